"""The test-process side of the broker: ask for GPUs and ports, give them back.

Over :class:`pytest_gpu.wire.client.Client`, read in the calling thread (no thread of its
own): the messages are :data:`pytest_gpu.leasing.protocol.BROKER`, every answer and event
checked on arrival.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from typing import Any

from ..base.requests import GpuRequest, format_size
from ..machine.messages import request_to_wire
from ..wire.client import Client, Closed, Garbled
from ..wire.frames import WireError
from ..wire.schema import Refused
from .protocol import BROKER, MAX_FRAME, LeaseMessage


class BrokerError(RuntimeError):
    """The broker refused a request or went away."""


class _GaveBack(Exception):
    """A refused request's ``on_wait`` gave leases back: ask again (internal to acquire)."""


class WaitTimeout(BrokerError):
    """A request waited longer than ``--gpu-wait-timeout``."""


@dataclass(frozen=True)
class Grant:
    """What the broker granted (a :class:`~pytest_gpu.leasing.protocol.LeaseMessage`):
    physical GPU indices and memory per GPU."""

    key: str
    indices: tuple[int, ...]
    memory: int
    exclusive: bool
    waited: float

    @classmethod
    def from_wire(cls, body: LeaseMessage | dict[str, Any], waited: float | None = None) -> Grant:
        """``waited``: as this process measured it, in place of the broker's figure."""
        return cls(
            key=str(body["key"]),
            indices=tuple(body["indices"]),
            memory=int(body["memory"]),
            exclusive=bool(body["exclusive"]),
            waited=float(body["waited"] if waited is None else waited),
        )


class BrokerClient:
    """One connection per process; calls are serialised (one wait at a time).

    A call abandoned half-way (pytest-timeout's signal method raising inside the wait, a
    KeyboardInterrupt) leaves the connection usable: an abandoned acquire is withdrawn at
    the broker (``abandon``: dropped from the queue, or released if it was granted
    meanwhile), an event that still arrives for it is discarded, and the answer of an
    interrupted call is skipped when it comes (answers name their call). Only an
    interruption in the middle of a message (a few microseconds of copying, never the
    wait) leaves the stream in doubt: then the connection is closed, the broker takes back
    everything this process held (as after a crash), and the next call connects afresh.
    """

    def __init__(self, address: str, authkey: bytes, worker: str) -> None:
        self._address = address
        self._authkey = authkey
        # re-entrant: an acquire's on_wait may give leases back through this client while it waits
        self._lock = threading.RLock()
        self._keys = itertools.count()
        self._pushed: dict[str, tuple[str, Any]] = {}  # acquire key -> its granted or refused event
        self._abandoned: set[str] = set()  # acquire keys given up on: an event for them is dropped
        self.worker = worker
        self._conn: Client | None = None
        self._closed = False
        self._connect()

    def _connect(self) -> None:
        try:
            conn = Client(
                self._address,
                BROKER,
                key=self._authkey,
                limit=MAX_FRAME,
                max_brackets=None,
                max_request=MAX_FRAME,
                on_event=self._stash,
            )
        except (OSError, EOFError, AuthenticationError) as exc:  # a wrong key is refused: BrokerError too
            raise BrokerError(f"cannot reach the pytest-gpu broker at {self._address}: {exc}") from None
        self._conn = conn
        self._pushed.clear()
        self._abandoned.clear()
        self.client_id = self._call("hello", worker=self.worker, pid=os.getpid())["client"]

    def _broken(self) -> None:
        """The stream is in doubt (interrupted mid-message) or gone: drop the connection; the
        broker takes everything back, and the next call reconnects."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _connection(self) -> Client:
        if self._conn is None or self._conn.lost is not None:
            self._broken()
            if self._closed:
                raise BrokerError("the connection to the pytest-gpu broker was closed")
            self._connect()
        assert self._conn is not None
        return self._conn

    def close(self) -> None:
        self._closed = True
        self._broken()

    def _lost(self, exc: BaseException) -> BrokerError:
        self._broken()
        return BrokerError(f"lost the connection to the pytest-gpu broker: {exc}")

    def _stash(self, kind: str, body: dict[str, Any]) -> None:
        """Keep an event for its acquire, or drop it if that acquire was abandoned (the broker
        takes such a late grant back itself: it handles ``abandon`` after sending it)."""
        key = body["key"]
        if key in self._abandoned:
            self._abandoned.discard(key)
        else:
            self._pushed[key] = (kind, body)

    def _call(self, kind: str, **fields: Any) -> Any:
        conn = self._connection()
        try:
            return conn.call(kind, fields)
        except Refused as exc:
            raise BrokerError(str(exc)) from None
        except (Closed, Garbled) as exc:
            raise self._lost(exc) from None

    def _tell(self, kind: str, **fields: Any) -> None:
        conn = self._connection()
        try:
            conn.tell(kind, fields)
        except (Closed, WireError) as exc:
            raise self._lost(exc) from None

    def _pump(self, timeout: float | None) -> bool:
        try:
            return self._connection().pump(timeout)
        except (Closed, Garbled) as exc:
            raise self._lost(exc) from None

    # -- public API -----------------------------------------------------------------

    def acquire(
        self,
        request: GpuRequest,
        test: str,
        timeout: float | None,
        on_wait: Callable[[], object] | None = None,
        avoid: Collection[int] = (),
    ) -> Grant:
        """Block until the broker grants ``request``; raise :class:`WaitTimeout` after ``timeout``.

        ``on_wait`` is called once if the broker says the request must wait, before the wait
        (it may give leases back through this client: what it releases can then be granted),
        or refuses it (a hold-and-wait deadlock: it waits for what this process holds): if it
        then returns true (it gave something back), the request is asked once more.
        Abandoned by any other exception (pytest-timeout, KeyboardInterrupt), the request
        is withdrawn at the broker, and a grant that comes after all is given back at once.
        ``avoid``: GPUs the lease should not be on, where the run has others enough (see
        :meth:`pytest_gpu.leasing.broker.Broker.allowed`).
        """
        with self._lock:
            self._connection()
            while True:
                key = f"k{next(self._keys)}"
                try:
                    return self._acquire(key, request, test, timeout, on_wait, avoid)
                except _GaveBack:
                    on_wait = None  # refused, then on_wait gave leases back: asked once more
                except BrokerError:
                    raise  # refused, timed out (and cancelled) or disconnected: nothing left at the broker
                except BaseException:
                    self._abandon(key)
                    raise

    def _acquire(
        self,
        key: str,
        request: GpuRequest,
        test: str,
        timeout: float | None,
        on_wait: Callable[[], object] | None,
        avoid: Collection[int] = (),
    ) -> Grant:
        started = time.monotonic()
        extra: dict[str, Any] = {"avoid": sorted(avoid)} if avoid else {}
        kind, body = self._call("acquire", key=key, request=request_to_wire(request), test=test, **extra)
        if kind == "granted":
            return Grant.from_wire(body, 0.0)
        if kind == "refused":
            if on_wait is not None and on_wait():  # refused (waiting for what this process holds)
                raise _GaveBack
            raise BrokerError(str(body))
        if on_wait is not None:
            on_wait()  # queued: what it gives back is granted in order, while this request waits
        deadline = None if timeout is None else started + timeout
        while key not in self._pushed:
            left = None if deadline is None else deadline - time.monotonic()
            if (left is not None and left <= 0) or not self._pump(left):
                return self._give_up(key, request, timeout or 0.0, started)
        return self._take_push(key, started)

    def _abandon(self, key: str) -> None:
        """Withdraw an acquire given up on: whatever the broker did with it is undone."""
        if self._conn is None or self._conn.lost is not None:
            return  # disconnected: the broker has taken everything back already
        pushed = self._pushed.pop(key, None)
        try:  # one-way: it must not wait (a second interruption, a process on its way out)
            if pushed is None:
                self._abandoned.add(key)
                self._tell("abandon", key=key)
            elif pushed[0] == "granted":
                self._tell("release", key=key, contexts=None, left=None)
        except BrokerError:
            pass  # disconnected meanwhile: the broker took everything back; the caller's exception stands

    def _take_push(self, key: str, started: float) -> Grant:
        kind, body = self._pushed.pop(key)
        if kind == "refused":
            raise BrokerError(str(body["message"]))
        return Grant.from_wire(body, time.monotonic() - started)

    def _give_up(self, key: str, request: GpuRequest, timeout: float, started: float) -> Grant:
        kind, body = self._call("cancel", key=key)
        if kind == "not-waiting" and key in self._pushed:
            return self._take_push(key, started)  # granted just as we gave up: keep it
        holders = "unknown holders"
        if kind == "cancelled":
            holders = describe_holders(body)
        raise WaitTimeout(f"waited {timeout:g}s for {request.describe()} (--gpu-wait-timeout); {holders}")

    def release(
        self, key: str, contexts: set[int] | None = None, left: dict[int, tuple[int, str]] | None = None
    ) -> None:
        """Give a lease back. One-way: the broker handles this connection's messages in
        order, so anything this process asks next already sees the lease returned.

        ``left``: GPU index -> (bytes, who left them), what this process still holds of
        leases that ended, on every GPU where it holds some (``None``: as told last); the
        broker counts it as this process's until told otherwise or the process is gone."""
        with self._lock:
            if self._conn is None or self._conn.lost is not None:
                return  # the connection was dropped: the broker took this lease back then
            held = None if contexts is None else sorted(contexts)
            told = None if left is None else {int(i): [int(n), str(who)] for i, (n, who) in left.items()}
            self._tell("release", key=key, contexts=held, left=told)

    def context_size(self, index: int, nbytes: int) -> None:
        """Tell the broker one CUDA context on GPU ``index`` takes ``nbytes`` (measured);
        :class:`BrokerError` when it refuses the figure."""
        with self._lock:
            self._call("context_size", index=index, bytes=nbytes)

    def ports(self, n: int, owner: str) -> list[int]:
        with self._lock:
            return list(self._call("ports", n=n, owner=owner))

    def release_ports(self, owner: str) -> None:
        with self._lock:
            self._call("release_ports", owner=owner)

    def catalog(self, tests: dict[str, Any]) -> None:
        """Tell the controller's scheduler what this worker collected (before xdist does)."""
        with self._lock:
            self._call("catalog", tests=tests)

    def status(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._call("status"))


def describe_holders(holders: list[dict[str, Any]]) -> str:
    if not holders:
        return "no test held a GPU at that moment"
    parts = []
    for row in holders:
        if row.get("left"):  # what a process still holds of a lease that ended
            gpus = ",".join(map(str, row["gpus"]))
            parts.append(f"{format_size(row['memory'])} on GPU {gpus} left by {row['test']} ({row['worker']})")
            continue
        held = []
        if row["gpus"]:
            each = "whole GPU" if row["exclusive"] else format_size(row["memory"])
            held.append(f"GPU {','.join(map(str, row['gpus']))}, {each}")
        if row.get("cpus"):
            held.append(f"{row['cpus']} CPUs")
        if row.get("host_memory"):
            held.append(f"{format_size(row['host_memory'])} of host memory")
        parts.append(f"{row['test']} ({row['worker']}: {', '.join(held)})")
    return "held by " + "; ".join(parts)
