"""NVIDIA: GPUs found through NVML, ``CUDA_VISIBLE_DEVICES`` as CUDA parses it, NVML's process
lists, CUDA's device list pinned and read back through ``libcuda.so.1``.

Indices are *physical* (NVML's PCI bus order); a MIG instance gets a number after the last
GPU (GPUs first, then each MIG-mode GPU's instances in slot order). Everything the plugin
sets for CUDA goes with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so that CUDA's numbering agrees
with NVML's. A run's inventory keeps the ``CUDA_VISIBLE_DEVICES`` it started with
(:attr:`~pytest_gpu.vendors.devices.Inventory.visible`): with every device the machine has,
it says how a process's CUDA numbers them (:func:`cuda_view`).

The NVML sampler (:class:`NvmlSampler`) is what pytest-gpu always ran: the foreign sampler's
(:meth:`~NvmlSampler.processes`: compute and graphics lists, v3 records where the driver has
them; v2 memory with the driver's reserve) and the verifier's and calibration's
(:meth:`~NvmlSampler.compute`: pynvml's own compute list). :meth:`Nvidia.sampler` gives the
process's one NVML, initialised at its first use and kept open until the process exits
(:func:`kept_nvml`): a GPU test samples twice, and each ``nvmlInit``/``nvmlShutdown`` pair
cost it more than the samples. NVML is not fork-safe: a forked child initialises its own.

Runs against the fake ``libnvidia-ml.so.1`` in CI (``PYTEST_GPU_FAKE_GPUS``,
:mod:`pytest_gpu.sim.nvml`); the NVML and ``libcuda.so.1`` paths follow NVIDIA's
documentation and were not run on a real GPU machine by the author.
"""

from __future__ import annotations

import ctypes
import functools
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from types import ModuleType
from typing import Any

from . import kinds, libraries
from .devices import Device, DeviceSpecError, Inventory, addressable, in_mig_mode
from .nvmlversion import nvml_version_problem
from .sampling import Refused, Sampler, Unavailable, Unlistable
from .vendor import Vendor

CUDA_VAR = "CUDA_VISIBLE_DEVICES"
#: The variables that narrow what a CUDA process sees; HIP's too: HIP on NVIDIA reads it.
VISIBILITY_VARS: tuple[str, ...] = (CUDA_VAR, "HIP_VISIBLE_DEVICES")
#: ``--gpus`` without a vendor (NVIDIA's, and the simulated machines').
GPUS_FORM = "auto, none, an index list such as 0,2,3, or simulated devices such as sim:4x16GiB"


class NvmlUnavailable(Unavailable):
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
        if match is None or match in chosen or in_mig_mode(match, devices):
            break
        chosen.append(match)
    return tuple(chosen)


def cuda_view(machine: tuple[Device, ...], visible: str | None) -> list[int]:
    """Physical indices a CUDA process enumerates, in ordinal order, when it starts under
    ``CUDA_VISIBLE_DEVICES=visible`` on ``machine`` (every device, MIG-mode GPUs included).

    The one model of CUDA's enumeration: the simulated runtime uses it too.
    """
    seen = addressable(machine) if visible is None else select_visible(machine, visible)
    # CUDA gives a process one MIG instance, the first it can see (NVIDIA's MIG user guide)
    first_mig = next((d.index for d in seen if d.parent is not None), None)
    return [d.index for d in seen if d.parent is None or d.index == first_mig]


def usable(found: tuple[Device, ...], visible: str | None) -> tuple[Device, ...]:
    """The devices a run may lease under an outer ``CUDA_VISIBLE_DEVICES``, in its order (every
    visible MIG instance: each lease is used by one process, a subprocess if need be)."""
    return addressable(found) if visible is None else select_visible(found, visible)


def why_none(found: tuple[Device, ...], visible: str | None) -> str:
    """Why a run started under ``CUDA_VISIBLE_DEVICES=visible`` may lease none of ``found``."""
    if not found:
        return "NVML reports no usable GPUs"
    if visible is not None:
        listed = ", ".join(f"{d.index}={d.uuid}" for d in found)
        return f"CUDA_VISIBLE_DEVICES={visible!r} matches none of the devices NVML reports ({listed})"
    return "every GPU NVML reports is in MIG mode without instances"


@functools.cache
def version_problem() -> str:
    """Why the installed nvidia-ml-py's process lists cannot be trusted ("": they can); read once."""
    return nvml_version_problem() or ""


class NvmlSampler:
    """NVML, initialised once (:class:`Unavailable` when it cannot be); :meth:`close` shuts it down."""

    name = "NVML"

    def __init__(self) -> None:
        self._handles: dict[str, Any] = {}
        try:
            pynvml = libraries.nvml()
            pynvml.nvmlInit()
        except ImportError:
            raise NvmlUnavailable("nvidia-ml-py is not installed") from None
        except Exception as exc:  # NVMLError (no driver, no library) and whatever a broken install raises
            raise NvmlUnavailable(f"NVML unavailable ({exc})") from None
        self._nvml: ModuleType = pynvml

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:
            pass
        self._handles.clear()

    def problem(self) -> str:
        return version_problem()

    def forget(self, uuid: str) -> None:
        self._handles.pop(uuid, None)

    def _handle(self, uuid: str) -> Any:
        handle = self._handles.get(uuid)
        if handle is None:
            handle = self._handles[uuid] = self._nvml.nvmlDeviceGetHandleByUUID(uuid)
        return handle

    def memory(self, uuid: str) -> tuple[int, int | None]:
        pynvml = self._nvml
        try:
            handle = self._handle(uuid)
            version = getattr(pynvml, "nvmlMemory_v2", None)
            if version is not None:
                try:
                    info = pynvml.nvmlDeviceGetMemoryInfo(handle, version=version)
                    return int(info.used), int(info.reserved)  # v2: used excludes reserved
                except pynvml.NVMLError as exc:
                    if exc.value not in (pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, pynvml.NVML_ERROR_NOT_SUPPORTED):
                        raise
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)
            return int(info.used), None
        except pynvml.NVMLError as exc:
            raise Refused(str(exc)) from None

    def processes(self, uuid: str) -> dict[int, int | None]:
        """Every process on the device, compute and graphics, once each (pid -> bytes; None: a
        list gave it without its memory, NVML_VALUE_NOT_AVAILABLE: not measured, never 0)."""
        handle = self._handle(uuid)
        found: dict[int, int | None] = {}
        for kind in ("Compute", "Graphics"):
            try:
                procs = self._list(handle, kind)
            except Unlistable:
                if kind == "Compute":
                    raise
                continue  # no graphics list (a compute-only GPU may refuse it): compute is what matters
            for proc in procs:
                pid = int(proc.pid)
                used = None if proc.usedGpuMemory is None else int(proc.usedGpuMemory)
                if pid not in found:
                    found[pid] = used
                elif found[pid] is None or used is None:
                    # listed without its memory in one list: the other's figure may leave out what
                    # that one holds, so it is not measured (the foreign share is then estimated)
                    found[pid] = None
                else:  # one process in both lists holds one amount of memory, not two
                    found[pid] = max(found[pid] or 0, used)
        return found

    def compute(self, uuid: str) -> list[tuple[int, int | None]]:
        """pynvml's own compute list (its record version): what the verifier always read."""
        pynvml = self._nvml
        try:
            # the handle as looked up once (a verifier samples every GPU twice a test): NVML's
            # handles hold while it stays initialised, and one that failed is looked up again
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(self._handle(uuid))
        except (pynvml.NVMLError, _mismatch(pynvml)) as exc:
            self.forget(uuid)
            # MIG without privileges: NoPermission; a driver older than the bindings:
            # nvidia-ml-py raises its library-mismatch error (not an NVMLError)
            raise Unlistable(f"NVML cannot list the processes there ({exc})", str(exc)) from None
        return [(int(p.pid), None if p.usedGpuMemory is None else int(p.usedGpuMemory)) for p in procs]

    def _list(self, handle: Any, kind: str) -> list[Any]:
        """One of NVML's process lists, in the newest records both the driver and the bindings have."""
        pynvml = self._nvml
        for suffix in ("_v3", "_v2", ""):
            function = getattr(pynvml, f"nvmlDeviceGet{kind}RunningProcesses{suffix}", None)
            if function is None:
                continue
            try:
                return list(function(handle))
            except pynvml.NVMLError as exc:
                if exc.value == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                    continue  # an older driver: try older records
                raise Unlistable(f"NVML cannot list the processes there ({exc})") from None
            except Exception as exc:  # nvidia-ml-py's library-mismatch error is not an NVMLError
                raise Unlistable(f"NVML cannot list the processes there ({exc})") from None
        raise Unlistable("NVML has no process list for it")


class KeptNvml(NvmlSampler):
    """The process's NVML (:func:`kept_nvml`): :meth:`close` leaves it open for the next caller."""

    @property
    def library(self) -> ModuleType:
        """The pynvml it was opened with."""
        return self._nvml

    def close(self) -> None:
        pass

    def shut(self) -> None:
        """Shut it down for real (the process's NVML is forgotten: :func:`forget_kept_nvml`)."""
        super().close()


_kept: libraries.PerProcess[KeptNvml] = libraries.PerProcess(KeptNvml)  # a forked child's copy: dropped, no shutdown


def kept_nvml() -> KeptNvml:
    """This process's NVML, initialised at the first call and kept open; a forked child (whose
    copy NVML does not count as initialised, and whose parent's handles must not be used)
    initialises its own. :class:`NvmlUnavailable` when NVML cannot be initialised (tried again
    at the next call)."""
    loaded = sys.modules.get("pynvml")  # another pynvml than the one it was opened with: not this NVML
    return _kept.get(renew=lambda kept: loaded is not None and loaded is not kept.library)


def forget_kept_nvml() -> None:
    """Shut the process's kept NVML down: the library it was opened on goes (fake GPUs turned off)."""
    kept = _kept.take()
    if kept is not None:
        kept.shut()


def _mismatch(pynvml: ModuleType) -> type[Exception]:
    found = getattr(pynvml, "NVMLLibraryMismatchError", None)
    return found if isinstance(found, type) and issubclass(found, Exception) else pynvml.NVMLError


def cu_init() -> tuple[list[str] | None, str]:
    """``cuInit(0)`` through libcuda.so.1, then the UUIDs of what the driver enumerates.

    Returns (the UUIDs' hex digits in ordinal order, or ``None``; a sentence when something failed).
    Follows the CUDA driver API's documentation; not run on a GPU machine here.
    """
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return None, f"libcuda.so.1 not loadable ({exc})"
    result = lib.cuInit(0)
    if result != 0:
        return None, f"cuInit failed with CUresult {result}"
    count = ctypes.c_int(0)
    if lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return None, "cuDeviceGetCount failed"
    get_uuid = getattr(lib, "cuDeviceGetUuid_v2", None) or getattr(lib, "cuDeviceGetUuid", None)
    if get_uuid is None:
        return None, "libcuda.so.1 has no cuDeviceGetUuid"
    uuids = []
    for ordinal in range(count.value):
        device = ctypes.c_int(0)
        raw = (ctypes.c_ubyte * 16)()
        if lib.cuDeviceGet(ctypes.byref(device), ordinal) != 0 or get_uuid(raw, device) != 0:
            return None, f"could not read the UUID of CUDA device {ordinal}"
        uuids.append(bytes(raw).hex())
    return uuids, ""


class Nvidia(Vendor):
    """NVIDIA's GPUs: NVML, ``CUDA_VISIBLE_DEVICES``, CUDA, NCCL."""

    kind = kinds.NVIDIA
    source = "nvml"
    driver = NvmlSampler.name
    visibility = VISIBILITY_VARS
    forms = GPUS_FORM
    gives_gpus = "the NVIDIA driver, CUDA_VISIBLE_DEVICES"
    collective = "nccl"
    collective_label = "NCCL"
    _missing = "no usable GPU with index {missing}; this machine has {known}"

    def devices(self) -> tuple[tuple[Device, ...], str]:
        return nvml_devices()

    def installed(self) -> bool:
        return True  # nvidia-ml-py is a dependency; its library is found when NVML is asked

    def outer(self, environ: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
        value = environ.get(CUDA_VAR)
        return () if value is None else ((CUDA_VAR, value),)

    def started_with(self, inventory: Inventory) -> tuple[tuple[str, str], ...]:
        """NVIDIA's inventory keeps its one variable as :attr:`Inventory.visible`."""
        return () if inventory.visible is None else ((CUDA_VAR, inventory.visible),)

    def said(self, outer: Sequence[tuple[str, str]]) -> str:
        return f"{CUDA_VAR}={dict(outer).get(CUDA_VAR)!r}"

    def view(self, machine: tuple[Device, ...], outer: Sequence[tuple[str, str]]) -> list[int]:
        return cuda_view(machine, dict(outer).get(CUDA_VAR))

    def usable(self, machine: tuple[Device, ...], outer: Sequence[tuple[str, str]]) -> tuple[Device, ...]:
        return usable(machine, dict(outer).get(CUDA_VAR))

    def none_left(self, found: tuple[Device, ...], outer: Sequence[tuple[str, str]]) -> str:
        return why_none(found, dict(outer).get(CUDA_VAR))

    def inventory_of(
        self,
        devices: tuple[Device, ...],
        source: str,
        note: str,
        found: tuple[Device, ...],
        outer: tuple[tuple[str, str], ...],
    ) -> Inventory:
        return Inventory(devices, source, note, found, dict(outer).get(CUDA_VAR))

    def sim_spec(self, spec: str, rest: str, *, named: bool) -> str:
        """``sim:4x16GiB``: the default vendor's simulated machine, spelled without a vendor."""
        if named:
            raise DeviceSpecError(f"--gpus {spec!r}: simulated devices take no vendor; expected {rest}")
        return rest

    def by_index(self, found: tuple[Device, ...]) -> tuple[Device, ...]:
        return tuple(d for d in found if d.parent is None)  # MIG instances have no index of their own to ask for

    def hidden(self, hidden: list[int], outer: Sequence[tuple[str, str]]) -> str:
        verb = "is" if len(hidden) == 1 else "are"
        return f"GPU {hidden} {verb} hidden by {self.said(outer)} (or in MIG mode); expected indices CUDA can see"

    def lease_env(self, names: Sequence[str]) -> dict[str, str]:
        return dict.fromkeys(VISIBILITY_VARS, ",".join(names))

    def pin(self) -> tuple[list[str] | None, str]:
        return cu_init()

    def sampler(self) -> Sampler:
        return kept_nvml()

    def untrusted(self) -> str:
        return version_problem()  # the installed nvidia-ml-py's, which amdsmi and Sysman do not use

    def gpu_label(self, device: Device) -> str:
        return f"GPU {device.index}" if device.parent is None else f"GPU {device.parent} MIG unit {device.index}"


NVIDIA = Nvidia()
