"""Applying a lease inside the test process: environment, and framework adapters.

Only the leased GPUs are ever touched. A framework is used only if the test process
has already imported it (``sys.modules``): the plugin never imports torch or CuPy.

The real-CUDA adapters (torch, CuPy) are written against the frameworks' documented
APIs (``torch.cuda.set_device``, ``torch.cuda.set_per_process_memory_fraction``,
``torch.cuda.reset_peak_memory_stats``; ``cupy.cuda.Device.use``,
``cupy.get_default_memory_pool().set_limit``) and exercised here only against stand-in
modules: the development machines have no GPU.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType

from . import sim
from .devices import Inventory

VISIBLE_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")


@dataclass(frozen=True)
class GpuLease:
    """The GPUs a test holds (the ``gpu`` fixture's value).

    ``indices`` are physical (NVML order), ``device`` is the first leased GPU as this
    process addresses it, ``env`` is what a subprocess needs to see exactly the lease.
    """

    key: str
    indices: tuple[int, ...]
    uuids: tuple[str, ...]
    memory: int
    exclusive: bool
    device: str
    visible_devices: str
    env: dict[str, str]
    waited: float
    simulated: bool = False

    def __repr__(self) -> str:
        return f"GpuLease(indices={self.indices}, memory={self.memory}, device={self.device!r})"


def process_view(inventory: Inventory) -> list[int]:
    """Physical indices in the order this process's CUDA runtime numbers them.

    The plugin runs with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and the inventory honours an
    outer ``CUDA_VISIBLE_DEVICES``, so the inventory order is the process order.
    """
    return [d.index for d in inventory.devices]


def in_process_ordinal(index: int, inventory: Inventory) -> int:
    """CUDA ordinal of physical GPU ``index`` inside this process during the test.

    Simulated devices read ``CUDA_VISIBLE_DEVICES`` at each call, so the first leased GPU
    is ordinal 0. A real CUDA runtime fixes its numbering when it initialises: if a
    framework is loaded it was (or will be, in :func:`confine`) initialised with the
    whole inventory visible, otherwise it will initialise inside the test with only the
    lease visible.
    """
    if inventory.simulated or not _cuda_framework_loaded():
        return 0
    return process_view(inventory).index(index)


def _cuda_framework_loaded() -> bool:
    return "torch" in sys.modules or "cupy" in sys.modules


def make_lease(
    key: str,
    indices: Sequence[int],
    memory: int,
    exclusive: bool,
    waited: float,
    inventory: Inventory,
    tag: str,
) -> GpuLease:
    devices = [inventory.by_index(i) for i in indices]
    if inventory.simulated:
        visible = ",".join(str(d.index) for d in devices)
    else:
        visible = ",".join(d.uuid for d in devices)  # UUIDs: immune to any ordering mismatch
    env = {name: visible for name in VISIBLE_VARS}
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    if inventory.simulated:
        env[sim.TAG_ENV] = tag
    ordinal = in_process_ordinal(devices[0].index, inventory)
    return GpuLease(
        key=key,
        indices=tuple(indices),
        uuids=tuple(d.uuid for d in devices),
        memory=memory,
        exclusive=exclusive,
        device=f"cuda:{ordinal}",
        visible_devices=visible,
        env=env,
        waited=waited,
        simulated=inventory.simulated,
    )


@dataclass
class Confinement:
    """What :func:`confine` changed, so :meth:`undo` can put it back."""

    saved_env: dict[str, str | None] = field(default_factory=dict)
    undo_steps: list[Callable[[], None]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def undo(self) -> None:
        for step in reversed(self.undo_steps):
            try:
                step()
            except Exception as exc:
                self.notes.append(f"could not undo a confinement step: {exc!r}")
        self.undo_steps.clear()
        for name, value in self.saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self.saved_env.clear()


def confine(lease: GpuLease, inventory: Inventory) -> Confinement:
    """Apply ``lease`` to this process until :meth:`Confinement.undo`."""
    done = Confinement()
    # Frameworks first: a CUDA runtime that initialises now must see the whole
    # inventory, not the narrowed variables set below (it would keep that view).
    torch = sys.modules.get("torch")
    if torch is not None and not lease.simulated:
        _confine_torch(torch, lease, inventory, done)
    cupy = sys.modules.get("cupy")
    if cupy is not None and not lease.simulated:
        _confine_cupy(cupy, lease, inventory, done)
    if lease.simulated:
        for index in lease.indices:
            sim.set_memory_cap(index, lease.memory)
            done.undo_steps.append(lambda index=index: sim.set_memory_cap(index, None))
    for name, value in lease.env.items():
        done.saved_env[name] = os.environ.get(name)
        os.environ[name] = value
    return done


def _confine_torch(torch: ModuleType, lease: GpuLease, inventory: Inventory, done: Confinement) -> None:
    cuda = getattr(torch, "cuda", None)
    if cuda is None or not cuda.is_available():
        return
    view = process_view(inventory)
    previous = cuda.current_device() if cuda.is_initialized() else None
    ordinals = [view.index(i) for i in lease.indices]
    for ordinal, index in zip(ordinals, lease.indices, strict=True):
        total = inventory.by_index(index).total_memory
        fraction = min(1.0, lease.memory / total) if total else 1.0
        cuda.set_per_process_memory_fraction(fraction, ordinal)
        cuda.reset_peak_memory_stats(ordinal)
        done.undo_steps.append(lambda o=ordinal: cuda.set_per_process_memory_fraction(1.0, o))
    cuda.set_device(ordinals[0])
    if previous is not None and previous != ordinals[0]:
        done.undo_steps.append(lambda: cuda.set_device(previous))


def _confine_cupy(cupy: ModuleType, lease: GpuLease, inventory: Inventory, done: Confinement) -> None:
    view = process_view(inventory)
    ordinal = view.index(lease.indices[0])
    device = cupy.cuda.Device(ordinal)
    device.use()
    pool = cupy.get_default_memory_pool()
    previous = pool.get_limit()
    pool.set_limit(size=lease.memory)
    done.undo_steps.append(lambda: pool.set_limit(size=previous))
