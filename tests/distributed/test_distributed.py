"""Distributed tests on warm rank pools, end to end: real gloo ranks on CPU under inner pytest runs.

A pool start costs seconds (every rank imports torch), so most behaviour is checked on
one shared inner run (``main``, module scope) whose tests are ordered so that each
effect can be read off afterwards: its per-test reports (written by a small inner
conftest), its junitxml properties, its terminal output and the pids each rank wrote
down. The behaviours that need their own options or process set-up (``--dist-pool=off``,
``--dist-pool-idle``, ``-n 2``, a SIGKILLed pytest) have their own small runs.

Every inner run carries a unique marker in its environment; rank processes inherit it,
which is how the orphan checks tell this run's ranks from anybody else's.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from conftest import require
from helpers import patience

RANKMAIN = "pytest_gpu.distributed.rankmain"
MARK_VAR = "DIST_TEST_RUN_MARK"
INNER_ARGS = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "no:benchmark", "-rA")
_OUTER_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "PYTEST_ADDOPTS")

# The inner conftest: every call report (and any failed/skipped setup or teardown) as a JSON line.
REPORTER = """
import json
import os


def pytest_runtest_logreport(report):
    path = os.environ.get("INNER_REPORTS")
    if not path or (report.when != "call" and report.passed):
        return
    record = {
        "nodeid": report.nodeid,
        "when": report.when,
        "outcome": "xfailed" if report.skipped and hasattr(report, "wasxfail") else report.outcome,
        "longrepr": report.longreprtext,
        "sections": {title: text for title, text in report.sections},
        "props": {name: value for name, value in report.user_properties},
    }
    with open(path, "a") as fh:
        fh.write(json.dumps(record) + "\\n")
"""

# Helpers shared by the inner test modules.
COMMON = """
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

D2 = pytest.mark.distributed(world_size=2)
NONE2 = pytest.mark.distributed(world_size=2, backend="none")
DATA = Path(os.environ["INNER_DATA"])


def note(name, value):
    (DATA / name).write_text(str(value))


def pid_note(test, rank):
    note(f"pid-{test}-{rank.rank}", os.getpid())


def allreduce_check(rank):
    import torch
    import torch.distributed as dist

    t = torch.ones(1) * (rank.rank + 1)
    dist.all_reduce(t)
    assert t.item() == 3
"""

MAIN = """
@pytest.fixture
def settings():
    return {"lr": 0.5, "layers": [1, 2, 3]}


@pytest.fixture
def lock():
    return threading.Lock()


@D2
def test_allreduce(rank):
    pid_note("allreduce", rank)
    allreduce_check(rank)


@D2
def test_rank_fixture(rank):
    import torch
    import torch.distributed as dist

    assert (rank.world_size, rank.backend, rank.device, rank.local_rank) == (2, "gloo", "cpu", rank.rank)
    assert os.environ["DIST_TEST_RUN_MARK"], "the orphan checks find ranks by this variable"
    assert dist.get_rank() == rank.rank
    assert rank.group is dist.group.WORLD
    draws = [torch.zeros(3) for _ in range(2)]
    dist.all_gather(draws, torch.rand(3))
    assert torch.equal(draws[0], draws[1]), "every rank is seeded alike"


@D2
def test_fails_on_rank_1(rank):
    assert rank.rank == 0


@D2
def test_fails_on_both_ranks(rank):
    value = rank.rank + 10
    assert value == 99


@D2
def test_prints(rank):
    print(f"stdout of rank {rank.rank}")
    print(f"stderr of rank {rank.rank}", file=sys.stderr)


@D2
def test_leaves_env_and_cwd_behind(rank, tmp_path):
    os.environ["PYTEST_GPU_LEAKED"] = "1"
    os.chdir(tmp_path)


@D2
def test_env_and_cwd_restored(rank):
    assert "PYTEST_GPU_LEAKED" not in os.environ
    assert os.path.realpath(os.getcwd()) == os.path.realpath(os.environ["INNER_CWD"])


@D2
def test_raises_after_changing_env_and_cwd(rank):
    os.environ["PYTEST_GPU_LEAKED_TOO"] = "1"
    os.chdir("/")
    raise RuntimeError(f"rank {rank.rank} gave up")


@D2
def test_restored_after_a_failure(rank):
    assert "PYTEST_GPU_LEAKED_TOO" not in os.environ
    assert os.path.realpath(os.getcwd()) == os.path.realpath(os.environ["INNER_CWD"])


@D2
def test_skips(rank):
    pytest.skip(f"skipped on rank {rank.rank}")


@D2
def test_xfails_inside(rank):
    pytest.xfail("known bug")


@D2
@pytest.mark.xfail(reason="fails on rank 1", strict=True)
def test_xfail_marker(rank):
    assert rank.rank == 0


@D2
@pytest.mark.parametrize("factor", [2, 5])
def test_parametrized(rank, factor):
    import torch
    import torch.distributed as dist

    t = torch.ones(1) * factor
    dist.all_reduce(t)
    assert t.item() == 2 * factor


@D2
def test_fixture_values(rank, tmp_path, settings):
    import torch.distributed as dist

    assert settings == {"lr": 0.5, "layers": [1, 2, 3]}
    (tmp_path / f"rank{rank.rank}").write_text("here")
    dist.barrier()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]
    note(f"tmp_path-{rank.rank}", tmp_path)


@D2
def test_unpicklable_fixture(rank, lock):
    pass


class TestInAClass:
    @D2
    def test_method(self, rank):
        allreduce_check(rank)


@D2
def test_groups_baseline(rank):
    from torch.distributed import distributed_c10d

    note(f"groups-{rank.rank}", len(distributed_c10d._world.pg_map))


def baseline(rank):
    return int((DATA / f"groups-{rank.rank}").read_text())


@D2
@pytest.mark.parametrize("i", range(200))
def test_subgroup(rank, i):
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    group = dist.new_group([0, 1])
    assert len(distributed_c10d._world.pg_map) == baseline(rank) + 1
    t = torch.ones(1) * i
    dist.all_reduce(t, group=group)
    assert t.item() == 2 * i


@D2
def test_subgroup_then_raise(rank):
    import torch.distributed as dist

    group = dist.new_group([0, 1])
    dist.barrier(group=group)
    raise RuntimeError("left a sub-group behind")


@D2
def test_groups_did_not_grow(rank):
    from torch.distributed import distributed_c10d

    pid_note("groups_did_not_grow", rank)
    assert len(distributed_c10d._world.pg_map) == baseline(rank)


@D2
def test_rank_1_killed(rank):
    if rank.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)


@D2
def test_after_kill(rank):
    pid_note("after_kill", rank)
    allreduce_check(rank)


@pytest.mark.distributed(world_size=2, timeout=5)
def test_stuck(rank):
    import torch.distributed as dist

    if rank.rank == 1:
        time.sleep(120)  # STUCK-SLEEP
    dist.barrier()  # STUCK-BARRIER


@D2
def test_after_timeout(rank):
    pid_note("after_timeout", rank)
    allreduce_check(rank)


@D2
def test_rank_1_dies_after_the_test(rank):
    if rank.rank == 1:
        note("doomed", os.getpid())
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGKILL)).start()


def test_between():
    pid = int((DATA / "doomed").read_text())
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        # until rank 1 is wholly dead: a zombie (the pool has not reaped it yet) with no thread
        # left exiting; its leader turns zombie while the others (gloo's) may still be on the way out
        try:
            if len(os.listdir(f"/proc/{pid}/task")) == 1 and "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]:
                break
        except OSError:
            break
        time.sleep(0.02)
    else:
        raise AssertionError("rank 1 did not die")


@D2
def test_after_pool_died(rank):
    pid_note("after_pool_died", rank)
    allreduce_check(rank)


@NONE2
def test_none_first(rank):
    assert (rank.backend, rank.group, rank.world_size) == ("none", None, 2)
    pid_note("none_first", rank)


@NONE2
def test_none_second(rank):
    pid_note("none_second", rank)


@pytest.mark.distributed(world_size=3, backend="none")
def test_none_three_ranks(rank):
    assert rank.world_size == 3
    pid_note("none_three_ranks", rank)


@NONE2
def test_none_again(rank):
    pid_note("none_again", rank)
"""

MAIN_SOURCE = textwrap.dedent(COMMON) + textwrap.dedent(MAIN)


# -- running inner suites ------------------------------------------------------------------------


def rank_processes(mark: str) -> list[psutil.Process]:
    """Live rank processes (and their launchers) started by the inner run with this marker."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if RANKMAIN not in " ".join(proc.info["cmdline"] or ()):
                continue
            if proc.environ().get(MARK_VAR) == mark and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def describe(procs: list[psutil.Process]) -> list[str]:
    out = []
    for proc in procs:
        try:
            out.append(f"{proc.pid}: {' '.join(proc.cmdline())}")
        except psutil.Error:
            out.append(f"{proc.pid}: (gone)")
    return out


@dataclass
class Suite:
    """An inner test directory, ready to run."""

    path: Path
    mark: str
    env: dict[str, str]

    @property
    def data(self) -> Path:
        return self.path / "data"

    def command(self, *args: str) -> list[str]:
        # --basetemp inside the suite: the default (shared, numbered) one may be pruned by other pytest runs
        junit, basetemp = self.path / "junit.xml", self.path / "basetemp"
        return [sys.executable, "-m", "pytest", *INNER_ARGS, f"--junitxml={junit}", f"--basetemp={basetemp}", *args]

    def run(self, *args: str, timeout: float = 600) -> Inner:
        out = subprocess.run(
            self.command(*args),
            cwd=self.path,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=patience(timeout),
        )
        leftovers = describe(rank_processes(self.mark))  # right after the session: nothing may be left
        return Inner(self, out.returncode, out.stdout, leftovers)


def make_suite(path: Path, files: dict[str, str]) -> Suite:
    path.mkdir(parents=True, exist_ok=True)
    (path / "data").mkdir()
    (path / "pytest.ini").write_text("[pytest]\n")
    (path / "conftest.py").write_text(textwrap.dedent(REPORTER))
    for name, text in files.items():
        (path / name).write_text(text)
    mark = uuid.uuid4().hex
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _OUTER_VARS
        and not k.startswith(("PYTEST_GPU_", "PYTEST_XDIST_"))
        and k not in ("PYTEST_CURRENT_TEST", "PYTEST_DISABLE_PLUGIN_AUTOLOAD")
    }
    env.update(
        {
            MARK_VAR: mark,
            "INNER_DATA": str(path / "data"),
            "INNER_CWD": str(path),
            "INNER_REPORTS": str(path / "reports.jsonl"),
        }
    )
    return Suite(path, mark, env)


@dataclass
class Inner:
    """What an inner run left: exit code, terminal output, reports, junitxml properties."""

    suite: Suite
    ret: int
    output: str
    leftovers: list[str]

    def __post_init__(self) -> None:
        self.reports: dict[str, dict] = {}
        path = self.suite.path / "reports.jsonl"
        if path.exists():
            for line in path.read_text().splitlines():
                record = json.loads(line)
                known = self.reports.get(record["nodeid"])
                if known is None or known["outcome"] == "passed":  # keep the call, or the phase that went wrong
                    self.reports[record["nodeid"]] = record
        self.junit: dict[str, dict[str, str]] = {}
        junit = self.suite.path / "junit.xml"
        if junit.exists():
            for case in ET.parse(junit).iter("testcase"):
                name = f"{case.get('classname')}::{case.get('name')}"
                self.junit[name] = {p.get("name", ""): p.get("value", "") for p in case.iter("property")}

    def report(self, nodeid: str) -> dict:
        assert nodeid in self.reports, f"{nodeid} has no report; output:\n{self.output[-3000:]}"
        return self.reports[nodeid]

    def outcome(self, nodeid: str) -> str:
        return self.report(nodeid)["outcome"]

    def props(self, case: str) -> dict[str, str]:
        """junitxml properties of ``module::test`` (classname::name)."""
        assert case in self.junit, f"{case} not in junitxml: {sorted(self.junit)[:20]}"
        return self.junit[case]

    def pids(self, test: str) -> set[int]:
        return {int(p.read_text()) for p in self.suite.data.glob(f"pid-{test}-*")}


def line_of(source: str, tag: str) -> int:
    return next(i for i, line in enumerate(source.splitlines(), 1) if tag in line)


def rank_sections(text: str) -> dict[int, str]:
    """The per-rank parts of a distributed failure message, by rank."""
    parts = re.split(r"^=+ rank (\d+) =+$", text, flags=re.MULTILINE)
    return {int(parts[i]): parts[i + 1] for i in range(1, len(parts), 2)}


@pytest.fixture(scope="module")
def main(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Inner]:
    require("torch", module="torch")
    suite = make_suite(tmp_path_factory.mktemp("main"), {"test_main.py": MAIN_SOURCE})
    yield suite.run()


def nid(name: str) -> str:
    return f"test_main.py::{name}"


def case(name: str) -> str:
    return f"test_main::{name}"


# -- the shared run ----------------------------------------------------------------------------------


def test_main_run_outcomes(main: Inner) -> None:
    failed = {n for n, r in main.reports.items() if r["outcome"] == "failed"}
    assert failed == {
        nid("test_fails_on_rank_1"),
        nid("test_fails_on_both_ranks"),
        nid("test_raises_after_changing_env_and_cwd"),
        nid("test_unpicklable_fixture"),
        nid("test_subgroup_then_raise"),
        nid("test_rank_1_killed"),
        nid("test_stuck"),
    }, main.output[-3000:]
    assert main.ret == pytest.ExitCode.TESTS_FAILED
    assert re.search(r"7 failed, 221 passed, 1 skipped, 2 xfailed in ", main.output), main.output[-2000:]


def test_allreduce_passes_and_starts_a_pool(main: Inner) -> None:
    assert main.outcome(nid("test_allreduce")) == "passed"
    props = main.props(case("test_allreduce"))
    assert props["dist_ranks"] == "2"
    assert props["dist_pool"] == "fresh"


def test_second_test_with_the_same_key_is_warm(main: Inner) -> None:
    assert main.outcome(nid("test_rank_fixture")) == "passed", main.report(nid("test_rank_fixture"))["longrepr"]
    assert main.props(case("test_rank_fixture"))["dist_pool"] == "warm"


def test_timing_properties_are_recorded(main: Inner) -> None:
    for name in ("test_allreduce", "test_rank_fixture", "test_fails_on_rank_1", "test_parametrized[2]"):
        props = main.props(case(name))
        assert float(props["dist_body_seconds"]) >= 0.0, (name, props)
        assert float(props["dist_overhead_seconds"]) > 0.0, (name, props)


def test_failure_on_rank_1_only_shows_rank_1(main: Inner) -> None:
    report = main.report(nid("test_fails_on_rank_1"))
    assert report["outcome"] == "failed"
    text = report["longrepr"]
    assert text.startswith("distributed test failed on 1 of 2 ranks (2 ranks (gloo via spawn))"), text
    sections = rank_sections(text)
    assert list(sections) == [1], text
    assert "assert rank.rank == 0" in sections[1]
    assert "AssertionError: assert 1 == 0" in sections[1]
    assert "test_main.py:" in sections[1]


def test_failure_on_both_ranks_shows_both(main: Inner) -> None:
    text = main.report(nid("test_fails_on_both_ranks"))["longrepr"]
    assert text.startswith("distributed test failed on 2 of 2 ranks"), text
    sections = rank_sections(text)
    assert list(sections) == [0, 1], text
    assert "assert 10 == 99" in sections[0] and "assert 11 == 99" not in sections[0]
    assert "assert 11 == 99" in sections[1] and "assert 10 == 99" not in sections[1]


def test_failure_detail_reaches_the_terminal(main: Inner) -> None:
    block = re.search(r"^_+ test_fails_on_rank_1 _+$(.*?)^_+ test_", main.output, flags=re.M | re.S)
    assert block is not None, main.output
    block = block.group(1)
    assert "distributed test failed on 1 of 2 ranks" in block
    assert "E       AssertionError: assert 1 == 0" in block
    assert re.search(r"^=+ rank 0 =+$", block, flags=re.MULTILINE) is None


def test_rank_output_becomes_report_sections(main: Inner) -> None:
    report = main.report(nid("test_prints"))
    assert report["outcome"] == "passed"
    sections = report["sections"]
    assert sections["Captured rank 0 stdout call"] == "stdout of rank 0\n"
    assert sections["Captured rank 1 stdout call"] == "stdout of rank 1\n"
    assert sections["Captured rank 0 stderr call"] == "stderr of rank 0\n"
    assert sections["Captured rank 1 stderr call"] == "stderr of rank 1\n"
    # a test's section holds only that test's output
    assert not any("rank" in title for title in main.report(nid("test_allreduce"))["sections"])
    block = main.output[main.output.index("Captured rank 1 stdout call") :]
    assert block.splitlines()[1] == "stdout of rank 1"


def test_env_and_cwd_are_restored_between_tests(main: Inner) -> None:
    for name in ("test_leaves_env_and_cwd_behind", "test_env_and_cwd_restored", "test_restored_after_a_failure"):
        report = main.report(nid(name))
        assert report["outcome"] == "passed", (name, report["longrepr"])
    failed = main.report(nid("test_raises_after_changing_env_and_cwd"))["longrepr"]
    assert "RuntimeError: rank 0 gave up" in failed
    assert "RuntimeError: rank 1 gave up" in failed


def test_skip_inside_the_body(main: Inner) -> None:
    report = main.report(nid("test_skips"))
    assert report["outcome"] == "skipped"
    assert "skipped on rank 0" in report["longrepr"]
    assert "skipped on rank 1" in report["longrepr"]
    assert re.search(r"^SKIPPED \[1\] test_main\.py:\d+: skipped on rank 0; skipped on rank 1$", main.output, re.M)


def test_xfail_inside_the_body_and_as_marker(main: Inner) -> None:
    assert main.outcome(nid("test_xfails_inside")) == "xfailed"
    assert main.outcome(nid("test_xfail_marker")) == "xfailed"
    assert "XFAIL test_main.py::test_xfails_inside - known bug" in main.output
    assert "XFAIL test_main.py::test_xfail_marker - fails on rank 1" in main.output


def test_parametrize(main: Inner) -> None:
    for factor in (2, 5):
        name = f"test_parametrized[{factor}]"
        assert main.outcome(nid(name)) == "passed", main.report(nid(name))["longrepr"]
        assert main.props(case(name))["dist_pool"] == "warm"


def test_fixture_values_reach_the_ranks(main: Inner) -> None:
    report = main.report(nid("test_fixture_values"))
    assert report["outcome"] == "passed", report["longrepr"]
    seen = {(main.suite.data / f"tmp_path-{r}").read_text() for r in (0, 1)}
    assert len(seen) == 1, seen  # both ranks got the same directory ...
    tmp = Path(seen.pop())
    assert sorted(p.name for p in tmp.iterdir()) == ["rank0", "rank1"]  # ... the one pytest made
    assert tmp.name.startswith("test_fixture_values")


def test_unpicklable_fixture_fails_naming_it(main: Inner) -> None:
    report = main.report(nid("test_unpicklable_fixture"))
    assert report["outcome"] == "failed"
    assert (
        "pytest-gpu: test_main.py::test_unpicklable_fixture: the value of fixture 'lock' (lock) "
        "cannot be sent to the ranks: cannot pickle '_thread.lock' object. "
        "Build it inside the test body, or make it picklable."
    ) in report["longrepr"]


def test_method_of_a_test_class(main: Inner) -> None:
    assert main.outcome(nid("TestInAClass::test_method")) == "passed"


def test_sub_groups_do_not_accumulate(main: Inner) -> None:
    for i in range(200):
        report = main.report(nid(f"test_subgroup[{i}]"))
        assert report["outcome"] == "passed", (i, report["longrepr"])
        assert report["props"]["dist_pool"] == "warm", i
    assert "left a sub-group behind" in main.report(nid("test_subgroup_then_raise"))["longrepr"]
    report = main.report(nid("test_groups_did_not_grow"))
    assert report["outcome"] == "passed", report["longrepr"]
    assert main.pids("groups_did_not_grow") == main.pids("allreduce")  # one pool all along
    assert len(main.pids("allreduce")) == 2


def test_rank_killed_mid_test_fails_it_and_the_next_test_gets_a_fresh_pool(main: Inner) -> None:
    text = main.report(nid("test_rank_1_killed"))["longrepr"]
    assert text.startswith("distributed test failed on 1 of 2 ranks"), text
    assert "rank 1 died during the test: killed by SIGKILL (exit -9)" in text
    assert main.outcome(nid("test_after_kill")) == "passed"
    assert main.props(case("test_after_kill"))["dist_pool"] == "fresh"
    assert len(main.pids("after_kill")) == 2
    assert not main.pids("after_kill") & main.pids("allreduce")


def test_stuck_rank_times_out_with_every_rank_stack(main: Inner) -> None:
    report = main.report(nid("test_stuck"))
    assert report["outcome"] == "failed"
    assert "ranks 0 and 1 did not finish within its timeout (5s)" in report["longrepr"]
    stacks = report["sections"]
    sleep_line = line_of(MAIN_SOURCE, "STUCK-SLEEP")
    barrier_line = line_of(MAIN_SOURCE, "STUCK-BARRIER")
    assert f'test_main.py", line {barrier_line} in test_stuck' in stacks["Captured rank 0 stack call"]
    assert " in barrier" in stacks["Captured rank 0 stack call"]
    assert f'test_main.py", line {sleep_line} in test_stuck' in stacks["Captured rank 1 stack call"]
    assert main.outcome(nid("test_after_timeout")) == "passed"
    assert main.props(case("test_after_timeout"))["dist_pool"] == "fresh"
    assert not main.pids("after_timeout") & main.pids("after_kill")


def test_pool_that_died_between_tests_is_replaced_and_said_so(main: Inner) -> None:
    assert main.outcome(nid("test_rank_1_dies_after_the_test")) == "passed"
    report = main.report(nid("test_after_pool_died"))
    assert report["outcome"] == "passed", report["longrepr"]
    assert main.props(case("test_after_pool_died"))["dist_pool"] == "fresh"
    note = report["sections"]["Captured pytest-gpu pool call"]
    assert "the warm pool 2 ranks (gloo via spawn) had died since its last test" in note
    assert "rank 1: killed by SIGKILL (exit -9)" in note
    assert note.endswith("this test ran in a fresh pool")


def test_pools_are_keyed_by_world_size_and_backend(main: Inner) -> None:
    pools = [main.props(case(n))["dist_pool"] for n in ("test_none_first", "test_none_second")]
    assert pools == ["fresh", "warm"]  # a gloo pool was warm before: another backend needs its own
    assert main.props(case("test_none_three_ranks"))["dist_pool"] == "fresh"
    assert main.props(case("test_none_three_ranks"))["dist_ranks"] == "3"
    assert main.props(case("test_none_again"))["dist_pool"] == "fresh"
    first, second = main.pids("none_first"), main.pids("none_second")
    three, again = main.pids("none_three_ranks"), main.pids("none_again")
    assert len(first) == 2 and first == second
    assert len(three) == 3 and not three & first
    assert len(again) == 2 and not again & (first | three)


def test_no_rank_process_left_after_the_session(main: Inner) -> None:
    assert main.leftovers == []


# -- runs with their own options -----------------------------------------------------------------------

POOL_OFF = """
@NONE2
def test_one(rank):
    pid_note("one", rank)


@NONE2
def test_two(rank):
    pid_note("two", rank)


@NONE2
def test_three(rank):
    pid_note("three", rank)


@NONE2
def test_sleeps_past_the_default_timeout(rank):
    time.sleep(60)
"""


def test_pool_off_starts_fresh_ranks_for_every_test(tmp_path: Path) -> None:
    suite = make_suite(tmp_path, {"test_off.py": textwrap.dedent(COMMON) + textwrap.dedent(POOL_OFF)})
    result = suite.run("--dist-pool=off", "--dist-timeout=2")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.output
    for name in ("test_one", "test_two", "test_three"):
        assert result.outcome(f"test_off.py::{name}") == "passed"
        assert result.props(f"test_off::{name}")["dist_pool"] == "fresh"
    one, two, three = result.pids("one"), result.pids("two"), result.pids("three")
    assert len(one) == len(two) == len(three) == 2
    assert not one & two and not two & three and not one & three
    text = result.report("test_off.py::test_sleeps_past_the_default_timeout")["longrepr"]
    assert "ranks 0 and 1 did not finish within its timeout (2s)" in text
    assert result.leftovers == []


OPTIONS = """
@NONE2
def test_compares_lists(rank):
    found = [1, rank.rank]
    assert found == [1, 5]
"""


@pytest.mark.parametrize("assert_mode", ["rewrite", "plain"])
def test_ranks_ignore_addopts_but_follow_the_assertion_mode(tmp_path: Path, assert_mode: str) -> None:
    """The ini file's addopts and PYTEST_ADDOPTS name options of plugins a rank does not load
    (xdist's ``-n``, pytest-gpu's own): its test bodies still run, and assert as pytest does."""
    suite = make_suite(tmp_path, {"test_opts.py": textwrap.dedent(COMMON) + textwrap.dedent(OPTIONS)})
    (suite.path / "pytest.ini").write_text("[pytest]\naddopts = -n 0 --dist-pool-idle=30\n")
    suite.env["PYTEST_ADDOPTS"] = "--gpu-schedule=off"
    result = suite.run(f"--assert={assert_mode}")
    text = result.report("test_opts.py::test_compares_lists")["longrepr"]
    sections = rank_sections(text)
    assert set(sections) == {0, 1}, text
    if assert_mode == "rewrite":
        assert "assert [1, 0] == [1, 5]" in sections[0], text
        assert "assert [1, 1] == [1, 5]" in sections[1], text
    else:
        assert "AssertionError" in sections[0] and "[1, 0] ==" not in text, text
    assert "KeyError" not in text and "rewriting unavailable" not in text, text
    assert result.leftovers == []


RANK0_CANNOT_JOIN = """

import os as _os

if _os.environ.get("PYTEST_GPU_RANK_LOG_DIR") and _os.environ.get("PYTEST_GPU_RANK") == "0":
    import torch.distributed as _dist

    def _refuse(*args, **kwargs):  # before rank 0 starts the rendezvous store
        raise RuntimeError("rank 0 cannot join")

    _dist.init_process_group = _refuse
"""

GLOO_ONE = """
@pytest.mark.distributed(world_size=2, backend="gloo")
def test_never_starts(rank):
    pass
"""


def test_a_rank_that_cannot_set_up_fails_the_start_at_once(tmp_path: Path) -> None:
    """Rank 0 fails before its rendezvous store listens; rank 1 would wait for that store
    until the group's timeout (120 s): the pool's start fails as soon as rank 0 says so,
    naming rank 1 as not set up, and kills it (it cannot answer a farewell)."""
    require("torch", module="torch")
    suite = make_suite(tmp_path, {"test_start.py": textwrap.dedent(COMMON) + textwrap.dedent(GLOO_ONE)})
    with (suite.path / "conftest.py").open("a") as conftest:
        conftest.write(textwrap.dedent(RANK0_CANNOT_JOIN))
    started = time.monotonic()
    result = suite.run()
    took = time.monotonic() - started
    text = result.report("test_start.py::test_never_starts")["longrepr"]
    assert "rank 0:" in text and "RuntimeError: rank 0 cannot join" in text, text
    assert "rank 1 had not finished setting up then" in text, text
    assert took < 60, f"the run took {took:.0f}s: it waited for rank 1"
    assert result.leftovers == []


IDLE = """
import psutil


@NONE2
def test_starts_a_pool(rank):
    pid_note("first", rank)


def ranks_alive():
    mark = os.environ["DIST_TEST_RUN_MARK"]
    alive = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if "pytest_gpu.distributed.rankmain" in " ".join(proc.info["cmdline"] or ()):
                if proc.environ().get("DIST_TEST_RUN_MARK") == mark and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc.pid)
        except psutil.Error:
            pass
    return alive


def test_pool_gone_while_the_session_runs():
    assert len(ranks_alive()) == 2  # still warm right after the test ...
    time.sleep(3)
    deadline = time.monotonic() + 30  # ... closed 2 s later (a loaded machine may take longer)
    while ranks_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ranks_alive() == []


@NONE2
def test_next_test_starts_a_new_pool(rank):
    pid_note("again", rank)
"""


def test_idle_pool_is_closed(tmp_path: Path) -> None:
    suite = make_suite(tmp_path, {"test_idle.py": textwrap.dedent(COMMON) + textwrap.dedent(IDLE)})
    result = suite.run("--dist-pool-idle=2")
    assert result.ret == pytest.ExitCode.OK, result.output
    assert result.outcome("test_idle.py::test_pool_gone_while_the_session_runs") == "passed"
    assert result.props("test_idle::test_starts_a_pool")["dist_pool"] == "fresh"
    assert result.props("test_idle::test_next_test_starts_a_new_pool")["dist_pool"] == "fresh"
    first, again = result.pids("first"), result.pids("again")
    assert len(first) == len(again) == 2 and not first & again
    assert not any(psutil.pid_exists(pid) and "rankmain" in " ".join(_cmdline(pid)) for pid in first)


def _cmdline(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:
        return []


XDIST = """
@D2
@pytest.mark.parametrize("n", [0, 1])
def test_side_by_side(rank, n):
    import torch.distributed as dist

    worker = os.environ["PYTEST_XDIST_WORKER"]
    if rank.rank == 0:
        note(f"port-{worker}", os.environ["MASTER_PORT"])
        deadline = time.monotonic() + 150
        while len(list(DATA.glob("port-*"))) < 2:  # wait until the other worker's pool is up and running a test
            assert time.monotonic() < deadline, "the other worker's pool never ran a test"
            time.sleep(0.05)
    dist.barrier()
    allreduce_check(rank)
"""


def test_two_xdist_workers_run_pools_side_by_side(tmp_path: Path) -> None:
    require("torch", module="torch")
    suite = make_suite(tmp_path, {"test_x.py": textwrap.dedent(COMMON) + textwrap.dedent(XDIST)})
    result = suite.run("-n", "2")
    assert result.ret == pytest.ExitCode.OK, result.output
    ports = {p.name: p.read_text() for p in suite.data.glob("port-*")}
    assert sorted(ports) == ["port-gw0", "port-gw1"], ports
    assert len(set(ports.values())) == 2, ports  # each pool got its own rendezvous port
    for n in (0, 1):
        assert result.props(f"test_x::test_side_by_side[{n}]")["dist_pool"] == "fresh"
    assert result.leftovers == []


KILLED = """
@D2
def test_hangs(rank):
    import torch.distributed as dist

    note(f"running-{rank.rank}", os.getpid())
    if rank.rank == 1:
        time.sleep(300)
    dist.barrier()
"""


def test_no_rank_left_after_pytest_is_sigkilled_mid_test(tmp_path: Path) -> None:
    require("torch", module="torch")
    suite = make_suite(tmp_path, {"test_k.py": textwrap.dedent(COMMON) + textwrap.dedent(KILLED)})
    with open(tmp_path / "output.txt", "w") as out:
        proc = subprocess.Popen(suite.command(), cwd=suite.path, env=suite.env, stdout=out, stderr=subprocess.STDOUT)
    ranks: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + patience(120)
        while len(list(suite.data.glob("running-*"))) < 2:
            assert proc.poll() is None, (tmp_path / "output.txt").read_text()
            assert time.monotonic() < deadline, "the distributed test never started"
            time.sleep(0.1)
        ranks = rank_processes(suite.mark)
        assert len(ranks) == 2, describe(ranks)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=patience(10))
        deadline = time.monotonic() + patience(20)
        while rank_processes(suite.mark) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert describe(rank_processes(suite.mark)) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for rank in ranks:  # only if the check above failed: do not leave them behind
            try:
                rank.kill()
            except psutil.Error:
                pass


NO_GPUS = """
def seen(rank):
    return {"cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "hip": os.environ.get("HIP_VISIBLE_DEVICES")}


@pytest.mark.distributed(world_size=2, backend="gloo", timeout=300)
def test_gloo_rank(rank):
    import torch
    import torch.distributed as dist

    assert (seen(rank), rank.device) == ({"cuda": "", "hip": ""}, "cpu")
    # every collective's timeout: past the test's own 300 s, so that a hang is reported with stacks
    timeout = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
    assert timeout.total_seconds() > 300
    allreduce_check(rank)


@NONE2
def test_none_rank(rank):
    assert (seen(rank), rank.device) == ({"cuda": "", "hip": ""}, "cpu")
"""


def test_ranks_without_gpus_see_none_and_outlast_the_test_timeout(tmp_path: Path) -> None:
    require("torch", module="torch")
    suite = make_suite(tmp_path, {"test_no_gpus.py": textwrap.dedent(COMMON) + textwrap.dedent(NO_GPUS)})
    # the user's selection: an unset variable in the ranks would show them every GPU instead
    suite.env.update(CUDA_VISIBLE_DEVICES="0,1", HIP_VISIBLE_DEVICES="1")
    result = suite.run("--dist-timeout=30")
    assert result.ret == pytest.ExitCode.OK, result.output
    assert result.outcome("test_no_gpus.py::test_gloo_rank") == "passed"
    assert result.outcome("test_no_gpus.py::test_none_rank") == "passed"
    assert result.leftovers == []


# -- a pool's GPUs: one holder among the others --------------------------------------------------

POOL_GPUS = """
G2 = pytest.mark.distributed(world_size=2, backend="gloo", gpus_per_rank=1)
KEPT = []


@G2
def test_within_its_budget(rank):
    from pytest_gpu import sim

    with sim.allocate("1GiB"):
        pass


@G2
def test_over_the_cap(rank):
    from pytest_gpu import sim

    if rank.rank == 1:
        sim.allocate("3GiB")  # its pool's lease gives each rank 2GiB per GPU


@G2
def test_keeps_memory(rank):
    from pytest_gpu import sim

    if rank.rank == 0:
        KEPT.append(sim.allocate("512MiB"))  # still held once the test is over


def test_plain_after_the_pool():
    from pytest_gpu.gpu.verification import claimed

    note("claimed-plain", json.dumps({str(k): v for k, v in claimed().items()}))
"""


def test_a_pools_lease_is_capped_verified_traced_and_counted(tmp_path: Path) -> None:
    require("torch", module="torch")
    suite = make_suite(tmp_path, {"test_pool_gpus.py": "import json\n" + textwrap.dedent(COMMON) + POOL_GPUS})
    trace = tmp_path / "trace.json"
    result = suite.run("--gpus", "sim:2x8GiB", "--gpu-default-memory=2GiB", "--gpu-verify=fail", f"--gpu-trace={trace}")
    name = "test_pool_gpus.py::"
    assert result.outcome(name + "test_within_its_budget") == "passed", result.output[-3000:]
    # confined: a rank is capped at the pool's lease, as a test process at its own
    over = result.report(name + "test_over_the_cap")
    assert over["outcome"] == "failed" and "out of memory" in over["longrepr"].lower(), over["longrepr"]
    # verified after each test it ran: the pool is named, during the test that broke it
    reports = [json.loads(line) for line in (tmp_path / "reports.jsonl").read_text().splitlines()]
    teardown = next(r for r in reports if r["nodeid"] == name + "test_keeps_memory" and r["when"] == "teardown")
    text = teardown["longrepr"]
    assert teardown["outcome"] == "failed", teardown
    assert "the rank pool of 2 ranks" in text and "broke its GPU lease while it ran" in text, text
    assert "still holds 512MiB" in text, text
    # counted in the summary, and named there
    assert re.search(r"pytest-gpu: .* · 1 violation\b", result.output), result.output[-3000:]
    assert "lease broken by the rank pool of 2 ranks" in result.output
    # drawn in the trace, on the GPUs the ranks used, under the pool's name
    events = json.loads(trace.read_text())["traceEvents"]
    pool = [e for e in events if e.get("cat") == "lease" and e["args"].get("holder") == "pool"]
    assert {e["args"]["gpu"] for e in pool} == {0, 1}, pool
    assert all(e["name"].startswith("the rank pool of 2 ranks") for e in pool)
    assert {e["args"]["nodeid"] for e in pool} >= {name + "test_within_its_budget", name + "test_keeps_memory"}
    # the ranks are the pool's while it lives, in this process: never the plain test's
    claimed = json.loads((suite.data / "claimed-plain").read_text())
    assert claimed and all(holder.startswith("the rank pool of 2 ranks") for holder in claimed.values())


# -- a pool's GPUs on the NVML path (fake GPUs: the code path of a real machine) ----------------

POOL_NVML_CLEAN = """
G2 = pytest.mark.distributed(world_size=2, backend="gloo", gpus_per_rank=1)


@G2
def test_within_its_budget(rank):
    from pytest_gpu import sim

    with sim.allocate("1GiB"):  # opens the rank's context on its GPU, frees the rest
        pass


@pytest.mark.gpu(memory="1GiB")
def test_plain_after_the_pool(gpu):
    pass
"""

POOL_NVML_KEEPS = """
G2 = pytest.mark.distributed(world_size=2, backend="gloo", gpus_per_rank=1)
KEPT = []


@G2
def test_keeps_memory(rank):
    from pytest_gpu import sim

    if rank.rank == 0:
        KEPT.append(sim.allocate("512MiB"))  # still held once the test is over
"""

POOL_NVML_BROKEN = (
    POOL_NVML_KEEPS
    + """

@G2
def test_over_the_budget(rank):
    from pytest_gpu import sim

    if rank.rank == 1:
        # another allocator than torch's (CuPy, raw cudaMalloc): torch's fraction does not cap it
        KEPT.append(sim.allocate("3GiB", capped=False))


HOLD = "from pytest_gpu import sim; import sys; a = sim.allocate('1GiB'); print('up', flush=True); sys.stdin.read()"
CHILDREN = []


def start_child(env=None):
    import subprocess

    pipe = subprocess.PIPE
    proc = subprocess.Popen([sys.executable, "-c", HOLD], stdin=pipe, stdout=pipe, text=True, env=env)
    assert proc.stdout.readline() == "up\\n"
    CHILDREN.append(proc)


@G2
def test_leaves_a_child(rank):
    if rank.rank == 0:
        start_child()  # on the rank's GPU, still running when the test is over


@G2
def test_child_outside_the_lease(rank):
    for proc in CHILDREN:
        proc.communicate()  # the first child ends
    CHILDREN.clear()
    if rank.rank == 1:
        from pytest_gpu import sim

        leased = set(os.environ["PYTEST_GPU_RANK_GPUS"].replace(";", ",").split(","))
        other = next(u.uuid for u in sim.ledger().units() if u.uuid not in leased)
        start_child(dict(os.environ, CUDA_VISIBLE_DEVICES=other))
        note("outside", other)


@G2
def test_after_them(rank):
    for proc in CHILDREN:
        proc.communicate()
    CHILDREN.clear()

    from pytest_gpu import sim

    if rank.rank == 0:  # rank 1 is at its cap: what it holds counts against it
        with sim.allocate("256MiB"):
            pass
"""
)


def fake_suite(tmp_path: Path, source: str, gpus: str = "sim:2x8GiB") -> Suite:
    require("torch", module="torch")
    require("C compiler", executable="cc")  # the fake libnvidia-ml.so.1 is built from C
    suite = make_suite(tmp_path, {"test_pool_nvml.py": textwrap.dedent(COMMON) + source})
    suite.env.update(PYTEST_GPU_FAKE_GPUS=gpus, PYTEST_GPU_SIM_LEDGER=str(tmp_path / "ledger"))
    return suite


def teardowns(suite: Suite) -> dict[str, dict]:
    reports = [json.loads(line) for line in (suite.path / "reports.jsonl").read_text().splitlines()]
    return {r["nodeid"].split("::")[-1]: r for r in reports if r["when"] == "teardown"}


def test_a_clean_pool_test_on_real_gpus_is_verified_not_noted(tmp_path: Path) -> None:
    suite = fake_suite(tmp_path, POOL_NVML_CLEAN)
    result = suite.run("--gpus", "auto", "--gpu-default-memory=2GiB", "--gpu-verify=fail")
    name = "test_pool_nvml.py::"
    assert result.outcome(name + "test_within_its_budget") == "passed", result.output[-3000:]
    assert result.outcome(name + "test_plain_after_the_pool") == "passed", result.output[-3000:]
    assert teardowns(suite) == {}, result.output[-3000:]  # no teardown failed
    assert re.search(r"pytest-gpu: 2 GPUs \(2x8GiB\) \[nvml\] · 2 GPU tests · .* · 0 violations", result.output), (
        result.output[-3000:]
    )
    assert "not verified" not in result.output, result.output[-3000:]  # the ranks' memory was measured
    assert result.leftovers == []


def test_a_pool_that_breaks_its_lease_on_real_gpus_is_named(tmp_path: Path) -> None:
    suite = fake_suite(tmp_path, POOL_NVML_BROKEN, "sim:3x8GiB")  # one GPU outside the pool's lease
    result = suite.run("--gpus", "auto", "--gpu-default-memory=2GiB", "--gpu-verify=fail")
    name = "test_pool_nvml.py::"
    assert "5 passed, 4 errors" in result.output, result.output[-3000:]  # the bodies passed; the pool broke
    assert result.outcome(name + "test_after_them") == "passed", result.output[-3000:]  # not charged again
    broken = teardowns(suite)
    assert set(broken) == {
        "test_keeps_memory",
        "test_over_the_budget",
        "test_leaves_a_child",
        "test_child_outside_the_lease",
    }, result.output[-3000:]
    # a rank keeps memory in a global: held after the test, named as the pool's
    kept = broken["test_keeps_memory"]["longrepr"]
    assert "the rank pool of 2 ranks" in kept and "broke its GPU lease while it ran" in kept, kept
    assert re.search(r"still holds 512MiB on GPU \d after the test \(a rank of the pool still holds it\)", kept), kept
    assert "above its budget" not in kept, kept
    # a rank over the pool's budget (per rank, per GPU): its peak, and what it still holds
    over = broken["test_over_the_budget"]["longrepr"]
    assert "the rank pool of 2 ranks" in over, over
    assert re.search(r"peak 3GiB on GPU \d is above its budget of 2GiB", over), over
    assert "512MiB" not in over, over  # the first leak is the first test's: not charged again
    # a process a rank started during the test, still running: the pool's leak, named
    child = broken["test_leaves_a_child"]["longrepr"]
    assert re.search(
        r"still holds 1\.5GiB on GPU \d after the test \(a process a rank of the pool started still running: "
        r"pid \d+ \(python",
        child,
    ), child  # its context and its allocation
    # ... and one on a GPU outside the pool's lease
    outside = broken["test_child_outside_the_lease"]["longrepr"]
    assert re.search(r"used memory on GPU \d \(1\.5GiB at peak\) outside its lease \(GPU \d,\d\)", outside), outside
    assert re.search(r"pytest-gpu: 3 GPUs \(3x8GiB\) \[nvml\] · 5 GPU tests · .* · 5 violations", result.output), (
        result.output[-3000:]
    )
    assert "not verified" not in result.output, result.output[-3000:]
    assert result.leftovers == []


POOL_NVML_GROWS = """
G2 = pytest.mark.distributed(world_size=2, backend="gloo", gpus_per_rank=1)


@pytest.mark.parametrize("i", range(50))
@G2
def test_new_library(i, rank):
    from pytest_gpu.sim import torch_cuda

    torch_cuda.launch(f"kernel{i}", local_memory=f"{4 * (i + 1)}MiB")  # a new module, more local memory
    torch_cuda.matmul(stream=i)  # cuBLAS (loaded once), a workspace on a new stream
    if i % 10 == 0:
        torch_cuda.convolution()  # cuDNN, loaded once
"""


@pytest.mark.slow  # 50 pool tests, torch in the ranks
@pytest.mark.parametrize("gpus", ["auto", "sim:2x8GiB"])
def test_a_warm_pool_meeting_new_libraries_and_streams_is_charged_nothing_for_them(tmp_path: Path, gpus: str) -> None:
    """A pool's ranks live through 50 clean tests, each growing their contexts (446 MiB in all,
    more than a lifetime allowance) and using cuBLAS on a new stream: its workspace is torch's
    allocation until the rank clears cuBLAS's workspaces, which it must, as the test process
    does, or each stream is read as the rank's leak (the simulated verifier sees the workspace
    as the test's allocation; NVML sees it within the context's allowance). ``auto``: the fake
    NVML's path, as on a real machine; ``sim:``: the ledger's."""
    if gpus == "auto":
        suite = fake_suite(tmp_path, POOL_NVML_GROWS)
    else:
        suite = make_suite(tmp_path, {"test_pool_nvml.py": textwrap.dedent(COMMON) + POOL_NVML_GROWS})
    result = suite.run("--gpus", gpus, "--gpu-default-memory=2GiB", "--gpu-verify=fail")
    assert "50 passed" in result.output and "error" not in result.output.splitlines()[-1], result.output[-3000:]
    assert teardowns(suite) == {}, result.output[-3000:]
    summary = r"pytest-gpu: 2 (simulated )?GPUs \(2x8GiB\) \[[^]]+\] · 50 GPU tests · .* · 0 violations"
    assert re.search(summary, result.output), result.output[-3000:]


def test_a_pool_nvml_cannot_measure_is_said_not_guessed(tmp_path: Path) -> None:
    """A driver that lists processes without their memory (``usedGpuMemory`` None): the pool's
    check claims no leak and says why, named as the pool's."""
    suite = fake_suite(tmp_path, POOL_NVML_KEEPS, "sim:2x8GiB;no-usage")
    result = suite.run("--gpus", "auto", "--gpu-default-memory=2GiB", "--gpu-verify=fail")
    assert result.outcome("test_pool_nvml.py::test_keeps_memory") == "passed", result.output[-3000:]
    assert re.search(r"· 1 GPU test · .* · 0 violations", result.output), result.output[-3000:]
    assert re.search(
        r"pytest-gpu: not verified: the rank pool of 2 ranks .*: NVML does not say how much memory processes use "
        r"on GPU \d",
        result.output,
    ), result.output[-3000:]
