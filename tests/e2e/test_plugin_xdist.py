"""The issue's "Done when" runs under pytest-xdist.

- 100 tests with random memory on 2 simulated GPUs under ``-n 8``: no simulated OOM with
  the plugin; the same suite without it (``-p no:gpu``, one shared ledger) runs out of memory.
- 32 workers on 4 simulated GPUs complete without errors.
"""

from __future__ import annotations

import pytest

RANDOM_SUITE = """
import random

import pytest
from pytest_gpu import sim

_rng = random.Random(20240607)
CASES = []
for i in range(100):
    gib = _rng.randint(1, 9)
    seconds = round(_rng.uniform(0.02, 0.1), 3)
    CASES.append(pytest.param(gib, seconds, marks=pytest.mark.gpu(memory=f"{gib}GiB"), id=f"t{i:03d}-{gib}GiB"))

@pytest.mark.parametrize(("gib", "seconds"), CASES)
def test_hold(gib, seconds):
    sim.hold(f"{gib}GiB", seconds)
"""


def test_random_memory_on_two_gpus_no_oom_with_plugin(gpu_pytester, run_inner):
    gpu_pytester.makepyfile(test_random=RANDOM_SUITE)
    result = run_inner("--gpus", "sim:2x16GiB", "-n", "8", subprocess=True)
    result.assert_outcomes(passed=100)
    assert "OutOfMemoryError" not in result.stdout.str()
    result.stdout.re_match_lines(
        [
            r"pytest-gpu: 2 simulated GPUs \(2x16GiB\) \[sim:2x16GiB\] · 100 GPU tests · "
            r"waited (\d+\.\ds|\d+ms|<1ms|0s) in total · 0 violations$"
        ]
    )
    assert "died while running" not in result.stdout.str()


def test_random_memory_on_two_gpus_ooms_without_plugin(gpu_pytester, run_inner, monkeypatch, tmp_path_factory):
    """The control: every worker lands on GPU 0 and the shared simulated ledger runs out."""
    ledger = tmp_path_factory.mktemp("raw-ledger")
    monkeypatch.setenv("PYTEST_GPU_SIM", "sim:2x16GiB")
    monkeypatch.setenv("PYTEST_GPU_SIM_LEDGER", str(ledger))
    gpu_pytester.makepyfile(test_random=RANDOM_SUITE)
    result = run_inner("-p", "no:gpu", "-n", "8", "-W", "ignore::pytest.PytestUnknownMarkWarning", subprocess=True)
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) >= 1, result.stdout.str()
    assert outcomes.get("failed", 0) + outcomes.get("passed", 0) == 100
    result.stdout.fnmatch_lines(["*pytest_gpu.sim.OutOfMemoryError: Simulated CUDA out of memory on GPU 0 *"])
    assert "OutOfMemoryError: Simulated CUDA out of memory on GPU 1" not in result.stdout.str()  # all on GPU 0
    assert "pytest-gpu:" not in result.stdout.str()  # the plugin really was off
    assert (ledger / "ledger.json").exists()  # the raw run used the ledger it was given


MANY_WORKERS = """
import pytest
from pytest_gpu import sim

CASES = [
    pytest.param(1 + i % 2, marks=pytest.mark.gpu(memory=f"{1 + i % 2}GiB"), id=f"t{i:02d}")
    for i in range(64)
]

@pytest.mark.parametrize("gib", CASES)
def test_small(gib, gpu, port):
    assert len(gpu.indices) == 1
    sim.hold(f"{gib}GiB", 0.02)
"""


def test_32_workers_on_4_gpus(gpu_pytester, run_inner):
    gpu_pytester.makepyfile(test_many=MANY_WORKERS)
    result = run_inner("--gpus", "sim:4x16GiB", "-n", "32", subprocess=True, timeout=180)
    result.assert_outcomes(passed=64)
    assert result.ret == pytest.ExitCode.OK
    out = result.stdout.str()
    assert "OutOfMemoryError" not in out
    assert "cannot fit beside the CUDA contexts" not in out
    assert "died while running" not in out
    result.stdout.fnmatch_lines(
        ["created: 32/32 workers", "pytest-gpu: 4 simulated GPUs * · 64 GPU tests · * · 0 violations"]
    )
