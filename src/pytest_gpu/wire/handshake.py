"""The key's challenge and answer, both ways, as :mod:`multiprocessing.connection` does them.

The server's side (:class:`Handshake`) is what :class:`multiprocessing.connection.Listener`
with an ``authkey`` does in blocking calls (:func:`~multiprocessing.connection.deliver_challenge`,
then :func:`~multiprocessing.connection.answer_challenge`), cut where it waits for the
other side, so that one thread can drive many handshakes over non-blocking sockets
(:mod:`pytest_gpu.wire.server`). The client's side (:func:`authenticate`) is
:func:`multiprocessing.connection.Client`'s, over a blocking socket. The challenge and the
answer are the standard library's own, whatever its version: its functions are run
against a stand-in connection (:class:`_Script`, :class:`_Blocking`), and an answer is
checked by its rule (its ``_verify_challenge`` on Python 3.12+, where the client may name
the digest; before, an HMAC-MD5 compared). Each side proves the key to the other: a
client never takes a message from a server that could not answer its challenge.

The frames are the wire's own 4-byte length (:func:`.frames.frame`) with raw bytes.
"""

from __future__ import annotations

import hmac
import socket
import struct
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from multiprocessing import AuthenticationError
from multiprocessing import connection as mp_connection
from multiprocessing.connection import answer_challenge, deliver_challenge
from typing import Any, cast

from .frames import frame

# The handshake's wire words, as multiprocessing.connection has them (unchanged since Python 2)
CHALLENGE, WELCOME, FAILURE = b"#CHALLENGE#", b"#WELCOME#", b"#FAILURE#"
MAX_FRAME = 256  # the longest frame read, as multiprocessing.connection's recv_bytes(256)

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


class _Blocking:
    """A blocking socket as the standard library's handshake functions use a connection."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def send_bytes(self, data: bytes) -> None:
        self.sock.sendall(frame(bytes(data)))

    def recv_bytes(self, maxlength: int | None = None) -> bytes:
        (size,) = struct.unpack("!i", self._exactly(4))
        if not 0 <= size <= (MAX_FRAME if maxlength is None else maxlength):
            raise EOFError(f"a handshake frame of {size} bytes")
        return self._exactly(size)

    def _exactly(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise EOFError("closed by the other side during the handshake")
            data += chunk
        return data


def authenticate(sock: socket.socket, authkey: bytes) -> None:
    """The client's side, over a blocking (or timed) socket: answer the server's challenge,
    then have it answer this side's. Raises :class:`~multiprocessing.AuthenticationError`
    for a wrong key (either side's), ``EOFError`` or ``OSError`` when the other side went."""
    conn = _Blocking(sock)
    answer_challenge(conn, authkey)  # type: ignore[arg-type]
    deliver_challenge(conn, authkey)  # type: ignore[arg-type]


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
    challenge: bytes  # what this side sent as its challenge (the frame's payload)
    step: str = ANSWER
    header: bool = True  # reading a frame's 4-byte length (else its payload)
    need: int = 4  # bytes still to read of the header or the payload
    data: bytearray = field(default_factory=bytearray)

    def read_frame(self) -> bytes | None:
        """The next whole frame, if it has arrived (else ``None``: more later). Reads no byte
        past its end; raises :class:`EOFError` once the other side closed, or sent a frame
        longer than :data:`MAX_FRAME` (nor takes an 8-byte length, as ``recv_bytes(256)``)."""
        while True:
            try:
                chunk = self.sock.recv(self.need)
            except BlockingIOError:
                return None
            except OSError as exc:
                raise EOFError(str(exc)) from None
            if not chunk:
                raise EOFError("closed by the other side")
            self.data += chunk
            self.need -= len(chunk)
            if self.need:
                continue
            if self.header:
                (size,) = struct.unpack("!i", self.data)
                if not 0 <= size <= MAX_FRAME:
                    raise EOFError(f"a frame of {size} bytes")
                self.header, self.need, self.data = False, size, bytearray()
                if size:
                    continue
            payload = bytes(self.data)
            self.header, self.need, self.data = True, 4, bytearray()
            return payload
