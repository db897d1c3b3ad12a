"""Rank pools started ahead (issue 33, item 2): a test process starts the pool of the next
test it holds while the test before it runs, so that test finds its pool warm (a
distributed test's, and an isolated test's one-rank pool), within ``--dist-pool-ahead``
rank processes, never by waiting for GPUs; the summary says how much start-up was hidden;
a run that ends before such a pool is used leaves no rank behind.

Inner runs write every report the controller sees as a JSON line (``REPORTER``)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from conftest import require
from helpers import patience
from pytest_gpu.base.distspec import DistSpec, isolated_spec
from pytest_gpu.base.requests import GpuRequest
from pytest_gpu.distributed.runner import AHEAD_PROPERTY, AHEAD_WAITED_PROPERTY, ahead_refusal

Run = Callable[..., pytest.RunResult]
GiB = 2**30

REPORTER = """
import json
import os

WORKER = []  # an xdist worker of this run (not of a run around it, whose variables it inherits)

def pytest_configure(config):
    WORKER.append(hasattr(config, "workerinput"))

def pytest_runtest_logreport(report):
    if WORKER[-1] or report.when != "call":
        return
    node = getattr(report, "node", None)
    record = {
        "nodeid": report.nodeid,
        "outcome": report.outcome,
        "worker": str(node.gateway.id) if node is not None else "main",
        "props": dict(report.user_properties),
    }
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "reports.jsonl"), "a") as fh:
        fh.write(json.dumps(record, default=str) + "\\n")
"""

# each pool test comes after a CPU test long enough for its pool to start meanwhile; under
# -n 2 each worker is handed a CPU test and, with it, the pool test it runs next
SUITE = """
import time

import pytest

@pytest.mark.parametrize("n", range(2))
def test_a_cpu(n):
    time.sleep(4)

@pytest.mark.distributed(world_size=2, backend="gloo")
def test_b_distributed(rank):
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2

@pytest.mark.gpu(memory="1GiB", isolate=True)
def test_c_isolated():
    import torch

    assert torch.cuda.device_count() == 1
"""


def reports(path: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for line in (path / "reports.jsonl").read_text().splitlines():
        row = json.loads(line)
        out[row["nodeid"].split("::")[-1]] = row
    return out


def test_the_first_test_of_a_pool_finds_it_started_ahead_under_xdist(gpu_pytester: pytest.Pytester, run_inner: Run):
    """Without the change each pool starts when its first test asks for it: no test says it
    found its pool started ahead, and the summary says nothing of it."""
    require("torch", module="torch")
    gpu_pytester.makeconftest(REPORTER)
    gpu_pytester.makepyfile(test_ahead=SUITE)
    result = run_inner("--gpus", "sim:2x16GiB", "-n", "2", "-p", "no:randomly", subprocess=True, timeout=240)
    result.assert_outcomes(passed=4)
    recs = reports(gpu_pytester.path)
    for name in ("test_b_distributed", "test_c_isolated"):
        props = recs[name]["props"]
        assert AHEAD_PROPERTY in props, (name, recs)
        assert props["dist_pool"] == "fresh"  # started for it, ahead of it
        # the CPU test before it took 4 s: its pool's start (or 4 s of it) was hidden behind it (the
        # rest, on a loaded machine, it waited for: the start under way, never a second one); a
        # one-rank pool starts in ~0.15 s (an interpreter, pytest's config without plugins)
        assert props[AHEAD_PROPERTY] > 0.05, (name, props)
        assert props[AHEAD_WAITED_PROPERTY] >= 0, (name, props)
    line = [ln for ln in result.outlines if "rank pools:" in ln]
    assert line and "2 started ahead" in line[0], result.stdout.str()


LONE = """
import time

import pytest

def test_a_cpu():
    time.sleep(3)

@pytest.mark.distributed(world_size=2, backend="gloo")
def test_b_distributed(rank):
    assert rank.world_size == 2

def test_c_cpu():
    time.sleep(3)

@pytest.mark.gpu(memory="1GiB", isolate=True)
def test_d_isolated():
    pass
"""


def test_the_budget_keeps_a_pool_too_large_from_starting_ahead(gpu_pytester: pytest.Pytester, run_inner: Run):
    """``--dist-pool-ahead=1``: the two-rank pool starts with its test, the isolated test's
    one-rank pool ahead of it (pytest without -n: the test it runs next)."""
    gpu_pytester.makeconftest(REPORTER)
    gpu_pytester.makepyfile(test_lone=LONE)
    result = run_inner("--gpus", "sim:1x16GiB", "-p", "no:randomly", "--dist-pool-ahead=1")
    result.assert_outcomes(passed=4)
    recs = reports(gpu_pytester.path)
    assert AHEAD_PROPERTY not in recs["test_b_distributed"]["props"], recs
    assert AHEAD_PROPERTY in recs["test_d_isolated"]["props"], recs
    assert "rank pools: 1 started ahead" in result.stdout.str()


def test_a_bad_budget_is_refused(gpu_pytester: pytest.Pytester, run_inner: Run):
    gpu_pytester.makepyfile(test_x="def test_x():\n    pass\n")
    result = run_inner("--dist-pool-ahead=-2")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--dist-pool-ahead: expected a whole number of rank processes*'-2'*"])


HELD = """
import time

import pytest

@pytest.mark.gpu(memory="1GiB", exclusive=True)
def test_a_holds_the_gpu():
    time.sleep(2)

@pytest.mark.gpu(memory="1GiB", isolate=True)
def test_b_isolated():
    pass
"""


def test_a_pool_is_never_started_ahead_by_waiting_for_its_gpus(gpu_pytester: pytest.Pytester, run_inner: Run):
    """The only GPU is the test's before it (exclusive): the isolated test's pool would wait
    for it, so none is started ahead (its lease is withdrawn, nothing waits): the test starts
    its own once the GPU is free, and the run is not held up."""
    gpu_pytester.makeconftest(REPORTER)
    gpu_pytester.makepyfile(test_held=HELD)
    started = time.monotonic()
    result = run_inner("--gpus", "sim:1x16GiB", "-p", "no:randomly", "--gpu-wait-timeout=20")
    result.assert_outcomes(passed=2)
    assert time.monotonic() - started < patience(15), result.stdout.str()
    assert AHEAD_PROPERTY not in reports(gpu_pytester.path)["test_b_isolated"]["props"]


def test_why_a_pool_is_not_started_ahead() -> None:
    two = DistSpec(world_size=2, backend="gloo", gpus_per_rank=0, launcher="spawn")
    assert ahead_refusal(two, 4, holds_gpus=False, waiting=True) is None  # gloo on CPUs takes no GPU
    assert ahead_refusal(two, 1, holds_gpus=False, waiting=False) == "its 2 ranks exceed --dist-pool-ahead=1"
    assert ahead_refusal(two, 0, holds_gpus=False, waiting=False) is not None
    one = isolated_spec(GpuRequest(count=1, memory=GiB, exclusive=False))
    assert ahead_refusal(one, 4, holds_gpus=True, waiting=False) is None
    assert ahead_refusal(one, 4, holds_gpus=True, waiting=True) == "tests wait for GPUs"


# the CPU test waits until the next test's pool (started ahead) has its ranks, writes their
# pids, then the run ends: by Ctrl-C (SIGINT to itself), or by -x after it fails
ENDS = """
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

HOW = {how!r}

def test_a_cpu():
    me = psutil.Process()
    deadline = time.monotonic() + 60
    ranks = []
    while len(ranks) < 2 and time.monotonic() < deadline:
        ranks = [p for p in me.children(recursive=True) if "rankmain" in " ".join(p.cmdline())]
        time.sleep(0.05)
    Path(__file__).with_name("ranks").write_text(" ".join(str(p.pid) for p in ranks))
    if HOW == "ctrl-c":
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)
    assert False, "the run ends here (-x)"

@pytest.mark.distributed(world_size=2, backend="gloo")
def test_b_distributed(rank):
    pass
"""


# the run itself ends them, before its process exits (not only their lifeline, after it)
ENDS_CONFTEST = """
import time
from pathlib import Path

import psutil
import pytest

@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    ranks = Path(__file__).with_name("ranks")
    pids = [int(p) for p in ranks.read_text().split()] if ranks.exists() else []
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.05)
    Path(__file__).with_name("alive").write_text(" ".join(map(str, alive)))
"""


@pytest.mark.parametrize("how", ["ctrl-c", "-x"])
def test_a_run_that_ends_before_its_pool_is_used_leaves_no_rank_behind(
    gpu_pytester: pytest.Pytester, run_inner: Run, how: str
) -> None:
    gpu_pytester.makeconftest(ENDS_CONFTEST)
    gpu_pytester.makepyfile(test_ends=ENDS.format(how=how))
    result = run_inner("--gpus", "none", "-p", "no:randomly", "-x", subprocess=True, timeout=120)
    assert result.ret in (pytest.ExitCode.INTERRUPTED, pytest.ExitCode.TESTS_FAILED), result.stdout.str()
    pids = [int(p) for p in (gpu_pytester.path / "ranks").read_text().split()]
    assert len(pids) == 2, result.stdout.str()  # the pool had started ahead: its ranks were there
    deadline = time.monotonic() + patience(10)
    left = pids
    while left and time.monotonic() < deadline:
        left = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.1)
    assert not left, f"rank processes {left} outlived the run\n{result.stdout.str()}"
    alive = (gpu_pytester.path / "alive").read_text()
    assert not alive, f"rank processes {alive} were left to their lifeline\n{result.stdout.str()}"
