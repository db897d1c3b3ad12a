"""Applying a lease to the test process until it ends: the runtime's pin, the environment, the
simulated GPUs' caps and the frameworks' confinement.

Only the leased GPUs are ever touched. A framework is used only if the test process
imports it: if it is loaded when the lease starts it is confined at once, and if the test
imports it while holding the lease it is confined right after its import
(:mod:`pytest_gpu.base.importhook`); the plugin never imports torch or CuPy itself. Which
frameworks are confined, and how, is the ``pytest_gpu_confine`` hook's: torch and CuPy
are built in (:mod:`pytest_gpu.gpu.adapters`), a conftest adds its own.

Before anything is narrowed, the process's CUDA device list is pinned to the run's
(:mod:`pytest_gpu.gpu.runtime`), so ordinals never depend on which test started CUDA.
What a confinement changed, and each lease's cap among the process's others, are
:mod:`pytest_gpu.gpu.isolation`'s.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from .. import sim
from ..sim import cuda
from ..vendors.devices import Inventory
from . import adapters, runtime
from .isolation import Confinement, GpuLease, Settled, activate, settle, share, unshare


def confine(lease: GpuLease, inventory: Inventory, frameworks: Callable[..., object] | None = None) -> Confinement:
    """Apply ``lease`` to this process until :meth:`Confinement.undo`.

    ``frameworks`` confines the frameworks the test uses: the ``pytest_gpu_confine`` hook
    (``config.hook.pytest_gpu_confine``), whose built-in implementations are the torch and
    CuPy adapters of :mod:`pytest_gpu.gpu.adapters`; ``None``: those two alone.

    Raises :class:`pytest_gpu.gpu.runtime.LeaseUnreachable` when this process's CUDA
    cannot address the lease; whatever was applied before an error is undone.
    """
    done = Confinement()
    activate(done.key)
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
    def used() -> dict[int, int]:
        return sim.ledger().allocations([os.getpid()])

    def cap(settled: Settled, unit: int) -> None:
        cuda.set_memory_cap(unit, settled.cap)

    previous = cuda.current_device()
    now = used()
    for index in lease.indices:
        share("sim", index, done.key, lease.memory)
        cap(settle("sim", index, now.get(index, 0)), index)

        def lift(index: int = index) -> None:  # the default binds this iteration's index
            cap(unshare("sim", index, done.key, used().get(index, 0)), index)

        done.undo_steps.append(lift)

    def resume() -> None:
        now = used()
        for index in lease.indices:
            cap(settle("sim", index, now.get(index, 0)), index)

    done.on_resume(resume)
    cuda.set_device(ordinals[0])
    done.undo_steps.append(lambda: _restore_sim_device(previous))


def _restore_sim_device(previous: int) -> None:
    # Going back to a device where this process has no context would open one there,
    # outside any lease (CUDA 12's cudaSetDevice creates the primary context).
    if cuda.has_context(cuda.unit_of(previous)):
        cuda.set_device(previous)
