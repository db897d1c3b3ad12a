"""One client for every pytest-gpu service: calls with ids and timeouts, one-way tells, events.

The other end of :mod:`.server`. A :class:`Client` connects (proving the key both ways
where the service has one, :func:`.handshake.authenticate`), sends a call as
``{"op": kind, "id": n, ...}`` and files the answer ``{"re": n, ...}`` with it, whatever
arrived in between; a one-way message (:meth:`Client.tell`) has no ``id``. Everything
the server sends is checked against the protocol's schema before anyone sees it: an
answer as strictly as the server checks a call, an event likewise. A message that is not
what the protocol says (:class:`Garbled`) ends the connection: the server is out of step.

Two ways to read:

- *in the caller's thread* (the default): a call reads until its answer has come, and
  hands the events that came first to ``on_event`` (or keeps them for :meth:`Client.receive`).
  An exception raised in the wait (pytest-timeout's signal, Ctrl-C) consumes nothing,
  and the answer of a call given up on is skipped when it comes. Only an exception while
  a message is being written or filed (microseconds) leaves the stream in doubt: then the
  connection is closed (:attr:`Client.lost`).
- *a reader thread* (``threaded``): answers go to the calls that wait for them, events to
  ``on_event`` as they come (for a peer that speaks unasked at any time: the arbiter).

Errors: :class:`~.schema.Refused` (the server answered an error), :class:`NoAnswer` (not
within the call's timeout), :class:`Closed` (the connection ended), :class:`Garbled`.
"""

from __future__ import annotations

import contextlib
import itertools
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from multiprocessing import AuthenticationError
from typing import Any

from .frames import MAX_BRACKETS, MAX_FRAME, MAX_REPLY, FrameReader, WireError, encode
from .handshake import authenticate
from .schema import Protocol, Refused
from .sockets import connect, peer_credentials

CONNECT_TIMEOUT_S = 5.0
READ_SIZE = 65536
ERROR_MAX = 4000  # characters of an error answer kept


class Closed(ConnectionError):
    """The connection ended (the server went away, or the stream was left in doubt)."""


class NoAnswer(TimeoutError):
    """A call was not answered within its timeout."""


class Garbled(WireError):
    """The server sent what its protocol does not allow: the connection was closed."""


class _Waiting:
    """A call sent, its answer not yet filed."""

    __slots__ = ("done", "error", "event", "expect", "kind", "value")

    def __init__(self, kind: str, threaded: bool, expect: Callable[[Any], None] | None = None) -> None:
        self.kind = kind
        self.expect = expect
        self.done = False
        self.value: Any = None
        self.error: BaseException | None = None
        self.event = threading.Event() if threaded else None

    def finish(self, value: Any = None, error: BaseException | None = None) -> None:
        if self.done:
            return
        self.value, self.error, self.done = value, error, True
        if self.event is not None:
            self.event.set()


class Client:
    """A connection to a server speaking ``protocol``; see the module doc.

    ``key``: the service's key (``None``: the server goes by the kernel's word, and this
    side reads who it is: :attr:`peer_pid`, :attr:`peer_uid`). ``limit``: the largest
    frame taken from the server. ``OSError`` when nothing listens at ``address``,
    :class:`~multiprocessing.AuthenticationError` for a wrong key (either side's)."""

    def __init__(
        self,
        address: str,
        protocol: Protocol,
        *,
        key: bytes | None = None,
        timeout: float = CONNECT_TIMEOUT_S,
        limit: int = MAX_REPLY,
        max_brackets: int | None = MAX_BRACKETS,
        max_request: int = MAX_FRAME,
        on_event: Callable[[str, Any], None] | None = None,
        on_lost: Callable[[Client], None] | None = None,  # threaded: once the reader thread ends
        threaded: bool = False,
    ) -> None:
        self.address = address
        self.protocol = protocol
        self.sock = connect(address, timeout)
        try:
            if key is not None:
                self.sock.settimeout(timeout)
                try:
                    authenticate(self.sock, key)
                except EOFError as exc:
                    raise ConnectionResetError(f"closed during the key's handshake ({exc})") from None
                except AssertionError as exc:  # before Python 3.12: a malformed challenge
                    raise AuthenticationError(f"not the key's handshake ({exc})") from None
                self.sock.settimeout(None)
        except BaseException:
            self.sock.close()
            raise
        self.peer_pid, self.peer_uid = peer_credentials(self.sock)
        self.max_request = max_request
        self._reader = FrameReader(limit, max_brackets)
        self._ids = itertools.count(1)
        self._last_id = 0
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # the calls waiting (the reader thread files their answers)
        self._calls: dict[int, _Waiting] = {}
        self._events: deque[tuple[str, Any]] = deque()
        self._on_event = on_event
        self._on_lost = on_lost
        self.lost: str | None = None  # why the connection ended, once it has
        self.garbled: str | None = None  # what the server sent that its protocol does not allow
        self.closing = False
        self._threaded = threaded
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._read_loop, name="pytest-gpu-wire-client", daemon=True)
            self._thread.start()

    # -- sending --------------------------------------------------------------------------

    def _send(self, message: dict[str, Any]) -> None:
        data = encode(message, self.max_request)  # WireError, ValueError, TypeError: nothing was sent
        if self.lost is not None:
            raise Garbled(self.garbled) if self.garbled is not None else Closed(self.lost)
        with self._send_lock:
            try:
                self.sock.sendall(data)
            except OSError as exc:
                self._end(f"lost the connection: {exc!r}")
                raise Closed(self.lost) from None
            except BaseException:
                self._end("interrupted while a message was written")  # possibly half of it
                raise

    def tell(self, kind: str, fields: dict[str, Any] | None = None) -> None:
        """One-way: nothing is answered (:class:`Closed` when the connection has ended)."""
        self._send({"op": kind, **(fields or {})})

    def call(
        self,
        kind: str,
        fields: dict[str, Any] | None = None,
        timeout: float | None = None,
        expect: Callable[[Any], None] | None = None,
    ) -> Any:
        """``kind``'s answer, checked; :class:`~.schema.Refused` when the server answered an
        error, :class:`NoAnswer` after ``timeout`` seconds, :class:`Closed`, :class:`Garbled`.

        ``expect``: what the caller knows that the schema cannot (a grant of the GPUs it asked
        on): called with the checked answer as it is filed, a :class:`~.frames.WireError` from
        it garbles the connection as a wrong shape does."""
        rid = next(self._ids)
        self._last_id = rid
        waiting = _Waiting(kind, self._threaded, expect)
        with self._lock:
            self._calls[rid] = waiting
        try:
            self._send({"op": kind, "id": rid, **(fields or {})})
            if waiting.event is not None:
                if not waiting.event.wait(timeout):
                    raise NoAnswer(f"{kind!r} was not answered within {timeout:g}s")
            else:
                self._wait(waiting, timeout)
        finally:
            with self._lock:
                self._calls.pop(rid, None)
        if waiting.error is not None:
            raise waiting.error
        return waiting.value

    # -- reading in the caller's thread ----------------------------------------------------

    def _wait(self, waiting: _Waiting, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not waiting.done:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise NoAnswer(f"{waiting.kind!r} was not answered within {timeout:g}s")
            self.pump(left)

    def pump(self, timeout: float | None = None) -> bool:
        """Read what has come (waiting up to ``timeout`` seconds, ``None``: until something
        does) and file it; ``False`` when nothing came in time."""
        if self.lost is not None:
            raise Garbled(self.garbled) if self.garbled is not None else Closed(self.lost)
        if timeout is not None:  # (a blocking recv waits as well: a signal's exception in it consumes nothing)
            poller = select.poll()
            poller.register(self.sock, select.POLLIN)
            try:
                if not poller.poll(max(timeout, 0.0) * 1000):
                    return False
            except OSError as exc:
                self._end(f"lost the connection: {exc!r}")
                raise Closed(self.lost) from None
        try:
            self._take(self.sock.recv(READ_SIZE))
        except (Closed, Garbled):
            raise
        except OSError as exc:
            self._end(f"lost the connection: {exc!r}")
            raise Closed(self.lost) from None
        except BaseException:
            self._end("interrupted while a message was read")
            raise
        return True

    def receive(self, timeout: float | None = None) -> tuple[str, Any] | None:
        """The next event, checked: ``(kind, body)``; ``None`` when none came within ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._events:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            self.pump(left)
        return self._events.popleft()

    # -- reading in a thread of its own ---------------------------------------------------

    def _read_loop(self) -> None:
        try:
            while True:
                self._take(self.sock.recv(READ_SIZE))
        except (Closed, Garbled):
            pass  # _take ended it
        except Exception as exc:  # the socket failed, or a handler of an event did
            self._end(f"lost the connection: {exc!r}")
        if self._on_lost is not None and not self.closing:
            self._on_lost(self)

    # -- filing -----------------------------------------------------------------------------

    def _take(self, data: bytes) -> None:
        """File what ``data`` completes; :class:`Closed` at the end of the stream."""
        if not data:
            self._end("closed by the other side")
            raise Closed(self.lost)
        try:
            for message in self._reader.feed(data):
                self._file(message)
        except WireError as exc:
            self._garble(str(exc))

    def _garble(self, why: str) -> None:
        self.garbled = f"{self.protocol.name} sent what its protocol does not allow: {why}"
        self._end(self.garbled, Garbled(self.garbled))
        raise Garbled(self.garbled)

    def _file(self, message: dict[str, Any]) -> None:
        if "re" in message:
            self._answer(message)
            return
        kind = message.pop("op", None)
        if kind is None and self.protocol.keyed and message:
            kind = next(iter(message))
        if not isinstance(kind, str):
            raise WireError(f"a message that is neither an answer nor an event: {message!r:.80}")
        body = self.protocol.event(kind, message)
        if self._on_event is not None:
            self._on_event(kind, body)
        else:
            self._events.append((kind, body))

    def _answer(self, message: dict[str, Any]) -> None:
        rid = message["re"]
        with self._lock:  # taken off at once: an end of the connection right after must not undo it
            waiting = self._calls.pop(rid, None) if rid.__class__ is int else None
        if waiting is None:
            if rid.__class__ is int and 0 < rid <= self._last_id:
                return  # the answer of a call given up on (timed out, interrupted): skipped
            raise WireError(f"an answer to no call ({rid!r:.20})")
        try:
            if len(message) != 2 or not ("ok" in message or "error" in message):
                raise WireError(f"its answer to {waiting.kind!r} must be {{re, ok}} or {{re, error}}")
            if "error" in message:
                error = message["error"]
                if not isinstance(error, str):
                    raise WireError(f"its error answer to {waiting.kind!r} is no text")
                waiting.finish(error=Refused(error[:ERROR_MAX]))
                return
            value = self.protocol.answer(waiting.kind, message["ok"])
            if waiting.expect is not None:
                waiting.expect(value)
            waiting.finish(value)
        except WireError:
            with self._lock:
                self._calls[rid] = waiting  # it fails with the connection, garbled
            raise

    def _end(self, why: str, error: BaseException | None = None) -> None:
        """The connection is over: every call still waiting fails (``error``, else :class:`Closed`)."""
        with self._lock:
            if self.lost is not None:
                return
            self.lost = why
            waiting, self._calls = list(self._calls.values()), {}
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        for call in waiting:
            call.finish(error=error or Closed(why))

    def close(self, wait: bool = True) -> None:
        """End the connection; ``wait``: for the reader thread to end too (not from a thread
        it may be waiting for: a lock the caller holds)."""
        self.closing = True
        self._end("closed by this side")
        self.sock.close()
        if wait and self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
