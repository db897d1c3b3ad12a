"""What the machine has: GPU discovery through NVML, explicit index lists, simulated devices.

Indices are *physical* (NVML's PCI bus order). Everything the plugin sets for CUDA
goes with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so that CUDA's numbering agrees with NVML's.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from .requests import SizeError, format_size, parse_size

SIM_PREFIX = "sim:"
GPUS_FORM = "auto, none, an index list such as 0,2,3, or simulated devices such as sim:4x16GiB"


class DeviceSpecError(ValueError):
    """A ``--gpus`` value that cannot be understood."""


@dataclass(frozen=True)
class Device:
    """One GPU: physical index, UUID, total memory in bytes."""

    index: int
    uuid: str
    total_memory: int
    name: str = ""
    simulated: bool = False


@dataclass(frozen=True)
class Inventory:
    """The GPUs a run may use, in physical-index order."""

    devices: tuple[Device, ...]
    source: str  # how it was found: "sim:4x16GiB", "nvml", "none", ...
    note: str = ""  # why it is empty, when it is

    @property
    def simulated(self) -> bool:
        return any(d.simulated for d in self.devices)

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
        return f"{len(self.devices)} {kind}GPU{'s' if len(self.devices) != 1 else ''} ({parts})"

    def to_wire(self) -> dict[str, object]:
        return {
            "source": self.source,
            "note": self.note,
            "devices": [[d.index, d.uuid, d.total_memory, d.name, d.simulated] for d in self.devices],
        }

    @classmethod
    def from_wire(cls, data: Mapping[str, object]) -> Inventory:
        rows = data["devices"]
        assert isinstance(rows, list)
        devices = tuple(
            Device(index=int(r[0]), uuid=str(r[1]), total_memory=int(r[2]), name=str(r[3]), simulated=bool(r[4]))
            for r in rows
        )
        return cls(devices=devices, source=str(data["source"]), note=str(data.get("note", "")))


def sim_uuid(index: int) -> str:
    """UUID of simulated GPU ``index`` (shaped like NVML's ``GPU-…`` UUIDs)."""
    return f"GPU-51a00000-0000-4000-8000-{index:012d}"


def parse_sim_spec(spec: str) -> tuple[Device, ...]:
    """``sim:4x16GiB`` or ``sim:2x80GiB,2x24GiB`` → simulated devices 0..n-1."""
    body = spec[len(SIM_PREFIX) :] if spec.lower().startswith(SIM_PREFIX) else spec
    devices: list[Device] = []
    if not body.strip():
        raise DeviceSpecError(f"--gpus {spec!r}: no simulated devices given; expected e.g. sim:4x16GiB")
    for part in body.split(","):
        match = re.fullmatch(r"\s*(?:(\d+)\s*[xX*]\s*)?(\S+?)\s*", part)
        if not match:
            raise DeviceSpecError(f"--gpus {spec!r}: cannot read {part!r}; expected COUNTxSIZE such as 4x16GiB")
        count = int(match.group(1)) if match.group(1) else 1
        try:
            size = parse_size(match.group(2))
        except SizeError as exc:
            raise DeviceSpecError(f"--gpus {spec!r}: bad size in {part!r}: {exc}") from None
        if count <= 0 or size <= 0:
            raise DeviceSpecError(f"--gpus {spec!r}: count and size must be positive in {part!r}")
        for _ in range(count):
            index = len(devices)
            devices.append(Device(index, sim_uuid(index), size, f"Simulated GPU {format_size(size)}", True))
    return tuple(devices)


class NvmlUnavailable(RuntimeError):
    """NVML could not be loaded or initialised (no driver, no GPU)."""


def nvml_devices() -> tuple[Device, ...]:
    """All GPUs NVML reports, in NVML (PCI bus) order.

    Untested here: written against nvidia-ml-py's documented API (``nvmlInit``,
    ``nvmlDeviceGetCount``, ``nvmlDeviceGetHandleByIndex``, ``nvmlDeviceGetUUID``,
    ``nvmlDeviceGetMemoryInfo``, ``nvmlDeviceGetName``); the development machines have no
    driver, where ``nvmlInit`` raises and this raises :class:`NvmlUnavailable`.
    """
    try:
        import pynvml
    except ImportError as exc:  # pragma: no cover - nvidia-ml-py is a dependency
        raise NvmlUnavailable(f"nvidia-ml-py is not installed ({exc})") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise NvmlUnavailable(f"NVML unavailable: {exc}") from None
    try:
        devices = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            total = pynvml.nvmlDeviceGetMemoryInfo(handle).total
            devices.append(
                Device(
                    index=i,
                    uuid=uuid.decode() if isinstance(uuid, bytes) else str(uuid),
                    total_memory=int(total),
                    name=name.decode() if isinstance(name, bytes) else str(name),
                )
            )
        return tuple(devices)
    finally:
        pynvml.nvmlShutdown()


def select_visible(devices: tuple[Device, ...], visible: str) -> tuple[Device, ...]:
    """Keep the devices an outer ``CUDA_VISIBLE_DEVICES`` allows, in its order.

    Entries are indices or (prefixes of) UUIDs; like CUDA, an invalid entry ends the list.
    """
    chosen: list[Device] = []
    for raw in visible.split(","):
        entry = raw.strip()
        if not entry:
            break
        match: Device | None = None
        if entry.isdigit() or (entry.startswith("-") and entry[1:].isdigit()):
            idx = int(entry)
            match = next((d for d in devices if d.index == idx), None)
        else:
            key = entry if entry.startswith(("GPU-", "MIG-")) else f"GPU-{entry}"
            candidates = [d for d in devices if d.uuid.startswith(key)]
            match = candidates[0] if len(candidates) == 1 else None
        if match is None or match in chosen:
            break
        chosen.append(match)
    return tuple(chosen)


def discover(spec: str, environ: Mapping[str, str] | None = None) -> Inventory:
    """Resolve a ``--gpus`` value into an :class:`Inventory`.

    ``auto`` asks NVML and honours an outer ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs);
    ``none`` means no GPUs; ``0,2,3`` picks physical indices; ``sim:…`` builds simulated
    devices.
    """
    env = os.environ if environ is None else environ
    value = spec.strip()
    lowered = value.lower()
    if lowered == "none":
        return Inventory((), "none", "--gpus none")
    if lowered.startswith(SIM_PREFIX):
        return Inventory(parse_sim_spec(value), value)
    if lowered == "auto" or re.fullmatch(r"\d+(\s*,\s*\d+)*", value):
        try:
            found = nvml_devices()
        except NvmlUnavailable as exc:
            if lowered == "auto":
                return Inventory((), "auto", str(exc))
            raise DeviceSpecError(f"--gpus {spec!r}: {exc}") from None
        if lowered == "auto":
            visible = env.get("CUDA_VISIBLE_DEVICES")
            if visible is not None:
                found = select_visible(found, visible)
            return Inventory(found, "nvml", "" if found else "NVML reports no GPUs")
        wanted = [int(x) for x in value.split(",")]
        known = {d.index: d for d in found}
        missing = [i for i in wanted if i not in known]
        if missing:
            raise DeviceSpecError(f"--gpus {spec!r}: no GPU with index {missing}; this machine has {sorted(known)}")
        if len(set(wanted)) != len(wanted):
            raise DeviceSpecError(f"--gpus {spec!r}: an index is listed twice")
        return Inventory(tuple(known[i] for i in wanted), "nvml")
    raise DeviceSpecError(f"--gpus {spec!r}: expected {GPUS_FORM}")
