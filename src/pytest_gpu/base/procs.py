"""Processes this package started or recorded: ending them, and telling whether one still runs.

Rank pools and the Ray head end their process trees one way (:func:`kill_and_wait`).
Run directories, the Ray head's watchdog, the simulated GPUs' ledger, shared artifacts'
builders and the machine's attached runs (foreign usage) all record a
process as ``(pid, create time)`` and later ask whether *that* process still runs, not
some later one that got the same pid (:func:`owner_alive`); run directories and a run's own
simulated machines keep it in an owner file (:func:`write_owner`, :func:`read_owner`). psutil is imported on use:
the plugin loads this module into every pytest process.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import psutil

# psutil's create_time is the process's start in clock ticks since boot plus the boot time
# from /proc/stat: whole seconds, re-read on every call, and moved when the wall clock is
# stepped or slewed (NTP). The same process can therefore read a whole second off what was
# recorded (plus float noise from adding ~1.7e9). A reused pid within 1.5 s of the recorded
# start would need the whole pid space to wrap in that time, so the slack costs nothing.
CTIME_TOLERANCE_S = 1.5


def started_at(proc: psutil.Process, ctime: float, tolerance: float = CTIME_TOLERANCE_S) -> bool:
    """Whether ``proc`` is the process recorded as started at ``ctime`` (not a reused pid)."""
    return abs(proc.create_time() - ctime) <= tolerance


def owner_alive(pid: int, ctime: float | None, *, tolerance: float = CTIME_TOLERANCE_S, unsure: bool = True) -> bool:
    """Whether process ``pid``, started at ``ctime`` (psutil's ``create_time``), still runs.

    A zombie counts as gone (it has exited, only its parent has not reaped it), and so does
    a process under that pid that started at another time (the pid was reused).
    ``ctime=None`` checks the pid only. ``unsure`` is the answer where psutil may not look
    at the process (``AccessDenied``): a caller that would destroy something of a live
    process on ``False`` keeps the default.
    """
    import psutil

    try:
        proc = psutil.Process(pid)
        if ctime is not None and not started_at(proc, ctime, tolerance):
            return False
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # ZombieProcess too
        return False
    except psutil.Error:
        return unsure


def write_owner(path: Path) -> None:
    """Make this process ``path``'s owner: its pid and create time as JSON, written aside and
    renamed into place, so that a reader (a sweep) never sees half an owner file."""
    import psutil

    me = psutil.Process()
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    tmp.write_text(json.dumps({"pid": me.pid, "ctime": me.create_time()}))
    os.replace(tmp, path)


def read_owner(path: Path) -> tuple[int, float]:
    """``(pid, create time)`` of the owner that ``path`` names (see :func:`write_owner`).

    Raises OSError (no such file), ValueError, KeyError or TypeError (not an owner file)."""
    owner = json.loads(path.read_text())
    return int(owner["pid"]), float(owner["ctime"])


def kill_and_wait(procs: Sequence[psutil.Process], timeout: float = 5.0) -> None:
    """SIGKILL every process of ``procs`` still alive, then wait up to ``timeout`` for them all."""
    import psutil

    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=timeout)


def descendants() -> dict[int, float]:
    """This process's live descendants: pid -> create time.

    Read through Linux's ``/proc/<pid>/task/<tid>/children`` where the kernel has it: the
    cost grows with the tree, not with every process of the machine (psutil's
    ``children(recursive=True)``, the fallback, reads all of ``/proc``: milliseconds on a
    busy machine, twice per GPU test)."""
    import psutil

    tree = _tree_from_proc(os.getpid())
    pids = tree if tree is not None else [child.pid for child in psutil.Process().children(recursive=True)]
    found: dict[int, float] = {}
    for pid in pids:
        try:
            found[pid] = psutil.Process(pid).create_time()
        except psutil.Error:  # gone since it was listed
            continue
    return found


def _tree_from_proc(root: int) -> list[int] | None:
    """The descendants of ``root`` from the kernel's per-thread children lists; ``None``
    where the kernel has none (built without ``CONFIG_PROC_CHILDREN``, or no ``/proc``)."""
    if not os.path.exists(f"/proc/{root}/task/{root}/children"):
        return None
    found: list[int] = []
    pending = [root]
    while pending:
        pid = pending.pop()
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:  # it ended meanwhile: so did the list of its children
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/children", "rb") as fh:
                    kids = [int(k) for k in fh.read().split()]
            except (OSError, ValueError):
                continue
            for kid in kids:
                if kid not in found:
                    found.append(kid)
                    pending.append(kid)
    return found


def process_name(pid: int) -> str:
    """``pid``'s name as ``ps`` shows it ("gone" when it cannot be read)."""
    import psutil

    try:
        return str(psutil.Process(pid).name())
    except psutil.Error:
        return "gone"
