"""The fake GPU machine a spec describes: ``sim:4x16GiB`` plus options (pure, no I/O).

Grammar (the value of ``--gpus sim:…`` and of ``PYTEST_GPU_FAKE_GPUS``)::

    [VENDOR:][sim:]GROUP[,GROUP...][;OPTION...]
    VENDOR   nvidia (the default), amd or xpu (:data:`pytest_gpu.vendors.kinds.ALL`): whose
             driver libraries the fake machine has (amd: a fake libamd_smi.so for the
             ``amdsmi`` package instead of a fake NVML; xpu: a fake Level Zero loader,
             ``libze_loader.so.1``; MIG and the NVML-only options below do not apply)
    GROUP    COUNTxSIZE or SIZE              e.g. 4x16GiB, 2x80GiB,2x24GiB
    OPTION   mig:I=COUNTxSIZE[,COUNTxSIZE]   GPU I is in MIG mode with these instances
             fault:I=KIND                    NVML refuses GPU I's handle: no_permission,
                                             gpu_is_lost or unknown (it is still counted)
             reserved=SIZE | reserved=P%     memory the driver keeps on every GPU (NVML's
                                             ``reserved``; CUDA cannot allocate it)
             pidns=OFFSET                    NVML reports host pids: pid + OFFSET (a
                                             container's pid namespace)
             no-v3                           the driver lacks
                                             nvmlDeviceGetComputeRunningProcesses_v3
             no-usage                        NVML lists processes without their memory
                                             (``usedGpuMemory`` not available, as under
                                             Windows WDDM)
             proc-unit=SIZE                  (amd) per-process memory in amdsmi's process list
                                             is rounded down to a multiple of SIZE
             proc-refresh=MS                 (amd) amdsmi's process list is a snapshot at most
                                             MS milliseconds old
             rocr-order=I,J,...              (amd) ROCr enumerates the GPUs in this order (HSA
                                             nodes), not in amdsmi's: every index, once
             context=SIZE                    what one CUDA context takes on a GPU here
                                             (default: the run's --gpu-context-overhead,
                                             which then is an assumption the machine may
                                             contradict, as real contexts do)
             slowdown=share                  GPUs share their compute: a test's compute
                                             (``sim.compute``, ``sim.hold``) runs 1/k as
                                             fast while k processes compute on its GPU (or
                                             MIG instance), as real GPUs time-slice between
                                             contexts (default: every process computes at
                                             full speed, however many share a GPU)

Limits: at most :data:`MAX_GPUS` GPUs, :data:`MAX_MIG` MIG instances per GPU, and
:data:`MAX_SIZE` per GPU or instance.

Units: CUDA addresses GPUs that are not in MIG mode and MIG instances. Unit ``i`` for
``i < len(gpus)`` is GPU ``i`` (NVML's index); MIG instances follow, numbered on from
``len(gpus)``, so a plain GPU's unit number is its NVML index.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..base.requests import SizeError, format_size, parse_size
from ..vendors import kinds
from ..vendors.devices import Device

PREFIX = "sim:"
# The fake libnvidia-ml.so.1 has room for this many (fake_nvml.c's MAX_GPUS, MAX_MIG);
# 7 is also what A100/H100 allow. Checked before expanding COUNTxSIZE: sim:30000x1GiB
# would otherwise build a machine for minutes.
MAX_GPUS = 64
MAX_MIG = 7
MAX_SIZE = 2**40  # 1 TiB: several times any GPU made; larger is a typo, not a machine
MAX_SIZE_TEXT = "1TiB"
FAULTS = ("no_permission", "gpu_is_lost", "unknown")
FORM = (
    "COUNTxSIZE groups such as sim:4x16GiB or sim:2x80GiB,2x24GiB, optionally followed by "
    "';'-separated options mig:I=COUNTxSIZE, fault:I=no_permission|gpu_is_lost|unknown, reserved=SIZE|P%, "
    "pidns=OFFSET, no-v3, no-usage, context=SIZE, slowdown=share; on amd: proc-unit=SIZE, proc-refresh=MS, "
    "rocr-order=I,J,..., proc-fds=N, apu, no-uuid=I,J,..."
)


class SpecError(ValueError):
    """A fake GPU spec that cannot be understood."""


@dataclass(frozen=True)
class Unit:
    """One CUDA-addressable device of the fake machine: a GPU, or a MIG instance."""

    index: int  # unit number (a plain GPU's is its NVML index)
    uuid: str
    total: int  # bytes NVML reports as total
    reserved: int  # bytes the driver keeps (not allocatable)
    name: str
    parent: int | None = None  # NVML index of the GPU a MIG instance lives on
    slot: int = 0  # MIG instance slot on its parent


@dataclass(frozen=True)
class Gpu:
    """One physical GPU as NVML numbers it."""

    index: int
    uuid: str
    total: int
    reserved: int
    name: str
    mig: tuple[Unit, ...] = ()  # non-empty: the GPU is in MIG mode
    fault: str = "none"


@dataclass(frozen=True)
class Machine:
    """A fake GPU machine."""

    spec: str
    gpus: tuple[Gpu, ...]
    pidns: int = 0
    no_v3: bool = False
    no_usage: bool = False
    context: int | None = None  # bytes of one CUDA context here (None: the ledger's configured overhead)
    vendor: str = kinds.DEFAULT.name  # whose driver libraries the machine has (pytest_gpu.vendors.kinds)
    proc_unit: int = 0  # amd: per-process figures rounded down to a multiple of this (0: exact bytes)
    proc_refresh_ms: int = 0  # amd: how stale amdsmi's process list may be
    rocr_order: tuple[int, ...] = ()  # amd: GPU indices in ROCr's enumeration order (empty: amdsmi's)
    proc_fds: int = 1  # amd: fds each process holds its one DRM client under (older amdsmi sums them)
    apu: bool = False  # amd: an APU (MI300A): amdsmi reports a process's memory as GTT, vram_mem 0
    no_uuid: tuple[int, ...] = ()  # amd: GPUs without a unique id (ROCr's "GPU-XX"), by index
    slowdown: bool = False  # slowdown=share: processes computing on one device share its time

    def units(self) -> tuple[Unit, ...]:
        """Every device unit, GPUs first (MIG-mode GPUs included, never addressable), then MIG instances."""
        plain = tuple(Unit(g.index, g.uuid, g.total, g.reserved, g.name) for g in self.gpus)
        return plain + tuple(u for g in self.gpus for u in g.mig)

    def addressable(self) -> tuple[Unit, ...]:
        """The units CUDA can open: GPUs not in MIG mode, and MIG instances."""
        mig_mode = {g.index for g in self.gpus if g.mig}
        return tuple(u for u in self.units() if u.index not in mig_mode)

    def devices(self) -> tuple[tuple[Device, ...], str]:
        """Every usable device (what its driver would report: NVML, amdsmi, Sysman), and a note on
        what was left out: a GPU with a fault, which the driver refuses."""
        refused = {g.index: g.fault for g in self.gpus if g.fault != "none"}
        found = tuple(
            Device(u.index, u.uuid, u.total, u.name, True, u.reserved, u.parent)
            for u in self.addressable()
            if u.index not in refused and u.parent not in refused
        )
        note = "; ".join(f"GPU {i} skipped: NVML refuses it ({kind})" for i, kind in refused.items())
        return found, note

    def all_devices(self) -> tuple[Device, ...]:
        """Every unit as a device (GPUs in MIG mode included), as the simulated runtime enumerates them."""
        return tuple(Device(u.index, u.uuid, u.total, u.name, True, u.reserved, u.parent) for u in self.units())


def gpu_uuid(index: int) -> str:
    """UUID of simulated GPU ``index`` (shaped like NVML's ``GPU-…`` UUIDs)."""
    return kinds.NVIDIA.sim_uuid(index)


def amd_uuid(index: int) -> str:
    """ROCr's UUID of simulated AMD GPU ``index``: ``GPU-`` and the 16 hex digits of its
    unique id (what ``ROCR_VISIBLE_DEVICES`` and amdsmi's ``hip_uuid`` name it by)."""
    return kinds.AMD.sim_uuid(index)


def xpu_uuid(index: int) -> str:
    """The UUID of simulated Intel GPU ``index``, as the fake Level Zero Sysman gives its 16 bytes
    (fake_zes.c's ``uuid_of``): hex digits in the 8-4-4-4-12 form, without a prefix."""
    return kinds.XPU.sim_uuid(index)


def split_vendor(spec: str) -> tuple[str, str]:
    """``amd:sim:8x192GiB`` -> (``amd``, ``sim:8x192GiB``); no vendor named -> the default (``nvidia``)."""
    text = spec.strip()
    head, sep, rest = text.partition(":")
    if sep and head.strip().lower() in kinds.NAMES:
        return head.strip().lower(), rest.strip()
    return kinds.DEFAULT.name, text


def mig_of(uuid: str) -> tuple[int, int] | None:
    """(GPU, slot) of the simulated MIG instance whose UUID is ``uuid`` (:func:`mig_uuid`), or ``None``."""
    found = re.fullmatch(r"MIG-51a00000-0000-4000-9000-(\d{6})(\d{6})", uuid)
    return None if found is None else (int(found.group(1)), int(found.group(2)))


def gpu_of(uuid: str) -> tuple[kinds.Kind, int] | None:
    """(vendor, index) of the simulated GPU whose UUID is ``uuid``, or ``None``."""
    for kind in kinds.ALL:
        index = kind.sim_index(uuid)
        if index is not None:
            return kind, index
    return None


def mig_uuid(parent: int, slot: int) -> str:
    """UUID of MIG instance ``slot`` on simulated GPU ``parent`` (shaped like ``MIG-…``)."""
    return f"MIG-51a00000-0000-4000-9000-{parent:06d}{slot:06d}"


def _groups(spec: str, body: str, what: str, device: str, holder: str, limit: int) -> list[int]:
    """The sizes of ``body``'s COUNTxSIZE groups: at most ``limit`` ``device``s, which ``holder`` has."""
    sizes: list[int] = []
    if not body.strip():
        raise SpecError(f"{spec!r}: no {what} given; expected e.g. sim:4x16GiB")
    for part in body.split(","):
        other = re.fullmatch(r"\s*(\d+)\s*([^\w\s.])\s*(\d\S*)\s*", part)
        if other:  # "4*16GiB": a separator this grammar does not have
            raise SpecError(
                f"{spec!r}: unknown separator {other.group(2)!r} in {part.strip()!r}; expected COUNTxSIZE "
                f"such as {other.group(1)}x{other.group(3)}"
            )
        match = re.fullmatch(r"\s*(?:(\d+)\s*[xX]\s*)?(\S+?)\s*", part)
        if not match:
            raise SpecError(f"{spec!r}: cannot read {part!r}; expected COUNTxSIZE such as 4x16GiB")
        count = int(match.group(1)) if match.group(1) else 1
        if re.fullmatch(r"\d+[xX]", part.strip()):  # "4x": the size is missing, not an unknown unit
            raise SpecError(f"{spec!r}: no size after {part.strip()!r}; expected COUNTxSIZE such as 4x16GiB")
        if re.fullmatch(r"[\d.]+", match.group(2)):  # "4x16": 16 bytes is never what was meant
            raise SpecError(
                f"{spec!r}: {part.strip()!r} has no unit; expected COUNTxSIZE with a unit, such as "
                f"{count}x{match.group(2)}GiB"
            )
        try:
            size = parse_size(match.group(2))
        except SizeError as exc:
            raise SpecError(f"{spec!r}: bad size in {part!r}: {exc}") from None
        if count <= 0 or size <= 0:
            raise SpecError(f"{spec!r}: count and size must be positive in {part!r}")
        if size > MAX_SIZE:
            raise SpecError(f"{spec!r}: {part.strip()!r}: a simulated {device} has at most {MAX_SIZE_TEXT}")
        if len(sizes) + count > limit:
            raise SpecError(f"{spec!r}: {len(sizes) + count} {device}s; {holder} has at most {limit}")
        sizes.extend([size] * count)
    return sizes


def check_context(spec: str, sizes: list[int], context: int, where: str) -> None:
    """Refuse a machine with a device no larger than one CUDA ``context`` (``where``: whose
    size that is): no test could ever get memory there."""
    small = min(sizes, default=context + 1)
    if small <= context:
        raise SpecError(
            f"{spec!r}: a device of {format_size(small)} is no larger than one CUDA context "
            f"({format_size(context)}, {where}); expected COUNTxSIZE with sizes larger than that, such as 4x16GiB"
        )


def _gpu_index(spec: str, option: str, raw: str, count: int) -> int:
    if not raw.strip().isdigit() or int(raw) >= count:
        raise SpecError(f"{spec!r}: {option}: {raw!r} is not a GPU index (0..{count - 1})")
    return int(raw)


def parse(spec: str) -> Machine:
    """Parse a spec (with or without ``sim:``) into a :class:`Machine`; :class:`SpecError` names the problem."""
    text = spec.strip()
    vendor, rest = split_vendor(text)
    whose = kinds.of(vendor)
    body = rest[len(PREFIX) :] if rest.lower().startswith(PREFIX) else rest
    groups, *options = body.split(";")
    sizes = _groups(spec, groups, "simulated devices", "GPU", "a simulated machine", MAX_GPUS)
    mig: dict[int, list[int]] = {}
    faults: dict[int, str] = {}
    reserved_of: int | float = 0
    pidns = 0
    no_v3 = False
    no_usage = False
    context: int | None = None
    proc_unit = 0
    proc_refresh_ms = 0
    rocr_order: tuple[int, ...] = ()
    proc_fds = 1
    apu = False
    no_uuid: tuple[int, ...] = ()
    slowdown = False
    for raw in options:
        option = raw.strip()
        if not option:
            continue
        key, _, value = option.partition("=")
        key = key.strip().lower()
        owner = next((k for k in kinds.ALL if k.sim_options and key.startswith(k.sim_options)), whose)
        if owner is not whose:  # another vendor's driver's option
            raise SpecError(f"{spec!r}: " + owner.sim_option_refused.format(option=option, vendor=vendor))
        if key.startswith("mig:"):
            index = _gpu_index(spec, option, key[4:], len(sizes))
            mig[index] = _groups(spec, value, f"MIG instances for GPU {index}", "MIG instance", f"GPU {index}", MAX_MIG)
            if sum(mig[index]) > sizes[index]:
                raise SpecError(f"{spec!r}: {option}: MIG instances add up to more than GPU {index}'s memory")
        elif key.startswith("fault:"):
            kind = value.strip().lower()
            if kind not in FAULTS:
                raise SpecError(f"{spec!r}: {option}: unknown fault {value!r}; expected one of {', '.join(FAULTS)}")
            faults[_gpu_index(spec, option, key[6:], len(sizes))] = kind
        elif key == "reserved":
            value = value.strip()
            try:
                reserved_of = float(value[:-1]) / 100 if value.endswith("%") else parse_size(value)
            except (ValueError, SizeError):
                raise SpecError(f"{spec!r}: {option}: expected a size or a percentage such as 1%") from None
            if isinstance(reserved_of, float) and not 0 <= reserved_of < 1:  # -5%, nan%, inf% read as floats
                raise SpecError(f"{spec!r}: {option}: expected a percentage from 0% to below 100%")
        elif key == "pidns":
            if not value.strip().isdigit():
                raise SpecError(f"{spec!r}: {option}: expected a non-negative integer pid offset")
            pidns = int(value)
        elif key == "no-v3" and not value:
            no_v3 = True
        elif key == "no-usage" and not value:
            no_usage = True
        elif key == "proc-unit":
            try:
                proc_unit = parse_size(value.strip())
            except SizeError:
                raise SpecError(f"{spec!r}: {option}: expected a size such as 1MiB") from None
        elif key == "rocr-order":
            parts = [part.strip() for part in value.split(",")]
            if not all(part.isdigit() for part in parts) or sorted(map(int, parts)) != list(range(len(sizes))):
                raise SpecError(
                    f"{spec!r}: {option}: expected every GPU index 0..{len(sizes) - 1} once, such as "
                    f"rocr-order={','.join(map(str, reversed(range(len(sizes)))))}"
                )
            rocr_order = tuple(map(int, parts))
        elif key == "proc-fds":
            if not value.strip().isdigit() or not 1 <= int(value) <= 16:
                raise SpecError(f"{spec!r}: {option}: expected a count of fds from 1 to 16, such as proc-fds=2")
            proc_fds = int(value)
        elif key == "apu" and not value:
            apu = True
        elif key == "no-uuid":
            no_uuid = tuple(sorted({_gpu_index(spec, option, part, len(sizes)) for part in value.split(",")}))
        elif key == "proc-refresh":
            if not value.strip().isdigit():
                raise SpecError(f"{spec!r}: {option}: expected whole milliseconds such as 1000")
            proc_refresh_ms = int(value)
        elif key == "context":
            try:
                context = parse_size(value.strip())
            except SizeError:
                raise SpecError(f"{spec!r}: {option}: expected a size such as 700MiB") from None
            if not 0 < context <= MAX_SIZE:
                raise SpecError(f"{spec!r}: {option}: a context takes more than 0 bytes and at most {MAX_SIZE_TEXT}")
        elif key == "slowdown":
            if value.strip().lower() != "share":
                raise SpecError(f"{spec!r}: {option}: expected slowdown=share (compute shared by who computes at once)")
            slowdown = True
        else:
            raise SpecError(f"{spec!r}: unknown option {option!r}; expected {FORM}")
    if context is not None:
        check_context(spec, [*sizes, *(size for sizes_ in mig.values() for size in sizes_)], context, "context=")
    gpus = []
    next_unit = len(sizes)
    for index, size in enumerate(sizes):
        reserved = int(size * reserved_of) if isinstance(reserved_of, float) else reserved_of
        reserved -= reserved % (2 * 2**20)  # drivers reserve in 2 MiB pages
        if reserved >= size:
            raise SpecError(f"{spec!r}: reserved memory must be less than each GPU's size")
        instances = []
        for slot, mig_size in enumerate(mig.get(index, ())):
            instances.append(
                Unit(
                    next_unit,
                    mig_uuid(index, slot),
                    mig_size,
                    0,
                    f"Simulated MIG {format_size(mig_size)} on GPU {index}",
                    parent=index,
                    slot=slot,
                )
            )
            next_unit += 1
        gpus.append(
            Gpu(
                index,
                whose.sim_uuid(index),
                size,
                reserved,
                f"Simulated {whose.label + ' ' if whose.named else ''}GPU {format_size(size)}",
                tuple(instances),
                faults.get(index, "none"),
            )
        )
    return Machine(
        text,
        tuple(gpus),
        pidns,
        no_v3,
        no_usage,
        context,
        vendor,
        proc_unit,
        proc_refresh_ms,
        rocr_order,
        proc_fds,
        apu,
        no_uuid,
        slowdown,
    )
