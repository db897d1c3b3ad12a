"""Honest reporting: Ctrl-C is an interruption, not a crash; names of tests, not of pools; one
wait figure; counts that read right ("1 port was", "GPUs 1 and 2 were").
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from conftest import INNER_ARGS
from helpers import patience
from pytest_gpu.base.distspec import DistSpec
from pytest_gpu.base.requests import DefaultMemory
from pytest_gpu.base.wording import join, numbered, plural, verb
from pytest_gpu.distributed.pool import DistSettings, RankPool
from pytest_gpu.leasing.protocol import CrashRecord
from pytest_gpu.report.summary import Summary
from pytest_gpu.report.timeline import Timeline
from pytest_gpu.run.session import GpuRun

T0 = 1_700_000_000.0

# -- wording -------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "expected"), [(0, "0 ports"), (1, "1 port"), (2, "2 ports"), (11, "11 ports")], ids=str)
def test_plural(n: int, expected: str) -> None:
    assert plural(n, "port") == expected


def test_plural_with_an_irregular_plural() -> None:
    assert plural(1, "process", "processes") == "1 process"
    assert plural(3, "process", "processes") == "3 processes"


@pytest.mark.parametrize(
    ("items", "expected"), [([], ""), ([1], "1"), ([1, 2], "1 and 2"), ([0, 2, 3], "0, 2 and 3")], ids=str
)
def test_join(items: list[int], expected: str) -> None:
    assert join(items) == expected


@pytest.mark.parametrize(
    ("numbers", "expected"), [([1], "GPU 1"), ([1, 2], "GPUs 1 and 2"), ((0, 1, 3), "GPUs 0, 1 and 3")], ids=str
)
def test_numbered(numbers: list[int], expected: str) -> None:
    assert numbered("GPU", numbers) == expected


def test_verb() -> None:
    assert (verb(1, "was", "were"), verb(2, "was", "were"), verb(0, "was", "were")) == ("was", "were", "were")


# -- the crash line ------------------------------------------------------------------------


def crash(gpus: tuple[int, ...] = (), ports: tuple[int, ...] = (), worker: str = "gw1", test: str | None = "t.py::x"):
    return CrashRecord(worker, 4242, test, gpus, ports, T0)


@pytest.mark.parametrize(
    ("gpus", "ports", "held"),
    [
        ((1,), (), "its GPU 1 was reclaimed"),
        ((1, 2), (), "its GPUs 1 and 2 were reclaimed"),
        ((), (20001,), "its 1 port was reclaimed"),
        ((), (20001, 20002), "its 2 ports were reclaimed"),
        ((1,), (20001,), "its GPU 1 and its 1 port were reclaimed"),
        ((0, 1), (20001, 20002), "its GPUs 0 and 1 and its 2 ports were reclaimed"),
    ],
    ids=["1gpu", "2gpus", "1port", "2ports", "1gpu-1port", "2gpus-2ports"],
)
def test_crash_line_counts_read_right(gpus: tuple[int, ...], ports: tuple[int, ...], held: str) -> None:
    line = Summary().crash_line(crash(gpus, ports))
    assert line == f"pytest-gpu: worker gw1 (pid 4242) died while running t.py::x; {held}"


def test_crash_line_of_an_unknown_test() -> None:
    assert "died while running an unknown test; its GPU 0 was" in Summary().crash_line(crash((0,), test=None))


def test_interrupted_run_gives_back_instead_of_dying() -> None:
    summary = Summary(interrupted=True)
    line = summary.crash_line(crash((1, 2), (20001, 20002)))
    assert line == "pytest-gpu: interrupted while gw1 ran t.py::x; its GPUs 1 and 2 and its 2 ports were given back"
    assert "died" not in line


def test_a_worker_seen_dying_before_the_interrupt_still_died() -> None:
    # xdist reported gw0 down with an error while the run went on: a crash, Ctrl-C or not
    summary = Summary(interrupted=True, down={"gw0": "Not properly terminated"})
    assert "died while running" in summary.crash_line(crash((0,), worker="gw0"))
    assert "interrupted while gw1 ran" in summary.crash_line(crash((1,), worker="gw1"))


def test_a_worker_that_got_ctrl_c_itself_was_interrupted() -> None:
    # xdist: a worker that finished with exit status 2 goes down with "keyboard-interrupt"
    summary = Summary(down={"gw0": "keyboard-interrupt"})
    assert summary.crash_line(crash((0,), worker="gw0")).startswith("pytest-gpu: interrupted while gw0 ran t.py::x")


def test_without_an_interrupt_a_worker_that_went_away_died() -> None:
    assert "died while running" in Summary().crash_line(crash((0,)))


def test_the_test_xdist_says_the_worker_ran_names_the_crash() -> None:
    # the broker names the holder (a rank pool started by an earlier test); xdist knows the test
    summary = Summary()
    summary.cut_short["gw1"] = ["t.py::later"]
    line = summary.crash_line(crash((0,), test="the rank pool of 2 ranks (gloo via spawn) started by t.py::first"))
    assert "died while running t.py::later; its GPU 0 was reclaimed" in line


def phase(nodeid: str, when: str, worker: str) -> pytest.TestReport:
    report = pytest.TestReport(nodeid, ("t.py", 1, nodeid), {}, "passed", None, when)  # type: ignore[arg-type]
    report.node = SimpleNamespace(gateway=SimpleNamespace(id=worker))  # type: ignore[attr-defined]  # xdist's
    return report


def test_an_interrupt_names_every_test_still_running_on_every_worker() -> None:
    """gw0's test held a GPU (its crash line names it); gw1's distributed test gave back its
    pool's port itself and a third test was still in its setup: each is named too."""
    summary = Summary()
    for nodeid, worker in (("t.py::gpu", "gw0"), ("t.py::done", "gw1"), ("t.py::dist", "gw1")):
        summary.pytest_runtest_logstart(nodeid, None)
        summary.pytest_runtest_logreport(phase(nodeid, "setup", worker))
        if nodeid == "t.py::done":
            for when in ("call", "teardown"):
                summary.pytest_runtest_logreport(phase(nodeid, when, worker))
            summary.pytest_runtest_logfinish(nodeid, None)
    summary.pytest_runtest_logstart("t.py::waiting", None)  # waiting for its GPUs: no report yet
    crashes = [crash((0,), worker="gw0", test="the rank pool of 2 ranks (gloo via spawn) started by t.py::first")]
    assert summary.running_lines(crashes) == []  # not interrupted (yet): nothing to say
    summary.pytest_keyboard_interrupt(None)  # type: ignore[arg-type]
    assert summary.crash_line(crashes[0]) == "pytest-gpu: interrupted while gw0 ran t.py::gpu; its GPU 0 was given back"
    assert summary.running_lines(crashes) == [
        "pytest-gpu: interrupted while t.py::waiting was setting up",
        "pytest-gpu: interrupted while gw1 ran t.py::dist",
    ]


def test_an_interrupted_run_without_workers_names_its_test() -> None:
    summary = Summary()
    summary.pytest_runtest_logstart("t.py::x", None)
    summary.pytest_runtest_logreport(pytest.TestReport("t.py::x", ("t.py", 1, "x"), {}, "passed", None, "setup"))
    summary.pytest_keyboard_interrupt(None)  # type: ignore[arg-type]
    assert summary.running_lines([]) == ["pytest-gpu: interrupted while running t.py::x"]


def test_summary_hears_interrupts_and_workers_going_down() -> None:
    summary = Summary()
    summary.pytest_testnodedown(SimpleNamespace(gateway=SimpleNamespace(id="gw0")), None)  # finished normally
    summary.pytest_testnodedown(SimpleNamespace(gateway=SimpleNamespace(id="gw1")), "Not properly terminated")
    assert summary.down == {"gw1": "Not properly terminated"}
    assert not summary.interrupted
    summary.pytest_keyboard_interrupt(None)  # type: ignore[arg-type]
    assert summary.interrupted


# -- one wait figure -----------------------------------------------------------------------


def test_both_summary_lines_print_the_tests_reported_waits() -> None:
    # the lease spans say 0.7s between asking and the grant (round trips, confinement), the
    # test's own gpu_wait_seconds 0.5s: both lines print the test's figure, summed over tests
    summary = Summary()
    for nodeid, reported in (("t.py::a", 0.5), ("t.py::b", 0.25)):
        row = [[0], 2**30, False, T0, T0 + 0.7, T0 + 2.0]
        summary.timeline.phase(
            nodeid,
            "gw0",
            "teardown",
            "passed",
            T0,
            T0 + 2.0,
            2.0,
            {"gpu_leases": json.dumps([row]), "gpu_wait_seconds": reported},
        )
    assert summary.waited == pytest.approx(0.75)
    inventory = SimpleNamespace(describe=lambda: "1 simulated GPU", source="sim:1x16GiB", note="", devices=[])
    first = summary.lines(inventory, [])[0]  # type: ignore[arg-type]
    timeline = summary.timeline.summary_lines([0], with_peaks=False)[0]
    assert "waited 750ms in total" in first  # as a trace viewer shows it
    assert "waited 750ms for GPUs" in timeline


def test_a_record_without_its_reported_wait_falls_back_on_its_spans() -> None:
    tl = Timeline()
    row = [[0], 2**30, False, T0, T0 + 0.5, T0 + 1.0]
    tl.phase("t.py::a", "gw0", "teardown", "passed", T0, T0 + 2.0, 2.0, {"gpu_leases": json.dumps([row])})
    assert tl.waited() == pytest.approx(0.5)


# -- rank pools are named after their test -------------------------------------------------


class Stop(Exception):
    pass


class RecordingClient:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def ports(self, n: int, owner: str) -> list[int]:
        self.calls.append(("ports", owner))
        return [20001]

    def acquire(self, request: Any, test: str, timeout: float | None, on_wait: Any = None, avoid: Any = ()) -> Any:
        self.calls.append(("acquire", test))
        raise Stop  # enough: the pool has said who holds what

    def release_ports(self, owner: str) -> None:
        self.calls.append(("release_ports", owner))

    def release(self, key: str, contexts: Any = None) -> None:
        self.calls.append(("release", key))


def test_a_rank_pool_holds_its_port_and_gpus_in_its_tests_name(tmp_path: Path) -> None:
    client = RecordingClient()
    settings = SimpleNamespace(default_memory=DefaultMemory.parse("exclusive"), wait_timeout=None)
    run = SimpleNamespace(client=client, settings=settings, quarantine=None, waiting=lambda: False, avoid=frozenset())
    run.hold = partial(GpuRun.hold, run)  # the run's one way to hold a lease, on the recording client
    spec = DistSpec(world_size=2, backend="none", gpus_per_rank=1, launcher="spawn")
    pool = RankPool(spec, run, DistSettings(), tmp_path, 60.0, "t.py::test_first")  # type: ignore[arg-type]
    with pytest.raises(Stop):
        pool.start([])
    holder = "the rank pool of 2 ranks (none via spawn, 1 GPU/rank) started by t.py::test_first"
    (_, owner), (_, test), (_, released) = client.calls
    # the broker names a dead worker's port holders by what precedes the last "@" of the owner
    assert owner.rsplit("@", 1)[0] == holder
    assert test == holder
    assert released == owner  # given back under the name it was taken with
    assert "pool0" not in holder and pool.id not in holder


# -- end to end ----------------------------------------------------------------------------

DYING_AND_SLEEPING = """
import os
import signal
import time

import pytest

MARKS = {marks!r}


@pytest.mark.gpu(memory="1GiB")
def test_dies(gpu, port):
    open(os.path.join(MARKS, "died"), "w").close()
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("i", range(2))
@pytest.mark.gpu(memory="1GiB")
def test_sleep(i, gpu, port):
    open(os.path.join(MARKS, f"running-{{i}}"), "w").close()
    time.sleep(120)
"""


@pytest.mark.parametrize("target", ["controller", "group"])
def test_ctrl_c_is_reported_as_an_interruption_and_a_crash_before_it_as_a_crash(
    gpu_pytester: pytest.Pytester, target: str
) -> None:
    """SIGINT to the controller (xdist tears its workers down) or to the whole process group
    (a terminal's Ctrl-C: the workers get it too) while two tests hold a GPU and a port each;
    a worker SIGKILLed earlier in the same run is still reported as dead."""
    marks = gpu_pytester.path / "marks"
    marks.mkdir()
    gpu_pytester.makepyfile(test_ctrl_c=DYING_AND_SLEEPING.format(marks=str(marks)))
    cmd = [sys.executable, "-m", "pytest", *INNER_ARGS, "-n", "2", "--gpus", "sim:2x16GiB", "test_ctrl_c.py"]
    proc = subprocess.Popen(
        cmd, cwd=gpu_pytester.path, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        # three tests started on two workers: the one that died was replaced (xdist saw it die)
        deadline = time.monotonic() + patience(60)
        while {p.name for p in marks.iterdir()} != {"died", "running-0", "running-1"}:
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "the tests never all started"
            time.sleep(0.05)
        time.sleep(0.3)  # the sleepers are past their ports(): inside time.sleep
        if target == "group":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=patience(60))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    died = re.findall(
        r"^pytest-gpu: worker gw\d+ \(pid \d+\) died while running (\S+); its GPU \d and its 1 port were reclaimed$",
        out,
        re.M,
    )
    assert died == ["test_ctrl_c.py::test_dies"], out
    interrupted = re.findall(
        r"^pytest-gpu: interrupted while gw\d+ ran (\S+); its GPU \d and its 1 port were given back$", out, re.M
    )
    assert sorted(interrupted) == ["test_ctrl_c.py::test_sleep[0]", "test_ctrl_c.py::test_sleep[1]"], out
    assert out.count("died while running") == 1, out


GPU_AND_DISTRIBUTED = """
import os
import time

import pytest

MARKS = {marks!r}


@pytest.mark.gpu(memory="1GiB")
def test_gpu(gpu):
    open(os.path.join(MARKS, "gpu"), "w").close()
    time.sleep(120)


@pytest.mark.distributed(world_size=2, backend="gloo")
def test_distributed(rank):
    open(os.path.join(MARKS, f"rank-{{rank.rank}}"), "w").close()
    time.sleep(120)
"""


@pytest.mark.parametrize("target", ["controller", "group"])
def test_ctrl_c_names_the_distributed_test_another_worker_ran(gpu_pytester: pytest.Pytester, target: str) -> None:
    """One worker runs a GPU test, the other a distributed test, whose pool gives back what it
    holds as it is killed (no crash record names it): the summary names both tests."""
    marks = gpu_pytester.path / "marks"
    marks.mkdir()
    gpu_pytester.makepyfile(test_both=GPU_AND_DISTRIBUTED.format(marks=str(marks)))
    cmd = [sys.executable, "-m", "pytest", *INNER_ARGS, "-n", "2", "--gpus", "sim:2x16GiB", "test_both.py"]
    proc = subprocess.Popen(
        cmd, cwd=gpu_pytester.path, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + patience(120)  # two ranks start (each imports torch) on a loaded machine
        while {p.name for p in marks.iterdir()} != {"gpu", "rank-0", "rank-1"}:
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "the tests never all started"
            time.sleep(0.05)
        time.sleep(0.3)
        if target == "group":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=patience(120))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert re.search(
        r"^pytest-gpu: interrupted while gw\d ran test_both\.py::test_gpu; its GPU \d was given back$", out, re.M
    ), out
    assert re.search(r"^pytest-gpu: interrupted while gw\d ran test_both\.py::test_distributed$", out, re.M), out
    assert "died while running" not in out, out


POOL_KILLER = """
import os
import signal

if os.environ.get("PYTEST_GPU_RANK_ADDRESS") and os.environ.get("PYTEST_GPU_RANK") == "0":
    # rank 0 of a pool that is setting up (it loads this conftest then): kill the worker
    # that is starting the pool
    os.kill(os.getppid(), signal.SIGKILL)
"""


@pytest.mark.parametrize(
    ("gpus_per_rank", "held"), [(0, "its 1 port was"), (1, "its GPUs 0 and 1 and its 1 port were")]
)
def test_a_worker_dying_while_its_pool_starts_names_the_test(
    gpu_pytester: pytest.Pytester, run_inner: Any, gpus_per_rank: int, held: str
) -> None:
    gpu_pytester.makeconftest(POOL_KILLER)
    gpu_pytester.makepyfile(
        test_pool=f"""
        import pytest

        @pytest.mark.distributed(world_size=2, backend="none", gpus_per_rank={gpus_per_rank})
        def test_starts_a_pool(rank):
            pass
        """
    )
    result = run_inner("--gpus", "sim:2x16GiB", "-n", "1", subprocess=True)
    result.assert_outcomes(failed=1)
    result.stdout.re_match_lines(
        [
            r"pytest-gpu: worker gw0 \(pid \d+\) died while running test_pool\.py::test_starts_a_pool; "
            rf"{re.escape(held)} reclaimed$"
        ]
    )
    assert "pool0" not in result.stdout.str()


def test_a_test_needing_its_own_idle_pools_gpus_gets_them_at_once(
    gpu_pytester: pytest.Pytester, run_inner: Any
) -> None:
    gpu_pytester.makepyfile(
        test_held="""
        import pytest

        @pytest.mark.distributed(world_size=1, backend="none", gpus_per_rank=1)
        def test_a(rank):
            pass

        @pytest.mark.gpu
        def test_b(gpu):
            pass
        """
    )
    # the warm pool keeps its GPU after test_a: test_b, in the same process, would wait for it
    # for ever (the broker refuses that at once, a cycle of hold-and-wait); instead the process
    # closes its idle pool and asks again (issue 19: tests/distributed/test_pool_wait.py)
    result = run_inner("--gpus", "sim:1x16GiB", "--gpu-wait-timeout", "600", subprocess=True, timeout=60)
    result.assert_outcomes(passed=2)
    assert "deadlock" not in result.stdout.str()
