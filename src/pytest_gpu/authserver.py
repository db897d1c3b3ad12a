"""An authenticated Unix-socket service: many clients, one serving thread, handshakes apart.

The transport of the run's lease service (:mod:`pytest_gpu.leasing.broker`), and nothing
of leases: :mod:`multiprocessing.connection` over a Unix socket in a private 0700
directory, authenticated with a random key. A subclass says what a message means
(:meth:`AuthServer._receive`) and what a client that went away leaves behind
(:meth:`AuthServer._disconnect`).

One thread serves every authenticated connection as its messages arrive (one epoll over
all sockets, no thread switch per message). The key's challenge and answer, both ways, are
driven by the accept thread over non-blocking sockets, each handshake moving on as its
frames arrive (:class:`Handshake`), within ``handshake_timeout`` seconds. A process that
connects and then sends nothing, half a frame or a wrong answer costs a descriptor until its
deadline and nothing else: no thread, and no slot anyone else waits for.

Beyond :data:`MAX_HANDSHAKES` (descriptors) a connection is still accepted at once: room is
made by shutting out one that has not answered the key's challenge, the oldest of the
process with the most such (``SO_PEERCRED``). A client with the key answers within a round
trip and cannot be shut out after, so strangers holding handshakes do not keep it waiting.

A client process that dies, for any reason, has its end of the socket closed by the
kernel: ``recv`` raises and :meth:`AuthServer._disconnect` is called at once, no polling.
"""

from __future__ import annotations

import hmac
import os
import selectors
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from multiprocessing import AuthenticationError
from multiprocessing import connection as mp_connection
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any, Generic, TypeVar, cast

ClientT = TypeVar("ClientT")  # what the subclass keeps per authenticated connection
_S = TypeVar("_S", bound="AuthServer")  # type: ignore[type-arg]

HANDSHAKE_TIMEOUT = 5.0  # seconds a new connection has to answer the key's challenge
MAX_HANDSHAKES = 256  # handshakes under way (descriptors) before one that has not answered yet is shut out
BACKLOG = 128
ACCEPT_BURST = 64  # connections accepted per wake-up of the accept thread, before it reads the handshakes'
MAX_FRAME = 256  # the longest handshake frame read, as multiprocessing.connection's recv_bytes(256)

# The handshake's wire words, as multiprocessing.connection has them (unchanged since Python 2)
CHALLENGE, WELCOME, FAILURE = b"#CHALLENGE#", b"#WELCOME#", b"#FAILURE#"

# Python 3.12+ checks an answer whose digest the client may name; before, an HMAC-MD5 of the message
_verify_challenge = cast(
    "Callable[[bytes, bytes, bytes], None] | None", getattr(mp_connection, "_verify_challenge", None)
)


class _Stop(Exception):
    """Raised by :class:`_Script` where the handshake would wait for the other side."""


class _Script:
    """A stand-in connection: what is sent is kept, what is received is ``given`` (one
    frame at most), then :class:`_Stop`."""

    def __init__(self, given: bytes | None) -> None:
        self.given, self.sent = given, b""

    def send_bytes(self, data: bytes) -> None:
        self.sent = self.sent or bytes(data)

    def recv_bytes(self, maxlength: int | None = None) -> bytes:
        given, self.given = self.given, None
        if given is None:
            raise _Stop
        return given


def _first_sent(step: Callable[[Any, bytes], None], authkey: bytes, given: bytes | None = None) -> bytes:
    """What ``step`` (the standard library's :func:`~multiprocessing.connection.deliver_challenge`
    or :func:`~multiprocessing.connection.answer_challenge`) sends first, having received
    ``given``: so the challenge and the answer are its own, whatever its version, and only
    the waiting is done here."""
    script = _Script(given)
    with suppress(_Stop):
        step(script, authkey)
    return script.sent


def new_challenge(authkey: bytes) -> bytes:
    """The frame :func:`~multiprocessing.connection.deliver_challenge` sends first (the
    prefix, then a random message: with its digest's name on Python 3.12+)."""
    return _first_sent(deliver_challenge, authkey)


def verified(authkey: bytes, challenge: bytes, response: bytes) -> bool:
    """Whether ``response`` answers ``challenge`` (a frame from :func:`new_challenge`) with
    ``authkey``, by the standard library's own rule."""
    message = challenge[len(CHALLENGE) :]
    if _verify_challenge is not None:
        try:
            _verify_challenge(authkey, message, response)
        except AuthenticationError:
            return False
        return True
    return hmac.compare_digest(hmac.new(authkey, message, "md5").digest(), response)


def answer(authkey: bytes, challenge: bytes) -> bytes:
    """What :func:`~multiprocessing.connection.answer_challenge` sends back to the client's
    ``challenge``; raises :class:`~multiprocessing.AuthenticationError` (or, before Python
    3.12, ``AssertionError``) for a malformed one."""
    return _first_sent(answer_challenge, authkey, challenge)


def frame(payload: bytes) -> bytes:
    """``payload`` as :meth:`multiprocessing.connection.Connection.send_bytes` frames it."""
    return struct.pack("!i", len(payload)) + payload


def _peer_pid(sock: socket.socket) -> int:
    """The process that connected ``sock`` (``SO_PEERCRED``); -1 where it cannot be told."""
    try:
        pid, _, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    except (AttributeError, OSError):  # no SO_PEERCRED on this platform
        return -1
    return int(pid)


# the steps of a handshake, in order: the frame awaited at each
ANSWER, CLIENT_CHALLENGE, CLIENT_WELCOME = "answer", "client-challenge", "client-welcome"


@dataclass(eq=False)
class Handshake:
    """A connection whose authentication is under way, driven by the accept thread, as
    :class:`multiprocessing.connection.Listener` with a key does it: this side's challenge
    sent at once, its answer awaited (``ANSWER``), then the client's challenge
    (``CLIENT_CHALLENGE``), answered, then the client's verdict (``CLIENT_WELCOME``). Frames
    are read exactly: what the client sends after the last is for the serving thread."""

    sock: socket.socket  # non-blocking
    peer: int  # the connecting process, -1 if unknown
    deadline: float
    challenge: bytes  # the frame this side sent
    step: str = ANSWER
    header: bool = True  # reading a frame's 4-byte length (else its payload)
    need: int = 4  # bytes still to read of the header or the payload
    data: bytearray = field(default_factory=bytearray)


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
        selector.register(listener, selectors.EVENT_READ, listener)
        try:
            while not self._closing:
                now = time.monotonic()
                while self._handshakes:  # oldest first: all have the same timeout
                    oldest = next(iter(self._handshakes))
                    if oldest.deadline > now:
                        break
                    self._end(selector, oldest)
                deadline = next(iter(self._handshakes)).deadline if self._handshakes else None
                timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                for key, _ in selector.select(timeout):
                    if self._closing:
                        break
                    if key.data is None:
                        os.read(self._accept_wake_r, 4096)
                    elif key.data is listener:
                        self._accept_some(selector, listener)
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

    def _accept_some(self, selector: selectors.BaseSelector, listener: socket.socket) -> None:
        """Accept what waits in the backlog (up to :data:`ACCEPT_BURST`), send each its
        challenge; beyond :data:`MAX_HANDSHAKES`, shut out one that has not answered yet."""
        for _ in range(ACCEPT_BURST):
            try:
                sock, _ = listener.accept()
            except BlockingIOError:
                return  # the backlog is empty
            except OSError:
                time.sleep(0.01)  # e.g. out of file descriptors: do not spin, try again
                return
            if len(self._handshakes) >= MAX_HANDSHAKES:
                self._make_room(selector)
            handshake = Handshake(sock, _peer_pid(sock), time.monotonic() + self.handshake_timeout, b"")
            try:
                sock.setblocking(False)
                handshake.challenge = new_challenge(self.authkey)
                self._send(handshake, handshake.challenge)
                selector.register(sock, selectors.EVENT_READ, handshake)
            except (OSError, ValueError):
                sock.close()
                continue
            self._handshakes[handshake] = None

    def _make_room(self, selector: selectors.BaseSelector) -> None:
        """Shut out the oldest handshake still owing the answer to this side's challenge of
        the process with the most such; if all have answered (they have the key), none."""
        waiting = [h for h in self._handshakes if h.step == ANSWER]
        if waiting:
            most = Counter(h.peer for h in waiting).most_common(1)[0][0]
            self._end(selector, next(h for h in waiting if h.peer == most))

    def _send(self, handshake: Handshake, payload: bytes) -> None:
        """Send one frame at once or not at all: a handshake's few hundred bytes always fit
        a new socket's buffer, so one that does not (or fails) ends the handshake."""
        data = frame(payload)
        if handshake.sock.send(data) != len(data):
            raise OSError("short send in the handshake")

    def _advance(self, selector: selectors.BaseSelector, handshake: Handshake) -> None:
        """Read what has arrived, exactly up to the end of a frame, and act on each whole
        frame; a connection that closed, sent a frame too long or a wrong one, is shut out."""
        sock = handshake.sock
        while True:
            try:
                chunk = sock.recv(handshake.need)
            except BlockingIOError:
                return  # more later
            except OSError:
                chunk = b""
            if not chunk:  # closed by the other side
                self._end(selector, handshake)
                return
            handshake.data += chunk
            handshake.need -= len(chunk)
            if handshake.need:
                continue
            if handshake.header:
                (size,) = struct.unpack("!i", handshake.data)
                if not 0 <= size <= MAX_FRAME:  # as recv_bytes(256): no long frames (nor 8-byte lengths)
                    self._end(selector, handshake)
                    return
                handshake.header, handshake.need, handshake.data = False, size, bytearray()
                if size:
                    continue
            payload = bytes(handshake.data)
            handshake.header, handshake.need, handshake.data = True, 4, bytearray()
            if not self._step(selector, handshake, payload):
                return

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
