"""What a machine has: its GPUs (:class:`Device`) and the run's share of them (:class:`Inventory`) (pure).

Indices are the driver's (NVML's PCI bus order on NVIDIA GPUs, amdsmi's on AMD GPUs, the
``ZE_AFFINITY_MASK`` count on Intel GPUs); a MIG instance gets a number after the last GPU
(GPUs first, then each MIG-mode GPU's instances in slot order). Each vendor finds them its
own way (:mod:`pytest_gpu.vendors.registry`); a simulated machine's are built in
:mod:`pytest_gpu.sim.spec`.

An :class:`Inventory` keeps, besides the GPUs the run may use, every device the machine
has and the visibility variables the run started with: a process's runtime numbers the
devices *it* sees (its vendor's :meth:`~pytest_gpu.vendors.vendor.Vendor.view`), which are
not the inventory when ``--gpus 0,2,3`` picks a subset.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..base.requests import format_size
from . import kinds


class DeviceSpecError(ValueError):
    """A ``--gpus`` value that cannot be understood."""


@dataclass(frozen=True)
class Device:
    """One GPU or MIG instance: physical index, UUID, total memory in bytes."""

    index: int
    uuid: str
    total_memory: int
    name: str = ""
    simulated: bool = False
    reserved: int = 0  # the driver's own memory (NVML's ``reserved``): never allocatable
    parent: int | None = None  # a MIG instance: the NVML index of its GPU

    @property
    def capacity(self) -> int:
        """Memory CUDA can allocate here (what ``cudaMemGetInfo`` calls total)."""
        return self.total_memory - self.reserved

    def to_wire(self) -> list[object]:
        return [self.index, self.uuid, self.total_memory, self.name, self.simulated, self.reserved, self.parent]

    @classmethod
    def from_wire(cls, r: list[Any]) -> Device:
        parent = r[6] if len(r) > 6 else None
        return cls(
            index=int(r[0]),
            uuid=str(r[1]),
            total_memory=int(r[2]),
            name=str(r[3]),
            simulated=bool(r[4]),
            reserved=int(r[5]) if len(r) > 5 else 0,
            parent=None if parent is None else int(parent),
        )


@dataclass(frozen=True)
class Inventory:
    """The GPUs a run may use, in physical-index order.

    ``machine`` is every device the machine has (the inventory's included), ``visible``
    the ``CUDA_VISIBLE_DEVICES`` the run started with: together they say how a process's
    CUDA numbers the devices (:func:`process_view`).
    """

    devices: tuple[Device, ...]
    source: str  # how it was found: "sim:4x16GiB", "nvml", "none", ...
    note: str = ""  # why it is empty, or what was left out
    machine: tuple[Device, ...] = ()
    visible: str | None = None
    vendor: str = kinds.DEFAULT.name  # whose GPUs (pytest_gpu.vendors.kinds)
    outer: tuple[tuple[str, str], ...] = ()  # another vendor's visibility variables the run started with

    @property
    def simulated(self) -> bool:
        return any(d.simulated for d in self.devices)

    @property
    def runtime(self) -> str:
        """Whose runtime a test process opens its context with here: ``CUDA``, ``HIP``, ``Level Zero``."""
        return kinds.of(self.vendor).runtime

    def by_index(self, index: int) -> Device:
        for device in self.devices:
            if device.index == index:
                return device
        raise KeyError(index)

    def describe(self) -> str:
        if not self.devices:
            return f"no GPUs ({self.note or self.source})"
        sizes: dict[int, int] = {}
        for device in self.devices:
            sizes[device.total_memory] = sizes.get(device.total_memory, 0) + 1
        parts = ", ".join(f"{n}x{format_size(size)}" for size, n in sizes.items())
        kind = "simulated " if self.simulated else ""
        whose = kinds.of(self.vendor)
        kind += f"{whose.label} " if whose.named else ""
        noun = "MIG instance" if all(d.parent is not None for d in self.devices) else "GPU"
        plural = "s" if len(self.devices) != 1 else ""
        return f"{len(self.devices)} {kind}{noun}{plural} ({parts})"

    def to_wire(self) -> dict[str, object]:
        wire: dict[str, object] = {
            "source": self.source,
            "note": self.note,
            "devices": [d.to_wire() for d in self.devices],
            "machine": [d.to_wire() for d in self.machine],
            "visible": self.visible,
        }
        if self.vendor != kinds.DEFAULT.name:  # another vendor's: NVIDIA's wire form is as it was
            wire.update(vendor=self.vendor, outer=[list(pair) for pair in self.outer])
        return wire

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Inventory:
        devices = tuple(Device.from_wire(r) for r in data["devices"])
        machine = tuple(Device.from_wire(r) for r in data.get("machine", ()))
        visible = data.get("visible")
        outer = tuple((str(k), str(v)) for k, v in data.get("outer", ()))
        vendor = str(data.get("vendor", kinds.DEFAULT.name))
        return cls(devices, str(data["source"]), str(data.get("note", "")), machine, visible, vendor, outer)


def addressable(machine: tuple[Device, ...]) -> tuple[Device, ...]:
    """The devices CUDA can open: all but GPUs in MIG mode (their instances are listed)."""
    return tuple(d for d in machine if not in_mig_mode(d, machine))


def in_mig_mode(device: Device, machine: tuple[Device, ...]) -> bool:
    """Whether ``device`` is a GPU in MIG mode: ``machine`` lists instances of it."""
    return device.parent is None and any(d.parent == device.index for d in machine)
