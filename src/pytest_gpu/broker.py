"""The lease service: one per run, hands out GPUs and ports to the test processes.

Transport: :mod:`multiprocessing.connection` over a Unix socket in the run's private
0700 directory, authenticated with a random key.
One thread serves every authenticated connection as its messages arrive; decisions are
made by :class:`pytest_gpu.placement.Pool` under one lock.

The key's challenge and answer (:func:`multiprocessing.connection.deliver_challenge`)
run in a short-lived thread per new connection, never on the accept thread nor on the
serving one, and within ``handshake_timeout`` seconds: a process that connects and then
sends nothing, half a frame or a wrong answer is shut out on its own while everyone else
connects and is served as usual.

Crash safety comes from the kernel: when a client process dies, for any reason, its end
of the socket is closed, ``recv`` raises, and everything it held (leases, queued
requests, ports, assumed contexts) is returned at once and recorded for the report.
There are no polling loops: a waiting request is answered the moment a release makes
room for it.

Protocol (pickled tuples; every message gets exactly one reply, in order, except that
a queued ``acquire`` is later followed by a ``push-granted`` or ``push-error`` for its key,
and that ``abandon`` and ``release`` get none):

    ("hello", {"worker", "pid"})                 -> ("ok", {"client"})
    ("acquire", {"key", "request", "test"})      -> ("granted", lease) | ("queued", key) | ("error", message)
    ("cancel", {"key"})                          -> ("cancelled", {"holders"}) | ("not-waiting", {})
    ("abandon", {"key"})                         -> no reply (one-way)
    ("release", {"key", "contexts"})             -> no reply (one-way)
    ("ports", {"n", "owner"})                    -> ("ports", [int]) | ("error", message)
    ("release_ports", {"owner"})                 -> ("ok", {})
    ("contexts", {"indices"})                    -> ("ok", {})
    ("status", {})                               -> ("status", dict)
    ("catalog", {"tests"})                       -> ("ok", {})   (an xdist worker's collection, for the scheduler)

``abandon`` withdraws an ``acquire`` its test gave up on while waiting (pytest-timeout
raising in the wait, a KeyboardInterrupt): still queued, it is dropped; granted meanwhile
(its ``push-granted`` possibly on its way), the lease is released at once, as if by
``release``; already gone, nothing happens. It is idempotent and never waits, so it can
be sent from an exception handler; the client discards a push that still arrives for an
abandoned key (the broker handles it in order, after any push it sent for that key).
"""

from __future__ import annotations

import itertools
import os
import select
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

from .placement import Lease, Policy, Pool, Unsatisfiable
from .ports import DEFAULT_RANGE, PortPool
from .requests import GpuRequest, format_size


@dataclass
class ClientInfo:
    client: str
    worker: str
    pid: int
    conn: Connection
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    tests: dict[str, str] = field(default_factory=dict)  # lease key -> test node id
    current_test: str | None = None

    def send(self, message: tuple[str, Any]) -> None:
        with self.send_lock:
            try:
                self.conn.send(message)
            except OSError:
                pass  # the reader thread sees the disconnect and cleans up


@dataclass(frozen=True)
class CrashRecord:
    """A client that went away while holding something."""

    worker: str
    pid: int
    test: str | None
    gpus: tuple[int, ...]
    ports: tuple[int, ...]
    at: float


@dataclass(eq=False)
class Handshake:
    """A connection whose authentication is under way (in its own thread)."""

    sock: socket.socket  # a second descriptor of the connection's socket: what the accept thread shuts down
    conn: Connection
    deadline: float
    state: str = "pending"  # -> "done" (its thread finished) or "expired" (shut down at the deadline)


def lease_message(lease: Lease, waited: float) -> dict[str, Any]:
    return {
        "key": lease.key.split("/", 1)[1],
        "indices": list(lease.placement.indices),
        "memory": lease.placement.memory,
        "exclusive": lease.placement.exclusive,
        "waited": waited,
    }


HANDSHAKE_TIMEOUT = 5.0  # seconds a new connection has to answer the key's challenge
MAX_HANDSHAKES = 64  # handshakes under way at once; more connections wait in the backlog meanwhile
BACKLOG = 128


class Broker:
    """Owns the pool and the listener; start with :meth:`start`, stop with :meth:`close`."""

    def __init__(
        self,
        capacities: dict[int, int],
        address: str,
        authkey: bytes,
        policy: Policy | None = None,
        port_range: tuple[int, int] = DEFAULT_RANGE,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
    ) -> None:
        self.pool = Pool(capacities, policy)
        self.ports = PortPool(port_range)
        self.address = address
        self.authkey = authkey
        self.handshake_timeout = handshake_timeout
        self.crashes: list[CrashRecord] = []
        self.grants = 0
        self.catalog: dict[str, Any] = {}  # node id -> what the scheduler needs (see catalog.py)
        self._lock = threading.Lock()
        self._clients: dict[str, ClientInfo] = {}
        self._queued_at: dict[str, float] = {}
        self._ids = itertools.count()
        self._closing = False
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._incoming: list[Connection] = []
        self._handshakes: set[Handshake] = set()  # under self._lock
        self._wake_r = self._wake_w = -1
        self._accept_wake_r = self._accept_wake_w = -1
        self._pipes_lock = threading.Lock()  # a wake-up pipe is never written once closed (its fd reused)
        self._selector: selectors.BaseSelector | None = None

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> Broker:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(self.address)
            os.chmod(self.address, 0o600)
            listener.listen(BACKLOG)
            listener.setblocking(False)  # accept() only when epoll says so, and never wait in it
        except OSError:
            listener.close()
            raise
        self._listener = listener
        self._wake_r, self._wake_w = os.pipe()
        self._accept_wake_r, self._accept_wake_w = os.pipe()
        for fd in (self._wake_w, self._accept_wake_w):
            os.set_blocking(fd, False)  # a full pipe already means "wake up"
        for target, name in ((self._accept_loop, "accept"), (self._serve_loop, "serve")):
            thread = threading.Thread(target=target, name=f"pytest-gpu-broker-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def close(self) -> None:
        self._closing = True
        self._wake()
        self._wake_accept()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=5)

    def _wake(self) -> None:
        """Wake the serving thread (new connections, closing)."""
        with self._pipes_lock:
            if self._wake_w >= 0:
                try:
                    os.write(self._wake_w, b"x")
                except OSError:
                    pass

    def _wake_accept(self) -> None:
        """Wake the accept thread (a handshake slot is free, closing)."""
        with self._pipes_lock:
            if self._accept_wake_w >= 0:
                try:
                    os.write(self._accept_wake_w, b"x")
                except OSError:
                    pass

    def _close_pipe(self, which: str) -> None:
        with self._pipes_lock:
            fds = getattr(self, f"{which}_r"), getattr(self, f"{which}_w")
            setattr(self, f"{which}_r", -1)
            setattr(self, f"{which}_w", -1)
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass

    # -- accepting and authenticating ---------------------------------------------------

    def _accept_loop(self) -> None:
        """Accept connections and start a handshake thread for each; shut down those that
        have not authenticated by their deadline. Never reads from a client itself."""
        assert self._listener is not None
        listener = self._listener
        selector = selectors.DefaultSelector()
        selector.register(self._accept_wake_r, selectors.EVENT_READ, None)
        listening = False
        try:
            while not self._closing:
                with self._lock:
                    now = time.monotonic()
                    for handshake in [h for h in self._handshakes if h.deadline <= now]:
                        self._expire_locked(handshake)
                    room = len(self._handshakes) < MAX_HANDSHAKES
                    deadline = min((h.deadline for h in self._handshakes), default=None)
                if room != listening:  # at the limit, new connections wait in the kernel's backlog
                    if room:
                        selector.register(listener, selectors.EVENT_READ, listener)
                    else:
                        selector.unregister(listener)
                    listening = room
                timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                for key, _ in selector.select(timeout):
                    if key.data is None:
                        os.read(self._accept_wake_r, 4096)
                    elif not self._closing:
                        self._accept_one(listener)
        finally:
            selector.close()
            listener.close()
            try:
                os.unlink(self.address)
            except OSError:
                pass
            with self._lock:
                for handshake in list(self._handshakes):
                    self._expire_locked(handshake)
            self._close_pipe("_accept_wake")

    def _accept_one(self, listener: socket.socket) -> None:
        try:
            sock, _ = listener.accept()
        except BlockingIOError:
            return  # it went away meanwhile
        except OSError:
            time.sleep(0.01)  # e.g. out of file descriptors: do not spin, try again
            return
        try:
            sock.setblocking(True)
            conn = Connection(os.dup(sock.fileno()))
        except OSError:
            sock.close()
            return
        handshake = Handshake(sock, conn, time.monotonic() + self.handshake_timeout)
        with self._lock:
            self._handshakes.add(handshake)
        thread = threading.Thread(target=self._authenticate, args=(handshake,), name="pytest-gpu-auth", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # cannot start a thread: refuse this one
            with self._lock:
                self._handshakes.discard(handshake)
            sock.close()
            conn.close()

    def _authenticate(self, handshake: Handshake) -> None:
        """The key's challenge, both ways, as :class:`multiprocessing.connection.Listener`
        does it; the accept thread shuts the socket down at the deadline, which ends it."""
        conn = handshake.conn
        try:
            deliver_challenge(conn, self.authkey)
            answer_challenge(conn, self.authkey)
            ok = True
        except Exception:  # wrong key, EOF, garbage, shut down at the deadline: drop it alone
            ok = False
        with self._lock:
            ok = ok and handshake.state == "pending" and not self._closing
            if handshake.state == "pending":
                handshake.state = "done"
            was_full = len(self._handshakes) >= MAX_HANDSHAKES
            self._handshakes.discard(handshake)
            if ok:
                self._incoming.append(conn)
        handshake.sock.close()  # the spare descriptor only; the connection lives on in ``conn``
        if ok:
            self._wake()
        else:
            conn.close()
        if was_full:
            self._wake_accept()  # a slot is free again: accept the next connection

    def _expire_locked(self, handshake: Handshake) -> None:
        if handshake.state != "pending":
            return
        handshake.state = "expired"
        self._handshakes.discard(handshake)
        try:  # wakes its thread's blocked read or write; the thread then closes the connection
            handshake.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    # -- all clients, one thread ------------------------------------------------------

    def _serve_loop(self) -> None:
        """Serve every connection from one thread: a message is handled as soon as it
        arrives (one epoll over all sockets), with no thread switch per request."""
        conns: dict[Connection, ClientInfo | None] = {}
        selector = self._selector = selectors.DefaultSelector()  # epoll: registered once, not per message
        selector.register(self._wake_r, selectors.EVENT_READ, None)
        try:
            while not self._closing:
                for key, _ in selector.select():
                    conn = key.data
                    if conn is None:
                        os.read(self._wake_r, 4096)
                        with self._lock:
                            incoming, self._incoming = self._incoming, []
                        for new in incoming:
                            conns[new] = None
                            selector.register(new.fileno(), selectors.EVENT_READ, new)
                        continue
                    # drain what is already buffered too: one wake-up, many messages
                    while self._receive(conn, conns) and conn.poll(0):
                        pass
        finally:
            selector.close()
            for conn, info in conns.items():
                if info is not None:
                    self._disconnect(info)
                try:
                    conn.close()
                except OSError:
                    pass
            with self._lock:
                for conn in self._incoming:
                    conn.close()
            self._close_pipe("_wake")

    def _drop(self, conn: Connection, conns: dict[Connection, ClientInfo | None]) -> None:
        del conns[conn]
        try:
            self._selector.unregister(conn.fileno())
        except (KeyError, ValueError, OSError):
            pass
        conn.close()

    def _receive(self, conn: Connection, conns: dict[Connection, ClientInfo | None]) -> bool:
        """Handle one message from ``conn``; ``False`` once the connection is gone."""
        info = conns[conn]
        try:
            kind, body = conn.recv()
        except (EOFError, OSError):
            # the process closed its end or died (the kernel closed it): take everything back
            self._drop(conn, conns)
            if info is not None:
                self._disconnect(info)
            return False
        if info is None:
            if kind != "hello":
                self._drop(conn, conns)
                return False
            info = ClientInfo(f"c{next(self._ids)}", str(body.get("worker", "?")), int(body.get("pid", 0)), conn)
            with self._lock:
                self._clients[info.client] = info
            conns[conn] = info
            info.send(("ok", {"client": info.client}))
            return True
        try:
            reply = self._handle(info, kind, body)
        except Exception as exc:  # a bug here must not stop the service for every worker
            reply = ("error", f"pytest-gpu broker failed on {kind!r}: {exc!r}")
        if reply is not None:  # "release" and "abandon" are one-way: a grant costs one round trip
            info.send(reply)
        return True

    def _handle(self, info: ClientInfo, kind: str, body: dict[str, Any]) -> tuple[str, Any] | None:
        if kind == "acquire":
            return self._acquire(info, body)
        if kind == "cancel":
            key = f"{info.client}/{body['key']}"
            with self._lock:
                if self.pool.cancel(key):
                    self._queued_at.pop(key, None)
                    info.tests.pop(key, None)
                    holders = self._holders_locked()
                    self._push_locked(self.pool.serve())  # what waited behind it may fit now
                    return ("cancelled", {"holders": holders})
            return ("not-waiting", {})
        if kind == "abandon":
            key = f"{info.client}/{body['key']}"
            with self._lock:
                info.tests.pop(key, None)
                self._queued_at.pop(key, None)
                if self.pool.cancel(key):
                    granted = self.pool.serve()  # what waited behind it may fit now
                else:
                    granted = self.pool.release(key)  # granted meanwhile (or already gone: nothing)
                self._push_locked(granted)
            return None
        if kind == "release":
            key = f"{info.client}/{body['key']}"
            contexts = body.get("contexts")
            with self._lock:
                info.tests.pop(key, None)
                granted = self.pool.release(key, None if contexts is None else set(contexts))
                self._push_locked(granted)
            return None
        if kind == "ports":
            with self._lock:
                try:
                    got = self.ports.take(int(body["n"]), f"{info.client}/{body['owner']}")
                except RuntimeError as exc:
                    return ("error", str(exc))
            return ("ports", got)
        if kind == "release_ports":
            with self._lock:
                self.ports.give_back(f"{info.client}/{body['owner']}")
            return ("ok", {})
        if kind == "contexts":
            with self._lock:
                self.pool.set_contexts(info.client, set(body["indices"]))
                self._push_locked(self.pool.serve())
            return ("ok", {})
        if kind == "test":
            info.current_test = body.get("nodeid")
            return ("ok", {})
        if kind == "status":
            with self._lock:
                return ("status", self.status_locked())
        if kind == "catalog":
            with self._lock:
                self.catalog.update(body["tests"])
            return ("ok", {})
        return ("error", f"unknown request {kind!r}")

    def _acquire(self, info: ClientInfo, body: dict[str, Any]) -> tuple[str, Any]:
        count, memory, exclusive, min_memory = body["request"]
        request = GpuRequest(count=count, memory=memory, exclusive=exclusive, min_memory=min_memory)
        key = f"{info.client}/{body['key']}"
        with self._lock:
            info.tests[key] = str(body.get("test") or "?")
            self._queued_at[key] = time.monotonic()
            try:
                granted = self.pool.submit(key, info.client, request)
            except Unsatisfiable as exc:
                info.tests.pop(key, None)
                self._queued_at.pop(key, None)
                return ("error", str(exc))
            mine = [lease for lease in granted if lease.key == key]
            self._send_grants_locked([lease for lease in granted if lease.key != key])
            blocked = self._blocked_locked()
            refusal = blocked.pop(key, None)
            if refusal is not None:
                self.pool.cancel(key)
                info.tests.pop(key, None)
                self._queued_at.pop(key, None)
            for other_key, message in blocked.items():
                self._reject_locked(other_key, message)
            if blocked or refusal is not None:  # the queue shrank: serve again
                again = self.pool.serve()
                mine = mine or [lease for lease in again if lease.key == key]
                self._push_locked([lease for lease in again if lease.key != key])
            if refusal is not None:
                return ("error", refusal)
            if mine:
                self.grants += 1
                self._queued_at.pop(key, None)
                return ("granted", lease_message(mine[0], 0.0))
            return ("queued", body["key"])

    # -- shared helpers (call with self._lock held) -----------------------------------

    def _push_locked(self, granted: list[Lease]) -> None:
        """After a change: send the new grants, turn away what can never be placed, and
        serve again while turning requests away lets others through (the queue shrank)."""
        while True:
            self._send_grants_locked(granted)
            blocked = self._blocked_locked()
            for key, message in blocked.items():
                self._reject_locked(key, message)
            if not blocked:
                return
            granted = self.pool.serve()

    def _send_grants_locked(self, granted: list[Lease]) -> None:
        now = time.monotonic()
        for lease in granted:
            info = self._clients.get(lease.client)
            waited = now - self._queued_at.pop(lease.key, now)
            self.grants += 1
            if info is not None:
                info.send(("push-granted", lease_message(lease, waited)))

    def _blocked_locked(self) -> dict[str, str]:
        """Waiting requests that cannot be placed even if every lease came back."""
        found = {}
        for waiting in self.pool.queue:
            reason = self.pool.blocked_forever(waiting)
            if reason:
                found[waiting.key] = reason
        return found

    def _reject_locked(self, key: str, message: str) -> None:
        self.pool.cancel(key)
        self._queued_at.pop(key, None)
        client = key.split("/", 1)[0]
        info = self._clients.get(client)
        if info is not None:
            info.tests.pop(key, None)
            info.send(("push-error", {"key": key.split("/", 1)[1], "message": message}))

    def _holders_locked(self) -> list[dict[str, Any]]:
        rows = []
        for lease in self.pool.leases.values():
            info = self._clients.get(lease.client)
            rows.append(
                {
                    "test": info.tests.get(lease.key, "?") if info else "?",
                    "worker": info.worker if info else "?",
                    "gpus": list(lease.placement.indices),
                    "memory": lease.placement.memory,
                    "exclusive": lease.placement.exclusive,
                }
            )
        return rows

    def _disconnect(self, info: ClientInfo) -> None:
        with self._lock:
            self._clients.pop(info.client, None)
            # The process keeps its CUDA contexts until it exits, which may be a while after
            # it closed its connection (a worker shutting down): keep counting them till then.
            contexts = {i for i, gpu in self.pool.gpus.items() if info.client in gpu.contexts}
            if contexts and not self._closing:
                self._hold_contexts_until_exit(info, contexts)
            held, granted = self.pool.forget_client(info.client)
            # port owners are "<test node id>@<pid>" (see lifecycle.ports_fixture)
            mine = [o.split("/", 1)[1] for o in self.ports.owners.values() if o.startswith(f"{info.client}/")]
            port_tests = sorted({o.rsplit("@", 1)[0] for o in mine})
            ports = self.ports.give_back_prefix(f"{info.client}/")
            for key in [k for k in self._queued_at if k.startswith(f"{info.client}/")]:
                del self._queued_at[key]
            if (held or ports) and not self._closing:
                tests = sorted({info.tests.get(lease.key, "?") for lease in held})
                test = ", ".join(tests) if tests else info.current_test or ", ".join(port_tests) or None
                gpus = tuple(sorted({i for lease in held for i in lease.placement.indices}))
                self.crashes.append(CrashRecord(info.worker, info.pid, test, gpus, tuple(sorted(ports)), time.time()))
            self._push_locked(granted)

    def _hold_contexts_until_exit(self, info: ClientInfo, contexts: set[int]) -> None:
        """Count ``info``'s contexts under a stand-in client until its process has exited.

        Waits on a pidfd (readable once the process has terminated; it does not reap it),
        so no polling. Without pidfds (not Linux) the contexts are dropped at once.
        """
        if info.pid <= 0 or info.pid == os.getpid() or not hasattr(os, "pidfd_open"):
            return
        try:
            fd = os.pidfd_open(info.pid)
        except OSError:
            return  # already gone
        stand_in = f"{info.client}~exiting"
        self.pool.set_contexts(stand_in, contexts)
        self.pool.exiting.add(stand_in)

        def wait() -> None:
            try:
                select.select([fd], [], [])
            finally:
                os.close(fd)
            with self._lock:
                self.pool.set_contexts(stand_in, set())
                self.pool.exiting.discard(stand_in)
                self._push_locked(self.pool.serve())

        threading.Thread(target=wait, name=f"pytest-gpu-exit-{info.pid}", daemon=True).start()

    def status_locked(self) -> dict[str, Any]:
        return {
            "clients": {c.client: {"worker": c.worker, "pid": c.pid} for c in self._clients.values()},
            "leases": self._holders_locked(),
            "waiting": [
                {"key": w.key, "request": w.request.describe(), "bypassed": w.bypassed} for w in self.pool.queue
            ],
            "ports": dict(self.ports.owners),
            "used": {i: self.pool.used(i) for i in self.pool.gpus},
            "contexts": {i: sorted(g.contexts) for i, g in self.pool.gpus.items()},
            "grants": self.grants,
            "crashes": [c.__dict__ for c in self.crashes],
        }

    def status(self) -> dict[str, Any]:
        with self._lock:
            return self.status_locked()

    def room(self) -> list[int]:
        """What each GPU can give leases now that its CUDA contexts are counted (at least one)."""
        overhead = self.pool.policy.overhead
        with self._lock:
            return [
                max(gpu.capacity - overhead * max(1, len(gpu.contexts)), 0) for _, gpu in sorted(self.pool.gpus.items())
            ]


def describe_holders(holders: list[dict[str, Any]]) -> str:
    if not holders:
        return "no test held a GPU at that moment"
    parts = []
    for row in holders:
        each = "whole GPU" if row["exclusive"] else format_size(row["memory"])
        parts.append(f"{row['test']} ({row['worker']}: GPU {','.join(map(str, row['gpus']))}, {each})")
    return "held by " + "; ".join(parts)
