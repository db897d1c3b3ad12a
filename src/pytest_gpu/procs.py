"""Processes this package started or recorded: ending them, and telling whether one still runs.

Rank pools and the Ray head end their process trees one way (:func:`kill_and_wait`).
Run directories, the Ray head's watchdog, the simulated GPUs' ledger, shared artifacts'
builders and the machine's attached runs (foreign usage) all record a
process as ``(pid, create time)`` and later ask whether *that* process still runs, not
some later one that got the same pid (:func:`owner_alive`). psutil is imported on use:
the plugin loads this module into every pytest process.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    """This process's live descendants: pid -> create time."""
    import psutil

    found: dict[int, float] = {}
    for child in psutil.Process().children(recursive=True):
        try:
            found[child.pid] = child.create_time()
        except psutil.Error:  # gone since it was listed
            continue
    return found


def process_name(pid: int) -> str:
    """``pid``'s name as ``ps`` shows it ("gone" when it cannot be read)."""
    import psutil

    try:
        return str(psutil.Process(pid).name())
    except psutil.Error:
        return "gone"
