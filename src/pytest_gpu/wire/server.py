"""One server loop for every pytest-gpu service: the broker, the arbiter, a rank pool.

A :class:`Server` listens on a Unix socket and has two threads. The **accept thread**
takes new connections and authenticates them (:class:`Auth`), each over a non-blocking
socket in its own epoll, so a stranger that connects and then stalls costs a descriptor
until its deadline and nothing else: no thread, and no slot anyone else waits for. The
**serving thread** serves every authenticated connection (a :class:`Peer`) from one epoll:
a message is handled as soon as it arrives, with no thread switch per message, by the
handler of its kind (``on_<kind>``; ``-`` in a kind is ``_``), after its fields were
checked against the protocol's schema (:mod:`.schema`; a service that only files what
arrives has one :meth:`Server.on_message` for all). A handler's return value is the
answer (``{"re": id, "ok": value}``), an exception it raises the error answer
(``{"re": id, "error": why}``, :meth:`Server.error_text`); a one-way message (no ``id``)
is answered nothing. Nothing a peer sends can raise out of the loop: whatever one peer
made happen ends that peer alone.

Authentication, pluggable:

- :class:`KeyAuth`: the key's challenge and answer both ways (:mod:`.handshake`), within
  ``timeout``. :data:`MAX_HANDSHAKES` bounds the descriptors: at the bound a new
  connection is accepted once room is made: a handshake that has owed the answer to this
  side's challenge for :data:`SHUT_OUT_AFTER` seconds is shut out, the oldest of the
  process with the most such (``SO_PEERCRED``), one every :data:`ACCEPT_PAUSE` at most. A
  client with the key answers within a round trip, and then is never shut out; so
  strangers holding handshakes, however many, keep it waiting :data:`SHUT_OUT_AFTER` at
  most (the backlog is no longer than the bound), and cost the accept thread little CPU
  by reconnecting.
- :class:`PeerAuth`: the kernel's word (uid and pid from ``SO_PEERCRED`` at connect),
  judged by a policy; the service then acts on that uid's behalf only.

Bounds (:class:`Bounds`, each ``None`` where a service has none): connections in all and
per uid; a peer's first whole message within ``hello_timeout``, any frame it started
finished within ``frame_timeout``; unfinished frames per uid; a peer whose unread
answers pile up beyond ``max_outbox`` bytes is dropped. Fairness: in each turn of the
loop a uid's connections are read for ``turn_bytes_per_uid`` bytes, the rest waiting for
the next turn (users take turns: another user's message waits at most a turn), and a uid
whose messages took ``seconds_per_uid`` of the thread's time in the current second is not
read until the next (a flood costs the process the server lives in at most that share).

A peer's process that dies, for any reason, has its end of the socket closed by the
kernel: ``recv`` returns nothing and :meth:`Server.disconnected` is called at once, no
polling.
"""

from __future__ import annotations

import functools
import os
import selectors
import socket
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .frames import MAX_BRACKETS, MAX_FRAME, MAX_REPLY, FrameReader, WireError, encode
from .frames import frame as handshake_frame
from .handshake import (
    ANSWER,
    CLIENT_CHALLENGE,
    CLIENT_WELCOME,
    FAILURE,
    WELCOME,
    Handshake,
    answer,
    new_challenge,
    verified,
)
from .schema import Protocol, Refused
from .sockets import listen, peer_credentials, unlink

_S = TypeVar("_S", bound="Server")

HANDSHAKE_TIMEOUT = 5.0  # seconds a new connection has to answer the key's challenge
MAX_HANDSHAKES = 256  # handshakes under way (descriptors) before one that has not answered yet is shut out
BACKLOG = 128  # no longer than MAX_HANDSHAKES: the backlog is taken in one round of shutting out
ACCEPT_BURST = 64  # connections accepted per wake-up of the accept thread, before it reads the handshakes'
SHUT_OUT_AFTER = 0.5  # seconds: at the bound, a handshake owing its answer this long may be shut out for a new one
ACCEPT_PAUSE = 0.001  # seconds between accepts at the bound: strangers reconnecting cost this thread little CPU
READ_SIZE = 65536


class Drop(Exception):
    """Raised by a handler: the peer is shut out, unanswered (it is out of step)."""


@dataclass(frozen=True)
class Bounds:
    """What one peer, and one user's peers together, may cost a server (``None``: no bound)."""

    max_request: int = MAX_FRAME  # the largest frame a peer may send
    max_brackets: int | None = MAX_BRACKETS  # see frames.decode
    max_answer: int = MAX_REPLY  # the largest frame sent; an answer over it is an error answer
    max_outbox: int | None = 4 << 20  # unread answers and events before a peer is dropped
    max_peers: int | None = None  # connections in all
    max_peers_per_uid: int | None = None
    max_pending_per_uid: int | None = None  # bytes of unfinished frames a user's peers may hold
    turn_bytes_per_uid: int | None = None  # what a user's peers are read for in one turn
    seconds_per_uid: float | None = None  # of each second, what a user's messages may take of the serving thread
    hello_timeout: float | None = None  # a new peer's first whole message
    frame_timeout: float | None = None  # a frame begun must be whole by then


class Auth:
    """How a new connection proves who it is before it is served."""


@dataclass(frozen=True)
class KeyAuth(Auth):
    """The key's challenge and answer, both ways (see the module doc)."""

    key: bytes
    timeout: float = HANDSHAKE_TIMEOUT


@dataclass(frozen=True)
class PeerAuth(Auth):
    """The kernel's word: ``admit(pid, uid)`` says why a peer is refused (``None``: it is not)."""

    admit: Callable[[int, int], str | None] = lambda pid, uid: None if uid >= 0 else "no credentials"


@dataclass(eq=False)
class Peer:
    """One authenticated connection, as the serving thread keeps it."""

    sock: socket.socket
    pid: int  # the kernel's word (SO_PEERCRED), 0 where it cannot tell
    uid: int
    reader: FrameReader
    outbox: bytearray = field(default_factory=bytearray)
    data: Any = None  # the service's own: a broker's client, the arbiter's run, a pool's rank
    closed: bool = False
    hello_by: float | None = None  # monotonic deadline of its first message; None once it came
    frame_by: float | None = None  # monotonic deadline of the frame under way
    doomed: str | None = None  # why another thread found it must go (the loop drops it)


class Server:
    """The listener, the authentication and the serving thread of one service; bound at
    construction (``OSError`` when the address is taken), served from :meth:`start`,
    stopped by :meth:`close`. A subclass names its :attr:`protocol` and has a handler per
    call kind; it may also say what a peer's going away leaves behind (:meth:`disconnected`)."""

    protocol: Protocol
    thread_prefix = "pytest-gpu-service"  # the threads' names: <prefix>-accept, <prefix>-serve

    def __init__(self, address: str, auth: Auth, bounds: Bounds | None = None) -> None:
        self.address = address
        self.auth = auth
        self.bounds = bounds or Bounds()
        self._handlers: dict[str, Callable[[Peer, Any], Any]] = {}
        for kind in self.protocol.calls:
            handler = getattr(self, "on_" + kind.replace("-", "_"), None)
            if handler is None and type(self).on_message is not Server.on_message:
                handler = functools.partial(self.on_message, kind)
            if handler is None:
                raise TypeError(f"{type(self).__name__} has no handler on_{kind.replace('-', '_')} for {kind!r}")
            self._handlers[kind] = handler
        self._fields = {kind: call.fields for kind, call in self.protocol.calls.items()}
        self._labels = {kind: repr(kind) for kind in self.protocol.calls}
        self._listener: socket.socket | None = listen(address, BACKLOG, private=isinstance(auth, KeyAuth))
        self._closing = False
        self._threads: list[threading.Thread] = []
        self._wire_lock = threading.Lock()  # peers' outboxes and counts, the hand-over of new peers
        self._incoming: list[Peer] = []
        self._peers: set[Peer] = set()
        self._by_uid: Counter[int] = Counter()  # peers per uid (handed over or served)
        # under way, oldest first (so the first is the next deadline); the accept thread's alone
        self._handshakes: dict[Handshake, None] = {}
        self._dirty: set[Peer] = set()  # peers whose epoll interest may have to change
        self._deadlined: set[Peer] = set()  # peers with a hello or frame deadline
        self._used: defaultdict[int, float] = defaultdict(float)  # seconds of the serving thread per uid, this second
        self._second = time.monotonic()
        self._window = 1.0  # seconds of one share (a test stretches it)
        self.dropped: Counter[str] = Counter()  # why peers were shut out, for tests and the curious
        self._pipes_lock = threading.Lock()  # a wake-up pipe is never written once closed (its fd reused)
        self._wake_r, self._wake_w = os.pipe()
        self._accept_wake_r, self._accept_wake_w = os.pipe()
        for fd in (self._wake_w, self._accept_wake_w):
            os.set_blocking(fd, False)  # a full pipe already means "wake up"
        self._selector = selectors.DefaultSelector()  # the serving thread's: registered once, not per message
        self._serving: threading.Thread | None = None
        self._serving_id: int | None = None

    # -- what a subclass says -------------------------------------------------------------

    def on_message(self, kind: str, peer: Peer, body: Any) -> Any:
        """The handler of every kind without an ``on_<kind>`` of its own (a service that files
        messages for another thread, as a rank pool does, has only this)."""
        raise NotImplementedError

    def connected(self, peer: Peer) -> None:
        """``peer`` was authenticated (serving thread)."""

    def disconnected(self, peer: Peer, why: str) -> None:
        """``peer``'s connection is gone (``why``: "closed", "closing" when the server stops, ...)."""

    def admit(self, peer: Peer, kind: str) -> None:
        """Before a message of ``kind`` is checked: raise to refuse it (:class:`Drop`: shut the peer out)."""

    def unknown(self, peer: Peer, kind: Any, rid: int | None) -> Any:
        """A message of a kind the protocol lacks: answered an error (when it has an ``id``),
        or what this returns."""
        raise WireError(f"unknown op {str(kind)[:40]!r}")

    def invalid(self, peer: Peer, kind: str, rid: int | None, error: WireError) -> Any:
        """A message whose fields are not what its kind's schema says: answered an error, or
        what this returns."""
        raise error

    def error_text(self, kind: Any, exc: Exception) -> str:
        """What an error answer says of ``exc``, raised while serving ``kind``."""
        if isinstance(exc, Refused):
            return str(exc)
        return f"{type(exc).__name__}: {exc}"

    # -- lifecycle ------------------------------------------------------------------------

    def start(self: _S) -> _S:
        """Start the accept and serving threads."""
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        for target, name in ((self._accept_loop, "accept"), (self._serve_loop, "serve")):
            thread = threading.Thread(target=target, name=f"{self.thread_prefix}-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        self._serving = self._threads[-1]
        self._serving_id = self._serving.ident
        return self

    def close(self) -> None:
        """Stop both threads: every connection is closed and its peer disconnected."""
        self._closing = True
        if not self._threads:  # never started: nothing but the listener to let go
            self._close_listener()
            self._selector.close()
            self._close_pipe("_wake")
            self._close_pipe("_accept_wake")
            return
        self._wake()
        self._wake_accept()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=5)

    def alive(self) -> bool:
        """Whether the serving thread still runs."""
        return self._serving is not None and self._serving.is_alive()

    def forget_in_child(self) -> None:
        """In a forked child: drop this process's copies of the sockets (never shut them
        down: they are the parent's too), so the child cannot keep the address bound after
        the parent is gone."""
        socks = [self._listener, *(p.sock for p in [*self._peers, *self._incoming])]
        socks += [h.sock for h in self._handshakes]
        for sock in socks:
            if sock is not None:
                with suppress(OSError):
                    os.close(sock.detach())
        self._listener = None

    def _wake(self) -> None:
        """Wake the serving thread (new peers, outboxes to watch, closing)."""
        with self._pipes_lock:
            if self._wake_w >= 0:
                with suppress(OSError):
                    os.write(self._wake_w, b"x")

    def _wake_accept(self) -> None:
        with self._pipes_lock:
            if self._accept_wake_w >= 0:
                with suppress(OSError):
                    os.write(self._accept_wake_w, b"x")

    def _close_pipe(self, which: str) -> None:
        with self._pipes_lock:
            fds = getattr(self, f"{which}_r"), getattr(self, f"{which}_w")
            setattr(self, f"{which}_r", -1)
            setattr(self, f"{which}_w", -1)
        for fd in fds:
            if fd >= 0:
                with suppress(OSError):
                    os.close(fd)

    def _close_listener(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
            unlink(self.address)

    # -- accepting and authenticating (the accept thread) ----------------------------------

    def _accept_loop(self) -> None:
        """Accept connections and move their handshakes on as their frames arrive, all
        from one epoll; shut out those that have not authenticated by their deadline.
        Never blocks on a peer: every socket here is non-blocking."""
        listener = self._listener
        assert listener is not None
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
            self._close_listener()
            for handshake in list(self._handshakes):
                handshake.sock.close()
            self._handshakes.clear()
            self._close_pipe("_accept_wake")

    def _accept_some(self, selector: selectors.BaseSelector, listener: socket.socket) -> float:
        """Accept what waits in the backlog (up to :data:`ACCEPT_BURST`): a key's handshake
        begins (at :data:`MAX_HANDSHAKES`, one at a time, each after shutting out a handshake
        that owes its answer, :meth:`_make_room`), a peer judged by its credentials is handed
        over at once. Returns when to accept again (0: at once)."""
        keyed = isinstance(self.auth, KeyAuth)
        for _ in range(ACCEPT_BURST):
            at_bound = keyed and len(self._handshakes) >= MAX_HANDSHAKES
            if at_bound and (wait := self._make_room(selector)):
                return time.monotonic() + wait
            try:
                sock, _ = listener.accept()
            except BlockingIOError:
                return 0.0  # the backlog is empty
            except OSError:  # e.g. out of file descriptors: do not spin, try again
                return time.monotonic() + 0.01
            pid, uid = peer_credentials(sock)
            why = self._refusal(pid, uid)
            if why is not None:
                with self._wire_lock:
                    self.dropped[why] += 1
                sock.close()
                continue
            try:
                sock.setblocking(False)
                if isinstance(self.auth, KeyAuth):
                    handshake = Handshake(sock, pid, time.monotonic() + self.auth.timeout, b"")
                    handshake.challenge = new_challenge(self.auth.key)
                    self._send_handshake(handshake, handshake.challenge)
                    selector.register(sock, selectors.EVENT_READ, handshake)
                    self._handshakes[handshake] = None
                else:
                    self._hand_over(sock, pid, uid)
            except (OSError, ValueError):
                sock.close()
            if at_bound:
                return time.monotonic() + ACCEPT_PAUSE
        return 0.0

    def _refusal(self, pid: int, uid: int) -> str | None:
        """Why a new connection is not even authenticated: too many, or its credentials."""
        bounds = self.bounds
        with self._wire_lock:
            if bounds.max_peers is not None and sum(self._by_uid.values()) >= bounds.max_peers:
                return "too many"
            if bounds.max_peers_per_uid is not None and self._by_uid[uid] >= bounds.max_peers_per_uid:
                return "too many"
        if isinstance(self.auth, PeerAuth):
            refused = self.auth.admit(pid, uid)
            if refused is not None:
                return "too many" if uid < 0 else refused
        return None

    def _make_room(self, selector: selectors.BaseSelector) -> float:
        """At the bound: shut out, of the handshakes that have owed the answer to this
        side's challenge for :data:`SHUT_OUT_AFTER` seconds, the oldest of the process with
        the most such, and return 0; if none owes it that long, return how long until one
        will (a client with the key answers within a round trip: it is not shut out). If
        none owes an answer at all (all have the key), return 0: the new one comes in
        beyond the bound."""
        assert isinstance(self.auth, KeyAuth)
        timeout = self.auth.timeout
        waiting = [h for h in self._handshakes if h.step == ANSWER]
        now = time.monotonic()
        due = [h for h in waiting if h.deadline - timeout + SHUT_OUT_AFTER <= now]
        if not due:
            return max(waiting[0].deadline - timeout + SHUT_OUT_AFTER - now, ACCEPT_PAUSE) if waiting else 0.0
        most = Counter(h.peer for h in due).most_common(1)[0][0]
        self._end(selector, next(h for h in due if h.peer == most))
        return 0.0

    def _send_handshake(self, handshake: Handshake, payload: bytes) -> None:
        """Send one frame at once or not at all: a handshake's few hundred bytes always fit
        a new socket's buffer, so one that does not (or fails) ends the handshake."""
        data = handshake_frame(payload)
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
        assert isinstance(self.auth, KeyAuth)
        key = self.auth.key
        try:
            if handshake.step == ANSWER:
                ok = verified(key, handshake.challenge, payload)
                self._send_handshake(handshake, WELCOME if ok else FAILURE)  # as deliver_challenge: the client is told
                handshake.step = CLIENT_CHALLENGE
            elif handshake.step == CLIENT_CHALLENGE:
                self._send_handshake(handshake, answer(key, payload))
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
        _, uid = peer_credentials(handshake.sock)
        self._hand_over(handshake.sock, handshake.peer, uid)

    def _hand_over(self, sock: socket.socket, pid: int, uid: int) -> None:
        bounds = self.bounds
        peer = Peer(sock, pid, uid, FrameReader(bounds.max_request, bounds.max_brackets))
        if bounds.hello_timeout is not None:
            peer.hello_by = time.monotonic() + bounds.hello_timeout
        with self._wire_lock:
            self._incoming.append(peer)
            self._by_uid[uid] += 1
        self._wake()

    # -- every peer, one thread -----------------------------------------------------------

    def _serve_loop(self) -> None:
        self._serving_id = threading.get_ident()
        try:
            while not self._closing:
                try:
                    self._turn()
                except Exception as exc:  # a bug of ours: say it, and go on serving every other peer
                    print(f"pytest-gpu: {self.thread_prefix}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                    time.sleep(0.01)
        finally:
            for peer in list(self._peers):
                self._flush(peer)  # what is said last (a roster without the leaving run) is small: it fits
                self._drop(peer, "closing")
            with self._wire_lock:
                incoming, self._incoming = self._incoming, []
            for peer in incoming:
                peer.sock.close()
            self._selector.close()
            self._close_pipe("_wake")

    def _turn(self) -> None:
        budget = self.bounds.turn_bytes_per_uid
        share = self.bounds.seconds_per_uid
        fair = budget is not None or share is not None
        spent: Counter[int] = Counter()  # bytes read per uid in this turn
        for key, events in self._selector.select(self._timeout()):
            peer: Peer | None = key.data
            if peer is None:
                self._woken()
                continue
            try:
                if events & selectors.EVENT_READ:
                    if not fair:
                        self._read(peer)
                    elif budget is None or spent[peer.uid] < budget:
                        if share is None:
                            spent[peer.uid] += self._read(peer)
                        elif not self._throttled(peer.uid):  # a user over its share: its turn comes again
                            started = time.perf_counter()
                            spent[peer.uid] += self._read(peer)
                            self._used[peer.uid] += time.perf_counter() - started
                            if self._throttled(peer.uid):
                                self._dirty.update(p for p in self._peers if p.uid == peer.uid)
                if events & selectors.EVENT_WRITE and not peer.closed:
                    self._flush(peer)
                    self._dirty.add(peer)
            except Exception as exc:  # whatever a peer made happen ends that peer alone
                self._drop(peer, f"error: {type(exc).__name__}")
        if self._deadlined or share is not None:
            self._expire()
        if self._dirty:
            self._update_interest()

    def _woken(self) -> None:
        """New peers to serve, outboxes another thread left, peers it found must go."""
        with suppress(OSError):
            os.read(self._wake_r, 4096)
        with self._wire_lock:
            incoming, self._incoming = self._incoming, []
            doomed = [p for p in self._peers if p.doomed is not None]
            self._dirty.update(p for p in self._peers if p.outbox)
        for peer in incoming:
            self._peers.add(peer)
            if peer.hello_by is not None:
                self._deadlined.add(peer)
            self._selector.register(peer.sock, selectors.EVENT_READ, peer)
            try:
                self.connected(peer)
            except Exception as exc:
                self._drop(peer, f"error: {type(exc).__name__}")
        for peer in doomed:
            self._drop(peer, peer.doomed or "doomed")

    def _timeout(self) -> float | None:
        if not self._deadlined and self.bounds.seconds_per_uid is None:
            return None
        deadlines = [d for p in self._deadlined for d in (p.hello_by, p.frame_by) if d is not None]
        if self.bounds.seconds_per_uid is not None and any(self._throttled(uid) for uid in self._used):
            deadlines.append(self._second + self._window)  # a user waiting for its next second
        return None if not deadlines else max(min(deadlines) - time.monotonic(), 0.0) + 0.001

    def _throttled(self, uid: int) -> bool:
        share = self.bounds.seconds_per_uid
        return share is not None and self._used[uid] >= share

    def _expire(self) -> None:
        now = time.monotonic()
        if self.bounds.seconds_per_uid is not None and now >= self._second + self._window:
            if any(self._throttled(uid) for uid in self._used):
                self._dirty.update(self._peers)  # read again
            self._second, self._used = now, defaultdict(float)
        for peer in list(self._deadlined):
            if peer.hello_by is not None and now >= peer.hello_by:
                self._drop(peer, "silent")
            elif peer.frame_by is not None and now >= peer.frame_by:
                self._drop(peer, "half frame")
            elif peer.hello_by is None and peer.frame_by is None:
                self._deadlined.discard(peer)

    def _read(self, peer: Peer) -> int:
        """Read and handle what ``peer`` sent; the bytes read."""
        try:
            data = peer.sock.recv(READ_SIZE)
        except BlockingIOError:
            return 0
        except OSError:
            data = b""
        if not data:
            self._drop(peer, "closed")
            return 0
        try:
            found = peer.reader.feed(data)
        except WireError:
            self._drop(peer, "bad frame")
            return len(data)
        if peer.reader.pending:
            bounds = self.bounds
            if peer.frame_by is None and bounds.frame_timeout is not None:
                peer.frame_by = time.monotonic() + bounds.frame_timeout
                self._deadlined.add(peer)
            if bounds.max_pending_per_uid is not None:
                held = sum(p.reader.pending for p in self._peers if p.uid == peer.uid)
                if held > bounds.max_pending_per_uid:
                    self._drop(peer, "too much unfinished")
                    return len(data)
        else:
            peer.frame_by = None
        if found:
            peer.hello_by = None
        for message in found:
            if peer.closed:
                break
            self._handle(peer, message)
        return len(data)

    def _handle(self, peer: Peer, message: dict[str, Any]) -> None:
        kind = message.pop("op", None)
        rid = message.pop("id", None)  # none: one-way, no answer
        if rid is not None and (rid.__class__ is not int or not 0 <= rid < 1 << 53):
            self._send(peer, {"re": None, "error": "id must be a non-negative integer"})
            return
        try:
            handler = self._handlers.get(kind) if isinstance(kind, str) else None
            if handler is None:
                value = self.unknown(peer, kind, rid)
            else:
                self.admit(peer, kind)
                try:
                    body = self._fields[kind].check(message, self._labels[kind])
                except WireError as exc:
                    value = self.invalid(peer, kind, rid, exc)
                else:
                    value = handler(peer, body)
        except Drop:
            self._drop(peer, "dropped")
            return
        except Exception as exc:  # a bad request is answered, never fatal to the server
            if rid is not None:
                self._send(peer, {"re": rid, "error": self.error_text(kind, exc)})
            return
        if rid is not None:
            self._send(peer, {"re": rid, "ok": value})

    # -- sending (any thread) -------------------------------------------------------------

    def send(self, peer: Peer, message: dict[str, Any]) -> None:
        """Send ``message`` to ``peer`` (from any thread); an event that cannot be said is
        dropped, as if it were lost."""
        self._send(peer, message)

    def tell(self, peer: Peer, kind: str, fields: dict[str, Any]) -> None:
        """Event ``kind`` to ``peer``: ``{"op": kind, ...fields}`` (from any thread)."""
        self._send(peer, {"op": kind, **fields})

    def _send(self, peer: Peer, message: dict[str, Any]) -> None:
        try:
            data = encode(message, self.bounds.max_answer)
        except (WireError, ValueError, TypeError) as exc:
            if "re" not in message:
                return  # an event that cannot be said: the peer notices nothing, as if it were lost
            data = encode({"re": message["re"], "error": f"the answer cannot be sent: {exc}"})
        in_loop = threading.get_ident() == self._serving_id
        with self._wire_lock:
            if peer.closed:
                return
            peer.outbox += data
            limit = self.bounds.max_outbox
            if limit is not None and len(peer.outbox) > limit:
                peer.doomed = "not reading"
            else:
                self._try_send(peer)
            waits = peer.doomed is not None or bool(peer.outbox)
            if waits and in_loop:
                self._dirty.add(peer)
        if waits:
            if not in_loop:
                self._wake()  # the loop watches for writability (or drops it)
            elif peer.doomed is not None:
                self._drop(peer, peer.doomed)

    def _try_send(self, peer: Peer) -> bool:
        """Send what the outbox holds, as far as the socket takes it now (under the lock);
        ``False`` once the socket failed (the loop drops it)."""
        try:
            while peer.outbox:
                sent = peer.sock.send(peer.outbox)
                del peer.outbox[:sent]
        except BlockingIOError:
            pass
        except OSError:
            peer.doomed = peer.doomed or "closed"
            return False
        return True

    def _flush(self, peer: Peer) -> None:
        with self._wire_lock:
            if peer.closed:
                return
            ok = self._try_send(peer)
        if not ok:
            self._drop(peer, "closed")

    def _update_interest(self) -> None:
        dirty, self._dirty = self._dirty, set()
        for peer in dirty:
            if peer.closed:
                continue
            if peer.doomed is not None:
                self._drop(peer, peer.doomed)
                continue
            with self._wire_lock:
                pending = bool(peer.outbox)
            reading = 0 if self._throttled(peer.uid) else selectors.EVENT_READ
            wanted = reading | (selectors.EVENT_WRITE if pending else 0)
            try:
                key = self._selector.get_key(peer.sock)
            except (KeyError, ValueError):
                key = None
            try:
                if not wanted:  # a user over its share with nothing to be sent: not listened to meanwhile
                    if key is not None:
                        self._selector.unregister(peer.sock)
                elif key is None:
                    self._selector.register(peer.sock, wanted, peer)
                elif key.events != wanted:
                    self._selector.modify(peer.sock, wanted, peer)
            except (KeyError, ValueError, OSError):
                pass

    def drop(self, peer: Peer, why: str) -> None:
        """Shut ``peer`` out (from any thread: another than the serving one leaves it to the loop)."""
        if threading.get_ident() == self._serving_id:
            self._drop(peer, why)
            return
        with self._wire_lock:
            peer.doomed = peer.doomed or why
        self._wake()

    def _drop(self, peer: Peer, why: str) -> None:
        with self._wire_lock:
            if peer.closed:
                return
            peer.closed = True
            self.dropped[why] += 1
            self._by_uid[peer.uid] -= 1
        self._peers.discard(peer)
        self._deadlined.discard(peer)
        self._dirty.discard(peer)
        with suppress(KeyError, ValueError):
            self._selector.unregister(peer.sock)
        peer.sock.close()
        try:
            self.disconnected(peer, why)
        except Exception as exc:  # a bug of ours: say it, the loop goes on
            print(f"pytest-gpu: {self.thread_prefix}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
