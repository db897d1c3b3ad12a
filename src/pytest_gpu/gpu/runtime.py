"""This process's GPU runtime: its device list is pinned before a test narrows the visibility variables.

A runtime fixes a process's device list when it initialises, from the visibility variables
of that moment: CUDA at ``cuInit`` (which the runtime, torch's ``is_available`` and any first
CUDA call imply) from ``CUDA_VISIBLE_DEVICES``; HIP at its first call from ROCm's variables;
Level Zero at its first ``zeInit`` from ``ZE_AFFINITY_MASK``. During a test those variables
name only the lease (for subprocesses). If the runtime first started *inside* a test, the
worker would keep that test's narrow list for life and every later lease would land on a
wrong or invalid ordinal. So before the first lease is applied in a process, :func:`pin`
initialises the runtime under the run's own variables (the vendor's
:meth:`~pytest_gpu.vendors.vendor.Vendor.pin`: ``cuInit(0)``, ``hipInit(0)``, ``zeInit(0)``,
which open no context, allocate no GPU memory and import nothing) and reads back the UUIDs of
what it enumerates, matched to the driver's. From then on a lease's GPU ``i`` is
``cuda:<view.index(i)>`` (``xpu:…`` on Intel GPUs) in the worker, ``cuda:0`` in subprocesses.
Where the runtime cannot be read back, the view is predicted from the variables the process
pinned with (the vendor's :meth:`~pytest_gpu.vendors.vendor.Vendor.view`).

On simulated or fake GPUs the runtime is :mod:`pytest_gpu.sim.cuda`, whose view is read
back exactly; on fake GPUs what the vendor's fake libraries model of its runtime is pinned too
(:meth:`~pytest_gpu.vendors.vendor.Vendor.pin_fake`: the fake Level Zero loader's device list,
which the simulated ``torch.xpu`` starts as torch's SYCL runtime does). The real runtimes'
paths (:mod:`pytest_gpu.vendors.nvidia`, ``amd``, ``intel``)
follow their documentation and sources and have not run on a GPU machine here; CI reads
back the fake ``libamdhip64.so`` (:mod:`pytest_gpu.sim.hip`) and the fake Level Zero loader
(:mod:`pytest_gpu.sim.zes`).

A process that has pinned has initialised its GPU driver: like any process that used CUDA,
it must not ``fork`` children that use the GPU (use the ``spawn`` start method).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..sim import cuda, fake
from ..vendors import registry as vendors
from ..vendors.devices import Inventory


class LeaseUnreachable(RuntimeError):
    """This process's runtime cannot address a leased GPU (its device list was fixed without it)."""


@dataclass
class _State:
    pinned: bool = False
    outer: tuple[tuple[str, str], ...] = ()  # the vendor's visibility variables when pinned
    uuids: list[str] | None = None  # what the runtime enumerates (Vendor.runtime_id), read back when pinned
    note: str = ""
    fake_pinned: bool = False  # on fake GPUs: what the vendor's fake libraries model of its runtime


_state = _State()


def simulated(inventory: Inventory) -> bool:
    """Whether this process's runtime is the simulated one (``sim:`` devices or fake GPUs)."""
    return inventory.simulated or fake.active()


def pin(inventory: Inventory) -> list[int]:
    """Initialise this process's runtime with the run's device list (once); return that list.

    Call it while the visibility variables are the run's (not a lease's).
    """
    if simulated(inventory):
        if fake.active() and not _state.fake_pinned:  # the fake Level Zero loader's device list too
            _state.fake_pinned = True
            vendors.of(inventory.vendor).pin_fake()
        return cuda.init()
    if not _state.pinned:
        vendor = vendors.of(inventory.vendor)
        _state.outer = vendor.outer(os.environ)
        _state.uuids, _state.note = vendor.pin()
        _state.pinned = True
    return view(inventory)


def view(inventory: Inventory) -> list[int]:
    """Physical indices in this process's runtime's ordinal order."""
    if simulated(inventory):
        return cuda.init()
    vendor = vendors.of(inventory.vendor)
    machine = inventory.machine or inventory.devices
    if _state.uuids is not None:  # what the runtime really enumerates, matched to the driver's devices
        by_uuid = {vendor.runtime_id(d.uuid): d.index for d in machine}
        found = [by_uuid.get(u) for u in _state.uuids]
        if all(i is not None for i in found):
            return [i for i in found if i is not None]
    # predicted from the variables it pinned with (the run's, before it pinned)
    return vendor.view(machine, _state.outer if _state.pinned else vendor.started_with(inventory))


def in_process(inventory: Inventory, indices: tuple[int, ...] | list[int]) -> list[int] | None:
    """This process's runtime's ordinals of physical GPUs ``indices``.

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
    vendor = vendors.of(inventory.vendor)
    run = vendor.started_with(inventory)
    said = f"{vendor.said(_state.outer if _state.pinned else run)}; the run's: {vendor.said(run)}"
    raise LeaseUnreachable(
        f"this process's {vendor.runtime} cannot address GPU {hidden}: it enumerates {seen} (started with {said})"
        + (f"; {_state.note}" if _state.note else "")
        + f". Start {vendor.runtime} outside tests, or leave {', '.join(vendor.visibility)} to pytest-gpu"
    )


def forget() -> None:
    """Forget the pin (tests only: a new process in spirit)."""
    global _state
    _state = _State()
