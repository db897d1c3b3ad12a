"""``procs``: whether a recorded process (pid + create time) still runs, and ending processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest

from helpers import patience
from pytest_gpu.base import procs
from pytest_gpu.base.procs import CTIME_TOLERANCE_S, kill_and_wait, owner_alive

ME = os.getpid()


@pytest.fixture
def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: the pid is free
    return proc.pid


@pytest.fixture
def zombie() -> Iterator[subprocess.Popen[bytes]]:
    """A child that has exited and is not reaped yet."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + patience(10)
    while psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the child did not exit"
        time.sleep(0.01)
    yield proc
    proc.wait()


def test_a_live_process_with_its_create_time_is_alive() -> None:
    assert owner_alive(ME, psutil.Process(ME).create_time())
    assert owner_alive(ME, None)  # the pid alone


def test_a_dead_pid_is_not_alive(dead_pid: int) -> None:
    assert not owner_alive(dead_pid, None)
    assert not owner_alive(dead_pid, 1.0)


def test_a_zombie_is_not_alive(zombie: subprocess.Popen[bytes]) -> None:
    assert not owner_alive(zombie.pid, psutil.Process(zombie.pid).create_time())
    assert not owner_alive(zombie.pid, None)


@pytest.mark.parametrize("off", [-3600.0, -2 * CTIME_TOLERANCE_S, 2 * CTIME_TOLERANCE_S])
def test_a_reused_pid_with_another_create_time_is_not_alive(off: float) -> None:
    assert not owner_alive(ME, psutil.Process(ME).create_time() + off)


@pytest.mark.parametrize("off", [-1.0, 1.0, 0.004])
def test_a_boot_time_that_moved_a_second_is_the_same_process(off: float) -> None:
    # /proc/stat's btime is whole seconds and follows the wall clock: a recorded create time
    # can be a second off the one psutil reads now for the very same process
    assert owner_alive(ME, psutil.Process(ME).create_time() + off)
    assert not owner_alive(ME, psutil.Process(ME).create_time() + off, tolerance=0.001)


def test_a_process_that_may_not_be_inspected_is_what_the_caller_says(monkeypatch: pytest.MonkeyPatch) -> None:
    def denied(self: psutil.Process) -> float:
        raise psutil.AccessDenied(self.pid)

    monkeypatch.setattr(psutil.Process, "create_time", denied)
    assert owner_alive(ME, 1.0)
    assert not owner_alive(ME, 1.0, unsure=False)


def test_kill_and_wait_ends_live_processes_and_skips_gone_ones() -> None:
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    short = subprocess.Popen([sys.executable, "-c", "pass"])
    procs = [psutil.Process(live.pid), psutil.Process(short.pid)]
    short.wait()  # gone before the kill: its kill() raises NoSuchProcess
    try:
        kill_and_wait(procs, timeout=10)
        assert not procs[0].is_running()
    finally:
        live.kill()
        live.wait()


def test_foreign_usage_knows_its_own_run_through_a_second_of_clock_step() -> None:
    """descends_from compares a root's recorded start with the same tolerance as owner_alive:
    an exact comparison counted the run's own processes as foreign after an NTP step."""
    from pytest_gpu.gpu.foreign import descends_from

    me = os.getpid()
    start = psutil.Process(me).create_time()
    assert descends_from(me, {me: start + 1.0})
    assert not descends_from(me, {me: start + 100.0})  # another process that had the pid


@pytest.mark.parametrize("kernel_lists", [True, False], ids=["proc-children", "psutil"])
def test_descendants_are_the_whole_tree_with_create_times(monkeypatch: pytest.MonkeyPatch, kernel_lists: bool) -> None:
    """Children, grandchildren and a child started from another thread are all found, by
    the kernel's per-thread lists or (where the kernel has none) psutil's scan of /proc."""
    import threading

    if not kernel_lists:
        monkeypatch.setattr(procs, "_tree_from_proc", lambda root: None)
    nested = subprocess.Popen(["bash", "-c", "sleep 30 & sleep 30 & wait"])
    from_thread: list[subprocess.Popen[bytes]] = []
    thread = threading.Thread(target=lambda: from_thread.append(subprocess.Popen(["sleep", "30"])))
    thread.start()
    thread.join()
    try:
        deadline = time.monotonic() + patience(10)
        while len(psutil.Process().children(recursive=True)) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        expected = {p.pid: p.create_time() for p in psutil.Process().children(recursive=True)}
        assert len(expected) >= 4
        assert procs.descendants() == expected
    finally:
        for grandchild in psutil.Process(nested.pid).children():  # first: bash's wait reaps them
            grandchild.kill()
        nested.wait(timeout=patience(10))
        from_thread[0].kill()
        from_thread[0].wait()
