"""--gpu-learn: measured peaks recorded in the cache and used as requests by later runs."""

from __future__ import annotations

import json

import pytest

GiB, MiB = 2**30, 2**20
SUITE = """
import json, os
import pytest
from pytest_gpu import sim

def record(name, gpu):
    with open(os.environ["LEASES"], "a") as f:
        f.write(json.dumps([name, gpu.memory, gpu.exclusive]) + "\\n")

@pytest.mark.gpu
def test_big(gpu):
    record("big", gpu)
    with sim.allocate("1GiB"):
        pass

def test_tiny(gpu):
    record("tiny", gpu)
    with sim.allocate("100MiB"):
        pass

@pytest.mark.gpu(memory="3GiB")
def test_named(gpu):
    record("named", gpu)
    with sim.allocate("1GiB"):
        pass
"""
ARGS = ("--gpus", "sim:2x16GiB", "-p", "no:benchmark", "-p", "no:hypothesispytest")


def leases(pytester: pytest.Pytester) -> dict[str, list[object]]:
    path = pytester.path / "leases"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.unlink()
    return {name: [memory, exclusive] for name, memory, exclusive in rows}


def test_learned_peaks_become_the_requests_of_later_runs(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_suite=SUITE)
    monkeypatch.setenv("LEASES", str(pytester.path / "leases"))
    whole = 16 * GiB - 500 * MiB
    pytester.runpytest_subprocess("-n", "2", "--gpu-learn", *ARGS).assert_outcomes(passed=3)
    first = leases(pytester)
    assert first == {"big": [whole, True], "tiny": [whole, True], "named": [3 * GiB, False]}
    pytester.runpytest_subprocess("-n", "2", "--gpu-learn", *ARGS).assert_outcomes(passed=3)
    # max(1.25 x peak, 256MiB); a test that names its memory keeps it
    assert leases(pytester) == {
        "big": [int(1.25 * GiB), False],
        "tiny": [256 * MiB, False],
        "named": [3 * GiB, False],
    }
    pytester.runpytest_subprocess(*ARGS).assert_outcomes(passed=3)  # without the flag: the default again
    assert leases(pytester) == first
