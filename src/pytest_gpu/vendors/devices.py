"""What the machine has: GPU discovery through NVML, explicit index lists, simulated devices.

Indices are *physical* (NVML's PCI bus order); a MIG instance gets a number after the
last GPU (GPUs first, then each MIG-mode GPU's instances in slot order). Everything the
plugin sets for CUDA goes with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so that CUDA's numbering
agrees with NVML's.

An :class:`Inventory` keeps, besides the GPUs the run may use, every device the machine
has and the ``CUDA_VISIBLE_DEVICES`` the run started with: a process's CUDA numbers the
devices *it* sees (see :func:`process_view`), which are not the inventory when
``--gpus 0,2,3`` picks a subset.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ..base.requests import format_size
from . import libraries

SIM_PREFIX = "sim:"
GPUS_FORM = "auto, none, an index list such as 0,2,3, or simulated devices such as sim:4x16GiB"


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


#: The runtime whose context a test process opens on each vendor's GPUs, as messages name it.
RUNTIMES = {"nvidia": "CUDA", "amd": "HIP", "xpu": "Level Zero"}


def runtime_name(vendor: str) -> str:
    """The runtime of ``vendor``'s GPUs (an inventory's or a lease's vendor), as messages name it."""
    return RUNTIMES[vendor]


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
    vendor: str = "nvidia"  # whose GPUs: nvidia, amd, xpu (pytest_gpu.gpu.discovery)
    outer: tuple[tuple[str, str], ...] = ()  # another vendor's visibility variables the run started with

    @property
    def simulated(self) -> bool:
        return any(d.simulated for d in self.devices)

    @property
    def runtime(self) -> str:
        """Whose runtime a test process opens its context with here: ``CUDA``, ``HIP``, ``Level Zero``."""
        return runtime_name(self.vendor)

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
        kind += {"amd": "AMD ", "xpu": "Intel "}.get(self.vendor, "")  # NVIDIA's, as always, unnamed
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
        if self.vendor != "nvidia":  # another vendor's: NVIDIA's wire form is as it was
            wire.update(vendor=self.vendor, outer=[list(pair) for pair in self.outer])
        return wire

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Inventory:
        devices = tuple(Device.from_wire(r) for r in data["devices"])
        machine = tuple(Device.from_wire(r) for r in data.get("machine", ()))
        visible = data.get("visible")
        outer = tuple((str(k), str(v)) for k, v in data.get("outer", ()))
        vendor = str(data.get("vendor", "nvidia"))
        return cls(devices, str(data["source"]), str(data.get("note", "")), machine, visible, vendor, outer)


def process_view(inventory: Inventory, visible: str | None = None, *, use_run: bool = True) -> list[int]:
    """Physical indices in the order a CUDA runtime that started with ``visible`` numbers them.

    ``visible`` defaults to the run's ``CUDA_VISIBLE_DEVICES`` (``use_run``), the view
    every worker's CUDA is pinned to. Without a record of the machine (an inventory made
    by hand) the inventory itself is the view.
    """
    machine = inventory.machine or inventory.devices
    return cuda_view(machine, inventory.visible if (visible is None and use_run) else visible)


def cuda_view(machine: tuple[Device, ...], visible: str | None) -> list[int]:
    """Physical indices a CUDA process enumerates, in ordinal order, when it starts under
    ``CUDA_VISIBLE_DEVICES=visible`` on ``machine`` (every device, MIG-mode GPUs included).

    The one model of CUDA's enumeration: the simulated runtime uses it too.
    """
    seen = addressable(machine) if visible is None else select_visible(machine, visible)
    # CUDA gives a process one MIG instance, the first it can see (NVIDIA's MIG user guide)
    first_mig = next((d.index for d in seen if d.parent is not None), None)
    return [d.index for d in seen if d.parent is None or d.index == first_mig]


def addressable(machine: tuple[Device, ...]) -> tuple[Device, ...]:
    """The devices CUDA can open: all but GPUs in MIG mode (their instances are listed)."""
    return tuple(d for d in machine if not _mig_mode_gpu(d, machine))


def _mig_mode_gpu(device: Device, machine: tuple[Device, ...]) -> bool:
    return device.parent is None and any(d.parent == device.index for d in machine)


def sim_uuid(index: int) -> str:
    """UUID of simulated GPU ``index`` (shaped like NVML's ``GPU-…`` UUIDs)."""
    from ..sim.spec import gpu_uuid

    return gpu_uuid(index)


def sim_machine(spec: str) -> tuple[tuple[Device, ...], str]:
    """Every usable device of a ``sim:`` spec (what NVML would report), and a note on what was left out."""
    from ..sim.spec import SpecError, parse

    try:
        machine = parse(spec)
    except SpecError as exc:
        raise DeviceSpecError(f"--gpus {exc}") from None
    refused = {g.index: g.fault for g in machine.gpus if g.fault != "none"}
    devices = tuple(
        Device(u.index, u.uuid, u.total, u.name, True, u.reserved, u.parent)
        for u in machine.addressable()
        if u.index not in refused and u.parent not in refused
    )
    note = "; ".join(f"GPU {i} skipped: NVML refuses it ({kind})" for i, kind in refused.items())
    return devices, note


def parse_sim_spec(spec: str) -> tuple[Device, ...]:
    """``sim:4x16GiB`` or ``sim:2x80GiB,2x24GiB`` (options: :mod:`pytest_gpu.sim.spec`) → its usable devices."""
    return sim_machine(spec)[0]


class NvmlUnavailable(RuntimeError):
    """NVML could not be loaded or initialised (no driver, no GPU)."""


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def nvml_devices() -> tuple[tuple[Device, ...], str]:
    """Every GPU (and MIG instance) NVML reports, in NVML (PCI bus) order, and a note.

    A GPU that NVML counts but will not open (``NO_PERMISSION`` in a cgroup-restricted
    job, ``GPU_IS_LOST``, ...) is left out and named in the note; it must never stop a
    run. A GPU in MIG mode contributes its MIG instances (CUDA cannot use the GPU
    itself), numbered after the last GPU.

    Runs against the fake ``libnvidia-ml.so.1`` in CI (``PYTEST_GPU_FAKE_GPUS``); not run
    on a real GPU machine by the author.
    """
    try:
        pynvml = libraries.nvml()
    except ImportError as exc:  # pragma: no cover - nvidia-ml-py is a dependency
        raise NvmlUnavailable(f"nvidia-ml-py is not installed ({exc})") from None
    except libraries.NvmlLibraryMissing as exc:
        raise NvmlUnavailable(f"NVML unavailable: {exc}") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise NvmlUnavailable(f"NVML unavailable: {exc}") from None
    notes: list[str] = []
    try:
        count = pynvml.nvmlDeviceGetCount()
        gpus: list[Device] = []
        migs: list[Device] = []
        for i in range(count):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                device = Device(
                    index=i,
                    uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                    total_memory=0,
                    name=_text(pynvml.nvmlDeviceGetName(handle)),
                )
                mig_mode = _mig_mode(pynvml, handle)
                if mig_mode:
                    for slot in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
                        try:
                            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
                        except pynvml.NVMLError_NotFound:
                            continue
                        total, reserved = _memory(pynvml, mig)
                        migs.append(
                            Device(
                                -1,
                                _text(pynvml.nvmlDeviceGetUUID(mig)),
                                total,
                                _text(pynvml.nvmlDeviceGetName(mig)),
                                reserved=reserved,
                                parent=i,
                            )
                        )
                total, reserved = _memory(pynvml, handle)
                gpus.append(replace(device, total_memory=total, reserved=reserved))
            except pynvml.NVMLError as exc:
                notes.append(f"GPU {i} skipped: NVML: {exc}")
        numbered = [replace(m, index=count + k) for k, m in enumerate(migs)]
        from .nvmlversion import nvml_version_problem

        problem = nvml_version_problem()
        if problem:
            notes.append(problem)
        return tuple(gpus + numbered), "; ".join(notes)
    finally:
        pynvml.nvmlShutdown()


def _mig_mode(pynvml: Any, handle: Any) -> bool:
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
    except pynvml.NVMLError:  # NOT_SUPPORTED on GPUs without MIG
        return False
    return bool(current)


def _memory(pynvml: Any, handle: Any) -> tuple[int, int]:
    """(total, reserved): v2 memory info where the driver has it (reserved is what CUDA cannot use)."""
    try:
        info = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
        return int(info.total), int(info.reserved)
    except (pynvml.NVMLError, AttributeError, TypeError):
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).total), 0


def select_visible(devices: tuple[Device, ...], visible: str) -> tuple[Device, ...]:
    """The devices a CUDA process sees under ``CUDA_VISIBLE_DEVICES=visible``, in its order.

    Entries are GPU indices, or ``GPU-``/``MIG-`` UUIDs or unique prefixes of them (a bare
    prefix means ``GPU-…``); like CUDA, an empty value hides every GPU, and an invalid
    or repeated entry ends the list. A GPU in MIG mode (by index or UUID) is invalid.
    """
    chosen: list[Device] = []
    for raw in visible.split(","):
        entry = raw.strip()
        if not entry:
            break
        match: Device | None = None
        if re.fullmatch(r"-?\d+", entry):
            idx = int(entry)
            match = next((d for d in devices if d.index == idx and d.parent is None), None)
        else:
            key = entry if entry.upper().startswith(("GPU-", "MIG-")) else f"GPU-{entry}"
            candidates = [d for d in devices if d.uuid.lower().startswith(key.lower())]
            match = candidates[0] if len(candidates) == 1 else None
        if match is None or match in chosen or _mig_mode_gpu(match, devices):
            break
        chosen.append(match)
    return tuple(chosen)


def discover(spec: str, environ: Mapping[str, str] | None = None) -> Inventory:
    """Resolve a ``--gpus`` value into an :class:`Inventory`.

    ``auto`` asks NVML and honours an outer ``CUDA_VISIBLE_DEVICES`` (indices, UUIDs, MIG
    UUIDs); ``none`` means no GPUs; ``0,2,3`` picks physical indices (each must be visible
    under an outer ``CUDA_VISIBLE_DEVICES``); ``sim:…`` builds simulated devices.
    """
    env = os.environ if environ is None else environ
    value = spec.strip()
    lowered = value.lower()
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if lowered == "none":
        return Inventory((), "none", "--gpus none")
    if lowered.startswith(SIM_PREFIX):
        found, note = sim_machine(value)
        return _visible_part(found, value, note, visible)
    if lowered == "auto" or re.fullmatch(r"\d+(\s*,\s*\d+)*", value):
        try:
            found, note = nvml_devices()
        except NvmlUnavailable as exc:
            if lowered == "auto":
                return Inventory((), "auto", str(exc))
            raise DeviceSpecError(f"--gpus {spec!r}: {exc}") from None
        if lowered == "auto":
            return _visible_part(found, "nvml", note, visible)
        seen = _usable(found, visible)
        wanted = [int(x) for x in value.split(",")]
        known = {d.index: d for d in found if d.parent is None}
        missing = [i for i in wanted if i not in known]
        if missing:
            raise DeviceSpecError(
                f"--gpus {spec!r}: no usable GPU with index {missing}; this machine has {sorted(known)}"
                + (f" ({note})" if note else "")
            )
        if len(set(wanted)) != len(wanted):
            raise DeviceSpecError(f"--gpus {spec!r}: an index is listed twice")
        hidden = [i for i in wanted if known[i] not in seen]
        if hidden:
            raise DeviceSpecError(
                f"--gpus {spec!r}: GPU {hidden} {'is' if len(hidden) == 1 else 'are'} hidden by "
                f"CUDA_VISIBLE_DEVICES={visible!r} (or in MIG mode); expected indices CUDA can see"
            )
        return Inventory(tuple(known[i] for i in wanted), "nvml", note, found, visible)
    raise DeviceSpecError(f"--gpus {spec!r}: expected {GPUS_FORM}")


def _usable(found: tuple[Device, ...], visible: str | None) -> tuple[Device, ...]:
    """The devices a run may lease under an outer ``CUDA_VISIBLE_DEVICES``, in its order (every
    visible MIG instance: each lease is used by one process, a subprocess if need be)."""
    return addressable(found) if visible is None else select_visible(found, visible)


def _visible_part(found: tuple[Device, ...], source: str, note: str, visible: str | None) -> Inventory:
    """The inventory of what an outer ``CUDA_VISIBLE_DEVICES`` leaves of ``found``; why, when nothing."""
    seen = _usable(found, visible)
    if not seen:
        note = "; ".join(filter(None, [_why_none(found, visible), note]))
    return Inventory(seen, source, note, found, visible)


def _why_none(found: tuple[Device, ...], visible: str | None) -> str:
    if not found:
        return "NVML reports no usable GPUs"
    if visible is not None:
        listed = ", ".join(f"{d.index}={d.uuid}" for d in found)
        return f"CUDA_VISIBLE_DEVICES={visible!r} matches none of the devices NVML reports ({listed})"
    return "every GPU NVML reports is in MIG mode without instances"
