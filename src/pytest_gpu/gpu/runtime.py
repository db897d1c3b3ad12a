"""This process's CUDA: its device list is pinned before a test narrows ``CUDA_VISIBLE_DEVICES``.

CUDA fixes a process's device list when its driver initialises (``cuInit``, which the
runtime, torch's ``is_available`` and any first CUDA call imply), from the
``CUDA_VISIBLE_DEVICES`` of that moment. During a test that variable names only the
lease (for subprocesses). If CUDA first started *inside* a test, the worker would keep
that test's narrow list for life and every later lease would land on a wrong or
invalid ordinal. So before the first lease is applied in a process, :func:`pin`
initialises the driver with the run's own ``CUDA_VISIBLE_DEVICES``: ``cuInit(0)`` opens
no context and allocates no GPU memory, and nothing is imported. From then on the
process numbers devices as :func:`pytest_gpu.vendors.devices.process_view` says (its vendor's
:meth:`~pytest_gpu.vendors.registry.Vendor.view`), and a
lease's GPU ``i`` is ``cuda:<view.index(i)>`` in the worker, ``cuda:0`` in subprocesses.

On simulated or fake GPUs the driver is :mod:`pytest_gpu.sim.cuda`, whose view is read
back exactly. On real GPUs ``libcuda.so.1`` is called through ctypes (``cuInit``, then
``cuDeviceGetCount`` and ``cuDeviceGetUuid_v2`` per ordinal, matched to NVML's UUIDs, so
a GPU NVML refused but CUDA counts still shifts the ordinals right); without that, the
view is predicted from the ``CUDA_VISIBLE_DEVICES`` the process pinned with. That path
follows the CUDA driver API's documentation and has not run on a GPU machine here.

On AMD GPUs (an inventory of vendor ``amd``) HIP is read back the same way through
``libamdhip64.so`` (``hipInit``, ``hipGetDeviceCount``, ``hipDeviceGet`` and
``hipDeviceGetUuid`` per ordinal, whose 16 bytes are the ASCII hex digits of ROCr's
``GPU-<16 hex>`` UUID: ROCm/clr ``rocdevice.cpp`` at f9f995c6), matched to amdsmi's UUIDs; the
library torch bundles is preferred, so that the process has one HIP runtime. Without it the
view is predicted from the ROCm visibility variables the process pinned with
(:func:`pytest_gpu.vendors.amd.rocm_view`). CI reads back the fake ``libamdhip64.so``
(:mod:`pytest_gpu.sim.hip`); no AMD GPU ran it here.

A process that has pinned has initialised CUDA's driver: like any process that used
CUDA, it must not ``fork`` children that use CUDA (use the ``spawn`` start method).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

from ..vendors import registry as vendors
from ..vendors.devices import Inventory


class LeaseUnreachable(RuntimeError):
    """This process's CUDA cannot address a leased GPU (its device list was fixed without it)."""


@dataclass
class _State:
    pinned: bool = False
    visible: str | None = None  # CUDA_VISIBLE_DEVICES when pinned
    outer: tuple[tuple[str, str], ...] = ()  # the vendor's visibility variables when pinned
    uuids: list[str] | None = None  # what the driver enumerates (UUIDs' hex digits), read back after cuInit
    note: str = ""


_state = _State()


def simulated(inventory: Inventory) -> bool:
    """Whether this process's CUDA is the simulated one (``sim:`` devices or fake GPUs)."""
    from ..sim import fake

    return inventory.simulated or fake.active()


def pin(inventory: Inventory) -> list[int]:
    """Initialise this process's CUDA with the run's device list (once); return that list.

    Call it while ``CUDA_VISIBLE_DEVICES`` is the run's (not a lease's).
    """
    if simulated(inventory):
        from ..sim import cuda

        return cuda.init()
    if not _state.pinned:
        _state.visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        _state.outer = vendors.of(inventory.vendor).outer(os.environ)
        if inventory.vendor == vendors.NVIDIA.name:
            _state.uuids, _state.note = _cu_init()
        elif inventory.vendor == "xpu":
            _state.uuids = None
            _state.note = "its Level Zero device list is predicted from ZE_AFFINITY_MASK, not read back"
        else:
            _state.uuids, _state.note = _hip_init()
        _state.pinned = True
    return view(inventory)


def view(inventory: Inventory) -> list[int]:
    """Physical indices in this process's CUDA ordinal order."""
    if simulated(inventory):
        from ..sim import cuda

        return cuda.init()
    machine = inventory.machine or inventory.devices
    if _state.uuids is not None:  # what the driver really enumerates, matched to NVML's devices
        by_uuid = {_hex(d.uuid): d.index for d in machine}
        found = [by_uuid.get(u) for u in _state.uuids]
        if all(i is not None for i in found):
            return [i for i in found if i is not None]
    # predicted from the variables it pinned with (the run's, before it pinned)
    outer = _state.outer if _state.pinned else vendors.started_with(inventory)
    return vendors.of(inventory.vendor).view(machine, outer)


def in_process(inventory: Inventory, indices: tuple[int, ...] | list[int]) -> list[int] | None:
    """This process's CUDA ordinals of physical GPUs ``indices``.

    ``None`` for MIG instances the process cannot use (CUDA gives a process one MIG
    instance): such a lease is for subprocesses. :class:`LeaseUnreachable` for any other
    GPU the process cannot see.
    """
    seen = view(inventory)
    hidden = [i for i in indices if i not in seen]
    if not hidden:
        return [seen.index(i) for i in indices]
    machine = {d.index: d for d in (inventory.machine or inventory.devices)}
    if all(i in machine and machine[i].parent is not None for i in hidden):
        return None
    if inventory.vendor != "nvidia":
        started_with = ", ".join(f"{k}={v!r}" for k, v in (_state.outer if _state.pinned else inventory.outer))
        run_s = ", ".join(f"{k}={v!r}" for k, v in inventory.outer)
        none = "no ZE_AFFINITY_MASK" if inventory.vendor == "xpu" else "no ROCm visibility variables"
        said = f"{started_with or none}; the run's: {run_s or 'none'}"
    else:
        started = _state.visible if _state.pinned else inventory.visible
        said = f"CUDA_VISIBLE_DEVICES={started!r}; the run's is {inventory.visible!r}"
    raise LeaseUnreachable(
        f"this process's CUDA cannot address GPU {hidden}: it enumerates {seen} (started with {said})"
        + (f"; {_state.note}" if _state.note else "")
        + ". Start CUDA outside tests, or leave CUDA_VISIBLE_DEVICES to pytest-gpu"
    )


def _hex(uuid: str) -> str:
    """The 32 hex digits of a ``GPU-…``/``MIG-…`` UUID, as the driver's 16 bytes give them."""
    return uuid.split("-", 1)[1].replace("-", "").lower() if "-" in uuid else uuid.lower()


def _cu_init() -> tuple[list[str] | None, str]:
    """``cuInit(0)`` through libcuda.so.1, then the UUIDs of what the driver enumerates.

    Returns (the UUIDs' hex digits in ordinal order, or ``None``; a sentence when something failed).
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


#: HIP error codes named in notes (hip_runtime_api.h's hipError_t)
_HIP_ERRORS = {1: "hipErrorInvalidValue", 100: "hipErrorNoDevice", 101: "hipErrorInvalidDevice"}


def _hip_library() -> tuple[ctypes.CDLL | None, str]:
    """HIP's runtime library: the one torch bundles (torch will load it: one HIP per process), else
    the dynamic linker's (one already loaded included), else ``$ROCM_PATH``/``$ROCM_HOME``/``/opt/rocm``'s."""
    import importlib.util

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


def _hip_init() -> tuple[list[str] | None, str]:
    """``hipInit(0)`` through libamdhip64.so, then the UUIDs of what HIP enumerates.

    Returns (the UUIDs' 16 hex digits in ordinal order, or ``None``; a sentence when something failed).
    """
    lib, why = _hip_library()
    if lib is None:
        return None, f"its HIP device list is predicted from ROCm's variables: {why}"
    said = "its HIP device list is predicted from ROCm's variables"
    result = lib.hipInit(0)
    if result != 0:
        return None, f"{said}: hipInit failed with {_HIP_ERRORS.get(result, f'hipError_t {result}')}"
    count = ctypes.c_int(0)
    result = lib.hipGetDeviceCount(ctypes.byref(count))
    if result != 0:
        return None, f"{said}: hipGetDeviceCount failed with {_HIP_ERRORS.get(result, f'hipError_t {result}')}"
    uuids = []
    for ordinal in range(count.value):
        device = ctypes.c_int(0)
        raw = (ctypes.c_char * 16)()
        if lib.hipDeviceGet(ctypes.byref(device), ordinal) != 0 or lib.hipDeviceGetUuid(raw, device) != 0:
            return None, f"{said}: could not read the UUID of HIP device {ordinal}"
        # ROCr's unique id as text: 16 hex digits ("XX..." on a GPU without one: matches no device)
        uuids.append(bytes(raw).decode("ascii", "replace").lower())
    return uuids, ""


def forget() -> None:
    """Forget the pin (tests only: a new process in spirit)."""
    global _state
    _state = _State()
