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
``memory_usage.vram_mem`` in bytes. The process list is read live (no lag by default;
``--gpu-amd-process-lag``, deprecated, still re-checks after a lag it is given), and every
violation judged from it says how coarse it may be (:meth:`Amd.caveat`). Before rocm-6.1.2
the list is of process handles (or structs), turned into records by
``amdsmi_get_gpu_process_info`` (:func:`_record`); figures amdsmi cannot vouch for (an APU's,
or one DRM client counted per fd) are not given (:class:`AmdSampler`).

HIP's device list is pinned and read back (:func:`hip_init`) through ``libamdhip64.so``
(``hipInit``, ``hipGetDeviceCount``, ``hipDeviceGet`` and ``hipDeviceGetUuid`` per ordinal,
whose 16 bytes are the ASCII hex digits of ROCr's ``GPU-<16 hex>`` UUID: ROCm/clr
``rocdevice.cpp`` at f9f995c6), matched to amdsmi's UUIDs; the library torch bundles is
preferred, so that the process has one HIP runtime. Without it the view is predicted from
the ROCm visibility variables the process pinned with (:func:`rocm_view`).

Not run on an AMD machine here: CI runs it against the fake ``libamd_smi.so``
(:mod:`pytest_gpu.sim.amdsmi`) through the real ``amdsmi`` package, and the fake
``libamdhip64.so`` (:mod:`pytest_gpu.sim.hip`).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import io
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ..base.requests import format_size
from ..base.wording import verb
from . import kinds, libraries
from .devices import Device
from .sampling import Refused, Sampler, Unavailable, Unlistable
from .vendor import Vendor

ROCR_VAR = "ROCR_VISIBLE_DEVICES"
ORDINAL_VAR = "GPU_DEVICE_ORDINAL"  # ROCclr's for OpenCL: a lease sets it, HIP does not read it
HIP_VARS = ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")  # HIP's first: it wins when set and not empty
#: Every variable that narrows what a ROCm process (HIP or OpenCL) sees, outermost first.
VISIBILITY_VARS = (ROCR_VAR, ORDINAL_VAR, *HIP_VARS)


# amdsmi's process list may be coarse (amdsmi.h says bytes; fdinfo gives KiB, some drivers
# whole MB): every violation found says so. It is not stale: amdsmi_get_gpu_process_list reads
# KFD's process list (rsmi_compute_process_info_get) and each process's fdinfo anew at every
# call, nothing cached (ROCm/amdsmi at 0ceca28: amd_smi.cc, amd_smi_gpu_device.cc's
# get_compute_process_list_impl, fdinfo.cc). So --gpu-amd-process-lag defaults to 0 (no
# re-check, no wait, no summary line); it is kept, deprecated, for configs that set it.
PROCESS_UNIT = 2**20
PROCESS_LAG_S = 0.0


class AmdSmiUnavailable(Unavailable):
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
    amdsmi = _kept()[0]  # kept open: a sampler of this process may be using it
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
    except amdsmi.AmdSmiException as exc:
        _forget()
        raise AmdSmiUnavailable(f"amdsmi lists no GPUs: {said(exc)}") from None
    found.sort(key=lambda pair: pair[0])
    return tuple(device for _, device in found), "; ".join(notes)


def _rocr_uuid(amdsmi: Any, handle: Any) -> tuple[str, int]:
    """(ROCr's ``GPU-…`` UUID, the HSA node that orders ROCr's enumeration) of ``handle``.

    From ``amdsmi_get_gpu_enumeration_info`` where the library has it (amdsmi 6.4 on); before
    that, from the ASIC serial, which ROCr's unique id is, in amdsmi's order. A GPU without a
    unique id (HSA's ``GPU-XX``, the same for every such GPU) is keyed by ROCr's index
    (:func:`unnamed`), the one name ``ROCR_VISIBLE_DEVICES`` takes for it."""
    getter = getattr(amdsmi, "amdsmi_get_gpu_enumeration_info", None)
    if getter is not None:
        try:
            info = getter(handle)
            uuid, hsa, hip = str(info.get("hip_uuid", "")), info.get("hsa_id"), info.get("hip_id")
            if uuid.upper() == NO_UUID and isinstance(hsa, int) and isinstance(hip, int):
                return unnamed(hip), hsa
            if uuid.upper().startswith("GPU-") and uuid.upper() != NO_UUID and isinstance(hsa, int):
                return uuid_key(uuid), hsa
        except amdsmi.AmdSmiException as exc:
            if getattr(exc, "err_code", None) not in (2, 3):  # NOT_SUPPORTED, NOT_YET_IMPLEMENTED: fall back
                raise
    serial = str(amdsmi.amdsmi_get_gpu_asic_info(handle).get("asic_serial", ""))
    if not serial.upper().startswith("0X") or not int(serial, 16):
        # no unique id and no ROCr index to name it by (amdsmi before 6.4): not leasable
        raise amdsmi.AmdSmiException(f"no unique id (asic_serial {serial!r}) and no enumeration info")
    return f"GPU-{int(serial, 16):016x}", 1 << 32  # after every GPU that has an HSA node


NO_UUID = "GPU-XX"  # HSA's UUID of every GPU without a unique id (ROCR-Runtime amd_gpu_agent.cpp)


def unnamed(rocr_index: int) -> str:
    """The key of a GPU without a unique id: ROCr's index of it (ROCr's filter matches no UUID to it)."""
    return f"GPU-xx:{rocr_index}"


def rocr_index(uuid: str) -> int | None:
    """ROCr's index of a GPU keyed by :func:`unnamed`; ``None`` for a GPU named by its UUID."""
    head, sep, index = uuid.partition(":")
    return int(index) if sep and head.upper() == NO_UUID and index.isdigit() else None


def _hsa_uuid(device: Device) -> str:
    """The UUID HSA (and so HIP) reports for ``device``."""
    return NO_UUID if rocr_index(device.uuid) is not None else device.uuid


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
            # a GPU without a unique id is "Invalid-UUID" to ROCr's filter: no entry names it
            candidates = [d for d in devices if rocr_index(d.uuid) is None and d.uuid.lower().startswith(entry.lower())]
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
            entry = next((str(n) for n, d in enumerate(devices) if entry in _hsa_uuid(d)), entry)
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

    ``ROCR_VISIBLE_DEVICES`` names them by UUID (indices may not be ROCr's); ROCr then exposes
    exactly them, in this order, so ``HIP_VISIBLE_DEVICES`` and ``GPU_DEVICE_ORDINAL`` count
    ``0,1,…`` into what it left: every ROCm release reads that, where HIP's variable takes UUIDs
    only from rocm-6.2.0 on (clr 52db98ed; before, ``GPU-…`` ends the list and the process sees
    no GPU). HIP reads ``CUDA_VISIBLE_DEVICES`` only when ``HIP_VISIBLE_DEVICES`` is unset or
    empty (and torch on ROCm likewise), so it keeps ROCr's names for the programs that read it,
    as on NVIDIA (``os.environ["CUDA_VISIBLE_DEVICES"] == gpu.visible_devices``); a simulated
    machine's names are indices, counted there too. An outer value of any of them cannot narrow
    the lease. (Frameworks that refuse ``ROCR_VISIBLE_DEVICES`` beside ``HIP_VISIBLE_DEVICES``,
    as verl does, need HIP's and CUDA's removed: docs-incoming/vendors.md.)
    """
    ordinals = ",".join(str(n) for n in range(len(uuids)))
    named = ",".join(uuids) if all(u.upper().startswith("GPU-") for u in uuids) else ordinals
    return {ROCR_VAR: ",".join(uuids), ORDINAL_VAR: ordinals, HIP_VARS[0]: ordinals, HIP_VARS[1]: named}


def outer(environ: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The ROCm visibility variables set in ``environ`` (what a run started with)."""
    return tuple((name, environ[name]) for name in VISIBILITY_VARS if environ.get(name) is not None)


def open_amdsmi() -> tuple[Any, dict[str, Any]]:
    """amdsmi, initialised (the caller shuts it down), and its GPUs' handles by ROCr UUID (a GPU
    it cannot query is left out); :class:`AmdSmiUnavailable` when it cannot be used."""
    amdsmi = _amdsmi()
    try:
        return amdsmi, _walk(amdsmi)
    except AmdSmiUnavailable:
        amdsmi.amdsmi_shut_down()
        raise


def _walk(amdsmi: Any) -> dict[str, Any]:
    """amdsmi's GPU handles by ROCr UUID (a GPU it cannot query is left out)."""
    handles: dict[str, Any] = {}
    try:
        for handle in amdsmi.amdsmi_get_processor_handles():
            try:
                handles[_rocr_uuid(amdsmi, handle)[0]] = handle
            except amdsmi.AmdSmiException:
                continue  # a GPU it cannot query: named by whoever asks for it
    except amdsmi.AmdSmiException as exc:
        raise AmdSmiUnavailable(f"amdsmi lists no GPUs: {said(exc)}") from None
    return handles


class _Opened:
    """amdsmi as this process keeps it open for its samplers (:data:`_opened`): initialised
    once, its GPUs walked once (``amdsmi_init`` and the walk cost more than the samples)."""

    def __init__(self) -> None:
        self.amdsmi, self.handles = open_amdsmi()
        self.stale = False  # walk the GPUs again at the next _kept() (a GPU was refused: it may be back)

    def shut(self) -> None:
        """A forked child's copy of the parent's init: dropped before the child opens its own."""
        with contextlib.suppress(Exception):
            self.amdsmi.amdsmi_shut_down()


_opened: libraries.PerProcess[_Opened] = libraries.PerProcess(_Opened, inherited=_Opened.shut)


def _kept() -> tuple[Any, dict[str, Any]]:
    """This process's amdsmi and its GPUs' handles (walked again where marked stale)."""
    opened = _opened.get()
    if opened.stale:
        opened.handles, opened.stale = _walk(opened.amdsmi), False
    return opened.amdsmi, opened.handles


def _forget() -> None:
    """Walk the GPUs again at the next :func:`_kept` (a GPU was refused: it may be back)."""
    _opened.get().stale = True


def _record(amdsmi: Any, handle: Any, listed: Any) -> dict[str, Any] | None:
    """One entry of amdsmi's process list as the dict every release gives in the end: from
    rocm-6.1.2 the entry itself; before, a process handle (to 6.1.0) or a ctypes struct (6.1.1)
    that ``amdsmi_get_gpu_process_info`` turns into it. ``None``: the process left meanwhile."""
    if isinstance(listed, Mapping):
        return dict(listed)
    try:
        info = amdsmi.amdsmi_get_gpu_process_info(handle, listed)
    except amdsmi.AmdSmiException:
        return None  # NOT_FOUND: its fdinfo is gone (it exited between the two calls)
    return dict(info) if isinstance(info, Mapping) else None


class AmdSampler:
    """amdsmi, initialised once per process (:class:`Unavailable` when it cannot be); GPUs named
    by ROCr UUID.

    Its per-process figures are the driver's fdinfo, summed by amdsmi over the process's fds
    on that GPU (bytes, possibly rounded); the used VRAM it reports includes the driver's own
    reservation (``reserved`` is not reported). Figures it cannot vouch for are not given:

    - ``vram_mem`` 0 for a listed process (an APU such as MI300A, whose memory is GTT; a
      process on a discrete GPU holds VRAM for its queues): the process's memory is unknown;
    - figures adding up to more than the GPU's used VRAM: amdsmi counted a DRM client once per
      fd that holds it (dup, fork, fd passing; amdsmi's ``fdinfo.cc`` sums every fd without
      de-duplicating ``drm-client-id``), so no figure on that GPU is believed
      (:class:`Unlistable`). A doubled figure that still fits under the used VRAM is not seen:
      the error is bounded by what the other processes and the driver's reserve leave free.
    """

    name = "amdsmi"

    def __init__(self) -> None:
        _kept()  # AmdSmiUnavailable (an Unavailable) when it cannot be opened

    @property
    def _amdsmi(self) -> Any:
        return _kept()[0]

    def close(self) -> None:
        pass  # amdsmi stays open for the process's next sampler (_opened)

    def problem(self) -> str:
        return ""

    def forget(self, uuid: str) -> None:
        _forget()

    def _handle(self, uuid: str) -> Any:
        try:
            handles = _kept()[1]
        except AmdSmiUnavailable as exc:
            raise Refused(str(exc)) from None
        handle = handles.get(uuid_key(uuid))
        if handle is None:
            raise Refused("amdsmi does not report it")
        return handle

    def memory(self, uuid: str) -> tuple[int, int | None]:
        handle = self._handle(uuid)
        try:
            return int(self._amdsmi.amdsmi_get_gpu_memory_usage(handle, self._amdsmi.AmdSmiMemoryType.VRAM)), None
        except self._amdsmi.AmdSmiException as exc:
            raise Refused(said(exc)) from None

    def processes(self, uuid: str) -> dict[int, int | None]:
        handle = self._handle(uuid)
        amdsmi = self._amdsmi
        try:
            listed = amdsmi.amdsmi_get_gpu_process_list(handle)
        except amdsmi.AmdSmiException as exc:
            raise Unlistable(f"amdsmi cannot list the processes there ({said(exc)})", said(exc)) from None
        found: dict[int, int | None] = {}
        for entry in listed:
            record = _record(amdsmi, handle, entry)
            if record is None:
                continue
            vram = int(record.get("memory_usage", {}).get("vram_mem", 0) or 0)
            found[int(record["pid"])] = vram or None  # 0: not measured (an APU's memory is GTT)
        counted = sum(v for v in found.values() if v)
        if counted:
            try:
                used = int(amdsmi.amdsmi_get_gpu_memory_usage(handle, amdsmi.AmdSmiMemoryType.VRAM))
            except amdsmi.AmdSmiException:
                used = counted
            if counted > used:
                why = (
                    f"its processes' figures add up to {format_size(counted)}, more than the "
                    f"{format_size(used)} in use there: counted once per fd of a DRM client, or out of date"
                )
                raise Unlistable(f"amdsmi's per-process figures are not believed there ({why})", why)
        return found

    def compute(self, uuid: str) -> list[tuple[int, int | None]]:
        """amdsmi's list is of compute (KFD) processes."""
        try:
            return list(self.processes(uuid).items())
        except Refused as exc:
            raise Unlistable(f"amdsmi cannot list the processes there ({exc})", str(exc)) from None


#: HIP error codes named in notes (hip_runtime_api.h's hipError_t)
_HIP_ERRORS = {1: "hipErrorInvalidValue", 100: "hipErrorNoDevice", 101: "hipErrorInvalidDevice"}


def _hip_library() -> tuple[ctypes.CDLL | None, str]:
    """HIP's runtime library: the one torch bundles (torch will load it: one HIP per process), else
    the dynamic linker's (one already loaded included), else ``$ROCM_PATH``/``$ROCM_HOME``/``/opt/rocm``'s."""
    names: list[str] = []
    spec = importlib.util.find_spec("torch")  # found, not imported: the plugin never imports torch
    if spec is not None and spec.origin:
        names.append(os.path.join(os.path.dirname(spec.origin), "lib", "libamdhip64.so"))
    names += ["libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6"]
    for root in (os.environ.get("ROCM_PATH"), os.environ.get("ROCM_HOME"), "/opt/rocm"):
        if root:
            names.append(os.path.join(root, "lib", "libamdhip64.so"))
    failures = []
    for name in names:
        if os.sep in name and not os.path.exists(name):
            continue
        try:
            return ctypes.CDLL(name), ""
        except OSError as exc:
            failures.append(str(exc))
    return None, f"libamdhip64.so not loadable ({failures[0] if failures else 'not found'})"


def hip_init() -> tuple[list[str] | None, str]:
    """``hipInit(0)`` through libamdhip64.so, then the UUIDs of what HIP enumerates.

    Returns (the UUIDs' 16 hex digits in ordinal order, or ``None``; a sentence when something failed).
    """
    lib, why = _hip_library()
    if lib is None:
        return None, f"its HIP device list is predicted from ROCm's variables: {why}"
    said_ = "its HIP device list is predicted from ROCm's variables"
    result = lib.hipInit(0)
    if result != 0:
        return None, f"{said_}: hipInit failed with {_HIP_ERRORS.get(result, f'hipError_t {result}')}"
    count = ctypes.c_int(0)
    result = lib.hipGetDeviceCount(ctypes.byref(count))
    if result != 0:
        return None, f"{said_}: hipGetDeviceCount failed with {_HIP_ERRORS.get(result, f'hipError_t {result}')}"
    uuids = []
    for ordinal in range(count.value):
        device = ctypes.c_int(0)
        raw = (ctypes.c_char * 16)()
        if lib.hipDeviceGet(ctypes.byref(device), ordinal) != 0 or lib.hipDeviceGetUuid(raw, device) != 0:
            return None, f"{said_}: could not read the UUID of HIP device {ordinal}"
        # ROCr's unique id as text: 16 hex digits ("XX..." on a GPU without one: matches no device)
        uuids.append(bytes(raw).rstrip(b"\0").decode("ascii", "replace").lower())
    return uuids, ""


def caveat(lag: float) -> str:
    """What a violation seen in amdsmi's list may be off by, said beside it (``lag``: the
    seconds the list may be old; a violation is kept only when a list read that long after
    the test ended still shows it)."""
    words = f"seen in amdsmi's per-process list, which may be rounded to {format_size(PROCESS_UNIT)}"
    if lag > 0:
        words += f", and still there {lag:g} s after the test ended (the list may be that old)"
    return words


class Amd(Vendor):
    """AMD's GPUs: amdsmi, ROCm's visibility variables, HIP, RCCL."""

    kind = kinds.AMD
    source = "amdsmi"
    driver = AmdSampler.name
    visibility = VISIBILITY_VARS
    forms = "amd:auto or amd: and amdsmi's indices such as amd:0,2"
    gives_gpus = "the amdgpu driver, amdsmi, ROCR_VISIBLE_DEVICES"
    collective = "nccl"
    collective_label = "RCCL (its nccl backend on ROCm)"
    _missing = "no usable AMD GPU with amdsmi index {missing}; this machine has {known}"
    _hidden_kind = "AMD GPU"
    _visible_by = "ROCm leaves visible"
    _none_found = "amdsmi reports no usable AMD GPUs"
    _none_left = "{said} leave none of the GPUs amdsmi reports"

    def devices(self) -> tuple[tuple[Device, ...], str]:
        return amdsmi_devices()

    def installed(self) -> bool:
        return importlib.util.find_spec("amdsmi") is not None  # a ROCm install (the rocm extra)

    def outer(self, environ: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
        return outer(environ)

    def said(self, outer: Sequence[tuple[str, str]]) -> str:
        return super().said(outer) or "no ROCm visibility variables"

    def view(self, machine: tuple[Device, ...], outer: Sequence[tuple[str, str]]) -> list[int]:
        return rocm_view(machine, dict(outer))

    def lease_env(self, names: Sequence[str]) -> dict[str, str]:
        return lease_env(names)

    def lease_names(self, devices: Sequence[Device]) -> list[str]:
        """UUIDs, but ROCr's index for a GPU without a unique id (ROCr's filter takes both in one list)."""
        return [str(rocr_index(n)) if rocr_index(n) is not None else n for n in super().lease_names(devices)]

    def runtime_id(self, uuid: str) -> str:
        """HIP reads back ``XX`` for every GPU without a unique id: such a key matches none (the
        view is then predicted from the variables)."""
        return uuid.lower() if rocr_index(uuid) is not None else super().runtime_id(uuid)

    def ray_env(self, devices: Sequence[Device]) -> dict[str, str]:
        """Ray reads ``HIP_VISIBLE_DEVICES`` (ray 2.60's ``AMDGPUAcceleratorManager``, which refuses
        ``ROCR_VISIBLE_DEVICES`` without it): the head gets the lease variables of the run's GPUs,
        so a task's HIP ids count into them."""
        env = lease_env(self.lease_names(devices))
        env.update(dict.fromkeys(HIP_VARS, env[ORDINAL_VAR]))
        return env

    def pin(self) -> tuple[list[str] | None, str]:
        return hip_init()

    def sampler(self) -> Sampler:
        with contextlib.redirect_stdout(io.StringIO()):  # amdsmi prints its load failures
            return AmdSampler()

    def lag(self, setting: float) -> float:
        return setting

    def caveat(self, lag: float) -> str:
        return caveat(lag)

    def unseen(self, tests: int, lag: float) -> str:
        ran = verb(tests, "test ran", "tests ran")
        they = verb(tests, "it took in its", "they took in their")
        return (
            f"pytest-gpu: {tests} AMD GPU {ran} shorter than amdsmi's process-list lag ({lag:g} s): memory "
            f"{they} last moments may not have been seen (--gpu-amd-lag-wait waits it out)"
        )


AMD = Amd()
