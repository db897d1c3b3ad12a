"""The run's private directory: broker socket, simulated ledger, rank logs.

Each run gets its own 0700 directory, so concurrent runs never share a path. A
controller killed with SIGKILL cannot clean up after itself; the next run on the
machine removes directories whose owning process is gone.

Run directories live in ``$TMPDIR/pytest-gpu-<uid>``. Where that path is unusable (it
belongs to another user, is no directory, is not writable) a run uses a private
``$TMPDIR/pytest-gpu-<uid>-XXXX`` instead and says so in one line on stderr.

Many runs may start and sweep at once, so: the owner file appears whole (written aside,
then renamed); a directory without a readable owner file is being created as long as the
process its name carries is alive, or for ``GRACE_S`` after its last change; and
directories may vanish under a sweep (another run's sweep removed them).
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
import tempfile
import time
from contextlib import suppress
from pathlib import Path

from ..base.procs import owner_alive, read_owner, write_owner
from ..base.safefiles import user_temp_dir

OWNER_FILE = "owner.json"
GRACE_S = 60.0  # a run directory younger than this without an owner file is being created


class RunDirError(OSError):
    """No run directory can be made (temp dir full, read-only, missing); ``filename`` is where."""

    def __str__(self) -> str:
        where = f" in {self.filename}" if self.filename else ""
        return (
            f"pytest-gpu: cannot create the run directory{where}: {self.strerror}; "
            "point TMPDIR at a writable directory with free space"
        )


def _unusable(root: Path) -> str | None:
    """Why ``root`` cannot be a directory private to this user (after making it 0700), or None.

    Safe where other users can create names (``/tmp``): a symbolic link or a directory of
    theirs is refused, never followed or used.
    """
    try:
        root.mkdir(mode=0o700, exist_ok=True)
        info = root.lstat()
    except FileExistsError:
        return "is not a directory"
    except OSError as exc:
        return f"cannot be created ({exc.strerror or exc})"
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link"  # it could point anywhere, also to another user's directory
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    if info.st_uid != os.getuid():
        return f"belongs to another user (uid {info.st_uid})"
    try:
        os.chmod(root, 0o700)
    except OSError as exc:
        return f"is not usable ({exc.strerror or exc})"
    if not os.access(root, os.W_OK | os.X_OK):
        return "is not writable"
    return None


def base_dir() -> Path:
    """Parent of this run's directory: the shared per-user one, or a private fallback (0700)."""
    try:
        root = user_temp_dir()
    except OSError as exc:  # gettempdir: "No usable temporary directory found in [...]"
        raise RunDirError(exc.errno, exc.strerror or str(exc)) from exc
    why = _unusable(root)
    if why is None:
        return root
    try:
        fallback = Path(tempfile.mkdtemp(prefix=f"{root.name}-", dir=root.parent))
    except OSError as exc:
        raise RunDirError(exc.errno, exc.strerror or str(exc), str(root.parent)) from exc
    # not warnings.warn: a "filterwarnings = error" suite would turn it into an INTERNALERROR
    print(f"pytest-gpu: warning: {root} {why}; this run uses {fallback} instead", file=sys.stderr, flush=True)
    return fallback


def _is_fallback(root: Path) -> bool:
    return root.name.startswith(f"pytest-gpu-{os.getuid()}-")


def _roots() -> list[Path]:
    """Every parent of this user's run directories: the shared one and private fallbacks."""
    shared = user_temp_dir()
    found = []
    for root in [shared, *shared.parent.glob(f"{shared.name}-*")]:
        try:
            info = root.lstat()
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
            found.append(root)
    return found


def _stale(run: Path) -> bool:
    """Whether ``run`` was left by a process that is gone. FileNotFoundError: it vanished."""
    try:
        pid, ctime = read_owner(run / OWNER_FILE)
    except (OSError, ValueError, KeyError, TypeError):
        # no whole owner file: being created while its creator (the pid in its name) lives;
        # else (a creator that died early, a name we did not make) after the grace period
        _, _, rest = run.name.partition("-")
        creator = rest.partition("-")[0]
        if creator.isdigit() and owner_alive(int(creator), None):
            return False
        return time.time() - run.stat().st_mtime >= GRACE_S
    return not owner_alive(pid, ctime)  # unsure (AccessDenied): alive, never sweep a live run's directory


def sweep_stale(root: Path | None = None) -> list[Path]:
    """Remove run directories left by processes that no longer exist (in ``root``, or in all of this user's)."""
    removed = []
    for parent in [root] if root is not None else _roots():
        for run in parent.glob("run-*"):
            try:
                if run.is_dir() and _stale(run):
                    shutil.rmtree(run, ignore_errors=True)
                    removed.append(run)
            except FileNotFoundError:
                continue  # removed meanwhile by another run's sweep
        if root is None and _is_fallback(parent):  # a private fallback, maybe left by a killed run
            with suppress(OSError):  # not empty, or gone already
                if time.time() - parent.stat().st_mtime >= GRACE_S:
                    parent.rmdir()
    return removed


_made: dict[Path, tuple[int, int]] = {}  # each run directory this process made: (st_dev, st_ino)


def _make(root: Path) -> Path:
    run = Path(tempfile.mkdtemp(prefix=f"run-{os.getpid()}-", dir=root))
    try:
        info = run.lstat()
        _made[run] = (info.st_dev, info.st_ino)
        write_owner(run / OWNER_FILE)
    except BaseException:
        shutil.rmtree(run, ignore_errors=True)
        raise
    return run


def create() -> Path:
    """A fresh private directory for this run, owned by this process.

    Raises :class:`RunDirError` (an ``OSError``) naming the temp directory where none can be made.
    """
    attempt = 0
    while True:
        root = base_dir()
        sweep_stale()
        try:
            return _make(root)
        except OSError as exc:
            if _is_fallback(root):
                with suppress(OSError):
                    root.rmdir()  # our private fallback, empty again
            attempt += 1
            if not (isinstance(exc, FileNotFoundError) and attempt < 3):
                raise RunDirError(exc.errno, exc.strerror or str(exc), str(root)) from exc
            # else the parent vanished under us (removed by hand, or a stalled fallback swept): again


def remove(run: Path) -> None:
    """Remove run directory ``run`` (made by :func:`create`), only if its name still leads to the
    directory made: one put in its place (whoever owns the directory above may rename what is
    in it) is left alone, and said so in one line."""
    made = _made.pop(run, None)
    try:
        info = run.lstat()
    except FileNotFoundError:
        info = None
    if made is not None and info is not None and (info.st_dev, info.st_ino) != made:
        print(f"pytest-gpu: warning: {run} is not the run directory this run made; left as it is", file=sys.stderr)
        return
    shutil.rmtree(run, ignore_errors=True)
    if _is_fallback(run.parent):
        with suppress(OSError):
            run.parent.rmdir()  # the run's private fallback parent
