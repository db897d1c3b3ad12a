"""What pytest-gpu asks of a GPU vendor: the :class:`Vendor` interface, and what every vendor
answers the same way (pure).

Each vendor answers every question that differs by vendor as a member of its object
(:mod:`pytest_gpu.vendors.nvidia`, :mod:`~pytest_gpu.vendors.amd`, :mod:`~pytest_gpu.vendors.intel`;
:mod:`pytest_gpu.vendors.registry` lists them): its words (:class:`~pytest_gpu.vendors.kinds.Kind`),
how its GPUs are found and picked by ``--gpus``, which variables narrow what a process sees,
what a lease sets and how it names GPUs, how its runtime is pinned and read back, how its
driver is sampled and what a verdict from it can and cannot see, its collective backend,
Ray's variables, and what gives a job its GPUs. Nothing outside ``vendors/`` compares vendor
names (tests/project/test_layout.py checks it): callers ask the object.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

from ..base.wording import verb
from .devices import Device, DeviceSpecError, Inventory
from .kinds import Kind
from .sampling import Unavailable

if TYPE_CHECKING:
    from .sampling import Sampler

#: ``--gpus 0,2,3``: GPUs by the driver's index.
INDICES = re.compile(r"\d+(\s*,\s*\d+)*")


def said(pairs: Sequence[tuple[str, str]]) -> str:
    """Variables as messages quote them: ``ROCR_VISIBLE_DEVICES='0', HIP_VISIBLE_DEVICES='1'``."""
    return ", ".join(f"{k}={v!r}" for k, v in pairs)


class Vendor(ABC):
    """One vendor's GPUs, drivers and runtime, as pytest-gpu needs to know them."""

    kind: ClassVar[Kind]
    #: :attr:`Inventory.source` when its driver answered: "nvml", "amdsmi", "sysman".
    source: ClassVar[str]
    #: Its driver's library as messages name it (its sampler's name): "NVML", "amdsmi", "Level Zero Sysman".
    driver: ClassVar[str]
    #: The variables that narrow what a process sees, outermost first (a lease sets them).
    visibility: ClassVar[tuple[str, ...]]
    #: What ``--gpus <name>:…`` takes, after "expected".
    forms: ClassVar[str]
    #: What gives a job its GPUs (``--gpu-required``'s advice).
    gives_gpus: ClassVar[str]
    #: torch.distributed's backend on its GPUs, and how messages name it.
    collective: ClassVar[str]
    collective_label: ClassVar[str]
    #: A lease names its GPUs by index rather than UUID (``ZE_AFFINITY_MASK`` takes indices only).
    names_by_index: ClassVar[bool] = False
    # discovery's words: what --gpus names by index, when the driver does not report it
    _missing: ClassVar[str]  # {missing}, {known}
    _hidden_kind: ClassVar[str]  # before "{hidden} is/are hidden by"
    _visible_by: ClassVar[str]  # after "expected indices"
    _none_found: ClassVar[str]  # the driver reports no GPU at all
    _none_left: ClassVar[str]  # {said}: the run's variables leave none

    # -- its words -------------------------------------------------------------------

    @property
    def name(self) -> str:
        """As ``--gpus`` and ``PYTEST_GPU_FAKE_GPUS`` spell it."""
        return self.kind.name

    @property
    def label(self) -> str:
        return self.kind.label

    @property
    def runtime(self) -> str:
        return self.kind.runtime

    @property
    def context(self) -> str:
        return self.kind.context

    @property
    def device_kind(self) -> str:
        """How torch names its devices: ``cuda`` or ``xpu``."""
        return self.kind.device_kind

    def gpu_label(self, device: Device) -> str:
        """One of its GPUs (as its driver reports it) in ``pytest-gpu status``: ``AMD GPU 2``."""
        return self.kind.gpu_label(device.index)

    # -- its GPUs --------------------------------------------------------------------

    @abstractmethod
    def devices(self) -> tuple[tuple[Device, ...], str]:
        """Every GPU the driver reports, in the order its runtime enumerates them, and a note;
        :class:`pytest_gpu.vendors.sampling.Unavailable` (a subclass saying why) when the driver
        cannot be asked."""

    def installed(self) -> bool:
        """Whether its driver's library may be here, found without loading anything: worth asking
        beside another vendor's GPUs."""
        return False

    @abstractmethod
    def outer(self, environ: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
        """Its visibility variables set in ``environ``."""

    def started_with(self, inventory: Inventory) -> tuple[tuple[str, str], ...]:
        """The visibility variables the run of ``inventory`` started with."""
        return inventory.outer

    def said(self, outer: Sequence[tuple[str, str]]) -> str:
        """What a process started with, in messages (``outer``: its visibility variables)."""
        return said(outer)

    @abstractmethod
    def view(self, machine: tuple[Device, ...], outer: Sequence[tuple[str, str]]) -> list[int]:
        """Indices of the devices a process started under ``outer`` enumerates, in its order."""

    def usable(self, machine: tuple[Device, ...], outer: Sequence[tuple[str, str]]) -> tuple[Device, ...]:
        """The devices a run started under ``outer`` may lease, in its order."""
        by_index = {d.index: d for d in machine}
        return tuple(by_index[i] for i in self.view(machine, outer))

    def none_left(self, found: tuple[Device, ...], outer: Sequence[tuple[str, str]]) -> str:
        """Why a run started under ``outer`` has none of ``found`` (none found at all included)."""
        return self._none_found if not found else self._none_left.format(said=said(outer))

    def inventory_of(
        self,
        devices: tuple[Device, ...],
        source: str,
        note: str,
        found: tuple[Device, ...],
        outer: tuple[tuple[str, str], ...],
    ) -> Inventory:
        """The inventory of ``devices`` out of the machine ``found``, the run having started under ``outer``."""
        return Inventory(devices, source, note, found, None, self.name, outer)

    def discover(self, spec: str, value: str, environ: Mapping[str, str], source: str) -> Inventory:
        """``--gpus`` ``spec`` for its GPUs: ``value`` is ``auto`` or an index list. An unavailable
        driver: for ``auto``, an empty inventory (its :attr:`Inventory.source`: ``source``) whose
        note says why; for indices, :class:`DeviceSpecError`."""
        if value.lower() == "auto":
            return self.found(environ, source)
        if INDICES.fullmatch(value):
            return self.by_indices(spec, [int(x) for x in value.split(",")], environ)
        raise DeviceSpecError(f"--gpus {spec!r}: expected {self.forms}")

    def found(self, environ: Mapping[str, str], source: str = "auto") -> Inventory:
        """The GPUs the driver reports that the run's visibility variables leave it (``auto``)."""
        try:
            found, note = self.devices()
        except Unavailable as exc:
            return Inventory((), source, str(exc), vendor=self.name)
        return self.narrowed(found, self.source, note, environ)

    def narrowed(self, found: tuple[Device, ...], source: str, note: str, environ: Mapping[str, str]) -> Inventory:
        """What the run's visibility variables leave of the machine ``found`` (a real or a simulated
        one); why, when nothing."""
        started = self.outer(environ)
        usable = self.usable(found, started)
        if not usable:
            note = "; ".join(filter(None, [self.none_left(found, started), note]))
        return self.inventory_of(usable, source, note, found, started)

    def sim_spec(self, spec: str, rest: str, *, named: bool) -> str:
        """The simulated machine ``--gpus`` ``spec`` asks for (``rest``: its ``sim:…``; ``named``: it
        named this vendor); :class:`DeviceSpecError` where ``--gpus`` makes none of this vendor's."""
        raise DeviceSpecError(f"--gpus {spec!r}: expected {self.forms}")

    def by_indices(self, spec: str, wanted: list[int], environ: Mapping[str, str]) -> Inventory:
        """``0,2`` (``amd:0,2``, ...): these GPUs by the driver's index, each one that the run's
        visibility variables leave visible."""
        try:
            found, note = self.devices()
        except Unavailable as exc:
            raise DeviceSpecError(f"--gpus {spec!r}: {exc}") from None
        known = {d.index: d for d in self.by_index(found)}
        missing = [i for i in wanted if i not in known]
        if missing:
            raise DeviceSpecError(
                f"--gpus {spec!r}: "
                + self._missing.format(missing=missing, known=sorted(known))
                + (f" ({note})" if note else "")
            )
        if len(set(wanted)) != len(wanted):
            raise DeviceSpecError(f"--gpus {spec!r}: an index is listed twice")
        started = self.outer(environ)
        seen = self.usable(found, started)
        hidden = [i for i in wanted if known[i] not in seen]
        if hidden:
            raise DeviceSpecError(f"--gpus {spec!r}: {self.hidden(hidden, started)}")
        return self.inventory_of(tuple(known[i] for i in wanted), self.source, note, found, started)

    def by_index(self, found: tuple[Device, ...]) -> tuple[Device, ...]:
        """The devices of ``found`` that ``--gpus`` may name by index."""
        return found

    def hidden(self, hidden: list[int], outer: Sequence[tuple[str, str]]) -> str:
        """Why ``--gpus`` may not name GPUs ``hidden``: the run's variables ``outer`` hide them."""
        verb = "is" if len(hidden) == 1 else "are"
        return f"{self._hidden_kind} {hidden} {verb} hidden by {said(outer)}; expected indices {self._visible_by}"

    # -- leases ----------------------------------------------------------------------

    @abstractmethod
    def lease_env(self, names: Sequence[str]) -> dict[str, str]:
        """The variables that make a subprocess see exactly the GPUs ``names`` (:meth:`lease_names`),
        in this order, as device 0, 1, …"""

    def lease_names(self, devices: Sequence[Device]) -> list[str]:
        """How a lease of ``devices`` names them to its runtime: UUIDs, immune to any difference in
        numbering; indices on a simulated machine, or where the variable takes nothing else."""
        if self.names_by_index or any(d.simulated for d in devices):
            return [str(d.index) for d in devices]
        return [d.uuid for d in devices]

    def ray_env(self, devices: Sequence[Device]) -> dict[str, str]:
        """The variables that give a Ray head the run's GPUs ``devices``: Ray counts its GPU ids in
        ``CUDA_VISIBLE_DEVICES`` and hands each task a subset, so the run's indices (in PCI bus
        order, as the plugin's everywhere) make a task's name real (or simulated) devices."""
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(d.index) for d in devices)}

    # -- its runtime -----------------------------------------------------------------

    @abstractmethod
    def pin(self) -> tuple[list[str] | None, str]:
        """Initialise this process's runtime now, under the visibility variables of this moment
        (it reads them once, at its first initialisation), and read back what it enumerates: the
        devices' :meth:`runtime_id` in its order, or ``None``; and a sentence when something failed."""

    def pin_fake(self) -> None:
        """On fake GPUs (whose device list is the simulated runtime's): pin what this vendor's fake
        libraries model of its runtime, as :meth:`pin` would on its GPUs. Nothing by default."""
        return None

    def runtime_id(self, uuid: str) -> str:
        """A device's UUID as :meth:`pin` reads it back: the hex digits after ``GPU-``."""
        return uuid.split("-", 1)[1].replace("-", "").lower() if "-" in uuid else uuid.lower()

    # -- verification ----------------------------------------------------------------

    @abstractmethod
    def sampler(self) -> Sampler:
        """The driver, open for memory and process samples (the caller closes it);
        :class:`pytest_gpu.vendors.sampling.Unavailable` says why not."""

    def untrusted(self) -> str:
        """Why none of the driver's per-process figures can be trusted here ("": they can)."""
        return ""

    def lag(self, setting: float) -> float:
        """Seconds its process list may be old (``setting``: ``--gpu-amd-process-lag``); 0: read live."""
        return 0.0

    def caveat(self, lag: float) -> str:
        """What a violation seen in its process list may be off by, said beside it ("": nothing)."""
        return ""

    def unseen(self, tests: int, lag: float) -> str:
        """The run summary's line for ``tests`` verified from a process list up to ``lag`` seconds
        old that may not show them yet (only a vendor with a :meth:`lag` has such tests)."""
        ran = verb(tests, "test ran", "tests ran")
        return f"pytest-gpu: {tests} {self.label} GPU {ran} shorter than the process list's lag ({lag:g} s)"
