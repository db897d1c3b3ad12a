"""This process's CUDA: its device list is pinned before a test narrows ``CUDA_VISIBLE_DEVICES``.

CUDA fixes a process's device list when its driver initialises (``cuInit``, which the
runtime, torch's ``is_available`` and any first CUDA call imply), from the
``CUDA_VISIBLE_DEVICES`` of that moment. During a test that variable names only the
lease (for subprocesses). If CUDA first started *inside* a test, the worker would keep
that test's narrow list for life and every later lease would land on a wrong or
invalid ordinal. So before the first lease is applied in a process, :func:`pin`
initialises the driver with the run's own ``CUDA_VISIBLE_DEVICES``: ``cuInit(0)`` opens
no context and allocates no GPU memory, and nothing is imported. From then on the
process numbers devices as :func:`pytest_gpu.gpu.devices.process_view` says, and a
lease's GPU ``i`` is ``cuda:<view.index(i)>`` in the worker, ``cuda:0`` in subprocesses.

On simulated or fake GPUs the driver is :mod:`pytest_gpu.sim.cuda`, whose view is read
back exactly. On real GPUs ``libcuda.so.1`` is called through ctypes; that path was
written against the CUDA driver API's documented semantics and has not run on a GPU
machine here.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

from .devices import Inventory, process_view


class LeaseUnreachable(RuntimeError):
    """This process's CUDA cannot address a leased GPU (its device list was fixed without it)."""


@dataclass
class _State:
    pinned: bool = False
    visible: str | None = None  # CUDA_VISIBLE_DEVICES when pinned
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
        _state.note = _cu_init()
        _state.pinned = True
    return view(inventory)


def view(inventory: Inventory) -> list[int]:
    """Physical indices in this process's CUDA ordinal order."""
    if simulated(inventory):
        from ..sim import cuda

        return cuda.init()
    if _state.pinned:
        return process_view(inventory, _state.visible, use_run=False)
    return process_view(inventory)


def ordinals(inventory: Inventory, indices: tuple[int, ...] | list[int]) -> list[int]:
    """This process's CUDA ordinals of physical GPUs ``indices``; :class:`LeaseUnreachable` if hidden."""
    seen = view(inventory)
    hidden = [i for i in indices if i not in seen]
    if hidden:
        raise LeaseUnreachable(
            f"this process's CUDA cannot address GPU {hidden}: its device list was fixed as {seen} "
            "(CUDA_VISIBLE_DEVICES was changed before CUDA started here, outside pytest-gpu)"
        )
    return [seen.index(i) for i in indices]


def _cu_init() -> str:
    """``cuInit(0)`` through libcuda.so.1; a sentence when the driver is missing or refuses."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return f"libcuda.so.1 not loadable ({exc})"
    result = lib.cuInit(0)
    return "" if result == 0 else f"cuInit failed with CUresult {result}"


def forget() -> None:
    """Forget the pin (tests only: a new process in spirit)."""
    global _state
    _state = _State()
