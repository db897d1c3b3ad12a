"""GPU-aware ``-n auto``: the formula (pure), the cap, the history, and end-to-end inner runs
whose CPUs and RAM a conftest.py of the inner run fixes (``os.sched_getaffinity``,
``psutil.virtual_memory``), with ``PYTEST_XDIST_AUTO_NUM_WORKERS`` unset."""

from __future__ import annotations

import json
import os
import re
import types

import psutil
import pytest

from conftest import INNER_ARGS
from helpers import patience
from pytest_gpu.run import options
from pytest_gpu.scheduling import autoworkers
from pytest_gpu.scheduling.autoworkers import choose

GiB, MiB = 2**30, 2**20
OVERHEAD = 500 * MiB  # the default context overhead
BIG_RAM = 1024 * GiB


# -- the formula -------------------------------------------------------------------------


def test_whole_gpus_give_one_worker_per_gpu():
    d = choose([80 * GiB] * 2, memory=None, overhead=OVERHEAD, cpus=16, ram=128 * GiB)
    assert (d.workers, d.fits) == (2, (1, 1))
    assert d.reason() == (
        "pytest-gpu: -n auto chose 2 workers: 2 GPUs, one whole-GPU test each (128GiB RAM, 16 CPUs allow more)"
    )


def test_sized_tests_fit_capacity_over_memory_plus_a_context_each():
    # floor(80GiB / (4GiB + 500MiB)) = 17 per GPU
    d = choose([80 * GiB] * 2, memory=4 * GiB, overhead=OVERHEAD, cpus=64, ram=BIG_RAM)
    assert (d.workers, d.fits) == (34, (17, 17))
    assert d.reason().endswith("2 GPUs x 17 tests of 4GiB each fit (1024GiB RAM, 64 CPUs allow more)")


def test_cpus_bound_the_workers():
    d = choose([80 * GiB] * 2, memory=4 * GiB, overhead=OVERHEAD, cpus=16, ram=BIG_RAM)
    assert d.workers == 16
    assert d.reason() == (
        "pytest-gpu: -n auto chose 16 workers: one per CPU (16 CPUs, 1024GiB RAM); 2 GPUs x 17 tests of 4GiB each fit"
    )


def test_host_ram_bounds_the_workers_at_4gib_each():
    d = choose([80 * GiB] * 2, memory=4 * GiB, overhead=OVERHEAD, cpus=64, ram=40 * GiB)
    assert d.workers == 10
    assert d.reason() == (
        "pytest-gpu: -n auto chose 10 workers: 40GiB RAM at 4GiB a worker (64 CPUs); 2 GPUs x 17 tests of 4GiB each fit"
    )


def test_at_least_one_worker_per_gpu_whatever_the_cpus():
    whole = choose([16 * GiB] * 8, memory=None, overhead=OVERHEAD, cpus=2, ram=BIG_RAM)
    assert whole.workers == 8
    assert whole.reason() == (
        "pytest-gpu: -n auto chose 8 workers: 8 GPUs, one whole-GPU test each "
        "(1024GiB RAM, 2 CPUs allow 2; at least one worker per GPU)"
    )
    sized = choose([16 * GiB] * 8, memory=4 * GiB, overhead=OVERHEAD, cpus=2, ram=BIG_RAM)
    assert (sized.workers, sized.fits) == (8, (3,) * 8)
    assert sized.reason() == (
        "pytest-gpu: -n auto chose 8 workers: one per GPU; 8 GPUs x 3 tests of 4GiB each fit; "
        "1024GiB RAM, 2 CPUs allow 2"
    )
    assert choose([16 * GiB], memory=None, overhead=OVERHEAD, cpus=1, ram=1 * GiB).workers == 1  # the floor of 1


def test_workers_per_gpu_caps_each_gpu():
    d = choose([80 * GiB] * 2, memory=4 * GiB, overhead=OVERHEAD, cpus=16, ram=80 * GiB, per_gpu=3)
    assert (d.workers, d.fits, d.capped) == (6, (3, 3), 3)
    assert d.reason() == (
        "pytest-gpu: -n auto chose 6 workers: 2 GPUs x 3 tests of 4GiB each fit, capped by "
        "gpu_workers_per_gpu = 3 (80GiB RAM, 16 CPUs allow more)"
    )
    # a cap no GPU reaches is not named
    assert choose([16 * GiB] * 2, memory=4 * GiB, overhead=OVERHEAD, cpus=16, ram=BIG_RAM, per_gpu=5).capped is None
    assert choose([16 * GiB] * 2, memory=None, overhead=OVERHEAD, cpus=16, ram=BIG_RAM, per_gpu=1).workers == 2


def test_the_context_budget_bounds_small_tests():
    # 256MiB tests: 80GiB / 756MiB = 108 would fit by memory, but the placement opens at
    # most a quarter of the GPU in contexts: 20GiB / 500MiB = 40
    d = choose([80 * GiB], memory=256 * MiB, overhead=OVERHEAD, cpus=1000, ram=BIG_RAM * 8)
    assert d.fits == (40,)


def test_mixed_gpus_are_counted_one_by_one():
    d = choose([80 * GiB, 80 * GiB, 24 * GiB, 24 * GiB], memory=8 * GiB, overhead=OVERHEAD, cpus=64, ram=BIG_RAM)
    assert (d.workers, d.fits) == (22, (9, 9, 2, 2))
    assert d.reason().endswith(": 22 tests of 8GiB fit on 4 GPUs (9+9+2+2) (1024GiB RAM, 64 CPUs allow more)")


def test_no_gpu_that_fits_a_test_leaves_the_number_to_xdist():
    d = choose([16 * GiB], memory=20 * GiB, overhead=OVERHEAD, cpus=4, ram=BIG_RAM)
    assert d.workers is None
    assert d.reason() == "pytest-gpu: -n auto: no GPU fits a test of 20GiB; xdist's CPU count decides"
    config = types.SimpleNamespace(stash=pytest.Stash(), option=types.SimpleNamespace(maxprocesses=1))
    config.stash[autoworkers.AUTO_KEY] = d
    assert autoworkers.summary_lines(config) == [d.reason()]  # said, and no worker count to cap
    assert choose([400 * MiB], memory=None, overhead=OVERHEAD, cpus=4, ram=BIG_RAM).workers is None


def test_without_gpus_the_summary_says_xdist_chose_and_how_many():
    d = autoworkers.Decision(None, (), 0, 0, None, gpuless="no GPUs (--gpus none)")
    assert d.reason() == "pytest-gpu: -n auto: this run has no GPUs (--gpus none); xdist's CPU count decides"
    config = types.SimpleNamespace(stash=pytest.Stash(), option=types.SimpleNamespace(numprocesses=8, maxprocesses=3))
    config.stash[autoworkers.AUTO_KEY] = d
    assert autoworkers.summary_lines(config) == [d.reason() + ": 8 workers; --maxprocesses=3 runs 3 workers"]
    config.option.maxprocesses = None
    config.stash[autoworkers.AUTO_KEY] = choose([16 * GiB], memory=20 * GiB, overhead=OVERHEAD, cpus=4, ram=BIG_RAM)
    assert autoworkers.summary_lines(config) == [
        "pytest-gpu: -n auto: no GPU fits a test of 20GiB; xdist's CPU count decides: 8 workers"
    ]


def test_learned_requests_are_named():
    d = choose([16 * GiB] * 2, memory=3 * GiB, overhead=OVERHEAD, cpus=16, ram=BIG_RAM, learned=True)
    assert "tests of 3GiB (the median learned request) each fit" in d.reason()


def test_the_summary_names_maxprocesses_when_it_caps_the_choice():
    decision = choose([80 * GiB] * 2, memory=4 * GiB, overhead=OVERHEAD, cpus=16, ram=80 * GiB, per_gpu=3)
    config = types.SimpleNamespace(stash=pytest.Stash(), option=types.SimpleNamespace(maxprocesses=None))
    assert autoworkers.summary_lines(config) == []  # pytest-gpu did not choose
    config.stash[autoworkers.AUTO_KEY] = decision
    assert autoworkers.summary_lines(config) == [decision.reason()]
    config.option.maxprocesses = 4
    assert autoworkers.summary_lines(config) == [decision.reason() + "; --maxprocesses=4 runs 4 workers"]


def test_host_cpus_is_the_affinity_mask(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5})
    assert autoworkers.host_cpus() == 3
    monkeypatch.delattr(os, "sched_getaffinity")
    monkeypatch.setattr(os, "cpu_count", lambda: 7)
    assert autoworkers.host_cpus() == 7


# -- the ini key / option ----------------------------------------------------------------


@pytest.mark.parametrize(("value", "expected"), [("none", None), ("None", None), ("3", 3), (" 1 ", 1)])
def test_workers_per_gpu_values(gpu_pytester, value, expected):
    gpu_pytester.makeini(f"[pytest]\ngpu_workers_per_gpu = {value}\n")
    assert options.read(gpu_pytester.parseconfig()).workers_per_gpu == expected
    assert options.read(gpu_pytester.parseconfig(f"--gpu-workers-per-gpu={value}")).workers_per_gpu == expected
    assert options.read(gpu_pytester.parseconfig("--gpu-workers-per-gpu=2")).workers_per_gpu == 2  # the CLI wins


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5", "²"])
def test_a_bad_workers_per_gpu_is_a_usage_error(gpu_pytester, run_inner, value):
    gpu_pytester.makepyfile("def test_cpu():\n    pass\n")
    expected = f"expected a positive whole number of workers per GPU or 'none', got {value!r}"
    result = run_inner(f"--gpu-workers-per-gpu={value}")  # also without -n auto
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert f"ERROR: --gpu-workers-per-gpu: {expected}" in result.errlines
    gpu_pytester.makeini(f"[pytest]\ngpu_workers_per_gpu = {value}\n")
    result = run_inner()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert f"ERROR: ini key 'gpu_workers_per_gpu': {expected}" in result.errlines


# -- history: --gpu-learn's recorded peaks, read before pytest's cache plugin is configured --


def _write_peaks(pytester: pytest.Pytester, peaks: object) -> None:
    path = pytester.path / ".pytest_cache" / "v" / "pytest_gpu" / "peaks"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(peaks))


def test_recorded_peaks_come_from_the_cache_directory(gpu_pytester):
    key = "pytest_gpu/peaks"
    assert autoworkers.recorded_peaks(gpu_pytester.parseconfig(), key) == []  # nothing recorded
    _write_peaks(gpu_pytester, {"t.py::a": 3 * GiB, "t.py::b": 1 * GiB, "t.py::c": "junk", "t.py::d": True})
    assert sorted(autoworkers.recorded_peaks(gpu_pytester.parseconfig(), key)) == [1 * GiB, 3 * GiB]
    assert autoworkers.recorded_peaks(gpu_pytester.parseconfig("--cache-clear"), key) == []
    assert autoworkers.recorded_peaks(gpu_pytester.parseconfig("-p", "no:cacheprovider"), key) == []
    moved = gpu_pytester.path / "elsewhere"
    gpu_pytester.makeini(f"[pytest]\ncache_dir = {moved}\n")
    assert autoworkers.recorded_peaks(gpu_pytester.parseconfig(), key) == []  # cache_dir is honoured
    _write_peaks(gpu_pytester, ["not", "a", "mapping"])
    gpu_pytester.makeini("[pytest]\n")
    assert autoworkers.recorded_peaks(gpu_pytester.parseconfig(), key) == []


# -- end to end: inner runs under xdist ----------------------------------------------------

SUITE = """
import pytest

@pytest.mark.gpu
def test_gpu(gpu):
    pass

def test_cpu():
    pass
"""

HOST = """
import os, types

import psutil

# this inner run's machine: {cpus} CPUs, {ram} bytes of RAM (read by pytest-gpu's -n auto)
os.sched_getaffinity = lambda pid: set(range({cpus}))
psutil.virtual_memory = lambda: types.SimpleNamespace(total={ram})
"""

CREATED = re.compile(r"created: (\d+)/(\d+) workers?")


@pytest.fixture
def machine(gpu_pytester, monkeypatch):
    """``machine(cpus, ram=64GiB)``: the inner run's host, and the suite."""
    monkeypatch.delenv(autoworkers.XDIST_ENV, raising=False)
    gpu_pytester.makepyfile(test_suite=SUITE)

    def make(cpus: int, ram: int = 64 * GiB) -> pytest.Pytester:
        gpu_pytester.makeconftest(HOST.format(cpus=cpus, ram=ram))
        return gpu_pytester

    return make


def _workers(result: pytest.RunResult) -> int:
    found = CREATED.search(result.stdout.str())
    assert found is not None, result.stdout.str()
    assert found.group(1) == found.group(2)
    return int(found.group(1))


def _auto_lines(result: pytest.RunResult) -> list[str]:
    return [line for line in result.stdout.lines if line.startswith("pytest-gpu: -n auto")]


def test_auto_on_two_80gib_gpus_and_two_cpus(machine, run_inner):
    machine(cpus=2)
    result = run_inner("-n", "auto", "--gpus", "sim:2x80GiB", subprocess=True)
    result.assert_outcomes(passed=2)
    assert _workers(result) == 2
    assert _auto_lines(result) == [
        "pytest-gpu: -n auto chose 2 workers: 2 GPUs, one whole-GPU test each (64GiB RAM, 2 CPUs allow as many)"
    ]


def test_auto_on_eight_16gib_gpus_and_two_cpus_gives_one_worker_per_gpu(machine, run_inner):
    machine(cpus=2)
    result = run_inner("-n", "auto", "--gpus", "sim:8x16GiB", "--gpu-default-memory", "4GiB", subprocess=True)
    result.assert_outcomes(passed=2)
    assert _workers(result) == 8  # xdist alone: 2
    assert _auto_lines(result) == [
        "pytest-gpu: -n auto chose 8 workers: one per GPU; 8 GPUs x 3 tests of 4GiB each fit; 64GiB RAM, 2 CPUs allow 2"
    ]


def test_the_ini_cap_applies(machine, run_inner):
    machine(cpus=16, ram=80 * GiB).makeini("[pytest]\ngpu_workers_per_gpu = 3\ngpu_default_memory = 4GiB\n")
    result = run_inner("-n", "auto", "--gpus", "sim:2x80GiB", subprocess=True)
    result.assert_outcomes(passed=2)
    assert _workers(result) == 6  # uncapped: 16, one per CPU
    assert _auto_lines(result) == [
        "pytest-gpu: -n auto chose 6 workers: 2 GPUs x 3 tests of 4GiB each fit, capped by "
        "gpu_workers_per_gpu = 3 (80GiB RAM, 16 CPUs allow more)"
    ]


def test_learned_peaks_size_the_workers_under_gpu_learn(machine, gpu_pytester):
    machine(cpus=16)
    # learned requests 3.75GiB, 3.75GiB, 1.25GiB: the median 3.75GiB fits 3 times on a 16GiB
    # GPU (the mean, 2.9GiB, would fit 4 times)
    _write_peaks(gpu_pytester, {"a": 3 * GiB, "b": 3 * GiB, "c": 1 * GiB})
    pairs = zip(INNER_ARGS[::2], INNER_ARGS[1::2], strict=True)  # ("-p", "no:..."); the cache stays on
    args = [a for pair in pairs if pair[1] != "no:cacheprovider" for a in pair]
    base = (*args, "-n", "auto", "--maxprocesses=1", "--gpus", "sim:2x16GiB")
    learned = gpu_pytester.runpytest_subprocess(*base, "--gpu-learn", timeout=patience(120))
    assert _auto_lines(learned) == [
        "pytest-gpu: -n auto chose 6 workers: 2 GPUs x 3 tests of 3.8GiB (the median learned request) each "
        "fit (64GiB RAM, 16 CPUs allow more); --maxprocesses=1 runs 1 worker"
    ]
    _write_peaks(gpu_pytester, {"a": 3 * GiB, "b": 3 * GiB, "c": 1 * GiB})  # the learning run recorded its own
    plain = gpu_pytester.runpytest_subprocess(
        *base, timeout=patience(120)
    )  # without --gpu-learn the requests are whole GPUs
    assert _auto_lines(plain) == [
        "pytest-gpu: -n auto chose 2 workers: 2 GPUs, one whole-GPU test each (64GiB RAM, 16 CPUs allow more)"
        "; --maxprocesses=1 runs 1 worker"
    ]


def test_explicit_numbers_are_untouched(machine, run_inner):
    machine(cpus=2)
    result = run_inner("-n", "3", "--gpus", "sim:8x16GiB", subprocess=True)
    result.assert_outcomes(passed=2)
    assert _workers(result) == 3
    assert _auto_lines(result) == []


def test_logical_is_xdists(machine, run_inner):
    machine(cpus=2)
    logical = psutil.cpu_count(logical=True)
    if logical == 7:
        pytest.skip("this machine has 7 logical CPUs, as many as the GPU formula would choose")
    result = run_inner("-n", "logical", "--gpus", "sim:7x16GiB", subprocess=True)
    result.assert_outcomes(passed=2)
    assert _workers(result) == logical  # xdist's psutil count, not one per GPU
    assert _auto_lines(result) == []


def test_the_xdist_env_var_is_xdists(machine, run_inner, monkeypatch):
    machine(cpus=2)
    monkeypatch.setenv(autoworkers.XDIST_ENV, "3")
    result = run_inner("-n", "auto", "--gpus", "sim:8x16GiB", subprocess=True)
    result.assert_outcomes(passed=2)
    assert _workers(result) == 3
    assert _auto_lines(result) == []


def test_without_gpus_xdist_counts_cpus(machine, run_inner):
    machine(cpus=16)  # what the formula would take; xdist counts with psutil
    expected = psutil.cpu_count(logical=False) or psutil.cpu_count()
    if expected == 16:
        pytest.skip("this machine has 16 CPUs, as many as the formula would choose")
    result = run_inner("-n", "auto", "--gpus", "none", subprocess=True)
    result.assert_outcomes(passed=1, skipped=1)
    assert _workers(result) == expected
    workers = f"{expected} worker{'' if expected == 1 else 's'}"
    assert _auto_lines(result) == [  # not chosen silently
        f"pytest-gpu: -n auto: this run has no GPUs (--gpus none); xdist's CPU count decides: {workers}"
    ]
