"""Intel XPU: GPUs found through Level Zero Sysman, ``ZE_AFFINITY_MASK``, Sysman's process list.

Why Sysman through ctypes on ``libze_loader.so.1``: it is the only source that sees other
processes' device memory (``zesDeviceProcessesGetState``), which verification of a lease's
subprocesses and foreign usage need; it ships with every Level Zero driver (no Python
package to install: ``pyzes`` is a ctypes wrapper over the same library); it is what torch
2.13 itself counts XPUs through before initialising (``torch/xpu/__init__.py``:
``_enum_zes_device_infos``); and it never starts a device runtime in the plugin's process
(the plugin never imports torch: :mod:`pytest_gpu.gpu.isolation`). ``torch.xpu`` in a
subprocess would see only its own process's counters, and ``xpu-smi`` is a separate install.
Only the calls below are made: ``zesInit``, ``zesDriverGet``, ``zesDeviceGet``,
``zesDeviceGetProperties``, ``zesDeviceEnumMemoryModules``, ``zesMemoryGetState``,
``zesDeviceProcessesGetState``; CI answers them with a fake loader (:mod:`pytest_gpu.sim.zes`).

Sources (commits in docs-incoming/xpu.md): oneapi-src/level-zero ``include/zes_api.h`` and
``include/ze_api.h`` (layouts, result codes, the two-call count protocol; "the number and
order of handles returned from [zesDeviceGet] is NOT affected by ZE_AFFINITY_MASK,
ZE_ENABLE_PCI_ID_DEVICE_ORDER, or ZE_FLAT_DEVICE_HIERARCHY"); intel/compute-runtime
``shared/source/execution_environment/execution_environment.cpp`` (``parseAffinityMask``);
torch 2.13 ``torch/xpu/__init__.py`` (``_parse_visible_devices``, ``_enum_zes_device_infos``).

Devices and tiles. A device here is what ``ZE_AFFINITY_MASK``'s plain entries count: under
``ZE_FLAT_DEVICE_HIERARCHY=FLAT`` (the driver's default) or ``COMBINED``, every tile of a
multi-tile card (a Max 1550 has two) is a device of its own, numbered across the cards in
Sysman's order; under ``COMPOSITE`` a card is one device. So :func:`sysman_devices` lists
tiles as devices under FLAT, as torch's count does, and a lease of a tile is that tile
alone. Sysman reports memory and processes per card, not per tile: a tile's lease cannot be
verified from them (its verdict says so). Assumed, not read back: the core driver numbers
cards in Sysman's order (true unless ``ZE_ENABLE_PCI_ID_DEVICE_ORDER`` reorders them).

``ZE_AFFINITY_MASK`` as compute-runtime applies it (:func:`xpu_view`): unset or empty, every
device; otherwise each entry that names a device selects it, and an entry that names none
(out of range, or ``X.Y`` under FLAT) is skipped, not an end of the list as CUDA's is; the
devices selected keep the driver's order whatever the mask's order (a bitset per card), so
``ZE_AFFINITY_MASK=3,1`` makes device 1 ``xpu:0``. Under COMPOSITE an ``X.Y`` entry exposes
card X restricted to tile Y (counted here as card X). A lease sets the mask to its devices;
its process numbers them in ascending order.

The mask is read once per process, when Level Zero's driver initialises (compute-runtime's
``parseAffinityMask``, called as the first ``zeInit`` creates the driver): a worker whose
Level Zero first started inside a test would keep that test's lease for life. So the worker
pins it as CUDA's is pinned (:func:`ze_init`, :meth:`Intel.pin`): ``zeInit`` under the run's
mask before the first lease, then the core API's devices (``zeDriverGet``, ``zeDeviceGet``,
``zeDeviceGetProperties``' 16-byte UUID) read back. CI runs it against the fake loader
(:mod:`pytest_gpu.sim.zes`), which reads the mask at its first ``zeInit`` as compute-runtime does.

Sysman is started once per process (:func:`process_sysman`; again in a forked child), before the
pin's ``zeInit``: compute-runtime (e37c60bf, ``level_zero/tools/source/sysman/sysman.cpp``,
``level_zero/sysman/source/shared/linux/zes_os_sysman_imp.cpp``) starts Sysman from the core
driver when ``zeInit`` runs under ``ZES_ENABLE_SYSMAN=1``, and a product without ``zesInit``
support then refuses ``zesInit`` (``ZE_RESULT_ERROR_UNSUPPORTED_FEATURE``, decided once per
process). Where Level Zero started first anyway, Sysman is used through the core API's handles,
which follow the process's ``ZE_AFFINITY_MASK`` (:attr:`Sysman.legacy`). A process's memory
figure is the sum over its fds of the card (``readClientInfoFromFdInfo``, no client id in
``zes_process_state_t``): a client reached through two fds reads twice, so it is bounded by the
card's memory in use (:meth:`Sysman.processes`).

Not run on an Intel machine here.
"""

from __future__ import annotations

import ctypes
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import kinds, libraries
from .devices import Device
from .sampling import Refused, Sampler, Unavailable, Unlistable
from .vendor import Vendor

MASK_VAR = "ZE_AFFINITY_MASK"
HIERARCHY_VAR = "ZE_FLAT_DEVICE_HIERARCHY"
#: The variables that narrow what a Level Zero process sees, outermost first.
VISIBILITY_VARS = (MASK_VAR,)
#: The loader's soname.
LIBRARY = "libze_loader.so.1"

ZE_RESULT_SUCCESS = 0
ZE_RESULT_ERROR_INVALID_SIZE = 0x78000008
ZE_RESULT_ERROR_UNSUPPORTED_FEATURE = 0x78000003
ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES = 0x3
ZES_STRUCTURE_TYPE_DEVICE_PROPERTIES = 0x1
ZES_STRUCTURE_TYPE_PROCESS_STATE = 0x16
ZES_STRUCTURE_TYPE_MEM_STATE = 0x1E
_RESULTS = {
    0x70000001: "ZE_RESULT_ERROR_DEVICE_LOST",
    0x70010000: "ZE_RESULT_ERROR_INSUFFICIENT_PERMISSIONS",
    0x70020000: "ZE_RESULT_ERROR_DEPENDENCY_UNAVAILABLE",
    0x78000001: "ZE_RESULT_ERROR_UNINITIALIZED",
    0x78000003: "ZE_RESULT_ERROR_UNSUPPORTED_FEATURE",
    0x78000004: "ZE_RESULT_ERROR_INVALID_ARGUMENT",
    0x78000005: "ZE_RESULT_ERROR_INVALID_NULL_HANDLE",
    0x78000007: "ZE_RESULT_ERROR_INVALID_NULL_POINTER",
    0x78000008: "ZE_RESULT_ERROR_INVALID_SIZE",
    0x7800000C: "ZE_RESULT_ERROR_INVALID_ENUMERATION",
}


class ZesUnavailable(Unavailable):
    """No Level Zero loader, no Intel GPU driver, or Sysman refused to start."""


class ZesError(RuntimeError):
    """One Sysman call failed (``code``: its ze_result_t)."""

    def __init__(self, call: str, code: int) -> None:
        super().__init__(f"{call} returned {_RESULTS.get(code, hex(code))}")
        self.code = code


class _CoreProperties(ctypes.Structure):
    _fields_ = [
        ("stype", ctypes.c_int),
        ("pNext", ctypes.c_void_p),
        ("type", ctypes.c_int),
        ("vendorId", ctypes.c_uint32),
        ("deviceId", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("subdeviceId", ctypes.c_uint32),
        ("coreClockRate", ctypes.c_uint32),
        ("maxMemAllocSize", ctypes.c_uint64),
        ("maxHardwareContexts", ctypes.c_uint32),
        ("maxCommandQueuePriority", ctypes.c_uint32),
        ("numThreadsPerEU", ctypes.c_uint32),
        ("physicalEUSimdWidth", ctypes.c_uint32),
        ("numEUsPerSubslice", ctypes.c_uint32),
        ("numSubslicesPerSlice", ctypes.c_uint32),
        ("numSlices", ctypes.c_uint32),
        ("timerResolution", ctypes.c_uint64),
        ("timestampValidBits", ctypes.c_uint32),
        ("kernelTimestampValidBits", ctypes.c_uint32),
        ("uuid", ctypes.c_uint8 * 16),
        ("name", ctypes.c_char * 256),
    ]


class _DeviceProperties(ctypes.Structure):
    _fields_ = [
        ("stype", ctypes.c_int),
        ("pNext", ctypes.c_void_p),
        ("core", _CoreProperties),
        ("numSubdevices", ctypes.c_uint32),
        ("serialNumber", ctypes.c_char * 64),
        ("boardNumber", ctypes.c_char * 64),
        ("brandName", ctypes.c_char * 64),
        ("modelName", ctypes.c_char * 64),
        ("vendorName", ctypes.c_char * 64),
        ("driverVersion", ctypes.c_char * 64),
    ]


class _MemState(ctypes.Structure):
    _fields_ = [
        ("stype", ctypes.c_int),
        ("pNext", ctypes.c_void_p),
        ("health", ctypes.c_int),
        ("free", ctypes.c_uint64),
        ("size", ctypes.c_uint64),
    ]


class _ProcessState(ctypes.Structure):
    _fields_ = [
        ("stype", ctypes.c_int),
        ("pNext", ctypes.c_void_p),
        ("processId", ctypes.c_uint32),
        ("memSize", ctypes.c_uint64),
        ("sharedSize", ctypes.c_uint64),
        ("engines", ctypes.c_uint32),
    ]


@dataclass(frozen=True)
class Card:
    """One Sysman device: a card, in Sysman's order."""

    index: int
    uuid: str  # the 16 bytes of core.uuid as 8-4-4-4-12 hex digits
    total: int  # bytes: the sum of its memory modules' sizes
    name: str
    tiles: int  # numSubdevices (0: a single-tile card)
    handle: Any = None


def _uuid(raw: Sequence[int]) -> str:
    text = bytes(raw).hex()
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


class Sysman:
    """Level Zero Sysman through ctypes, initialised; :class:`ZesUnavailable` says why not.

    ``legacy``: ``zesInit`` answered ``ZE_RESULT_ERROR_UNSUPPORTED_FEATURE`` because Level Zero was
    started (``zeInit``) under ``ZES_ENABLE_SYSMAN=1`` first, on a product without ``zesInit``
    support (compute-runtime's ``LinuxSysmanImp::init``); Sysman then answers through the core
    API's device handles, which follow ``ZE_AFFINITY_MASK`` (and FLAT mode): only the devices the
    process's mask left are there, found by their UUID. Use :func:`process_sysman`, not this class:
    one per process.
    """

    def __init__(self) -> None:
        try:
            self._lib = ctypes.CDLL(LIBRARY)
        except OSError as exc:
            raise ZesUnavailable(f"no Level Zero loader ({exc})") from None  # the OSError names the library
        code = self._lib.zesInit(ctypes.c_uint32(0))
        self.legacy = code == ZE_RESULT_ERROR_UNSUPPORTED_FEATURE
        if code != ZE_RESULT_SUCCESS and not self.legacy:
            raise ZesUnavailable(f"Level Zero Sysman unavailable (zesInit returned {_RESULTS.get(code, hex(code))})")
        try:
            if self.legacy:  # zeInit ran already: this one reads nothing anew
                code = self._lib.zeInit(ctypes.c_uint32(0))
                if code != ZE_RESULT_SUCCESS:
                    raise ZesError("zeInit", code)
                drivers = _handles(self._lib, "zeDriverGet", None)
            else:
                drivers = self._list("zesDriverGet", None)
        except ZesError as exc:
            raise ZesUnavailable(f"Level Zero Sysman unavailable ({exc})") from None
        self._driver = drivers[0] if drivers else None

    def _call(self, name: str, *args: Any) -> None:
        code = getattr(self._lib, name)(*args)
        if code != ZE_RESULT_SUCCESS:
            raise ZesError(name, code)

    def _list(self, name: str, owner: Any) -> list[Any]:
        """The two-call count protocol: the number, then that many handles."""
        count = ctypes.c_uint32(0)
        head = () if owner is None else (ctypes.c_void_p(owner),)
        self._call(name, *head, ctypes.byref(count), None)
        handles = (ctypes.c_void_p * max(count.value, 1))()
        self._call(name, *head, ctypes.byref(count), handles)
        return [handles[i] for i in range(count.value)]

    def cards(self) -> list[Card]:
        """Every Sysman device of the first driver (torch's choice too), in Sysman's order."""
        if self._driver is None:
            return []
        found: list[Card] = []
        if self.legacy:  # the core API's devices are Sysman's now
            handles = _handles(self._lib, "zeDeviceGet", self._driver)
        else:
            handles = self._list("zesDeviceGet", self._driver)
        for handle in handles:
            props = _DeviceProperties()
            props.stype = ZES_STRUCTURE_TYPE_DEVICE_PROPERTIES
            self._call("zesDeviceGetProperties", ctypes.c_void_p(handle), ctypes.byref(props))
            uuid = _uuid(props.core.uuid)
            if any(card.uuid == uuid for card in found):
                continue  # legacy mode under FLAT: each tile's core handle reaches its card's Sysman
            total = self.memory(handle)[1]
            name = props.core.name.decode(errors="replace") or props.modelName.decode(errors="replace")
            found.append(Card(len(found), uuid, total, name, int(props.numSubdevices), handle))
        return found

    def memory(self, handle: Any) -> tuple[int, int]:
        """(used, size) bytes over the card's memory modules."""
        used = size = 0
        for module in self._list("zesDeviceEnumMemoryModules", handle):
            state = _MemState()
            state.stype = ZES_STRUCTURE_TYPE_MEM_STATE
            self._call("zesMemoryGetState", ctypes.c_void_p(module), ctypes.byref(state))
            size += int(state.size)
            used += int(state.size) - int(state.free)
        return used, size

    def processes(self, handle: Any, *, bounded: bool = True) -> dict[int, int]:
        """pid -> device memory in bytes of every process on the card, each at most what the card
        has in use (``bounded=False``: as the driver says it; the list may grow between the count
        and the read: a larger buffer is tried then, as the header recommends)."""
        count = ctypes.c_uint32(0)
        self._call("zesDeviceProcessesGetState", ctypes.c_void_p(handle), ctypes.byref(count), None)
        for _ in range(3):
            room = count.value + 8
            states = (_ProcessState * room)()
            for state in states:
                state.stype = ZES_STRUCTURE_TYPE_PROCESS_STATE
            count = ctypes.c_uint32(room)
            code = self._lib.zesDeviceProcessesGetState(ctypes.c_void_p(handle), ctypes.byref(count), states)
            if code == ZE_RESULT_SUCCESS:
                found: dict[int, int] = {}
                for state in states[: count.value]:
                    found[int(state.processId)] = found.get(int(state.processId), 0) + int(state.memSize)
                # A process's memSize is the sum over its fds of the device, without de-duplicating DRM
                # clients (compute-runtime's readClientInfoFromFdInfo; no client id is returned): a
                # client reached through two fds (dup, fork, fd passing) reads twice. No process holds
                # more than the card has in use, read after the list.
                if not bounded:
                    return found
                used = self.memory(handle)[0]
                return {pid: min(size, used) for pid, size in found.items()}
            if code != ZE_RESULT_ERROR_INVALID_SIZE:
                raise ZesError("zesDeviceProcessesGetState", code)
        raise ZesError("zesDeviceProcessesGetState", ZE_RESULT_ERROR_INVALID_SIZE)


_process: libraries.PerProcess[Sysman] = libraries.PerProcess(Sysman)


def process_sysman() -> Sysman:
    """This process's Sysman, initialised on first use (:class:`ZesUnavailable` when it cannot be;
    a failure is not kept: the driver may appear). One ``zesInit`` per process, as zes_api.h wants
    ("Only one instance of sysman will be initialized per process"), and one again in a forked
    child ("Each forked process must call this function")."""
    return _process.get()


def flat(environ: Mapping[str, str]) -> bool:
    """Whether tiles are devices: FLAT (the default) or COMBINED, not COMPOSITE (compute-runtime's
    ``setDeviceHierarchyMode``; torch's count reads it the same way)."""
    return environ.get(HIERARCHY_VAR) != "COMPOSITE"


def devices_of(cards: Sequence[Card], tiles_are_devices: bool) -> tuple[Device, ...]:
    """The devices ``ZE_AFFINITY_MASK`` counts, in order: under FLAT a multi-tile card's tiles one by
    one (each with an equal share of the card's memory, named ``<uuid>/tile<T>``), else cards."""
    found: list[Device] = []
    for card in cards:
        if tiles_are_devices and card.tiles > 0:
            for tile in range(card.tiles):
                found.append(
                    Device(len(found), f"{card.uuid}/tile{tile}", card.total // card.tiles, f"{card.name} tile {tile}")
                )
        else:
            found.append(Device(len(found), card.uuid, card.total, card.name))
    return tuple(found)


def sysman_devices(environ: Mapping[str, str]) -> tuple[tuple[Device, ...], str]:
    """Every Intel GPU device Sysman reports (tiles as devices under FLAT), indexed as
    ``ZE_AFFINITY_MASK`` counts them, and a note; :class:`ZesUnavailable` when Sysman cannot be used."""
    zes = process_sysman()
    if zes.legacy and (environ.get(MASK_VAR) or "").strip():
        # the core devices the mask left: not the machine's, and not numbered as the mask counts them
        raise ZesUnavailable(
            f"Level Zero Sysman lists only the devices {MASK_VAR}={environ[MASK_VAR]} leaves: Level Zero started "
            "under ZES_ENABLE_SYSMAN=1 before pytest-gpu and the driver has no zesInit support (unset "
            "ZES_ENABLE_SYSMAN, or start Level Zero after pytest-gpu)"
        )
    try:
        cards = zes.cards()
    except ZesError as exc:
        raise ZesUnavailable(f"Level Zero Sysman cannot list the GPUs ({exc})") from None
    tiled = [c for c in cards if c.tiles > 0]
    note = ""
    if tiled and flat(environ):
        note = (
            f"{len(tiled)} card(s) with tiles: each tile is a device ({HIERARCHY_VAR} FLAT); Sysman gives memory and "
            "processes per card, so a tile's lease is not verified"
        )
    return devices_of(cards, flat(environ)), note


def xpu_view(machine: tuple[Device, ...], outer: Mapping[str, str]) -> list[int]:
    """Indices of the devices a Level Zero process started under ``outer`` enumerates, in its order."""
    mask = outer.get(MASK_VAR)
    indices = [d.index for d in machine]
    if mask is None or mask.strip() == "":  # unset, or empty: compute-runtime applies no mask
        return indices
    chosen: set[int] = set()
    tiles_are_devices = flat(outer)
    for entry in mask.split(","):
        entry = entry.strip()
        if re.fullmatch(r"\d+", entry):
            position = int(entry)
        elif re.fullmatch(r"\d+\.\d+", entry) and not tiles_are_devices:
            position = int(entry.split(".")[0])  # COMPOSITE: card X restricted to tile Y
        else:
            continue  # X.Y under FLAT, or not a number: skipped
        if position < len(machine):
            chosen.add(position)
    return [indices[p] for p in sorted(chosen)]


def lease_env(names: Sequence[str]) -> dict[str, str]:
    """What a subprocess needs to see exactly the devices ``names`` (their ``ZE_AFFINITY_MASK``
    indices): ``ZE_AFFINITY_MASK`` lists them as given, and the process numbers them ``xpu:0``,
    ``xpu:1``… in ascending order, whatever the list's (Level Zero keeps the driver's order).

    ``CUDA_VISIBLE_DEVICES`` is set to the same list, as the AMD lease names its GPUs in every
    variable a program may read (``os.environ["CUDA_VISIBLE_DEVICES"] == gpu.visible_devices``):
    no CUDA runtime exists on an Intel-only machine to misread it. ROCm's variables are not set.
    """
    mask = ",".join(names)
    return {MASK_VAR: mask, "CUDA_VISIBLE_DEVICES": mask}


def outer(environ: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """``ZE_AFFINITY_MASK`` and ``ZE_FLAT_DEVICE_HIERARCHY`` as set in ``environ`` (a run's start)."""
    return tuple((name, environ[name]) for name in (MASK_VAR, HIERARCHY_VAR) if environ.get(name) is not None)


class XpuSampler:
    """Level Zero Sysman, initialised (:class:`Unavailable` when it cannot be); GPUs named by the
    UUIDs :func:`pytest_gpu.vendors.intel.sysman_devices` gives. Memory and processes are per card: a
    tile (``<uuid>/tile<T>``) is refused, so its lease shows as not verified."""

    name = "Level Zero Sysman"

    def __init__(self) -> None:
        self._zes = process_sysman()  # ZesUnavailable: an Unavailable
        try:
            self._handles = _handles_of(self._zes)
        except ZesError as exc:
            raise ZesUnavailable(str(exc)) from None

    def close(self) -> None:
        pass  # Sysman has no shutdown call: the process's stays (process_sysman)

    def problem(self) -> str:
        return ""

    def forget(self, uuid: str) -> None:
        pass

    def _handle(self, uuid: str) -> Any:
        if "/tile" in uuid:
            raise Refused("Level Zero Sysman reports memory and processes per card, not per tile")
        handle = self._handles.get(uuid)
        if handle is None:
            self._handles = _handles_of(self._zes, fresh=True)
            handle = self._handles.get(uuid)
        if handle is None:
            if self._zes.legacy:
                raise Refused(
                    "Level Zero Sysman, started by zeInit under ZES_ENABLE_SYSMAN=1 (the driver has no zesInit "
                    "support), sees only the devices this process's ZE_AFFINITY_MASK left"
                )
            raise Refused("Level Zero Sysman does not report it")
        return handle

    def memory(self, uuid: str) -> tuple[int, int | None]:
        handle = self._handle(uuid)
        try:
            return self._zes.memory(handle)[0], None
        except ZesError as exc:
            raise Refused(str(exc)) from None

    def processes(self, uuid: str) -> dict[int, int | None]:
        try:
            handle = self._handle(uuid)
        except Refused as exc:
            raise Unlistable(f"Level Zero Sysman cannot list the processes there ({exc})", str(exc)) from None
        try:
            return dict(self._zes.processes(handle))
        except ZesError as exc:
            raise Unlistable(f"Level Zero Sysman cannot list the processes there ({exc})", str(exc)) from None

    def compute(self, uuid: str) -> list[tuple[int, int | None]]:
        return list(self.processes(uuid).items())


_known: dict[int, dict[str, Any]] = {}  # id(Sysman) -> UUID -> handle: a process's handles do not change


def _handles_of(zes: Sysman, *, fresh: bool = False) -> dict[str, Any]:
    """UUID -> Sysman handle of each device ``zes`` reports, listed once per Sysman (``fresh``: again)."""
    if fresh or id(zes) not in _known:
        _known.clear()  # one Sysman per process: an older one is a parent's
        _known[id(zes)] = {card.uuid: card.handle for card in zes.cards()}
    return _known[id(zes)]


def ze_init() -> tuple[list[str] | None, str]:
    """``zeInit(0)`` through the Level Zero loader, then the UUIDs of the devices its first driver
    enumerates (``zeDeviceGet``, ``zeDeviceGetProperties``): the driver has read ``ZE_AFFINITY_MASK``
    now, once for the process.

    Returns (the UUIDs' 32 hex digits in ordinal order, or ``None``; a sentence when something failed).
    """
    said = "its Level Zero device list is predicted from ZE_AFFINITY_MASK"
    try:
        lib = ctypes.CDLL(LIBRARY)
    except OSError as exc:
        return None, f"{said}: no Level Zero loader ({exc})"
    code = lib.zeInit(ctypes.c_uint32(0))
    if code != ZE_RESULT_SUCCESS:
        return None, f"{said}: zeInit returned {_RESULTS.get(code, hex(code))}"
    try:
        drivers = _handles(lib, "zeDriverGet", None)
        if not drivers:
            return None, f"{said}: zeDriverGet lists no driver"
        devices = _handles(lib, "zeDeviceGet", drivers[0])
        uuids = []
        for handle in devices:
            props = _CoreProperties()
            props.stype = ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES
            code = lib.zeDeviceGetProperties(ctypes.c_void_p(handle), ctypes.byref(props))
            if code != ZE_RESULT_SUCCESS:
                raise ZesError("zeDeviceGetProperties", code)
            uuids.append(bytes(props.uuid).hex())
    except ZesError as exc:
        return None, f"{said}: {exc}"
    return uuids, ""


def _handles(lib: ctypes.CDLL, name: str, owner: Any) -> list[Any]:
    """The two-call count protocol of the core API: the number, then that many handles."""
    count = ctypes.c_uint32(0)
    head = () if owner is None else (ctypes.c_void_p(owner),)
    code = getattr(lib, name)(*head, ctypes.byref(count), None)
    if code != ZE_RESULT_SUCCESS:
        raise ZesError(name, code)
    handles = (ctypes.c_void_p * max(count.value, 1))()
    code = getattr(lib, name)(*head, ctypes.byref(count), handles)
    if code != ZE_RESULT_SUCCESS:
        raise ZesError(name, code)
    return [handles[i] for i in range(count.value)]


class Intel(Vendor):
    """Intel's GPUs: Level Zero Sysman, ``ZE_AFFINITY_MASK``, Level Zero, XCCL."""

    kind = kinds.XPU
    source = "sysman"
    driver = XpuSampler.name
    visibility = VISIBILITY_VARS
    forms = (
        "xpu:auto, xpu: and device indices as ZE_AFFINITY_MASK counts them (such as xpu:0,2), "
        "or simulated Intel GPUs such as xpu:sim:4x64GiB"
    )
    gives_gpus = "the Intel GPU driver and Level Zero loader (libze_loader.so.1), ZE_AFFINITY_MASK"
    collective = "xccl"
    collective_label = "XCCL"
    names_by_index = True  # ZE_AFFINITY_MASK takes indices only
    _missing = "no Intel GPU device {missing}; Level Zero Sysman reports {known}"
    _hidden_kind = "Intel GPU"
    _visible_by = "the run's ZE_AFFINITY_MASK leaves visible"
    _none_found = "Level Zero Sysman reports no Intel GPUs"
    _none_left = "{said} leaves none of the devices Sysman reports"

    def devices(self) -> tuple[tuple[Device, ...], str]:
        return sysman_devices(os.environ)

    def outer(self, environ: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
        return outer(environ)

    def said(self, outer: Sequence[tuple[str, str]]) -> str:
        return super().said(outer) or "no ZE_AFFINITY_MASK"

    def view(self, machine: tuple[Device, ...], outer: Sequence[tuple[str, str]]) -> list[int]:
        return xpu_view(machine, dict(outer))

    def lease_env(self, names: Sequence[str]) -> dict[str, str]:
        return lease_env(names)

    def sim_spec(self, spec: str, rest: str, *, named: bool) -> str:
        """``xpu:sim:4x64GiB``: simulated Intel GPUs."""
        return f"{self.name}:{rest}"

    def pin(self) -> tuple[list[str] | None, str]:
        """Sysman first, then Level Zero's device list: a ``zeInit`` under ``ZES_ENABLE_SYSMAN=1``
        would start Sysman in its legacy mode, where a driver without ``zesInit`` support refuses
        ``zesInit`` for the rest of the process (and its handles follow the lease's mask)."""
        try:
            process_sysman()
        except ZesUnavailable:
            pass  # said where it is sampled
        return ze_init()

    def pin_fake(self) -> None:
        """The fake Level Zero loader models the core driver's device list and Sysman's two
        initialisations: pinned as on Intel GPUs (the simulated runtime's list is pinned apart)."""
        self.pin()

    def runtime_id(self, uuid: str) -> str:
        """Level Zero's 16 bytes, as hex digits (a Sysman UUID is 8-4-4-4-12 of them)."""
        return uuid.replace("-", "").lower()

    def sampler(self) -> Sampler:
        return XpuSampler()


XPU = Intel()
