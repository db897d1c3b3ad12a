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

import functools
import os
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Protocol

from .. import sim
from ..leasing.requests import format_size
from ..report.wording import numbered
from . import runtime
from .devices import Inventory, addressable
from .isolation import GpuLease


@dataclass
class Verdict:
    """What one test used, and what it did wrong."""

    peak: dict[int, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what could not be checked, and why
    measured: bool = True  # False: the peaks are unknown (not zero)

    def merge(self, other: Verdict) -> None:
        self.measured = self.measured and other.measured
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
    *,
    whence: dict[int, str] | None = None,
) -> Verdict:
    """Pure rule: turn measured usage into a verdict for ``lease``; ``others``: GPUs other
    leases of the same test held (theirs to judge); ``whence``: how a GPU outside the lease
    was reached, where it is known (``"cuda:0 from another thread"``)."""
    verdict = Verdict(peak={i: peak.get(i, 0) for i in lease.indices})
    leased = set(lease.indices)
    shared = set(others) - leased
    outside = sorted(set(touched) - leased - shared)
    if outside:
        how = whence or {}
        used = ", ".join(
            f"GPU {i} ({format_size(peak[i]) + ' at peak' if peak.get(i) else 'a CUDA context'}"
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
            verdict.violations.append(
                f"still holds {format_size(current[index])} on GPU {index} after the test "
                "(a leaked allocation, or a subprocess still running)"
            )
    return verdict


THREAD_ADVICE = (
    "a thread's current device is its own (cuda:0 until it chooses one); a thread that uses the GPU "
    "must call torch.cuda.set_device(lease.device) first, or work inside `with torch.cuda.device(lease.device):`"
)


def threads_outside(usage: sim.TagUsage, lease: GpuLease, confined: int) -> dict[int, str]:
    """GPUs outside ``lease`` that a thread of this process other than ``confined`` (the thread
    the lease confined) touched, named as that thread's CUDA saw them: ``"cuda:0 from another
    thread (Thread-1)"``. The ledger records the thread of each call; real NVML cannot."""
    from ..sim import cuda as sim_cuda

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
# warm rank pool, the run's Ray head): their GPU usage is their holder's, never the test's.
_CLAIMED: dict[int, str] = {}


def claim_processes(pids: Iterable[int], holder: str) -> None:
    """Say that ``pids`` (and their descendants) answer to ``holder``, not to the test that
    happens to run while they live; :func:`release_processes` when they end."""
    for pid in pids:
        _CLAIMED[int(pid)] = holder


def release_processes(pids: Iterable[int]) -> None:
    """``pids`` ended (or were handed back): forget their holder."""
    for pid in pids:
        _CLAIMED.pop(int(pid), None)


def claimed() -> dict[int, str]:
    """pid -> holder of the long-lived processes another holding answers for."""
    return dict(_CLAIMED)


@functools.cache
def _version_problem() -> str:
    """Why the installed nvidia-ml-py's process lists cannot be trusted ("": they can); read once."""
    from .nvmlversion import nvml_version_problem

    return nvml_version_problem() or ""


def _mismatch(pynvml: ModuleType) -> type[Exception]:
    found = getattr(pynvml, "NVMLLibraryMismatchError", None)
    return found if isinstance(found, type) and issubclass(found, Exception) else pynvml.NVMLError


def torch_peak(cuda: ModuleType, ordinal: int) -> int:
    """torch's peak on ``ordinal``, read as the lease's cap counts it.

    - Native caching allocator (the default): ``max_memory_reserved``. The fraction cap
      counts reserved segments (``total_allocated_memory + alloc_size <= allowed``), and a
      cached block is memory the lease holds.
    - ``backend:cudaMallocAsync``: ``max_memory_allocated`` (the pool's ``UsedMemHigh``).
      The fraction caps ``pytorch_used_bytes`` only, and the pool keeps freed memory
      reserved (release threshold ``UINT64_MAX``) until ``empty_cache``:
      ``max_memory_reserved`` (``ReservedMemHigh``) can pass the cap with no allocation ever
      refused (c10/cuda/CUDAMallocAsyncAllocator.cpp: ``mallocAsync``, ``setMemoryFraction``,
      ``getDeviceStats``).
    - ``expandable_segments:True``: ``max_memory_allocated``. ``alloc_block`` checks the
      fraction against the reserve plus the request *before* ``map_block`` maps whole pages
      (20 MiB in the large pool), so the reserve can end up to a page above the cap while
      every allocation fitted (c10/cuda/CUDACachingAllocator.cpp: ``alloc_block``,
      ``try_allocate_expandable_block``, ``ExpandableSegment::map``).

    In the last two cases the peak is what the test's tensors held, not the physical memory
    the allocator reserved (NVML's figure, which can be higher). The allocator's
    configuration is read from ``PYTORCH_ALLOC_CONF``/``PYTORCH_CUDA_ALLOC_CONF`` as torch
    reads it at start (a later ``torch.cuda.memory._set_allocator_settings`` is not seen).
    Checked against the torch double (:mod:`pytest_gpu.sim.torch_cuda`), not on a real GPU.
    """
    backend = getattr(cuda, "get_allocator_backend", lambda: "native")()
    raw = os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or ""
    settings = dict(item.strip().partition(":")[::2] for item in raw.split(",") if item.strip())
    if backend == "cudaMallocAsync" or settings.get("expandable_segments", "").strip().lower() == "true":
        return int(cuda.max_memory_allocated(ordinal))
    return int(cuda.max_memory_reserved(ordinal))


class Verifier(Protocol):
    """What checks a lease: :class:`SimVerifier`, :class:`NvmlVerifier`, :class:`SharedVerifier`."""

    def begin(self, lease: GpuLease, owner: int) -> None: ...

    def end(self, lease: GpuLease, others: Iterable[int] = ()) -> Verdict: ...


class SimVerifier:
    """Reads the simulated ledger; the tag is set in the environment by the lease.

    The ledger records which thread made each call: a GPU outside the lease reached from a
    thread other than the one that began the lease (the test's) is named as such."""

    def __init__(self) -> None:
        self._thread = threading.get_ident()

    def begin(self, lease: GpuLease, owner: int) -> None:
        self._thread = threading.get_ident()  # the test's thread, which the lease confined
        sim.ledger().begin_tag(lease.env[sim.TAG_ENV], owner)

    def end(self, lease: GpuLease, others: Iterable[int] = ()) -> Verdict:
        usage = sim.ledger().tag_usage(lease.env[sim.TAG_ENV], drop=True)
        whence = threads_outside(usage, lease, self._thread)
        return judge(lease, usage.peak, usage.current, usage.touched, others, whence=whence)


class NvmlVerifier:
    """Real GPUs: NVML per-process usage of this process tree, torch counters if loaded.

    Runs in CI against the fake ``libnvidia-ml.so.1`` and the torch double; not run on a
    real GPU by the author. The worker's own CUDA context is accounted by the broker, so
    usage on a GPU is compared with what the process tree had there at setup.
    """

    def __init__(self, inventory: Inventory, overhead: int) -> None:
        self.inventory = inventory
        self.overhead = overhead
        self._baseline: dict[int, int] = {}
        self._torch_base: dict[int, int] = {}
        self._notes: list[str] = []
        self._unmeasured: set[int] = set()
        self._untrusted = _version_problem()  # its process lists are scrambled: measure nothing from them

    def _usage(self) -> tuple[dict[int, int], dict[int, int]] | None:
        """Bytes NVML reports per GPU for this process and for its children; ``None`` (and a
        note) when it cannot tell."""
        import psutil
        import pynvml

        if self._untrusted:
            self._give_up(self._untrusted)
            return None
        me = psutil.Process()
        children = {child.pid for child in me.children(recursive=True)}
        mine: dict[int, int] = {}
        theirs: dict[int, int] = {}
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            self._give_up(f"NVML unavailable ({exc}): memory outside the lease was not checked")
            return None
        try:
            foreign: set[int] = set()
            for device in addressable(self.inventory.machine or self.inventory.devices):
                try:
                    handle = pynvml.nvmlDeviceGetHandleByUUID(device.uuid)
                    procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                except (pynvml.NVMLError, _mismatch(pynvml)) as exc:
                    # MIG without privileges: NoPermission; a driver older than the bindings:
                    # nvidia-ml-py raises its library-mismatch error (not an NVMLError)
                    self._note(f"NVML cannot list processes on GPU {device.index} ({exc}): not checked there")
                    self._unmeasured.add(device.index)
                    continue
                for proc in procs:
                    if proc.pid == me.pid or proc.pid in children:
                        if proc.usedGpuMemory is None:  # "not available": unknown, not zero
                            self._note(f"NVML does not say how much memory processes use on GPU {device.index}")
                            self._unmeasured.add(device.index)
                            continue
                        into = mine if proc.pid == me.pid else theirs
                        into[device.index] = into.get(device.index, 0) + int(proc.usedGpuMemory)
                    elif not psutil.pid_exists(proc.pid):
                        foreign.add(proc.pid)
            if foreign and not mine and not theirs:
                # NVML reports host pids; in a container's pid namespace none of them is ours
                self._give_up(
                    f"NVML reports processes ({', '.join(map(str, sorted(foreign)[:3]))}) that do not exist in this "
                    "pid namespace (a container?): memory outside the lease was not checked"
                )
                return None
        finally:
            pynvml.nvmlShutdown()
        return mine, theirs

    def _give_up(self, why: str) -> None:
        """Nothing NVML says can be attributed to this test: note why, mark every GPU unmeasured."""
        self._note(why)
        self._unmeasured.update(d.index for d in self.inventory.devices)

    def _note(self, text: str) -> None:
        if text not in self._notes:
            self._notes.append(text)

    def _torch(self) -> ModuleType | None:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            return torch
        return None

    def begin(self, lease: GpuLease, owner: int) -> None:
        usage = self._usage()
        self._baseline = usage[0] if usage is not None else {}
        torch = self._torch()
        ordinals = runtime.in_process(self.inventory, lease.indices)
        if torch is not None and ordinals is not None:
            self._torch_base = {i: torch.cuda.memory_allocated(o) for i, o in zip(lease.indices, ordinals, strict=True)}

    def end(self, lease: GpuLease, others: Iterable[int] = ()) -> Verdict:
        usage = self._usage()
        touched: list[int] = []
        peak = {i: 0 for i in lease.indices}
        torch = self._torch()
        ordinals = runtime.in_process(self.inventory, lease.indices)
        if usage is not None:
            mine, theirs = usage
            # (a) this process on a GPU outside the lease: any growth, a new context included
            touched = [i for i in mine if mine[i] > self._baseline.get(i, 0)]
            touched += [i for i in theirs if theirs[i] > 0 and i not in touched]
            for i in lease.indices:
                # subprocesses still alive count whole (their contexts too); this process's
                # growth counts where torch cannot say (its context grows as CUDA loads modules)
                own = 0
                if torch is None:
                    own = mine.get(i, 0) - self._baseline.get(i, 0)
                    if self._baseline.get(i, 0) == 0:
                        own -= self.overhead  # the process opened its context here during the test
                peak[i] = max(own, 0) + theirs.get(i, 0)
        current: dict[int, int] = {}
        if torch is not None and ordinals is not None:
            for index, ordinal in zip(lease.indices, ordinals, strict=True):
                peak[index] = max(peak[index], torch_peak(torch.cuda, ordinal))
                left = torch.cuda.memory_allocated(ordinal) - self._torch_base.get(index, 0)
                if left > 0:
                    current[index] = left
        grew = [i for i in touched if i in usage[0]] if usage is not None else []
        whence = _cuda0_whence(self.inventory, lease, grew)
        verdict = judge(lease, peak, current, touched, others, whence=whence)
        verdict.notes.extend(self._notes)
        verdict.measured = torch is not None or not (self._unmeasured & set(lease.indices))
        return verdict


def _cuda0_whence(inventory: Inventory, lease: GpuLease, grew: list[int]) -> dict[int, str]:
    """Real GPUs: NVML reports per process, not per thread. Where this process grew on its own
    cuda:0 outside the lease, say what that may be (a thread left on its default device) and
    that it cannot be told. Runs against the fake NVML; not run on a real GPU here."""
    view = runtime.view(inventory)
    if not view or view[0] in lease.indices or view[0] not in grew:
        return {}
    return {view[0]: "this process's cuda:0: perhaps from another thread, which NVML cannot tell apart"}


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

    def end(self, lease_: GpuLease, others: Iterable[int] = ()) -> Verdict:
        kept = tuple(i for i in lease_.indices if i not in self.shared)
        verdict = self.inner.end(replace(lease_, indices=kept), {*others, *self.shared})
        verdict.measured = False
        verdict.notes.append(
            f"{numbered('GPU', sorted(self.shared))} shared with {self.whose} in this process: peak and "
            "leftovers there are not told apart (NVML and torch count per process)"
        )
        return verdict
