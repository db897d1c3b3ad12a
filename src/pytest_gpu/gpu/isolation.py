"""Applying a lease inside the test process: environment, and framework adapters.

Only the leased GPUs are ever touched. A framework is used only if the test process
imports it: if it is loaded when the lease starts it is confined at once, and if the test
imports it while holding the lease it is confined right after its import
(:mod:`pytest_gpu.importhook`); the plugin never imports torch or CuPy itself.

Before anything is narrowed, the process's CUDA device list is pinned to the run's
(:mod:`pytest_gpu.gpu.runtime`), so ordinals never depend on which test started CUDA.

The real-CUDA adapters follow torch's and CuPy's own sources (``c10/cuda``'s
``setMemoryFraction`` calls ``SetDevice`` and leaves it; the caching allocator keeps
freed blocks until ``empty_cache``; ``reset_peak_memory_stats`` sets the peak to the
current reserve; CuPy's ``set_limit`` and ``free_all_blocks`` act on the current
device's pool). They are exercised in CI against :mod:`pytest_gpu.sim.torch_cuda` and a
CuPy stand-in, not on a real GPU.
"""

from __future__ import annotations

import gc
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from .. import importhook, sim
from . import runtime
from .devices import Inventory

VISIBLE_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")
# JAX preallocates 75 % of every visible GPU when its backend starts, TensorFlow all of it:
# on demand, capped at the lease (JAX), or growing (TF) instead.
XLA_PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"
XLA_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"
TF_GROWTH = "TF_FORCE_GPU_ALLOW_GROWTH"


@dataclass(frozen=True)
class GpuLease:
    """The GPUs a test holds (the ``gpu`` fixture's value).

    ``indices`` are physical (NVML order); ``device`` is the first leased GPU as this
    process's CUDA addresses it (``cuda:K``: the worker's CUDA sees every GPU of the run, so
    K is the GPU's place in the run's list, not necessarily 0), ``devices`` all of them, in
    the order of ``indices``; ``env`` is what a subprocess needs to see exactly the lease
    (there the lease is ``cuda:0``, ``cuda:1``, ...).
    """

    key: str
    indices: tuple[int, ...]
    uuids: tuple[str, ...]
    memory: int
    exclusive: bool
    device: str
    visible_devices: str
    env: dict[str, str]
    waited: float
    simulated: bool = False
    devices: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return f"GpuLease(indices={self.indices}, memory={self.memory}, device={self.device!r})"


def make_lease(
    key: str,
    indices: Sequence[int],
    memory: int,
    exclusive: bool,
    waited: float,
    inventory: Inventory,
    tag: str,
) -> GpuLease:
    devices = [inventory.by_index(i) for i in indices]
    if inventory.simulated:
        visible = ",".join(str(d.index) for d in devices)
    else:
        visible = ",".join(d.uuid for d in devices)  # UUIDs: immune to any ordering mismatch
    env = {name: visible for name in VISIBLE_VARS}
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    # one fraction for every GPU: of the largest, so no GPU is given more than the lease
    largest = max(d.capacity for d in devices)
    env[XLA_PREALLOCATE] = "false"
    env[XLA_FRACTION] = f"{min(memory / largest, 1.0):.4f}" if largest else "1.0"
    env[TF_GROWTH] = "true"
    if inventory.simulated:
        env[sim.TAG_ENV] = tag
    runtime.pin(inventory)  # the ordinals named here are those of the pinned CUDA, as confine's
    ordinals = runtime.in_process(inventory, [d.index for d in devices])
    named = [f"cuda:{o}" for o in ordinals] if ordinals is not None else []  # none: a MIG lease for subprocesses
    return GpuLease(
        key=key,
        indices=tuple(indices),
        uuids=tuple(d.uuid for d in devices),
        memory=memory,
        exclusive=exclusive,
        device=named[0] if named else "",
        visible_devices=visible,
        env=env,
        waited=waited,
        simulated=inventory.simulated,
        devices=tuple(named),
    )


@dataclass
class Confinement:
    """What :func:`confine` changed, so :meth:`undo` can put it back."""

    saved_env: dict[str, str | None] = field(default_factory=dict)
    undo_steps: list[Callable[[], None]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def undo(self) -> None:
        for step in reversed(self.undo_steps):
            try:
                step()
            except Exception as exc:
                self.notes.append(f"could not undo a confinement step: {exc!r}")
        self.undo_steps.clear()
        for name, value in self.saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self.saved_env.clear()


def confine(lease: GpuLease, inventory: Inventory) -> Confinement:
    """Apply ``lease`` to this process until :meth:`Confinement.undo`.

    Raises :class:`pytest_gpu.gpu.runtime.LeaseUnreachable` when this process's CUDA
    cannot address the lease; whatever was applied before an error is undone.
    """
    done = Confinement()
    try:
        runtime.pin(inventory)  # while CUDA_VISIBLE_DEVICES is still the run's
        ordinals = runtime.in_process(inventory, lease.indices)
        if ordinals is None:
            done.notes.append(
                f"GPU {','.join(map(str, lease.indices))} (MIG) cannot be used by this process's CUDA, which "
                "uses one MIG instance per process: use the lease from a subprocess (gpu.env)"
            )
        else:
            if runtime.simulated(inventory):
                _confine_sim(lease, ordinals, done)
            for name, adapter in (("torch", _confine_torch), ("cupy", _confine_cupy)):
                module = sys.modules.get(name)
                if module is not None:
                    adapter(module, lease, ordinals, inventory, done)
                else:  # the test may import it while it holds the lease: confine it then
                    hook = _late(adapter, lease, ordinals, inventory, done)
                    importhook.on_import(name, hook)
                    done.undo_steps.append(lambda name=name, hook=hook: importhook.cancel(name, hook))
        for name, value in lease.env.items():
            done.saved_env[name] = os.environ.get(name)
            os.environ[name] = value
    except BaseException:
        done.undo()
        raise
    return done


Adapter = Callable[[ModuleType, GpuLease, list[int], Inventory, Confinement], None]

# The budgets of the leases this process holds now, per (framework, device): a
# gpu_request section on the GPU of the test's main lease adds to the cap, and ending it
# gives the main lease its own cap back (not none, not the section's).
_held: dict[tuple[str, int], list[int]] = {}


def _hold(kind: str, device: int, memory: int) -> tuple[int, bool]:
    """Add a lease's budget on ``device``; (the process's total there now, whether it is the first)."""
    stack = _held.setdefault((kind, device), [])
    stack.append(memory)
    return sum(stack), len(stack) == 1


def _drop(kind: str, device: int, memory: int) -> int:
    """Remove a lease's budget on ``device``; the total of the leases still held there (0: none)."""
    stack = _held.get((kind, device), [])
    if memory in stack:
        stack.remove(memory)
    if not stack:
        _held.pop((kind, device), None)
    return sum(stack)


def _late(
    adapter: Adapter, lease: GpuLease, ordinals: list[int], inventory: Inventory, done: Confinement
) -> Callable[[ModuleType], None]:
    def hook(module: ModuleType) -> None:
        # runs inside the test's import statement; an undo step added now runs first at undo
        try:
            adapter(module, lease, ordinals, inventory, done)
        except Exception as exc:  # never break the test's import; said in the summary and here
            note = f"could not confine {module.__name__} after its import: {exc!r}"
            done.notes.append(note)
            warnings.warn(f"pytest-gpu: {note}", RuntimeWarning, stacklevel=2)

    return hook


def _confine_sim(lease: GpuLease, ordinals: list[int], done: Confinement) -> None:
    from ..sim import cuda

    previous = cuda.current_device()
    for index in lease.indices:
        total, _ = _hold("sim", index, lease.memory)
        cuda.set_memory_cap(index, total)
        done.undo_steps.append(
            lambda index=index: cuda.set_memory_cap(index, _drop("sim", index, lease.memory) or None)
        )
    cuda.set_device(ordinals[0])
    done.undo_steps.append(lambda: _restore_sim_device(previous))


def _restore_sim_device(previous: int) -> None:
    from ..sim import cuda

    # Going back to a device where this process has no context would open one there,
    # outside any lease (CUDA 12's cudaSetDevice creates the primary context).
    if cuda.has_context(cuda.unit_of(previous)):
        cuda.set_device(previous)


def _has_context(torch: ModuleType, ordinal: int) -> bool:
    probe = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    if probe is not None:
        return bool(probe(ordinal))
    return bool(torch.cuda.memory_reserved(ordinal) > 0)


def _confine_torch(
    torch: ModuleType, lease: GpuLease, ordinals: list[int], inventory: Inventory, done: Confinement
) -> None:
    cuda = getattr(torch, "cuda", None)
    if cuda is None or not cuda.is_available():
        return
    state: dict[str, Any] = {"active": True, "applied": False, "previous": None}

    def total_of(ordinal: int, index: int) -> int:
        # torch caps a fraction of the total *it* sees (cudaMemGetInfo), a little less than NVML's
        return int(cuda.get_device_properties(ordinal).total_memory) or inventory.by_index(index).capacity

    def apply() -> None:
        if not state["active"] or state["applied"]:
            return  # the lease ended before torch started CUDA
        state["applied"] = True
        state["previous"] = cuda.current_device()
        # Blocks an earlier test left in the cache would count as this test's peak
        # (reset_peak_memory_stats sets the peak to the current reserve), and are memory
        # the broker has given to someone else.
        cuda.empty_cache()
        for ordinal, index in zip(ordinals, lease.indices, strict=True):
            budget, first = _hold("torch", ordinal, lease.memory)
            cuda.set_per_process_memory_fraction(min(1.0, budget / total_of(ordinal, index)), ordinal)
            if first:  # a section on the main lease's GPU must not erase the main lease's peak
                cuda.reset_peak_memory_stats(ordinal)
        cuda.set_device(ordinals[0])

    def undo() -> None:
        state["active"] = False
        if not state["applied"]:
            return
        gc.collect()  # tensors only a reference cycle still holds
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()  # cuBLAS keeps workspaces in torch's allocator: not the test's leak
        cuda.empty_cache()  # give the lease's memory back for real, not to this worker's cache
        for ordinal, index in zip(ordinals, lease.indices, strict=True):
            left = _drop("torch", ordinal, lease.memory)
            cuda.set_per_process_memory_fraction(min(1.0, left / total_of(ordinal, index)) if left else 1.0, ordinal)
        # Old torch's setMemoryFraction switched the device and left it; go back where the
        # process was only if it has a context there (else CUDA 12 would open one).
        previous = state["previous"]
        if previous is not None and previous not in ordinals and _has_context(torch, previous):
            cuda.set_device(previous)
        else:
            cuda.set_device(ordinals[0])

    done.undo_steps.append(undo)
    lazy_call = getattr(cuda, "_lazy_call", None)
    if cuda.is_initialized() or lazy_call is None:
        apply()
    else:  # torch runs it when it starts CUDA: a test that never does keeps torch's CUDA unstarted
        lazy_call(apply)


def _confine_cupy(
    cupy: ModuleType, lease: GpuLease, ordinals: list[int], inventory: Inventory, done: Confinement
) -> None:
    pool = cupy.get_default_memory_pool()
    previous: dict[int, int] = {}
    # set_limit and free_all_blocks act on the current device's pool only: visit each GPU
    for ordinal in ordinals:
        with cupy.cuda.Device(ordinal):
            pool.free_all_blocks()
            previous[ordinal] = pool.get_limit()
            budget, _ = _hold("cupy", ordinal, lease.memory)
            pool.set_limit(size=budget)
    cupy.cuda.Device(ordinals[0]).use()

    def undo() -> None:
        for ordinal in ordinals:
            with cupy.cuda.Device(ordinal):
                pool.free_all_blocks()
                left = _drop("cupy", ordinal, lease.memory)
                pool.set_limit(size=left or previous[ordinal])

    done.undo_steps.append(undo)
