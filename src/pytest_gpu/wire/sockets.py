"""The Unix sockets frames travel on: who is at the other end, and addresses ``bind`` and ``connect`` can take."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from collections.abc import Iterator


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix socket, as the kernel says
    (Linux); (0, -1) where it cannot."""
    so_peercred = getattr(socket, "SO_PEERCRED", None)
    if so_peercred is None:
        return 0, -1
    try:
        pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, so_peercred, struct.calcsize("3i")))
    except OSError:
        return 0, -1
    return pid, uid


@contextlib.contextmanager
def reachable(address: str) -> Iterator[str]:
    """``address`` as ``bind``/``connect`` can take it: an abstract name as it is, a socket
    file through its directory's descriptor when its path is longer than a socket address
    may be (108 bytes; temporary directories of tests are deep)."""
    if address.startswith("\0") or len(os.fsencode(address)) < 100:
        yield address
        return
    directory, name = os.path.split(address)
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{name}"
    finally:
        os.close(fd)
