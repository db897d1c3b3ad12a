"""Host resources: the machine's CPUs and RAM, leased to tests like GPU memory.

A request's ``cpus=`` and ``host_memory=`` (``gpu(...)`` keywords, the ``host`` marker,
``gpu_marker_map`` and the ``pytest_gpu_item_request`` hook) are leased from the machine's
CPUs and RAM by the machine's arbiter, atomically with the request's GPUs: no more CPUs
or RAM are promised at once than the machine has, whichever run asks.

The machine, as a run sees it (:func:`capacity`):

- CPUs: ``len(os.sched_getaffinity(0))`` (the CPUs this process may run on), else
  ``os.cpu_count()``; ``--gpu-host-cpus N`` declares another number;
- RAM: ``psutil.virtual_memory().total`` less a reserve for the system and pytest itself
  (:data:`RESERVE_FRACTION` of it, at least :data:`RESERVE_MIN`); ``--gpu-host-memory SIZE``
  declares another amount.

The arbiter takes the view of its own run (each election: the new arbiter's run); the
views of the runs attaching to it are not asked (another user's run could lie).

While a test holds ``cpus=N``, its ``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS`` are ``N``
(restored afterwards), and so are torch's intra-op threads (``torch.set_num_threads``) if
torch is already imported (it is never imported for this).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..gpu.isolation import Confinement

RESERVE_FRACTION = 0.10
RESERVE_MIN = 1 << 30
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass(frozen=True)
class HostCapacity:
    """What the machine has to lease: CPUs and bytes of RAM."""

    cpus: int
    memory: int

    def to_wire(self) -> tuple[int, int]:
        return (self.cpus, self.memory)


def machine_cpus() -> int:
    """CPUs this process may run on (its affinity mask), else the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def reserve(total: int) -> int:
    """RAM kept back from leases: 10 % of it, at least 1 GiB (never all of it)."""
    return min(max(int(total * RESERVE_FRACTION), RESERVE_MIN), total)


def total_memory() -> int:
    """The machine's RAM."""
    import psutil

    return int(psutil.virtual_memory().total)


def machine_memory() -> int:
    """RAM that leases may promise: the machine's total less :func:`reserve`."""
    total = total_memory()
    return total - reserve(total)


def capacity(cpus: int | None = None, memory: int | None = None) -> HostCapacity:
    """The machine's host capacity as this run declares it (``None``: measured)."""
    return HostCapacity(machine_cpus() if cpus is None else cpus, machine_memory() if memory is None else memory)


def confine_threads(cpus: int, done: Confinement) -> None:
    """Threads of this process follow ``cpus`` until ``done`` is undone: the OpenMP/MKL
    variables (for what the test starts or initialises now) and torch's intra-op threads."""
    for name in THREAD_VARS:
        done.saved_env.setdefault(name, os.environ.get(name))
        os.environ[name] = str(cpus)
    torch = sys.modules.get("torch")
    setter = getattr(torch, "set_num_threads", None)
    getter = getattr(torch, "get_num_threads", None)
    if setter is None or getter is None:
        return
    try:
        previous = int(getter())
        setter(cpus)
    except Exception as exc:  # a broken or partial torch: say so, never fail the test for it
        done.notes.append(f"could not set torch's threads to {cpus}: {exc!r}")
        return
    done.undo_steps.append(lambda: setter(previous))
