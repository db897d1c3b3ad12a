"""After a test: did it stay inside its lease?

Three checks, each producing a sentence for the report:

(a) memory used on a GPU outside the lease;
(b) peak memory above the lease's budget on a leased GPU;
(c) memory still held on a GPU after the test's teardown.

Simulated devices answer from the ledger, which attributes every allocation (of the
test process and of its subprocesses, which inherit the tag) to the test. Real GPUs
answer from NVML per-process usage of this process and its children, and from torch's
allocator counters when torch is loaded.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass, field

from . import sim
from .devices import Inventory
from .isolation import GpuLease, process_view
from .requests import format_size


@dataclass
class Verdict:
    """What one test used, and what it did wrong."""

    peak: dict[int, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)

    def merge(self, other: Verdict) -> None:
        for index, value in other.peak.items():
            self.peak[index] = max(self.peak.get(index, 0), value)
        self.violations.extend(other.violations)


def judge(
    lease: GpuLease,
    peak: dict[int, int],
    current: dict[int, int],
    touched: Iterable[int],
) -> Verdict:
    """Pure rule: turn measured usage into a verdict for ``lease``."""
    verdict = Verdict(peak={i: peak.get(i, 0) for i in lease.indices})
    leased = set(lease.indices)
    outside = sorted(set(touched) - leased)
    if outside:
        used = ", ".join(f"GPU {i} ({format_size(peak.get(i, 0))} at peak)" for i in outside)
        verdict.violations.append(f"used memory on {used} outside its lease (GPU {','.join(map(str, lease.indices))})")
    for index in lease.indices:
        if peak.get(index, 0) > lease.memory:
            verdict.violations.append(
                f"peak {format_size(peak[index])} on GPU {index} is above its budget of {format_size(lease.memory)}"
            )
    for index in sorted(current):
        if current[index] > 0:
            verdict.violations.append(
                f"still holds {format_size(current[index])} on GPU {index} after the test "
                "(a leaked allocation, or a subprocess still running)"
            )
    return verdict


class SimVerifier:
    """Reads the simulated ledger; the tag is set in the environment by the lease."""

    def begin(self, lease: GpuLease, owner: int) -> None:
        sim.ledger().begin_tag(lease.env[sim.TAG_ENV], owner)

    def end(self, lease: GpuLease) -> Verdict:
        usage = sim.ledger().tag_usage(lease.env[sim.TAG_ENV], drop=True)
        return judge(lease, usage.peak, usage.current, usage.touched)


class NvmlVerifier:
    """Real GPUs: NVML per-process usage of this process tree, torch counters if loaded.

    Untested here (no GPU on the development machines); written against nvidia-ml-py's
    ``nvmlDeviceGetComputeRunningProcesses`` (``pid``, ``usedGpuMemory``) and torch's
    ``max_memory_reserved``/``memory_allocated``. NVML reports host pids, so in a
    container with its own pid namespace the per-process check finds nothing (it then
    passes rather than guess). The worker's own CUDA context is accounted by the broker,
    so usage on a GPU is compared with what the process tree had there at setup.
    """

    def __init__(self, inventory: Inventory, overhead: int) -> None:
        self.inventory = inventory
        self.overhead = overhead
        self._baseline: dict[int, int] = {}
        self._torch_base: dict[int, int] = {}

    def _usage(self) -> dict[int, int]:
        import psutil
        import pynvml

        me = psutil.Process()
        pids = {me.pid} | {child.pid for child in me.children(recursive=True)}
        usage: dict[int, int] = {}
        pynvml.nvmlInit()
        try:
            for device in self.inventory.devices:
                handle = pynvml.nvmlDeviceGetHandleByUUID(device.uuid)
                for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    if proc.pid in pids and proc.usedGpuMemory:
                        usage[device.index] = usage.get(device.index, 0) + int(proc.usedGpuMemory)
        finally:
            pynvml.nvmlShutdown()
        return usage

    def begin(self, lease: GpuLease, owner: int) -> None:
        self._baseline = self._usage()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            view = process_view(self.inventory)
            self._torch_base = {i: torch.cuda.memory_allocated(view.index(i)) for i in lease.indices}

    def end(self, lease: GpuLease) -> Verdict:
        now = self._usage()
        grown = {i: now.get(i, 0) - self._baseline.get(i, 0) for i in now}
        for i in grown:
            if self._baseline.get(i, 0) == 0 and i in lease.indices:
                grown[i] -= self.overhead  # this test opened the process's context here
        touched = [i for i, delta in grown.items() if delta > 0]
        peak = {i: max(grown.get(i, 0), 0) for i in lease.indices}
        current: dict[int, int] = {}
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            view = process_view(self.inventory)
            for index in lease.indices:
                ordinal = view.index(index)
                peak[index] = max(peak[index], int(torch.cuda.max_memory_reserved(ordinal)))
                left = torch.cuda.memory_allocated(ordinal) - self._torch_base.get(index, 0)
                if left > 0:
                    current[index] = left
        return judge(lease, peak, current, touched)
