"""Whole pytest sessions started by real launchers: torchrun, mpirun (Open MPI), srun (SLURM).

Each test writes a small suite into a temporary directory and starts the launcher on it
in a subprocess (its own process group, killed afterwards). The launches are the
expensive part (1-10 s each), so every launch is checked for several things at once.
The srun tests use the session's one-node SLURM cluster (``slurm`` in conftest.py).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import require
from helpers import patience

INNER = ("-p", "no:benchmark", "-p", "no:hypothesispytest", "--color=no")
NO_CACHE = ("-p", "no:cacheprovider")
LAUNCH_TIMEOUT = 150
# where a rank never reports, rank 0 waits this long twice (for its results, then for it to
# leave): short, but long enough for every rank to finish collecting (that gather waits as long)
MISSING_RANK_TIMEOUT = 4
GATHER = f"--rank-gather-timeout={MISSING_RANK_TIMEOUT}"
GiB, OVERHEAD = 2**30, 500 * 2**20  # --gpu-context-overhead's default

# the environment of a rank of an outer launch (or of an outer xdist worker) must not leak in
_DROP_PREFIXES = ("PYTEST_GPU_", "PYTEST_XDIST_", "TORCHELASTIC_", "OMPI_", "PMI_", "PMIX_", "SLURM_")
_DROP = {"PYTEST_ADDOPTS", "CUDA_VISIBLE_DEVICES", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}

# every inner module knows its rank the same way
RANK_OF = """
import os

RANK = next((int(os.environ[v]) for v in ("RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID") if v in os.environ), 0)
"""

# Rank 1 writes straight to its file descriptors outside any test (pytest's capturing is
# suspended then, so descriptors 1 and 2 are whatever pytest found at its start): that
# must land in its log file too. Every rank records the exit status its pytest ends with.
CONFTEST = (
    RANK_OF
    + """
import pytest


def pytest_configure(config):
    if RANK == 1:
        os.write(1, ("RANK1" + "-CONFTEST-STDOUT\\n").encode())
        os.write(2, ("RANK1" + "-CONFTEST-STDERR\\n").encode())


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    with open(f"exit-rank{RANK}.txt", "w") as f:
        f.write(str(int(session.exitstatus)))
"""
)

LOCKSTEP = (
    RANK_OF
    + """
import pytest


def test_ok():
    if RANK == 1:
        print("RANK1" + "-ONLY-PASSING-TEST")


def test_x():
    print(f"test_x runs on rank {RANK}")
    assert RANK != 1, "rank 1 disagrees"


@pytest.mark.horovod_dist
def test_hvd():
    pass


@pytest.mark.skip(reason="not today")
def test_skipped():
    pass
"""
)
RANK1_ONLY = ("RANK1-ONLY-PASSING-TEST", "RANK1-CONFTEST-STDOUT", "RANK1-CONFTEST-STDERR")

KILLED = (
    RANK_OF
    + """
import signal
import time


def test_first():
    pass


def test_dies():
    if RANK == 0:
        open("rank0-in-test_dies", "w").close()
        if "TORCHELASTIC_RUN_ID" in os.environ:
            time.sleep(60)  # torchrun ends rank 0 (SIGTERM) as soon as rank 1 is gone
    else:
        deadline = time.monotonic() + 60
        while not os.path.exists("rank0-in-test_dies") and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)


def test_after():
    pass
"""
)

HUNG = (
    RANK_OF
    + """
import time


def test_first():
    pass


def test_hangs():
    if RANK == 1:
        time.sleep(120)
"""
)

MISMATCH = (
    RANK_OF
    + """
def test_common():
    pass


if RANK == 1:

    def test_only_rank1():
        pass
"""
)

# 60 tests whose ids sort in definition order. Without history the split is round-robin
# over the sorted ids, so rank 0 gets every third test: the long ones.
SHARDED = """
import time

import pytest


def seconds(i):
    return 0.2 + (i % 5) * 0.025 if i % 3 == 0 else 0.01 + (i % 4) * 0.03


@pytest.mark.parametrize("i", range(60), ids=lambda i: f"{i:02d}")
def test_sleep(i):
    time.sleep(seconds(i))
"""


@dataclass
class Launched:
    cwd: Path
    returncode: int
    stdout: str
    stderr: str

    @property
    def terminal(self) -> str:
        return self.stdout + self.stderr

    def exit_statuses(self, ranks: int) -> list[str]:
        return [(self.cwd / f"exit-rank{r}.txt").read_text() for r in range(ranks)]

    def junit(self, name: str = "junit.xml") -> dict[str, ET.Element]:
        cases = {}
        for case in ET.parse(self.cwd / name).iter("testcase"):
            key = f"{case.get('classname')}::{case.get('name')}"
            assert key not in cases, f"{key} twice in {name}"
            cases[key] = case
        return cases


def inner_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DROP and not k.startswith(_DROP_PREFIXES)}
    env.update(extra)
    return env


def launch(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = LAUNCH_TIMEOUT) -> Launched:
    """Run a launcher to its end; afterwards kill whatever is left of its process group."""
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=patience(timeout))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{cmd} did not end within {timeout}s\n--- stdout\n{out}\n--- stderr\n{err}")
    finally:
        try:  # a rank that hangs outlives an mpirun that gave up on it
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
    # shown with a failing test: the whole terminal of the launch
    print(f"$ {' '.join(cmd)}  # in {cwd}, exit status {proc.returncode}\n--- stdout\n{out}\n--- stderr\n{err}")
    return Launched(cwd, proc.returncode, out, err)


class Launcher:
    """How to start N copies of pytest under one launcher, with the environment it needs."""

    def __init__(self, name: str, request: pytest.FixtureRequest) -> None:
        self.name = name
        if name == "torchrun":
            require("torch", module="torch")
            self.env = inner_env()
        elif name == "mpirun":
            require("Open MPI", executable="mpirun")
            self.env = inner_env(
                OMPI_ALLOW_RUN_AS_ROOT="1",
                OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                OMPI_MCA_rmaps_base_oversubscribe="1",
            )
        else:
            require("SLURM", executable="srun")
            self.env = inner_env(SLURM_CONF=request.getfixturevalue("slurm"))

    def command(self, ranks: int, *pytest_args: str) -> list[str]:
        pytest_cmd = [sys.executable, "-m", "pytest", *INNER, *pytest_args]
        if self.name == "torchrun":
            return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", *pytest_cmd[1:]]
        if self.name == "mpirun":
            return ["mpirun", "-n", str(ranks), *pytest_cmd]
        return ["srun", "-n", str(ranks), *pytest_cmd]

    def run(self, cwd: Path, ranks: int, *pytest_args: str) -> Launched:
        return launch(self.command(ranks, *pytest_args), cwd, self.env)


def suite(directory: Path, **modules: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "pytest.ini").write_text("[pytest]\n")
    (directory / "conftest.py").write_text(CONFTEST)
    for name, source in modules.items():
        (directory / f"{name}.py").write_text(source)
    return directory


@pytest.fixture(params=["torchrun", "mpirun", "srun"])
def launcher(request: pytest.FixtureRequest) -> Launcher:
    return Launcher(request.param, request)


# -- lockstep: every rank runs every test ------------------------------------------------------


@pytest.mark.slow
def test_lockstep_failure_on_one_rank(launcher: Launcher, tmp_path: Path) -> None:
    name = launcher.name
    cwd = suite(tmp_path, test_lockstep=LOCKSTEP)
    # mpirun: a log directory given on the command line (it must reach the earliest redirect)
    log_dir = cwd / ("ranklogs" if name == "mpirun" else "logs")
    extra = ["--rank-log-dir=ranklogs"] if name == "mpirun" else []
    result = launcher.run(cwd, 2, *NO_CACHE, "-rA", "--junitxml=junit.xml", *extra)
    out, terminal = result.stdout, result.terminal
    rank1_log = log_dir / name / "rank1.log"

    assert result.returncode != 0, terminal
    assert result.exit_statuses(2) == ["1", "1"], terminal  # every rank's pytest fails, not only rank 1's
    # rank 0 reports rank 1's failure: its traceback, its captured output, the summary lines
    assert re.search(r"_+ test_x \[rank 1\] _+", out), out
    assert "E       AssertionError: rank 1 disagrees" in out
    assert "test_x runs on rank 1" in out
    assert f"failed on rank 1 of 2; its whole output: {rank1_log}" in out
    assert "FAILED test_lockstep.py::test_x@rank1 - AssertionError: rank 1 disagrees" in out
    assert f"pytest-gpu: 2 ranks under {name}" in out
    assert "test_lockstep.py::test_x: failed on rank 1; passed on rank 0" in out
    assert "test_lockstep.py::test_skipped: skipped on ranks 0,1" in out
    assert "every test passed" not in out
    assert f"output of rank 1: {rank1_log}" in out
    # ... and only rank 0 wrote to the terminal
    assert out.count("test session starts") == 1, out
    for text in RANK1_ONLY:
        assert text not in terminal, f"{text!r} from rank 1 reached the terminal"
    log = rank1_log.read_text()
    for text in RANK1_ONLY:
        assert text in log, f"{text!r} missing from {rank1_log}"
    assert "FAILED test_lockstep.py::test_x - AssertionError: rank 1 disagrees" in log
    if name == "mpirun":
        assert not (cwd / "logs").exists()
    # the strategy marker: horovod cannot run under torchrun, it can under mpirun and srun
    deselected = "pytest-gpu: deselected 1: horovod_dist cannot run under torchrun (allowed: mpirun srun)"
    # each test counts once: test_x failed (on rank 1), though it passed on rank 0
    if name == "torchrun":
        assert deselected in out
        assert re.search(r"=+ 1 failed, 1 passed, 1 skipped, 1 deselected in ", out), out
    else:
        assert "pytest-gpu: deselected" not in out
        assert re.search(r"=+ 1 failed, 2 passed, 1 skipped in ", out), out
    # rank 0's junitxml: one case per test, rank 1's failure in test_x's; rank 1 keeps its own by its log
    cases = result.junit()
    assert not [case for case in cases if "@rank" in case], cases
    failure = cases["test_lockstep::test_x"].find("failure")
    assert failure is not None
    assert (failure.get("message") or "").startswith("rank 1: AssertionError: rank 1 disagrees")
    assert "assert RANK != 1" in (failure.text or "")
    assert ("test_lockstep::test_hvd" in cases) == (name != "torchrun")
    suite_counts = ET.parse(cwd / "junit.xml").find("testsuite")
    assert suite_counts is not None
    assert (suite_counts.get("tests"), suite_counts.get("failures")) == (str(len(cases)), "1")
    rank1_cases = result.junit(str(log_dir / name / "rank1.xml"))
    assert rank1_cases["test_lockstep::test_x"].find("failure") is not None


ERRORS = (
    RANK_OF
    + """
import pytest


@pytest.fixture
def broken():
    raise RuntimeError("setup broke")


@pytest.fixture
def breaks_on_rank_1():
    yield
    if RANK == 1:
        raise RuntimeError("teardown broke on rank 1")


def test_setup(broken):
    pass


def test_teardown(breaks_on_rank_1):
    pass
"""
)


@pytest.mark.slow
def test_errors_are_reported_as_errors_with_the_logs_they_are_in(launcher: Launcher, tmp_path: Path) -> None:
    """Rank 0's report calls a fixture's error an error (at setup, at teardown), not a failure,
    and names the other ranks' real log files."""
    cwd = suite(tmp_path, test_errors=ERRORS)
    result = launcher.run(cwd, 3, *NO_CACHE)
    out = result.stdout
    logs = cwd / "logs" / launcher.name
    assert "test_errors.py::test_setup: error at setup on ranks 0,1,2" in out, out
    assert "test_errors.py::test_teardown: error at teardown on rank 1; passed on ranks 0,1,2" in out, out
    assert f"error at teardown on rank 1 of 3; its whole output: {logs / 'rank1.log'}" in out, out
    assert f"error at setup on rank 2 of 3; its whole output: {logs / 'rank2.log'}" in out, out
    assert f"output of ranks 1 and 2: {logs / 'rank1.log'}, {logs / 'rank2.log'}" in out, out
    assert "failed on rank" not in out and "<N>" not in out, out
    assert re.search(r"=+ 1 passed, 2 errors in ", out), out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["torchrun", "srun"])
def test_killed_rank_is_reported_by_rank_0(name: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    launcher = Launcher(name, request)
    cwd = suite(tmp_path, test_killed=KILLED)
    result = launcher.run(cwd, 2, *NO_CACHE, GATHER, "--junitxml=junit.xml")
    out, terminal = result.stdout, result.terminal
    rank1_log = cwd / "logs" / name / "rank1.log"

    assert result.returncode != 0, terminal
    assert f"rank 1 did not report within {GATHER}s (it died or hangs); its output: {rank1_log}" in out, terminal
    assert f"FAILED pytest-gpu::rank1 - rank 1 of 2 ({name}) did not report" in out
    if name == "torchrun":  # torchrun stopped rank 0 in the middle of test_dies
        assert "KeyboardInterrupt: SIGTERM from the launcher" in out
        assert re.search(r"=+ 1 failed, 1 passed in ", out), out
    else:  # srun let rank 0 finish the suite
        assert re.search(r"=+ 1 failed, 3 passed in ", out), out
        assert result.exit_statuses(1) == ["1"]
    failure = result.junit()["pytest-gpu::rank1"].find("failure")
    assert failure is not None
    assert f"did not report its results within {GATHER}s" in (failure.get("message") or "")


@pytest.mark.slow
def test_hung_rank_under_mpirun_is_reported(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    launcher = Launcher("mpirun", request)
    cwd = suite(tmp_path, test_hung=HUNG)
    result = launcher.run(cwd, 2, *NO_CACHE, GATHER, "--junitxml=junit.xml")
    out = result.stdout
    rank1_log = cwd / "logs" / "mpirun" / "rank1.log"

    assert result.returncode != 0, result.terminal
    assert f"rank 1 did not report within {GATHER}s (it died or hangs); its output: {rank1_log}" in out
    assert "FAILED pytest-gpu::rank1 - rank 1 of 2 (mpirun) did not report" in out
    assert re.search(r"=+ 1 failed, 2 passed in ", out), out
    assert result.exit_statuses(1) == ["1"]
    assert result.junit()["pytest-gpu::rank1"].find("failure") is not None


GPU_SHARES = (
    RANK_OF
    + """
import json

import pytest

from pytest_gpu.base.launch import detect


@pytest.mark.gpu(exclusive=True)
def test_whole(gpu):
    ctx = detect()
    with open(f"lease-rank{RANK}.json", "w") as f:
        json.dump({"indices": list(gpu.indices), "memory": gpu.memory, "local": [ctx.local_rank, ctx.local_size]}, f)


@pytest.mark.gpu(2, exclusive=True)
def test_two(gpu):
    pass
"""
)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "gpus", "leases", "two"),
    [
        # 3 GPUs, 2 ranks: whole GPUs 0 and 2 for rank 0, GPU 1 for rank 1 (where 2 GPUs never fit)
        (
            "torchrun",
            "sim:3x16GiB",
            [({0, 2}, 16 * GiB - OVERHEAD), ({1}, 16 * GiB - OVERHEAD)],
            "passed on rank 0; skipped on rank 1",
        ),
        # 1 GPU, 2 ranks: half of it each
        ("mpirun", "sim:1x16GiB", [({0}, 8 * GiB - OVERHEAD), ({0}, 8 * GiB - OVERHEAD)], "skipped on ranks 0,1"),
        # 2 GPUs, 2 ranks (srun's node size: SLURM_STEP_TASKS_PER_NODE)
        ("srun", "sim:2x16GiB", [({0}, 16 * GiB - OVERHEAD), ({1}, 16 * GiB - OVERHEAD)], "skipped on ranks 0,1"),
    ],
    ids=["torchrun-3-gpus", "mpirun-1-gpu", "srun-2-gpus"],
)
def test_ranks_of_a_node_lease_disjoint_shares_of_its_gpus(
    name: str,
    gpus: str,
    leases: list[tuple[set[int], int]],
    two: str,
    request: pytest.FixtureRequest,
    tmp_path: Path,
) -> None:
    launcher = Launcher(name, request)
    cwd = suite(tmp_path, test_shares=GPU_SHARES)
    result = launcher.run(cwd, 2, *NO_CACHE, "--gpus", gpus)
    assert result.returncode == 0, result.terminal
    for rank, (allowed, memory) in enumerate(leases):
        lease = json.loads((cwd / f"lease-rank{rank}.json").read_text())
        assert set(lease["indices"]) <= allowed and lease["memory"] == memory, (rank, lease)
        assert lease["local"] == [rank, 2]  # the launcher's own word for the ranks on this node
    assert f"test_shares.py::test_two: {two}" in result.stdout  # a rank's share is all it may lease


@pytest.mark.slow
def test_ranks_that_collected_different_tests(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    launcher = Launcher("mpirun", request)
    cwd = suite(tmp_path, test_mismatch=MISMATCH)
    result = launcher.run(cwd, 2, *NO_CACHE, "--rank-gather-timeout=30")
    terminal = result.terminal

    assert result.returncode != 0, terminal
    assert "pytest-gpu: the ranks collected different tests, so they cannot run in lockstep:" in terminal
    assert "  only on rank 1 (not on every rank): test_mismatch.py::test_only_rank1" in terminal
    assert "only on rank 0" not in terminal
    assert "test_common" not in terminal.split("cannot run in lockstep:", 1)[1]
    assert "every test passed" not in terminal
    assert terminal.count("test session starts") == 1


# -- a suite shaped like itwinai's tests/torch, under mpirun and srun ------------------------------

ITWINAI_LAUNCHED = (
    RANK_OF
    + """
import pytest
import torch
import torch.distributed as dist


@pytest.mark.hpc
@pytest.mark.torch_dist
@pytest.mark.parametrize("strategy", ["ddp_strategy", "deepspeed_strategy"])
def test_distributed_trainer_mnist(strategy):
    if strategy == "ddp_strategy":
        # nothing but pytest-gpu sets torch's variables under mpirun or srun
        dist.init_process_group("gloo", init_method="env://")
        try:
            total = torch.tensor([dist.get_rank() + 1.0])
            dist.all_reduce(total)
            assert (total.item(), dist.get_world_size(), dist.get_rank()) == (3.0, 2, RANK)
            assert int(os.environ["LOCAL_RANK"]) == RANK
        finally:
            dist.destroy_process_group()
    else:
        assert RANK != 1, "rank 1 disagrees"


@pytest.mark.hpc
@pytest.mark.torch_dist
def test_dataset(broken_dataset):
    pass


@pytest.mark.torch_dist
@pytest.mark.skipif(RANK == 0, reason="no shard of the data on rank 0")
def test_data_shard():
    assert RANK != 1, "rank 1's shard is empty"


@pytest.mark.hpc
@pytest.mark.horovod_dist
def test_horovod_trainer():
    pass


@pytest.mark.hpc
@pytest.mark.ray_dist
@pytest.mark.parametrize("workers", [1, 2])
def test_ray_trainer(workers):
    pass
"""
)
BROKEN_FIXTURE = """

@pytest.fixture
def broken_dataset():
    raise RuntimeError("dataset missing")
"""


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mpirun", "srun"])
def test_itwinai_suite_under_a_launcher(name: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """One count per test, well-formed ids, tracebacks without pytest-gpu's frames, torch's
    variables under launchers that do not set them, and the rank-log directory from the ini."""
    require("torch", module="torch")
    launcher = Launcher(name, request)
    cwd = suite(tmp_path, test_itwinai=ITWINAI_LAUNCHED)
    (cwd / "conftest.py").write_text(CONFTEST + BROKEN_FIXTURE)
    (cwd / "pytest.ini").write_text("[pytest]\nrank_log_dir = ranklogs\n")
    result = launcher.run(cwd, 2, *NO_CACHE, "--junitxml=junit.xml")
    out, terminal = result.stdout, result.terminal

    assert result.returncode != 0, terminal
    assert result.exit_statuses(2) == ["1", "1"], terminal
    # env:// initialised gloo on both ranks: the test passed everywhere
    assert "test_distributed_trainer_mnist[ddp_strategy]:" not in out, out
    # one count per test: 5 tests ran (the ray tests cannot run under a launcher); test_data_shard
    # failed on rank 1: it is a failure, not a skip (rank 0's)
    assert re.search(r"=+ 2 failed, 2 passed, 2 deselected, 1 error in ", out), out
    assert "test_itwinai.py::test_data_shard: failed on rank 1; skipped on rank 0" in out
    mnist = "test_itwinai.py::test_distributed_trainer_mnist"
    assert f"{mnist}[deepspeed_strategy]: failed on rank 1; passed on rank 0" in out
    assert "test_itwinai.py::test_dataset: error at setup on ranks 0,1" in out
    # a rank's id keeps the parametrized id's closing bracket last
    assert f"FAILED {mnist}[deepspeed_strategy@rank1]" in out  # the message may be cut to the terminal's width
    assert "ERROR test_itwinai.py::test_dataset@rank1 - RuntimeError: dataset missing" in out
    assert "]@rank" not in out
    # the fixture's error starts in the fixture, not in the hook it passed through
    errors = out.split("= ERRORS =", 1)[1].split("= FAILURES =", 1)[0]
    assert "def broken_dataset():" in errors
    assert "tester.py" not in errors and "return (yield)" not in errors, errors
    # junitxml: one case per test, every rank's failure in it
    cases = result.junit()
    assert set(cases) == {
        "test_itwinai::test_distributed_trainer_mnist[ddp_strategy]",
        "test_itwinai::test_distributed_trainer_mnist[deepspeed_strategy]",
        "test_itwinai::test_dataset",
        "test_itwinai::test_horovod_trainer",
        "test_itwinai::test_data_shard",
    }
    assert cases["test_itwinai::test_data_shard"].find("skipped") is None
    assert [e.get("message", "")[:7] for e in cases["test_itwinai::test_dataset"].findall("error")] == [
        "rank 0:",
        "rank 1:",
    ]
    testsuite = ET.parse(cwd / "junit.xml").find("testsuite")
    assert testsuite is not None
    counts = {k: testsuite.get(k) for k in ("tests", "failures", "errors", "skipped")}
    assert counts == {"tests": "5", "failures": "2", "errors": "1", "skipped": "0"}
    # the rank-log directory from the ini
    assert (cwd / "ranklogs" / name / "rank1.log").is_file()
    assert not (cwd / "logs").exists()
    assert f"output of rank 1: {cwd / 'ranklogs' / name / 'rank1.log'}" in out


# -- outside any launcher --------------------------------------------------------------------------

OUTSIDE = """
import pytest


@pytest.mark.torch_dist
def test_torch():
    pass


@pytest.mark.ray_dist
def test_ray():
    pass


@pytest.mark.hpc
def test_hpc():
    pass


@pytest.mark.launcher("srun", "mpirun")
def test_launcher_only():
    pass


def test_plain():
    pass
"""


@pytest.fixture
def outside(gpu_pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    for name in list(os.environ):
        if name in _DROP or name.startswith(_DROP_PREFIXES):
            monkeypatch.delenv(name)
    gpu_pytester.makepyfile(test_outside=OUTSIDE)
    return gpu_pytester


def test_outside_a_launcher_needs_a_launcher(outside: pytest.Pytester) -> None:
    result = outside.runpytest_inprocess(*NO_CACHE, "--strict-markers", "-rA")
    result.assert_outcomes(passed=2, deselected=3)
    result.stdout.fnmatch_lines_random(
        [
            "pytest-gpu: deselected 1: torch_dist needs a launcher (mpirun or srun or torchrun)",
            "pytest-gpu: deselected 1: hpc needs a launcher (mpirun or srun or torchrun) or -m selecting it",
            "pytest-gpu: deselected 1: launcher(srun, mpirun) needs a launcher (mpirun or srun)",
            "PASSED test_outside.py::test_ray",
            "PASSED test_outside.py::test_plain",
        ]
    )


def test_outside_a_launcher_custom_mapping(outside: pytest.Pytester) -> None:
    outside.makeini("[pytest]\nlauncher_markers =\n    # our own strategy\n    jax_dist: srun\n")
    outside.makepyfile(
        test_jax="import pytest\n\n@pytest.mark.jax_dist\ndef test_jax():\n    pass\n\ndef test_plain():\n    pass\n"
    )
    result = outside.runpytest_inprocess(*NO_CACHE, "--strict-markers", "-rA", "test_jax.py")
    result.assert_outcomes(passed=1, deselected=1)
    result.stdout.fnmatch_lines(["pytest-gpu: deselected 1: jax_dist needs a launcher (srun)"])


def test_outside_a_launcher_hpc_with_m_hpc(outside: pytest.Pytester) -> None:
    outside.makeini("[pytest]\n")
    result = outside.runpytest_inprocess(*NO_CACHE, "-m", "hpc", "-rA")
    result.assert_outcomes(passed=1, deselected=4)
    result.stdout.fnmatch_lines(["PASSED test_outside.py::test_hpc"])
    result.stdout.no_fnmatch_line("*hpc needs*")


# Shaped like itwinai's tests/torch: every distributed test is also marked hpc; its README runs
# `torchrun ... pytest -m torch_dist`, `mpirun ... pytest -m horovod_dist`, `pytest -m ray_dist`.
ITWINAI = """
import pytest


@pytest.mark.hpc
@pytest.mark.torch_dist
@pytest.mark.parametrize("strategy", ["ddp_strategy", "deepspeed_strategy"])
def test_distributed_trainer_mnist(strategy):
    pass


@pytest.mark.hpc
@pytest.mark.horovod_dist
def test_horovod_trainer():
    pass


@pytest.mark.hpc
@pytest.mark.ray_dist
@pytest.mark.parametrize("workers", [1, 2])
def test_ray_trainer(workers):
    pass


@pytest.mark.hpc
def test_hpc_only():
    pass


def test_plain():
    pass
"""
HPC_REASON = "hpc needs a launcher (mpirun or srun or torchrun) or -m selecting it"
TORCH_REASON = "torch_dist needs a launcher (mpirun or srun or torchrun)"
HOROVOD_REASON = "horovod_dist needs a launcher (mpirun or srun)"


@pytest.mark.parametrize(
    ("expression", "passed", "reasons"),
    [
        # no -m: only the plain test; horovod_dist sorts before hpc, so it names the reason
        ("", ["test_plain"], {HPC_REASON: 5, HOROVOD_REASON: 1}),
        # itwinai's README command: the ray tests are selected, though marked hpc too
        ("ray_dist", ["test_ray_trainer[1]", "test_ray_trainer[2]"], {}),
        ("hpc and ray_dist", ["test_ray_trainer[1]", "test_ray_trainer[2]"], {}),
        ("hpc", ["test_ray_trainer[1]", "test_ray_trainer[2]", "test_hpc_only"], {TORCH_REASON: 2, HOROVOD_REASON: 1}),
        ("torch_dist", [], {TORCH_REASON: 2}),
        # "not hpc" is no request for hpc tests (a substring match took it for one): -m removes them
        # itself, and the reasons count only the tests -m kept
        ("not hpc", ["test_plain"], {}),
        # selected for what they lack, not by a marker they carry: the hpc rule stands
        ("not slow", ["test_plain"], {HPC_REASON: 5, HOROVOD_REASON: 1}),
    ],
    ids=["none", "ray_dist", "hpc-and-ray_dist", "hpc", "torch_dist", "not-hpc", "not-slow"],
)
def test_itwinai_markers_outside_a_launcher(
    outside: pytest.Pytester, expression: str, passed: list[str], reasons: dict[str, int]
) -> None:
    outside.makepyfile(test_itwinai=ITWINAI)
    # the project registers its marker: since pytest 9.2, --strict-markers refuses an unregistered name in -m
    outside.makeini("[pytest]\nmarkers =\n    slow: the project's slow tests\n")
    args = ["-m", expression] if expression else []
    result = outside.runpytest_inprocess(*NO_CACHE, "--strict-markers", "-rA", *args, "test_itwinai.py")
    assert sorted(re.findall(r"^PASSED test_itwinai.py::(\S+)", result.stdout.str(), re.M)) == sorted(passed)
    lines = re.findall(r"^pytest-gpu: deselected (\d+): (.*)$", result.stdout.str(), re.M)
    assert {reason: int(n) for n, reason in lines} == reasons
    assert result.ret == (pytest.ExitCode.OK if passed else pytest.ExitCode.NO_TESTS_COLLECTED)


def test_itwinai_markers_under_xdist_reasons_from_the_controller(outside: pytest.Pytester) -> None:
    """xdist workers deselect; the controller, whose terminal is the one shown, prints why."""
    outside.makepyfile(test_itwinai=ITWINAI)
    result = outside.runpytest_subprocess(
        *NO_CACHE, "-n", "2", "-m", "torch_dist", "test_itwinai.py", timeout=patience(120)
    )
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED, result.stdout.str()
    result.stdout.fnmatch_lines(["*2 workers [[]0 items[]]*", f"pytest-gpu: deselected 2: {TORCH_REASON}"])
    result = outside.runpytest_subprocess(*NO_CACHE, "-n", "2", "test_itwinai.py", timeout=patience(120))
    result.assert_outcomes(passed=1)  # the controller hears no deselection from xdist: pytest-gpu's lines say it
    result.stdout.fnmatch_lines_random(
        [f"pytest-gpu: deselected 5: {HPC_REASON}", f"pytest-gpu: deselected 1: {HOROVOD_REASON}"]
    )


def test_hpc_rule_through_launcher_markers(outside: pytest.Pytester) -> None:
    """An ini mapping replaces the defaults, the hpc line with them."""
    outside.makepyfile(test_itwinai=ITWINAI)
    outside.makeini("[pytest]\nlauncher_markers =\n    hpc: torchrun srun mpirun ray\n    ray_dist: ray\n")
    result = outside.runpytest_inprocess(*NO_CACHE, "-rA", "test_itwinai.py")
    # hpc tests run anywhere now; torch_dist and horovod_dist are no longer in the mapping either
    result.assert_outcomes(passed=7)


def test_outside_a_launcher_shard_is_a_usage_error(outside: pytest.Pytester) -> None:
    result = outside.runpytest_inprocess(*NO_CACHE, "--shard")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*--shard: not running under a launcher (srun, mpirun or torchrun), nothing to shard*"]
    )


def test_bad_launcher_markers_are_usage_errors(outside: pytest.Pytester) -> None:
    outside.makeini("[pytest]\nlauncher_markers =\n    torch_dist: torchrun slurm\n")
    result = outside.runpytest_inprocess(*NO_CACHE)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*ini key 'launcher_markers': unknown launcher 'slurm' in*torch_dist: torchrun slurm*"]
    )

    outside.makeini("[pytest]\n")
    outside.makepyfile(
        test_bad="import pytest\n\n@pytest.mark.launcher('torchrun', 'pbs')\ndef test_pbs():\n    pass\n"
    )
    result = outside.runpytest_inprocess(*NO_CACHE, "test_bad.py")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_bad.py::test_pbs: launcher marker: unknown launcher 'pbs'*"])


# -- tracebacks: no pytest-gpu frame where it only passed an error through -------------------------

FIXTURE_ERRORS = """
import pytest


@pytest.fixture
def broken():
    raise RuntimeError("setup broke")


@pytest.fixture(scope="module")
def broken_module():
    raise RuntimeError("module setup broke")


@pytest.fixture
def broken_teardown():
    yield
    raise RuntimeError("teardown broke")
"""

FIXTURE_TESTS = """
import pytest


def test_setup(broken):
    pass


@pytest.mark.gpu(memory="1GiB")
def test_gpu_setup(broken):
    pass


def test_module(broken_module):
    pass


def test_teardown(broken_teardown):
    pass
"""


@pytest.mark.parametrize("workers", ["0", "2"])
def test_fixture_errors_have_no_pytest_gpu_frames(outside: pytest.Pytester, workers: str) -> None:
    outside.makeconftest(FIXTURE_ERRORS)  # the fixtures in another file than the tests: nothing cuts the traceback
    outside.makepyfile(test_fixtures=FIXTURE_TESTS)
    args = (*NO_CACHE, "--gpus", "sim:1x16GiB", "-n", workers, "test_fixtures.py")
    run = outside.runpytest_subprocess if workers != "0" else outside.runpytest_inprocess
    result = run(*args)
    result.assert_outcomes(passed=1, errors=4)
    out = result.stdout.str()
    for message in ("setup broke", "module setup broke", "teardown broke"):
        assert f"E       RuntimeError: {message}" in out
    assert "/pytest_gpu/" not in out and "return (yield)" not in out, out


# -- shard mode: the suite split over the ranks --------------------------------------------------


def share_spread(out: str) -> int:
    match = re.search(r"share durations: rank 0: .* \(spread (\d+)% of the mean\)", out)
    assert match, out
    return int(match.group(1))


@pytest.mark.slow
def test_shard_under_srun(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    launcher = Launcher("srun", request)
    cwd = suite(tmp_path, test_sharded=SHARDED)
    expected = {f"test_sharded::test_sleep[{i:02d}]" for i in range(60)}
    spreads = []
    for attempt in (1, 2):  # the first run records the durations (pytest's cache), the second uses them
        result = launcher.run(cwd, 3, "--shard", f"--junitxml=junit{attempt}.xml")
        out = result.stdout
        assert result.returncode == 0, result.terminal
        assert result.exit_statuses(3) == ["0", "0", "0"]
        assert "pytest-gpu: 3 shards under srun" in out
        assert re.search(r"=+ 60 passed in ", out), out
        cases = result.junit(f"junit{attempt}.xml")  # fails on a test reported twice
        assert set(cases) == expected
        assert all(case.find("failure") is None and case.find("skipped") is None for case in cases.values())
        spreads.append(share_spread(out))
        if attempt == 1:  # no history: count-balanced
            assert "rank 0 ran 20 of 60 tests; the other shares came from ranks 1+" in out
    assert (cwd / ".pytest_cache").is_dir()
    # without history rank 0 got all the long tests; with it the shares are balanced
    assert spreads[0] > 25, spreads
    assert spreads[1] <= 25, spreads


@pytest.mark.slow
def test_shard_with_xdist_workers_under_srun(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """The docs' recipe (docs/launchers.md): each rank runs its share with its own xdist workers."""
    launcher = Launcher("srun", request)
    source = SHARDED.replace("range(60)", "range(12)").replace("time.sleep(seconds(i))", "time.sleep(0.02)")
    cwd = suite(tmp_path, test_sharded=source)
    result = launcher.run(cwd, 2, *NO_CACHE, "--shard", "-n", "2", "--junitxml=junit.xml")
    out = result.stdout

    assert result.returncode == 0, result.terminal
    assert "pytest-gpu: 2 shards under srun" in out
    assert "2 workers [6 items]" in out  # rank 0's share, over its own workers
    assert re.search(r"=+ 12 passed in ", out), out
    assert set(result.junit()) == {f"test_sharded::test_sleep[{i:02d}]" for i in range(12)}
    assert "2 workers [6 items]" in (cwd / "logs" / "srun" / "rank1.log").read_text()
