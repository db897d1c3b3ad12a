"""GPU-aware ``-n auto``: how many xdist workers a GPU machine keeps busy.

pytest-xdist asks ``pytest_xdist_auto_num_workers(config)`` for ``-n auto`` (and ``-n
logical``), first result wins, and its own answer is the CPU count. With GPUs in the
run's inventory pytest-gpu answers ``-n auto`` with :func:`choose`; ``-n logical``,
``PYTEST_XDIST_AUTO_NUM_WORKERS`` and a machine without GPUs are left to xdist (``None``):
for the last, the summary says so, and how many workers xdist's CPU count gave.

The formula (docs/scheduling.md, "How many workers?")::

    m      one test's memory per GPU: --gpu-default-memory, or with --gpu-learn and
           recorded peaks the median of the requests --gpu-learn makes of them
           (max(1.25 x peak, 256MiB)); 'exclusive': a whole GPU
    k_i    tests that fit on GPU i at once: 1 for whole GPUs, else
           floor(capacity_i / (m + context overhead)) (every worker has its own CUDA
           context), at most the GPU's context budget (a quarter of it in contexts,
           as the placement keeps it) and gpu_workers_per_gpu
    g      sum of k_i;  n: the GPUs with k_i >= 1
    h      min(CPUs, floor(host RAM / 4GiB))
    -n     min(g, max(h, n)), at least 1

So never more workers than GPU tests fit at once, as many as CPUs and RAM allow, and at
least one per GPU even on a machine with few CPUs (GPU tests mostly wait on their GPU).
:func:`choose` is pure; :func:`auto_num_workers` gathers its inputs (the options, device
discovery, the cache, the CPUs this process may run on, host RAM) before pytest's own
configuration, which is when xdist asks.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from ..base.requests import GpuRequest, format_size, learned
from ..base.wording import plural
from ..gpu.discovery import discover
from ..gpu.share import node_share
from ..leasing.host import machine_cpus, total_memory
from ..machine.placement import Policy
from ..run import history, options
from ..run.keys import LAUNCH_KEY
from ..vendors.devices import DeviceSpecError

HOST_MEMORY_PER_WORKER = 4 * 2**30  # host RAM one worker is counted to need
XDIST_ENV = "PYTEST_XDIST_AUTO_NUM_WORKERS"


@dataclass(frozen=True)
class Decision:
    """What ``-n auto`` chose and why: ``workers`` ``None`` leaves it to xdist."""

    workers: int | None
    fits: tuple[int, ...]  # k_i: tests that fit at once on each GPU
    cpus: int
    ram: int
    memory: int | None  # m; None: a whole GPU
    learned: bool = False
    capped: int | None = None  # gpu_workers_per_gpu, where it lowered some k_i
    gpuless: str | None = None  # the run has no GPUs: its inventory, described ("no GPUs (--gpus none)")

    @property
    def gpu_bound(self) -> int:
        return sum(self.fits)

    @property
    def host_bound(self) -> int:
        return max(1, min(self.cpus, self.ram // HOST_MEMORY_PER_WORKER))

    def reason(self) -> str:
        """The summary line."""
        if self.gpuless is not None:
            return f"pytest-gpu: -n auto: this run has {self.gpuless}; xdist's CPU count decides"
        what = "a whole GPU" if self.memory is None else format_size(self.memory)
        if self.learned:
            what += " (the median learned request)"
        if self.workers is None:
            return f"pytest-gpu: -n auto: no GPU fits a test of {what}; xdist's CPU count decides"
        fitting = [k for k in self.fits if k]
        if self.memory is None:
            gpus = f"{plural(len(fitting), 'GPU')}, one whole-GPU test each"
        elif len(set(fitting)) == 1:
            gpus = f"{plural(len(fitting), 'GPU')} x {plural(fitting[0], 'test')} of {what} each fit"
        else:
            gpus = f"{plural(self.gpu_bound, 'test')} of {what} fit on {plural(len(fitting), 'GPU')} "
            gpus += f"({'+'.join(map(str, fitting))})"
        if self.capped is not None:
            gpus += f", capped by gpu_workers_per_gpu = {self.capped}"
        ram = f"{format_size(self.ram)} RAM"
        cpus = plural(self.cpus, "CPU")
        head = f"pytest-gpu: -n auto chose {plural(self.workers, 'worker')}: "
        host = self.host_bound
        if self.workers == self.gpu_bound:
            if host > self.workers:
                return head + f"{gpus} ({ram}, {cpus} allow more)"
            if host == self.workers:
                return head + f"{gpus} ({ram}, {cpus} allow as many)"
            return head + f"{gpus} ({ram}, {cpus} allow {host}; at least one worker per GPU)"
        if self.workers == host:
            if self.cpus <= self.ram // HOST_MEMORY_PER_WORKER:
                limit = f"one per CPU ({cpus}, {ram})"
            else:
                limit = f"{ram} at {format_size(HOST_MEMORY_PER_WORKER)} a worker ({cpus})"
            return head + f"{limit}; {gpus}"
        return head + f"one per GPU; {gpus}; {ram}, {cpus} allow {host}"


def choose(
    capacities: Sequence[int],
    *,
    memory: int | None,
    overhead: int,
    cpus: int,
    ram: int,
    per_gpu: int | None = None,
    learned: bool = False,
) -> Decision:
    """The formula of this module's docstring (pure).

    ``capacities``: each GPU's allocatable bytes; ``memory``: one test's bytes per GPU
    (``None``: whole GPUs); ``overhead``: one CUDA context; ``per_gpu``: the
    ``gpu_workers_per_gpu`` cap. A result with ``workers`` ``None``: no GPU fits one test.
    """
    policy = Policy(overhead=overhead)
    fits: list[int] = []
    capped = False
    for capacity in capacities:
        if capacity <= overhead:
            k = 0
        elif memory is None:
            k = 1
        else:
            k = min(capacity // (memory + overhead), policy.context_limit(capacity))
        if per_gpu is not None and k > per_gpu:
            k, capped = per_gpu, True
        fits.append(k)
    gpu_bound = sum(fits)
    decision = Decision(None, tuple(fits), cpus, ram, memory, learned, per_gpu if capped else None)
    if gpu_bound == 0:
        return decision
    used = sum(1 for k in fits if k)
    workers = max(1, min(gpu_bound, max(decision.host_bound, used)))
    return Decision(workers, tuple(fits), cpus, ram, memory, learned, per_gpu if capped else None)


# -- the hook's I/O -----------------------------------------------------------------------

AUTO_KEY = pytest.StashKey[Decision]()


def host_cpus() -> int:
    """CPUs this process may run on (its affinity mask: taskset, cgroup cpusets)."""
    return machine_cpus()


def host_memory() -> int:
    return total_memory()


def recorded_peaks(config: pytest.Config, key: str) -> list[int]:
    """``--gpu-learn``'s recorded peaks, read from pytest's cache directory before pytest's
    cache plugin is configured (xdist asks for the worker count earlier)."""
    if not config.pluginmanager.has_plugin("cacheprovider") or config.getoption("cacheclear", False):
        return []
    raw = os.path.expandvars(os.path.expanduser(str(config.getini("cache_dir"))))
    path = Path(raw) if os.path.isabs(raw) else config.rootpath / raw
    try:
        values = json.loads((path / "v" / key).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    if not isinstance(values, dict):  # a hand-edited file must not break the run
        return []
    return [int(v) for v in values.values() if isinstance(v, int | float) and not isinstance(v, bool) and v >= 0]


def auto_num_workers(config: pytest.Config) -> int | None:
    """``pytest_xdist_auto_num_workers``: the workers for ``-n auto`` on a GPU machine, or
    ``None`` to leave the number to xdist (``-n logical``, ``PYTEST_XDIST_AUTO_NUM_WORKERS``,
    no GPUs). The decision is kept in ``config.stash[AUTO_KEY]`` for the summary."""
    if getattr(config.option, "numprocesses", None) != "auto" or os.environ.get(XDIST_ENV):
        return None

    settings = options.read(config)
    try:
        inventory = node_share(discover(settings.gpus), config.stash.get(LAUNCH_KEY, None))
    except DeviceSpecError as exc:
        raise pytest.UsageError(str(exc)) from None
    if not inventory.devices:  # xdist's number, said in the summary (summary_lines)
        config.stash[AUTO_KEY] = Decision(None, (), 0, 0, None, gpuless=inventory.describe())
        return None
    capacities = [d.capacity for d in inventory.devices]
    memory = settings.default_memory.memory
    peaks = recorded_peaks(config, history.PEAKS_KEY) if settings.learn else []
    usable = max(capacities) - settings.context_overhead
    if peaks and usable > 0:
        asked = [learned(GpuRequest(), peak, usable).memory or 0 for peak in peaks]
        memory = int(statistics.median_low(asked))
    decision = choose(
        capacities,
        memory=memory,
        overhead=settings.context_overhead,
        cpus=host_cpus(),
        ram=host_memory(),
        per_gpu=settings.workers_per_gpu,
        learned=bool(peaks) and usable > 0,
    )
    config.stash[AUTO_KEY] = decision
    return decision.workers


def summary_lines(config: pytest.Config) -> list[str]:
    """The summary's line on how ``-n auto`` chose (none when pytest-gpu was not asked); where
    it left the number to xdist, the number xdist chose (``numprocesses`` once it answered)."""
    decision = config.stash.get(AUTO_KEY, None)
    if decision is None:
        return []
    line = decision.reason()
    workers = decision.workers
    if workers is None:
        chosen = getattr(config.option, "numprocesses", None)
        if isinstance(chosen, int) and not isinstance(chosen, bool):
            workers = chosen
            line += f": {plural(workers, 'worker')}"
    most = getattr(config.option, "maxprocesses", None)
    if workers is not None and most and most < workers:
        line += f"; --maxprocesses={most} runs {plural(most, 'worker')}"
    return [line]
