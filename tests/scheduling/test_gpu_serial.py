"""``@pytest.mark.gpu_serial``: a test that has the machine alone.

No other test of the run runs while it does (the scheduler drains, runs it, resumes: the
planner's rule 0), and it leases every GPU of the run exclusively, so no other run's test
is on them either. Checked from the planner alone (simulated time) and end to end from
``--gpu-trace`` files of inner runs on simulated GPUs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest

from conftest import INNER_ARGS
from helpers import NODE, load_trace, one_node, patience
from pytest_gpu.scheduling.planner import Job, Need

Run = Callable[..., pytest.RunResult]


# -- the planner (rule 0) ---------------------------------------------------------------------


def alone(index: int, duration: float = 1.0, **kw: Any) -> Job:
    return Job(index, duration, Need(2, None), alone=True, **kw)


def test_tests_that_run_alone_go_first_one_after_another_on_one_worker() -> None:
    # collected last, and shorter than the rest: they still go first
    jobs = [Job(0, 9.0), Job(1, 8.0, Need(1, 4)), Job(2, 7.0), alone(3, 0.5), alone(4, 2.0)]
    planner = one_node(jobs, [16, 16])
    for w in "ABC":
        planner.add_worker(w, NODE)
    assert planner.pick("A", 0.0) == 4  # longest first among them
    assert planner.pick("B", 0.0) is None  # the run is 4's alone
    assert planner.pick("C", 0.0) is None
    assert planner.pick("A", 0.0) == 3  # its successor: the next one that runs alone
    planner.complete("A", 4, 2.0)
    assert planner.pick("B", 2.0) is None and planner.pick("C", 2.0) is None  # 3 runs now
    assert planner.pick("A", 2.0) == 0  # 3's successor, started once 3 finished
    assert planner.pick("B", 2.0) is None  # 3 has not finished yet
    planner.complete("A", 3, 2.5)
    assert {planner.pick("B", 2.5), planner.pick("C", 2.5)} == {1, 2}  # everyone works again
    assert planner.pending == 0


def test_a_pending_test_that_runs_alone_waits_until_no_worker_runs_a_test() -> None:
    # a test that runs alone pending while others run (a rerun put it back): drain first
    jobs = [alone(0, 1.0), Job(1, 3.0), Job(2, 2.0), Job(3, 1.0), Job(4, 1.0)]
    planner = one_node(jobs, [16, 16])
    planner.add_worker("A", NODE)
    planner.add_worker("B", NODE)
    assert planner.pick("A", 0.0) == 0
    assert planner.pick("A", 0.0) == 1
    planner.complete("A", 0, 1.0)
    assert planner.pick("A", 1.0) == 2  # 1 runs on A
    assert planner.pick("B", 1.0) == 3  # B holds 3, not started: it waits for a successor
    planner.requeue(0)
    assert planner.eligible("B") and planner.pending == 2
    assert planner.pick("B", 1.0) is None  # A runs 1: nothing else is handed out, 0 included
    planner.complete("A", 1, 4.0)  # A holds 2, B holds 3: neither runs a test
    assert planner.pick("A", 4.0) == 0  # 2 runs, then 0; B's 3 does not start meanwhile
    assert planner.pick("B", 4.0) is None
    planner.complete("A", 2, 6.0)
    assert planner.pick("B", 6.0) is None  # 0 runs now
    assert planner.pick("A", 6.0) == 4
    planner.complete("A", 0, 7.0)
    assert planner.queue("B") == [3] and planner.pending == 0


def test_a_group_with_a_test_that_runs_alone_runs_alone_as_a_whole_in_order() -> None:
    jobs = [Job(0, 5.0), Job(1, 1.0, group="g"), alone(2, 1.0, group="g"), Job(3, 1.0, group="g"), Job(4, 5.0)]
    planner = one_node(jobs, [16, 16])
    planner.add_worker("A", NODE)
    planner.add_worker("B", NODE)
    assert planner.alone == {1, 2, 3}
    assert planner.pick("A", 0.0) == 1  # the group's first test, though it needs no GPU
    assert planner.pick("B", 0.0) is None
    assert planner.pick("A", 0.0) == 2
    planner.complete("A", 1, 1.0)
    assert planner.pick("B", 1.0) is None
    assert planner.pick("A", 1.0) == 3
    planner.complete("A", 2, 2.0)
    assert planner.pick("B", 2.0) is None  # 3 runs alone too: it is in the group
    assert planner.pick("A", 2.0) in (0, 4)
    planner.complete("A", 3, 3.0)
    assert planner.pick("B", 3.0) in (0, 4) and planner.pending == 0


def test_a_test_that_runs_alone_goes_back_to_pending_when_its_worker_dies() -> None:
    planner = one_node([alone(0), alone(1), Job(2, 1.0), Job(3, 1.0)], [16, 16])
    planner.add_worker("A", NODE)
    planner.add_worker("B", NODE)
    assert planner.pick("A", 0.0) == 0
    assert planner.pick("A", 0.0) == 1
    assert planner.remove_worker("A") == [0, 1]  # 0 crashed, 1 goes back
    assert planner.pick("B", 1.0) == 1  # no worker runs a test: it goes at once
    assert planner.pick("B", 1.0) == 2


def test_a_suite_without_such_tests_is_planned_as_before() -> None:
    planner = one_node([Job(0, 1.0), Job(1, 2.0)], [16])
    planner.add_worker("A", NODE)
    planner.add_worker("B", NODE)
    assert planner.alone == frozenset()
    assert (planner.pick("A", 0.0), planner.pick("B", 0.0)) == (1, 0)


# -- end to end -------------------------------------------------------------------------------

MIX = """
import time

import pytest
from pytest_gpu import sim

@pytest.mark.parametrize("i", range(6))
@pytest.mark.gpu(memory="2GiB")
def test_gpu(i):
    sim.hold("1GiB", 0.3)

@pytest.mark.parametrize("i", range(6))
def test_cpu(i):
    time.sleep(0.3)

@pytest.mark.gpu_serial
def test_bench(gpu):
    assert sorted(gpu.indices) == [0, 1, 2, 3] and gpu.exclusive
    sim.hold("1GiB", 0.4)

@pytest.mark.gpu_serial
def test_measure():
    time.sleep(0.2)

class TestGrouped:
    @pytest.mark.xdist_group("bench")
    def test_prepare(self):
        time.sleep(0.1)

    @pytest.mark.xdist_group("bench")
    @pytest.mark.gpu_serial
    def test_after_prepare(self):
        time.sleep(0.1)
"""

ALONE = (
    "test_mix.py::test_bench",
    "test_mix.py::test_measure",
    "test_mix.py::TestGrouped::test_prepare",
    "test_mix.py::TestGrouped::test_after_prepare",
)


def spans_of(events: list[dict[str, Any]]) -> dict[str, tuple[int, int, int]]:
    """Node id -> (start, end, worker track) of each test in the trace (setup to teardown)."""
    return {
        e["args"]["nodeid"]: (e["ts"], e["ts"] + e["dur"], e["tid"])
        for e in events
        if e.get("ph") == "X" and e.get("cat") == "test"
    }


def overlapping(spans: dict[str, tuple[int, int, int]], nodeid: str) -> list[str]:
    start, end, _ = spans[nodeid]
    return sorted(n for n, (s, e, _) in spans.items() if n != nodeid and s < end and e > start)


def most_at_once(spans: list[tuple[int, int, int]]) -> int:
    edges = sorted([(s, 1) for s, _, _ in spans] + [(e, -1) for _, e, _ in spans])
    level = top = 0
    for _, step in edges:
        level += step
        top = max(top, level)
    return top


def test_a_serial_test_overlaps_no_other_test_and_the_run_resumes_in_parallel(
    gpu_pytester: pytest.Pytester, run_inner: Run
) -> None:
    gpu_pytester.makepyfile(test_mix=MIX)
    trace = gpu_pytester.path / "trace.json"
    args = ("--gpus", "sim:4x16GiB", "-n", "4", "--strict-markers", "--gpu-trace", str(trace))
    result = run_inner(*args, subprocess=True)
    result.assert_outcomes(passed=16)
    events, _ = load_trace(trace)
    spans = spans_of(events)
    assert len(spans) == 16
    for nodeid in ALONE:  # the serial tests, and the group one of them is in
        assert overlapping(spans, nodeid) == [], nodeid
    # they go first, as a batch (one drain); the group on one worker, in collection order
    assert max(spans[n][1] for n in ALONE) <= min(s for n, (s, _, _) in spans.items() if n not in ALONE)
    prepare, after = spans[ALONE[2]], spans[ALONE[3]]
    assert prepare[2] == after[2] and prepare[1] <= after[0]
    # the others ran side by side: the drain is no serialisation of the whole run
    others = [span for n, span in spans.items() if n not in ALONE]
    assert most_at_once(others) >= 2 and len({tid for _, _, tid in others}) >= 2
    # every GPU of the run, exclusively, for each serial test
    leases = [e for e in events if e.get("ph") == "X" and e.get("cat") == "lease"]
    for nodeid in (ALONE[0], ALONE[1], ALONE[3]):
        mine = [e for e in leases if e["args"]["nodeid"] == nodeid]
        assert sorted(e["pid"] - 100 for e in mine) == [0, 1, 2, 3], nodeid
        assert all(e["args"]["exclusive"] for e in mine), nodeid
    assert not [e for e in leases if e["args"]["nodeid"] == ALONE[2]]  # the group's other test: no GPU
    # a serial test's lease is not its to size: no memory= suggestion for it
    assert "test_bench: asked" not in result.stdout.str() and "test_measure: asked" not in result.stdout.str()


CPU_ONLY = """
import time

import pytest

@pytest.mark.parametrize("i", range(6))
def test_cpu(i):
    time.sleep(0.2)

@pytest.mark.gpu_serial
def test_alone(request):
    assert "gpu" not in request.fixturenames
    time.sleep(0.3)
"""


def test_a_serial_test_without_gpus_is_still_alone_in_the_run(gpu_pytester: pytest.Pytester, run_inner: Run) -> None:
    gpu_pytester.makepyfile(test_cpu_only=CPU_ONLY)
    trace = gpu_pytester.path / "trace.json"
    result = run_inner("--gpus", "none", "-n", "3", "--gpu-trace", str(trace), subprocess=True)
    result.assert_outcomes(passed=7)
    events, _ = load_trace(trace)
    spans = spans_of(events)
    assert overlapping(spans, "test_cpu_only.py::test_alone") == []
    assert not [e for e in events if e.get("cat") == "lease"]
    assert most_at_once([s for n, s in spans.items() if "test_alone" not in n]) >= 2


FAILING_FIRST = """
import time

import pytest

@pytest.mark.parametrize("i", range(4))
def test_quick(i):
    time.sleep(0.05)

@pytest.mark.gpu_serial
def test_bench():
    time.sleep(0.2)
    assert False, "too slow"
"""


def test_with_x_a_failing_serial_test_stops_the_run_before_any_other_test_started(
    gpu_pytester: pytest.Pytester, run_inner: Run
) -> None:
    gpu_pytester.makepyfile(test_first=FAILING_FIRST)
    result = run_inner("--gpus", "sim:2x16GiB", "-n", "2", "-x", subprocess=True)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*test_first.py::test_bench*too slow*"])


PLACED_BY_XDIST = """
import pytest

@pytest.mark.parametrize("i", range(3))
def test_other(i):
    pass

@pytest.mark.gpu_serial
def test_bench():
    pass
"""


@pytest.mark.parametrize(
    ("args", "chosen"),
    [
        (("-n", "2", "--dist", "load"), "--dist load"),
        (("-n", "2", "--dist=loadfile"), "--dist loadfile"),
        (("-n", "2", "--gpu-schedule=off"), "--gpu-schedule=off"),
    ],
    ids=["dist-load", "dist-loadfile", "schedule-off"],
)
def test_under_xdists_own_scheduling_a_serial_test_fails_saying_what_to_do(
    gpu_pytester: pytest.Pytester, run_inner: Run, args: tuple[str, ...], chosen: str
) -> None:
    gpu_pytester.makepyfile(test_placed=PLACED_BY_XDIST)
    result = run_inner("--gpus", "sim:2x16GiB", *args, subprocess=True)
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(
        [
            f"*pytest-gpu: test_placed.py::test_bench is marked gpu_serial, but under {chosen} xdist hands out "
            f"the tests and other tests would run beside it; drop {chosen} (pytest-gpu's scheduler then runs it "
            f"alone), or give these tests a pass of their own: -m gpu_serial without -n, and -m 'not gpu_serial' "
            f"with {chosen}"
        ]
    )


@pytest.mark.parametrize("args", [("-n", "1", "--dist", "load"), ()], ids=["one-worker", "no-xdist"])
def test_one_process_or_one_worker_runs_a_serial_test_whatever_the_dist_mode(
    gpu_pytester: pytest.Pytester, run_inner: Run, args: tuple[str, ...]
) -> None:
    gpu_pytester.makepyfile(test_placed=PLACED_BY_XDIST)
    result = run_inner("--gpus", "sim:2x16GiB", "--gpu-schedule=off", *args, subprocess=bool(args))
    result.assert_outcomes(passed=4)


REFUSED = {
    "arguments": (
        "@pytest.mark.gpu_serial(2)\ndef test_x(): pass\n",
        "test_refused.py::test_x: gpu_serial takes no arguments, got (2); expected @pytest.mark.gpu_serial "
        "(no arguments)",
    ),
    "keyword": (
        "@pytest.mark.gpu_serial(exclusive=True)\ndef test_x(): pass\n",
        "test_refused.py::test_x: gpu_serial takes no arguments, got (exclusive=True); expected "
        "@pytest.mark.gpu_serial (no arguments)",
    ),
    "gpu-marker": (
        "pytestmark = pytest.mark.gpu(memory='1GiB')\n\n@pytest.mark.gpu_serial\ndef test_x(): pass\n",
        "test_refused.py::test_x: both gpu_serial and a gpu marker: a gpu_serial test holds every GPU of the "
        "run exclusively (its gpu fixture is that lease); remove the gpu marker (from the test, or its class "
        "or module)",
    ),
    "distributed": (
        "@pytest.mark.gpu_serial\n@pytest.mark.distributed(2)\ndef test_x(rank): pass\n",
        "test_refused.py::test_x: both gpu_serial and a distributed marker: a distributed test's rank pool "
        "leases GPUs of its own, which a gpu_serial test holds every GPU of the run exclusively would keep "
        "from it; remove one of the two",
    ),
    "section": (
        "@pytest.mark.gpu_serial\ndef test_x(gpu_request): pass\n",
        "test_refused.py::test_x: gpu_serial with a lease of its own besides (gpu_request): a gpu_serial "
        "test holds every GPU of the run exclusively, so that lease would wait for the test itself; use the "
        "test's gpu fixture instead (its lease: every GPU)",
    ),
    "fixture-lease": (
        "@pytest.fixture(scope='module')\ndef model(gpu_lease_factory):\n"
        "    return gpu_lease_factory(memory='1GiB')\n\n"
        "@pytest.mark.gpu_serial\ndef test_x(model): pass\n",
        "test_refused.py::test_x: gpu_serial with a lease of its own besides (model): *",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_a_serial_test_cannot_be_combined_with_fails_collection_naming_it(
    gpu_pytester: pytest.Pytester, run_inner: Run, case: str
) -> None:
    source, message = REFUSED[case]
    gpu_pytester.makepyfile(test_refused="import pytest\n\n" + source)
    result = run_inner("--gpus", "sim:2x16GiB", "--strict-markers")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*pytest-gpu: invalid GPU request", message.replace("[", "[[]")])


CONVENTIONS = """
import pytest

@pytest.mark.large
@pytest.mark.gpu_serial
def test_mapped(gpu):
    assert len(gpu.indices) == 2 and gpu.exclusive

@pytest.mark.gpu_serial
def test_cuda_hooked(gpu):
    assert len(gpu.indices) == 2 and gpu.exclusive
"""

HOOK = """
import pytest

@pytest.hookimpl(optionalhook=True)
def pytest_gpu_item_request(item):
    if item.name.startswith("test_cuda_"):
        return {"memory": "1GiB"}
"""


def test_the_marker_map_and_the_hook_do_not_shrink_a_serial_tests_lease(
    gpu_pytester: pytest.Pytester, run_inner: Run
) -> None:
    gpu_pytester.makeini("[pytest]\nmarkers =\n    large: big\ngpu_marker_map =\n    large: count=1 memory=1GiB\n")
    gpu_pytester.makeconftest(HOOK)
    gpu_pytester.makepyfile(test_serial_conventions=CONVENTIONS)
    result = run_inner("--gpus", "sim:2x16GiB", "--strict-markers")
    result.assert_outcomes(passed=2)


def test_the_marker_is_registered(gpu_pytester: pytest.Pytester, run_inner: Run) -> None:
    result = run_inner("--markers")
    result.stdout.fnmatch_lines(["@pytest.mark.gpu_serial: the test runs alone: *see pytest-gpu's README."])


# -- across runs --------------------------------------------------------------------------------

HOLDS_THE_MACHINE = """
import os, time

import pytest

@pytest.mark.gpu_serial
def test_bench(gpu):
    with open(os.environ["TIMES"], "a") as out:
        out.write(f"bench-start {time.time()}\\n")
    time.sleep(2.0)
    with open(os.environ["TIMES"], "a") as out:
        out.write(f"bench-end {time.time()}\\n")
"""

WANTS_A_GPU = """
import os, time

import pytest

@pytest.mark.gpu(memory="1GiB")
def test_small(gpu):
    with open(os.environ["TIMES"], "a") as out:
        out.write(f"small-start {time.time()}\\n")
"""


def test_no_other_runs_test_is_on_the_gpus_while_a_serial_test_runs(gpu_pytester: pytest.Pytester) -> None:
    path = gpu_pytester.path
    (path / "bench").mkdir()
    (path / "bench" / "test_bench.py").write_text(HOLDS_THE_MACHINE)
    (path / "small").mkdir()
    (path / "small" / "test_small.py").write_text(WANTS_A_GPU)
    times = path / "times.txt"
    env = {**os.environ, "PYTEST_GPU_SIM_MACHINE": "shared", "TIMES": str(times)}

    def start(where: str, *args: str) -> subprocess.Popen[str]:
        command = [sys.executable, "-m", "pytest", *INNER_ARGS, "-q", "--gpus", "sim:2x16GiB", *args, where]
        return subprocess.Popen(command, cwd=path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    bench = start("bench", "-n", "2")
    try:
        deadline = time.monotonic() + patience(120)
        while not (times.exists() and "bench-start" in times.read_text()):
            assert bench.poll() is None, bench.communicate()[0]
            assert time.monotonic() < deadline, "the serial test did not start"
            time.sleep(0.05)
        small = start("small")
        out_small, _ = small.communicate(timeout=patience(120))
    finally:
        out_bench, _ = bench.communicate(timeout=patience(120))
    assert bench.returncode == 0, out_bench
    assert small.returncode == 0, out_small
    stamps = dict(line.split() for line in times.read_text().splitlines())
    assert float(stamps["small-start"]) >= float(stamps["bench-end"]), stamps  # it waited for the whole machine
