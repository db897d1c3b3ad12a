"""A lease in the test process: the ``gpu`` fixture's value (:class:`GpuLease`), what confining
the process to it changed (:class:`Confinement`, the ``pytest_gpu_confine`` hook's argument),
and each lease's cap among the process's others.

Applying a lease is :func:`pytest_gpu.gpu.confine.confine`'s; the frameworks' own confinement
(torch's and CuPy's built in: :mod:`pytest_gpu.gpu.adapters`) is written against this module.

A lease's cap on a GPU is its own budget on top of what the rest of the process holds there
(:func:`share`, :func:`settle`): a test's verdict never depends on a fixture's lease in the
same process, nor on what an earlier test left behind.
"""

from __future__ import annotations

import itertools
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from types import ModuleType

from .. import sim
from ..base import importhook
from ..vendors import registry as vendors
from ..vendors.devices import Inventory
from . import runtime

VISIBILITY = vendors.VISIBILITY  # every variable a lease of any vendor sets to say which GPUs a process sees
# JAX preallocates 75 % of every visible GPU when its backend starts, TensorFlow all of it:
# on demand, capped at the lease (JAX), or growing (TF) instead.
XLA_PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"
XLA_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"
TF_GROWTH = "TF_FORCE_GPU_ALLOW_GROWTH"
_keys = itertools.count()


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
    vendor: str = vendors.DEFAULT.name  # whose GPUs (the inventory's): which variables ``env`` sets

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
    vendor = vendors.of(inventory.vendor)
    names = vendor.lease_names(devices)  # UUIDs, immune to any ordering mismatch, where the runtime takes them
    visible = ",".join(names)
    env = vendor.lease_env(names)
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
    named = (
        [f"{vendor.device_kind}:{o}" for o in ordinals] if ordinals is not None else []
    )  # none: MIG, for subprocesses
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
    """The variables that make a subprocess see exactly the GPUs ``visible`` (a lease's names:
    UUIDs, or indices), in this order, as ``vendor``'s lease sets them
    (:meth:`pytest_gpu.vendors.vendor.Vendor.lease_env`)."""
    return vendors.of(vendor).lease_env(visible)


@dataclass
class Confinement:
    """What :func:`~pytest_gpu.gpu.confine.confine` changed, so :meth:`undo` can put it back.

    The ``pytest_gpu_confine`` hook receives it: an implementation confines its framework
    through :meth:`when_imported` and :meth:`on_undo`. ``ordinals`` are the leased GPUs as
    this process's CUDA numbers them (``lease.indices`` order); ``inventory`` the run's GPUs.
    """

    saved_env: dict[str, str | None] = field(default_factory=dict)
    undo_steps: list[Callable[[], None]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    ordinals: list[int] = field(default_factory=list)
    inventory: Inventory | None = None
    # the lease as this process's books of caps know it (see share/settle), unique in the process
    key: str = field(default_factory=lambda: f"lease-{next(_keys)}")
    resume_steps: list[Callable[[], None]] = field(default_factory=list)
    # GPU index -> the lease's own peak there, where a framework measured one (torch): what the
    # process held above the rest of it while the lease was active, as the cap counts it
    peaks: dict[int, int] = field(default_factory=dict)

    def on_undo(self, step: Callable[[], None]) -> None:
        """Run ``step`` when the lease ends (steps run last-added first)."""
        self.undo_steps.append(step)

    def on_resume(self, step: Callable[[], None]) -> None:
        """Run ``step`` when the process works for this lease again (:meth:`resume`): a
        framework sets this lease's cap again on its GPUs."""
        self.resume_steps.append(step)

    def resume(self) -> None:
        """The process works for this lease again (a fixture's setup, during which the fixture's
        own lease was the active one, returned to the test): its caps apply again, on top of
        what the rest of the process holds now. Errors become notes."""
        activate(self.key)
        for step in self.resume_steps:
            try:
                step()
            except Exception as exc:
                self.notes.append(f"could not set the lease's cap again: {exc!r}")

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
        deactivate(self.key)  # each framework's cap goes to the lease active before this one
        for step in reversed(self.undo_steps):
            try:
                step()
            except Exception as exc:
                self.notes.append(f"could not undo a confinement step: {exc!r}")
        self.undo_steps.clear()
        self.resume_steps.clear()
        for name, value in self.saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self.saved_env.clear()


# -- each lease's cap: its own budget on top of what the rest of the process holds ------------
#
# A process can hold several leases on one GPU: a test's, its gpu_request sections', fixtures'
# of any scope. Its frameworks have one cap per device, which belongs to the lease the process
# works for now, the *active* one: the lease begun (or resumed) last of those still held. The cap
# is that lease's budget on top of what the rest of the process held when it became active (a
# fixture's tensors, what an earlier test left behind), so a test's verdict and its cap never
# depend on what else its process holds: under -n 2 or without xdist, beside a fixture's lease or
# not, a test may allocate its own budget. Each framework counts the process's memory its own way
# (the simulated ledger, torch's allocator, CuPy's pool), so each keeps its own book per device.

_order: list[str] = []  # the process's confined leases (Confinement.key), in activation order


def activate(key: str) -> None:
    """Lease ``key`` is the one the process works for now (it began, or a fixture's setup,
    which worked for its own lease, returned to the test)."""
    if key in _order:
        _order.remove(key)
    _order.append(key)


def deactivate(key: str) -> None:
    """Lease ``key`` ended: the one active before it is active again."""
    if key in _order:
        _order.remove(key)


@dataclass
class Share:
    """One lease's part of a device's cap, for one framework: ``own``, what it added to the
    process's memory there (as the framework counts) while it was active; ``peak``, the most it
    held at once while active, where the framework keeps a peak (torch)."""

    key: str
    memory: int
    own: int = 0
    peak: int = 0


@dataclass(frozen=True)
class Settled:
    """A device's cap after a change: ``cap`` for the active lease (``None``: no lease left
    there, the framework's own setting ``outside`` goes back); ``opened``: a lease became
    active there (a framework's peak counter is reset, so the next reading is that lease's);
    ``ended``: the share that :func:`unshare` ended."""

    cap: int | None
    opened: bool
    outside: int = 0
    ended: Share | None = None


@dataclass
class _Book:
    """One framework's book of one device."""

    shares: dict[str, Share] = field(default_factory=dict)
    current: str | None = None  # whose window is open
    others: int = 0  # what the rest of the process held when that window opened
    outside: int = 0  # the framework's own setting before any lease (CuPy's pool limit)


_books: dict[tuple[str, int], _Book] = {}


def share(kind: str, device: int, key: str, memory: int, outside: int = 0) -> None:
    """Lease ``key`` (budget ``memory``) caps framework ``kind`` on ``device`` from now on,
    while it is active (:func:`settle` says the cap); ``outside``: the framework's own setting,
    put back once no lease is left there."""
    book = _books.get((kind, device))
    if book is None:
        book = _books[(kind, device)] = _Book(outside=outside)
    book.shares[key] = Share(key, memory)


def _close(book: _Book, used: int, peak: int | None) -> None:
    """The open window ends: what the process holds beyond the others is its lease's own."""
    share_ = book.shares.get(book.current or "")
    if share_ is not None:
        share_.own = max(used - book.others, 0)
        if peak is not None:
            share_.peak = max(share_.peak, peak - book.others)
    book.current = None


def settle(kind: str, device: int, used: int, peak: int | None = None) -> Settled:
    """The cap of framework ``kind`` on ``device`` now: ``used`` is what the process holds
    there as the framework counts it, ``peak`` the framework's peak since its last reset."""
    book = _books.get((kind, device))
    if book is None:
        return Settled(None, False)
    active = next((k for k in reversed(_order) if k in book.shares), None)
    if active is None and book.shares:  # shared outside confine(): the latest
        active = list(book.shares)[-1]
    if active == book.current and active is not None:
        current = book.shares[active]
        return Settled(book.others + current.memory, False, book.outside)
    _close(book, used, peak)
    if active is None:
        del _books[(kind, device)]
        return Settled(None, True, book.outside)
    book.current = active
    opened = book.shares[active]
    book.others = max(used - opened.own, 0)
    return Settled(book.others + opened.memory, True, book.outside)


def unshare(kind: str, device: int, key: str, used: int, peak: int | None = None) -> Settled:
    """Lease ``key`` no longer caps ``kind`` on ``device``: the cap now (:func:`settle`), and
    its share as it ended (its own memory and peak)."""
    book = _books.get((kind, device))
    if book is None or key not in book.shares:
        return settle(kind, device, used, peak)
    if book.current == key:
        _close(book, used, peak)
    ended = book.shares.pop(key)
    settled = settle(kind, device, used, None)
    return replace(settled, ended=ended)
