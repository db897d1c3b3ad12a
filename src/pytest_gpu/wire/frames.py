"""Frames between runs and the arbiter: a 4-byte length, then JSON (pure: the sockets are :mod:`.sockets`).

JSON, not pickle: the arbiter may serve another user's runs, and nothing received from a
socket may run code. A frame is at most ``MAX_FRAME`` bytes one way (to the arbiter) and
``MAX_REPLY`` the other; its JSON is at most ``MAX_DEPTH`` deep (checked before it is
parsed, so no nesting can exhaust the parser's stack), with no ``NaN`` or ``Infinity``.
A reader that is fed bytes as they arrive never blocks on a peer that stops half-way.
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


def encode(message: dict[str, Any], limit: int = MAX_FRAME) -> bytes:
    data = json.dumps(message, separators=(",", ":"), allow_nan=False).encode()
    if len(data) > limit:
        raise WireError(f"frame of {len(data)} bytes is over the {limit}-byte limit")
    return _HEADER.pack(len(data)) + data


def _depth_ok(raw: bytes) -> bool:
    """Whether ``raw``'s brackets nest at most ``MAX_DEPTH`` deep (strings aside), in a few
    C-speed passes: each round drops the innermost pairs; a run of more openers than the
    depth allows, a round that drops nothing, or too many brackets end it at once."""
    unescaped = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = _STRINGS.sub(b"", unescaped).translate(None, _NOT_BRACKETS)
    if len(brackets) > MAX_BRACKETS:
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


def decode(raw: bytes) -> dict[str, Any]:
    """One frame's JSON object; :class:`WireError` for anything else."""
    if not _depth_ok(raw):
        raise WireError(f"frame nests deeper than {MAX_DEPTH} levels")
    try:
        message = json.loads(raw, parse_constant=_no_constants)
    except (ValueError, RecursionError) as exc:
        raise WireError(f"frame is not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise WireError("frame is not a JSON object")
    return message


class FrameReader:
    """Turns bytes, as they come, into messages; ``limit``: the largest frame accepted."""

    def __init__(self, limit: int = MAX_FRAME) -> None:
        self._buffer = bytearray()
        self.limit = limit

    @property
    def pending(self) -> int:
        """Bytes received of frames not yet whole."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self._buffer += data
        messages = []
        while len(self._buffer) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self._buffer)
            if size > self.limit:
                raise WireError(f"frame of {size} bytes is over the {self.limit}-byte limit")
            if len(self._buffer) < _HEADER.size + size:
                break
            raw = bytes(self._buffer[_HEADER.size : _HEADER.size + size])
            del self._buffer[: _HEADER.size + size]
            messages.append(decode(raw))
        return messages
