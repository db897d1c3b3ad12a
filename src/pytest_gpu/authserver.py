"""An authenticated Unix-socket service: many clients, one serving thread, handshakes apart.

The transport of the run's lease service (:mod:`pytest_gpu.leasing.broker`), and nothing
of leases: :mod:`multiprocessing.connection` over a Unix socket in a private 0700
directory, authenticated with a random key. A subclass says what a message means
(:meth:`AuthServer._receive`) and what a client that went away leaves behind
(:meth:`AuthServer._disconnect`).

One thread serves every authenticated connection as its messages arrive (one epoll over
all sockets, no thread switch per message). The key's challenge and answer
(:func:`multiprocessing.connection.deliver_challenge`) run in a short-lived thread per new
connection, never on the accept thread nor on the serving one, and within
``handshake_timeout`` seconds: a process that connects and then sends nothing, half a frame
or a wrong answer is shut out on its own while everyone else connects and is served as usual.

A client process that dies, for any reason, has its end of the socket closed by the
kernel: ``recv`` raises and :meth:`AuthServer._disconnect` is called at once, no polling.
"""

from __future__ import annotations

import os
import selectors
import socket
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Generic, TypeVar

ClientT = TypeVar("ClientT")  # what the subclass keeps per authenticated connection
_S = TypeVar("_S", bound="AuthServer")  # type: ignore[type-arg]


@dataclass(eq=False)
class Handshake:
    """A connection whose authentication is under way (in its own thread)."""

    sock: socket.socket  # a second descriptor of the connection's socket: what the accept thread shuts down
    conn: Connection
    deadline: float
    state: str = "pending"  # -> "done" (its thread finished) or "expired" (shut down at the deadline)


HANDSHAKE_TIMEOUT = 5.0  # seconds a new connection has to answer the key's challenge
MAX_HANDSHAKES = 64  # handshakes under way at once; more connections wait in the backlog meanwhile
BACKLOG = 128


class AuthServer(Generic[ClientT]):
    """The listener, the handshakes and the serving thread; start with :meth:`start`, stop
    with :meth:`close`.

    ``_lock`` (re-entrant) guards the handshakes and new connections; a subclass guards its
    own state with it too. The serving thread calls :meth:`_receive` for each message and
    :meth:`_disconnect` for each client still connected when it stops.
    """

    thread_prefix = "pytest-gpu-service"  # the threads' names: <prefix>-accept, <prefix>-serve

    def __init__(self, address: str, authkey: bytes, handshake_timeout: float = HANDSHAKE_TIMEOUT) -> None:
        self.address = address
        self.authkey = authkey
        self.handshake_timeout = handshake_timeout
        self._lock = threading.RLock()
        self._closing = False
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._incoming: list[Connection] = []
        self._handshakes: set[Handshake] = set()  # under self._lock
        self._wake_r = self._wake_w = -1
        self._accept_wake_r = self._accept_wake_w = -1
        self._pipes_lock = threading.Lock()  # a wake-up pipe is never written once closed (its fd reused)
        self._selector: selectors.BaseSelector | None = None

    # -- what a subclass says -------------------------------------------------------------

    def _receive(self, conn: Connection, conns: dict[Connection, ClientT | None]) -> bool:
        """Handle one message from ``conn`` (``conns[conn]``: its client, ``None`` before
        the subclass made one); ``False`` once the connection is gone (:meth:`_drop` it)."""
        raise NotImplementedError

    def _disconnect(self, client: ClientT) -> None:
        """``client``'s connection is gone (closed, its process died, or the service stops)."""
        raise NotImplementedError

    # -- lifecycle ------------------------------------------------------------------------

    def start(self: _S) -> _S:
        """Listen at ``address`` (mode 0600) and start the accept and serving threads."""
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
            thread = threading.Thread(target=target, name=f"{self.thread_prefix}-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def close(self) -> None:
        """Stop both threads: every connection is closed and its client disconnected."""
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
        conns: dict[Connection, ClientT | None] = {}
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

    def _drop(self, conn: Connection, conns: dict[Connection, ClientT | None]) -> None:
        del conns[conn]
        try:
            if self._selector is not None:  # set by _serve_loop, the only caller
                self._selector.unregister(conn.fileno())
        except (KeyError, ValueError, OSError):
            pass
        conn.close()
