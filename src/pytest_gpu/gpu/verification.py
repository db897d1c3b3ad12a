"""After a test: did it stay inside its lease?

Three checks, each producing a sentence for the report:

(a) memory used on a GPU outside the lease;
(b) peak memory above the lease's budget on a leased GPU;
(c) memory still held on a GPU after the test's teardown.

Simulated devices answer from the ledger, which attributes every allocation (of the
test process and of its subprocesses, which inherit the tag) to the test. Real GPUs
answer from NVML per-process usage of this process and its children, and from torch's
allocator counters when torch is loaded. GPUs that another lease of the same test held
(a ``gpu_request`` section) are that lease's to judge: NVML's usage is per process, not
per lease.

What cannot be measured is said, not guessed: an NVML error (MIG without privileges:
``NoPermission``) or a container whose pid namespace hides the host pids NVML reports
turns the per-process check into a note on the report, and the test is judged on what
was measured.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Protocol

from .. import sim
from ..base.procs import CTIME_TOLERANCE_S, descendants, owner_alive, process_name
from ..base.requests import format_size
from ..base.wording import numbered
from ..sim import cuda as sim_cuda
from ..vendors import registry as vendors
from ..vendors.devices import Inventory, addressable
from ..vendors.sampling import Unavailable, Unlistable
from . import runtime
from .isolation import GpuLease
from .torchstats import TorchCounters, torch_counters


@dataclass
class Verdict:
    """What one test used, and what it did wrong."""

    peak: dict[int, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what could not be checked, and why
    measured: bool = True  # False: the peaks are unknown (not zero)
    # AMD: the process list's lag (seconds) when the verdict was read from a list that may not
    # yet show the test at all (it ended sooner than that after the lease began, and nothing
    # waited: see NvmlVerifier.end); 0: no such blind spot. The run's summary counts these.
    unseen_lag: float = 0.0
    # GPU index -> bytes the lease still held after the test (the "still holds" violations):
    # what its process keeps charged to it until they are given back (see GpuRun.finish)
    left: dict[int, int] = field(default_factory=dict)

    def merge(self, other: Verdict) -> None:
        self.measured = self.measured and other.measured
        self.unseen_lag = max(self.unseen_lag, other.unseen_lag)
        for index, value in other.left.items():
            self.left[index] = self.left.get(index, 0) + value
        for index, value in other.peak.items():
            self.peak[index] = max(self.peak.get(index, 0), value)
        self.violations.extend(other.violations)
        self.notes.extend(n for n in other.notes if n not in self.notes)


def judge(
    lease: GpuLease,
    peak: dict[int, int],
    current: dict[int, int],
    touched: Iterable[int],
    others: Iterable[int] = (),
    why: Mapping[int, str] | None = None,
    *,
    whence: dict[int, str] | None = None,
) -> Verdict:
    """Pure rule: turn measured usage into a verdict for ``lease``; ``others``: GPUs other
    leases of the same test held (theirs to judge); ``why``: per GPU, what still holds its
    ``current`` memory, where the verifier knows; ``whence``: how a GPU outside the lease
    was reached, where it is known (``"cuda:0 from another thread"``)."""
    verdict = Verdict(peak={i: peak.get(i, 0) for i in lease.indices})
    leased = set(lease.indices)
    shared = set(others) - leased
    outside = sorted(set(touched) - leased - shared)
    if outside:
        how = whence or {}
        context = f"a {vendors.of(lease.vendor).context}"  # the lease's vendor's: CUDA, HIP, Level Zero
        used = ", ".join(
            f"GPU {i} ({format_size(peak[i]) + ' at peak' if peak.get(i) else context}"
            + (f"; {how[i]})" if i in how else ")")
            for i in outside
        )
        verdict.violations.append(f"used memory on {used} outside its lease (GPU {','.join(map(str, lease.indices))})")
        if any(i in how for i in outside):
            verdict.violations[-1] += f": {THREAD_ADVICE}"
    for index in lease.indices:
        if peak.get(index, 0) > lease.memory:
            verdict.violations.append(
                f"peak {format_size(peak[index])} on GPU {index} is above its budget of {format_size(lease.memory)}"
            )
    for index in sorted(current):
        if current[index] > 0 and (index in leased or index not in shared):
            held = (why or {}).get(index) or "a leaked allocation, or a subprocess still running"
            verdict.violations.append(
                f"still holds {format_size(current[index])} on GPU {index} after the test ({held})"
            )
            verdict.left[index] = current[index]
    return verdict


THREAD_ADVICE = (
    "a thread's current device is its own (cuda:0 until it chooses one); a thread that uses the GPU "
    "must call torch.cuda.set_device(lease.device) first, or work inside `with torch.cuda.device(lease.device):`"
)


def threads_outside(usage: sim.TagUsage, lease: GpuLease, confined: int) -> dict[int, str]:
    """GPUs outside ``lease`` that a thread of this process other than ``confined`` (the thread
    the lease confined) touched, named as that thread's CUDA saw them: ``"cuda:0 from another
    thread (Thread-1)"``. The ledger records the thread of each call; real NVML cannot."""
    me, found = os.getpid(), {}
    for unit, who in usage.threads.items():
        if unit in lease.indices:
            continue
        names = sorted({name for pid, ident, name in who if pid == me and ident != confined})
        if names:
            ordinal = sim_cuda.ordinal_of(unit)
            where = f"cuda:{ordinal}" if ordinal is not None else f"GPU {unit}"
            found[unit] = f"{where} from another thread ({', '.join(names)})"
    return found


# Long-lived processes this process started for a holder other than the running test (a
# warm rank pool, the run's Ray head, a session fixture's server): their GPU usage is their
# holder's, never the test's. pid -> (holder, create time: a recycled pid is not claimed).
_CLAIMED: dict[int, tuple[str, float | None]] = {}


def claim_processes(pids: Iterable[int], holder: str) -> None:
    """Say that ``pids`` (and their descendants) answer to ``holder``, not to the test that
    happens to run while they live; :func:`release_processes` when they end (a claim on a
    process that ended lapses by itself)."""
    for pid in pids:
        _CLAIMED[int(pid)] = (holder, _create_time(int(pid)))


def release_processes(pids: Iterable[int]) -> None:
    """``pids`` ended (or were handed back): forget their holder."""
    for pid in pids:
        _CLAIMED.pop(int(pid), None)


def claimed() -> dict[int, str]:
    """pid -> holder of the live long-lived processes another holding answers for."""
    for pid, (_, ctime) in list(_CLAIMED.items()):
        if not owner_alive(pid, ctime, unsure=False):
            del _CLAIMED[pid]  # it ended (its pid may be another process's now)
    return {pid: holder for pid, (holder, _) in _CLAIMED.items()}


def _create_time(pid: int) -> float | None:
    import psutil

    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


@contextmanager
def claiming(holder: str) -> Iterator[None]:
    """Claim for ``holder`` the processes this process starts inside the block and that are
    still alive at its end: a session or module fixture's server, set up during the setup of
    the first test that needs it, is the fixture's, not that test's."""
    before = set(descendants())
    try:
        yield
    finally:
        started = set(descendants()) - before
        holders = claimed()
        # a process claimed inside the block by a holder of its own (the run's Ray head a
        # fixture starts) stays that holder's, and so do its descendants
        started = {pid for pid in started if _claimant(pid, holders) is None}
        if started:
            claim_processes(started, holder)


class Verifier(Protocol):
    """What checks a lease: :class:`SimVerifier`, :class:`NvmlVerifier`, :class:`SharedVerifier`,
    and a rank pool's: :class:`SimRankVerifier`, :class:`NvmlRankVerifier`."""

    def begin(self, lease: GpuLease, owner: int) -> None: ...

    def end(self, lease: GpuLease, others: Iterable[int] = (), peaks: Mapping[int, int] | None = None) -> Verdict:
        """The verdict; ``peaks``: GPU index -> the lease's own peak where its confinement measured
        one (:attr:`~pytest_gpu.gpu.isolation.Confinement.peaks`: torch's, above what the rest of
        the process held), used in place of the process's peak."""
        ...


class SimVerifier:
    """Reads the simulated ledger; the tag is set in the environment by the lease.

    The ledger records which thread made each call: a GPU outside the lease reached from a
    thread other than the one that began the lease (the test's) is named as such."""

    def __init__(self) -> None:
        self._thread = threading.get_ident()

    def begin(self, lease: GpuLease, owner: int) -> None:
        self._thread = threading.get_ident()  # the test's thread, which the lease confined
        sim.ledger().begin_tag(lease.env[sim.TAG_ENV], owner)

    def end(self, lease: GpuLease, others: Iterable[int] = (), peaks: Mapping[int, int] | None = None) -> Verdict:
        usage = sim.ledger().tag_usage(lease.env[sim.TAG_ENV], drop=True)  # per lease already: peaks unused
        whence = threads_outside(usage, lease, self._thread)
        return judge(lease, usage.peak, usage.current, usage.touched, others, whence=whence)


class SimRankVerifier:
    """A rank pool's lease on simulated GPUs: its ranks' allocations carry the lease's tag.

    Each rank keeps its CUDA context for the pool's life, as the test process keeps its own:
    the contexts are the pool's standing cost (placement counts a context on each leased
    GPU, beside the lease's budget), neither a test's peak nor a leak. ``pids``: the ranks'
    processes (set once they have said hello), asked when the check runs.
    """

    def __init__(self, overhead: int, pids: Iterable[int] = ()) -> None:
        self.overhead = overhead
        self.pids: list[int] = list(pids)

    def begin(self, lease: GpuLease, owner: int) -> None:
        sim.ledger().begin_tag(lease.env[sim.TAG_ENV], owner)

    def end(self, lease: GpuLease, others: Iterable[int] = (), peaks: Mapping[int, int] | None = None) -> Verdict:
        led = sim.ledger()
        usage = led.tag_usage(lease.env[sim.TAG_ENV], drop=True)
        contexts: dict[int, int] = {}
        for pid in self.pids:
            for unit in led.contexts_of(pid):
                contexts[unit] = contexts.get(unit, 0) + self.overhead
        peak = {i: max(n - contexts.get(i, 0), 0) for i, n in usage.peak.items()}
        current = {i: max(n - contexts.get(i, 0), 0) for i, n in usage.current.items()}
        touched = {i for i in usage.touched if i in lease.indices or peak.get(i, 0) or current.get(i, 0)}
        return judge(lease, peak, current, touched, others)


# A process's CUDA context grows after it opens: kernels load lazily (CUDA_MODULE_LOADING=LAZY,
# the default since CUDA 12.2), cuBLAS, cuDNN, NCCL and Triton load their modules and create
# their handles on first use, local memory grows to what a kernel needs and never shrinks. NVML
# cannot tell that growth from an allocation held, so up to this much growth per GPU *in one
# test* (above the baseline taken when its lease began, which holds all earlier growth) is taken
# as the context's: neither the test's peak nor a leak. A long-lived worker or pool meets a new
# library in test after test; an allowance over the process's life would run out and charge clean
# tests. Beyond it, all the growth is the test's: its peak, and held when it outlives the test.
CONTEXT_GROWTH = 256 * 2**20
_grown: dict[tuple[int, int], int] = {}  # (pid, GPU index) -> growth taken as the context's so far


@dataclass
class _Sample:
    """What NVML says this process and its descendants use (a process whose usage NVML does
    not give is left out, and its GPU marked unmeasured)."""

    usage: dict[int, dict[int, int]] = field(default_factory=dict)  # pid -> GPU index -> bytes
    tree: dict[int, float] = field(default_factory=dict)  # live descendants: pid -> create time


class NvmlVerifier:
    """Real GPUs: NVML per-process usage, torch's counters where torch is the allocator.

    What a test is charged (docs/how-it-works.md's accounting table says the same):

    - this process's NVML usage (every allocator: torch, CuPy, JAX, raw ``cudaMalloc``,
      NCCL), above what it used when the lease began, once the lease was applied (its
      context, what earlier tests left and grew into it are the baseline), less growth up to
      :data:`CONTEXT_GROWTH`, which is its context's (libraries and kernels loaded on first
      use); a context the test opened is its measured size (:attr:`contexts`), else ``overhead``;
    - the processes the test started: descendants of this process born while the lease was
      held, with theirs. A descendant alive before it began (a warm rank pool, the Ray head,
      torch.compile's workers) is not the test's: one :func:`claimed` answers to its holder,
      any other is named in a note and left out.

    A leak is memory this process still holds at the end (after the adapters' ``empty_cache``)
    above its baseline, or a process the test started still on a GPU. The peak is torch's
    (:func:`~pytest_gpu.gpu.torchstats.torch_peak`) where torch allocated, else NVML's sample at the end: NVML has
    no per-process peak, so memory a test allocated and freed outside torch is not seen, and
    such a peak is not a measurement (no ``memory=`` suggestion is made from it).

    Runs in CI against the fake ``libnvidia-ml.so.1`` and the torch double; not run on a
    real GPU by the author.
    """

    def __init__(
        self,
        inventory: Inventory,
        overhead: int,
        lag: float = 0.0,
        wait: bool = False,
        contexts: Mapping[int, int] | None = None,
    ) -> None:
        self.inventory = inventory
        self.vendor = vendors.of(inventory.vendor)
        self.overhead = overhead
        # GPU index -> a context's size as measured there (the run's calibration, read when used:
        # it fills in as GPUs are measured); the configured ``overhead`` only where none was
        self.contexts: Mapping[int, int] = contexts if contexts is not None else {}
        # seconds the driver's process list may be old (AMD's; NVML and Sysman read live: never waited for)
        self.lag = self.vendor.lag(lag)
        self.wait = wait  # --gpu-amd-lag-wait: a test shorter than the lag waits out the rest
        self._begun = -math.inf  # when the begin sample was taken (time.monotonic)
        self._baseline: dict[int, int] = {}
        self._before: dict[int, float] = {}  # descendants alive when the lease began
        self._torch_base: dict[int, int] = {}
        self._torch_reserved: dict[int, int] = {}
        self._notes: list[str] = []
        self._unmeasured: set[int] = set()
        self._untrusted = self.vendor.untrusted()  # its process lists are scrambled: measure nothing from them
        self._peaks: dict[int, int] = {}  # the lease's own torch peaks, given to end()

    def _usage(self) -> _Sample | None:
        """Bytes the driver reports per GPU for this process and each live descendant (NVML's
        compute lists; amdsmi's process list on AMD GPUs); ``None`` (and a note) when it cannot tell."""
        import psutil

        if self._untrusted:
            self._give_up(self._untrusted)
            return None
        me = psutil.Process()
        sample = _Sample()
        sample.tree = self._tree()
        try:
            driver = self.vendor.sampler()
        except Unavailable as exc:
            self._give_up(f"{exc}: memory outside the lease was not checked")
            return None
        try:
            foreign: set[int] = set()
            for device in addressable(self.inventory.machine or self.inventory.devices):
                try:
                    procs = driver.compute(device.uuid)
                except Unlistable as exc:
                    self._note(
                        f"{driver.name} cannot list processes on GPU {device.index} ({exc.cause}): not checked there"
                    )
                    self._unmeasured.add(device.index)
                    continue
                for pid, used in procs:
                    if pid == me.pid or pid in sample.tree:
                        if used is None:  # "not available": unknown, not zero
                            self._note(
                                f"{driver.name} does not say how much memory processes use on GPU {device.index}"
                            )
                            self._unmeasured.add(device.index)
                            continue
                        into = sample.usage.setdefault(pid, {})
                        # a process in the compute and graphics lists, or on two MIG units of a GPU
                        into[device.index] = into.get(device.index, 0) + used
                    elif not psutil.pid_exists(pid):
                        foreign.add(pid)
            if foreign and not sample.usage:
                # the driver reports host pids; in a container's pid namespace none of them is ours
                self._give_up(
                    f"{driver.name} reports processes ({', '.join(map(str, sorted(foreign)[:3]))}) that do not "
                    "exist in this pid namespace (a container?): memory outside the lease was not checked"
                )
                return None
        finally:
            driver.close()
        return sample

    def _tree(self) -> dict[int, float]:
        """The processes whose usage is sampled besides this one: its live descendants (pid -> create time)."""
        return descendants()

    def _give_up(self, why: str) -> None:
        """Nothing NVML says can be attributed to this test: note why, mark every GPU unmeasured."""
        self._note(why)
        self._unmeasured.update(d.index for d in self.inventory.devices)

    def _note(self, text: str) -> None:
        if text not in self._notes:
            self._notes.append(text)

    def context(self, index: int) -> int:
        """One context's size on GPU ``index``: as measured there, else the configured overhead."""
        return self.contexts.get(index) or self.overhead

    def _torch(self) -> ModuleType | None:
        """torch's device module (``torch.cuda``; ``torch.xpu`` on Intel GPUs), once it has started."""
        torch = sys.modules.get("torch")
        device = getattr(torch, self.vendor.device_kind, None)
        if device is not None and device.is_available() and device.is_initialized():
            module: ModuleType = device
            return module
        return None

    def begin(self, lease: GpuLease, owner: int) -> None:
        sample = self._usage()
        self._begun = time.monotonic()
        self._baseline = sample.usage.get(os.getpid(), {}) if sample is not None else {}
        self._before = sample.tree if sample is not None else descendants()
        device = self._torch()
        ordinals = runtime.in_process(self.inventory, lease.indices)
        if device is not None and ordinals is not None:
            for index, ordinal in zip(lease.indices, ordinals, strict=True):
                counters = torch_counters(device, ordinal)
                self._torch_base[index] = counters.allocated
                self._torch_reserved[index] = counters.reserved

    def _split(self, sample: _Sample) -> tuple[dict[int, int], dict[int, dict[int, int]]]:
        """This process's usage, and that of the processes the test started (pid -> GPU -> bytes);
        the others of the tree are their holders' (named in a note when no holder claimed them)."""
        holders = claimed()
        mine = sample.usage.get(os.getpid(), {})
        started: dict[int, dict[int, int]] = {}
        for pid, used in sample.usage.items():
            if pid == os.getpid() or not any(used.values()):
                continue
            holder = _claimant(pid, holders)
            if holder is not None:
                continue  # a warm pool's rank, the Ray head: verified as its holder's
            if abs(self._before.get(pid, -math.inf) - sample.tree.get(pid, math.inf)) <= CTIME_TOLERANCE_S:
                where = numbered("GPU", sorted(i for i, n in used.items() if n))
                self._note(  # no bytes in it: the summary counts the tests a note was made for
                    f"pid {pid} ({process_name(pid)}), started before the test, uses {where}: not charged to the "
                    "test (a process of a fixture, a pool or an earlier test)"
                )
                continue
            started[pid] = used
        return mine, started

    def end(self, lease: GpuLease, others: Iterable[int] = (), peaks: Mapping[int, int] | None = None) -> Verdict:
        """Judge the lease (:meth:`_judged`); where the driver's list is coarse (AMD's), each
        violation says how coarse it may be (a rank pool's verdict too)."""
        self._peaks = dict(peaks or {})
        verdict = self._judged(lease, others)
        caveat = self.vendor.caveat(self.lag)
        if caveat:
            verdict.violations = [f"{v} ({caveat})" for v in verdict.violations]
        return verdict

    def _judged(self, lease: GpuLease, others: Iterable[int] = ()) -> Verdict:
        """Judge the lease from a sample taken now. Where the driver's list may be ``lag`` old
        (AMD), it may still show what was freed in the test's last moments, and not yet show
        what was taken in them:

        - when the sample finds a violation, the verdict is made again, from scratch, from one
          more sample taken ``lag`` after the test ended (what was freed by then is gone from
          that list): a cost paid only where something looks wrong;
        - a test that ended less than ``lag`` after the begin sample may not be in the list at
          all: with ``wait`` (``--gpu-amd-lag-wait``) the sample is taken no earlier than
          ``lag`` after the begin sample (a wait of the rest of the lag, never more); without
          it (the default) nothing waits, and the verdict says so (:attr:`Verdict.unseen_lag`)
          for the run's summary to count.
        """
        if self.lag <= 0:
            return self._end(lease, others)
        ended = time.monotonic()
        if self.wait:
            _sleep_until(self._begun + self.lag)
        kept = list(self._notes), set(self._unmeasured), dict(_grown)
        sampled = time.monotonic()
        verdict = self._end(lease, others)
        if verdict.violations:
            # judged again from scratch: what the first sample noted or took as context growth is undone
            self._notes, self._unmeasured = kept[0], kept[1]
            _grown.clear()
            _grown.update(kept[2])
            _sleep_until(ended + self.lag)
            sampled = time.monotonic()
            verdict = self._end(lease, others)
        if sampled < self._begun + self.lag:  # read from a list that may predate all the test did
            verdict.unseen_lag = self.lag
        return verdict

    def _end(self, lease: GpuLease, others: Iterable[int] = ()) -> Verdict:
        """The verdict from one sample taken now."""
        sample = self._usage()
        touched: list[int] = []
        peak = {i: 0 for i in lease.indices}
        current: dict[int, int] = {}
        why: dict[int, list[str]] = {}
        whence: dict[int, str] = {}
        seen = False
        device = self._torch()
        ordinals = runtime.in_process(self.inventory, lease.indices)
        pid = os.getpid()
        counted: dict[int, TorchCounters] = {}
        if device is not None and ordinals is not None:
            for index, ordinal in zip(lease.indices, ordinals, strict=True):
                counted[index] = counters = torch_counters(device, ordinal)
                # the lease's own (the adapter's, above what the rest of the process held: a fixture's
                # tensors, an earlier test's leftovers), else torch's since the lease's start
                peak[index] = self._peaks.get(index, counters.peak)
                seen = seen or peak[index] > 0
                left = counters.allocated - self._torch_base.get(index, 0)
                if left > 0:
                    current[index] = left
                    why.setdefault(index, []).append("torch still allocates it: a tensor kept after the test")
        if sample is not None:
            mine, started = self._split(sample)
            # (a) this process on a GPU outside the lease (any growth, a new context included),
            # or a process the test started anywhere outside it
            touched = [i for i in mine if mine[i] > self._baseline.get(i, 0)]
            whence = _cuda0_whence(self.inventory, lease, touched)
            touched += [i for used in started.values() for i, n in used.items() if n > 0 and i not in touched]
            for index in lease.indices:
                if index in self._unmeasured:
                    continue
                growth = mine.get(index, 0) - self._baseline.get(index, 0)
                if self._baseline.get(index, 0) == 0 and growth > 0:
                    growth -= self.context(index)  # the process opened its context here during the test
                if index in counted:
                    # torch's cache is counted by torch; what NVML adds beyond it is another allocator's
                    growth -= max(counted[index].reserved - self._torch_reserved.get(index, 0), 0)
                growth = max(growth, 0)
                held = _beyond_context(pid, index, growth)  # 0: the context's growth, not the test's
                children = {p: used[index] for p, used in started.items() if used.get(index)}
                peak[index] += held + sum(children.values())
                seen = seen or peak[index] > 0
                if held:
                    current[index] = current.get(index, 0) + held
                    outside = ", outside torch's cache" if device is not None else ""
                    why.setdefault(index, []).append(f"memory this process still holds after the test{outside}")
                if children:
                    current[index] = current.get(index, 0) + sum(children.values())
                    names = ", ".join(f"pid {p} ({process_name(p)})" for p in sorted(children))
                    why.setdefault(index, []).append(
                        f"{_plural_proc(len(children))} the test started still running: {names}"
                    )
        verdict = judge(lease, peak, current, touched, others, {i: "; ".join(w) for i, w in why.items()}, whence=whence)
        verdict.notes.extend(self._notes)
        unmeasured = self._unmeasured & set(lease.indices)
        verdict.measured = seen and (device is not None or not unmeasured)
        return verdict


class NvmlRankVerifier(NvmlVerifier):
    """A rank pool's lease on real GPUs: NVML's per-process usage of its ranks.

    The pool's processes are its ranks (``pids``, set once they have said hello) and their
    descendants; they are claimed by the pool (:func:`claim_processes`), so the test
    process's own :class:`NvmlVerifier` never charges them. Each check (:meth:`end`, after
    every test the pool ran) judges the window since :meth:`begin`:

    - baseline: what each process of the pool used per GPU when the window began (its
      CUDA context, NCCL's buffers, what earlier tests grew into its context): the pool's
      standing cost, as the test process's context is the test's;
    - the test's use of a leased GPU is the pool's growth over that baseline, sampled once
      the ranks have run the test and cleaned up (``gc.collect`` and ``empty_cache`` in
      :mod:`~pytest_gpu.distributed.rankmain`): NVML has no per-process peak, so memory a
      rank allocated and freed during the test is not seen, and the peak is what was still
      there at the end (not a measurement: no ``memory=`` suggestion is made from it);
    - a rank that opened its first context on a GPU during the test (nothing there at the
      baseline) is not charged for the context (its measured size, else ``overhead``); growth
      up to :data:`CONTEXT_GROWTH` in one test is its context's (libraries and kernels loaded,
      NCCL's communicators), neither peak nor leak; beyond it, growth that remains after the
      test is held: a leak of the rank;
    - a process a rank started during the test is charged in full, and is a leak while it runs;
    - a process of the pool on a GPU outside the pool's lease is a violation.

    What NVML cannot tell (no usage given, no permission, a container's pid namespace) is a
    note, as for :class:`NvmlVerifier`. Runs in CI against the fake ``libnvidia-ml.so.1``;
    not run on a real GPU by the author.
    """

    def __init__(
        self,
        inventory: Inventory,
        overhead: int,
        pids: Iterable[int] = (),
        lag: float = 0.0,
        wait: bool = False,
        contexts: Mapping[int, int] | None = None,
    ) -> None:
        super().__init__(inventory, overhead, lag, wait, contexts)
        self.pids: list[int] = list(pids)
        self._usage_before: dict[int, dict[int, int]] = {}  # pool process -> GPU index -> bytes
        self._pool_before: dict[int, float] = {}  # the pool's processes when the window began

    def _tree(self) -> dict[int, float]:
        """This process's descendants, and the ranks that are not among them (an ``srun`` step's
        tasks are the children of Slurm's step daemon, on this node) with their own."""
        import psutil

        tree = descendants()
        for pid in self.pids:
            if pid in tree:
                continue
            try:
                rank = psutil.Process(pid)
                tree[pid] = rank.create_time()
                for child in rank.children(recursive=True):
                    tree[child.pid] = child.create_time()
            except psutil.Error:  # it ended (the pool died): nothing of it to sample
                continue
        return tree

    def _pool(self, sample: _Sample) -> tuple[dict[int, float], dict[int, dict[int, int]]]:
        """The live processes of the pool (pid -> create time) and their usage, from ``sample``."""
        ranks = dict.fromkeys(self.pids, "the pool")
        inside = {pid: ctime for pid, ctime in sample.tree.items() if _claimant(pid, ranks) is not None}
        return inside, {pid: used for pid, used in sample.usage.items() if pid in inside}

    def begin(self, lease: GpuLease, owner: int) -> None:
        self._notes, self._unmeasured = [], set()  # the last window's were said with its verdict
        sample = self._usage()
        self._begun = time.monotonic()
        self._pool_before, self._usage_before = self._pool(sample) if sample is not None else ({}, {})

    def _end(self, lease: GpuLease, others: Iterable[int] = ()) -> Verdict:
        sample = self._usage()
        leased = set(lease.indices)
        peak = {i: 0 for i in lease.indices}
        current: dict[int, int] = {}
        touched: set[int] = set()
        why: dict[int, list[str]] = {}
        if sample is not None:
            alive, usage = self._pool(sample)
            for pid, used in sorted(usage.items()):
                standing = pid in self.pids or (
                    abs(self._pool_before.get(pid, -math.inf) - alive[pid]) <= CTIME_TOLERANCE_S
                )
                for index, now in used.items():
                    if index in self._unmeasured:
                        continue
                    if not standing:  # a process a rank started during the test: all of it is the test's
                        if now > 0:
                            touched.add(index)
                            peak[index] = peak.get(index, 0) + now
                            if index in leased:
                                current[index] = current.get(index, 0) + now
                                why.setdefault(index, []).append(
                                    f"a process a rank of the pool started still running: pid {pid} "
                                    f"({process_name(pid)})"
                                )
                        continue
                    before = self._usage_before.get(pid, {}).get(index, 0)
                    growth = now - before
                    if growth <= 0:
                        continue
                    touched.add(index)  # outside the lease, a new context is already a violation
                    if before == 0:
                        growth = max(growth - self.context(index), 0)  # the rank opened its context here
                    if index not in leased:
                        peak[index] = peak.get(index, 0) + growth
                        continue
                    held = _beyond_context(pid, index, growth)  # 0: the context's growth, not the test's
                    peak[index] += held
                    if held:
                        current[index] = current.get(index, 0) + held
                        reason = "a rank of the pool still holds it"
                        if pid not in self.pids:
                            reason = f"pid {pid} ({process_name(pid)}), started by a rank of the pool, still holds it"
                        if reason not in why.get(index, []):
                            why.setdefault(index, []).append(reason)
        verdict = judge(lease, peak, current, touched, others, {i: "; ".join(w) for i, w in why.items()})
        verdict.notes.extend(self._notes)
        verdict.measured = False  # NVML's sample at the end, not a peak
        return verdict


def standing(inventory: Inventory, context: Mapping[int, int], indices: Iterable[int]) -> dict[int, int]:
    """What this process holds on each of ``indices`` beyond its own context (``context``: its
    size per GPU), with what the processes it started and no other holder claimed hold there,
    whole: measured while no lease of the process is there, it is what earlier leases left. A
    GPU that cannot be measured now is left out. Simulated GPUs: the ledger; real ones: the
    driver's process lists (as :class:`NvmlVerifier` reads them)."""
    wanted = list(indices)
    me = os.getpid()
    holders = claimed()
    if inventory.simulated:
        started = [pid for pid in descendants() if _claimant(pid, holders) is None]
        found = sim.ledger().allocations([me], whole=started)
        return {i: found.get(i, 0) for i in wanted}
    verifier = NvmlVerifier(inventory, 0)
    sample = verifier._usage()
    if sample is None:
        return {}
    out: dict[int, int] = {}
    for index in wanted:
        if index in verifier._unmeasured:
            continue
        mine = sample.usage.get(me, {}).get(index, 0)
        held = max(mine - context.get(index, 0) - _grown.get((me, index), 0), 0) if mine else 0
        for pid, used in sample.usage.items():
            if pid != me and _claimant(pid, holders) is None:
                held += used.get(index, 0)
        out[index] = held
    return out


def _sleep_until(deadline: float) -> None:
    """Wait until ``time.monotonic()`` reaches ``deadline`` (at once when it has)."""
    left = deadline - time.monotonic()
    if left > 0:
        time.sleep(left)


def _cuda0_whence(inventory: Inventory, lease: GpuLease, grew: list[int]) -> dict[int, str]:
    """Real GPUs: the driver reports per process, not per thread. Where this process grew on its
    own device 0 (``cuda:0``, ``xpu:0``) outside the lease, say what that may be (a thread left on
    its default device) and that it cannot be told. Runs against the fake drivers; not run on a
    real GPU here."""
    view = runtime.view(inventory)
    if not view or view[0] in lease.indices or view[0] not in grew:
        return {}
    vendor = vendors.of(inventory.vendor)
    where = f"this process's {vendor.device_kind}:0"
    return {view[0]: f"{where}: perhaps from another thread, which {vendor.driver} cannot tell apart"}


def _claimant(pid: int, holders: dict[int, str]) -> str | None:
    """The holder that claimed ``pid`` or one of its ancestors (``None``: no one)."""
    if not holders:
        return None
    if pid in holders:
        return holders[pid]
    import psutil

    try:
        for parent in psutil.Process(pid).parents():
            if parent.pid in holders:
                return holders[parent.pid]
    except psutil.Error:
        return None
    return None


def _plural_proc(count: int) -> str:
    return "a process" if count == 1 else f"{count} processes"


def _beyond_context(pid: int, index: int, growth: int) -> int:
    """What of process ``pid``'s ``growth`` on GPU ``index`` during one test is the test's: all
    of it when it is more than the context may grow by in a test (:data:`CONTEXT_GROWTH`), else
    none (the context grew: kept in :data:`_grown`, which :func:`standing` leaves out)."""
    if growth > CONTEXT_GROWTH:
        return growth
    key = (pid, index)
    _grown[key] = _grown.get(key, 0) + growth
    return 0


class SharedVerifier:
    """A verifier that leaves GPUs shared with other leases of this process unjudged.

    On real GPUs NVML's usage and torch's allocator count per process: on a GPU that a
    test's lease shares with a fixture's, the test's peak and leftovers cannot be told from
    the fixture's. Said in a note, not guessed (simulated GPUs count per lease: no need)."""

    def __init__(self, inner: Verifier, shared: set[int], whose: str) -> None:
        self.inner = inner
        self.shared = shared
        self.whose = whose

    def begin(self, lease_: GpuLease, owner: int) -> None:
        self.inner.begin(lease_, owner)

    def end(self, lease_: GpuLease, others: Iterable[int] = (), peaks: Mapping[int, int] | None = None) -> Verdict:
        kept = tuple(i for i in lease_.indices if i not in self.shared)
        verdict = self.inner.end(replace(lease_, indices=kept), {*others, *self.shared}, peaks)
        verdict.measured = False
        verdict.notes.append(
            f"{numbered('GPU', sorted(self.shared))} shared with {self.whose} in this process: peak and "
            "leftovers there are not told apart (NVML and torch count per process)"
        )
        return verdict
