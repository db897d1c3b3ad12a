"""AMD ROCm: GPUs found through amdsmi, ROCm's visibility variables, amdsmi's process list.

Sources (file and commit in docs-incoming/vendors-status.md): ROCm/amdsmi's ``amdsmi.h`` and
``amd_smi.cc`` and the ``amdsmi`` 7.0.2 package from PyPI (``amdsmi_interface.py``,
``amdsmi_wrapper.py``); ROCm's "GPU isolation techniques" page; torch's
``torch/cuda/__init__.py`` (``_parse_visible_devices`` on ROCm).

Names. A device's :attr:`Device.uuid` here is ROCr's: ``GPU-`` and the 16 hex digits of its
unique id, which ``ROCR_VISIBLE_DEVICES`` accepts and amdsmi reports as the ``hip_uuid`` of
``amdsmi_get_gpu_enumeration_info`` (amdsmi's own 36-character UUID is another string). Its
:attr:`Device.index` is amdsmi's (what ``amd-smi`` prints), which need not be the index HIP
or ROCr give the same GPU (pytorch #131901, ROCm/amdsmi #175): so leases name GPUs by UUID,
never by index, and the inventory's ``machine`` lists the GPUs in ROCr's order (by HSA node,
``hsa_id``), the order ``ROCR_VISIBLE_DEVICES``' indices count in.

Visibility, as the ROCm stack applies it (:func:`rocm_view`): ``ROCR_VISIBLE_DEVICES`` first,
by ROCr's rules (:func:`select`: indices or UUIDs into ROCr's enumeration; ROCm/ROCR-Runtime
``core/inc/amd_filter_device.h`` and ``core/runtime/amd_filter_device.cpp`` at c7785a6d), then,
in what ROCr left, ``HIP_VISIBLE_DEVICES`` or, when that is unset or empty,
``CUDA_VISIBLE_DEVICES``, by HIP's (:func:`hip_select`: ROCm/clr
``rocclr/device/rocm/rocdevice.cpp`` at f9f995c6). ``GPU_DEVICE_ORDINAL`` is ROCclr's for
OpenCL: HIP does not read it. torch's own count before CUDA starts
(``torch.cuda._parse_visible_devices`` on ROCm) has rules of its own and is not this model.

Units (``amdsmi.h``): VRAM total and usage in bytes; a process's ``mem`` and
``memory_usage.vram_mem`` in bytes. Drivers differ in how fine and how fresh the process
list is: the verifier judges a violation again once the list's staleness has passed
(``--gpu-amd-process-lag``; ``--gpu-amd-lag-wait`` also waits it out for a shorter test), and
every violation judged from it says how coarse it may be (:func:`pytest_gpu.gpu.verification.amd_caveat`).

Not run on an AMD machine here: CI runs it against the fake ``libamd_smi.so``
(:mod:`pytest_gpu.sim.amdsmi`) through the real ``amdsmi`` package.
"""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import libraries
from .devices import Device

ROCR_VAR = "ROCR_VISIBLE_DEVICES"
ORDINAL_VAR = "GPU_DEVICE_ORDINAL"  # ROCclr's for OpenCL: a lease sets it, HIP does not read it
HIP_VARS = ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")  # HIP's first: it wins when set and not empty
#: Every variable that narrows what a ROCm process (HIP or OpenCL) sees, outermost first.
VISIBILITY_VARS = (ROCR_VAR, ORDINAL_VAR, *HIP_VARS)


class AmdSmiUnavailable(RuntimeError):
    """amdsmi is not installed, finds no ``libamd_smi.so``, or has no amdgpu driver to talk to."""


def _amdsmi() -> Any:
    """The ``amdsmi`` package, initialised for AMD GPUs; :class:`AmdSmiUnavailable` says why not."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):  # the package prints its load failure to stdout
            amdsmi = libraries.load("amdsmi")
    except ImportError as exc:
        raise AmdSmiUnavailable(f"amdsmi is not installed ({exc}; pip install 'pytest-gpu[rocm]')") from None
    except (KeyError, OSError, AttributeError) as exc:  # its wrapper binds libamd_smi.so at import
        why = " ".join(printed.getvalue().split()) or f"{type(exc).__name__}: {exc}"
        raise AmdSmiUnavailable(f"amdsmi cannot load libamd_smi.so ({why})") from None
    try:
        amdsmi.amdsmi_init(amdsmi.AmdSmiInitFlags.INIT_AMD_GPUS)
    except amdsmi.AmdSmiException as exc:
        raise AmdSmiUnavailable(f"amdsmi unavailable: {said(exc)}") from None
    return amdsmi


def said(exc: Exception) -> str:
    """amdsmi's error in one line (its ``str`` spans two)."""
    info = getattr(exc, "get_error_info", None)
    text = info(detailed=False) if callable(info) else str(exc)
    return " ".join(str(text).split())


def amdsmi_devices() -> tuple[tuple[Device, ...], str]:
    """Every AMD GPU amdsmi reports, in ROCr's order, with amdsmi's indices; and a note.

    A GPU amdsmi counts but cannot query (no permission, a lost device) is left out and named
    in the note, as NVML's are. :class:`AmdSmiUnavailable` when amdsmi cannot be used.
    """
    amdsmi = _amdsmi()
    notes: list[str] = []
    found: list[tuple[int, Device]] = []
    try:
        for index, handle in enumerate(amdsmi.amdsmi_get_processor_handles()):
            try:
                uuid, hsa_id = _rocr_uuid(amdsmi, handle)
                total = int(amdsmi.amdsmi_get_gpu_memory_total(handle, amdsmi.AmdSmiMemoryType.VRAM))
                name = str(amdsmi.amdsmi_get_gpu_asic_info(handle).get("market_name", ""))
                bdf = str(amdsmi.amdsmi_get_gpu_device_bdf(handle))
            except amdsmi.AmdSmiException as exc:
                notes.append(f"GPU {index} skipped: amdsmi: {said(exc)}")
                continue
            found.append((hsa_id, Device(index, uuid, total, f"{name} ({bdf})" if name else bdf)))
    finally:
        amdsmi.amdsmi_shut_down()
    found.sort(key=lambda pair: pair[0])
    return tuple(device for _, device in found), "; ".join(notes)


def _rocr_uuid(amdsmi: Any, handle: Any) -> tuple[str, int]:
    """(ROCr's ``GPU-…`` UUID, the HSA node that orders ROCr's enumeration) of ``handle``.

    From ``amdsmi_get_gpu_enumeration_info`` where the library has it (amdsmi 6.4 on); before
    that, from the ASIC serial, which ROCr's unique id is, in amdsmi's order."""
    getter = getattr(amdsmi, "amdsmi_get_gpu_enumeration_info", None)
    if getter is not None:
        try:
            info = getter(handle)
            uuid, hsa = str(info.get("hip_uuid", "")), info.get("hsa_id")
            if uuid.upper().startswith("GPU-") and isinstance(hsa, int):
                return uuid_key(uuid), hsa
        except amdsmi.AmdSmiException as exc:
            if getattr(exc, "err_code", None) not in (2, 3):  # NOT_SUPPORTED, NOT_YET_IMPLEMENTED: fall back
                raise
    serial = str(amdsmi.amdsmi_get_gpu_asic_info(handle).get("asic_serial", ""))
    if not serial.upper().startswith("0X"):
        raise AmdSmiUnavailable(f"amdsmi gives no unique id for a GPU (asic_serial {serial!r})")
    return f"GPU-{int(serial, 16):016x}", 1 << 32  # after every GPU that has an HSA node


def uuid_key(uuid: str) -> str:
    """A ROCr UUID as this module spells it: ``GPU-`` and lower-case hex digits."""
    return "GPU-" + uuid[4:].lower() if uuid.upper().startswith("GPU-") else uuid


def _entries(value: str) -> list[str]:
    return [entry.strip() for entry in value.split(",")]


def select(devices: tuple[Device, ...], value: str) -> tuple[Device, ...]:
    """The devices ``ROCR_VISIBLE_DEVICES=value`` leaves of ``devices`` (ROCr's enumeration), in its order.

    ROCr's ``RvdFilter`` (ROCR-Runtime at c7785a6d): entries are indices into ``devices`` or
    ``GPU-`` UUIDs (a unique prefix of one, any case), each trimmed; an empty value hides every
    device; an entry that names none, or one already chosen, ends the list.
    """
    chosen: list[Device] = []
    for entry in _entries(value):
        match: Device | None = None
        if re.fullmatch(r"\d+", entry):
            position = int(entry)
            match = devices[position] if position < len(devices) else None
        elif entry.upper().startswith("GPU-") and len(entry) > 4:
            candidates = [d for d in devices if d.uuid.lower().startswith(entry.lower())]
            match = candidates[0] if len(candidates) == 1 else None
        if match is None or match in chosen:
            break
        chosen.append(match)
    return tuple(chosen)


def hip_select(devices: tuple[Device, ...], value: str) -> tuple[Device, ...]:
    """The devices HIP keeps of ``devices`` (what ROCr left, in its order) for ``HIP_VISIBLE_DEVICES=value``.

    ROCm/clr ``rocclr/device/rocm/rocdevice.cpp`` (``Device::init``, at f9f995c6): an empty
    value narrows nothing; an entry containing ``GPU-`` is the first device whose UUID contains
    it (case as ROCr spells UUIDs: lower-case hex), else an index, written exactly (``1``, not
    ``01`` or `` 1``); an invalid entry ends the list, a repeated one is skipped; a comma at
    the very end is not an entry.
    """
    if not value:
        return devices
    entries = value.split(",")
    if len(entries) > 1 and entries[-1] == "":
        entries.pop()  # clr's loop stops when the position passes the string's end
    chosen: list[int] = []
    for entry in entries:
        if "GPU-" in entry:
            entry = next((str(n) for n, d in enumerate(devices) if entry in d.uuid), entry)
        if not re.fullmatch(r"0|[1-9]\d*", entry) or int(entry) >= len(devices):
            break  # clr: "anything to the right of invalid deviceId has to be discarded"
        if int(entry) not in chosen:
            chosen.append(int(entry))
    return tuple(devices[n] for n in chosen)


def rocm_view(machine: tuple[Device, ...], environ: Mapping[str, str]) -> list[int]:
    """amdsmi indices of the devices a HIP process started under ``environ`` enumerates, in its
    device order (``hip:0`` / torch's ``cuda:0`` first); ``machine`` is in ROCr's order.

    ``ROCR_VISIBLE_DEVICES`` by ROCr's rules, then HIP's variable by clr's (module docstring);
    ``GPU_DEVICE_ORDINAL`` is not read, as HIP does not read it."""
    seen = machine
    rocr = environ.get(ROCR_VAR)
    if rocr is not None:
        seen = select(seen, rocr)
    hip = environ.get(HIP_VARS[0]) or environ.get(HIP_VARS[1]) or ""  # clr: HIP's when non-empty
    return [d.index for d in hip_select(seen, hip)]


def lease_env(uuids: Sequence[str]) -> dict[str, str]:
    """What a subprocess needs to see exactly the GPUs ``uuids`` (ROCr's), in this order, as
    ``cuda:0``, ``cuda:1``…

    ``ROCR_VISIBLE_DEVICES`` names them by UUID (indices may not be ROCr's).
    ``HIP_VISIBLE_DEVICES`` and ``CUDA_VISIBLE_DEVICES`` name the same UUIDs, which select, in
    the same order, what ROCr left: every variable a program may read says the lease, as on
    NVIDIA (``os.environ["CUDA_VISIBLE_DEVICES"] == gpu.visible_devices``), and an outer value of
    theirs cannot narrow it. ``GPU_DEVICE_ORDINAL`` takes indices only: ``0,1,…``. Names that
    are not UUIDs (a simulated machine's indices) are counted, ``0,1,…``, in HIP's too.
    (Frameworks that refuse ``ROCR_VISIBLE_DEVICES`` beside ``HIP_VISIBLE_DEVICES``, as verl
    does, need HIP's and CUDA's removed: docs-incoming/vendors.md.)
    """
    ordinals = ",".join(str(n) for n in range(len(uuids)))
    named = ",".join(uuids) if all(u.upper().startswith("GPU-") for u in uuids) else ordinals
    return {ROCR_VAR: ",".join(uuids), ORDINAL_VAR: ordinals, **dict.fromkeys(HIP_VARS, named)}


def outer(environ: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The ROCm visibility variables set in ``environ`` (what a run started with)."""
    return tuple((name, environ[name]) for name in VISIBILITY_VARS if environ.get(name) is not None)


@dataclass
class AmdUsage:
    """One look at amdsmi's memory figures for some GPUs (by ROCr UUID).

    ``used``/``total``: VRAM in bytes (the driver's own reservation counts as used);
    ``processes``: each process's VRAM in bytes as the process list gives it, for the GPUs
    whose processes could be listed (``notes`` says why another could not). How fine and how
    fresh the per-process figures are is the driver's: the list may be rounded and a moment
    old, and its figures need not add up to ``used``.
    """

    used: dict[str, int] = field(default_factory=dict)
    total: dict[str, int] = field(default_factory=dict)
    processes: dict[str, dict[int, int]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def open_amdsmi() -> tuple[Any, dict[str, Any]]:
    """amdsmi, initialised (the caller shuts it down), and its GPUs' handles by ROCr UUID (a GPU
    it cannot query is left out); :class:`AmdSmiUnavailable` when it cannot be used."""
    amdsmi = _amdsmi()
    handles: dict[str, Any] = {}
    try:
        for handle in amdsmi.amdsmi_get_processor_handles():
            try:
                handles[_rocr_uuid(amdsmi, handle)[0]] = handle
            except amdsmi.AmdSmiException:
                continue  # a GPU it cannot query: named by whoever asks for it
    except amdsmi.AmdSmiException as exc:
        amdsmi.amdsmi_shut_down()
        raise AmdSmiUnavailable(f"amdsmi lists no GPUs: {said(exc)}") from None
    return amdsmi, handles


def amdsmi_usage(uuids: tuple[str, ...] | list[str]) -> AmdUsage:
    """VRAM used and per-process VRAM of the GPUs ``uuids`` (ROCr's), through amdsmi.

    :class:`AmdSmiUnavailable` when amdsmi cannot be used at all; a GPU it cannot query, or
    one no longer present, is named in ``notes``.
    """
    amdsmi, handles = open_amdsmi()
    usage = AmdUsage()
    try:
        for uuid in uuids:
            handle = handles.get(uuid_key(uuid))
            if handle is None:
                usage.notes.append(f"amdsmi cannot query {uuid}")
                continue
            try:
                vram = amdsmi.AmdSmiMemoryType.VRAM
                usage.used[uuid] = int(amdsmi.amdsmi_get_gpu_memory_usage(handle, vram))
                usage.total[uuid] = int(amdsmi.amdsmi_get_gpu_memory_total(handle, vram))
                listed = amdsmi.amdsmi_get_gpu_process_list(handle)
            except amdsmi.AmdSmiException as exc:
                usage.notes.append(f"amdsmi cannot list the processes on {uuid}: {said(exc)}")
                continue
            usage.processes[uuid] = {int(p["pid"]): int(p["memory_usage"]["vram_mem"]) for p in listed}
    finally:
        amdsmi.amdsmi_shut_down()
    return usage
