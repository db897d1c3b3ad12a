"""Stopping the run's head, and finding the processes that belong to it.

The head is stopped by the process that owns the run directory, the xdist controller or
the single pytest process, in its ``pytest_unconfigure`` (:func:`stop_head`). That
process outlives every worker (the worker that started the head may finish while others
still use it) and runs no Ray driver of its own under xdist. Each test process only
disconnects (``ray.shutdown()``) when its session ends.

``ray stop`` is not used: it stops *every* Ray process of the user on the machine, an
external cluster included. The head runs in a process session of its own, led by its
watchdog (:mod:`.watchdog`), so stopping it means: ask the watchdog (it drains the head),
then SIGKILL what is left of that session, and nothing else.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterable, Mapping
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from ..base.procs import kill_and_wait, owner_alive
from ..gpu.verification import release_processes
from ..run.feature import Feature
from ..run.holding import Owner
from .head import STATE_FILE
from .readiness import disconnect

if TYPE_CHECKING:  # psutil, like Ray, is imported where it is used: the plugin loads this package
    import psutil

    from ..run.session import GpuRun

# who holds the head's ports while it starts, and answers for its processes (gpu.verification.claimed)
RAY_HEAD = Owner("ray", "the run's Ray head")
STOP_GRACE = 15.0  # seconds the head may take to drain after SIGTERM before it is killed
# watchdogs this process started: reaped when stopped, so no "still running" ResourceWarning
WATCHDOGS: dict[int, subprocess.Popen[bytes]] = {}


class RayHead(Feature):
    """The feature's hook object in the process that owns the run: the head a test started is
    stopped when the run ends, before the run (and its directory) closes."""

    def pytest_unconfigure(self) -> None:
        if self.has_run:  # (none when pytest_configure failed)
            stop_head(self.run)


def stop_head(run: GpuRun) -> None:
    """At the end of the run, in the process that owns the run directory: stop our head.

    A no-op in xdist workers, when no test asked for ``ray_cluster``, and for an external
    cluster (no record is written for one). Does not import Ray.
    """
    if run.broker is None:
        return
    state_path = run.run_dir / STATE_FILE
    try:
        record = json.loads(state_path.read_text())
    except (OSError, ValueError):
        return
    disconnect()
    stop(record)
    state_path.unlink(missing_ok=True)


def stop(record: Mapping[str, Any]) -> None:
    """Stop the head of ``record`` (``ray-head.json``): its watchdog, its session, its temp dir."""
    import psutil

    pid = record.get("watchdog")
    if not isinstance(pid, int):
        return
    ctime = float(record.get("ctime", 0.0))
    watchdog = None
    if owner_alive(pid, ctime):  # still the watchdog we started, not a process that got its pid
        with suppress(psutil.Error):
            watchdog = psutil.Process(pid)
    if watchdog is not None:
        with suppress(psutil.Error):  # TimeoutExpired too: what is left is killed below
            watchdog.terminate()  # it drains the head, then kills what is left of its session
            watchdog.wait(STOP_GRACE + 5)
    kill_session(pid, ctime)
    release_processes([pid])  # claimed by startonce when it started the watchdog
    child = WATCHDOGS.pop(pid, None)
    if child is not None:
        child.poll()  # reaped; no "still running" ResourceWarning later
    if record.get("separate_temp_dir"):
        import shutil

        shutil.rmtree(str(record["temp_dir"]), ignore_errors=True)


def session_processes(sid: int, since: float = 0.0, exclude: Iterable[int] = ()) -> list[psutil.Process]:
    """Live processes of session ``sid`` started at or after ``since`` (not zombies)."""
    import psutil

    skip = set(exclude)
    found = []
    for proc in psutil.process_iter(["create_time", "status"]):
        if proc.pid in skip:
            continue
        try:
            if os.getsid(proc.pid) != sid:
                continue
        except OSError:
            continue
        if proc.info["status"] == psutil.STATUS_ZOMBIE or (proc.info["create_time"] or 0.0) < since - 0.01:
            continue
        found.append(proc)
    return found


def kill_session(sid: int, since: float = 0.0, exclude: Iterable[int] = ()) -> None:
    """SIGKILL every live process of session ``sid`` (started since ``since``), and wait for them."""
    kill_and_wait(session_processes(sid, since, exclude))


def process_name(proc: psutil.Process) -> str:
    """``proc``'s name, ``""`` once it is gone."""
    import psutil

    try:
        return str(proc.name())
    except psutil.Error:
        return ""
