"""A process's simulated CUDA runtime, with the semantics of the real one.

- The device list is fixed at the process's first CUDA use (:func:`init`, the analogue
  of ``cuInit``, which every other call implies), from ``CUDA_VISIBLE_DEVICES`` as CUDA
  parses it (:func:`pytest_gpu.vendors.nvidia.cuda_view`; on another vendor's machine from
  its variables, as its runtime reads them: :meth:`pytest_gpu.vendors.vendor.Vendor.view`).
  Changing the variable later changes nothing in this process, only in its future subprocesses.
- There is a current device per host thread, as in CUDA: ordinal 0 in every thread until
  that thread calls :func:`set_device` (a thread a test starts is on ordinal 0, whatever
  the thread that started it chose). Contexts are per process (the primary context).
- The first touch of a device opens a context there (charged in the ledger):
  :func:`set_device` (CUDA 12's ``cudaSetDevice`` creates the primary context), an
  allocation, :func:`mem_get_info`. :func:`init` alone opens none.
- An ordinal outside the process's list raises :class:`SimDeviceError` ("invalid
  device ordinal").
- A sticky error (:func:`poison`: a device-side assert, an illegal address) leaves the
  process's CUDA unusable until it exits, as the real driver does: from then on every call
  that reaches the driver (an allocation, a free, :func:`set_device`, :func:`mem_get_info`,
  :func:`synchronize`) raises :class:`CudaError` with CUDA's message, and the memory the
  process holds stays charged in the ledger until the process exits.

Ordinals are relative to the process's fixed list; *units* are the ledger's device
numbers (a plain GPU's unit is its NVML index, see :mod:`pytest_gpu.sim.spec`).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..base.requests import format_size, parse_size
from ..vendors import registry as vendors
from .ledger import TAG_ENV, Ledger, OutOfMemoryError, SimDeviceError, ledger
from .spec import Unit

__all__ = [
    "STICKY_ERRORS",
    "Allocation",
    "CudaError",
    "OutOfMemoryError",
    "SimDeviceError",
    "allocate",
    "compute",
    "current_device",
    "device_count",
    "hang",
    "hold",
    "init",
    "initialized",
    "mem_get_info",
    "poison",
    "release_hang",
    "set_device",
    "sticky_error",
    "synchronize",
    "usage",
    "wait_for_kernels",
]

#: What the simulator raises as the runtime it models would (out of memory, an invalid ordinal,
#: a sticky error, and torch's and CuPy's errors that the doubles raise or let through).
MODELLED_ERRORS = (RuntimeError, MemoryError, IndexError, ValueError, TypeError)


def hidden_in_tracebacks(excinfo: Any) -> bool:
    """pytest's ``__tracebackhide__`` for the simulator's modules: a modelled error shows the
    test's line and its message, not the simulator's frames, as the real runtime's errors (which
    come from C) do; any other exception (a bug of the simulator) keeps its frames."""
    return excinfo is not None and bool(excinfo.errisinstance(MODELLED_ERRORS))


__tracebackhide__ = hidden_in_tracebacks

# cudaGetErrorString -> cudaGetErrorName of the errors that corrupt a context for good (CUDA runtime
# API, enum cudaError: "any further CUDA work will return the same error ... the process must be
# terminated and relaunched"), with their codes in ERROR_CODES. Texts as cudart 12 gives them; 911's
# text is not in any source read here (its name is: torch's and CuPy's messages both carry it).
STICKY_ERRORS = {
    "device-side assert triggered": "cudaErrorAssert",
    "an illegal memory access was encountered": "cudaErrorIllegalAddress",
    "the launch timed out and was terminated": "cudaErrorLaunchTimeout",
    "hardware stack error": "cudaErrorHardwareStackError",
    "an illegal instruction was encountered": "cudaErrorIllegalInstruction",
    "misaligned address": "cudaErrorMisalignedAddress",
    "operation not supported on global/shared address space": "cudaErrorInvalidAddressSpace",
    "invalid program counter": "cudaErrorInvalidPc",
    "unspecified launch failure": "cudaErrorLaunchFailure",
    "an external device encountered an error": "cudaErrorExternalDevice",
}

#: cudaGetErrorName -> the cudaError_t value (driver_types.h)
ERROR_CODES = {
    "cudaErrorIllegalAddress": 700,
    "cudaErrorLaunchTimeout": 702,
    "cudaErrorAssert": 710,
    "cudaErrorHardwareStackError": 714,
    "cudaErrorIllegalInstruction": 715,
    "cudaErrorMisalignedAddress": 716,
    "cudaErrorInvalidAddressSpace": 717,
    "cudaErrorInvalidPc": 718,
    "cudaErrorLaunchFailure": 719,
    "cudaErrorExternalDevice": 911,
}


class CudaError(RuntimeError):
    """A CUDA runtime call failed with ``error`` (``cudaGetErrorString``'s text): since a
    sticky error (:func:`poison`), every call that reaches the driver."""

    __module__ = "pytest_gpu.sim"

    def __init__(self, error: str) -> None:
        super().__init__(f"CUDA error: {error}")
        self.error = error


_sticky: dict[int, str] = {}  # pid -> the sticky error its CUDA is in (a forked child has its own CUDA)


def poison(error: str = "device-side assert triggered") -> None:
    """Inject a sticky CUDA error into this process (a kernel's device-side assert, an
    illegal address): every later CUDA call of the process raises :class:`CudaError`, and
    what it holds stays charged until it exits. ``error``: one of :data:`STICKY_ERRORS`."""
    if error not in STICKY_ERRORS:
        raise ValueError(f"poison: {error!r} is not a sticky CUDA error; expected one of {sorted(STICKY_ERRORS)}")
    _runtime()  # the machine it happens on: another ledger is another process
    _sticky[os.getpid()] = error


def sticky_error() -> str | None:
    """The sticky error this process's CUDA is in (``cudaGetErrorString``'s text), or ``None``."""
    if not _sticky:
        return None
    _runtime()  # another ledger is another machine, where this process starts anew
    return _sticky.get(os.getpid())


def clear_sticky() -> None:
    """Forget this process's sticky error and hung kernel, as a new process would start (tests of
    the double only)."""
    _sticky.pop(os.getpid(), None)
    release_hang()


_hung: dict[int, threading.Event] = {}  # pid -> set when its hung kernel ends (a forked child has none)


def hang() -> None:
    """Launch a kernel in this process that never finishes (a deadlock, an endless loop): every
    synchronising call (:func:`synchronize`, torch's and CuPy's) blocks until it ends, which on
    a GPU without a watchdog is never; :func:`release_hang` ends it (tests of the double only)."""
    _runtime()
    _hung.setdefault(os.getpid(), threading.Event())


def release_hang() -> None:
    """End this process's hung kernel: the calls blocked on it return."""
    event = _hung.pop(os.getpid(), None)
    if event is not None:
        event.set()


def wait_for_kernels() -> None:
    """Block until this process's kernels are done, as ``cudaDeviceSynchronize`` does."""
    event = _hung.get(os.getpid())
    if event is not None:
        event.wait()


def _check_sticky() -> None:
    """Raise the process's sticky error, as every runtime call after one does."""
    error = sticky_error()
    if error is not None:
        raise CudaError(error)


@dataclass
class _Runtime:
    key: str = ""  # the ledger the view belongs to: another ledger is another machine
    ledger: Ledger | None = None  # that ledger's object in this process (the same key, found faster)
    view: list[int] | None = None  # units, in ordinal order; None until first use
    units: tuple[Unit, ...] = ()  # the machine's units when the view was fixed (their properties do not change)
    started: str = ""  # the visibility variables when the view was fixed, as messages say them
    local: threading.local = field(default_factory=threading.local)  # .current: the thread's device
    caps: dict[int, int] = field(default_factory=dict)  # unit -> bytes (the lease's cap)
    pid: int = 0  # whose contexts ``ctx`` knows
    ctx: set[int] = field(default_factory=set)  # units where this process surely has a context
    slowdown: bool | None = None  # whether the machine shares compute (slowdown=share); None: not read yet


_rt = _Runtime()


def _runtime(led: Ledger | None = None) -> _Runtime:
    led = led or ledger()
    if _rt.ledger is led:  # asked on every call: ledger() gives one object per ledger and process
        return _rt
    key = str(led.path)
    if _rt.key != key:
        # Another ledger is another machine (in-process test runs): start as a new process would.
        forget()
        _rt.key = key
    _rt.ledger = led
    return _rt


def _view() -> list[int]:
    """The process's device list (units, by ordinal), fixed now if it is not yet."""
    view = _runtime().view
    return _fix_view() if view is None else view


def init() -> list[int]:
    """Fix this process's device list now (no context is opened); return it as units."""
    return list(_view())


def _fix_view() -> list[int]:
    led = ledger()
    _runtime(led)
    if _rt.view is None:
        machine = led.machine()
        vendor = vendors.of(machine.vendor)  # the one model of its runtime's enumeration (AMD: ROCr's, then HIP's)
        units = list(machine.all_devices())
        if machine.rocr_order:  # ROCr enumerates in another order than amdsmi's indices (AMD has no MIG)
            rank = {index: n for n, index in enumerate(machine.rocr_order)}
            units.sort(key=lambda u: rank[u.index])
        started = vendor.outer(os.environ)
        _rt.view = vendor.view(tuple(units), started)
        _rt.units = machine.units()
        _rt.started = vendor.said(started)
    return _rt.view


def initialized() -> bool:
    """Whether this process's device list is fixed."""
    return _runtime().view is not None


def device_count() -> int:
    return len(_view())


def _current() -> int:
    """The calling thread's current ordinal (0 until it sets one, as ``cudaGetDevice`` says)."""
    current: int = getattr(_rt.local, "current", 0)
    return current


def current_device() -> int:
    _view()
    return _current()


def unit_of(ordinal: int | str | None = None) -> int:
    """The ledger unit behind ``ordinal`` (default: the current device)."""
    view = _view()
    chosen = _current() if ordinal is None else _ordinal(ordinal)
    if isinstance(chosen, bool) or not isinstance(chosen, int):
        raise SimDeviceError(f"device must be an int ordinal, got {ordinal!r}")
    if not 0 <= chosen < len(view):
        raise SimDeviceError(
            f"invalid device ordinal {chosen}: this process sees {len(view)} simulated GPU(s) "
            f"(its CUDA started with {_rt.started})"
        )
    return view[chosen]


def properties(ordinal: int | str | None = None) -> Unit:
    """The device behind ``ordinal`` (default: the current device) as ``cudaGetDeviceProperties``
    describes it (name, uuid, total): read from the machine once, when the process's device
    list was fixed, as a device's properties do not change while a process uses it."""
    unit = unit_of(ordinal)
    return _rt.units[unit]


def _device_type() -> str:
    """How torch names this machine's devices: ``xpu`` on a fake Intel machine, else ``cuda``."""
    return vendors.of(ledger().machine().vendor).device_kind


def _ordinal(device: object) -> object:
    # "cuda:1" and "cuda" as torch writes devices (a lease's ``device``); ints as CUDA's.
    # "xpu:1" on a fake Intel machine, whose leases name their devices as torch.xpu does.
    if isinstance(device, str):
        name, _, number = device.partition(":")
        if name == _device_type() and (number.isdigit() or not number):
            return int(number) if number else _current()
    return device


def ordinal_of(unit: int) -> int | None:
    """This process's ordinal for ledger unit ``unit``, or ``None`` if it cannot see it."""
    view = _view()
    return view.index(unit) if unit in view else None


def _known_contexts() -> set[int]:
    # contexts live until the process exits: once seen, a context need not be asked for again
    if _rt.pid != os.getpid():  # a forked child has none of its parent's
        _rt.pid, _rt.ctx = os.getpid(), set()
    return _rt.ctx


def _open_context(unit: int) -> None:
    known = _known_contexts()
    if unit not in known:
        ledger().allocate(0, unit, os.environ.get(TAG_ENV), None, thread=thread_label())
        known.add(unit)


def thread_label() -> list[int | str]:
    """What the ledger records of the calling thread: [thread id, thread name]."""
    me = threading.current_thread()
    return [threading.get_ident(), me.name]


def set_device(ordinal: int | str) -> None:
    """Make ``ordinal`` (or ``"cuda:N"``) current, opening its context (as ``cudaSetDevice`` does in CUDA 12)."""
    _check_sticky()
    unit = unit_of(ordinal)
    _open_context(unit)
    _rt.local.current = _view().index(unit)


def mem_get_info(ordinal: int | None = None) -> tuple[int, int]:
    """``cudaMemGetInfo``: (free, total) bytes on ``ordinal``; total excludes the driver's reserve."""
    _check_sticky()
    unit = unit_of(ordinal)
    led = ledger()
    _open_context(unit)
    info = _rt.units[unit]
    total = info.total - info.reserved
    return max(total - led.used()[unit], 0), total


def synchronize() -> None:
    """``cudaDeviceSynchronize`` on the current device: where a kernel's sticky error surfaces;
    it waits for a hung kernel (:func:`hang`) for ever."""
    _check_sticky()
    wait_for_kernels()
    set_device(current_device())  # needs (and opens) the current device's context


def contexts() -> set[int]:
    """Units on which this process has a context (as the ledger, the driver's truth, says)."""
    found = ledger().contexts_of(os.getpid())
    _known_contexts().update(found)
    return found


def has_context(unit: int) -> bool:
    """Whether this process has a context on ``unit``."""
    return unit in _known_contexts() or unit in contexts()


def set_memory_cap(unit: int, nbytes: int | None) -> None:
    """Cap this process's allocations on ``unit`` (the lease's budget); ``None`` lifts it."""
    caps = _runtime().caps
    if nbytes is None:
        caps.pop(unit, None)
    else:
        caps[unit] = nbytes


def forget() -> None:
    """Forget this process's runtime state, as if it were a new process (tests of the double only)."""
    global _rt
    _rt = _Runtime()
    _sticky.clear()
    for event in _hung.values():
        event.set()
    _hung.clear()


class Allocation:
    """Simulated device memory (a raw ``cudaMalloc``); free it with :meth:`free` or a ``with`` block.

    Unlike a framework's tensor it is not freed when garbage-collected.
    """

    def __init__(self, ledger_: Ledger, handle: str, nbytes: int, device: int, unit: int) -> None:
        self._ledger = ledger_
        self._handle: str | None = handle
        self.nbytes = nbytes
        self.device = device  # the ordinal it was allocated on
        self.physical = unit  # the ledger unit (a plain GPU's NVML index)

    def free(self) -> None:
        """``cudaFree``; after a sticky error it fails and the memory stays charged until the process exits."""
        if self._handle is not None:
            _check_sticky()
            self._ledger.free(self._handle)
            self._handle = None

    @property
    def freed(self) -> bool:
        return self._handle is None

    def __enter__(self) -> Allocation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    def __repr__(self) -> str:
        state = "freed" if self.freed else "live"
        return f"<sim.Allocation {format_size(self.nbytes)} on cuda:{self.device} (GPU {self.physical}) {state}>"


def free_all(allocations: list[Allocation]) -> None:
    """``cudaFree`` each of ``allocations`` (those not freed yet), in one write of each ledger:
    a framework's cache emptied at once. After a sticky error it fails and frees none."""
    live = [a for a in allocations if a._handle is not None]
    if not live:
        return
    _check_sticky()
    by_ledger: dict[int, tuple[Ledger, list[str]]] = {}
    for allocation in live:
        assert allocation._handle is not None
        by_ledger.setdefault(id(allocation._ledger), (allocation._ledger, []))[1].append(allocation._handle)
    for led, handles in by_ledger.values():
        led.free(*handles)
    for allocation in live:
        allocation._handle = None


def allocate(nbytes: int | str, device: int | str | None = None, *, capped: bool = True) -> Allocation:
    """Allocate simulated memory on ``device`` (an ordinal or ``"cuda:N"``; default: the current device).

    Raises :class:`OutOfMemoryError` when the device or this process's cap is exceeded,
    :class:`SimDeviceError` for an ordinal this process cannot see. ``capped=False``: a
    framework's own reservation that its own cap already judged (torch's fraction under
    ``cudaMallocAsync`` or expandable segments, which may reserve past it): the lease's
    cap here stands in for a framework's, and the hardware has no other.
    """
    size = parse_size(nbytes)
    if size <= 0:
        raise ValueError(f"allocate: expected a positive size, got {nbytes!r}")
    _check_sticky()
    unit = unit_of(device)
    ordinal = _view().index(unit)
    led = ledger()
    cap = _rt.caps.get(unit) if capped else None
    try:
        handle = led.allocate(size, unit, os.environ.get(TAG_ENV), cap, thread=thread_label())
    except OutOfMemoryError as exc:
        raise exc.with_traceback(None) from None  # cudaMalloc's error: from here, not the ledger's insides
    _known_contexts().add(unit)
    return Allocation(led, handle, size, ordinal, unit)


def hold(nbytes: int | str, seconds: float, device: int | str | None = None) -> None:
    """Allocate ``nbytes``, :func:`compute` for ``seconds``, free: a stand-in for a GPU kernel's work."""
    with allocate(nbytes, device):
        compute(seconds, device)


# How often a computation on a machine with slowdown=share reads how many share its GPU.
COMPUTE_TICK = 0.02


def compute(seconds: float, device: int | str | None = None) -> None:
    """Compute on ``device`` (default: the current device) for what takes the GPU ``seconds``
    alone: a kernel's work, in the process's context there (opened if it is not).

    On a machine whose spec has ``slowdown=share`` the GPU's time is shared: while k processes
    compute on the device (a GPU, or a MIG instance: its own slice of compute) each advances
    at 1/k of real time, as a GPU time-slices between contexts, k read again every
    :data:`COMPUTE_TICK` seconds; so two computations of 1 s that overlap on one GPU both end
    after 2 s, on two GPUs after 1 s. Without it, a plain sleep of ``seconds``."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 <= seconds < float("inf"):
        raise ValueError(f"compute: expected a finite number of seconds >= 0, got {seconds!r}")
    _check_sticky()
    unit = unit_of(device)
    led = ledger()
    if not _slowdown(led):
        _open_context(unit)
        time.sleep(seconds)
        return
    led.begin_compute(unit, os.environ.get(TAG_ENV), thread=thread_label())
    _known_contexts().add(unit)
    try:
        left, last = float(seconds), time.monotonic()
        while left > 0:
            share = max(1, led.computing(unit))
            time.sleep(min(COMPUTE_TICK, left * share))
            now = time.monotonic()  # the time taken, not the time asked: a loaded host's ticks run long
            left -= (now - last) / share
            last = now
    finally:
        led.end_compute(unit)


def _slowdown(led: Ledger) -> bool:
    """Whether ``led``'s machine shares compute (its spec, fixed while this process uses it)."""
    runtime = _runtime(led)
    if runtime.slowdown is None:
        runtime.slowdown = led.machine().slowdown
    return runtime.slowdown


def usage() -> dict[int, int]:
    """Bytes in use per ledger unit, contexts included."""
    return ledger().used()
