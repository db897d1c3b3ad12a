"""The run's private directory: broker socket, simulated ledger, rank logs.

Each run gets its own 0700 directory, so concurrent runs never share a path. A
controller killed with SIGKILL cannot clean up after itself; the next run on the
machine removes directories whose owning process is gone.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

OWNER_FILE = "owner.json"


def base_dir() -> Path:
    """Per-user parent of all run directories (0700)."""
    root = Path(tempfile.gettempdir()) / f"pytest-gpu-{os.getuid()}"
    root.mkdir(mode=0o700, exist_ok=True)
    if root.stat().st_uid != os.getuid():
        raise RuntimeError(f"{root} belongs to another user; refusing to use it")
    os.chmod(root, 0o700)
    return root


def _owner_alive(run: Path) -> bool:
    import psutil

    try:
        owner = json.loads((run / OWNER_FILE).read_text())
        proc = psutil.Process(int(owner["pid"]))
        return proc.create_time() == owner["ctime"] and proc.status() != psutil.STATUS_ZOMBIE
    except (OSError, ValueError, KeyError, psutil.Error):
        return False


def sweep_stale(root: Path | None = None) -> list[Path]:
    """Remove run directories left by processes that no longer exist."""
    removed = []
    for run in (root or base_dir()).glob("run-*"):
        if not run.is_dir():
            continue
        if not (run / OWNER_FILE).exists() and time.time() - run.stat().st_mtime < 60:
            continue  # being created by a run that has not written its owner file yet
        if not _owner_alive(run):
            shutil.rmtree(run, ignore_errors=True)
            removed.append(run)
    return removed


def create() -> Path:
    """A fresh private directory for this run, owned by this process."""
    root = base_dir()
    sweep_stale(root)
    run = Path(tempfile.mkdtemp(prefix=f"run-{os.getpid()}-", dir=root))
    import psutil

    me = psutil.Process()
    (run / OWNER_FILE).write_text(json.dumps({"pid": me.pid, "ctime": me.create_time()}))
    return run


def remove(run: Path) -> None:
    shutil.rmtree(run, ignore_errors=True)
