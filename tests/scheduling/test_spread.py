"""Spread compute, pack memory, end to end: with GPUs idle, two GPU tests that run at the same
time never share a GPU (an inner ``-n 2`` run on ``sim:2x16GiB``).

The rule itself is :func:`pytest_gpu.machine.placement.place`'s (tests/machine/
test_placement_spread.py); the scheduler's plans follow it (tests/scheduling/test_planner.py).
"""

from __future__ import annotations

import json

import pytest

from conftest import INNER_ARGS
from helpers import patience

# Two 4 GiB tests that meet: each says where it runs, then waits for the other, so they are
# provably concurrent whatever the scheduler's order; a test that never meets the other fails.
MEETING = """
import json
import pathlib
import time

import pytest

from pytest_gpu import sim

HERE = pathlib.Path(__file__).parent


def meet(name, other, gpu):
    with sim.allocate("3GiB", gpu.device):  # the test's memory, on its GPU
        (HERE / f"{name}.json").write_text(json.dumps(list(gpu.indices)))
        deadline = time.monotonic() + 90
        while not (HERE / f"{other}.json").exists():
            assert time.monotonic() < deadline, f"{other} never ran at the same time as {name}"
            time.sleep(0.02)
        time.sleep(0.3)  # both hold their leases (and GPUs) together a while


@pytest.mark.gpu(memory="4GiB")
def test_a(gpu):
    meet("a", "b", gpu)


@pytest.mark.gpu(memory="4GiB")
def test_b(gpu):
    meet("b", "a", gpu)
"""


def met(pytester: pytest.Pytester, *args: str) -> tuple[list[int], list[int], str]:
    """The GPUs test_a and test_b ran on, and the run's output."""
    pytester.makepyfile(test_meet=MEETING)
    result = pytester.runpytest_subprocess(
        *INNER_ARGS, "--gpus", "sim:2x16GiB", "-n", "2", *args, timeout=patience(120)
    )
    result.assert_outcomes(passed=2)
    a = json.loads((pytester.path / "a.json").read_text())
    b = json.loads((pytester.path / "b.json").read_text())
    assert len(a) == len(b) == 1
    return a, b, result.stdout.str()


@pytest.mark.parametrize("schedule", ["gpu", "off"])
def test_two_concurrent_gpu_tests_never_share_a_gpu_while_another_idles(
    gpu_pytester: pytest.Pytester, schedule: str
) -> None:
    a, b, out = met(gpu_pytester, *(["--gpu-schedule=off"] if schedule == "off" else []))
    assert a != b, f"both tests ran on GPU {a[0]} while the other GPU idled:\n{out[-2000:]}"


def test_the_bench_switch_puts_them_on_one_gpu_as_before(
    gpu_pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PYTEST_GPU_PLACEMENT=affinity (bench/makespan.py's other arm): the scheduler packs, the
    broker honours its plan, both run on GPU 0 (the issue's ``GPU busy 0:53% 1:0%``)."""
    monkeypatch.setenv("PYTEST_GPU_PLACEMENT", "affinity")
    a, b, out = met(gpu_pytester)
    assert a == b == [0], out[-2000:]


def test_a_bad_placement_switch_is_a_usage_error(
    gpu_pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTEST_GPU_PLACEMENT", "packed")
    gpu_pytester.makepyfile(test_one="def test_one(): pass\n")
    result = gpu_pytester.runpytest_subprocess(*INNER_ARGS, "--gpus", "sim:2x16GiB", timeout=patience(60))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*PYTEST_GPU_PLACEMENT='packed': expected 'spread' or 'affinity'*"])
