"""Distributed tests beside pytest-timeout: an interrupted test leaves no rank running its body.

pytest-timeout's signal method raises inside the pytest process, in the middle of the pool's
wait for the ranks' results. The pool must then be killed (the ranks would go on running the
hung body, and the next test's wait would read that body's result), and a result must only
ever be taken for the test run it belongs to.
"""

from __future__ import annotations

import signal
import textwrap
import threading
import time
import types
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest

from conftest import require
from helpers import patience, rank_processes
from pytest_gpu.base.distspec import DistSpec
from pytest_gpu.distributed import pool as pool_module
from pytest_gpu.distributed.pool import DistSettings, RankPool
from pytest_gpu.distributed.runner import PoolManager
from wired_ranks import body, connect

MARK_VAR = "COMPAT_TIMEOUT_RUN_MARK"
GLOO2 = DistSpec(world_size=2, backend="gloo", gpus_per_rank=0, launcher="spawn")

INNER = """
import os
import time
from pathlib import Path

import pytest

DATA = Path(os.environ["COMPAT_DATA"])
GLOO2 = pytest.mark.distributed(world_size=2, backend="gloo")


@GLOO2
@pytest.mark.timeout(60)
def test_0_starts_the_pool(rank):
    pass  # the pool's start (seconds: every rank imports torch) is not part of the next test's 3 s


@GLOO2
def test_a_hangs(rank):
    (DATA / f"a-{rank.rank}").write_text(str(os.getpid()))
    time.sleep(60)


@GLOO2
@pytest.mark.timeout(30)
def test_b_runs(rank):
    (DATA / f"b-{rank.rank}").write_text(str(os.getpid()))


@GLOO2
@pytest.mark.timeout(30)
def test_c_own_value(rank):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank.rank + 7)])
    dist.all_reduce(t)
    assert t.item() == 15.0
    (DATA / f"c-{rank.rank}").write_text(str(t.item()))
"""


def test_a_test_timed_out_by_pytest_timeout_leaves_no_rank_running_its_body(
    gpu_pytester: pytest.Pytester, run_inner: Callable[..., pytest.RunResult], monkeypatch: pytest.MonkeyPatch
) -> None:
    require("torch", module="torch")
    require("pytest-timeout", module="pytest_timeout")
    data = gpu_pytester.path / "data"
    data.mkdir()
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK_VAR, mark)
    monkeypatch.setenv("COMPAT_DATA", str(data))
    gpu_pytester.makeini("[pytest]\n")
    gpu_pytester.makepyfile(test_compat=textwrap.dedent(INNER))
    result = run_inner("--timeout=3", "-v", subprocess=True, timeout=150)
    output = result.stdout.str()
    leftovers = rank_processes(MARK_VAR, mark)
    assert not leftovers, f"rank processes outlived the run: {leftovers}"
    expected = ["test_0_starts_the_pool PASSED", "test_a_hangs FAILED", "test_b_runs PASSED", "test_c_own_value PASSED"]
    result.stdout.fnmatch_lines([f"*{line}*" for line in expected])
    # one line for where the pool was, then where the ranks hung: none of the plugin's frames between
    result.stdout.fnmatch_lines(
        [
            "*_ test_a_hangs _*",
            "pytest-gpu: timed out while its rank pool of 2 ranks (gloo via spawn) ran its body (ranks 0 and 1 "
            "still in it), for 3.0s; the pool was killed, the ranks' stacks follow (Timeout (>3.0s) from "
            "pytest-timeout.)",
            "*- Captured rank 0 stack call -*",
        ]
    )
    assert "in test_a_hangs" in output, output[-4000:]  # where the ranks hung
    failure = output.split("_ test_a_hangs _", 1)[1].split("Captured stdout call", 1)[0]
    assert "pool.py" not in failure and "selectors.py" not in failure, failure
    result.assert_outcomes(passed=3, failed=1)
    # the second and third bodies really ran, in a fresh pool, and the third computed its own value
    hung = {p.read_text() for p in data.glob("a-*")}
    ran = {p.read_text() for p in data.glob("b-*")}
    assert len(hung) == 2 and len(ran) == 2 and not hung & ran, (hung, ran)
    assert {p.name: p.read_text() for p in data.glob("c-*")} == {"c-0": "15.0", "c-1": "15.0"}


SLOW_START_CONFTEST = """
import os
import time

if os.environ.get("PYTEST_GPU_RANK_ADDRESS"):  # a rank setting up (it loads this conftest then)
    time.sleep(60)  # as a rank importing a large library
"""

SLOW_START = """
import pytest

@pytest.mark.distributed(world_size=2, backend="gloo")
def test_slow_start(rank):
    pass
"""


@pytest.mark.parametrize("workers", ["0", "1"])
def test_a_timeout_while_the_pool_starts_says_so_in_one_line_above_the_ranks_stacks(
    gpu_pytester: pytest.Pytester, run_inner: Callable[..., pytest.RunResult], workers: str
) -> None:
    """pytest-timeout's signal method, while the ranks still set up: the report says that the
    pool was starting (its size, backend, how long, at which stage) and shows where each rank
    was; the plugin's frames (pool.py, selectors.py) are not the report."""
    require("pytest-timeout", module="pytest_timeout")
    gpu_pytester.makeini("[pytest]\n")
    gpu_pytester.makeconftest(SLOW_START_CONFTEST)
    gpu_pytester.makepyfile(test_start=SLOW_START)
    result = run_inner("--timeout=4", "-n", workers, subprocess=True, timeout=150)
    result.assert_outcomes(failed=1)
    line = (
        "pytest-gpu: timed out while its rank pool of 2 ranks (gloo via spawn) was starting, for *s (its ranks "
        "setting up: pytest's configuration and conftests, the process group); the pool was killed, the ranks' "
        "stacks follow (Timeout (>4.0s) from pytest-timeout.)"
    )
    stack = "*- Captured rank 0 stack call -*" if workers == "0" else "*- rank 0 stack -*"
    result.stdout.fnmatch_lines(["*_ test_slow_start _*", *(["[[]gw0[]] *"] if workers != "0" else []), line, stack])
    out = result.stdout.str()
    failure = out.split("_ test_slow_start _", 1)[1].split("Captured stdout call", 1)[0]
    assert f'{gpu_pytester.path / "conftest.py"}", line' in failure, failure  # where the ranks were: its sleep
    assert "pool.py" not in failure and "selectors.py" not in failure, failure
    result.stdout.fnmatch_lines(["FAILED test_start.py::test_slow_start - pytest-gpu: timed out*"])


def test_the_thread_method_dump_names_the_pool_the_test_waited_for(
    gpu_pytester: pytest.Pytester, run_inner: Callable[..., pytest.RunResult], monkeypatch: pytest.MonkeyPatch
) -> None:
    """pytest-timeout's thread method dumps every thread's stack and ends the process, no report
    made: the waiting thread's name says what it waited for, and no rank outlives the run."""
    require("pytest-timeout", module="pytest_timeout")
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK_VAR, mark)
    gpu_pytester.makeini("[pytest]\n")
    gpu_pytester.makeconftest(SLOW_START_CONFTEST)
    gpu_pytester.makepyfile(test_start=SLOW_START)
    result = run_inner("--timeout=4", "--timeout-method=thread", subprocess=True, timeout=150)
    assert result.ret == 1
    result.stdout.fnmatch_lines(
        [
            "*Stack of MainThread (pytest-gpu: its rank pool of 2 ranks (gloo via spawn) starting: its ranks setting "
            "up: pytest's configuration and conftests, the process group, since *:*:*) (*",
        ]
    )
    deadline = time.monotonic() + patience(30)  # the ranks see their lifeline close and end their process group
    while (left := rank_processes(MARK_VAR, mark)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"rank processes outlived the run: {left}"


# -- the pool's side of the protocol, with in-process "ranks" ---------------------------------------


class PipeRankPool(RankPool):
    """A pool whose ranks are threads at the other end of its socket, answering as ``answer`` says."""

    answer: ClassVar[Callable[[int, dict[str, Any]], list[tuple[str, dict[str, Any]]]]]
    made: ClassVar[list[PipeRankPool]] = []

    def start(self, config_args: list[str]) -> None:
        PipeRankPool.made.append(self)
        self.dir.mkdir(parents=True, exist_ok=True)
        connect(self, self._answer)

    def _answer(self, rank: int, kind: str, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        if kind == "run":
            return type(self).answer(rank, body)
        if kind == "close":
            return [("closed", {"rank": rank})]
        return []


def result_of(rank: int, run_id: Any, value: str) -> tuple[str, dict[str, Any]]:
    return ("result", {"rank": rank, "outcome": "passed", "message": value, "longrepr": "", "run_id": run_id})


def make_manager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, answer: Callable[..., None]) -> PoolManager:
    monkeypatch.setattr(pool_module, "RankPool", PipeRankPool)
    monkeypatch.setattr(PipeRankPool, "made", [])
    monkeypatch.setattr(PipeRankPool, "answer", staticmethod(answer), raising=False)
    run = types.SimpleNamespace(client=None)  # no GPU lease, no port: nothing to give back
    return PoolManager(run, DistSettings(timeout=30.0, grace=2.0), [], tmp_path)  # type: ignore[arg-type]


def test_a_stale_result_is_never_taken_for_the_current_tests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def answer(rank: int, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        stale = [result_of(rank, "an-earlier-run", "stale")] if rank == 1 else []  # still busy with an earlier test
        return [*stale, result_of(rank, body["run_id"], "own")]

    manager = make_manager(tmp_path, monkeypatch, answer)
    try:
        result, _ = manager.execute(GLOO2, body("t"), 30.0)
    finally:
        manager.close()
    assert all(r["message"] == "own" for r in result.results.values()), result.results
    assert result.outcome == "failed" and result.broken
    assert any("answered for another test run" in p for p in result.problems), result.problems
    assert manager.pool is None and PipeRankPool.made[0]._stopped  # an out-of-step pool is not reused


class Interrupted(BaseException):
    """What pytest-timeout's signal method raises (pytest's Failed, a BaseException)."""


@pytest.mark.slow
def test_an_interrupted_wait_kills_the_pool_and_the_next_test_gets_a_fresh_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hang = threading.Event()

    def answer(rank: int, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        if body["nodeid"] == "hangs":
            hang.wait(30)
        return [result_of(rank, body["run_id"], body["nodeid"])]

    def alarm(signum: int, frame: Any) -> None:
        raise Interrupted("timeout")

    manager = make_manager(tmp_path, monkeypatch, answer)
    previous = signal.signal(signal.SIGALRM, alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)  # as pytest-timeout --timeout-method=signal
        with pytest.raises(Interrupted):
            manager.execute(GLOO2, body("hangs"), 30.0)
        signal.setitimer(signal.ITIMER_REAL, 0)
        first = PipeRankPool.made[0]
        assert first._stopped and manager.pool is None  # killed at once, not left running the body
        assert manager.interrupted.startswith("its rank pool of 2 ranks (gloo via spawn) ran its body (ranks 0 and 1")
        hang.set()  # a rank that still answered now could only answer for the hung test
        result, _ = manager.execute(GLOO2, body("next"), 30.0)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        hang.set()
        manager.close()
    assert len(PipeRankPool.made) == 2
    assert result.outcome == "passed" and {r["message"] for r in result.results.values()} == {"next"}
