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

import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType

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


def in_process_ordinal(index: int, inventory: Inventory) -> int:
    """CUDA ordinal of physical GPU ``index`` in this process once its CUDA is pinned."""
    return runtime.ordinals(inventory, [index])[0]


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
    smallest = min(d.capacity for d in devices)
    env[XLA_PREALLOCATE] = "false"
    env[XLA_FRACTION] = f"{min(memory / smallest, 1.0):.4f}" if smallest else "1.0"
    env[TF_GROWTH] = "true"
    if inventory.simulated:
        env[sim.TAG_ENV] = tag
    ordinals = runtime.ordinals(inventory, [d.index for d in devices])
    return GpuLease(
        key=key,
        indices=tuple(indices),
        uuids=tuple(d.uuid for d in devices),
        memory=memory,
        exclusive=exclusive,
        device=f"cuda:{ordinals[0]}",
        visible_devices=visible,
        env=env,
        waited=waited,
        simulated=inventory.simulated,
        devices=tuple(f"cuda:{o}" for o in ordinals),
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
    cannot address the lease.
    """
    done = Confinement()
    runtime.pin(inventory)  # while CUDA_VISIBLE_DEVICES is still the run's
    ordinals = runtime.ordinals(inventory, lease.indices)
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
    return done


Adapter = Callable[[ModuleType, GpuLease, list[int], Inventory, Confinement], None]


def _late(
    adapter: Adapter, lease: GpuLease, ordinals: list[int], inventory: Inventory, done: Confinement
) -> Callable[[ModuleType], None]:
    def hook(module: ModuleType) -> None:
        # runs inside the test's import statement; an undo step added now runs first at undo
        try:
            adapter(module, lease, ordinals, inventory, done)
        except Exception as exc:  # never break the test's import
            done.notes.append(f"could not confine {module.__name__} after its import: {exc!r}")

    return hook


def _confine_sim(lease: GpuLease, ordinals: list[int], done: Confinement) -> None:
    from ..sim import cuda

    previous = cuda.current_device()
    for index in lease.indices:
        cuda.set_memory_cap(index, lease.memory)
        done.undo_steps.append(lambda index=index: cuda.set_memory_cap(index, None))
    cuda.set_device(ordinals[0])
    done.undo_steps.append(lambda: _restore_sim_device(previous))


def _restore_sim_device(previous: int) -> None:
    from ..sim import cuda

    # Going back to a device where this process has no context would open one there,
    # outside any lease (CUDA 12's cudaSetDevice creates the primary context).
    if cuda.unit_of(previous) in cuda.contexts():
        cuda.set_device(previous)


def _confine_torch(
    torch: ModuleType, lease: GpuLease, ordinals: list[int], inventory: Inventory, done: Confinement
) -> None:
    cuda = getattr(torch, "cuda", None)
    if cuda is None or not cuda.is_available():
        return
    previous = cuda.current_device() if cuda.is_initialized() else None
    # Blocks an earlier test left in the cache would count as this test's peak
    # (reset_peak_memory_stats sets the peak to the current reserve) and are memory the
    # broker has given to someone else.
    cuda.empty_cache()
    for ordinal, index in zip(ordinals, lease.indices, strict=True):
        # torch caps a fraction of the total *it* sees (cudaMemGetInfo), a little less than NVML's
        total = int(cuda.get_device_properties(ordinal).total_memory) or inventory.by_index(index).capacity
        cuda.set_per_process_memory_fraction(min(1.0, lease.memory / total), ordinal)
        cuda.reset_peak_memory_stats(ordinal)
    cuda.set_device(ordinals[0])

    def undo() -> None:
        cuda.empty_cache()  # give the lease's memory back for real, not to this worker's cache
        for ordinal in ordinals:
            cuda.set_per_process_memory_fraction(1.0, ordinal)  # calls SetDevice(ordinal)
        # setMemoryFraction left the current device on the last ordinal; go back where the
        # process was only if it already had a context there (else CUDA would open one)
        if previous is not None and previous not in ordinals and cuda.memory_reserved(previous) > 0:
            cuda.set_device(previous)
        else:
            cuda.set_device(ordinals[0])

    done.undo_steps.append(undo)


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
            pool.set_limit(size=lease.memory)
    cupy.cuda.Device(ordinals[0]).use()

    def undo() -> None:
        for ordinal in ordinals:
            with cupy.cuda.Device(ordinal):
                pool.free_all_blocks()
                pool.set_limit(size=previous[ordinal])

    done.undo_steps.append(undo)
