"""A run's way to the machine's arbiter: be it, or attach to it; and take over when it goes.

The first run to need a GPU takes the domain's lock (``flock`` on ``arbiter.lock``) and
is the arbiter: it decides in-process, at no extra cost, and serves the other runs on an
abstract Unix socket (:mod:`.server`). The others connect there. Whoever holds the lock
is the arbiter, and the kernel releases the lock when its process exits, SIGKILL
included, so there is never a second arbiter nor a lock left behind.

When the arbiter's run ends (or dies), its socket closes and every other run elects
again: one takes the lock, the rest connect to it, and each brings what it holds and
waits for (the mirror of its own run it keeps, :mod:`.mirror`). The new arbiter grants
nothing until every run that is still alive (its ``runs/<id>.lock`` is still locked)
has re-attached, or ``RESUME_AFTER_S`` has passed, so nothing held is promised twice.
A run that is not the arbiter reaches it over :mod:`.remote`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import queue
import secrets
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from ..leasing.placement import Policy
from ..leasing.requests import GpuRequest
from .arbiter import Arbiter, Asked, Event, ForeignSource, Sink
from .domain import Domain, make_shared, user_name
from .mirror import Mirror, to_wire
from .remote import Lost, MachineError, Remote
from .server import ArbiterServer
from .wire import request_to_wire

ELECT_TIMEOUT_S = 10.0


def _live_runs(domain: Domain, exclude: str) -> set[str]:
    """Runs whose membership lock is held (they are alive), but ``exclude``."""
    live: set[str] = set()
    try:
        entries = list(domain.runs_path.glob("*.lock"))
    except OSError:
        return live
    for path in entries:
        run = path.name[: -len(".lock")]
        if run == exclude:
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            live.add(run)
        except OSError:
            pass
        else:
            if path.stat().st_uid == os.getuid():
                with contextlib.suppress(OSError):
                    path.unlink()  # left by a dead run of ours
        finally:
            os.close(fd)
    return live


_links: weakref.WeakSet[MachineLink] = weakref.WeakSet()


def _forget_in_child() -> None:
    """After ``fork()``: a child (a test's ``multiprocessing`` worker, say) must hold none of
    the run's locks or sockets, or it would keep the run "alive" and the arbiter's lock and
    address taken after the run is gone. Only the child's copies are closed."""
    for link in list(_links):
        link._forget_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


class MachineLink:
    """This run's side of machine-wide leasing (see the module doc).

    Its methods are the :class:`~.arbiter.Arbiter`'s for this run; :meth:`attach` must
    come first. Thread-safe.
    """

    def __init__(
        self,
        domain: Domain | Callable[[], Domain] | None,
        policy: Policy | None = None,
        *,
        label: str = "",
        foreign: ForeignSource | None = None,
        run: str | None = None,
    ) -> None:
        # a callable is asked on attach: a run that never needs a GPU never touches the machine dir
        self._domain = domain
        self.domain: Domain | None = domain if isinstance(domain, Domain) else None
        self.policy = policy or Policy()
        self.label = label or f"pytest in {os.getcwd()}"
        self.foreign = foreign
        self.run = run or f"{os.getpid()}-{secrets.token_hex(3)}"
        self.failovers = 0
        # _lock: calls and failovers, one at a time (held across I/O); the mirror has its
        # own, never held across I/O (the reader thread takes it to file events)
        self._lock = threading.RLock()
        self._gpus: dict[str, int] = {}
        self._host: tuple[int, int] | None = None  # this run's view of the machine's CPUs and RAM
        self._sink: Sink | None = None
        self._arbiter: Arbiter | None = None  # when this run is the arbiter
        self._server: ArbiterServer | None = None
        self._remote: Remote | None = None
        self._lock_fd = -1
        self._member_fd = -1
        self._attached = False
        self._closed = False
        self._mirror = Mirror()  # what this run holds and waits for, to bring to a new arbiter
        self._events: queue.SimpleQueue[list[Event] | None] = queue.SimpleQueue()
        self._dispatcher: threading.Thread | None = None
        _links.add(self)

    def _forget_in_child(self) -> None:
        for fd in (self._lock_fd, self._member_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._lock_fd = self._member_fd = -1
        if self._server is not None:
            self._server.forget_in_child()
        if self._remote is not None:
            with contextlib.suppress(OSError):
                os.close(self._remote.sock.detach())
        self._server = self._remote = self._arbiter = None
        self._closed = True  # the child is no run: close() does nothing there

    @property
    def is_arbiter(self) -> bool:
        return self._arbiter is not None

    # -- joining ------------------------------------------------------------------------

    def attach(self, gpus: dict[str, int], sink: Sink, host: tuple[int, int] | None = None) -> None:
        """Join the machine with these GPUs (UUID -> capacity) and this run's view of its
        CPUs and RAM (``host``, see :mod:`pytest_gpu.leasing.host`); ``sink`` gets this run's events."""
        with self._lock:
            if self._attached:
                return
            self._gpus, self._sink, self._host = dict(gpus), sink, host
            self._dispatcher = threading.Thread(
                target=self._dispatch_loop, name="pytest-gpu-machine-events", daemon=True
            )
            self._dispatcher.start()
            if callable(self._domain) and self.domain is None:
                self.domain = self._domain()
            if self.domain is None:  # a private pool: this run shares its GPUs with no one
                self._arbiter = Arbiter(self.policy, self.foreign)
                self._attach_here(self._arbiter)
            else:
                self._join_membership()
                self._elect_and_attach(expect=False)
            self._attached = True

    def _join_membership(self) -> None:
        assert self.domain is not None
        make_shared(self.domain.runs_path)  # every user's runs add their files there
        fd = os.open(self.domain.runs_path / f"{self.run}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        self._member_fd = fd

    def _elect_and_attach(self, expect: bool) -> None:
        assert self.domain is not None
        deadline = time.monotonic() + ELECT_TIMEOUT_S
        while True:
            if self._try_lead(expect):
                return
            try:
                remote = Remote(self.domain.address(), self._file_events, self._remote_lost)
            except OSError:
                if time.monotonic() > deadline:
                    raise MachineError(
                        f"pytest-gpu: no arbiter answers at {self.domain.path} and its lock is held; "
                        "is a process stuck holding it?"
                    ) from None
                time.sleep(0.005)  # the arbiter has the lock but is not listening yet, or is leaving
                continue
            try:
                self._attach_remote(remote)
            except Lost:
                remote.close()
                continue
            self._remote = remote
            return

    def _try_lead(self, expect: bool) -> bool:
        assert self.domain is not None
        fd = os.open(self.domain.lock_path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            if os.fstat(fd).st_uid == os.getuid():
                os.fchmod(fd, 0o666)  # other users' runs must be able to take it too
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        arbiter = Arbiter(self.policy, self.foreign)
        try:
            server = ArbiterServer(arbiter, self.domain.address())
        except OSError:  # the old arbiter's socket is not gone yet
            os.close(fd)
            return False
        # this run's leases are in the allocator before any other run can reach it (the server
        # starts last): nothing it holds can be promised to another run meanwhile
        if expect:
            arbiter.expect(_live_runs(self.domain, self.run))
        self._lock_fd, self._arbiter = fd, arbiter
        self._attach_here(arbiter)
        self._server = server.start()
        return True

    def _attach_here(self, arbiter: Arbiter) -> None:
        """This run joins the arbiter in its own process, with what it holds and waits for."""
        held, asked, contexts = self._mirror.snapshot()
        arbiter.attach(
            self.run,
            pid=os.getpid(),
            user=user_name(),
            label=self.label,
            gpus=self._gpus,
            sink=self._file_events,
            held=held,
            asked=asked,
            host=self._host,
        )
        for client, gpus in contexts.items():
            arbiter.set_contexts(self.run, client, gpus)

    def _attach_remote(self, remote: Remote) -> None:
        held, asked, contexts = self._mirror.snapshot()
        remote.call(
            "attach",
            run=self.run,
            pid=os.getpid(),
            user=user_name(),
            label=self.label,
            gpus=self._gpus,
            held=[to_wire(h) for h in held],
            asked=[to_wire(a) for a in asked],
            **({} if self._host is None else {"host": list(self._host)}),
        )
        for client, gpus in contexts.items():
            remote.call("set_contexts", client=client, contexts=gpus)

    def _remote_lost(self, remote: Remote) -> None:
        """The arbiter went away (its run ended or died): elect again, from the reader thread."""
        if remote is not self._remote:
            return  # a connection that never served (lost while attaching): its caller tries again
        with self._lock:
            if self._closed or remote is not self._remote:
                return  # closed, or another thread failed over already
            self._failover()

    def _failover(self) -> None:
        old, self._remote = self._remote, None
        if old is not None:
            old.closing = True
            old.close()
        self.failovers += 1
        self._elect_and_attach(expect=True)

    # -- events -------------------------------------------------------------------------

    def _file_events(self, events: list[Event]) -> None:
        """Events, from the arbiter in this process or the reader thread: the sink gets them
        on a thread of its own, which holds none of this link's locks (a sink may wait for
        its broker's lock, held by a thread that waits for this link)."""
        if self._arbiter is not None and not self._mirror.inflight:
            self._events.put(events)  # the arbiter's own run keeps no mirror
            return
        passed = self._mirror.file(events)
        if passed:
            self._events.put(passed)

    def _dispatch_loop(self) -> None:
        while True:
            events = self._events.get()
            if events is None:
                return
            if self._sink is not None:
                try:
                    self._sink(events)
                except Exception:
                    pass

    # -- calls --------------------------------------------------------------------------

    def _call(self, op: str, local: Callable[[Arbiter], Any], **fields: Any) -> Any:
        """``local(arbiter)`` when this run is the arbiter, else ``op`` over the socket;
        the arbiter lost on the way: elect again and ask the new one."""
        with self._lock:
            for _ in range(3):
                if self._arbiter is not None:
                    return local(self._arbiter)
                assert self._remote is not None, "attach() first"
                try:
                    return self._remote.call(op, **fields)
                except Lost:
                    self._failover()
            raise MachineError(f"pytest-gpu: the machine's arbiter kept going away during {op!r}")

    def _tell(self, op: str, local: Callable[[Arbiter], Any], **fields: Any) -> None:
        with self._lock:
            if self._arbiter is not None:
                local(self._arbiter)
            elif self._remote is not None:
                self._remote.tell(op, **fields)

    def submit(
        self, key: str, client: str, worker: str, test: str, request: GpuRequest, gpus: list[str]
    ) -> tuple[str, Any]:
        with self._lock:
            arbiter = self._arbiter
            if arbiter is not None:
                # the fast path of a run that is the arbiter: no mirror (it never re-declares)
                return arbiter.submit(self.run, key, client, worker, test, request, gpus)
            self._mirror.begin(key)
            try:
                kind, value = self._call(
                    "submit",
                    lambda a: a.submit(self.run, key, client, worker, test, request, gpus),
                    key=key,
                    client=client,
                    worker=worker,
                    test=test,
                    request=request_to_wire(request),
                    gpus=gpus,
                )
            finally:
                early = self._mirror.end(key)
            if kind == "queued" and early is not None:  # decided before the answer came
                kind, value = early[0], early[2] if early[0] == "granted" else early[2]["message"]
            if self._arbiter is None:  # still a follower: keep the mirror
                self._mirror.answered(Asked(key, client, worker, test, request, tuple(gpus)), kind, value)
            return kind, value

    def cancel(self, key: str) -> list[dict[str, Any]] | None:
        with self._lock:
            self._mirror.withdraw(key)
            holders: list[dict[str, Any]] | None = self._call("cancel", lambda a: a.cancel(self.run, key), key=key)
            return holders

    def abandon(self, key: str) -> None:
        with self._lock:
            self._mirror.drop(key)
            self._tell("abandon", lambda a: a.abandon(self.run, key), key=key)

    def release(self, key: str, contexts: list[str] | None = None) -> None:
        with self._lock:
            arbiter = self._arbiter
            if arbiter is not None:
                arbiter.release(self.run, key, contexts)
                return
            self._mirror.release(key, contexts)
            self._tell("release", lambda a: a.release(self.run, key, contexts), key=key, contexts=contexts)

    def set_contexts(self, client: str, contexts: list[str]) -> None:
        with self._lock:
            self._mirror.set_contexts(client, contexts)
            self._call(
                "set_contexts",
                lambda a: a.set_contexts(self.run, client, contexts),
                client=client,
                contexts=contexts,
            )

    def forget_client(self, client: str) -> list[tuple[str, tuple[str, ...]]]:
        with self._lock:
            self._mirror.forget_client(client)
            rows = self._call("forget_client", lambda a: a.forget_client(self.run, client), client=client)
            return [(str(k), tuple(g)) for k, g in rows]

    def exiting(self, client: str, contexts: list[str]) -> None:
        self._call("exiting", lambda a: a.exiting(self.run, client, contexts), client=client, contexts=contexts)

    def exited(self, client: str) -> None:
        self._call("exited", lambda a: a.exited(self.run, client), client=client)

    def room(self, gpus: list[str]) -> list[int]:
        return list(self._call("room", lambda a: a.room(gpus), gpus=gpus))

    def status(self) -> dict[str, Any]:
        return dict(self._call("status", lambda a: a.status()))

    # -- leaving ------------------------------------------------------------------------

    def close(self) -> None:
        """Leave the machine: what this run holds goes back; if it was the arbiter, the
        other runs elect a new one."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            # membership first: a new arbiter must not wait for this run to come back
            if self._member_fd >= 0 and self.domain is not None:
                with contextlib.suppress(OSError):
                    (self.domain.runs_path / f"{self.run}.lock").unlink()
                os.close(self._member_fd)
                self._member_fd = -1
            if self._server is not None:
                self._server.close()
            if self._arbiter is not None:
                self._arbiter.close()
            if self._lock_fd >= 0:
                os.close(self._lock_fd)  # the lock goes with it
                self._lock_fd = -1
            if self._remote is not None:
                self._remote.close()
            self._events.put(None)


def status(domain: Domain, timeout: float = 5.0) -> dict[str, Any] | None:
    """The machine's state from its arbiter, or ``None`` when no run is attached (no arbiter)."""
    if not domain.lock_path.exists():
        return None
    try:
        remote = Remote(domain.address(), lambda events: None, lambda lost: None)
    except OSError:
        return None
    try:
        remote.sock.settimeout(timeout)
        return dict(remote.call("status"))
    except Lost:
        return None
    finally:
        remote.close()

