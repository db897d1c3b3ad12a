"""What a ledger write and look costs (issue 33, "A lease at the floor"): files swapped in
whole, ``nvml.state`` left alone when NVML would show the same, the asking process's own
records not looked up in /proc, device properties read once per process: and none of it
weakens the simulation (a dead process's memory and contexts are still gone)."""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_gpu import sim
from pytest_gpu.sim import LEDGER_ENV, OVERHEAD_ENV, SPEC_ENV, TAG_ENV, OutOfMemoryError, torch_cuda

ledger_module = importlib.import_module("pytest_gpu.sim.ledger")  # the module: sim.ledger is its function
MiB, GiB = 2**20, 2**30


@pytest.fixture(autouse=True)
def ledger_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    path = tmp_path / "ledger"
    monkeypatch.setenv(LEDGER_ENV, str(path))
    monkeypatch.setenv(SPEC_ENV, "sim:2x4GiB")
    monkeypatch.setenv(OVERHEAD_ENV, "512MiB")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv(TAG_ENV, raising=False)
    sim.cuda.forget()
    yield path
    sim.cuda.forget()


def _inode(path: Path) -> int:
    return path.stat().st_ino


def test_a_tag_alone_leaves_nvml_state_as_it_is_and_memory_rewrites_it(ledger_dir: Path) -> None:
    sim.ledger().allocate(0, 0, None, None)  # a context: NVML lists this process
    state = ledger_dir / "nvml.state"
    before, text = _inode(state), state.read_text()
    sim.ledger().begin_tag("t1", os.getpid())  # the simulation's bookkeeping: NVML shows nothing of it
    assert _inode(state) == before and state.read_text() == text
    assert "t1" in (ledger_dir / "ledger.json").read_text()
    handle = sim.ledger().allocate(256 * MiB, 0, "t1", None)
    assert _inode(state) != before  # memory changed: written anew
    assert f"{256 * MiB + 512 * MiB}" in state.read_text()
    after = _inode(state)
    sim.ledger().tag_usage("t1", drop=True)
    assert _inode(state) == after
    sim.ledger().free(handle)
    assert f" {512 * MiB}\n" in state.read_text()


def test_a_write_swaps_its_files_in_whole_and_leaves_nothing_aside(
    ledger_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sim.ledger().allocate(0, 0, None, None)
    if ledger_module._renameat2() is None:
        pytest.skip("this libc has no renameat2")

    def plain(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a plain rename over the file (ext4 writes it back at once)")

    monkeypatch.setattr(ledger_module, "replace_file", plain)
    monkeypatch.setattr(ledger_module, "_unswappable", False)
    first = _inode(ledger_dir / "ledger.json")
    handle = sim.ledger().allocate(GiB, 1, None, None)
    assert _inode(ledger_dir / "ledger.json") != first  # a new file, never the old one written over
    sim.ledger().free(handle)
    assert sorted(p.name for p in ledger_dir.iterdir()) == ["ledger.json", "ledger.lock", "nvml.state"]
    assert sim.ledger().used() == {0: 512 * MiB, 1: 512 * MiB}


def test_without_renameat2_a_write_replaces_its_files(ledger_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ledger_module, "_renameat2", lambda: None)
    monkeypatch.setattr(ledger_module, "_unswappable", False)
    sim.ledger().allocate(GiB, 0, None, None)
    assert sim.ledger().used()[0] == GiB + 512 * MiB
    assert sorted(p.name for p in ledger_dir.iterdir()) == ["ledger.json", "ledger.lock", "nvml.state"]


def test_the_asking_process_is_not_looked_up_yet_an_earlier_holder_of_its_pid_is_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sim.ledger().allocate(GiB, 0, None, None)
    looked: list[int] = []
    real = ledger_module.owner_alive

    def counted(pid: int, *args: Any, **kwargs: Any) -> bool:
        looked.append(pid)
        return bool(real(pid, *args, **kwargs))

    monkeypatch.setattr(ledger_module, "owner_alive", counted)
    sim.ledger().allocate(GiB, 0, None, None)  # a write prunes: this process's record is its own
    assert os.getpid() not in looked
    assert sim.ledger().used()[0] == 2 * GiB + 512 * MiB
    # the same pid recorded by a process that started long before: it is gone, its memory freed
    with sim.ledger()._state() as state:
        state["procs"][str(os.getpid())]["ctime"] -= 3600
    assert sim.ledger().used()[0] == 0
    assert sim.ledger().contexts_of(os.getpid()) == set()


def test_a_dead_process_has_no_contexts(monkeypatch: pytest.MonkeyPatch) -> None:
    sim.ledger().allocate(0, 1, None, None)
    with sim.ledger()._state() as state:  # a record of a process that has exited
        state["procs"]["999999999"] = {"ctime": 1.0, "ctx": {"0": None}, "allocs": {}, "seq": 0}
    monkeypatch.setattr(ledger_module, "owner_alive", lambda pid, *a, **k: pid != 999999999)
    assert sim.ledger().contexts_of(999999999) == set()
    assert sim.ledger().contexts_of(os.getpid()) == {1}


def test_device_properties_are_read_once_per_process_view(monkeypatch: pytest.MonkeyPatch) -> None:
    assert sim.cuda.properties(1).total == 4 * GiB
    reads: list[int] = []
    real = ledger_module.Ledger._read

    def counted(self: Any) -> Any:
        reads.append(1)
        return real(self)

    monkeypatch.setattr(ledger_module.Ledger, "_read", counted)
    props = torch_cuda._get_device_properties(1)
    assert props.total_memory == sim.cuda.properties(1).total - sim.cuda.properties(1).reserved
    assert props.uuid == sim.cuda.properties(1).uuid.split("-", 1)[1]
    assert reads == []
    # the allocator's cap still counts against the ledger's truth
    sim.cuda.set_memory_cap(0, GiB)
    with pytest.raises(OutOfMemoryError, match="capped"):
        sim.cuda.allocate(2 * GiB, 0)
    with pytest.raises(sim.SimDeviceError):
        sim.cuda.properties(2)


def test_an_allocation_reads_its_process_s_start_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """psutil's look at a process (~0.1 ms, several under load) was made on every allocation,
    for a record that existed already."""
    looked: list[int] = []
    real = ledger_module._proc_start

    def counted(pid: int) -> float | None:
        looked.append(pid)
        return real(pid)

    monkeypatch.setattr(ledger_module, "_proc_start", counted)
    monkeypatch.setattr(ledger_module, "_own", (0, None))  # as in a new process
    for _ in range(3):
        sim.ledger().free(sim.ledger().allocate(MiB, 0, None, None))
    sim.ledger().begin_tag("t", os.getpid())
    assert looked == [os.getpid()]
    with sim.ledger()._state(write=False) as state:
        assert abs(state["procs"][str(os.getpid())]["ctime"] - real(os.getpid())) < 1.5
        assert state["tags"]["t"]["octime"] == state["procs"][str(os.getpid())]["ctime"]


def test_a_dead_process_pruned_by_a_tag_s_write_leaves_nvml_s_list(
    ledger_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sim.ledger().allocate(0, 0, None, None)
    with sim.ledger()._state() as state:  # a process that has exited since, holding memory
        dead = {"ctime": 1.0, "ctx": {"1": None}, "allocs": {"999999999:1": [1, GiB, None]}, "seq": 1}
        state["procs"]["999999999"] = dead
    assert " 999999999 " in (ledger_dir / "nvml.state").read_text()
    monkeypatch.setattr(ledger_module, "owner_alive", lambda pid, *a, **k: pid != 999999999)
    sim.ledger().begin_tag("t", os.getpid())
    sim.ledger().tag_usage("t", drop=True)  # pruned, then a tag dropped: NVML must stop listing the dead
    assert " 999999999 " not in (ledger_dir / "nvml.state").read_text()
