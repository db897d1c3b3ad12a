"""Where the runs of one machine meet: a directory every user can reach, and its names.

A *domain* is a set of GPUs that runs must share: the machine's real GPUs (``gpus``),
or one simulated machine (``sim-<name>``, see :func:`sim_machine_name`). Its directory
holds the arbiter's lock, the runs' membership locks and, for a simulated machine, the
simulated GPUs' ledger.

The root is ``$PYTEST_GPU_MACHINE_DIR`` or ``/tmp/pytest-gpu-machines`` (not ``$TMPDIR``:
users with different temp directories must still meet). It is made sticky and
world-writable like ``/tmp`` itself, so each user's runs can add their own files and no
one can remove another user's. Where it cannot be used that way (it belongs to another
user and is not sticky and world-writable, or is a symbolic link) the runs of this user
coordinate only among themselves, in a private directory, and say so once.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import stat
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT_ENV = "PYTEST_GPU_MACHINE_DIR"
SIM_MACHINE_ENV = "PYTEST_GPU_SIM_MACHINE"
DEFAULT_ROOT = "/tmp/pytest-gpu-machines"
REAL = "gpus"

_warned: set[str] = set()


class DomainError(OSError):
    """The machine directory cannot be made at all; ``filename`` is where."""

    def __str__(self) -> str:
        return (
            f"pytest-gpu: cannot create the machine directory {self.filename}: {self.strerror}; "
            f"set {ROOT_ENV} to a writable directory"
        )


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "_"


def user_name(uid: int | None = None) -> str:
    """The name of user ``uid`` (default: this process's), or the number where it has none."""
    uid = os.getuid() if uid is None else uid
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return str(uid)


def sim_machine_name(spec: str) -> str:
    """The simulated machine a run on ``spec`` uses: ``$PYTEST_GPU_SIM_MACHINE``, or one per
    user and spec (``<user>-<spec>``)."""
    named = os.environ.get(SIM_MACHINE_ENV, "").strip()
    return _safe(named) if named else _safe(f"{user_name()}-{spec}")


def shared_problem(path: Path, mode: int) -> tuple[int, str] | None:
    """After ``path`` was made (``mkdir``): why it is not a directory every user can write
    with ``mode`` (``0o1777``: sticky, like ``/tmp``), as (errno, why), or None.

    Ours: given ``mode`` (``mkdir``'s went through the umask). Another user's: its creator
    makes it shared right after its ``mkdir``, so one that is not shared yet is waited for,
    briefly. OSError: it vanished meanwhile."""
    sticky = bool(mode & stat.S_ISVTX)
    deadline = time.monotonic() + 2.0
    while True:
        info = path.lstat()
        if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
            return errno.ENOTDIR, "is not a directory"
        current = stat.S_IMODE(info.st_mode)
        if current == mode:
            return None
        if info.st_uid == os.getuid():
            try:
                os.chmod(path, mode)
            except OSError as exc:
                return exc.errno or errno.EACCES, f"cannot be shared ({exc.strerror or exc})"
            return None
        if current & mode == mode:
            return None  # another user's, and as open as asked (or more)
        if time.monotonic() > deadline:
            wanted = "sticky and world-writable" if sticky else "writable by every user"
            return errno.EACCES, f"belongs to another user (uid {info.st_uid}) and is not {wanted}"
        time.sleep(0.02)


def _shared_ok(path: Path) -> str | None:
    """Why ``path`` cannot be a shared (sticky, world-writable) directory, or None (made so)."""
    try:
        path.mkdir(mode=0o1777, exist_ok=True)
        problem = shared_problem(path, 0o1777)
    except FileExistsError:
        return "is not a directory"
    except OSError as exc:
        return f"cannot be created ({exc.strerror or exc})"
    return None if problem is None else problem[1]


def make_shared(path: Path) -> None:
    """Make ``path`` a shared (sticky, world-writable) directory, or raise :class:`DomainError`."""
    why = _shared_ok(path)
    if why is not None:
        raise DomainError(0, why, str(path))


def root() -> Path:
    """The directory where every run of this machine meets (made on first use)."""
    configured = os.environ.get(ROOT_ENV)
    path = Path(configured) if configured else Path(DEFAULT_ROOT)
    why = _shared_ok(path)
    if why is None:
        return path
    private = Path(os.path.expanduser("~")) / ".cache" / "pytest-gpu" / "machines"
    try:
        private.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise DomainError(exc.errno, exc.strerror or str(exc), str(private)) from exc
    if str(path) not in _warned:
        _warned.add(str(path))
        # not warnings.warn: a "filterwarnings = error" suite would turn it into an INTERNALERROR
        print(
            f"pytest-gpu: warning: {path} {why}; this user's runs share GPUs only among themselves (through {private})",
            file=sys.stderr,
            flush=True,
        )
    return private


@dataclass(frozen=True)
class Domain:
    """One set of GPUs that runs share, and its directory."""

    name: str
    path: Path

    @classmethod
    def named(cls, name: str) -> Domain:
        path = root() / _safe(name)
        make_shared(path)
        return cls(name, path)

    @classmethod
    def real(cls) -> Domain:
        return cls.named(REAL)

    @classmethod
    def sim(cls, spec: str) -> Domain:
        return cls.named(f"sim-{sim_machine_name(spec)}")

    @property
    def lock_path(self) -> Path:
        """Held (``flock``) by the run that is the domain's arbiter."""
        return self.path / "arbiter.lock"

    @property
    def runs_path(self) -> Path:
        """One file per attached run, each ``flock``-ed by its run while it lives."""
        return self.path / "runs"

    @property
    def ledger_path(self) -> Path:
        """The simulated GPUs' ledger, for a simulated machine."""
        return self.path / "sim-ledger"

    def address(self) -> str:
        """The arbiter's socket: an abstract Unix socket named after this directory's lock
        file (no file to leave behind or to be unable to replace: it vanishes with its
        process, whoever the owner)."""
        info = self.lock_path.stat()
        digest = hashlib.sha1(f"{info.st_dev}:{info.st_ino}:{self.path}".encode()).hexdigest()[:20]
        return f"\0pytest-gpu-{digest}"
