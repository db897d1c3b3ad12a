"""How a pool's rank processes are started: one class per ``launcher=`` of the marker.

A launcher object belongs to one pool (:mod:`.pool`) and owns the processes it starts:
whether it can run here (its executable on PATH), their command lines and environments,
their process group, what became of a rank that is gone, and how they are all killed.
The pool never asks which launcher it has.

``spawn`` starts every rank itself and sees each one's exit status; ``torchrun``,
``mpirun`` and ``srun`` are started once and start the ranks, whose exit status only
they see.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import psutil

from ..base.distspec import DistSpec
from ..base.procs import kill_and_wait

RANK_MODULE = "pytest_gpu.distributed.rankmain"
# What a rank reads to learn its place, set by the pool's own launcher (spawn) or by the
# ranks' launcher: never inherited from a pytest run that is itself a rank of something.
LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "PYTEST_GPU_RANK",
    "PYTEST_GPU_WORLD_SIZE",
    "CUDA_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "GPU_DEVICE_ORDINAL",
    "PYTEST_GPU_RANK_VENDOR",
    "PYTEST_GPU_SIM_TAG",
)

Process = tuple[list[str], dict[str, str]]  # a command line and its environment


def exit_text(code: int | None) -> str:
    """A process's exit status in words: "exit code 1", "killed by SIGKILL (exit -9)"."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name} (exit {code})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def join_group(pgid: int) -> dict[str, Any]:
    """Popen arguments that put the child in process group ``pgid`` (0: a new group of its own).

    Ranks get a group of their own (so ``killpg`` takes them and their children) but stay
    in pytest's session, since a process can only join a group of its own session.
    """
    if sys.version_info >= (3, 11):
        return {"process_group": pgid}
    return {"preexec_fn": lambda: os.setpgid(0, pgid)}  # pragma: no cover - Python 3.10


class Launcher:
    """Starts the rank processes of one pool, for ``spec``, and ends them."""

    name: ClassVar[str]
    process: ClassVar[str | None] = None  # what it starts, in "<process> ended" (None: its name)

    def __init__(self, spec: DistSpec) -> None:
        self.spec = spec
        self.procs: list[subprocess.Popen[bytes]] = []  # what it started, in order
        self.pgid: int | None = None  # their process group: the first one's pid

    def unavailable(self) -> str | None:
        """Why this launcher cannot run here (the pool's error), or None."""
        return None

    def environment(self, pool_env: Mapping[str, str], port: int) -> dict[str, str]:
        """Every rank's environment: this process's but :data:`LAUNCH_VARS`, the rendezvous, ``pool_env``."""
        env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
        env.update(pool_env)
        return env

    def processes(self, pool_env: Mapping[str, str], port: int) -> list[Process]:
        """What the pool starts, in order; ``pool_env``: the pool's variables, ``port``: the rendezvous port."""
        raise NotImplementedError

    def start(self, pool_env: Mapping[str, str], port: int, log: Path) -> None:
        """Start :meth:`processes` in a process group of their own, their output appended to ``log``."""
        with open(log, "ab") as out:
            for argv, proc_env in self.processes(pool_env, port):
                proc = subprocess.Popen(
                    argv, env=proc_env, stdin=subprocess.DEVNULL, stdout=out, stderr=out, **join_group(self.pgid or 0)
                )
                self.procs.append(proc)  # at once: a later Popen that fails must not leave this one running
                if self.pgid is None:
                    self.pgid = proc.pid

    def ended(self) -> str | None:
        """Which process it started has ended, and how (None: every one still runs)."""
        dead = [p for p in self.procs if p.poll() is not None]
        return f"{self.process or self.name} ended: {exit_text(dead[0].returncode)}" if dead else None

    def exit_of(self, rank: int, pid: int | None) -> str:
        """What became of ``rank`` (pid ``pid``), found gone."""
        return f"pid {pid} is gone (launched by {self.name}; exit status not visible)"

    def kill(self, pids: Iterable[int]) -> None:
        """SIGKILL what it started, the ranks ``pids`` and all their children, and reap them."""
        self._before_kill()
        victims: list[psutil.Process] = []
        for pid in [*pids, *(p.pid for p in self.procs)]:
            try:
                proc = psutil.Process(pid)
                victims += [proc, *proc.children(recursive=True)]
            except psutil.Error:
                pass
        if self.pgid is not None:
            try:
                os.killpg(self.pgid, signal.SIGKILL)
            except OSError:
                pass
        kill_and_wait(victims)
        for popen in self.procs:
            try:
                popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def _before_kill(self) -> None:
        """What must happen before its processes are SIGKILLed."""


class Spawn(Launcher):
    """The pool starts each rank itself, numbered through the variables torch reads."""

    name = "spawn"
    process = "a rank process"

    def processes(self, pool_env: Mapping[str, str], port: int) -> list[Process]:
        env = self.environment(pool_env, port)
        ws = str(self.spec.world_size)
        started = []
        for r in range(self.spec.world_size):
            rank_env = dict(env, PYTEST_GPU_RANK=str(r), PYTEST_GPU_WORLD_SIZE=ws)
            rank_env.update(RANK=str(r), WORLD_SIZE=ws, LOCAL_RANK=str(r))
            started.append(([sys.executable, "-m", RANK_MODULE], rank_env))
        return started

    def exit_of(self, rank: int, pid: int | None) -> str:
        if rank >= len(self.procs):
            return super().exit_of(rank, pid)
        proc = self.procs[rank]  # rank r is the r-th process it started
        try:
            proc.wait(timeout=2)  # a rank whose connection just closed may not have exited yet
        except subprocess.TimeoutExpired:
            pass
        return exit_text(proc.returncode)


class External(Launcher):
    """A launcher program, started once, that starts the ranks."""

    executable: ClassVar[str | None] = None  # looked up on PATH (None: nothing to look up)
    needs: ClassVar[str] = ""  # what the error says it needs, when PATH lacks the executable

    def unavailable(self) -> str | None:
        if self.executable is not None and shutil.which(self.executable) is None:
            return f"launcher {self.name!r} needs {self.needs}"
        return None

    def command(self, port: int) -> list[str]:
        raise NotImplementedError

    def environment(self, pool_env: Mapping[str, str], port: int) -> dict[str, str]:
        env = super().environment(pool_env, port)
        # Open MPI may be under any of them (backend "mpi" with srun): more ranks than cores is fine in a test
        env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
        return env

    def processes(self, pool_env: Mapping[str, str], port: int) -> list[Process]:
        return [(self.command(port), self.environment(pool_env, port))]

    def _which(self) -> str:
        exe = shutil.which(self.executable or "")
        if exe is None:  # the pool asks unavailable() first
            raise RuntimeError(self.unavailable())
        return exe


class Torchrun(External):
    """``python -m torch.distributed.run``: torch's elastic agent, on this node only."""

    name = "torchrun"  # a module of torch, run by this Python: no executable to look for

    def command(self, port: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={self.spec.world_size}",
            "--nnodes=1",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            "-m",
            RANK_MODULE,
        ]


class Mpirun(External):
    """An MPI's ``mpirun`` (backend "mpi": the ranks share its ``MPI.COMM_WORLD``)."""

    name = "mpirun"
    executable = "mpirun"
    needs = "an MPI's mpirun on PATH (e.g. apt-get install openmpi-bin)"

    def command(self, port: int) -> list[str]:
        return [self._which(), "-n", str(self.spec.world_size), sys.executable, "-m", RANK_MODULE]

    def environment(self, pool_env: Mapping[str, str], port: int) -> dict[str, str]:
        env = super().environment(pool_env, port)
        if os.geteuid() == 0:  # Open MPI refuses root unless told twice; a container's CI often is root
            env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
            env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        return env


class Srun(External):
    """SLURM's ``srun``: one job step of ``world_size`` tasks on one node."""

    name = "srun"
    executable = "srun"
    needs = "SLURM's srun on PATH, inside an allocation"

    def command(self, port: int) -> list[str]:
        ws = self.spec.world_size
        return [self._which(), f"--ntasks={ws}", "--nodes=1", "--kill-on-bad-exit=1", sys.executable, "-m", RANK_MODULE]

    def _before_kill(self) -> None:
        # srun gives its job allocation back only when it exits by itself: a SIGKILLed srun
        # leaves the SLURM job running (holding its CPUs and GPUs). SIGTERM makes it end the
        # step (its tasks get the signal) and release the allocation.
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


BY_NAME: dict[str, type[Launcher]] = {cls.name: cls for cls in (Spawn, Torchrun, Mpirun, Srun)}


def launcher_for(spec: DistSpec) -> Launcher:
    """The launcher ``spec`` names (one of :data:`.spec.LAUNCHERS`)."""
    return BY_NAME[spec.launcher](spec)
