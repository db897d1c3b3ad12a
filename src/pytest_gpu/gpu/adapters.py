"""The built-in implementations of the ``pytest_gpu_confine`` hook: torch and CuPy.

Registered by the plugin as ``gpu_adapters`` (``-p no:gpu_adapters`` turns them off, for a
suite that confines these frameworks its own way). Neither is imported here: each adapter
runs when its framework is imported (:meth:`Confinement.when_imported`).

They follow torch's and CuPy's own sources (``c10/cuda``'s ``setMemoryFraction`` called
``SetDevice`` and left it before torch 2.10; the caching allocator keeps freed blocks until
``empty_cache``; ``reset_peak_memory_stats`` sets the peak to the current reserve; CuPy's
``set_limit`` and ``free_all_blocks`` act on the current device's pool; ``Device.__exit__``
sets the device it found, unconditionally). Exercised in CI against
:mod:`pytest_gpu.sim.torch_cuda` and :mod:`pytest_gpu.sim.cupy_cuda`; on a real GPU only
where a device machine ran ``tests/gpu/``.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

from ..vendors import registry as vendors
from .isolation import Confinement, GpuLease, Settled, settle, share, unshare
from .torchstats import set_fractions, torch_counters


@pytest.hookimpl
def pytest_gpu_confine(lease: GpuLease, confinement: Confinement) -> None:
    """Confine torch and CuPy, now or when the test imports them, to ``lease``."""
    ordinals = confinement.ordinals
    confinement.when_imported("torch", lambda torch: _confine_torch(torch, lease, ordinals, confinement))
    confinement.when_imported("cupy", lambda cupy: _confine_cupy(cupy, lease, ordinals, confinement))


def _has_context(torch: ModuleType, ordinal: int, device: ModuleType | None = None) -> bool:
    """Whether this process holds memory on ``ordinal`` (CUDA: its primary context). ``device``:
    torch's device module when it is not ``torch.cuda`` (``torch.xpu``, which has no such probe)."""
    probe = getattr(torch._C, "_cuda_hasPrimaryContext", None) if device is None else None
    if probe is not None:
        return bool(probe(ordinal))
    return bool((device or torch.cuda).memory_reserved(ordinal) > 0)


def collect_while(held: Callable[[], bool]) -> None:
    """Collect garbage while ``held()`` says memory is still held: the youngest generation
    first, a full collection (0.1-0.2 s in a process that imported torch) only if the
    younger ones did not free it. Nothing at all when nothing is held."""
    for generation in (0, 1, 2):
        if not held():
            return
        gc.collect(generation)


# applies waiting for torch to start CUDA (leases held now, oldest first), run by one call
# queued with torch.cuda._lazy_call per torch module: torch never empties its queue, and each
# queued call formats the stack, so one per lease would cost every test that never starts CUDA
_deferred: dict[Callable[[], None], None] = {}
_queued: set[int] = set()  # id() of the torch.cuda modules that have the call queued


def _run_deferred() -> None:
    for apply in list(_deferred):
        _deferred.pop(apply, None)
        apply()


def _defer(cuda: ModuleType, apply: Callable[[], None]) -> bool:
    """Run ``apply`` when torch starts CUDA; ``False``: this torch cannot say (run it now)."""
    lazy_call = getattr(cuda, "_lazy_call", None)
    if lazy_call is None:
        return False
    _deferred[apply] = None
    if id(cuda) not in _queued:
        _queued.add(id(cuda))
        lazy_call(_run_deferred)
    return True


_said_uncapped: set[str] = set()  # the device modules whose missing cap was said (once per process)


def _uncapped(torch: ModuleType, device: ModuleType, done: Confinement) -> None:
    """Say, once per process, that this torch cannot cap its allocator on the device (no
    ``set_per_process_memory_fraction``): the lease's memory is not enforced by torch, and is
    still verified after the test."""
    name = device.__name__
    if name not in _said_uncapped:
        _said_uncapped.add(name)
        done.notes.append(
            f"torch {getattr(torch, '__version__', '?')} has no {name}.set_per_process_memory_fraction (it came in "
            "torch 2.10): the lease's memory is not enforced by torch in this process; what tests use is still verified"
        )


def _confine_torch(torch: ModuleType, lease: GpuLease, ordinals: list[int], done: Confinement) -> None:
    # Intel GPUs: torch.xpu, whose Python API is torch.cuda's for everything done here
    # (torch/xpu/__init__.py, torch/xpu/memory.py: set_device, set_per_process_memory_fraction,
    # reset_peak_memory_stats, empty_cache, memory_stats, _lazy_call)
    cuda = getattr(torch, vendors.of(lease.vendor).device_kind, None)
    if cuda is None or not cuda.is_available():
        return
    xpu = cuda is not getattr(torch, "cuda", None)  # torch.xpu: no cuBLAS workspaces, no primary-context probe
    state: dict[str, Any] = {"active": True, "applied": False, "previous": None, "base": {}}

    def total_of(ordinal: int, index: int) -> int:
        # torch caps a fraction of the total *it* sees (totalGlobalMem, = cudaMemGetInfo's total), a
        # little less than NVML's. Not through get_device_properties: it asserts ordinal <
        # device_count(), and torch < 2.4 (before pytorch#122815) cached device_count at its first
        # call (lru_cache) from the CUDA_VISIBLE_DEVICES of that moment, the lease's when CUDA
        # starts inside one. The accessor torch's lazy init defines checks the driver's count.
        unchecked = getattr(cuda, "_get_device_properties", None)
        if unchecked is not None:
            return int(unchecked(ordinal).total_memory) or _capacity(done, index)
        return _capacity(done, index)

    def fraction(cap: int | None, ordinal: int, index: int) -> float:
        return 1.0 if cap is None else min(1.0, cap / total_of(ordinal, index))

    def settle_(ordinal: int, index: int, settled: Settled) -> None:
        """Set the cap the books say on ``ordinal``; a lease that became active there starts its
        peak afresh (its own peak is read from there on: Confinement.peaks)."""
        cap = getattr(cuda, "set_per_process_memory_fraction", None)
        if cap is None:  # torch.xpu before torch 2.10 (pytorch#165510): raising here would break torch's lazy init
            _uncapped(torch, cuda, done)
        else:
            cap(fraction(settled.cap, ordinal, index), ordinal)
        if settled.opened:
            cuda.reset_peak_memory_stats(ordinal)

    def apply() -> None:
        if not state["active"] or state["applied"]:
            return  # the lease ended before torch started CUDA
        state["applied"] = True
        state["previous"] = cuda.current_device()
        # Blocks an earlier test left in the cache would count as this test's peak, and are
        # memory the broker has given to someone else.
        cuda.empty_cache()
        for ordinal, index in zip(ordinals, lease.indices, strict=True):
            counters = torch_counters(cuda, ordinal)
            share("torch", ordinal, done.key, lease.memory)
            settle_(ordinal, index, settle("torch", ordinal, counters.capped, counters.peak))
            state["base"][ordinal] = counters.allocated  # what undo's check compares with
        cuda.set_device(ordinals[0])

    def resume() -> None:
        if not state["active"] or not state["applied"]:
            return
        settled = {}
        for ordinal in ordinals:
            counters = torch_counters(cuda, ordinal)
            settled[ordinal] = settle("torch", ordinal, counters.capped, counters.peak)
        # the test goes on where it was: torch < 2.10 moved the current device with each fraction
        caps = {o: s.cap for o, s in settled.items()}
        indices = dict(zip(ordinals, lease.indices, strict=True))
        if getattr(cuda, "set_per_process_memory_fraction", None) is None:
            _uncapped(torch, cuda, done)  # torch.xpu before torch 2.10: nothing to set
        else:
            set_fractions(cuda, {o: fraction(caps[o], o, indices[o]) for o in ordinals})
        for ordinal, settled_ in settled.items():
            if settled_.opened:
                cuda.reset_peak_memory_stats(ordinal)

    def undo() -> None:
        state["active"] = False
        _deferred.pop(apply, None)
        if not state["applied"]:
            return  # torch never started CUDA during the lease: nothing to put back
        clear = None if xpu else getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()  # cuBLAS keeps workspaces in torch's allocator: not the test's leak
        base: dict[int, int] = state["base"]
        # tensors only a reference cycle still holds: collected only when torch still counts
        # memory the lease's start did not have (a full collection costs 0.1 s with torch loaded)
        collect_while(lambda: any(torch_counters(cuda, o).allocated > base.get(o, 0) for o in ordinals))
        cuda.empty_cache()  # give the lease's memory back for real, not to this worker's cache
        for ordinal, index in zip(ordinals, lease.indices, strict=True):
            counters = torch_counters(cuda, ordinal)
            settled = unshare("torch", ordinal, done.key, counters.capped, counters.peak)
            if settled.ended is not None:
                done.peaks[index] = settled.ended.peak
            settle_(ordinal, index, settled)
        # Old torch's setMemoryFraction switched the device and left it; go back where the
        # process was only if it has a context there (else CUDA 12 would open one).
        previous = state["previous"]
        if previous is not None and previous not in ordinals and _has_context(torch, previous, cuda if xpu else None):
            cuda.set_device(previous)
        else:
            cuda.set_device(ordinals[0])

    done.on_resume(resume)
    done.on_undo(undo)
    if cuda.is_initialized() or not _defer(cuda, apply):
        apply()


def _confine_cupy(cupy: ModuleType, lease: GpuLease, ordinals: list[int], done: Confinement) -> None:
    """Cap CuPy's default pool on each leased GPU, finishing on the lease's first ordinal.

    ``set_limit`` and ``free_all_blocks`` act on the current device's pool, so each leased
    GPU is made current with ``Device(k).use()`` (its context is the lease's). Never ``with
    cupy.cuda.Device(k)``: its ``__exit__`` calls ``setDevice`` on the device it found,
    unconditionally (cupy/cuda/device.pyx), and CUDA 12's ``cudaSetDevice`` opens the primary
    context there: ~500 MiB on a GPU outside the lease (often GPU 0). CuPy cannot ask whether a
    device has a context, so the process is left on the lease's first ordinal, as torch's
    adapter leaves it.
    """
    pool = cupy.get_default_memory_pool()

    def limit(settled: Settled) -> None:
        pool.set_limit(size=settled.outside if settled.cap is None else settled.cap)

    for ordinal in ordinals:
        cupy.cuda.Device(ordinal).use()
        pool.free_all_blocks()
        share("cupy", ordinal, done.key, lease.memory, outside=pool.get_limit())
        limit(settle("cupy", ordinal, pool.total_bytes()))
    cupy.cuda.Device(ordinals[0]).use()

    def undo() -> None:
        for ordinal in ordinals:
            cupy.cuda.Device(ordinal).use()
            pool.free_all_blocks()
            limit(unshare("cupy", ordinal, done.key, pool.total_bytes()))
        cupy.cuda.Device(ordinals[0]).use()

    def resume() -> None:
        for ordinal in ordinals:
            cupy.cuda.Device(ordinal).use()
            limit(settle("cupy", ordinal, pool.total_bytes()))
        cupy.cuda.Device(ordinals[0]).use()

    done.on_undo(undo)
    done.on_resume(resume)


def _capacity(done: Confinement, index: int) -> int:
    return done.inventory.by_index(index).capacity if done.inventory is not None else 0
