"""Frames, the one framing of every pytest-gpu socket: a 4-byte length, then JSON (pure:
the sockets are :mod:`.sockets`).

JSON, not pickle: the arbiter may serve another user's runs, and nothing received from a
socket may run code (bytes that must travel, a test body's pickled arguments, are an
opaque base64 field, unpickled only by a process that authenticated its peer). A frame is
at most a protocol's limit (``MAX_FRAME`` to the arbiter, ``MAX_REPLY`` back); its JSON is
at most ``MAX_DEPTH`` deep (checked before it is parsed, so no nesting can exhaust the
parser's stack), with no ``NaN`` or ``Infinity``. A reader that is fed bytes as they
arrive never blocks on a peer that stops half-way. The key's handshake
(:mod:`.handshake`) uses the same 4-byte length, with raw bytes for its payload.
"""

from __future__ import annotations

import json
import re
import struct
from typing import Any


class WireError(ValueError):
    """A frame that is too large, too deep or not JSON, or a field that is not what it must be."""


MAX_FRAME = 1 << 20  # a run's message to the arbiter (an attach with a thousand leases is ~300 KiB)
MAX_REPLY = 16 << 20  # the arbiter's answer (a status of a busy machine)
MAX_DEPTH = 8  # the deepest message is an attach: {held: [{request: [...]}]}
_HEADER = struct.Struct(">I")
# the escapes that matter for quotes gone first (left to right, as JSON reads them), strings
# are quote to quote: every pass linear, whatever the bytes (no pattern retried at every quote)
_STRINGS = re.compile(rb'"[^"]*"')
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_TOO_DEEP = re.compile(rb"[\[{]{%d}" % (MAX_DEPTH + 1))
MAX_BRACKETS = 1 << 17  # a run's largest attach (4096 leases and as many requests) has fewer


def _no_object(value: Any) -> Any:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


_encoder = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
# the C encoder, made once (json.dumps makes one per call): no check for circles (no message has one)
_c_encoder = getattr(json.encoder, "c_make_encoder", None)
_encode_once: Any = (
    _c_encoder(None, _no_object, json.encoder.encode_basestring_ascii, None, ":", ",", False, False, False)
    if _c_encoder is not None
    else None
)


def _dumps(message: dict[str, Any]) -> str:
    if _encode_once is None:
        return _encoder.encode(message)
    return "".join(_encode_once(message, 0))


def encode(message: dict[str, Any], limit: int = MAX_FRAME) -> bytes:
    """``message`` as one frame; :class:`WireError` when it is over ``limit`` bytes,
    ``ValueError`` or ``TypeError`` when it is no JSON (a NaN, an object)."""
    data = _dumps(message).encode()
    if len(data) > limit:
        raise WireError(f"frame of {len(data)} bytes is over the {limit}-byte limit")
    return _HEADER.pack(len(data)) + data


def frame(payload: bytes) -> bytes:
    """Raw bytes as one frame (the handshake's)."""
    return _HEADER.pack(len(payload)) + payload


def _depth_ok(raw: bytes, max_brackets: int | None = MAX_BRACKETS) -> bool:
    """Whether ``raw``'s brackets nest at most ``MAX_DEPTH`` deep (strings aside), in a few
    C-speed passes: each round drops the innermost pairs; a run of more openers than the
    depth allows, a round that drops nothing, or too many brackets end it at once."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
        return True  # too few openers to nest too deep (strings' count too: it can only be more)
    unescaped = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = _STRINGS.sub(b"", unescaped).translate(None, _NOT_BRACKETS)
    if max_brackets is not None and len(brackets) > max_brackets:
        return False
    for _ in range(MAX_DEPTH + 1):
        if not brackets:
            return True
        if _TOO_DEEP.search(brackets):
            return False
        fewer = brackets.replace(b"[]", b"").replace(b"{}", b"")
        if len(fewer) == len(brackets):
            return False  # unbalanced: no JSON
        brackets = fewer
    return not brackets


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


_decoder = json.JSONDecoder(parse_constant=_no_constants)  # made once (json.loads makes one per call)


def decode(raw: bytes, max_brackets: int | None = MAX_BRACKETS) -> dict[str, Any]:
    """One frame's JSON object; :class:`WireError` for anything else. ``max_brackets``: the
    most brackets a frame may hold (``None``: as many as its size allows; a catalog of a
    large suite has more than an attach)."""
    if not _depth_ok(raw, max_brackets):
        raise WireError(f"frame nests deeper than {MAX_DEPTH} levels")
    try:
        message = _decoder.decode(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise WireError(f"frame is not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise WireError("frame is not a JSON object")
    return message


class FrameReader:
    """Turns bytes, as they come, into messages; ``limit``: the largest frame accepted
    (``max_brackets``: see :func:`decode`)."""

    def __init__(self, limit: int = MAX_FRAME, max_brackets: int | None = MAX_BRACKETS) -> None:
        self._buffer = bytearray()
        self.limit = limit
        self.max_brackets = max_brackets

    @property
    def pending(self) -> int:
        """Bytes received of frames not yet whole."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """The messages whole once ``data`` is added (none while a frame is still coming)."""
        buffer = self._buffer
        if buffer:
            buffer += data
            if len(buffer) >= _HEADER.size:
                (size,) = _HEADER.unpack_from(buffer)
                if size > self.limit:
                    raise WireError(f"frame of {size} bytes is over the {self.limit}-byte limit")
                if len(buffer) < _HEADER.size + size:
                    return []  # a large frame still coming: not copied again
            data = bytes(buffer)
            buffer.clear()
        messages = []
        pos, end = 0, len(data)
        while end - pos >= _HEADER.size:
            (size,) = _HEADER.unpack_from(data, pos)
            if size > self.limit:
                raise WireError(f"frame of {size} bytes is over the {self.limit}-byte limit")
            stop = pos + _HEADER.size + size
            if stop > end:
                break
            messages.append(decode(data[pos + _HEADER.size : stop], self.max_brackets))
            pos = stop
        if pos < end:
            buffer += memoryview(data)[pos:]
        return messages
