"""Last run's failures first (``--ff``, ``-x``), new tests first (``--nf``) under the GPU scheduler.

The scheduler reads pytest's own cache (``cache/lastfailed``, ``cache/nodeids``) at the
xdist controller and gives the planner an :class:`~pytest_gpu.scheduling.planner.Order`. The unit
tests check :func:`pytest_gpu.scheduling.scheduler.order`; the end-to-end ones run an inner suite
twice on one cache directory: a first run records durations and a failure, the second
(``--ff`` or ``-x``) must start the failing test among the first ones.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import cached_args, patience
from pytest_gpu.scheduling.scheduler import order

COLLECTION = ["t.py::test_a", "t.py::test_b", "t.py::K::test_c", "u.py::test_d[1]", "u.py::test_d[2]"]


def test_order_without_options_is_the_default() -> None:
    got = order(COLLECTION, {"t.py::test_b"}, set(COLLECTION), failed_first=False, new_first=False, stop_early=False)
    assert got.ahead == {} and not got.shortest_first


def test_order_ff_moves_last_failures_ahead() -> None:
    got = order(COLLECTION, {"t.py::test_b", "gone.py::x"}, None, failed_first=True, new_first=False, stop_early=False)
    assert got.ahead == {1: 1} and not got.shortest_first


def test_order_maxfail_moves_failures_ahead_and_the_rest_shortest_first() -> None:
    got = order(COLLECTION, {"u.py::test_d[2]"}, None, failed_first=False, new_first=False, stop_early=True)
    assert got.ahead == {4: 1} and got.shortest_first


def test_order_a_collector_that_failed_covers_its_tests() -> None:
    got = order(COLLECTION, {"t.py::K", "u.py"}, None, failed_first=True, new_first=False, stop_early=False)
    assert got.ahead == {2: 1, 3: 1, 4: 1}


def test_order_nf_moves_new_tests_ahead_of_failures() -> None:
    known, failed = set(COLLECTION[:3]), {"t.py::test_a", "u.py::test_d[2]"}
    got = order(COLLECTION, failed, known, failed_first=True, new_first=True, stop_early=False)
    assert got.ahead == {0: 1, 3: 2, 4: 3}
    # nothing recorded yet: no test is "new"
    assert order(COLLECTION, set(), None, failed_first=False, new_first=True, stop_early=False).ahead == {}


# -- end to end -----------------------------------------------------------------------------------

# each test notes its start (in the worker that runs it), in order
STARTED = """
import os


def pytest_runtest_setup(item):
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "started.log"), "a") as fh:
        fh.write(item.nodeid + "\\n")
"""

SUITE = """
import time

import pytest

@pytest.mark.parametrize("i", range(8))
def test_slow(i):
    time.sleep(0.4)

@pytest.mark.gpu(memory="2GiB")
@pytest.mark.parametrize("i", range(4))
def test_gpu(i):
    time.sleep(0.3)

def test_quick():
    assert False, "fails at once"
"""

QUICK = "test_ff.py::test_quick"
TOTAL = 13


def started(path: Path) -> list[str]:
    log = path / "started.log"
    lines = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    return lines


@pytest.fixture
def recorded(gpu_pytester: pytest.Pytester) -> tuple[str, ...]:
    """A first run on 2 workers: durations recorded, ``test_quick`` failed, and (longest first) ran last."""
    gpu_pytester.makeconftest(STARTED)
    gpu_pytester.makepyfile(test_ff=SUITE)
    args = (*cached_args(gpu_pytester), "--gpus", "sim:4x16GiB", "-n", "2")
    first = gpu_pytester.runpytest_subprocess(*args, timeout=patience(120))
    first.assert_outcomes(passed=TOTAL - 1, failed=1)
    assert len(started(gpu_pytester.path)) == TOTAL
    cache = gpu_pytester.path / ".pytest_cache" / "v"
    assert QUICK in (cache / "cache" / "lastfailed").read_text()
    assert QUICK in (cache / "pytest_gpu" / "durations").read_text()
    return args


def test_ff_runs_last_failure_first(gpu_pytester: pytest.Pytester, recorded: tuple[str, ...]) -> None:
    second = gpu_pytester.runpytest_subprocess(*recorded, "--ff", "-v", timeout=patience(120))
    second.assert_outcomes(passed=TOTAL - 1, failed=1)
    order_run = started(gpu_pytester.path)
    assert len(order_run) == TOTAL
    assert order_run.index(QUICK) < 2, order_run  # the first test of one of the two workers
    second.stdout.fnmatch_lines(["*GpuScheduling*"])


def test_x_stops_after_few_tests(gpu_pytester: pytest.Pytester, recorded: tuple[str, ...]) -> None:
    second = gpu_pytester.runpytest_subprocess(*recorded, "-x", timeout=patience(120))
    outcomes = second.parseoutcomes()
    assert outcomes.get("failed") == 1
    ran = started(gpu_pytester.path)
    # the failure first; at most what the two workers held then (two each) besides it
    assert QUICK in ran[:2] and len(ran) <= 5, ran
    assert outcomes.get("passed", 0) <= 4, outcomes
