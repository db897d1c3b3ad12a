"""Rank pools started by real launchers: mpirun (backend "mpi", mpi4py), torchrun, and srun.

Each test is one inner pytest run in a subprocess. The srun test runs against a
one-node SLURM cluster started for the session from this project's own copy of
``tests/tools/slurm-single-node.sh``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
import xml.etree.ElementTree as ET

import pytest

from conftest import require
from helpers import patience, rank_processes

MARK_VAR = "DIST_TEST_RUN_MARK"
INNER_ARGS = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "no:benchmark", "-rA")


class Launch:
    """One inner run: its files, a unique marker in its environment, its junitxml."""

    def __init__(self, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
        self.pytester = pytester
        self.mark = uuid.uuid4().hex
        for name in list(os.environ):
            if name.startswith(("PYTEST_GPU_", "PYTEST_XDIST_")) or name in ("PYTEST_ADDOPTS", "CUDA_VISIBLE_DEVICES"):
                monkeypatch.delenv(name)
        monkeypatch.setenv(MARK_VAR, self.mark)
        self.junit = pytester.path / "junit.xml"

    def run(self, source: str, timeout: float = 180) -> pytest.RunResult:
        self.pytester.makeini("[pytest]\n")
        self.pytester.makepyfile(test_launch=source)
        return self.pytester.runpytest_subprocess(*INNER_ARGS, f"--junitxml={self.junit}", timeout=patience(timeout))

    def props(self) -> dict[str, dict[str, str]]:
        return {
            str(case.get("name")): {p.get("name", ""): p.get("value", "") for p in case.iter("property")}
            for case in ET.parse(self.junit).iter("testcase")
        }


@pytest.fixture
def launch(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Launch:
    return Launch(pytester, monkeypatch)


# -- mpirun + mpi4py ----------------------------------------------------------------------------

MPI_SUITE = """
import os

import pytest

MPI2 = pytest.mark.distributed(world_size=2, backend="mpi")


@MPI2
def test_allreduce_on_the_communicator(rank):
    from mpi4py import MPI

    comm = rank.group
    assert comm is MPI.COMM_WORLD
    assert (comm.Get_size(), comm.Get_rank()) == (2, rank.rank)
    assert (rank.backend, rank.world_size, rank.local_rank) == ("mpi", 2, rank.rank)
    assert "OMPI_COMM_WORLD_RANK" in os.environ
    assert os.environ["DIST_TEST_RUN_MARK"]  # what the orphan check looks for
    assert comm.allreduce(rank.rank + 1) == 3


@MPI2
def test_warm_world(rank):
    assert rank.group.allreduce(10 * (rank.rank + 1)) == 30


@MPI2
def test_fails_on_rank_1(rank):
    total = rank.group.allreduce(1)
    assert total + rank.rank == 2
"""


def test_mpi_backend_through_mpirun(launch: Launch) -> None:
    require("MPI", module="mpi4py", executable="mpirun")
    result = launch.run(MPI_SUITE)
    result.assert_outcomes(passed=2, failed=1)
    props = launch.props()
    assert [props[n]["dist_pool"] for n in ("test_allreduce_on_the_communicator", "test_warm_world")] == [
        "fresh",
        "warm",
    ]
    text = result.stdout.str()
    assert "distributed test failed on 1 of 2 ranks (2 ranks (mpi via mpirun))" in text
    assert "E       AssertionError: assert (2 + 1) == 2" in text
    assert "=== rank 0 ===" not in text
    assert rank_processes(MARK_VAR, launch.mark) == []


# -- torchrun ---------------------------------------------------------------------------------------

TORCHRUN_SUITE = """
import os

import pytest

TR2 = pytest.mark.distributed(world_size=2, launcher="torchrun")


@TR2
def test_allreduce_under_torchrun(rank):
    import torch
    import torch.distributed as dist

    assert "TORCHELASTIC_RUN_ID" in os.environ  # started by torchrun, not by the plugin
    assert os.environ["DIST_TEST_RUN_MARK"]  # what the orphan check looks for
    assert (os.environ["RANK"], os.environ["LOCAL_RANK"]) == (str(rank.rank), str(rank.local_rank))
    assert (rank.backend, rank.world_size) == ("gloo", 2)
    t = torch.ones(1) * (rank.rank + 1)
    dist.all_reduce(t)
    assert t.item() == 3


@TR2
def test_warm_under_torchrun(rank):
    import torch.distributed as dist

    assert dist.get_world_size() == 2
"""


def test_torchrun_launcher_with_gloo(launch: Launch) -> None:
    require("torch", module="torch")
    result = launch.run(TORCHRUN_SUITE)
    result.assert_outcomes(passed=2)
    props = launch.props()
    assert props["test_allreduce_under_torchrun"]["dist_pool"] == "fresh"
    assert props["test_warm_under_torchrun"]["dist_pool"] == "warm"
    assert rank_processes(MARK_VAR, launch.mark) == []


# -- srun on a one-node SLURM cluster -----------------------------------------------------------------


SRUN_SUITE = """
import os
import time

import pytest


@pytest.mark.distributed(world_size=2, launcher="srun")
def test_allreduce_under_srun(rank):
    import torch
    import torch.distributed as dist

    assert os.environ["SLURM_PROCID"] == str(rank.rank)
    assert os.environ["SLURM_NTASKS"] == "2"
    assert os.environ["DIST_TEST_RUN_MARK"]  # what the orphan check looks for
    t = torch.ones(1) * (rank.rank + 1)
    dist.all_reduce(t)
    assert t.item() == 3


@pytest.mark.distributed(world_size=2, launcher="srun")
def test_warm_under_srun(rank):
    assert os.environ["SLURM_PROCID"] == str(rank.rank)


@pytest.mark.distributed(world_size=2, launcher="srun", timeout=3)
def test_hangs_under_srun(rank):
    time.sleep(120)
"""


def test_srun_launcher(launch: Launch, slurm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    require("torch", module="torch")
    monkeypatch.setenv("SLURM_CONF", slurm)
    for name in list(os.environ):  # srun must make its own allocation, not join an outer one
        if name.startswith("SLURM_") and name != "SLURM_CONF":
            monkeypatch.delenv(name)
    result = launch.run(SRUN_SUITE)
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*ranks 0 and 1 did not finish within its timeout (3s)*"])
    props = launch.props()
    assert props["test_allreduce_under_srun"]["dist_pool"] == "fresh"
    assert props["test_warm_under_srun"]["dist_pool"] == "warm"
    assert rank_processes(MARK_VAR, launch.mark) == []
    squeue = shutil.which("squeue")
    if squeue is not None:  # the pools' jobs ended with them (a SIGKILLed srun would leave its job running)
        deadline = time.monotonic() + patience(10)
        while (jobs := subprocess.run([squeue, "-h"], capture_output=True, text=True).stdout.strip()) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.2)
        assert jobs == ""
