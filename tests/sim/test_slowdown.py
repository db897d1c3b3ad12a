"""Simulated GPUs that share their compute (``slowdown=share``): a test's compute runs 1/k as
fast while k processes compute on its GPU, as real GPUs time-slice between contexts.

Without the option (the default) :func:`pytest_gpu.sim.compute` is a sleep and the ledger
keeps no record of it, so every figure measured before stays as it was.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import patience
from pytest_gpu import sim
from pytest_gpu.sim import LEDGER_ENV, OVERHEAD_ENV, SPEC_ENV, TAG_ENV, LedgerWriteError
from pytest_gpu.sim import cuda as sim_cuda
from pytest_gpu.sim.spec import SpecError, parse

SHARED = "sim:2x4GiB;slowdown=share"


@pytest.fixture(autouse=True)
def ledger_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private ledger for each test on a machine that shares compute."""
    path = tmp_path / "ledger"
    monkeypatch.setenv(LEDGER_ENV, str(path))
    monkeypatch.setenv(SPEC_ENV, SHARED)
    monkeypatch.setenv(OVERHEAD_ENV, "512MiB")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv(TAG_ENV, raising=False)
    sim.cuda.forget()
    yield path
    sim.cuda.forget()


# -- the spec ----------------------------------------------------------------------------


def test_the_spec_option() -> None:
    assert parse(SHARED).slowdown
    assert not parse("sim:2x4GiB").slowdown  # the default: compute is not shared
    assert parse("amd:sim:2x64GiB;slowdown=share").slowdown  # every vendor's GPUs


@pytest.mark.parametrize("option", ["slowdown", "slowdown=", "slowdown=2", "slowdown=shared"])
def test_a_bad_slowdown_names_what_was_expected(option: str) -> None:
    with pytest.raises(SpecError, match=r"expected slowdown=share"):
        parse(f"sim:2x4GiB;{option}")


# -- one process: what it waits, with the share read each tick -----------------------------


def slept(monkeypatch: pytest.MonkeyPatch, sharing: list[int]) -> list[float]:
    """Where compute's sleeps go (on a clock of their own), while ``computing`` answers
    ``sharing`` in turn (then its last)."""
    steps: list[float] = []
    monkeypatch.setattr(sim_cuda.time, "sleep", steps.append)
    monkeypatch.setattr(sim_cuda.time, "monotonic", lambda: sum(steps))
    answers = iter(sharing)
    monkeypatch.setattr(sim.Ledger, "computing", lambda self, unit: next(answers, sharing[-1]))
    return steps


def test_alone_compute_takes_its_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    steps = slept(monkeypatch, [1])
    sim.compute(0.5)
    assert sum(steps) == pytest.approx(0.5)
    assert max(steps) <= sim_cuda.COMPUTE_TICK + 1e-9  # the share is read again every tick


def test_compute_shared_by_two_takes_twice_as_long(monkeypatch: pytest.MonkeyPatch) -> None:
    steps = slept(monkeypatch, [2])
    sim.compute(0.5)
    assert sum(steps) == pytest.approx(1.0)


def test_what_a_tick_really_took_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    # a loaded host: every sleep takes twice what was asked; alone, 0.5 s of compute ends after 0.5 s
    asked: list[float] = []
    monkeypatch.setattr(sim_cuda.time, "sleep", asked.append)
    monkeypatch.setattr(sim_cuda.time, "monotonic", lambda: 2 * sum(asked))
    monkeypatch.setattr(sim.Ledger, "computing", lambda self, unit: 1)
    sim.compute(0.5)
    assert 2 * sum(asked) == pytest.approx(0.5, abs=sim_cuda.COMPUTE_TICK * 2)


def test_the_share_is_read_as_it_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    # 0.1 s of compute at a third of the speed (0.3 s), then the rest alone
    tick = sim_cuda.COMPUTE_TICK
    thirds = round(0.1 / (tick / 3))
    steps = slept(monkeypatch, [3] * thirds + [1])
    sim.compute(0.5)
    assert sum(steps) == pytest.approx(0.3 + 0.4)


def test_the_ledger_knows_who_computes_where_while_it_lasts(monkeypatch: pytest.MonkeyPatch) -> None:
    led = sim.ledger()
    seen: list[tuple[int, int]] = []
    monkeypatch.setattr(sim_cuda.time, "sleep", lambda s: seen.append((led.computing(0), led.computing(1))))
    monkeypatch.setattr(sim_cuda.time, "monotonic", lambda: len(seen))  # a second per tick
    sim.compute(0.05, device=1)
    assert seen and set(seen) == {(0, 1)}
    assert (led.computing(0), led.computing(1)) == (0, 0)  # over: no record left
    assert 1 in led.contexts_of(os.getpid())  # a kernel runs in a context


def test_without_the_option_compute_is_a_sleep_and_leaves_no_record(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(LEDGER_ENV, str(tmp_path / "plain"))
    monkeypatch.setenv(SPEC_ENV, "sim:2x4GiB")
    sim.cuda.forget()
    steps: list[float] = []
    monkeypatch.setattr(sim_cuda.time, "sleep", steps.append)
    monkeypatch.setattr(sim.Ledger, "begin_compute", lambda *a, **k: pytest.fail("recorded"))
    sim.hold("1GiB", 0.5)
    assert steps == [0.5]


@pytest.mark.parametrize("seconds", [-1.0, float("nan"), float("inf"), True, "1"])
def test_bad_seconds_are_refused(seconds: object) -> None:
    with pytest.raises(ValueError, match="compute: expected a finite number of seconds >= 0"):
        sim.compute(seconds)  # type: ignore[arg-type]


def test_a_device_this_process_cannot_see_is_refused() -> None:
    with pytest.raises(sim.SimDeviceError, match="invalid device ordinal 5"):
        sim.compute(0.01, device=5)


def test_a_sticky_error_stops_compute() -> None:
    sim.poison()
    with pytest.raises(sim.CudaError):
        sim.compute(0.01)


def test_a_malformed_busy_record_is_refused(ledger_dir: Path) -> None:
    sim.allocate("1MiB")
    state = json.loads((ledger_dir / "ledger.json").read_text())
    next(iter(state["procs"].values()))["busy"] = {"7": 1}  # no GPU 7 on this machine
    (ledger_dir / "ledger.json").write_text(json.dumps(state))
    with pytest.raises(LedgerWriteError, match=r"malformed record procs\[.*\]\.busy"):
        sim.usage()


# -- processes: the machine-wide share ------------------------------------------------------

WORKER = """
import sys, time
from pytest_gpu import sim
sim.init()
print("ready", flush=True)
sys.stdin.readline()  # go
start = time.monotonic()
sim.compute(float(sys.argv[1]), device=int(sys.argv[2]))
print(time.monotonic() - start, flush=True)
"""


def run_together(*devices: int, seconds: float = 0.6) -> list[float]:
    """Processes computing ``seconds`` each on ``devices``, started together: their wall times."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(seconds), str(d)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for d in devices
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        return [float(proc.communicate(timeout=patience(60))[0]) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.slow  # four processes computing for a second
def test_processes_on_one_gpu_share_it_and_on_two_do_not() -> None:
    # on one GPU, two computations of 0.6 s overlap for most of their time: each takes nearly
    # twice as long (a slow start of one only lengthens what the other does alone); the
    # bound is a lower one, which load can only help
    shared = run_together(0, 0)
    assert sum(shared) >= 1.5 * 2 * 0.6, shared
    apart = run_together(0, 1)
    assert sum(apart) < sum(shared), (apart, shared)


def test_a_dead_process_no_longer_shares_the_gpu(ledger_dir: Path) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "from pytest_gpu import sim; print('go', flush=True); sim.compute(600)"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "go\n"
        led = sim.ledger()
        deadline = time.monotonic() + patience(30)
        while led.computing(0) != 1:
            assert time.monotonic() < deadline, "the child never computed"
            time.sleep(0.02)
    finally:
        child.kill()
        child.wait()
        if child.stdout is not None:
            child.stdout.close()
    assert led.computing(0) == 0  # its work ended with it, as a real process's kernels do
