"""pytest_gpu.sim: the cross-process ledger of simulated GPU memory (the project's "physics")."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from helpers import patience, user_dir
from pytest_gpu import sim
from pytest_gpu.sim import (
    LEDGER_ENV,
    OVERHEAD_ENV,
    SPEC_ENV,
    TAG_ENV,
    Allocation,
    Ledger,
    OutOfMemoryError,
    SimDeviceError,
    TagUsage,
)
from pytest_gpu.sim.spec import gpu_uuid as sim_uuid

MiB, GiB = 2**20, 2**30
OVERHEAD = 512 * MiB
PID = os.getpid()


@pytest.fixture(autouse=True)
def ledger_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private ledger for each test: 2 simulated GPUs of 4GiB, 512MiB per context."""
    path = tmp_path / "ledger"
    monkeypatch.setenv(LEDGER_ENV, str(path))
    monkeypatch.setenv(SPEC_ENV, "sim:2x4GiB")
    monkeypatch.setenv(OVERHEAD_ENV, "512MiB")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv(TAG_ENV, raising=False)
    sim.cuda.forget()  # each test is a new process: device list, current device, caps
    yield path
    sim.cuda.forget()


# -- helpers ---------------------------------------------------------------------------

CHILD = """
import sys, time
from pytest_gpu import sim
handle = sim.allocate(sys.argv[1], device=int(sys.argv[2]))
print("ready", flush=True)
if sys.argv[3] == "sleep":
    time.sleep(120)
else:
    sys.stdin.readline()  # exit when told, without freeing
"""


class Child:
    """A process that allocates simulated memory, says "ready", then sleeps or waits for a line."""

    def __init__(self, nbytes: str, device: int = 0, then: str = "sleep") -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, nbytes, str(device), then],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line == "ready\n", f"child did not allocate (exit code {self.proc.poll()})"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def finish(self) -> None:
        """Let it exit normally (it does not free its allocation)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.close()
        assert self.proc.wait(timeout=patience(30)) == 0

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=patience(30))
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


@pytest.fixture
def children() -> Iterator[list[Child]]:
    made: list[Child] = []
    yield made
    for child in made:
        child.close()


def spawn(children: list[Child], nbytes: str, device: int = 0, then: str = "sleep") -> Child:
    child = Child(nbytes, device, then)
    children.append(child)
    return child


# -- allocate / free / with ------------------------------------------------------------


def test_fresh_ledger_is_empty() -> None:
    assert sim.usage() == {0: 0, 1: 0}
    assert [(u.index, u.uuid, u.total) for u in sim.ledger().units()] == [
        (0, sim_uuid(0), 4 * GiB),
        (1, sim_uuid(1), 4 * GiB),
    ]


def test_ledger_lives_where_the_env_says(ledger_dir: Path) -> None:
    sim.allocate("1MiB").free()
    assert (ledger_dir / "ledger.json").is_file()
    assert sim.ledger().path == ledger_dir


def test_allocate_and_free() -> None:
    alloc = sim.allocate("1GiB")
    assert isinstance(alloc, Allocation)
    assert (alloc.nbytes, alloc.device, alloc.physical, alloc.freed) == (GiB, 0, 0, False)
    assert sim.usage() == {0: GiB + OVERHEAD, 1: 0}
    alloc.free()
    assert alloc.freed
    assert sim.usage() == {0: OVERHEAD, 1: 0}  # the context stays until the process exits
    alloc.free()  # a second free is harmless
    assert sim.usage() == {0: OVERHEAD, 1: 0}


def test_allocate_accepts_ints_and_sizes() -> None:
    with sim.allocate(1000) as a, sim.allocate("1KB") as b:
        assert a.nbytes == b.nbytes == 1000
        assert sim.usage()[0] == OVERHEAD + 2000


def test_with_block_frees() -> None:
    with sim.allocate("2GiB", device=1) as alloc:
        assert sim.usage() == {0: 0, 1: 2 * GiB + OVERHEAD}
    assert alloc.freed
    assert sim.usage() == {0: 0, 1: OVERHEAD}


def test_with_block_frees_on_exception() -> None:
    with pytest.raises(KeyError), sim.allocate("2GiB"):
        raise KeyError("boom")
    assert sim.usage()[0] == OVERHEAD


def test_allocation_repr() -> None:
    alloc = sim.allocate("1GiB", device=1)
    assert repr(alloc) == "<sim.Allocation 1GiB on cuda:1 (GPU 1) live>"
    alloc.free()
    assert repr(alloc) == "<sim.Allocation 1GiB on cuda:1 (GPU 1) freed>"


def test_garbage_collection_does_not_free() -> None:
    sim.allocate("1GiB")  # like a raw cudaMalloc: dropped, not freed
    assert sim.usage()[0] == GiB + OVERHEAD


def test_hold_allocates_sleeps_and_frees() -> None:
    seen: list[int] = []
    thread = threading.Thread(target=sim.hold, args=("1GiB", 0.3, 1))  # seen within 10ms of its start
    thread.start()
    deadline = time.monotonic() + patience(5)
    while time.monotonic() < deadline and not seen:
        used = sim.usage()[1]
        if used:
            seen.append(used)
        time.sleep(0.01)
    thread.join()
    assert seen == [GiB + OVERHEAD]
    assert sim.usage() == {0: 0, 1: OVERHEAD}


# -- out of memory ---------------------------------------------------------------------


def test_out_of_memory_is_a_memory_error() -> None:
    assert issubclass(OutOfMemoryError, MemoryError)
    with pytest.raises(MemoryError):
        sim.allocate("5GiB")


def test_out_of_memory_message_and_nothing_charged() -> None:
    keep = sim.allocate("3GiB")
    with pytest.raises(OutOfMemoryError) as info:
        sim.allocate("1GiB")
    assert str(info.value) == (
        f"Simulated CUDA out of memory on GPU 0 ({sim_uuid(0)}): tried to allocate 1GiB; "
        f"3.5GiB of 4GiB in use (pid {PID}: 3GiB), 512MiB free. (pid {PID})"
    )
    assert sim.usage()[0] == 3 * GiB + OVERHEAD
    keep.free()


def test_out_of_memory_counts_the_new_context() -> None:
    # 4GiB fits the card but not beside this process's first context on it
    with pytest.raises(OutOfMemoryError) as info:
        sim.allocate("4GiB", device=1)
    assert str(info.value) == (
        f"Simulated CUDA out of memory on GPU 1 ({sim_uuid(1)}): tried to allocate 4GiB + context; "
        f"0B of 4GiB in use (contexts only), 4GiB free. (pid {PID})"
    )
    assert sim.usage() == {0: 0, 1: 0}  # a failed first allocation leaves no context
    assert sim.ledger().contexts_of(PID) == set()


def test_exactly_full_is_allowed() -> None:
    with sim.allocate(4 * GiB - OVERHEAD):
        assert sim.usage()[0] == 4 * GiB
        with pytest.raises(OutOfMemoryError):
            sim.allocate(1)


def test_second_allocation_may_fill_the_card() -> None:
    # the context is already open: the rest of the card is all usable, no second overhead
    with sim.allocate("1GiB"), sim.allocate(3 * GiB - OVERHEAD):
        assert sim.usage()[0] == 4 * GiB


def test_other_processes_count(children: list[Child]) -> None:
    child = spawn(children, "3GiB")
    with pytest.raises(OutOfMemoryError) as info:
        sim.allocate("1GiB")
    assert f"pid {child.pid}: 3GiB" in str(info.value)
    assert "3.5GiB of 4GiB in use" in str(info.value)


# -- context overhead ------------------------------------------------------------------


def test_context_overhead_charged_once_per_device() -> None:
    a = sim.allocate("1GiB", device=0)
    b = sim.allocate("256MiB", device=0)
    c = sim.allocate("100MiB", device=1)
    assert sim.usage() == {0: GiB + 256 * MiB + OVERHEAD, 1: 100 * MiB + OVERHEAD}
    assert sim.ledger().contexts_of(PID) == {0, 1}
    for alloc in (a, b, c):
        alloc.free()
    assert sim.usage() == {0: OVERHEAD, 1: OVERHEAD}
    d = sim.allocate("1GiB", device=0)  # the context is already there: not charged again
    assert sim.usage() == {0: GiB + OVERHEAD, 1: OVERHEAD}
    d.free()


def test_overhead_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(OVERHEAD_ENV, "0")
    with sim.allocate("1GiB"):
        assert sim.usage()[0] == GiB


def test_ledger_create_fixes_spec_and_overhead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "run-ledger"
    Ledger.create(path, "sim:1x2GiB", 100 * MiB)
    monkeypatch.setenv(LEDGER_ENV, str(path))
    monkeypatch.setenv(SPEC_ENV, "sim:1x2GiB")
    monkeypatch.setenv(OVERHEAD_ENV, "1GiB")  # the ledger's own overhead wins
    with sim.allocate("1GiB"):
        assert sim.usage() == {0: GiB + 100 * MiB}
        with pytest.raises(SimDeviceError):
            sim.allocate(1, device=1)


def test_ledger_create_resets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sim.allocate("1GiB")
    Ledger.create(Path(os.environ[LEDGER_ENV]), "sim:2x4GiB", OVERHEAD)
    assert sim.usage() == {0: 0, 1: 0}


def test_a_new_spec_replaces_an_idle_ledger(monkeypatch: pytest.MonkeyPatch, children: list[Child]) -> None:
    child = spawn(children, "1GiB", then="wait")
    monkeypatch.setenv(SPEC_ENV, "sim:3x8GiB")
    # a live process still holds memory under the old spec: the ledger is kept
    assert sim.usage() == {0: GiB + OVERHEAD, 1: 0}
    child.finish()
    assert sim.usage() == {0: 0, 1: 0, 2: 0}
    assert [u.total for u in sim.ledger().units()] == [8 * GiB] * 3


# -- device numbering as CUDA does it --------------------------------------------------


def test_default_device_is_zero() -> None:
    with sim.allocate("1GiB") as alloc:
        assert (alloc.device, alloc.physical) == (0, 0)


def test_device_is_relative_to_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with sim.allocate("1GiB") as alloc:
        assert (alloc.device, alloc.physical) == (0, 1)
        assert sim.usage() == {0: 0, 1: GiB + OVERHEAD}
    assert sim.ledger().contexts_of(PID) == {1}


def test_visible_devices_reordered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    with sim.allocate("1GiB", device=1) as a, sim.allocate("2GiB", device=0) as b:
        assert (a.physical, b.physical) == (0, 1)
        assert sim.usage() == {0: GiB + OVERHEAD, 1: 2 * GiB + OVERHEAD}


def test_visible_devices_by_uuid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", sim_uuid(1))
    with sim.allocate("1GiB", device=0) as alloc:
        assert alloc.physical == 1


def test_device_list_is_fixed_at_first_use(monkeypatch: pytest.MonkeyPatch) -> None:
    # as CUDA: the variable is read once, when the process's CUDA starts
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    a = sim.allocate("1MiB")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    b = sim.allocate("1MiB")
    assert (a.physical, b.physical) == (1, 1)
    assert sim.device_count() == 1
    with pytest.raises(SimDeviceError, match=r"its CUDA started with CUDA_VISIBLE_DEVICES='1'"):
        sim.allocate("1MiB", device=1)


def test_init_fixes_the_list_without_a_context(monkeypatch: pytest.MonkeyPatch) -> None:
    assert sim.init() == [0, 1]  # cuInit: no context, no memory
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert sim.usage() == {0: 0, 1: 0}
    assert sim.device_count() == 2


def test_current_device_and_set_device_opens_a_context() -> None:
    assert sim.current_device() == 0
    assert sim.usage() == {0: 0, 1: 0}
    sim.set_device(1)  # CUDA 12: cudaSetDevice creates the primary context
    assert sim.current_device() == 1
    assert sim.usage() == {0: 0, 1: OVERHEAD}
    with sim.allocate("1GiB") as alloc:  # the default device is the current one
        assert (alloc.device, alloc.physical) == (1, 1)
    with pytest.raises(SimDeviceError, match=r"invalid device ordinal 2"):
        sim.set_device(2)
    assert sim.current_device() == 1


def test_current_device_is_per_thread() -> None:
    """CUDA's current device belongs to the host thread: a new thread starts on ordinal 0."""
    sim.set_device(1)
    seen: list[int] = []

    def work() -> None:
        seen.append(sim.current_device())
        with sim.allocate("1GiB") as alloc:  # its default device: ordinal 0, whose context it opens
            seen.append(alloc.physical)
        sim.set_device(1)
        seen.append(sim.current_device())

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen == [0, 0, 1]
    assert sim.current_device() == 1
    assert sim.cuda.contexts() == {0, 1}


def test_mem_get_info_opens_a_context_and_excludes_the_reserve(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SPEC_ENV, "sim:2x4GiB;reserved=64MiB")
    sim.cuda.forget()
    free, total = sim.mem_get_info(1)
    assert total == 4 * GiB - 64 * MiB
    assert free == total - OVERHEAD
    with pytest.raises(OutOfMemoryError, match=r"512MiB of 3.9GiB in use"):
        sim.allocate(4 * GiB - 64 * MiB - OVERHEAD + 1, device=1)


def test_ordinal_beyond_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with pytest.raises(SimDeviceError) as info:
        sim.allocate("1GiB", device=1)
    assert str(info.value) == (
        "invalid device ordinal 1: this process sees 1 simulated GPU(s) "
        "(its CUDA started with CUDA_VISIBLE_DEVICES='1')"
    )
    assert sim.usage() == {0: 0, 1: 0}


def test_ordinal_beyond_the_machine() -> None:
    with pytest.raises(SimDeviceError) as info:
        sim.allocate("1GiB", device=2)
    assert (
        str(info.value) == "invalid device ordinal 2: this process sees 2 simulated GPU(s) "
        "(its CUDA started with CUDA_VISIBLE_DEVICES=None)"
    )


def test_negative_ordinal() -> None:
    with pytest.raises(SimDeviceError, match=r"^invalid device ordinal -1: "):
        sim.allocate("1GiB", device=-1)


@pytest.mark.parametrize(
    ("visible", "seen"),
    [
        ("", 0),  # nothing visible
        ("7", 0),  # no such GPU
        ("0,7,1", 1),  # an invalid entry ends the list
        ("1,1", 1),  # a repeated entry too
        ("GPU-nope,0", 0),
    ],
)
def test_invalid_visible_entries(monkeypatch: pytest.MonkeyPatch, visible: str, seen: int) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    with pytest.raises(SimDeviceError) as info:
        sim.allocate("1MiB", device=seen)
    expected = f"this process sees {seen} simulated GPU(s) (its CUDA started with CUDA_VISIBLE_DEVICES={visible!r})"
    assert expected in str(info.value)


@pytest.mark.parametrize("device", [True, "0", 1.0])
def test_device_must_be_an_int(device: object) -> None:
    with pytest.raises(SimDeviceError) as info:
        sim.allocate("1MiB", device=device)  # type: ignore[arg-type]
    assert str(info.value) == f"device must be an int ordinal, got {device!r}"


def test_ledger_allocate_checks_physical_index() -> None:
    with pytest.raises(SimDeviceError) as info:
        sim.ledger().allocate(1, 5, None, None)
    assert str(info.value) == "invalid device: simulated device 5 does not exist"


# -- per-process cap -------------------------------------------------------------------


def test_memory_cap() -> None:
    sim.set_memory_cap(0, GiB)
    a = sim.allocate("768MiB")
    with pytest.raises(OutOfMemoryError) as info:
        sim.allocate("512MiB")
    assert str(info.value) == (
        "Simulated CUDA out of memory on GPU 0: tried to allocate 512MiB; this process already holds 768MiB and "
        f"is capped at 1GiB (its pytest-gpu lease). (pid {PID})"
    )
    with sim.allocate("2GiB", device=1):  # the cap is per device
        pass
    a.free()
    with sim.allocate("1GiB"):  # freeing makes room under the cap again
        pass
    sim.set_memory_cap(0, None)
    with sim.allocate("3GiB"):
        pass


def test_memory_cap_is_by_physical_device(monkeypatch: pytest.MonkeyPatch) -> None:
    sim.set_memory_cap(1, 100 * MiB)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    with pytest.raises(OutOfMemoryError, match=r"capped at 100MiB"):
        sim.allocate("200MiB")
    with sim.allocate("200MiB", device=1):
        pass


# -- dead processes --------------------------------------------------------------------


def test_memory_of_a_sigkilled_process_is_freed(children: list[Child]) -> None:
    child = spawn(children, "2GiB", device=1)
    assert sim.usage() == {0: 0, 1: 2 * GiB + OVERHEAD}
    assert sim.ledger().contexts_of(child.pid) == {1}
    os.kill(child.pid, signal.SIGKILL)
    child.proc.wait(timeout=patience(30))
    assert sim.usage() == {0: 0, 1: 0}
    assert sim.ledger().contexts_of(child.pid) == set()
    with sim.allocate(4 * GiB - OVERHEAD, device=1):  # the whole card is usable again
        pass


def test_memory_of_a_killed_but_unreaped_process_is_freed(children: list[Child]) -> None:
    # the driver frees a process's memory when it dies, not when its parent reaps it
    child = spawn(children, "2GiB")
    os.kill(child.pid, signal.SIGKILL)
    deadline = time.monotonic() + patience(10)
    while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "child did not die"
        time.sleep(0.01)
    assert sim.usage() == {0: 0, 1: 0}


def test_process_exiting_without_freeing(children: list[Child]) -> None:
    child = spawn(children, "1GiB", then="wait")
    assert sim.usage() == {0: GiB + OVERHEAD, 1: 0}
    child.finish()
    assert sim.usage() == {0: 0, 1: 0}


@pytest.mark.slow
def test_two_live_processes_and_this_one(children: list[Child]) -> None:
    first = spawn(children, "1GiB", device=0)
    second = spawn(children, "1GiB", device=0)
    with sim.allocate("512MiB"):
        assert sim.usage()[0] == 3 * OVERHEAD + 2 * GiB + 512 * MiB
    assert sim.usage()[0] == 3 * OVERHEAD + 2 * GiB
    first.close()
    assert sim.usage()[0] == 2 * OVERHEAD + GiB
    second.close()
    assert sim.usage()[0] == OVERHEAD  # this process's context


def _fake_record(pid: int, ctime: float | None, nbytes: int) -> None:
    led = sim.ledger()
    with led._state() as state:
        state["procs"][str(pid)] = {
            "ctime": ctime,
            "ctx": {"0": None},
            "allocs": {f"{pid}:1": [0, nbytes, None]},
            "seq": 1,
        }


def test_record_of_a_live_process_is_kept() -> None:
    parent = os.getppid()
    _fake_record(parent, psutil.Process(parent).create_time(), GiB)
    assert sim.usage()[0] == GiB + OVERHEAD
    assert sim.ledger().contexts_of(parent) == {0}


def test_recycled_pid_does_not_keep_memory() -> None:
    # the record's process started earlier than the process now using that pid
    parent = os.getppid()
    _fake_record(parent, psutil.Process(parent).create_time() - 1000.0, GiB)
    assert sim.usage()[0] == 0
    assert sim.ledger().contexts_of(parent) == set()


def test_record_of_a_vanished_pid_is_dropped() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    _fake_record(proc.pid, 1.0, GiB)
    assert sim.usage()[0] == 0


# -- tags: what one test's processes used ----------------------------------------------


def test_tag_accounting_owner_and_child(monkeypatch: pytest.MonkeyPatch, children: list[Child]) -> None:
    led = sim.ledger()
    led.begin_tag("t::one", owner=PID)
    monkeypatch.setenv(TAG_ENV, "t::one")
    mine = sim.allocate("1GiB", device=0)  # the owner's (worker's) context is not the test's
    assert led.tag_usage("t::one") == TagUsage(peak={0: GiB}, current={0: GiB}, touched={0})

    child = spawn(children, "512MiB", device=1, then="wait")  # inherits the tag: its context counts
    assert led.tag_usage("t::one") == TagUsage(
        peak={0: GiB, 1: 512 * MiB + OVERHEAD},
        current={0: GiB, 1: 512 * MiB + OVERHEAD},
        touched={0, 1},
    )
    child.finish()
    mine.free()
    # everything is gone now, the peak stays
    assert led.tag_usage("t::one") == TagUsage(peak={0: GiB, 1: 512 * MiB + OVERHEAD}, current={}, touched={0, 1})


def test_tag_peak_is_the_high_water_mark(monkeypatch: pytest.MonkeyPatch) -> None:
    led = sim.ledger()
    led.begin_tag("t", owner=PID)
    monkeypatch.setenv(TAG_ENV, "t")
    a = sim.allocate("1GiB")
    b = sim.allocate("1GiB")
    a.free()
    c = sim.allocate("256MiB")
    usage = led.tag_usage("t")
    assert usage.peak == {0: 2 * GiB}
    assert usage.current == {0: GiB + 256 * MiB}
    b.free()
    c.free()


def test_owner_context_opened_under_the_tag_is_not_charged(monkeypatch: pytest.MonkeyPatch) -> None:
    led = sim.ledger()
    led.begin_tag("t", owner=PID)
    monkeypatch.setenv(TAG_ENV, "t")
    sim.allocate("1MiB", device=1).free()
    usage = led.tag_usage("t")
    assert usage.touched == {1}
    assert usage.current == {}
    assert usage.peak == {1: MiB}


def test_tag_ignores_untagged_and_other_tags(monkeypatch: pytest.MonkeyPatch) -> None:
    led = sim.ledger()
    led.begin_tag("a", owner=PID)
    led.begin_tag("b", owner=PID)
    untagged = sim.allocate("1GiB")
    monkeypatch.setenv(TAG_ENV, "b")
    in_b = sim.allocate("256MiB", device=1)
    assert led.tag_usage("a") == TagUsage()
    assert led.tag_usage("b") == TagUsage(peak={1: 256 * MiB}, current={1: 256 * MiB}, touched={1})
    untagged.free()
    in_b.free()


def test_memory_left_under_a_tag_shows_as_current(monkeypatch: pytest.MonkeyPatch) -> None:
    led = sim.ledger()
    led.begin_tag("leaky", owner=PID)
    monkeypatch.setenv(TAG_ENV, "leaky")
    leaked = sim.allocate("300MiB")
    monkeypatch.delenv(TAG_ENV)
    assert led.tag_usage("leaky").current == {0: 300 * MiB}
    leaked.free()
    assert led.tag_usage("leaky").current == {}


def test_tag_drop_forgets_it(monkeypatch: pytest.MonkeyPatch) -> None:
    led = sim.ledger()
    led.begin_tag("t", owner=PID)
    monkeypatch.setenv(TAG_ENV, "t")
    sim.allocate("1MiB").free()
    assert led.tag_usage("t", drop=True).peak == {0: MiB}
    assert led.tag_usage("t") == TagUsage()


def test_allocation_under_an_unknown_tag_is_not_tracked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TAG_ENV, "never-begun")
    sim.allocate("1MiB").free()
    assert sim.ledger().tag_usage("never-begun") == TagUsage()


def test_begin_tag_restarts_accounting(monkeypatch: pytest.MonkeyPatch) -> None:
    led = sim.ledger()
    led.begin_tag("t", owner=PID)
    monkeypatch.setenv(TAG_ENV, "t")
    sim.allocate("1GiB").free()
    led.begin_tag("t", owner=PID)
    assert led.tag_usage("t") == TagUsage()


# -- contexts_of -----------------------------------------------------------------------


def test_contexts_of(children: list[Child], monkeypatch: pytest.MonkeyPatch) -> None:
    led = sim.ledger()
    assert led.contexts_of(PID) == set()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    child = spawn(children, "1MiB", device=0)  # physical 1 through the inherited CUDA_VISIBLE_DEVICES
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    sim.allocate("1MiB", device=0).free()
    assert led.contexts_of(PID) == {0}
    assert led.contexts_of(child.pid) == {1}
    assert led.contexts_of(999_999_999) == set()


# -- the default location ----------------------------------------------------------------


def test_default_ledger_is_the_simulated_machines_per_user_and_per_spec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pwd

    monkeypatch.setenv("PYTEST_GPU_MACHINE_DIR", str(tmp_path))
    user = pwd.getpwuid(os.getuid()).pw_name
    mine = user_dir(tmp_path)  # the user's own directory: no other user enters it
    assert sim.default_ledger_dir("sim:4x16GiB") == mine / f"sim-{user}-sim_4x16GiB" / "sim-ledger"
    assert sim.default_ledger_dir("sim:2x80GiB,2x24GiB") == mine / f"sim-{user}-sim_2x80GiB_2x24GiB" / "sim-ledger"
    monkeypatch.delenv(LEDGER_ENV)
    monkeypatch.setenv(SPEC_ENV, "sim:1x1GiB")
    assert sim.ledger().path == mine / f"sim-{user}-sim_1x1GiB" / "sim-ledger"
    monkeypatch.setenv("PYTEST_GPU_SIM_MACHINE", "ci")  # a named machine, whatever the spec
    assert sim.ledger().path == sim.machine_ledger_dir("sim:2x1GiB") == mine / "sim-ci" / "sim-ledger"


# -- tracebacks: the simulator's frames stay out of them -----------------------------------

OOM_SUITE = """
import pytest
from pytest_gpu import sim
from pytest_gpu.sim import cuda, cupy_cuda


@pytest.mark.gpu(memory="1GiB")
def test_allocate(gpu):
    sim.allocate("2GiB")  # the user's line: allocate


@pytest.mark.gpu(memory="1GiB")
def test_hold(gpu):
    sim.hold("2GiB", seconds=0.1)  # the user's line: hold


@pytest.mark.gpu(memory="1GiB")
def test_bad_ordinal(gpu):
    sim.allocate("1MiB", device=5)  # the user's line: ordinal


@pytest.mark.gpu(memory="1GiB")
def test_cupy(gpu):
    cupy_cuda.module().get_default_memory_pool().malloc(64 * 2**30)  # the user's line: cupy


@pytest.mark.gpu(memory="1GiB")
def test_a_bug_of_the_simulator(gpu, monkeypatch):
    monkeypatch.setattr(cuda, "thread_label", lambda: None.missing)
    sim.allocate("1MiB")  # the user's line: bug
"""


def failure_sections(output: str) -> dict[str, str]:
    """Each failed test's traceback in pytest's output, by test name."""
    parts = re.split(r"^_{3,} (test_\w+) _{3,}$", output, flags=re.MULTILINE)
    sections = dict(zip(parts[1::2], parts[2::2], strict=True))
    return {name: text.split("short test summary info")[0] for name, text in sections.items()}


def test_an_oom_shows_the_test_s_line_not_the_simulator_s(gpu_pytester: pytest.Pytester, run_inner) -> None:
    """As the real runtime's errors, which come from C: the test's line and the error, no frame
    of the simulator (``__tracebackhide__`` for the errors it models); a bug of the simulator
    still shows where it is."""
    gpu_pytester.makepyfile(test_oom=OOM_SUITE)
    result = run_inner("--gpus", "sim:1x4GiB", "-p", "no:xdist", subprocess=True)
    result.assert_outcomes(failed=5)
    sections = failure_sections(result.stdout.str())
    expected = {
        "test_allocate": ("allocate", "pytest_gpu.sim.OutOfMemoryError: Simulated CUDA out of memory on GPU 0"),
        "test_hold": ("hold", "pytest_gpu.sim.OutOfMemoryError: Simulated CUDA out of memory on GPU 0"),
        "test_bad_ordinal": ("ordinal", "pytest_gpu.sim.SimDeviceError: invalid device ordinal 5"),
        "test_cupy": ("cupy", "pytest_gpu.sim.cupy_cuda.OutOfMemoryError: Out of memory allocating"),
    }
    for name, (line, error) in expected.items():
        text = sections[name]
        assert re.search(rf"^>\s+.*# the user's line: {line}$", text, flags=re.MULTILINE), text
        assert re.search(rf"^E\s+{re.escape(error)}", text, flags=re.MULTILINE), text
        assert "pytest_gpu/sim/" not in text and "def " not in text.split(f"the user's line: {line}")[1], text
    bug = sections["test_a_bug_of_the_simulator"]
    assert "src/pytest_gpu/sim/cuda.py" in bug and "AttributeError" in bug, bug
