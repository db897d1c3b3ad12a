"""Frames between runs and the arbiter: a 4-byte length, then JSON.

JSON, not pickle: the arbiter may serve another user's runs, and nothing received from a
socket may run code. Frames are at most ``MAX_FRAME`` bytes; a reader that is fed bytes
as they arrive never blocks on a peer that stops half-way through a frame.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

from ..leasing.requests import GpuRequest

MAX_FRAME = 1 << 20
_HEADER = struct.Struct(">I")


class WireError(ValueError):
    """A frame that is too large or not JSON: the peer is dropped."""


def encode(message: dict[str, Any]) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    if len(data) > MAX_FRAME:
        raise WireError(f"frame of {len(data)} bytes is over the {MAX_FRAME}-byte limit")
    return _HEADER.pack(len(data)) + data


class FrameReader:
    """Turns bytes, as they come, into messages."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self._buffer += data
        messages = []
        while len(self._buffer) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self._buffer)
            if size > MAX_FRAME:
                raise WireError(f"frame of {size} bytes is over the {MAX_FRAME}-byte limit")
            if len(self._buffer) < _HEADER.size + size:
                break
            raw = bytes(self._buffer[_HEADER.size : _HEADER.size + size])
            del self._buffer[: _HEADER.size + size]
            try:
                message = json.loads(raw)
            except ValueError as exc:
                raise WireError(f"frame is not JSON: {exc}") from exc
            if not isinstance(message, dict):
                raise WireError("frame is not a JSON object")
            messages.append(message)
        return messages


def request_to_wire(request: GpuRequest) -> list[Any]:
    """``[count, memory, exclusive, min_memory]``, then ``cpus, host_memory`` only when the
    request leases host resources (what an older peer reads is unchanged otherwise)."""
    shape = [request.count, request.memory, request.exclusive, request.min_memory]
    if request.host:
        shape += [request.cpus, request.host_memory]
    return shape


def request_from_wire(data: list[Any] | tuple[Any, ...]) -> GpuRequest:
    """The inverse of :func:`request_to_wire`: 4 fields (no host part) or 6."""
    if len(data) not in (4, 6):
        raise WireError(f"a request has 4 or 6 fields, got {len(data)}")
    count, memory, exclusive, min_memory = data[:4]
    cpus, host_memory = data[4:] if len(data) == 6 else (0, 0)
    return GpuRequest(
        count=int(count),
        memory=memory,
        exclusive=bool(exclusive),
        min_memory=min_memory,
        cpus=int(cpus),
        host_memory=int(host_memory),
    )


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix socket (Linux); (0, -1) elsewhere."""
    so_peercred = getattr(socket, "SO_PEERCRED", None)
    if so_peercred is None:
        return 0, -1
    try:
        pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, so_peercred, struct.calcsize("3i")))
    except OSError:
        return 0, -1
    return pid, uid
