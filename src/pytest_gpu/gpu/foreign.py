"""What processes outside pytest-gpu use on the machine's GPUs, through NVML (or amdsmi).

GPUs belong to the machine: besides every pytest-gpu run (each a tree of processes under
its controller, the *roots*), a notebook, a training job or another user's program may hold
memory there. :class:`ForeignSampler` reports per GPU how much, so leases do not promise it.

Two ways to tell, chosen per sample:

- **per process**, when NVML's pids are this pid namespace's: every process NVML lists
  (compute and graphics lists, v3 records where the driver has them) that is not ours is
  foreign; a process is ours when it, or one of its ancestors, is a root
  (:func:`descends_from`). An orphan of a run that died was re-parented to init (or a
  subreaper), so it is foreign now, as it should be: nobody leases what it holds. Of the
  runs whose confinement the caller cannot answer for (another user's: the arbiter's
  :class:`~pytest_gpu.machine.arbiter.Roots` ``limits``), a process is that run's only if it
  is the run's user's, and what the run's processes use beyond what its leases account for
  is foreign too.
- **by difference**, when per-process lists cannot be trusted: NVML reports host pids and
  this process lives in a container's pid namespace (a listed pid does not exist here),
  NVML refuses the list (``NoPermission`` on MIG for an unprivileged user), or the installed
  nvidia-ml-py reads process records wrongly. Then foreign = max(0, used - reserved -
  ``accounted``), where ``accounted`` is what pytest-gpu's own leases and contexts account
  for on that GPU (the caller knows), and the result says so in its ``note``.

A GPU whose handle NVML refuses (``NoPermission``, ``GPU_IS_LOST``) reports 0 with a note:
nothing can be known about it. Nothing here raises for NVML's sake: what cannot be measured
is said in the note, and the sample goes on.

On AMD GPUs (no NVML) the same judgement is made from amdsmi's per-process list
(:class:`pytest_gpu.vendors.amd.AmdSampler`); amdsmi's used VRAM includes the driver's reserve.
On Intel GPUs (neither), from Level Zero Sysman's (:class:`pytest_gpu.vendors.intel.XpuSampler`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..base.procs import started_at
from ..base.requests import format_size
from ..machine.arbiter import Roots
from ..vendors import registry as vendors
from ..vendors.sampling import Refused, Sampler, Unavailable, Unlistable

#: Which pids are pytest-gpu's: a predicate, the roots' pids, or the roots' pids mapped to
#: their ``psutil`` create times (a recycled root pid is then not ours).
Ours = Callable[[int], bool] | Collection[int] | Mapping[int, float]


class ForeignProcess(NamedTuple):
    """A process outside pytest-gpu using a GPU: its pid, bytes there, and name ("" if unknown)."""

    pid: int
    bytes: int
    name: str


@dataclass(frozen=True)
class Foreign:
    """What processes outside pytest-gpu use on one GPU.

    ``bytes``: their memory there (0 when unknown: see ``note``); ``processes``: the
    foreign processes NVML lists there, when per-process classification was possible;
    ``note``: why the figure is an estimate, or unknown.
    """

    bytes: int
    processes: tuple[ForeignProcess, ...] = ()
    note: str | None = None


def descends_from(pid: int, roots: Collection[int] | Mapping[int, float]) -> bool:
    """Whether process ``pid`` is one of ``roots`` or descends from one (through its parents).

    ``roots`` may map each pid to its ``psutil`` create time: a root pid that was recycled by
    another process then does not count. Parent links are followed as ``psutil`` does, which
    stops at a parent pid recycled after the child started. A process that is gone (a zombie
    included) or cannot be read is not ours.
    """
    if not roots:
        return False
    ctimes = roots if isinstance(roots, Mapping) else None
    if ctimes is None and pid in roots:
        return True
    import psutil

    try:
        proc: psutil.Process | None = psutil.Process(pid)
        seen: set[int] = set()
        while proc is not None and proc.pid not in seen:
            seen.add(proc.pid)
            if proc.pid in roots and (ctimes is None or started_at(proc, ctimes[proc.pid])):
                return True
            proc = proc.parent()
    except (psutil.NoSuchProcess, psutil.AccessDenied):  # gone, a zombie, or hidden (hidepid)
        return False
    return False


def root_of(pid: int, roots: Collection[int]) -> int | None:
    """The root ``pid`` descends from (itself included), or ``None`` (gone, hidden, no root's)."""
    import psutil

    try:
        proc: psutil.Process | None = psutil.Process(pid)
        seen: set[int] = set()
        while proc is not None and proc.pid not in seen:
            seen.add(proc.pid)
            if proc.pid in roots:
                return proc.pid
            proc = proc.parent()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return None


def _uid(pid: int) -> int | None:
    import psutil

    try:
        return int(psutil.Process(pid).uids().real)
    except psutil.Error:
        return None


def _predicate(ours: Ours) -> Callable[[int], bool]:
    if callable(ours):
        return ours
    roots = ours
    return lambda pid: descends_from(pid, roots)


class ForeignSampler:
    """Samples foreign GPU usage through the machine's driver: the first vendor's
    (:data:`pytest_gpu.vendors.registry.VENDORS`: NVML, else amdsmi, else Level Zero Sysman)
    that opens, once; :meth:`close` shuts it down.

    ``uuids``: the GPUs (or MIG instances) to sample by default. ``accounted``: a callable
    returning what pytest-gpu's own leases and contexts account for per UUID, used where
    per-process classification is impossible (a caller of :meth:`sample` may pass it
    directly instead). Thread-safe.
    """

    def __init__(self, uuids: Iterable[str] = (), *, accounted: Callable[[], Mapping[str, int]] | None = None) -> None:
        self.uuids = list(uuids)
        self.accounted = accounted
        self._lock = threading.Lock()
        self._driver: Sampler | None = None
        self.unavailable: str | None = None  # why the first vendor's driver cannot be used, if it cannot
        first, *others = vendors.VENDORS.values()
        self._others: list[vendors.Vendor] = others  # asked once, at the first sample, where the first cannot be used
        try:
            self._driver = first.sampler()
        except Unavailable as exc:
            self.unavailable = str(exc)

    # -- lifecycle -------------------------------------------------------------------

    def close(self) -> None:
        """Shut the driver down (once); later samples say the sampler is closed."""
        with self._lock:
            if self._driver is not None:
                self._driver.close()
                self._driver = None
                self.unavailable = "the sampler was closed"
            self._others = []  # closed: no other vendor's is asked either

    def __enter__(self) -> ForeignSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- sampling --------------------------------------------------------------------

    def __call__(self, uuids: list[str], roots: set[int]) -> dict[str, int]:
        """Foreign bytes per UUID: the arbiter's ``ForeignSource``."""
        return {uuid: found.bytes for uuid, found in self.sample(roots, uuids=uuids).items()}

    def _open(self) -> Sampler | None:
        """The driver to sample with: NVML's, else (an AMD machine) amdsmi's, else (an Intel
        machine) Level Zero Sysman's, opened once."""
        while self._driver is None and self._others:
            try:
                self._driver = self._others.pop(0).sampler()
            except Unavailable:
                continue
        return self._driver

    def sample(
        self,
        ours: Ours,
        accounted: Mapping[str, int] | None = None,
        *,
        uuids: Iterable[str] | None = None,
    ) -> dict[str, Foreign]:
        """Per UUID, what processes that are not ``ours`` use there now.

        ``ours``: a predicate on pids, or the roots' pids (see :data:`Ours`). ``accounted``:
        bytes pytest-gpu accounts for per UUID (default: the ``accounted`` callable given at
        construction, else nothing), needed only when per-process classification is impossible.
        """
        wanted = list(self.uuids if uuids is None else uuids)
        with self._lock:
            driver = self._open()
            if driver is None:
                why = f"{self.unavailable}: foreign GPU usage is unknown"
                return {uuid: Foreign(0, (), why) for uuid in wanted}
            if accounted is None:
                accounted = self.accounted() if self.accounted is not None else {}
            is_ours = _predicate(ours)
            result: dict[str, Foreign] = {}
            memory: dict[str, tuple[int, int | None]] = {}  # uuid -> (used, reserved or None)
            listed: dict[str, dict[int, int | None]] = {}  # uuid -> pid -> bytes (None: not available)
            unlisted: dict[str, str] = {}  # uuid -> why its processes are not known
            for uuid in wanted:
                try:
                    memory[uuid] = driver.memory(uuid)
                except Refused as exc:
                    driver.forget(uuid)
                    result[uuid] = Foreign(0, (), f"{driver.name} refuses {uuid} ({exc}): its foreign usage is unknown")
                    continue
                try:
                    listed[uuid] = driver.processes(uuid)
                except Unlistable as exc:
                    unlisted[uuid] = str(exc)
            problem = driver.problem()
            if problem:  # every list is scrambled: none can be read per process
                unlisted.update(dict.fromkeys(listed, problem))
                listed.clear()
            hidden = self._hidden_pids(listed)
            if hidden:
                shown = ", ".join(map(str, hidden[:3])) + (", ..." if len(hidden) > 3 else "")
                why = (
                    f"{driver.name} reports processes ({shown}) that do not exist in this pid namespace "
                    "(a container?): their owners cannot be told apart"
                )
                unlisted.update(dict.fromkeys(listed, why))
                listed.clear()
            roots = ours if isinstance(ours, Roots) and ours.limits else None
            if roots is not None:  # their processes are judged by what their runs account for, below
                is_ours = _predicate(set(roots) - set(roots.limits))
            for uuid, procs in listed.items():
                if roots is not None:
                    procs, beyond = self._beyond_limits(uuid, procs, roots)
                else:
                    beyond = 0
                found = self._by_process(uuid, procs, is_ours, memory[uuid], accounted.get(uuid, 0))
                result[uuid] = Foreign(found.bytes + beyond, found.processes, found.note) if beyond else found
            for uuid, why in unlisted.items():
                result[uuid] = self._by_difference(uuid, memory[uuid], accounted.get(uuid, 0), why, driver.name)
            return {uuid: result[uuid] for uuid in wanted}

    def listed_outside(self, roots: Mapping[int, float], gpus: Mapping[int, str]) -> dict[int, int]:
        """GPU index -> bytes the processes the driver lists there use, those of ``roots``'
        trees and this process left out, for the GPUs of ``gpus`` (index -> UUID) where every
        such process is listed with its memory: :meth:`sample`'s per-process figures alone
        (no estimate by difference, so no memory query), at the cost of a GPU test's start.
        A GPU the driver cannot list, or refuses, is left out; all are where its lists are
        scrambled or its pids are another namespace's."""
        me = os.getpid()
        found: dict[int, int] = {}
        with self._lock:
            driver = self._open()
            if driver is None or driver.problem():
                return {}
            listed: dict[int, dict[int, int | None]] = {}
            for index, uuid in gpus.items():
                try:
                    listed[index] = driver.processes(uuid)
                except Exception:  # Unlistable, or a GPU gone from the driver: nothing is known there
                    driver.forget(uuid)
            if self._hidden_pids(listed):
                return {}
            for index, procs in listed.items():
                outside = [used for pid, used in procs.items() if pid != me and not descends_from(pid, roots)]
                if None not in outside:  # one listed without its memory: unknown, not zero
                    found[index] = sum(used or 0 for used in outside)
        return found

    @staticmethod
    def _hidden_pids(listed: Mapping[Any, Mapping[int, int | None]]) -> list[int]:
        """Listed pids that do not exist here: the driver's pids are another pid namespace's. (A
        process that exits between the driver's list and this look makes one sample an estimate,
        no worse.)"""
        import psutil

        return sorted({pid for procs in listed.values() for pid in procs if not psutil.pid_exists(pid)})

    @staticmethod
    def _beyond_limits(uuid: str, procs: Mapping[int, int | None], roots: Roots) -> tuple[dict[int, int | None], int]:
        """Of ``procs``, those of runs the arbiter cannot answer for (``roots.limits``) taken out,
        and what those runs use on ``uuid`` beyond what their leases account for there; a
        process of such a run's tree that is not the run's user's stays in (judged as any)."""
        rest: dict[int, int | None] = {}
        used: dict[int, int] = {}
        for pid, nbytes in procs.items():
            root = root_of(pid, roots)
            limit = roots.limits.get(root) if root is not None else None
            if root is None or limit is None or nbytes is None or _uid(pid) != limit[0]:
                rest[pid] = nbytes
                continue
            used[root] = used.get(root, 0) + nbytes
        beyond = sum(max(0, n - roots.limits[root][1].get(uuid, 0)) for root, n in used.items())
        return rest, beyond

    # -- the two ways to tell ----------------------------------------------------------

    @staticmethod
    def _by_process(
        uuid: str,
        procs: Mapping[int, int | None],
        is_ours: Callable[[int], bool],
        memory: tuple[int, int | None],
        accounted: int,
    ) -> Foreign:
        import psutil

        foreign: list[ForeignProcess] = []
        unknown: list[int] = []
        for pid, used in sorted(procs.items()):
            if is_ours(pid):
                continue
            try:
                name = psutil.Process(pid).name()
            except psutil.Error:
                name = ""
            if used is None:
                unknown.append(pid)
            foreign.append(ForeignProcess(pid, used or 0, name))
        if unknown:  # NVML does not say what they use: estimate the whole GPU's foreign share
            why = f"NVML does not say how much memory process {', '.join(map(str, unknown))} uses"
            estimate = ForeignSampler._by_difference(uuid, memory, accounted, why)
            return Foreign(estimate.bytes, tuple(foreign), estimate.note)
        return Foreign(sum(p.bytes for p in foreign), tuple(foreign), None)

    @staticmethod
    def _by_difference(
        uuid: str, memory: tuple[int, int | None], accounted: int, why: str, driver: str = "NVML"
    ) -> Foreign:
        used, reserved = memory
        estimate = max(0, used - accounted)
        how = f"used memory less the {format_size(accounted)} pytest-gpu accounts for"
        if reserved is None:
            how += f" (the driver's reserve, which this {driver} does not report, counts as foreign)"
        return Foreign(estimate, (), f"{why}: foreign usage on {uuid} is its {how}")


class OutsideRun:
    """What memory processes outside one run use on its GPUs, as a test process samples it:
    the evidence that an out-of-memory error came from outside the test
    (:mod:`pytest_gpu.run.transient`). ``roots``: the run's owner (pid -> create time); every
    process descending from it is the run's. The driver is opened at the first sample and
    kept open until :meth:`close`.

    Only per-process figures count: an estimate by difference (a container's pid namespace,
    MIG without privileges) would count the run's own memory as outside it, so a GPU sampled
    that way is left out (nothing is known there)."""

    def __init__(self, roots: Mapping[int, float]) -> None:
        self.roots = dict(roots)
        self._sampler: ForeignSampler | None = None

    def sample(self, gpus: Mapping[int, str]) -> dict[int, int]:
        """GPU index -> bytes outside the run there now, for the GPUs of ``gpus`` (index ->
        UUID) whose processes the driver lists; a GPU it cannot tell about is left out."""
        if not gpus:
            return {}
        if self._sampler is None:
            self._sampler = ForeignSampler()
        return self._sampler.listed_outside(self.roots, gpus)

    def close(self) -> None:
        if self._sampler is not None:
            self._sampler.close()
            self._sampler = None
