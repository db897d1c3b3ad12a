"""Shared test helpers.

Tests that need an optional component (torch, Open MPI, SLURM, Ray, ...) call
``require("name")``: when it is absent the test is skipped with the reason
``missing component: name``. `.ci/run` installs every component and fails the build if
any test is skipped with that reason.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

pytest_plugins = ["pytester"]

MISSING = "missing component"


def require(component: str, *, module: str | None = None, executable: str | None = None) -> None:
    """Skip the calling test unless ``module`` imports / ``executable`` is on PATH."""
    if module is not None and importlib.util.find_spec(module) is None:
        pytest.skip(f"{MISSING}: {component} (python module {module!r} not installed)")
    if executable is not None and shutil.which(executable) is None:
        pytest.skip(f"{MISSING}: {component} ({executable!r} not on PATH)")


# -- end-to-end runs of the plugin through pytester ----------------------------------

# Inner pytest runs: no cache files in the test directory, and no unrelated plugins
# (their start-up cost is paid by every xdist worker).
# pytest-depends reorders collected tests, pytest-randomly shuffles them: only the tests of
# their compatibility turn them on.
INNER_ARGS = (
    "-p",
    "no:cacheprovider",
    "-p",
    "no:benchmark",
    "-p",
    "no:hypothesispytest",
    "-p",
    "no:depends",
    "-p",
    "no:randomly",
)
_OUTER_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "PYTEST_ADDOPTS")
# pytester points HOME at each test's directory; the fake libnvidia-ml.so.1 is built once
# per cache directory, so inner runs share the user's (as real runs would)
_CACHE = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")


MACHINE_DIR_ENV = "PYTEST_GPU_MACHINE_DIR"


@pytest.fixture(autouse=True)
def private_machines(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test its own machine directory: the runs it starts (in-process, subprocesses,
    xdist) meet only each other, and its simulated machines are its own, never a concurrent
    test's (this suite runs under xdist) nor a developer's real runs'.

    Simulated machines stay one per spec (``PYTEST_GPU_SIM_MACHINE`` is left unset): two runs
    of one test on different specs are two machines, as they are for a user.
    """
    path = tmp_path_factory.mktemp("machines")
    monkeypatch.setenv(MACHINE_DIR_ENV, str(path))
    monkeypatch.delenv("PYTEST_GPU_SIM_MACHINE", raising=False)
    return path


@pytest.fixture
def gpu_pytester(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, private_machines: Path) -> pytest.Pytester:
    """``pytester`` with an environment free of GPU selection and pytest-gpu variables.

    An inner run must not inherit a lease (or a simulated ledger) from the run that
    executes this test suite; it meets other runs in this test's own machine directory.
    """
    for name in list(os.environ):
        if name in _OUTER_VARS or name.startswith("PYTEST_GPU_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv(MACHINE_DIR_ENV, str(private_machines))
    monkeypatch.setenv("XDG_CACHE_HOME", _CACHE)
    return pytester


@pytest.fixture
def run_inner(gpu_pytester: pytest.Pytester) -> Callable[..., pytest.RunResult]:
    """``run_inner(*args, subprocess=False, timeout=120)``: pytest on ``gpu_pytester``'s files.

    In-process by default; ``subprocess=True`` for anything with ``-n`` (xdist needs
    real processes) or that must start from a fresh interpreter.
    """

    def run(*args: str, subprocess: bool = False, timeout: float = 120) -> pytest.RunResult:
        full = (*INNER_ARGS, *args)
        if subprocess:
            return gpu_pytester.runpytest_subprocess(*full, timeout=timeout)
        return gpu_pytester.runpytest_inprocess(*full)

    return run


# -- foreign processes on simulated GPUs -------------------------------------------------


class Holder:
    """A process outside any pytest run holding simulated GPU memory (``python -m pytest_gpu.sim hold``)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pytest_gpu.sim", "hold", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("holding "):
            _, err = self.proc.communicate(timeout=30)
            raise AssertionError(f"hold {' '.join(args)} did not start (exit {self.proc.returncode}): {line}{err}")
        self.pid = int(line.split()[1])
        assert self.pid == self.proc.pid

    def kill(self, *, reap: bool = True) -> None:
        """SIGKILL it (the driver, and the ledger, free what it held); ``reap=False`` leaves a zombie."""
        self.proc.kill()
        if reap:
            self.proc.wait(timeout=30)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate(timeout=30)


@pytest.fixture
def hold() -> Iterator[Callable[..., Holder]]:
    """``hold("--machine", name, "--spec", spec, "--gpu", "1", "--memory", "1GiB")``: a
    :class:`Holder`, killed at the end of the test."""
    made: list[Holder] = []

    def start(*args: str, env: dict[str, str] | None = None) -> Holder:
        holder = Holder(*args, env=env)
        made.append(holder)
        return holder

    yield start
    for holder in made:
        holder.close()


# -- a one-node SLURM cluster, shared by every test of the session that needs one ---------

SLURM_SCRIPT = Path(__file__).parent / "tools" / "slurm-single-node.sh"


@pytest.fixture(scope="session")
def slurm() -> Iterator[str]:
    """A one-node SLURM cluster (fake gpu:4, 8 CPUs) for this session; yields its SLURM_CONF.

    Started once from this project's own ``tests/tools/slurm-single-node.sh`` (one cluster
    per machine: its daemons listen on SLURM's fixed ports) and stopped at the end.
    """
    require("SLURM", executable="slurmctld")
    require("SLURM", executable="srun")
    if os.geteuid() != 0:
        pytest.skip("the single-node SLURM cluster needs root (munge, slurmd)")
    # Not under pytest's basetemp: that is 0700, and munged runs as the munge user.
    base = Path(tempfile.mkdtemp(prefix="pytest-gpu-slurm-"))
    base.chmod(0o755)
    try:
        started = subprocess.run(
            ["bash", str(SLURM_SCRIPT), "start", str(base), "4", "8"], capture_output=True, text=True, timeout=90
        )
        others = [
            f"{p.pid}: {' '.join(p.info['cmdline'] or ())}"
            for p in psutil.process_iter(["name", "cmdline"])
            if p.info["name"] == "slurmctld" and str(base) not in " ".join(p.info["cmdline"] or ())
        ]
        assert started.returncode == 0, f"SLURM did not start:\n{started.stdout}\n{started.stderr}" + (
            f"another SLURM cluster runs on this machine (its ports are taken): {others}" if others else ""
        )
        conf = str(base / "slurm.conf")
        assert f"export SLURM_CONF={conf}" in started.stdout
        yield conf
    finally:
        daemons = []
        for name in ("slurmd", "ctld", "munged"):
            try:
                daemons.append(psutil.Process(int((base / f"{name}.bgpid").read_text())))
            except (OSError, ValueError, psutil.Error):
                pass
        subprocess.run(["bash", str(SLURM_SCRIPT), "stop", str(base)], timeout=60, check=False)
        _, alive = psutil.wait_procs(daemons, timeout=10)
        for proc in alive:  # a daemon that ignored SIGTERM
            proc.kill()
        shutil.rmtree(base, ignore_errors=True)
