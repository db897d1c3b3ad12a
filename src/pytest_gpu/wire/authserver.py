"""An authenticated Unix-socket service: many clients, one serving thread, handshakes apart.

The transport of the run's lease service (:mod:`pytest_gpu.leasing.broker`), and nothing
of leases: :mod:`multiprocessing.connection` over a Unix socket in a private 0700
directory, authenticated with a random key. A subclass says what a message means
(:meth:`AuthServer._receive`) and what a client that went away leaves behind
(:meth:`AuthServer._disconnect`).

One thread serves every authenticated connection as its messages arrive (one epoll over
all sockets, no thread switch per message). The key's challenge and answer, both ways, are
driven by the accept thread over non-blocking sockets, each handshake moving on as its
frames arrive (:class:`~pytest_gpu.handshake.Handshake`), within ``handshake_timeout``
seconds. A process that connects and then sends nothing, half a frame or a wrong answer
costs a descriptor until its deadline and nothing else: no thread, and no slot anyone else
waits for.

:data:`MAX_HANDSHAKES` bounds the descriptors. At the bound a new connection is accepted
once room is made: a handshake that has owed the answer to the key's challenge for
:data:`SHUT_OUT_AFTER` seconds is shut out, the oldest of the process with the most such
(``SO_PEERCRED``), one every :data:`ACCEPT_PAUSE` at most. A client with the key answers
within a round trip, and then is never shut out; so strangers holding handshakes, however
many, keep it waiting :data:`SHUT_OUT_AFTER` at most (the backlog is no longer than the
bound), not a timeout, and cost this thread little CPU by reconnecting.

A client process that dies, for any reason, has its end of the socket closed by the
kernel: ``recv`` raises and :meth:`AuthServer._disconnect` is called at once, no polling.
"""

from __future__ import annotations

import os
import selectors
import socket
import threading
import time
from collections import Counter
from contextlib import suppress
from multiprocessing.connection import Connection
from typing import Generic, TypeVar

from .handshake import (
    ANSWER,
    CLIENT_CHALLENGE,
    CLIENT_WELCOME,
    FAILURE,
    WELCOME,
    Handshake,
    answer,
    frame,
    new_challenge,
    peer_pid,
    verified,
)

ClientT = TypeVar("ClientT")  # what the subclass keeps per authenticated connection
_S = TypeVar("_S", bound="AuthServer")  # type: ignore[type-arg]

HANDSHAKE_TIMEOUT = 5.0  # seconds a new connection has to answer the key's challenge
MAX_HANDSHAKES = 256  # handshakes under way (descriptors) before one that has not answered yet is shut out
BACKLOG = 128  # no longer than MAX_HANDSHAKES: the backlog is taken in one round of shutting out
ACCEPT_BURST = 64  # connections accepted per wake-up of the accept thread, before it reads the handshakes'
SHUT_OUT_AFTER = 0.5  # seconds: at the bound, a handshake owing its answer this long may be shut out for a new one
ACCEPT_PAUSE = 0.001  # seconds between accepts at the bound: strangers reconnecting cost this thread little CPU


class AuthServer(Generic[ClientT]):
    """The listener, the handshakes and the serving thread; start with :meth:`start`, stop
    with :meth:`close`.

    ``_lock`` (re-entrant) guards the connections handed from the accept thread to the
    serving one; a subclass guards its own state with it too. The handshakes are the accept
    thread's alone. The serving thread calls :meth:`_receive` for each message and
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
        # under way, oldest first (so the first is the next deadline); the accept thread's alone
        self._handshakes: dict[Handshake, None] = {}
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
        """Wake the accept thread (closing)."""
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
        """Accept connections and move their handshakes on as their frames arrive, all
        from one epoll; shut out those that have not authenticated by their deadline.
        Never blocks on a client: every socket here is non-blocking."""
        assert self._listener is not None
        listener = self._listener
        selector = selectors.DefaultSelector()
        selector.register(self._accept_wake_r, selectors.EVENT_READ, None)
        listening, resume = False, 0.0  # resume: when to accept again after a pause at the bound
        try:
            while not self._closing:
                now = time.monotonic()
                while self._handshakes:  # oldest first: all have the same timeout
                    oldest = next(iter(self._handshakes))
                    if oldest.deadline > now:
                        break
                    self._end(selector, oldest)
                if len(self._handshakes) < MAX_HANDSHAKES:  # room again (a handshake ended): no pause
                    resume = 0.0
                if (now >= resume) != listening:  # paused, new connections wait in the kernel's backlog
                    if listening:
                        selector.unregister(listener)
                    else:
                        selector.register(listener, selectors.EVENT_READ, listener)
                    listening = not listening
                wake = [next(iter(self._handshakes)).deadline] if self._handshakes else []
                wake += [] if listening else [resume]
                timeout = max(min(wake) - time.monotonic(), 0.0) if wake else None
                for key, _ in selector.select(timeout):
                    if self._closing:
                        break
                    if key.data is None:
                        os.read(self._accept_wake_r, 4096)
                    elif key.data is listener:
                        resume = self._accept_some(selector, listener)
                    elif key.data in self._handshakes:  # not shut out earlier in this batch
                        self._advance(selector, key.data)
        finally:
            selector.close()
            listener.close()
            try:
                os.unlink(self.address)
            except OSError:
                pass
            for handshake in list(self._handshakes):
                handshake.sock.close()
            self._handshakes.clear()
            self._close_pipe("_accept_wake")

    def _accept_some(self, selector: selectors.BaseSelector, listener: socket.socket) -> float:
        """Accept what waits in the backlog (up to :data:`ACCEPT_BURST`), send each its
        challenge; at :data:`MAX_HANDSHAKES`, one at a time, each after shutting out a
        handshake that owes its answer (:meth:`_make_room`). Returns when to accept again
        (0: at once)."""
        for _ in range(ACCEPT_BURST):
            at_bound = len(self._handshakes) >= MAX_HANDSHAKES
            if at_bound and (wait := self._make_room(selector)):
                return time.monotonic() + wait
            try:
                sock, _ = listener.accept()
            except BlockingIOError:
                return 0.0  # the backlog is empty
            except OSError:  # e.g. out of file descriptors: do not spin, try again
                return time.monotonic() + 0.01
            handshake = Handshake(sock, peer_pid(sock), time.monotonic() + self.handshake_timeout, b"")
            try:
                sock.setblocking(False)
                handshake.challenge = new_challenge(self.authkey)
                self._send(handshake, handshake.challenge)
                selector.register(sock, selectors.EVENT_READ, handshake)
                self._handshakes[handshake] = None
            except (OSError, ValueError):
                sock.close()
            if at_bound:
                return time.monotonic() + ACCEPT_PAUSE
        return 0.0

    def _make_room(self, selector: selectors.BaseSelector) -> float:
        """At the bound: shut out, of the handshakes that have owed the answer to this
        side's challenge for :data:`SHUT_OUT_AFTER` seconds, the oldest of the process with
        the most such, and return 0; if none owes it that long, return how long until one
        will (a client with the key answers within a round trip: it is not shut out). If
        none owes an answer at all (all have the key), return 0: the new one comes in
        beyond the bound."""
        waiting = [h for h in self._handshakes if h.step == ANSWER]
        now = time.monotonic()
        due = [h for h in waiting if h.deadline - self.handshake_timeout + SHUT_OUT_AFTER <= now]
        if not due:
            return (
                max(waiting[0].deadline - self.handshake_timeout + SHUT_OUT_AFTER - now, ACCEPT_PAUSE)
                if waiting
                else 0.0
            )
        most = Counter(h.peer for h in due).most_common(1)[0][0]
        self._end(selector, next(h for h in due if h.peer == most))
        return 0.0

    def _send(self, handshake: Handshake, payload: bytes) -> None:
        """Send one frame at once or not at all: a handshake's few hundred bytes always fit
        a new socket's buffer, so one that does not (or fails) ends the handshake."""
        data = frame(payload)
        if handshake.sock.send(data) != len(data):
            raise OSError("short send in the handshake")

    def _advance(self, selector: selectors.BaseSelector, handshake: Handshake) -> None:
        """Act on each whole frame that has arrived; one that closed or sent a frame too
        long is shut out."""
        try:
            while (payload := handshake.read_frame()) is not None:
                if not self._step(selector, handshake, payload):
                    return
        except EOFError:
            self._end(selector, handshake)

    def _step(self, selector: selectors.BaseSelector, handshake: Handshake, payload: bytes) -> bool:
        """Act on one whole frame; ``False`` once the handshake is over (either way)."""
        try:
            if handshake.step == ANSWER:
                ok = verified(self.authkey, handshake.challenge, payload)
                self._send(handshake, WELCOME if ok else FAILURE)  # as deliver_challenge: the client is told
                handshake.step = CLIENT_CHALLENGE
            elif handshake.step == CLIENT_CHALLENGE:
                self._send(handshake, answer(self.authkey, payload))
                ok, handshake.step = True, CLIENT_WELCOME
            else:  # CLIENT_WELCOME: the client took this side's answer, or refused it
                self._end(selector, handshake, keep=payload == WELCOME)
                return False
        except Exception:  # a malformed challenge (AuthenticationError, AssertionError), a failed send
            ok = False
        if not ok:
            self._end(selector, handshake)
        return ok

    def _end(self, selector: selectors.BaseSelector, handshake: Handshake, keep: bool = False) -> None:
        """The handshake is over: ``keep``, the connection goes to the serving thread;
        else it is closed (its deadline passed, it failed, or room was made)."""
        self._handshakes.pop(handshake, None)
        with suppress(KeyError, ValueError):
            selector.unregister(handshake.sock)
        if not keep or self._closing:
            handshake.sock.close()
            return
        try:
            handshake.sock.setblocking(True)
            conn = Connection(handshake.sock.detach())
        except OSError:
            handshake.sock.close()
            return
        with self._lock:
            self._incoming.append(conn)
        self._wake()

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
