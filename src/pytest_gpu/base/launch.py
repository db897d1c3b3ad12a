"""Is this pytest one rank of a launcher? Read from the environment only (pure)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

DISABLE_ENV = "PYTEST_GPU_LAUNCHER"  # "none" turns detection off


@dataclass(frozen=True)
class LaunchContext:
    """Which launcher started this process, and this process's place in it."""

    launcher: str  # "torchrun", "srun" or "mpirun" (Open MPI, or any PMI/PMIx launcher)
    rank: int
    world_size: int
    local_rank: int
    run_id: str  # the same on every rank of one launch, different between launches
    local_size: int = 1  # ranks on this node (they share its GPUs)

    @property
    def is_root(self) -> bool:
        return self.rank == 0


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "").strip()
    return int(value) if value.isdigit() else None


def _slurm_local_size(env: Mapping[str, str]) -> int | None:
    """Tasks of this step on this node, from ``SLURM_STEP_TASKS_PER_NODE`` ("2(x3),1") and ``SLURM_NODEID``."""
    per_node: list[int] = []
    for part in env.get("SLURM_STEP_TASKS_PER_NODE", "").split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            return None
        per_node += [int(match.group(1))] * int(match.group(2) or 1)
    node = _int(env, "SLURM_NODEID") or 0
    return per_node[node] if node < len(per_node) else None


def _context(
    launcher: str, rank: int, size: int, local: int | None, local_size: int | None, run_id: str
) -> LaunchContext:
    if local is None:
        local = rank
    # a node's size unknown (or inconsistent): the whole world, which may make GPU shares too small, never overlap
    if not local_size or local >= local_size:
        local_size = max(size, local + 1)
    return LaunchContext(launcher, rank, size, local, _safe(run_id), local_size)


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)[:80] or "run"


def detect(environ: Mapping[str, str] | None = None) -> LaunchContext | None:
    """The launch this process is part of, or ``None`` outside any launcher.

    Checked in this order, since launchers nest (torchrun inside an srun step):
    torchrun (``TORCHELASTIC_RUN_ID`` with ``RANK``/``WORLD_SIZE``), Open MPI
    (``OMPI_COMM_WORLD_RANK``/``SIZE``), SLURM (``SLURM_PROCID``/``SLURM_NTASKS`` inside
    an ``srun`` step), PMI/PMIx (``PMI_RANK``/``PMI_SIZE``, ``PMIX_RANK``).
    """
    env = os.environ if environ is None else environ
    if env.get(DISABLE_ENV, "").lower() == "none":
        return None
    rank, size = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if env.get("TORCHELASTIC_RUN_ID") and rank is not None and size:
        local = _int(env, "LOCAL_RANK")
        run_id = env["TORCHELASTIC_RUN_ID"]
        restart = _int(env, "TORCHELASTIC_RESTART_COUNT")
        if restart:  # torchrun --max-restarts: a new attempt keeps the run id, but is a new launch
            run_id = f"{run_id}.restart{restart}"
        return _context("torchrun", rank, size, local, _int(env, "LOCAL_WORLD_SIZE"), run_id)
    rank, size = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
    if rank is not None and size:
        local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK")
        run_id = env.get("PMIX_NAMESPACE") or env.get("OMPI_MCA_orte_ess_jobid") or f"ppid{os.getppid()}"
        return _context("mpirun", rank, size, local, _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE"), run_id)
    rank, size = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS") or _int(env, "SLURM_NPROCS")
    if rank is not None and size and env.get("SLURM_STEP_ID") is not None:
        local = _int(env, "SLURM_LOCALID")
        run_id = f"{env.get('SLURM_JOB_ID', 'job')}.{env['SLURM_STEP_ID']}"
        return _context("srun", rank, size, local, _slurm_local_size(env), run_id)
    rank = _int(env, "PMI_RANK")
    if rank is None:
        rank = _int(env, "PMIX_RANK")
    size = _int(env, "PMI_SIZE")
    if rank is not None and size:
        run_id = env.get("PMIX_NAMESPACE") or env.get("PMI_JOBID") or f"ppid{os.getppid()}"
        return _context("mpirun", rank, size, _int(env, "MPI_LOCALRANKID"), _int(env, "MPI_LOCALNRANKS"), run_id)
    return None
