"""The test-process side of the broker: ask for GPUs and ports, give them back."""

from __future__ import annotations

import itertools
import os
import threading
import time
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection
from typing import Any

from .broker import describe_holders
from .requests import GpuRequest


class BrokerError(RuntimeError):
    """The broker refused a request or went away."""


class WaitTimeout(BrokerError):
    """A request waited longer than ``--gpu-wait-timeout``."""


@dataclass(frozen=True)
class Grant:
    """What the broker granted: physical GPU indices and memory per GPU."""

    key: str
    indices: tuple[int, ...]
    memory: int
    exclusive: bool
    waited: float


def _grant(body: dict[str, Any], waited: float | None = None) -> Grant:
    return Grant(
        key=str(body["key"]),
        indices=tuple(body["indices"]),
        memory=int(body["memory"]),
        exclusive=bool(body["exclusive"]),
        waited=float(body["waited"] if waited is None else waited),
    )


class BrokerClient:
    """One connection per process; calls are serialised (one wait at a time)."""

    def __init__(self, address: str, authkey: bytes, worker: str) -> None:
        try:
            self._conn: Connection = Client(address, family="AF_UNIX", authkey=authkey)
        except (OSError, EOFError, AuthenticationError) as exc:  # a wrong key is refused: BrokerError too
            raise BrokerError(f"cannot reach the pytest-gpu broker at {address}: {exc}") from None
        self._lock = threading.Lock()
        self._keys = itertools.count()
        self._pushed: dict[str, tuple[str, Any]] = {}
        self.worker = worker
        reply = self._call("hello", {"worker": worker, "pid": os.getpid()})
        self.client_id = reply[1]["client"]

    def close(self) -> None:
        try:
            self._conn.close()
        except OSError:
            pass

    def _recv(self, timeout: float | None = None) -> tuple[str, Any] | None:
        """Next message, stashing pushes; ``None`` on timeout."""
        if timeout is not None and not self._conn.poll(max(timeout, 0.0)):
            return None
        try:
            message = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise BrokerError(f"lost the connection to the pytest-gpu broker: {exc!r}") from None
        return message

    def _reply(self) -> tuple[str, Any]:
        while True:
            message = self._recv()
            assert message is not None
            if message[0].startswith("push-"):
                self._pushed[message[1]["key"]] = message
                continue
            return message

    def _send(self, kind: str, body: dict[str, Any]) -> None:
        try:
            self._conn.send((kind, body))
        except (OSError, EOFError) as exc:
            raise BrokerError(f"lost the connection to the pytest-gpu broker: {exc!r}") from None

    def _call(self, kind: str, body: dict[str, Any]) -> tuple[str, Any]:
        self._send(kind, body)
        return self._reply()

    # -- public API -----------------------------------------------------------------

    def acquire(self, request: GpuRequest, test: str, timeout: float | None) -> Grant:
        """Block until the broker grants ``request``; raise :class:`WaitTimeout` after ``timeout``."""
        with self._lock:
            key = f"k{next(self._keys)}"
            started = time.monotonic()
            kind, body = self._call(
                "acquire",
                {
                    "key": key,
                    "request": (request.count, request.memory, request.exclusive, request.min_memory),
                    "test": test,
                },
            )
            if kind == "granted":
                return _grant(body, 0.0)
            if kind == "error":
                raise BrokerError(str(body))
            deadline = None if timeout is None else started + timeout
            while key not in self._pushed:
                left = None if deadline is None else deadline - time.monotonic()
                message = self._recv(left) if left is None or left > 0 else None
                if message is None:
                    return self._give_up(key, request, timeout or 0.0, started)
                if message[0].startswith("push-"):
                    self._pushed[message[1]["key"]] = message
            return self._take_push(key, started)

    def _take_push(self, key: str, started: float) -> Grant:
        kind, body = self._pushed.pop(key)
        if kind == "push-error":
            raise BrokerError(str(body["message"]))
        return _grant(body, time.monotonic() - started)

    def _give_up(self, key: str, request: GpuRequest, timeout: float, started: float) -> Grant:
        kind, body = self._call("cancel", {"key": key})
        if kind == "not-waiting" and key in self._pushed:
            return self._take_push(key, started)  # granted just as we gave up: keep it
        holders = describe_holders(body.get("holders", [])) if kind == "cancelled" else "unknown holders"
        raise WaitTimeout(f"waited {timeout:g}s for {request.describe()} (--gpu-wait-timeout); {holders}")

    def release(self, key: str, contexts: set[int] | None = None) -> None:
        """Give a lease back. One-way: the broker handles this connection's messages in
        order, so anything this process asks next already sees the lease returned."""
        with self._lock:
            self._send("release", {"key": key, "contexts": None if contexts is None else sorted(contexts)})

    def report_contexts(self, indices: set[int]) -> None:
        with self._lock:
            self._call("contexts", {"indices": sorted(indices)})

    def set_test(self, nodeid: str | None) -> None:
        """Tell the broker which test runs now, so a crash report can name it."""
        with self._lock:
            self._call("test", {"nodeid": nodeid})

    def ports(self, n: int, owner: str) -> list[int]:
        with self._lock:
            kind, body = self._call("ports", {"n": n, "owner": owner})
        if kind == "error":
            raise BrokerError(str(body))
        return list(body)

    def release_ports(self, owner: str) -> None:
        with self._lock:
            self._call("release_ports", {"owner": owner})

    def catalog(self, tests: dict[str, Any]) -> None:
        """Tell the controller's scheduler what this worker collected (before xdist does)."""
        with self._lock:
            self._call("catalog", {"tests": tests})

    def status(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._call("status", {})[1])
