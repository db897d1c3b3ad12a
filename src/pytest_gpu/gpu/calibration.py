"""How much one CUDA, HIP or Level Zero context really takes: measured in the test process, not assumed.

``--gpu-context-overhead`` (500 MiB) is an assumption; a real context is larger or smaller
by driver, GPU and what loads into it (cuBLAS, cuDNN, NCCL, Triton). So on the first lease
of each GPU a test process reads its own NVML usage there right after its context opened
(the lease's confinement opens it on the lease's first GPU), less what the frameworks'
allocators still reserve (torch's cache), and the broker hands the figure to the machine's
arbiter, which uses it for that GPU's placement (the largest measured counts). An explicit
``--gpu-context-overhead`` wins: nothing is measured then.

On AMD GPUs it is this process's line in amdsmi's process list. On simulated GPUs the
figure is what the fake NVML reports for the process (the ledger's
rendered state), so a machine whose contexts differ from the assumption (``context=`` in
the spec) is measured as a real one would be. NVML's path runs in CI only against the fake
``libnvidia-ml.so.1``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..sim.ledger import STATE_FILE, ledger
from ..vendors import registry as vendors
from ..vendors.sampling import Unavailable

if TYPE_CHECKING:
    from ..vendors.devices import Inventory
    from .isolation import GpuLease


PLAUSIBLE = 4  # a figure above this many times the assumed context is more than a context: dropped


@dataclass
class Calibration:
    """What this process measured: GPU index -> bytes of its context there."""

    measured: dict[int, int] = field(default_factory=dict)
    _tried: set[int] = field(default_factory=set)

    def measure(self, lease: GpuLease, inventory: Inventory, assumed: int) -> dict[int, int]:
        """Figures for the lease's GPUs measured now for the first time (GPUs where this
        process has no context yet are tried again with a later lease). ``assumed``: the
        configured size; a figure above :data:`PLAUSIBLE` times it holds more than a context
        (memory the process allocated outside any lease) and is dropped."""
        todo = [i for i in lease.indices if i not in self._tried]
        if not todo:
            return {}
        usage = process_usage(todo, inventory)
        if usage is None:  # NVML cannot tell here: not tried again
            self._tried.update(todo)
            return {}
        held = _framework_reserved(lease)
        found: dict[int, int] = {}
        for index, used in usage.items():
            self._tried.add(index)
            context = used - held.get(index, 0)
            if 0 < context <= PLAUSIBLE * assumed:
                found[index] = self.measured[index] = context
        return found

    def report(self, lease: GpuLease, inventory: Inventory, tell: Callable[[int, int], None], assumed: int) -> None:
        """Measure (:meth:`measure`) and ``tell`` the broker each new figure (GPU index,
        bytes); one it refuses (``RuntimeError``: not a size that GPU can have) is dropped,
        and placement keeps the assumption there."""
        for index, nbytes in self.measure(lease, inventory, assumed).items():
            try:
                tell(index, nbytes)
            except RuntimeError:
                self.measured.pop(index, None)

    def report_opened(
        self, lease: GpuLease, inventory: Inventory, tell: Callable[[int, int], None], assumed: int
    ) -> None:
        """At a lease's end, after the adapters gave torch's cache back: :meth:`report` for
        the lease's GPUs where the test itself opened this process's context (torch starts
        CUDA lazily, inside the test). Nothing is asked of NVML unless torch has a context
        on a GPU not measured yet, so a test that never started CUDA pays nothing."""
        pending = [d for i, d in zip(lease.indices, lease.devices, strict=False) if i not in self._tried]
        if pending and _torch_has_context(pending):
            self.report(lease, inventory, tell, assumed)


def _torch_has_context(devices: list[str]) -> bool:
    torch = sys.modules.get("torch")
    check = getattr(getattr(torch, "_C", None), "_cuda_hasPrimaryContext", None)
    cuda = getattr(torch, "cuda", None)
    try:
        if check is None or cuda is None or not cuda.is_initialized():
            return False
        return any(check(int(device.partition(":")[2] or 0)) for device in devices)
    except Exception:  # a broken CUDA: it is the quarantine's to say
        return False


def process_usage(indices: list[int], inventory: Inventory) -> dict[int, int] | None:
    """NVML's usage of this process on each of ``indices`` that it has a context on;
    ``None`` where NVML cannot say."""
    if inventory.simulated:
        return _simulated_usage(indices, inventory)
    return _driver_usage(indices, inventory)


def _simulated_usage(indices: list[int], inventory: Inventory) -> dict[int, int] | None:
    """What the fake NVML reports: the ledger's rendered state (``proc <uuid> <pid> <bytes>``)."""
    try:
        text = (ledger().path / STATE_FILE).read_text()
    except (OSError, ValueError):
        return None
    uuids = {inventory.by_index(i).uuid: i for i in indices}
    found: dict[int, int] = {}
    me = str(os.getpid())
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == "proc" and parts[2] == me and parts[1] in uuids:
            found[uuids[parts[1]]] = int(parts[3])
    return found


def _driver_usage(indices: list[int], inventory: Inventory) -> dict[int, int] | None:
    """This process's line in the driver's compute lists (NVML's; amdsmi's on AMD GPUs, whose
    figure may be rounded: docs-incoming/vendors.md) on each of ``indices``."""
    try:
        driver = vendors.of(inventory.vendor).sampler()
    except Unavailable:
        return None
    found: dict[int, int] = {}
    try:
        for index in indices:
            try:
                procs = driver.compute(inventory.by_index(index).uuid)
            except Exception:  # Unlistable, or whatever else the driver raises: no figure there
                continue
            for pid, used in procs:
                if pid == os.getpid() and used is not None:
                    found[index] = used
    finally:
        driver.close()
    return found


def _framework_reserved(lease: GpuLease) -> dict[int, int]:
    """Bytes torch's caching allocator reserves on the lease's GPUs (not context), if torch's device
    module (``torch.cuda``; ``torch.xpu`` on Intel GPUs) started."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, vendors.of(lease.vendor).device_kind, None)
    held: dict[int, int] = {}
    try:
        if cuda is None or not cuda.is_initialized():
            return held
        for index, device in zip(lease.indices, lease.devices, strict=False):
            held[index] = int(cuda.memory_reserved(device))
    except Exception:  # a broken CUDA (see pytest_gpu.run.quarantine): nothing measured is lost
        return {}
    return held
