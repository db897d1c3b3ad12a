"""Files and directories in places other local users can write, handled so they cannot redirect us.

In a sticky world-writable directory (``/tmp``) any user may create any name before we
do: a symbolic link to one of our files, a FIFO that blocks an ``open``, a directory we
then write into. The rules here, for every layer:

- a name is never followed: every ``open`` has ``O_NOFOLLOW`` (and ``O_NONBLOCK``, so a
  planted FIFO cannot block it), and what it opened is checked on the descriptor (a
  regular file; owned by whom it must be) before it is used;
- a file is created with ``O_CREAT | O_EXCL``, and its mode set with ``fchmod`` on the
  descriptor, never by path;
- a file is replaced whole by a temporary file of an unpredictable name, created so, then
  renamed over it: inside a directory only its owner(s) can write;
- a directory someone else owns, a symbolic link, or anything else where a directory of
  ours belongs is refused with :class:`Unsafe`, which says why; callers fall back to a
  place of their own;
- whoever owns a directory may rename anything in it, ours included: a directory of ours
  there is checked once and then used through its descriptor (``dir_fd``), and an existing
  directory is never opened up (:func:`group_dir`);
- a library or program is used only where it and every directory above it up to a base
  of ours are ours and no one else's to write (:func:`own_tree`, :func:`open_own_file`).

What the kernel vouches for (ownership read with ``fstat`` on an open descriptor) is
identity; a name is only a claim.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import stat
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class Unsafe(OSError):
    """A path that another user could redirect or tamper with; ``filename`` is where, ``strerror`` why."""

    def __str__(self) -> str:
        return f"{self.filename} {self.strerror}"


def _refuse(path: Path | str, why: str, code: int = errno.EPERM) -> Unsafe:
    return Unsafe(code, why, str(path))


def _owner_name(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def user_temp_dir() -> Path:
    """``$TMPDIR/pytest-gpu-<uid>``: this user's name in the temporary directory every user
    shares (its run directories, the fake libraries' cache), not yet made nor checked.
    :class:`OSError` where there is no usable temporary directory."""
    return Path(tempfile.gettempdir()) / f"pytest-gpu-{os.getuid()}"


def private_dir(path: Path) -> Path:
    """``path`` as a directory of this user's that no one else can enter (0700), made if missing.

    Raises :class:`Unsafe` when it is a symbolic link, not a directory, or another user's;
    :class:`OSError` when it cannot be made."""
    os.close(open_private_dir(path))
    return path


def open_private_dir(path: Path) -> int:
    """A descriptor of ``path`` as :func:`private_dir` makes it: what was checked is what the
    caller holds, whatever the name leads to later (whoever owns the directory above may
    rename what is in it)."""
    with suppress(FileExistsError):
        os.mkdir(path, 0o700)
    fd = open_dir(path)
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid():
            raise _refuse(path, f"belongs to another user, {_owner_name(info.st_uid)}")
        if stat.S_IMODE(info.st_mode) != 0o700:
            os.fchmod(fd, 0o700)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _only_mine(fd: int, path: Path | str) -> None:
    info = os.fstat(fd)
    if info.st_uid != os.geteuid():
        raise _refuse(path, f"belongs to another user, {_owner_name(info.st_uid)}")
    if info.st_mode & 0o022:
        raise _refuse(path, f"can be written by other users (mode {stat.S_IMODE(info.st_mode):o})", errno.EACCES)


def own_tree(base: Path, parts: Sequence[str]) -> Path:
    """``base / parts...``: directories that are this user's and no one else's to write, those
    of ``parts`` made (0700) where missing.

    Each is opened from the one above it, without following a link, and checked on its
    descriptor: this user's, not writable by group or others (``base`` included: a
    world-writable ``$HOME=/tmp`` is refused, as is a name there another user took). So no
    one else can add, replace or rename anything below ``base``. :class:`Unsafe` says which
    one is not so, :class:`OSError` where one cannot be made."""
    fd = open_dir(base)
    path = base
    try:
        _only_mine(fd, path)
        for part in parts:
            with suppress(FileExistsError):
                os.mkdir(part, 0o700, dir_fd=fd)
            path = path / part
            inner = open_dir(part, dir_fd=fd, shown=path)
            os.close(fd)
            fd = inner
            _only_mine(fd, path)
    finally:
        os.close(fd)
    return path


def open_own_file(path: Path | str) -> int:
    """Open regular file ``path`` for reading, without following a link, where it is this user's
    and no one else can write it (:class:`Unsafe` otherwise): a library to load, a program to run."""
    fd = open_file(path, owner=os.geteuid())
    try:
        _only_mine(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def shared_dir(path: Path, mode: int = 0o1777) -> Path:
    """``path`` as a directory every user may add to, like ``/tmp`` (sticky: no one removes
    another's entries), made if missing; whoever made it.

    Ours: given ``mode`` (``mkdir``'s went through the umask). Another user's: it must be at
    least as open and sticky already (its creator sets the mode right after ``mkdir``: one
    that is not yet is refused; a later run finds it right). Raises :class:`Unsafe` otherwise."""
    with suppress(FileExistsError):
        os.mkdir(path, mode & 0o777)
    fd = open_dir(path)
    try:
        info = os.fstat(fd)
        current = stat.S_IMODE(info.st_mode)
        if info.st_uid == os.geteuid():
            if current != mode:
                os.fchmod(fd, mode)
        elif current & mode != mode:
            wanted = "sticky and world-writable" if mode & stat.S_ISVTX else f"mode {mode:o}"
            raise _refuse(path, f"belongs to {_owner_name(info.st_uid)} and is not {wanted}", errno.EACCES)
    finally:
        os.close(fd)
    return path


def group_dir(path: Path, gid: int) -> Path:
    """``path`` as a directory that the members of group ``gid`` share and no one else
    enters (02770, that group), made if missing.

    Only a directory this call made is given the group and mode: one that exists is used as
    it is or refused, never opened up. Whoever owns the directory ``path`` is in may rename
    any entry there (another of this user's directories, a private one, to ``path``), so a
    directory found under the name is not trusted to be a group directory because it is
    this user's; and one made here must still be empty when it is opened (a full one was
    swapped in between ``mkdir`` and ``open``). One that others can write, of another group,
    not yet the group's (a private directory), or not a directory, is refused with :class:`Unsafe`."""
    created = False
    try:
        os.mkdir(path, 0o700)
        created = True
    except FileExistsError:
        pass
    fd = open_dir(path)
    try:
        info = os.fstat(fd)
        if created and info.st_uid == os.geteuid() and not os.listdir(fd):
            if info.st_gid != gid:
                os.fchown(fd, -1, gid)
            os.fchmod(fd, 0o2770)
            info = os.fstat(fd)
        mode = stat.S_IMODE(info.st_mode)
        if info.st_gid != gid:
            raise _refuse(path, f"belongs to group {info.st_gid}, not {gid} (left as it is)")
        if mode & 0o007 or mode & 0o070 != 0o070:
            raise _refuse(
                path,
                f"has mode {mode:o}: expected 2770 (the group's, no one else's); left as it is "
                "(a directory found there is never opened up: remove it if it is a group's that was never finished)",
            )
    finally:
        os.close(fd)
    return path


def open_dir(path: Path | str, *, dir_fd: int | None = None, shown: Path | str | None = None) -> int:
    """A descriptor of directory ``path``, which must not be a symbolic link (:class:`Unsafe`,
    naming ``shown``, else ``path``); ``dir_fd``: as for :func:`open_file`."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            named = path if shown is None else shown
            raise _refuse(named, "is a symbolic link or not a directory", exc.errno) from None
        raise


def _checked(fd: int, path: Path | str, owner: int | None) -> int:
    info = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(info.st_mode):
        problem = "is not a regular file"
    elif owner is not None and info.st_uid != owner:
        problem = f"belongs to {_owner_name(info.st_uid)}"
    if problem is not None:
        os.close(fd)
        raise _refuse(path, problem)
    return fd


def open_file(
    path: Path | str, flags: int = os.O_RDONLY, *, owner: int | None = None, dir_fd: int | None = None
) -> int:
    """Open an existing regular file without following a link; ``owner``: the uid it must have.

    ``dir_fd`` (here and below): a descriptor of the directory a relative ``path`` is in: a
    directory checked once and then used through it, whatever its name leads to later."""
    try:
        fd = os.open(path, flags | _NOFOLLOW, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refuse(path, "is a symbolic link", exc.errno) from None
        raise
    fd = _checked(fd, path, owner)
    os.set_blocking(fd, True)
    return fd


def create_file(path: Path | str, mode: int, flags: int = os.O_WRONLY, *, dir_fd: int | None = None) -> int:
    """Create ``path`` (it must not exist: ``FileExistsError``) with exactly ``mode``, whatever the umask."""
    fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | _NOFOLLOW, mode & 0o777, dir_fd=dir_fd)
    os.set_blocking(fd, True)
    try:
        os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_or_create(
    path: Path | str, mode: int, flags: int = os.O_RDWR, *, owner: int | None = None, dir_fd: int | None = None
) -> int:
    """Open regular file ``path``, creating it with ``mode`` if missing; never through a link.

    ``owner``: the uid an existing file must have (``None``: anyone's)."""
    for _ in range(8):  # it may appear or vanish between the two tries
        try:
            return create_file(path, mode, flags, dir_fd=dir_fd)
        except FileExistsError:
            pass
        try:
            return open_file(path, flags, owner=owner, dir_fd=dir_fd)
        except FileNotFoundError:
            continue
    raise _refuse(path, "keeps appearing and vanishing", errno.EAGAIN)


def read_bytes(path: Path | str, limit: int, *, owner: int | None = None, dir_fd: int | None = None) -> bytes:
    """The content of regular file ``path`` (at most ``limit`` bytes, else :class:`Unsafe`)."""
    fd = open_file(path, owner=owner, dir_fd=dir_fd)
    try:
        # asked for by its size, not the limit: a read of ``limit`` bytes allocates that much
        # first (a 16 MiB limit: ~12 µs of every small file's read)
        parts = [os.read(fd, min(os.fstat(fd).st_size, limit) + 1)]
        total = len(parts[0])
        while parts[-1] and total <= limit:  # it grew since, or its size says nothing (procfs)
            parts.append(os.read(fd, min(limit + 1 - total, 1 << 20)))
            total += len(parts[-1])
        data = b"".join(parts)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise _refuse(path, f"is larger than {limit} bytes", errno.EFBIG)
    return data


def write_new(path: Path | str, data: bytes, mode: int, *, dir_fd: int | None = None) -> None:
    """Create ``path`` (never there before: :func:`create_file`) and write ``data`` to it whole;
    a write that fails removes what it created."""
    fd = create_file(path, mode, dir_fd=dir_fd)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
    except BaseException:
        with suppress(OSError):
            os.unlink(path, dir_fd=dir_fd)
        raise


def replace_file(path: Path, data: bytes, mode: int, *, dir_fd: int | None = None) -> None:
    """Write ``path`` whole: to a temporary file of an unpredictable name, then renamed over it.

    For directories only their owner(s) can write: in a sticky directory the rename fails
    when ``path`` is someone else's (and is never followed if it is a link)."""
    temp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    write_new(temp, data, mode, dir_fd=dir_fd)
    try:
        os.replace(temp, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with suppress(OSError):
            os.unlink(temp, dir_fd=dir_fd)
        raise


@contextmanager
def locked(path: Path, mode: int = 0o600, *, owner: int | None = None, dir_fd: int | None = None) -> Iterator[int]:
    """An exclusive ``flock`` on regular file ``path`` (created with ``mode`` if missing) while
    the block runs; the kernel drops it if the process dies. A file that cannot be opened for
    writing (another user's) is locked through a read-only descriptor: ``flock`` needs none."""
    try:
        fd = open_or_create(path, mode, owner=owner, dir_fd=dir_fd)
    except PermissionError:
        fd = open_file(path, os.O_RDONLY, owner=owner, dir_fd=dir_fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)
