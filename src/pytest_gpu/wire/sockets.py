"""The Unix sockets frames travel on: who is at the other end, and addresses that always work.

A socket file's path may be longer than a socket address can be (108 bytes on Linux; a
run's sockets sit deep in ``$TMPDIR``): every bind and connect here goes through
:func:`reachable`, which reaches such a file through its directory's descriptor. An
abstract name (``"\\0..."``) is used as it is.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from collections.abc import Iterator

SHORT_ENOUGH = 100  # bytes of a path bound or connected as it is (the limit is 108, with its NUL)


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
    may be (temporary directories are deep)."""
    if address.startswith("\0") or len(os.fsencode(address)) < SHORT_ENOUGH:
        yield address
        return
    directory, name = os.path.split(address)
    fd = os.open(directory or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{name}"
    finally:
        os.close(fd)


def listen(address: str, backlog: int, private: bool = False) -> socket.socket:
    """A non-blocking listening socket at ``address``; ``private``: its file is made mode 0600
    (it sits in a 0700 directory too). ``OSError`` when it is taken (``EADDRINUSE``)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with reachable(address) as where:
            sock.bind(where)
        if private and not address.startswith("\0"):
            os.chmod(address, 0o600)
        sock.listen(backlog)
        sock.setblocking(False)  # accept() only when epoll says so, and never wait in it
    except OSError:
        sock.close()
        raise
    return sock


def connect(address: str, timeout: float | None) -> socket.socket:
    """A socket connected to ``address`` (within ``timeout`` seconds), left blocking."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        with reachable(address) as where:
            sock.connect(where)
        sock.settimeout(None)
    except OSError:
        sock.close()
        raise
    return sock


def unlink(address: str) -> None:
    """Remove a socket file (an abstract name has none)."""
    if not address.startswith("\0"):
        with contextlib.suppress(OSError):
            os.unlink(address)
