"""The GPU-aware xdist scheduler, end to end through inner pytest runs on simulated GPUs.

Each test checks one behaviour a user relies on: which scheduler ``-n`` uses, groups and
pytest-dependency chains kept on one worker, warm rank pools reused, longest tests first
from the recorded durations, no GPU wait when CPU work can fill the gap, a killed worker
never hanging the run, the ``--gpu-trace`` file and the terminal summary.

Where a test reads who ran what and when, an inner conftest (``REPORTER``) writes every
report the controller sees (a serial run's too) as a JSON line.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from conftest import require
from helpers import cached_args, load_trace, patience

# The controller (or a serial run) sees every worker's reports, crashed tests included.
REPORTER = """
import json
import os


def pytest_runtest_logreport(report):
    if "PYTEST_XDIST_WORKER" in os.environ:
        return
    node = getattr(report, "node", None)
    record = {
        "nodeid": report.nodeid,
        "when": report.when,
        "outcome": report.outcome,
        "worker": str(node.gateway.id) if node is not None else "main",
        "start": float(getattr(report, "start", 0.0) or 0.0),
        "longrepr": report.longreprtext,
        "props": dict(report.user_properties),
    }
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "reports.jsonl"), "a") as fh:
        fh.write(json.dumps(record, default=str) + "\\n")
"""

Run = Callable[..., pytest.RunResult]


def reports(path: Path) -> dict[str, dict[str, Any]]:
    """Node id -> worker, earliest start, outcome (the first phase that did not pass), longrepr, properties."""
    out: dict[str, dict[str, Any]] = {}
    reports_file = path / "reports.jsonl"
    if not reports_file.exists():
        return out
    for line in reports_file.read_text().splitlines():
        row = json.loads(line)
        rec = out.setdefault(
            row["nodeid"], {"worker": row["worker"], "start": 0.0, "outcome": "passed", "longrepr": "", "props": {}}
        )
        if row["start"] and (not rec["start"] or row["start"] < rec["start"]):
            rec["start"] = row["start"]
        if row["outcome"] != "passed" and rec["outcome"] == "passed":
            rec["outcome"], rec["longrepr"] = row["outcome"], row["longrepr"]
        rec["props"].update(row["props"])
    return out


def starts_by_worker(recs: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """Worker -> node ids in the order the worker started them."""
    out: dict[str, list[str]] = {}
    for nodeid, rec in sorted(recs.items(), key=lambda kv: kv[1]["start"]):
        out.setdefault(rec["worker"], []).append(nodeid)
    return out


def spans_of_tests(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The trace's test spans, by start."""
    return sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "test"), key=lambda e: e["ts"])


# -- which scheduler -n uses ----------------------------------------------------------------------

FEW = (
    "import pytest\n\n@pytest.mark.parametrize('i', range(3))\ndef test_x(i): pass\n\n"
    "@pytest.mark.gpu(memory='1GiB')\ndef test_g(): pass\n"
)
SCHEDULERS = pytest.mark.parametrize(
    ("args", "scheduler"),
    [
        ((), "GpuScheduling"),
        (("--gpu-schedule=off",), "LoadScheduling"),
        (("-o", "gpu_schedule=off"), "LoadScheduling"),
        (("--dist", "load"), "LoadScheduling"),  # the user's explicit choice wins
        (("--dist", "loadgroup"), "LoadGroupScheduling"),
    ],
    ids=["default", "off", "ini-off", "dist-load", "dist-loadgroup"],
)

# The controller as ``-n 2`` configures it (pytest-gpu's and xdist's command-line and
# configure hooks have run), asked for its scheduler the way xdist's session asks; then
# that session is taken out, so the tests run in this process instead of starting workers
# (no worker, so no terminal summary of a distributed run: the end-to-end test checks that).
SCHEDULER_PROBE = """
import pytest


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    dsession = config.pluginmanager.getplugin("dsession")
    scheduler = config.hook.pytest_xdist_make_scheduler(config=config, log=dsession.log)
    (config.rootpath / "scheduler.txt").write_text(type(scheduler).__name__)
    config.pluginmanager.unregister(dsession)
"""


@SCHEDULERS
def test_n_uses_gpu_scheduling_unless_off_or_dist_chosen(
    gpu_pytester: pytest.Pytester, run_inner: Run, args: tuple[str, ...], scheduler: str
) -> None:
    gpu_pytester.makeconftest(SCHEDULER_PROBE)
    gpu_pytester.makepyfile(test_few=FEW)
    result = run_inner("--gpus", "sim:4x16GiB", "-n", "2", "-v", *args)
    result.assert_outcomes(passed=4)
    assert (gpu_pytester.path / "scheduler.txt").read_text() == scheduler


@pytest.mark.parametrize(
    ("args", "scheduler"),
    [((), "GpuScheduling"), (("--dist", "loadgroup"), "LoadGroupScheduling")],
    ids=["default", "dist-loadgroup"],
)
def test_n_uses_the_chosen_scheduler_end_to_end(
    gpu_pytester: pytest.Pytester, run_inner: Run, args: tuple[str, ...], scheduler: str
) -> None:
    """The probe's answer is the scheduler real workers get, and an explicit --dist is said
    in the summary (--gpu-schedule=off is not: test_cpu_work_fills_the_gap_... checks)."""
    gpu_pytester.makepyfile(test_few=FEW)
    result = run_inner("--gpus", "sim:4x16GiB", "-n", "2", "-v", *args, subprocess=True)
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines([f"scheduling tests via {scheduler}"])
    said = "the GPU scheduler is off" in result.stdout.str()
    assert said == ("--dist" in args), result.stdout.str()  # an explicit --dist is said in the summary
    if "--dist" in args:
        result.stdout.fnmatch_lines([f"pytest-gpu: --dist {args[1]} chosen: xdist places the tests, *"])


@pytest.mark.parametrize("where", ["option", "ini"])
def test_bad_gpu_schedule_value_is_a_usage_error(gpu_pytester: pytest.Pytester, run_inner: Run, where: str) -> None:
    gpu_pytester.makepyfile(test_one="def test_one(): pass\n")
    if where == "ini":
        gpu_pytester.makeini("[pytest]\ngpu_schedule = maybe\n")
        result = run_inner("--gpus", "sim:1x16GiB")
        named = "ini key 'gpu_schedule'"
    else:
        result = run_inner("--gpus", "sim:1x16GiB", "--gpu-schedule=maybe")
        named = "--gpu-schedule"
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: {named}: expected one of on, off, got 'maybe'"])


# -- groups ---------------------------------------------------------------------------------------

GROUPS = """
import time

import pytest

def work():
    time.sleep(0.15)

@pytest.mark.xdist_group("g")
def test_g1(): work()

def test_f1(): work()

@pytest.mark.xdist_group("h")
def test_h1(): work()

@pytest.mark.xdist_group("g")
def test_g2(): work()

def test_f2(): work()

@pytest.mark.xdist_group("h")
def test_h2(): work()

def test_f3(): work()

@pytest.mark.xdist_group("g")
def test_g3(): work()

def test_f4(): work()

@pytest.mark.xdist_group("g")
def test_g4(): work()
"""


def test_xdist_group_runs_on_one_worker_in_collection_order(gpu_pytester: pytest.Pytester, run_inner: Run) -> None:
    gpu_pytester.makeconftest(REPORTER)
    gpu_pytester.makepyfile(test_groups=GROUPS)
    result = run_inner("--gpus", "sim:1x16GiB", "-n", "3", subprocess=True)
    result.assert_outcomes(passed=10)
    recs = reports(gpu_pytester.path)
    assert len({r["worker"] for r in recs.values()}) >= 2  # more workers than groups, and they were used
    order = starts_by_worker(recs)
    for group, members in (("g", ["test_g1", "test_g2", "test_g3", "test_g4"]), ("h", ["test_h1", "test_h2"])):
        ids = [f"test_groups.py::{m}" for m in members]
        workers = {recs[i]["worker"] for i in ids}
        assert len(workers) == 1, (group, {i: recs[i]["worker"] for i in ids})
        ran = [i for i in order[workers.pop()] if i in ids]
        assert ran == ids, (group, ran)


DEPENDENCY = """
import time

import pytest

def work():
    time.sleep(0.05)

@pytest.mark.dependency()
def test_a(): work()

@pytest.mark.parametrize("i", range(4))
def test_fill1(i): work()

@pytest.mark.dependency()
def test_x(): assert False, "x fails"

@pytest.mark.dependency(depends=["test_a"])
def test_b(): work()

@pytest.mark.parametrize("i", range(4))
def test_fill2(i): work()

@pytest.mark.dependency(depends=["test_x"])
def test_y(): work()

@pytest.mark.dependency(depends=["test_b"])
def test_c(): work()

@pytest.mark.parametrize("i", range(4))
def test_fill3(i): work()

@pytest.mark.dependency(depends=["test_y"])
def test_z(): work()
"""

DEP_OUTCOMES = {
    "test_a": "passed",
    "test_b": "passed",  # would be skipped if it ran on another worker than test_a
    "test_c": "passed",
    "test_x": "failed",
    "test_y": "skipped",
    "test_z": "skipped",
}


def test_dependency_chains_run_in_order_on_one_worker(gpu_pytester: pytest.Pytester, run_inner: Run) -> None:
    gpu_pytester.makeconftest(REPORTER)
    gpu_pytester.makepyfile(test_dep=DEPENDENCY)
    result = run_inner("--gpus", "sim:1x16GiB", "-n", "4", "-rs", subprocess=True)
    result.assert_outcomes(passed=15, failed=1, skipped=2)
    result.stdout.fnmatch_lines(["SKIPPED * test_y depends on test_x", "SKIPPED * test_z depends on test_y"])
    recs = reports(gpu_pytester.path)
    assert {n.split("::")[1]: recs[n]["outcome"] for n in recs if "fill" not in n} == DEP_OUTCOMES
    assert len({r["worker"] for r in recs.values()}) >= 2  # the fillers were spread
    order = starts_by_worker(recs)
    for chain in (["test_a", "test_b", "test_c"], ["test_x", "test_y", "test_z"]):
        ids = [f"test_dep.py::{name}" for name in chain]
        workers = {recs[i]["worker"] for i in ids}
        assert len(workers) == 1, {i: recs[i]["worker"] for i in ids}
        assert [i for i in order[workers.pop()] if i in ids] == ids

    # the same suite serially: the same outcomes
    (gpu_pytester.path / "reports.jsonl").unlink()
    serial = run_inner("--gpus", "sim:1x16GiB", "-rs", subprocess=True)
    serial.assert_outcomes(passed=15, failed=1, skipped=2)
    recs = reports(gpu_pytester.path)
    assert {n.split("::")[1]: recs[n]["outcome"] for n in recs if "fill" not in n} == DEP_OUTCOMES


# -- rank pools -----------------------------------------------------------------------------------

POOLS = """
import time
from pathlib import Path

import pytest

DONE = Path(__file__).parent / "done"

@pytest.mark.distributed(2)
@pytest.mark.parametrize("i", range(3))
def test_dist(rank, i):
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2
    if rank.rank == 0:
        (DONE / str(i)).write_text("")

@pytest.mark.parametrize("i", range(4))
def test_cpu(i):
    # busy until every distributed test is done: another worker always has CPU work at hand
    # and never needs to start a second pool (bounded, so a scheduler bug cannot hang the run)
    deadline = time.monotonic() + 90
    while len(list(DONE.iterdir())) < 3:
        if time.monotonic() > deadline:
            (DONE.parent / f"gave-up-{i}").write_text("")
            break
        time.sleep(0.05)
"""


def test_distributed_tests_stay_on_the_worker_with_the_warm_pool(gpu_pytester: pytest.Pytester, run_inner: Run) -> None:
    require("torch", module="torch")
    gpu_pytester.makeconftest(REPORTER)
    gpu_pytester.makepyfile(test_pools=POOLS)
    (gpu_pytester.path / "done").mkdir()
    result = run_inner("--gpus", "none", "-n", "2", subprocess=True, timeout=240)
    result.assert_outcomes(passed=7)
    recs = reports(gpu_pytester.path)
    dist = {n: r for n, r in recs.items() if "test_dist" in n}
    assert len({r["worker"] for r in dist.values()}) == 1, {n: r["worker"] for n, r in dist.items()}
    pools = sorted(r["props"]["dist_pool"] for r in dist.values())
    assert pools == ["fresh", "warm", "warm"], {n: r["props"]["dist_pool"] for n, r in dist.items()}
    assert not list(gpu_pytester.path.glob("gave-up-*"))  # no distributed test sat queued behind a CPU test


# -- durations from history -----------------------------------------------------------------------

HISTORY = """
import time

import pytest

@pytest.mark.parametrize("i", range(10))
def test_short(i):
    time.sleep(0.05)

def test_long():
    time.sleep(1.5)
"""


def test_recorded_durations_put_the_longest_test_first(gpu_pytester: pytest.Pytester) -> None:
    gpu_pytester.makepyfile(test_hist=HISTORY)
    trace = gpu_pytester.path / "trace.json"
    args = (*cached_args(gpu_pytester), "--gpus", "sim:1x16GiB", "-n", "2", "--gpu-trace", str(trace))
    long_id = "test_hist.py::test_long"

    first = gpu_pytester.runpytest_subprocess(*args, timeout=patience(120))
    first.assert_outcomes(passed=11)
    durations = json.loads((gpu_pytester.path / ".pytest_cache/v/pytest_gpu/durations").read_text())
    assert set(durations) == {f"test_hist.py::test_short[{i}]" for i in range(10)} | {long_id}
    assert durations[long_id] >= 1.5
    # nothing known yet: collection order, so the long test (collected last) starts last
    names = [e["args"]["nodeid"] for e in spans_of_tests(load_trace(trace)[0])]
    assert names[-1] == long_id, names

    second = gpu_pytester.runpytest_subprocess(*args, timeout=patience(120))
    second.assert_outcomes(passed=11)
    spans = spans_of_tests(load_trace(trace)[0])
    names = [e["args"]["nodeid"] for e in spans]
    assert names.index(long_id) < 2, names  # among the first test of each worker
    worker = next(e["args"]["worker"] for e in spans if e["args"]["nodeid"] == long_id)
    assert next(e["args"]["nodeid"] for e in spans if e["args"]["worker"] == worker) == long_id


# -- handing out ahead -----------------------------------------------------------------------------

AHEAD = """
import os

import pytest


def queued(config):
    # tests this xdist worker holds besides the running one and its next (xdist's own queue)
    plugin = next(p for p in config.pluginmanager.get_plugins() if type(p).__name__ == "WorkerInteractor")
    with plugin.torun.lock() as items:
        return sum(isinstance(i, int) for i in items)


@pytest.mark.parametrize("i", range(12))
@pytest.mark.gpu(memory="1GiB")
def test_gpu(request, i):
    with open(os.path.join(os.path.dirname(__file__), "queued.txt"), "a") as fh:
        fh.write(f"{queued(request.config)}\\n")


@pytest.mark.parametrize("i", range(12))
def test_cpu(request, i):
    with open(os.path.join(os.path.dirname(__file__), "queued.txt"), "a") as fh:
        fh.write(f"{queued(request.config)}\\n")
"""


def test_a_worker_running_short_tests_holds_the_test_after_its_next(gpu_pytester: pytest.Pytester) -> None:
    """With short tests recorded, a worker holds one more test than xdist needs to start its
    running test's successor, so it starts that one without waiting for the controller."""
    gpu_pytester.makepyfile(test_ahead=AHEAD)
    args = (*cached_args(gpu_pytester), "--gpus", "sim:2x16GiB", "-n", "2")
    queued = gpu_pytester.path / "queued.txt"
    first = gpu_pytester.runpytest_subprocess(*args, timeout=patience(120))
    first.assert_outcomes(passed=24)
    # nothing recorded yet: every test is expected to take as long as the unknown ones, a second
    assert set(queued.read_text().split()) == {"0"}
    queued.unlink()
    second = gpu_pytester.runpytest_subprocess(*args, timeout=patience(120))
    second.assert_outcomes(passed=24)
    seen = [int(x) for x in queued.read_text().split()]
    assert max(seen) == 1 and seen.count(1) >= 4, seen  # never more than one ahead


# -- GPU-aware choice -----------------------------------------------------------------------------

TWO_BIG = """
import time

import pytest
from pytest_gpu import sim

BIG = pytest.mark.gpu(memory="12GiB")

@BIG
def test_big1():
    sim.hold("12GiB", 1.5)

def test_cpu1():
    time.sleep(0.3)

@BIG
def test_big2():
    sim.hold("12GiB", 1.5)

@pytest.mark.parametrize("i", range(5))
def test_cpu(i):
    time.sleep(0.3)
"""


def test_cpu_work_fills_the_gap_instead_of_waiting_for_the_gpu(gpu_pytester: pytest.Pytester) -> None:
    """Two 12GiB tests on one 16GiB GPU: the scheduler never has both waiting on it at once."""
    gpu_pytester.makepyfile(test_big=TWO_BIG)
    trace = gpu_pytester.path / "trace.json"
    args = (*cached_args(gpu_pytester), "--gpus", "sim:1x16GiB", "-n", "2", "--gpu-trace", str(trace))

    # the control, which also records the durations: xdist's load scheduling sends the
    # first two tests to one worker and the next two to the other, so both big tests start together
    plain = gpu_pytester.runpytest_subprocess(*args, "--gpu-schedule=off", "-v", timeout=patience(120))
    plain.assert_outcomes(passed=8)
    plain.stdout.fnmatch_lines(["*scheduling tests via LoadScheduling"])
    assert "the GPU scheduler is off" not in plain.stdout.str()  # only an explicit --dist is said
    assert sum(e["args"]["wait_s"] for e in spans_of_tests(load_trace(trace)[0])) > 0.5

    scheduled = gpu_pytester.runpytest_subprocess(*args, timeout=patience(120))
    scheduled.assert_outcomes(passed=8)
    events, _ = load_trace(trace)
    waits = {e["args"]["nodeid"]: e["args"]["wait_s"] for e in spans_of_tests(events)}
    assert sum(waits.values()) < 0.3, waits
    # a broker round trip over 1ms shows as a wait span too: none may be a real wait
    assert all(e["dur"] < 100_000 for e in events if e.get("cat") == "wait")
    scheduled.stdout.re_match_lines([r"pytest-gpu: makespan .* · waited (\d+ms|<1ms|0s) for GPUs · GPU busy 0:.*"])


ONE_ROUND = """
import pytest
from pytest_gpu import sim

@pytest.mark.gpu(memory="12GiB")
def test_big():
    sim.hold("11GiB", 2.0)

@pytest.mark.gpu(exclusive=True)
def test_whole():
    sim.hold("8GiB", 1.5)

@pytest.mark.gpu(memory="1GiB")
def test_small():
    sim.hold("900MiB", 1.0)
"""


def test_the_tests_of_one_round_are_placed_where_the_planner_planned_them(gpu_pytester: pytest.Pytester) -> None:
    """Three first tests on two GPUs: the 12 GiB one is planned on GPU 0, the whole GPU on GPU 1,
    the 1 GiB one beside the 12. By the broker's own rule a first lease goes to the GPU with the
    fewest contexts, so the 1 GiB test would take GPU 1 if it asked before the whole-GPU test,
    which then waited for it: the plan travels to the broker, and nothing waits."""
    gpu_pytester.makepyfile(test_round=ONE_ROUND)
    trace = gpu_pytester.path / "trace.json"
    args = (*cached_args(gpu_pytester), "--gpus", "sim:2x16GiB", "-n", "3", "--gpu-trace", str(trace))
    gpu_pytester.runpytest_subprocess(*args, timeout=patience(120)).assert_outcomes(passed=3)  # records the durations
    for _ in range(2):  # which test asks first is a race: twice
        gpu_pytester.runpytest_subprocess(*args, timeout=patience(120)).assert_outcomes(passed=3)
        spans = {e["args"]["nodeid"].split("::")[-1]: e["args"] for e in spans_of_tests(load_trace(trace)[0])}
        assert {name: span["gpus"] for name, span in spans.items()} == {
            "test_big": [0],
            "test_whole": [1],
            "test_small": [0],
        }
        assert sum(span["wait_s"] for span in spans.values()) < 0.3, spans


def test_plans_name_the_runs_own_gpu_indices(
    gpu_pytester: pytest.Pytester, fake_run: Callable[..., pytest.RunResult]
) -> None:
    """``--gpus 0,2,3``: the planner numbers the run's GPUs 0-2, the broker by their indices;
    a plan for the planner's GPU 1 is the run's GPU 2 (not a GPU the run does not have)."""
    gpu_pytester.makepyfile(
        test_whole="""
        import pytest
        from pytest_gpu import sim

        @pytest.mark.parametrize("i", range(3))
        @pytest.mark.gpu(exclusive=True)
        def test_whole(i):
            sim.hold("1GiB", 0.5)
        """
    )
    trace = gpu_pytester.path / "trace.json"
    result = fake_run("sim:4x16GiB", "--gpus", "0,2,3", "-n", "3", f"--gpu-trace={trace}")
    result.assert_outcomes(passed=3)
    gpus = sorted(g for e in spans_of_tests(load_trace(trace)[0]) for g in e["args"]["gpus"])
    assert gpus == [0, 2, 3], gpus


# -- a worker killed mid-run ----------------------------------------------------------------------

KILLED = """
import os
import signal
import time
from pathlib import Path

import pytest
from pytest_gpu import sim

HERE = Path(__file__).parent

def note():
    (HERE / "pids" / str(os.getpid())).write_text("")

def die_once():
    note()
    guard = HERE / "killed-once"
    if not guard.exists():  # a rerun (there should be none) must not kill again
        guard.write_text("")
        os.kill(os.getpid(), signal.SIGKILL)

{tests}
"""

KILLED_HOLDING_GPU = """
@pytest.mark.gpu(memory="2GiB")
def test_die():
    with sim.allocate("1GiB"):
        die_once()

@pytest.mark.parametrize("i", range(4))
@pytest.mark.gpu(memory="4GiB")
def test_gpu(i):
    note()
    sim.hold("4GiB", 0.2)

@pytest.mark.parametrize("i", range(4))
@pytest.mark.xdist_group("g")
def test_grouped(i):
    note()
    time.sleep(0.1)

@pytest.mark.parametrize("i", range(4))
def test_cpu(i):
    note()
    time.sleep(0.1)
"""

KILLED_IN_GROUP = """
@pytest.mark.xdist_group("g")
def test_g1():
    note()

@pytest.mark.xdist_group("g")
def test_g2():
    die_once()

@pytest.mark.xdist_group("g")
def test_g3():
    note()

@pytest.mark.xdist_group("g")
def test_g4():
    note()

@pytest.mark.parametrize("i", range(4))
def test_cpu(i):
    note()
    time.sleep(0.1)
"""


def run_marked(gpu_pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, run_inner: Run, tests: str) -> Any:
    """Run ``tests`` under ``-n 3``; returns the result and a check that no process of the run is left."""
    mark = uuid.uuid4().hex
    monkeypatch.setenv("SCHED_TEST_RUN_MARK", mark)  # every process of the inner run inherits it
    gpu_pytester.makeconftest(REPORTER)
    gpu_pytester.makepyfile(test_k=KILLED.format(tests=tests))
    (gpu_pytester.path / "pids").mkdir()
    result = run_inner("--gpus", "sim:2x16GiB", "-n", "3", subprocess=True, timeout=120)
    deadline = time.monotonic() + patience(15)
    while (left := _marked_processes(mark)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for proc in left:  # only when the check below fails: do not leave them behind
        try:
            proc.kill()
        except psutil.Error:
            pass
    assert not left, [p.info for p in left]
    return result


def _marked_processes(mark: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        if proc.pid == os.getpid() or proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            if proc.environ().get("SCHED_TEST_RUN_MARK") == mark:
                found.append(proc)
        except psutil.Error:
            pass
    return found


def test_worker_killed_holding_a_gpu_never_hangs_the_run(
    gpu_pytester: pytest.Pytester, run_inner: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = run_marked(gpu_pytester, monkeypatch, run_inner, KILLED_HOLDING_GPU)
    result.assert_outcomes(passed=12, failed=1)
    result.stdout.re_match_lines(
        [
            r".*worker '(gw\d+)' crashed while running 'test_k\.py::test_die'",
            r"pytest-gpu: worker gw\d+ \(pid \d+\) died while running test_k\.py::test_die; "
            r"its GPU \d was reclaimed$",
        ]
    )
    recs = reports(gpu_pytester.path)
    assert {n for n, r in recs.items() if r["outcome"] != "passed"} == {"test_k.py::test_die"}
    assert len({recs[f"test_k.py::test_grouped[{i}]"]["worker"] for i in range(4)}) == 1


def test_worker_killed_inside_a_group_the_rest_of_the_group_still_runs(
    gpu_pytester: pytest.Pytester, run_inner: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = run_marked(gpu_pytester, monkeypatch, run_inner, KILLED_IN_GROUP)
    result.assert_outcomes(passed=7, failed=1)
    result.stdout.re_match_lines([r".*worker '(gw\d+)' crashed while running 'test_k\.py::test_g2'"])
    assert "died while running" not in result.stdout.str()  # it held no GPU and no port: nothing to reclaim
    recs = reports(gpu_pytester.path)
    assert {n for n, r in recs.items() if r["outcome"] != "passed"} == {"test_k.py::test_g2"}
    g3, g4 = recs["test_k.py::test_g3"], recs["test_k.py::test_g4"]
    assert g3["worker"] == g4["worker"] and g3["start"] < g4["start"]  # still together, in order
    assert recs["test_k.py::test_g2"]["start"] <= g3["start"]


# -- the trace ------------------------------------------------------------------------------------

TRACED = """
import time
from pathlib import Path

import pytest
from pytest_gpu import sim

HOLDING = Path(__file__).parent / "holding"

def test_mid(gpu_request):
    # CPU work first, then both GPUs whole: it waits, mid-test, for test_holder's lease
    deadline = time.monotonic() + 30
    while not HOLDING.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    with gpu_request(count=2, exclusive=True):
        sim.hold("1GiB", 0.1)

@pytest.mark.gpu(memory="4GiB")
def test_holder():
    with sim.allocate("4GiB"):
        HOLDING.write_text("")
        time.sleep(1.0)

@pytest.mark.gpu(exclusive=True)
def test_exclusive():
    sim.hold("2GiB", 0.3)

@pytest.mark.parametrize("i", range(5))
@pytest.mark.gpu(memory="4GiB")
def test_shared(i):
    sim.hold("4GiB", 0.2)

def test_cpu():
    time.sleep(0.1)
"""


def test_gpu_trace_file(gpu_pytester: pytest.Pytester, run_inner: Run, tmp_path: Path) -> None:
    require("matplotlib", module="matplotlib")
    gpu_pytester.makepyfile(test_traced=TRACED)
    trace = gpu_pytester.path / "out" / "trace.json"
    trace.parent.mkdir()  # the run writes into it, and makes none (a missing one is a usage error)
    result = run_inner("--gpus", "sim:2x16GiB", "-n", "3", "--gpu-trace", str(trace), subprocess=True)
    result.assert_outcomes(passed=9)
    result.stdout.fnmatch_lines([f"pytest-gpu: trace written to {trace} (open in ui.perfetto.dev)"])
    events, other = load_trace(trace)
    assert [g["index"] for g in other["gpus"]] == [0, 1]

    tests = spans_of_tests(events)
    assert len(tests) == 9
    assert len({e["args"]["nodeid"] for e in tests}) == 9
    leases = [e for e in events if e.get("ph") == "X" and e.get("cat") == "lease"]
    assert {e["pid"] for e in leases} == {100, 101}
    assert all(e["pid"] == 100 + e["args"]["gpu"] for e in leases)
    # test_mid's lease holds both GPUs: one span on each
    assert sorted(e["pid"] for e in leases if e["args"]["nodeid"].endswith("test_mid")) == [100, 101]
    assert sum(1 for e in leases if e["args"]["exclusive"]) == 3

    assert exclusive_overlaps(leases) == []

    waits = [e for e in events if e.get("ph") == "X" and e.get("cat") == "wait"]
    assert any(e["args"]["nodeid"].endswith("test_mid") for e in waits)  # its wait, forced above
    by_id = {e["args"]["nodeid"]: e for e in tests}
    for wait in waits:
        test = by_id[wait["args"]["nodeid"]]
        assert (wait["pid"], wait["tid"]) == (test["pid"], test["tid"])
        assert test["ts"] <= wait["ts"] and wait["ts"] + wait["dur"] <= test["ts"] + test["dur"], (wait, test)
    mid = by_id["test_traced.py::test_mid"]
    assert mid["args"]["wait_s"] > 0.3

    from pytest_gpu import cli

    picture = tmp_path / "out.png"
    assert cli.main(["report", str(trace), "-o", str(picture)]) == 0
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def exclusive_overlaps(leases: list[dict[str, Any]], tolerance_us: int = 0) -> list[tuple[str, str, int]]:
    """Pairs of lease spans on one GPU, one of them exclusive, that overlap by more than ``tolerance_us``."""
    found = []
    for pid in sorted({e["pid"] for e in leases}):
        on_gpu = sorted((e for e in leases if e["pid"] == pid), key=lambda e: e["ts"])
        for n, a in enumerate(on_gpu):
            for b in on_gpu[n + 1 :]:
                if a["args"]["exclusive"] or b["args"]["exclusive"]:
                    overlap = min(a["ts"] + a["dur"], b["ts"] + b["dur"]) - max(a["ts"], b["ts"])
                    if overlap > tolerance_us:
                        found.append((a["args"]["nodeid"], b["args"]["nodeid"], overlap))
    return found


HANDOVER = """
import time

import pytest
from pytest_gpu import sim

@pytest.mark.gpu(exclusive=True)
def test_first():
    sim.hold("1GiB", 0.8)

@pytest.mark.gpu(exclusive=True)
def test_second():
    sim.hold("1GiB", 0.8)
"""

# The worker giving its lease back is descheduled right after the broker took it (as on a
# loaded machine): it wakes up only once the other worker already holds the GPU.
SLOW_RELEASE = """
import time

from pytest_gpu.leasing import client

_release = client.BrokerClient.release


def _slow_release(self, *args, **kwargs):
    result = _release(self, *args, **kwargs)
    time.sleep(0.3)
    return result


client.BrokerClient.release = _slow_release
"""


def test_trace_lease_ends_when_it_is_given_back(gpu_pytester: pytest.Pytester, run_inner: Run) -> None:
    """A lease's end on the timeline is stamped before its release is sent.

    The broker hands the GPU to a waiting test as soon as it processes the release; were
    the end stamped after the release round trip, the trace would show an exclusive lease
    overlapping the lease it waited for (on a loaded machine by milliseconds to seconds;
    here 0.3s, injected by a conftest that slows ``BrokerClient.release`` down).
    """
    gpu_pytester.makeconftest(SLOW_RELEASE)
    gpu_pytester.makepyfile(test_handover=HANDOVER)
    trace = gpu_pytester.path / "trace.json"
    # xdist's load scheduling: one test per worker, both at once (pytest-gpu's would run them
    # one after the other on one worker, and nothing would wait)
    args = ("--gpus", "sim:1x16GiB", "-n", "2", "--gpu-schedule=off", "--gpu-trace", str(trace))
    result = run_inner(*args, subprocess=True)
    result.assert_outcomes(passed=2)
    events, _ = load_trace(trace)
    assert sum(e["args"]["wait_s"] for e in spans_of_tests(events)) > 0.3  # one really waited for the other
    leases = [e for e in events if e.get("ph") == "X" and e.get("cat") == "lease"]
    assert len(leases) == 2
    assert exclusive_overlaps(leases) == []


# -- the terminal summary -------------------------------------------------------------------------

OVERASKED = """
import pytest
from pytest_gpu import sim

@pytest.mark.gpu(memory="8GiB")
def test_overasked():
    sim.hold("256MiB", 0.05)

@pytest.mark.gpu(memory="1GiB")
def test_fitting():
    sim.hold("900MiB", 0.05)
"""


def test_summary_names_the_heavy_users_and_a_request_far_above_its_peak(
    gpu_pytester: pytest.Pytester, run_inner: Run
) -> None:
    gpu_pytester.makepyfile(test_sizes=OVERASKED)
    result = run_inner("--gpus", "sim:1x16GiB")
    result.assert_outcomes(passed=2)
    result.stdout.re_match_lines(
        [
            r"pytest-gpu: makespan \d+\.\ds · test time \d+\.\ds .*· waited (\d+\.\ds|\d+ms|<1ms|0s) for GPUs · "
            r"GPU busy 0:\d+%$",
            r"pytest-gpu: largest GPU-second users:$",
            r" +\d+\.\d GPU-s  test_sizes\.py::test_(overasked|fitting)$",
            r"pytest-gpu: requests that do not match the measured peak:$",
            r"  test_sizes\.py::test_overasked: asked 8GiB, peaked at 256MiB \(far below\): suggest memory=\"512MiB\"$",
        ]
    )
    assert "test_fitting: asked" not in result.stdout.str()  # 900MiB of 1GiB: a good request

    quiet = run_inner("--gpus", "sim:1x16GiB", "--gpu-verify=off")
    quiet.assert_outcomes(passed=2)
    quiet.stdout.fnmatch_lines(["pytest-gpu: makespan *", "pytest-gpu: largest GPU-second users:"])
    assert "suggest memory=" not in quiet.stdout.str()
    assert "requests that do not match" not in quiet.stdout.str()
