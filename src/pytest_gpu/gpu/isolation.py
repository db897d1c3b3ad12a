"""Applying a lease inside the test process: environment, and the frameworks' confinement.

Only the leased GPUs are ever touched. A framework is used only if the test process
imports it: if it is loaded when the lease starts it is confined at once, and if the test
imports it while holding the lease it is confined right after its import
(:mod:`pytest_gpu.importhook`); the plugin never imports torch or CuPy itself. Which
frameworks are confined, and how, is the ``pytest_gpu_confine`` hook's: torch and CuPy
are built in (:mod:`pytest_gpu.gpu.adapters`), a conftest adds its own.

Before anything is narrowed, the process's CUDA device list is pinned to the run's
(:mod:`pytest_gpu.gpu.runtime`), so ordinals never depend on which test started CUDA.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType

from .. import importhook, sim
from . import runtime, vendors
from .devices import Inventory

VISIBLE_VARS = vendors.NVIDIA_VARS
VISIBILITY = vendors.VISIBILITY  # every variable a lease of any vendor sets to say which GPUs a process sees
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
    vendor: str = "nvidia"  # whose GPUs (the inventory's): which variables ``env`` sets

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
    if inventory.simulated or inventory.vendor == "xpu":  # ZE_AFFINITY_MASK takes indices only
        visible = ",".join(str(d.index) for d in devices)
    else:
        visible = ",".join(d.uuid for d in devices)  # UUIDs: immune to any ordering mismatch
    env = visibility_env(inventory.vendor, visible.split(","))
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
    kind = "xpu" if inventory.vendor == "xpu" else "cuda"  # as torch names the devices
    named = [f"{kind}:{o}" for o in ordinals] if ordinals is not None else []  # none: a MIG lease for subprocesses
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
        vendor=inventory.vendor,
    )


def visibility_env(vendor: str, visible: Sequence[str]) -> dict[str, str]:
    """The variables that make a subprocess see exactly the GPUs ``visible`` (UUIDs, or a simulated
    machine's indices), in this order: ``CUDA_VISIBLE_DEVICES`` and ``HIP_VISIBLE_DEVICES`` for
    NVIDIA's; ``ROCR_VISIBLE_DEVICES`` and the variables that count into it for AMD's
    (:meth:`pytest_gpu.gpu.vendors.Vendor.lease_env`)."""
    return vendors.of(vendor).lease_env(visible)


@dataclass
class Confinement:
    """What :func:`confine` changed, so :meth:`undo` can put it back.

    The ``pytest_gpu_confine`` hook receives it: an implementation confines its framework
    through :meth:`when_imported` and :meth:`on_undo`. ``ordinals`` are the leased GPUs as
    this process's CUDA numbers them (``lease.indices`` order); ``inventory`` the run's GPUs.
    """

    saved_env: dict[str, str | None] = field(default_factory=dict)
    undo_steps: list[Callable[[], None]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    ordinals: list[int] = field(default_factory=list)
    inventory: Inventory | None = None

    def on_undo(self, step: Callable[[], None]) -> None:
        """Run ``step`` when the lease ends (steps run last-added first)."""
        self.undo_steps.append(step)

    def when_imported(self, name: str, apply: Callable[[ModuleType], None]) -> None:
        """``apply(module)`` now if module ``name`` is imported, else right after the test
        imports it while it holds the lease (never importing it here: the plugin must not).

        An error of a late ``apply`` never breaks the test's import: it becomes a note of the
        test's verdict and a warning. An error now propagates (the lease is not applied).
        """
        module = sys.modules.get(name)
        if module is not None:
            apply(module)
            return

        def hook(module: ModuleType) -> None:
            # runs inside the test's import statement; an undo step added now runs first at undo
            try:
                apply(module)
            except Exception as exc:
                note = f"could not confine {module.__name__} after its import: {exc!r}"
                self.notes.append(note)
                warnings.warn(f"pytest-gpu: {note}", RuntimeWarning, stacklevel=2)

        importhook.on_import(name, hook)
        self.on_undo(lambda: importhook.cancel(name, hook))

    def undo(self) -> None:
        """Put back what the confinement changed, last change first; errors become notes."""
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


def confine(lease: GpuLease, inventory: Inventory, frameworks: Callable[..., object] | None = None) -> Confinement:
    """Apply ``lease`` to this process until :meth:`Confinement.undo`.

    ``frameworks`` confines the frameworks the test uses: the ``pytest_gpu_confine`` hook
    (``config.hook.pytest_gpu_confine``), whose built-in implementations are the torch and
    CuPy adapters of :mod:`pytest_gpu.gpu.adapters`; ``None``: those two alone.

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
            done.inventory, done.ordinals = inventory, ordinals
            if runtime.simulated(inventory):
                _confine_sim(lease, ordinals, done)
            if frameworks is None:
                from . import adapters

                adapters.pytest_gpu_confine(lease, done)
            else:
                frameworks(lease=lease, confinement=done)
        for name, value in lease.env.items():
            done.saved_env[name] = os.environ.get(name)
            os.environ[name] = value
    except BaseException:
        done.undo()
        raise
    return done


def _confine_sim(lease: GpuLease, ordinals: list[int], done: Confinement) -> None:
    from ..sim import cuda

    previous = cuda.current_device()
    for index in lease.indices:
        total, _ = hold("sim", index, lease.memory)
        cuda.set_memory_cap(index, total)

        def lift(index: int = index) -> None:  # the default binds this iteration's index
            cuda.set_memory_cap(index, drop("sim", index, lease.memory) or None)

        done.undo_steps.append(lift)
    cuda.set_device(ordinals[0])
    done.undo_steps.append(lambda: _restore_sim_device(previous))


def _restore_sim_device(previous: int) -> None:
    from ..sim import cuda

    # Going back to a device where this process has no context would open one there,
    # outside any lease (CUDA 12's cudaSetDevice creates the primary context).
    if cuda.has_context(cuda.unit_of(previous)):
        cuda.set_device(previous)


# The budgets of the leases this process holds now, per (framework, device): a
# gpu_request section on the GPU of the test's main lease adds to the cap, and ending it
# gives the main lease its own cap back (not none, not the section's).
_held: dict[tuple[str, int], list[int]] = {}


def hold(kind: str, device: int, memory: int) -> tuple[int, bool]:
    """Add a lease's budget on ``device``; (the process's total there now, whether it is the first)."""
    stack = _held.setdefault((kind, device), [])
    stack.append(memory)
    return sum(stack), len(stack) == 1


def drop(kind: str, device: int, memory: int) -> int:
    """Remove a lease's budget on ``device``; the total of the leases still held there (0: none)."""
    stack = _held.get((kind, device), [])
    if memory in stack:
        stack.remove(memory)
    if not stack:
        _held.pop((kind, device), None)
    return sum(stack)
