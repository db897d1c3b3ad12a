"""The ``distributed`` marker: what a distributed test asks for, and the run's settings for it (pure)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .requests import DefaultMemory, GpuRequest, GpuRequestError, build_request
from .wording import plural

BACKENDS = ("auto", "gloo", "nccl", "xccl", "ccl", "mpi", "none")
GPU_BACKENDS = ("nccl", "xccl", "ccl")  # a GPU for each rank (xccl, ccl: Intel GPUs)
LAUNCHERS = ("spawn", "torchrun", "mpirun", "srun")
DIST_MARKER_FORM = (
    '@pytest.mark.distributed(world_size, *, backend="auto", gpus_per_rank=None, launcher="spawn", timeout=None)'
)
_KWARGS = ("world_size", "backend", "gpus_per_rank", "launcher", "timeout")


@dataclass(frozen=True)
class DistSpec:
    """A resolved ``distributed`` marker; also the key of the pool that can run it.

    ``lease``: an isolated test's (``gpu(..., isolate=True)``, :func:`isolated_spec`): its
    pool is one rank holding exactly that lease, and pools are keyed by it (its shape).
    """

    world_size: int
    backend: str
    gpus_per_rank: int
    launcher: str
    timeout: float | None = None
    lease: GpuRequest | None = None

    @property
    def pool_key(self) -> tuple[object, ...]:
        key = (self.world_size, self.backend, self.launcher, self.gpus_per_rank)
        return key if self.lease is None else (*key, self.lease)  # an isolated test's: its lease's shape

    @property
    def isolated(self) -> bool:
        """Whether this is an isolated test's one-rank pool, not a ``distributed`` marker's."""
        return self.lease is not None

    def gpu_request(self, default_memory: DefaultMemory) -> GpuRequest | None:
        """The GPUs its pool holds: an isolated test's lease, or ``gpus_per_rank`` per rank,
        ``--gpu-default-memory`` each (``None``: none)."""
        if self.lease is not None:
            return self.lease
        if not self.gpus_per_rank:
            return None
        return build_request((self.world_size * self.gpus_per_rank,), {}, default_memory)

    def describe(self) -> str:
        if self.lease is not None:
            return f"1 isolated process ({self.lease.describe()})"
        gpus = f", {self.gpus_per_rank} GPU/rank" if self.gpus_per_rank else ""
        return f"{plural(self.world_size, 'rank')} ({self.backend} via {self.launcher}{gpus})"


def isolated_spec(request: GpuRequest) -> DistSpec:
    """The one-rank pool of a test marked ``gpu(..., isolate=True)``: no process group, the
    test's whole lease on its one rank (which sees it as ``cuda:0..count-1``)."""
    return DistSpec(world_size=1, backend="none", gpus_per_rank=request.count, launcher="spawn", lease=request)


def build_spec(args: Sequence[Any], kwargs: Mapping[str, Any], *, auto_backend: str = "gloo") -> DistSpec:
    """Validate ``distributed`` marker arguments; raise :class:`GpuRequestError` with the expected form.

    ``auto_backend``: what ``backend="auto"`` is here (see :mod:`pytest_gpu.distributed.backends`)."""
    what = "distributed marker"
    unknown = sorted(set(kwargs) - set(_KWARGS))
    if unknown:
        raise GpuRequestError(f"{what}: unknown keyword {', '.join(map(repr, unknown))}; expected {DIST_MARKER_FORM}")
    if len(args) > 1 or (args and "world_size" in kwargs):
        raise GpuRequestError(f"{what}: give world_size once, positionally or by keyword; expected {DIST_MARKER_FORM}")
    if not args and "world_size" not in kwargs:
        raise GpuRequestError(f"{what}: world_size is required; expected {DIST_MARKER_FORM}")
    world_size = args[0] if args else kwargs["world_size"]
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= 0:
        raise GpuRequestError(f"{what}: world_size must be a positive int, got {world_size!r}")
    backend = kwargs.get("backend", "auto")
    if backend not in BACKENDS:
        raise GpuRequestError(f"{what}: backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    launcher = kwargs.get("launcher")
    if launcher is None:
        launcher = "mpirun" if backend == "mpi" else "spawn"
    if launcher not in LAUNCHERS:
        raise GpuRequestError(f"{what}: launcher must be one of {', '.join(LAUNCHERS)}, got {launcher!r}")
    if backend == "mpi" and launcher not in ("mpirun", "srun"):
        raise GpuRequestError(f"{what}: backend='mpi' needs launcher='mpirun' or 'srun', got {launcher!r}")
    if backend == "auto":
        backend = auto_backend
    gpus_per_rank = kwargs.get("gpus_per_rank")
    if gpus_per_rank is None:
        gpus_per_rank = 1 if backend in GPU_BACKENDS else 0
    if isinstance(gpus_per_rank, bool) or not isinstance(gpus_per_rank, int) or gpus_per_rank < 0:
        raise GpuRequestError(f"{what}: gpus_per_rank must be an int >= 0, got {gpus_per_rank!r}")
    if backend in GPU_BACKENDS and gpus_per_rank == 0:
        raise GpuRequestError(f"{what}: backend={backend!r} needs gpus_per_rank >= 1")
    timeout = kwargs.get("timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise GpuRequestError(f"{what}: timeout must be a positive number of seconds, got {timeout!r}")
    return DistSpec(world_size, backend, gpus_per_rank, launcher, None if timeout is None else float(timeout))


# How far the process group's own timeout lies past the longest test a pool runs: the time
# the pool needs to collect every rank's stack and kill the ranks once that test timed out.
GROUP_TIMEOUT_MARGIN = 60.0


@dataclass(frozen=True)
class DistSettings:
    """The run's options for its distributed tests (``--dist-timeout``, ``--dist-pool``, ...)."""

    timeout: float = 300.0  # per test, unless the marker says otherwise
    pool: bool = True
    idle: float = 60.0
    init_timeout: float = 120.0
    grace: float = 10.0  # how long the other ranks get once one rank failed or died
    wait_timeout: float = 1800.0


def group_timeout(settings: DistSettings, test_timeout: float) -> float:
    """The ``timeout`` of a pool's process group, for tests of up to ``test_timeout`` seconds.

    torch applies it to every collective (NCCL's watchdog aborts the ranks when one waits
    longer), so it must outlast the pool's own per-test timeout, which reports a hang with
    every rank's stack; ``init_timeout`` (the rendezvous) is bounded by the pool's set-up wait.
    """
    return max(settings.init_timeout, test_timeout + settings.grace + GROUP_TIMEOUT_MARGIN)
