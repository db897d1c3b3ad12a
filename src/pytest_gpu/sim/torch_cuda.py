"""``torch.cuda`` for torch's CPU build, with the semantics of torch 2.13 on a CUDA 12 machine.

:func:`install` gives ``torch._C`` the ``_cuda_*`` bindings a CUDA build of torch has
(and the few ``torch.cuda`` names bound from them at import), backed by the simulated
runtime :mod:`pytest_gpu.sim.cuda` and the cross-process ledger. ``torch.cuda``'s own
Python code then runs unchanged: ``is_available``, ``device_count``, ``init``,
``set_device``, ``device``, ``current_device``, ``synchronize``, ``mem_get_info``,
``get_device_properties``/``get_device_name``, ``set_per_process_memory_fraction``,
``memory_allocated``/``memory_reserved``/``max_*``, ``memory_stats``,
``reset_peak_memory_stats``, ``empty_cache``, ``manual_seed_all``. What the bindings model,
after torch's C++ (c10/cuda/CUDAFunctions.cpp, c10/cuda/CUDACachingAllocator.cpp,
torch/csrc/cuda/Module.cpp):

- ``is_available()`` is ``cudaGetDeviceCount() > 0``: it initialises the driver, which
  fixes the process's device list (no context), while ``is_initialized()`` stays False.
- ``device_count()`` before torch's lazy init counts through NVML and the *current*
  ``CUDA_VISIBLE_DEVICES`` (torch's own parser; NVML answers from the ledger's machine);
  after it, the driver's count, cached.
- Lazy init sizes the caching allocator's per-device table to the driver's count
  ("Allocator not initialized for device N: did you call init?" beyond it) and fails
  with "No CUDA GPUs are available" when the list is empty.
- Current device as c10 keeps it under CUDA 12, per host thread (CUDA's current device and
  c10's ``thread_local targetDeviceIndex``, c10/cuda/CUDAFunctions.cpp): a thread a test
  starts is on ordinal 0 until it calls ``set_device``. ``set_device`` always calls
  ``cudaSetDevice`` (opens the primary context); device guards (``torch.cuda.device``,
  :func:`empty` with a device) switch with ``cudaSetDevice`` on entry and on exit only
  *record* the previous device when it has no context, so none is opened there.
- ``set_per_process_memory_fraction`` (torch >= 2.10) only sets the allocator's cap,
  fraction x ``totalGlobalMem`` (= ``mem_get_info`` total: the device total less the
  driver's reserve; 1.0 = no cap): no device switch, no context. Torch < 2.10 made the
  device current (opening its context), read ``cudaMemGetInfo`` and did not switch back
  (c10/cuda/CUDACachingAllocator.cpp at pytorch/pytorch 001074d: ``C10_CUDA_CHECK(
  c10::cuda::SetDevice(device))`` in ``setMemoryFraction``):
  ``install(torch, legacy_memory_fraction=True)`` models that instead, and so does every
  process on fake GPUs under ``PYTEST_GPU_SIM_TORCH=2.9`` (:data:`TORCH_VERSION_ENV`).
- The caching allocator: sizes round up to 512 bytes; requests up to 1 MiB come from
  2 MiB segments, up to 10 MiB from 20 MiB segments, larger ones from segments rounded
  to 2 MiB; best-fit reuse, splitting and merging of cached blocks; a freed block stays
  reserved until ``empty_cache()``; a segment that would pass the fraction cap or does
  not fit in the device (or in this process's pytest-gpu lease cap) makes torch free every
  unused cached segment and retry once, then raise ``torch.OutOfMemoryError`` with
  torch's message. ``reset_peak_memory_stats`` sets every peak to its current value.
- ``PYTORCH_ALLOC_CONF``/``PYTORCH_CUDA_ALLOC_CONF`` (read as torch reads them:
  ``backend`` when torch is installed, the rest at lazy init): ``expandable_segments:True``
  grows one segment per pool in 2 MiB (small) or 20 MiB (large) pages; the fraction is
  checked against the reserve plus the request *before* the pages are mapped, so the
  reserve can end up to a page above the cap (c10/cuda/CUDACachingAllocator.cpp:
  ``alloc_block``, ``map_block``, ``ExpandableSegment::map``, ``release_blocks``).
  ``backend:cudaMallocAsync`` is :class:`_AsyncAllocator`: the cap counts bytes in use,
  the pool keeps what was freed (c10/cuda/CUDAMallocAsyncAllocator.cpp). The pytest-gpu
  lease cap of :mod:`pytest_gpu.sim.cuda` does not apply to these reservations (torch's
  cap judged them; the hardware has no other). Other keys are ignored.
- Everything reaches the ledger (segments as allocations, contexts), so NVML sees it.
- A fork after the driver was touched poisons the child, as torch's fork handler does.
- After a sticky CUDA error (:func:`pytest_gpu.sim.poison`: a device-side assert, an
  illegal address) every binding that reaches the driver (``synchronize``,
  ``empty_cache``, ``set_device``, device switches, allocations, ``mem_get_info``) raises
  ``torch.AcceleratorError`` with ``C10_CUDA_CHECK``'s message, as torch 2.13 does
  (c10/cuda/CUDAException.cpp), for each of CUDA's sticky errors; the statistics, which are
  host-side, still answer. A hung kernel (:func:`pytest_gpu.sim.hang`) blocks ``synchronize``.

Tensors on the simulated GPUs (``torch.ones(n, device="cuda")``, ``x.to("cuda:1")``, every
op on them) are host tensors charged through this allocator: :mod:`pytest_gpu.sim.torch_tensors`,
which :func:`install` installs. :func:`empty` stands for ``torch.empty(nbytes,
dtype=torch.uint8, device=...)`` without the host's bytes and returns a :class:`Block` whose
memory goes back to the cache on :meth:`Block.free` or when it is garbage-collected. The
allocator has torch's mutex: a block freed while another thread (or the garbage collector,
inside an allocation) holds it is freed by the holder. State is per process; :func:`reset`
forgets it (tests of the double only).

What a context gains on a kernel's or library's first use (:func:`launch`, :func:`matmul`,
:func:`convolution`): lazily loaded modules, cuBLAS's and cuDNN's state, local memory that never
shrinks, all in the ledger as the process's context (NVML sees them, torch counts none), and
cuBLAS's workspace per stream in torch's allocator until ``_cuda_clearCublasWorkspaces``.

Left out: streams as objects, events and CUDA graphs (one allocator stream per device; a
stream is a number to :func:`matmul`; ``_cuda_getCurrentRawStream``
answers the default stream, 0, for torch._dynamo's import), the other allocator settings
(max_split_size, rounding divisions, garbage collection, ``_set_allocator_settings`` at run
time), ``memory_snapshot``, memory pools, ``caching_allocator_alloc``, peer access, and CUDA
kernels (the CPU computes what tensors on the simulated GPUs hold).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, NoReturn

from ..base.importhook import waiting
from ..base.requests import parse_size
from . import cuda as sim_cuda
from . import torch_tensors, zes
from .ledger import STATE_FILE, TAG_ENV, OutOfMemoryError, SimDeviceError, ledger

__all__ = ["Block", "empty", "install", "reset"]

__tracebackhide__ = sim_cuda.hidden_in_tracebacks  # an OOM shows the test's line, as torch's (from C++) does

KiB, MiB = 2**10, 2**20
MIN_BLOCK = 512  # kMinBlockSize: every size rounds up to a multiple of it
SMALL_SIZE = 1 * MiB  # kSmallSize: largest request served from the small pool
SMALL_BUFFER = 2 * MiB  # kSmallBuffer: segment size of the small pool
LARGE_BUFFER = 20 * MiB  # kLargeBuffer: segment for requests between 1 MiB and 10 MiB
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc: from here segments are the request rounded up
ROUND_LARGE = 2 * MiB  # kRoundLarge
ONE_EXABYTE = 2**60
_STAT_ARRAYS = (
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
)
_COUNTERS = (
    "num_alloc_retries",
    "num_ooms",
    "num_sync_all_streams",
    "num_device_alloc",
    "num_device_free",
    "num_oom_rejections",
)
_CUDA_CHECK_TAIL = (
    "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace "
    "below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"
)


# -- allocator statistics (c10::CachingDeviceAllocator::Stat) ---------------------------------


@dataclass
class _Stat:
    current: int = 0
    peak: int = 0
    allocated: int = 0
    freed: int = 0

    def increase(self, amount: int) -> None:
        self.current += amount
        self.peak = max(self.peak, self.current)
        self.allocated += amount

    def decrease(self, amount: int) -> None:
        self.current -= amount
        self.freed += amount

    def as_dict(self) -> dict[str, int]:
        return {"current": self.current, "peak": self.peak, "allocated": self.allocated, "freed": self.freed}


@dataclass
class _Stats:
    arrays: dict[str, dict[str, _Stat]] = field(
        default_factory=lambda: {
            name: {k: _Stat() for k in ("all", "small_pool", "large_pool")} for name in _STAT_ARRAYS
        }
    )
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_COUNTERS, 0))
    oversize_allocations: _Stat = field(default_factory=_Stat)
    oversize_segments: _Stat = field(default_factory=_Stat)

    def change(self, name: str, small: bool, amount: int) -> None:
        """Add ``amount`` (negative: remove) to stat ``name`` in "all" and in the block's pool."""
        array = self.arrays[name]  # (every tensor's allocation and free comes here: kept lean)
        for stat in (array["all"], array["small_pool" if small else "large_pool"]):
            stat.current += amount
            if amount >= 0:
                stat.allocated += amount
                if stat.current > stat.peak:
                    stat.peak = stat.current
            else:
                stat.freed -= amount

    def current(self, name: str) -> int:
        return self.arrays[name]["all"].current

    def stats(self) -> Iterator[_Stat]:
        for array in self.arrays.values():
            yield from array.values()
        yield self.oversize_allocations
        yield self.oversize_segments

    def as_dict(self) -> dict[str, Any]:
        """What ``torch._C._cuda_memoryStats`` returns (``torch.cuda.memory_stats`` flattens it)."""
        result: dict[str, Any] = {k: self.counters[k] for k in _COUNTERS}
        result["max_split_size"] = -1  # SIZE_MAX cast to int64: splitting is never limited
        for name, array in self.arrays.items():
            result[name] = {key: stat.as_dict() for key, stat in array.items()}
        result["oversize_allocations"] = self.oversize_allocations.as_dict()
        result["oversize_segments"] = self.oversize_segments.as_dict()
        result["reserved_bytes_by_private_pools"] = {}
        return result


# -- the caching allocator of one device (DeviceCachingAllocator) -----------------------------


class _CacheBlock:
    """A block of a segment (one ``cudaMalloc``: a ledger allocation), allocated or cached;
    ``prev``/``next`` are its neighbours in the segment."""

    def __init__(self, size: int, ptr: int, small: bool, segment: sim_cuda.Allocation) -> None:
        self.size = size
        self.ptr = ptr
        self.small = small
        self.segment = segment
        self.allocated = False
        self.requested = 0
        self.prev: _CacheBlock | None = None
        self.next: _CacheBlock | None = None

    @property
    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


def _round_size(size: int) -> int:
    return MIN_BLOCK if size < MIN_BLOCK else MIN_BLOCK * -(-size // MIN_BLOCK)


def _allocation_size(size: int) -> int:
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * -(-size // ROUND_LARGE)


def _torch_size(nbytes: int) -> str:
    """c10's ``format_size``, as torch's messages print sizes."""
    if nbytes <= KiB:
        return f"{nbytes} bytes"
    if nbytes <= MiB:
        return f"{nbytes / KiB:.2f} KiB"
    if nbytes <= 2**30:
        return f"{nbytes / MiB:.2f} MiB"
    return f"{nbytes / 2**30:.2f} GiB"


class _DeviceAllocator:
    """The caching allocator of one ordinal, one stream."""

    def __init__(self, ordinal: int) -> None:
        self.ordinal = ordinal
        self.stats = _Stats()
        self.pools: dict[bool, list[_CacheBlock]] = {True: [], False: []}  # small? -> cached blocks
        self.reserved = 0  # total_allocated_memory: bytes of live segments
        self.allowed: int | None = None  # allowed_memory_maximum, from the memory fraction
        self.alive = True  # False once reset() dropped it: its blocks are gone
        self.segments: dict[bool, _Expandable] = {}  # small? -> its expandable segment (expandable_segments:True)

    def total_global_mem(self) -> int:
        """``cudaDeviceProp.totalGlobalMem`` (read without a context)."""
        unit = sim_cuda.properties(self.ordinal)
        return unit.total - unit.reserved

    def malloc(self, orig_size: int) -> Any:
        size = _round_size(orig_size)
        small = size <= SMALL_SIZE
        alloc_size = _allocation_size(size)
        if _proc.expandable:
            return self._malloc_expandable(size, orig_size, small, alloc_size)
        block = self._get_free_block(size, small)
        cause: OutOfMemoryError | None = None
        if block is None:
            block, cause = self._alloc_block(alloc_size, small, retry=False)
        if block is None:
            # cudaMalloc failed: give every unused cached segment back and try once more
            self.release_cached_blocks()
            block, cause = self._alloc_block(alloc_size, small, retry=True)
        if block is None:
            self._out_of_memory(alloc_size, cause)
        remaining = block.size - size
        split = remaining >= MIN_BLOCK if small else remaining > SMALL_SIZE
        return self._alloc_found_block(block, size, orig_size, split)

    def _malloc_expandable(self, size: int, orig_size: int, small: bool, alloc_size: int) -> _XBlock:
        """``expandable_segments:True``: one growing segment per pool. ``alloc_block`` checks the
        fraction against ``total_allocated_memory + alloc_size`` *before* mapping, then maps
        whole pages (20 MiB in the large pool) at the lowest free address: the reserve can end
        up to a page past the cap while every allocation the cap judged fitted."""
        segment = self.segments.get(small)
        if segment is None:
            segment = self.segments[small] = _Expandable(self, small)
        block = segment.free_fit(size)
        for retry in (False, True):
            if block is not None:
                break
            if retry:  # mapping failed: unmap every free page, then try once more
                self.release_cached_blocks()
                self.stats.counters["num_alloc_retries"] += 1
            if self.allowed is None or self.reserved + alloc_size <= self.allowed:
                block = segment.find_and_map(size)
        if block is None:
            self._out_of_memory(alloc_size, None)
        block = segment.take(block, size, orig_size)
        self._count_allocated(block.size, orig_size, small)
        return block

    def _get_free_block(self, size: int, small: bool) -> _CacheBlock | None:
        fits = [b for b in self.pools[small] if b.size >= size]
        if not fits:
            return None
        best = min(fits, key=lambda b: (b.size, b.ptr))  # best fit, as the size-ordered std::set gives
        self.pools[small].remove(best)
        return best

    def _count_allocated(self, size: int, orig_size: int, small: bool) -> None:
        """The statistics of one block handed out (c10's ``malloc``: allocation, active, requested)."""
        for name, amount in (
            ("allocation", 1),
            ("allocated_bytes", size),
            ("active", 1),
            ("active_bytes", size),
            ("requested_bytes", orig_size),
        ):
            self.stats.change(name, small, amount)

    def _alloc_block(
        self, alloc_size: int, small: bool, *, retry: bool
    ) -> tuple[_CacheBlock | None, OutOfMemoryError | None]:
        if retry:
            self.stats.counters["num_alloc_retries"] += 1
        if self.allowed is not None and self.reserved + alloc_size > self.allowed:
            return None, None  # the fraction cap: no cudaMalloc is attempted
        try:
            allocation = sim_cuda.allocate(alloc_size, device=self.ordinal)
        except OutOfMemoryError as exc:  # cudaErrorMemoryAllocation (device full, or the lease's cap)
            return None, exc
        self.reserved += alloc_size
        block = _CacheBlock(alloc_size, _proc.next_address(alloc_size), small, allocation)
        self.stats.change("segment", small, 1)
        self.stats.change("reserved_bytes", small, alloc_size)
        self.stats.counters["num_device_alloc"] += 1
        return block, None

    def _alloc_found_block(self, block: _CacheBlock, size: int, orig_size: int, split: bool) -> _CacheBlock:
        already_split = block.is_split
        if split:
            remaining = block
            block = _CacheBlock(size, remaining.ptr, remaining.small, remaining.segment)
            block.prev = remaining.prev
            if block.prev is not None:
                block.prev.next = block
            block.next = remaining
            remaining.prev = block
            remaining.ptr += size
            remaining.size -= size
            self.pools[remaining.small].append(remaining)
            if already_split:
                self.stats.change("inactive_split_bytes", block.small, -block.size)
            else:
                self.stats.change("inactive_split_bytes", block.small, remaining.size)
                self.stats.change("inactive_split", block.small, 1)
        elif already_split:
            self.stats.change("inactive_split_bytes", block.small, -block.size)
            self.stats.change("inactive_split", block.small, -1)
        block.allocated = True
        block.requested = orig_size
        self._count_allocated(block.size, orig_size, block.small)
        return block

    def free(self, block: Any) -> None:
        """A tensor died: its block goes back to the cache (the segment stays reserved)."""
        if isinstance(block, _XBlock):
            for name, amount in (
                ("allocation", -1),
                ("allocated_bytes", -block.size),
                ("active", -1),
                ("active_bytes", -block.size),
                ("requested_bytes", -block.requested),
            ):
                self.stats.change(name, block.small, amount)
            self.segments[block.small].give_back(block)
            return
        block.allocated = False
        self.stats.change("allocation", block.small, -1)
        self.stats.change("allocated_bytes", block.small, -block.size)
        original, requested = block.size, block.requested
        net_blocks, net_size = 0, 0
        for neighbour in (block.prev, block.next):
            subsumed = self._try_merge(block, neighbour)
            if subsumed:
                net_blocks -= 1
                net_size -= subsumed
        self.pools[block.small].append(block)
        if block.is_split:
            net_blocks += 1
            net_size += block.size
        self.stats.change("inactive_split", block.small, net_blocks)
        self.stats.change("inactive_split_bytes", block.small, net_size)
        self.stats.change("active", block.small, -1)
        self.stats.change("active_bytes", block.small, -original)
        self.stats.change("requested_bytes", block.small, -requested)

    def _try_merge(self, dst: _CacheBlock, src: _CacheBlock | None) -> int:
        if src is None or src.allocated:
            return 0
        if dst.prev is src:
            dst.ptr = src.ptr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        self.pools[src.small].remove(src)
        return src.size

    def release_cached_blocks(self) -> None:
        """``emptyCache``: ``cudaFree`` every cached block that is a whole segment."""
        self.stats.counters["num_sync_all_streams"] += 1
        whole = [(small, b) for small in (False, True) for b in self.pools[small] if not b.is_split]
        sim_cuda.free_all([b.segment for _, b in whole])  # the driver's cudaFrees, one ledger write for them all
        for small, block in whole:
            self.pools[small].remove(block)
            self.reserved -= block.size
            self.stats.change("segment", small, -1)
            self.stats.change("reserved_bytes", small, -block.size)
            self.stats.counters["num_device_free"] += 1
        for segment in self.segments.values():
            segment.unmap_free_pages()

    def release_all(self) -> None:
        """Free every segment, in use or not (:func:`reset`)."""
        self.alive = False
        for expandable in self.segments.values():
            expandable.release_all()
        cached = [b for pool in self.pools.values() for b in pool]
        for segment in {b.segment for b in cached + _proc.live_blocks(self)}:
            segment.free()

    def set_fraction(self, fraction: float) -> None:
        if not 0 <= fraction <= 1:
            raise RuntimeError(f"invalid fraction:{fraction}. Please set within [0, 1].")
        if _settings.legacy_memory_fraction:
            # torch < 2.10: SetDevice(device) (never switched back), then cudaMemGetInfo,
            # which opens the device's context
            _set_device(self.ordinal, force=False)
            self.allowed = int(fraction * sim_cuda.mem_get_info(self.ordinal)[1])
            return
        self.allowed = None if fraction >= 1.0 else int(fraction * self.total_global_mem())

    def fraction(self) -> float:
        return 1.0 if self.allowed is None else self.allowed / self.total_global_mem()

    def _out_of_memory(self, alloc_size: int, cause: BaseException | None) -> NoReturn:
        free, total = sim_cuda.mem_get_info(self.ordinal)
        allowed = f"{_torch_size(self.allowed)} allowed; " if self.allowed is not None else ""
        self.stats.counters["num_ooms"] += 1
        allocated, reserved = self.stats.current("allocated_bytes"), self.stats.current("reserved_bytes")
        message = (
            f"{_settings.kind.upper()} out of memory. Tried to allocate {_torch_size(alloc_size)}. "
            f"GPU {self.ordinal} has a total capacity of {_torch_size(total)} of which {_torch_size(free)} is free. "
            f"{_process_memory_info(self.ordinal)}{allowed}Of the allocated memory {_torch_size(allocated)} is "
            f"allocated by PyTorch, and {_torch_size(reserved - allocated)} is reserved by PyTorch but unallocated."
            " If reserved but unallocated memory is large try setting"
            " PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for"
            " Memory Management "
            " (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)"
        )
        error = _require_torch().OutOfMemoryError(message)
        if cause is not None and free >= alloc_size:  # the device had room: the lease's cap refused it
            raise error from cause  # which torch's message cannot say; the simulator's does
        raise error from None  # as torch's, from C++: its message says it all


# -- PYTORCH_CUDA_ALLOC_CONF: expandable segments and the cudaMallocAsync backend ------------


def _alloc_conf() -> dict[str, str]:
    """``PYTORCH_ALLOC_CONF`` (torch >= 2.9), else ``PYTORCH_CUDA_ALLOC_CONF``: ``key:value,...``."""
    raw = os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or ""
    conf = {}
    for item in raw.split(","):
        key, _, value = item.strip().partition(":")
        if key:
            conf[key.strip()] = value.strip()
    return conf


class _XBlock:
    """A block of an expandable segment: ``[offset, offset + size)`` of its address space, all mapped."""

    def __init__(self, offset: int, size: int, small: bool) -> None:
        self.offset = offset
        self.size = size
        self.small = small
        self.allocated = False
        self.requested = 0

    @property
    def end(self) -> int:
        return self.offset + self.size


class _Expandable:
    """One expandable segment (c10's ``ExpandableSegment``, one stream): address space for
    1 1/8 of the device's memory, backed page by page (2 MiB pages for the small pool, 20 MiB
    for the large) as allocations need them. Each ``map`` is one ledger allocation; unmapping
    part of one gives it back and re-charges the pages kept."""

    def __init__(self, owner: _DeviceAllocator, small: bool) -> None:
        self.owner = owner
        self.small = small
        self.page = SMALL_BUFFER if small else LARGE_BUFFER
        total = owner.total_global_mem()
        self.max_pages = -(-(total + total // 8) // self.page)
        self.blocks: list[_XBlock] = []  # sorted by offset; they tile the mapped pages exactly
        self.runs: dict[int, tuple[sim_cuda.Allocation, set[int]]] = {}  # one per map: ledger charge, pages
        self.page_run: dict[int, int] = {}  # mapped page -> its run
        self.next_run = itertools.count()

    def free_fit(self, size: int) -> _XBlock | None:
        fits = [b for b in self.blocks if not b.allocated and b.size >= size]
        return min(fits, key=lambda b: (b.size, b.offset)) if fits else None

    def _room_at(self, start: int, size: int) -> bool:
        """Whether ``[start, start + size)`` holds only free blocks and unmapped pages."""
        if start + size > self.max_pages * self.page:
            return False
        return all(not b.allocated for b in self.blocks if b.offset < start + size and b.end > start)

    def find_and_map(self, size: int) -> _XBlock | None:
        """``try_allocate_expandable_block``: the lowest address where ``size`` fits in free and
        unmapped space; map its unmapped pages (rounded up to whole pages). ``None``: the
        device cannot back them (the ledger refused)."""
        mapped = self.page_run
        candidates = [p * self.page for p in range(self.max_pages) if p not in mapped and (p == 0 or p - 1 in mapped)]
        for start in candidates:
            before = next((b for b in self.blocks if b.end == start and not b.allocated), None)
            if before is not None:
                start = before.offset
            if self._room_at(start, size):
                break
        else:
            return None
        first, last = start // self.page, -(-(start + size) // self.page)
        pages = [p for p in range(first, last) if p not in self.page_run]
        if pages:
            try:
                charge = sim_cuda.allocate(len(pages) * self.page, device=self.owner.ordinal, capped=False)
            except OutOfMemoryError:
                return None
            run = next(self.next_run)
            self.runs[run] = (charge, set(pages))
            for p in pages:
                self.page_run[p] = run
                self.blocks.append(_XBlock(p * self.page, self.page, self.small))
            self.owner.reserved += len(pages) * self.page
            self.owner.stats.change("reserved_bytes", self.small, len(pages) * self.page)
            self.owner.stats.counters["num_device_alloc"] += 1
            self._merge_all()
        return next(b for b in self.blocks if b.offset <= start < b.end)

    def _merge_all(self) -> None:
        self.blocks.sort(key=lambda b: b.offset)
        merged: list[_XBlock] = []
        for block in self.blocks:
            last = merged[-1] if merged else None
            if last is not None and not last.allocated and not block.allocated and last.end == block.offset:
                last.size += block.size
            else:
                merged.append(block)
        self.blocks = merged

    def take(self, block: _XBlock, size: int, requested: int) -> _XBlock:
        """Hand out ``size`` bytes from the start of free ``block`` (the rest stays free)."""
        if block.size - size >= MIN_BLOCK:  # should_split: expandable segments split down to 512 bytes
            rest = _XBlock(block.offset + size, block.size - size, block.small)
            block.size = size
            self.blocks.insert(self.blocks.index(block) + 1, rest)
        block.allocated, block.requested = True, requested
        return block

    def give_back(self, block: _XBlock) -> None:
        block.allocated, block.requested = False, 0
        self._merge_all()

    def unmap_free_pages(self) -> None:
        """``release_blocks``/``unmap_block``: unmap every page no allocated block touches."""
        gone: set[int] = set()
        for block in [b for b in self.blocks if not b.allocated]:
            first, last = -(-block.offset // self.page), block.end // self.page
            gone.update(range(first, last))
        if not gone:
            return
        kept: list[_XBlock] = []
        for block in self.blocks:
            start, end = block.offset, block.end
            pieces = []
            cursor = start
            for p in sorted(q for q in gone if start <= q * self.page < end):
                if p * self.page > cursor:
                    pieces.append((cursor, p * self.page))
                cursor = (p + 1) * self.page
            if cursor < end:
                pieces.append((cursor, end))
            if len(pieces) == 1 and pieces[0] == (start, end):
                kept.append(block)
                continue
            for a, b in pieces:
                kept.append(_XBlock(a, b - a, self.small))
        self.blocks = kept
        for run, (charge, pages) in list(self.runs.items()):
            if pages & gone:
                charge.free()
                left = pages - gone
                del self.runs[run]
                if left:  # the pages kept stay charged (no new memory: this cannot fail for want of it)
                    again = sim_cuda.allocate(len(left) * self.page, device=self.owner.ordinal, capped=False)
                    self.runs[run] = (again, left)
        for p in gone:
            del self.page_run[p]
        self.owner.reserved -= len(gone) * self.page
        self.owner.stats.change("reserved_bytes", self.small, -len(gone) * self.page)
        self.owner.stats.counters["num_device_free"] += 1

    def release_all(self) -> None:
        for charge, _ in self.runs.values():
            charge.free()
        self.runs.clear()


class _AsyncBlock:
    """An allocation from the cudaMallocAsync pool: ``size`` bytes in ``chunk``."""

    def __init__(self, size: int, chunk: _PoolChunk) -> None:
        self.size = size
        self.chunk = chunk


@dataclass
class _PoolChunk:
    """Physical memory the driver's pool reserved (one ledger allocation) and what is live in it."""

    size: int
    charge: sim_cuda.Allocation
    live: int = 0


class _AsyncAllocator(_DeviceAllocator):
    """``backend:cudaMallocAsync`` (c10/cuda/CUDAMallocAsyncAllocator.cpp) on one device.

    - The device's default ``cudaMemPool_t`` has its release threshold at ``UINT64_MAX``: a
      freed allocation's memory stays reserved in the pool until ``empty_cache``
      (``cudaMemPoolTrimTo(pool, 0)``, here: every chunk nothing lives in).
    - ``set_per_process_memory_fraction`` makes the device current under a guard (its context
      opens), reads ``cudaMemGetInfo`` and sets ``pytorch_memory_limits[device] = fraction x
      total``; ``mallocAsync`` refuses ``pytorch_used_bytes + size`` above it with "Allocation
      on device N would exceed allowed memory". The limit counts the bytes asked for, not
      what the pool reserves: the pool may hold more than the limit.
    - Stats are the pool's attributes: ``allocated_bytes`` = ``UsedMemCurrent``/``UsedMemHigh``,
      ``reserved_bytes`` = ``ReservedMemCurrent``/``ReservedMemHigh``, in "all" only (every
      other stat stays 0); ``reset_peak_memory_stats`` resets both highs to the current values.

    The driver's pool itself is modelled simply: an allocation is served from a chunk with
    room enough for it (fragmentation inside a chunk is ignored), else the pool reserves a new
    chunk of the size rounded up to 2 MiB. A chunk the device cannot back raises at once (the
    driver's own trimming on failure is not modelled).
    """

    def __init__(self, ordinal: int) -> None:
        super().__init__(ordinal)
        self.chunks: list[_PoolChunk] = []
        self.used = 0  # pytorch_used_bytes
        self.limit: int | None = None  # pytorch_memory_limits (UINT64_MAX: None)

    def _stat(self, name: str, amount: int) -> None:
        stat = self.stats.arrays[name]["all"]
        if amount >= 0:
            stat.increase(amount)
        else:
            stat.decrease(-amount)

    def _async_out_of_memory(self, orig_size: int, limit: int | None) -> BaseException:
        """torch's out-of-memory error as the async allocator words it; ``limit``: the fraction's
        cap, when that is what refused."""
        free, total = sim_cuda.mem_get_info(self.ordinal)
        text = (
            f"Allocation on device {self.ordinal} would exceed allowed memory. (out of memory)"
            f"\nCurrently allocated     : {_torch_size(self.used)}"
            f"\nRequested               : {_torch_size(orig_size)}"
            f"\nDevice limit            : {_torch_size(total)}"
            f"\nFree (according to CUDA): {_torch_size(free)}"
        )
        if limit is not None:
            text += "\nPyTorch limit (set by user-supplied memory fraction)"
            text += f"\n                        : {_torch_size(limit)}"
        error: BaseException = _require_torch().OutOfMemoryError(text)
        return error

    def malloc(self, orig_size: int) -> Any:
        if self.limit is not None and self.used + orig_size > self.limit:
            raise self._async_out_of_memory(orig_size, self.limit)
        chunk = next((c for c in self.chunks if c.size - c.live >= orig_size), None)
        if chunk is None:
            size = ROUND_LARGE * -(-orig_size // ROUND_LARGE)
            try:
                charge = sim_cuda.allocate(size, device=self.ordinal, capped=False)
            except OutOfMemoryError:  # the device is full, as torch's message says
                self.stats.counters["num_ooms"] += 1
                raise self._async_out_of_memory(orig_size, None) from None
            chunk = _PoolChunk(size, charge)
            self.chunks.append(chunk)
            self.reserved += size
            self._stat("reserved_bytes", size)
        chunk.live += orig_size
        self.used += orig_size
        self._stat("allocated_bytes", orig_size)
        self._stat("active_bytes", orig_size)
        return _AsyncBlock(orig_size, chunk)

    def free(self, block: Any) -> None:
        block.chunk.live -= block.size
        self.used -= block.size
        self._stat("allocated_bytes", -block.size)
        self._stat("active_bytes", -block.size)

    def release_cached_blocks(self) -> None:
        for chunk in [c for c in self.chunks if c.live == 0]:
            self.chunks.remove(chunk)
            chunk.charge.free()
            self.reserved -= chunk.size
            self._stat("reserved_bytes", -chunk.size)

    def release_all(self) -> None:
        self.alive = False
        for chunk in self.chunks:
            chunk.charge.free()

    def set_fraction(self, fraction: float) -> None:
        if not 0 <= fraction <= 1:
            raise RuntimeError(f"invalid fraction:{fraction}. Please set within (0, 1).")
        with _device_guard(self.ordinal):  # CUDAGuard + lazy_init_device: the context opens here
            total = sim_cuda.mem_get_info(self.ordinal)[1]
        self.limit = int(fraction * total)

    def fraction(self) -> float:
        return 1.0 if self.limit is None else self.limit / self.total_global_mem()


def _process_memory_info(ordinal: int) -> str:
    """``reportProcessMemoryInfo``: each process on the device as NVML lists it (the ledger's state file)."""
    try:
        led = ledger()
        uuid = led.units()[sim_cuda.unit_of(ordinal)].uuid
        lines = (led.path / STATE_FILE).read_text().splitlines()
        offset = led.machine().pidns
    except OSError:
        return ""
    parts = []
    for line in lines:
        fields = line.split()
        if len(fields) == 4 and fields[0] == "proc" and fields[1] == uuid:
            pid = int(fields[2]) + offset  # NVML reports host pids
            who = "Including non-PyTorch memory, this process" if pid == os.getpid() else f"Process {pid}"
            parts.append(f"{who} has {_torch_size(int(fields[3]))} memory in use. ")
    return "".join(parts)


# -- process state ----------------------------------------------------------------------------


@dataclass
class _Process:
    allocators: list[_DeviceAllocator] = field(default_factory=list)  # sized at lazy init
    local: threading.local = field(default_factory=threading.local)  # .target, per thread
    poisoned: bool = False  # the driver was touched: a forked child cannot use CUDA
    bad_fork: bool = False
    address: int = 0x7F0000000000  # next segment's (fake) device address
    blocks: dict[int, tuple[_DeviceAllocator, _CacheBlock]] = field(default_factory=dict)  # live Blocks
    keys: Iterator[int] = field(default_factory=itertools.count)
    cached_count: int | None = None  # torch < 2.4's lru_cache'd device_count
    expandable: bool = False  # PYTORCH_CUDA_ALLOC_CONF's expandable_segments:True, read at lazy init
    loaded: set[tuple[int, str]] = field(default_factory=set)  # (unit, module or library) in the context
    local_memory: dict[int, int] = field(default_factory=dict)  # unit -> the context's local memory
    workspaces: dict[tuple[int, int], int] = field(default_factory=dict)  # (ordinal, stream) -> cuBLAS's block key

    def next_address(self, size: int) -> int:
        base = self.address
        self.address += size + SMALL_BUFFER
        return base

    def live_blocks(self, allocator: _DeviceAllocator) -> list[_CacheBlock]:
        return [b for a, b in self.blocks.values() if a is allocator]


@dataclass
class _Settings:
    torch: ModuleType | None = None
    legacy_memory_fraction: bool = False
    device_count: Callable[[], int] | None = None  # torch.cuda.device_count as this torch defines it
    backend: str = "native"  # PYTORCH_CUDA_ALLOC_CONF's backend, read when torch's CUDA library loads
    fork_handler: bool = False
    kind: str = "cuda"  # the device module the double serves: torch.cuda, or torch.xpu on Intel GPUs
    libraries: _Libraries | None = None  # behind matmul and convolution (set by install): CUDA's


class _Mutex:
    """The caching allocator's mutex. A tensor freed while it is held (by the garbage collector
    inside an allocation, or in another thread, from a destructor, which must not wait) is
    queued and freed by the holder before it lets go."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local = threading.local()  # .held: this thread holds the lock
        self._queued: list[int] = []

    def _held_here(self) -> bool:
        return bool(getattr(self._local, "held", False))

    def __enter__(self) -> None:
        self._lock.acquire()
        self._local.held = True

    def __exit__(self, *exc: object) -> None:
        try:
            while self._queued:
                self._release(self._queued.pop())
        finally:
            self._local.held = False
            self._lock.release()
        if self._queued and self._lock.acquire(blocking=False):  # queued while we let go
            self._local.held = True
            self.__exit__()

    def free(self, key: int, *, wait: bool) -> None:
        """Free a :class:`Block`'s memory now, or queue it for the holder of the lock."""
        if self._held_here() or not self._lock.acquire(blocking=wait):
            self._queued.append(key)
            return
        self._local.held = True
        try:
            self._release(key)
        finally:
            self.__exit__()

    @staticmethod
    def _release(key: int) -> None:
        entry = _proc.blocks.pop(key, None)
        if entry is not None and entry[0].alive:
            entry[0].free(entry[1])


_proc = _Process()
_settings = _Settings()
_mutex = _Mutex()


NOT_INSTALLED = (
    "pytest_gpu.sim.torch_cuda: torch has no simulated torch.cuda in this process. Run on simulated "
    "GPUs (pytest --gpus sim:4x16GiB, or PYTEST_GPU_FAKE_GPUS=sim:4x16GiB), where pytest-gpu gives "
    "torch's CPU build its simulated torch.cuda when torch is imported, or, outside pytest-gpu, "
    "call pytest_gpu.sim.torch_cuda.install(torch) after `import torch`"
)


def _require_torch() -> Any:
    if _settings.torch is None:
        _import_torch()
    if _settings.torch is None:
        raise RuntimeError(NOT_INSTALLED)
    return _settings.torch


def _import_torch() -> None:
    """On fake GPUs, this double's functions may come before the test's ``import torch``: import
    it here, and the fake-GPU switch (which waits for torch's import) installs the double as it
    does for the test's import."""
    if "torch" in sys.modules or not waiting("torch"):  # no switch waits to install it (or torch is a CUDA build)
        return
    try:
        import torch  # noqa: F401 - the switch's import hook installs the double
    except ImportError as exc:
        raise RuntimeError(
            f"pytest_gpu.sim.torch_cuda needs torch (its CPU build will do: pip install torch "
            f"--index-url https://download.pytorch.org/whl/cpu): {exc}"
        ) from None


def _device_lazy_init() -> None:
    """``torch::utils::device_lazy_init``: C++ entry points run torch.cuda's (torch.xpu's) Python lazy init."""
    getattr(_require_torch(), _settings.kind)._lazy_init()


def _cuda_error(what: str, help_line: str) -> Exception:
    """What ``C10_CUDA_CHECK`` raises for a failed runtime call."""
    message = f"CUDA error: {what}\n{help_line}\n{_CUDA_CHECK_TAIL}"
    error: Exception = _require_torch().AcceleratorError(message)  # torch is untyped here (Any)
    return error


_ERROR_HELP = (
    "Search for `{name}' in https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html "
    "for more information."
)


def _check_sticky() -> None:
    """``C10_CUDA_CHECK`` of a runtime call made after a sticky error (every call fails with it)."""
    error = sim_cuda.sticky_error()
    if error is not None:
        raise _cuda_error(error, _ERROR_HELP.format(name=sim_cuda.STICKY_ERRORS[error]))


def _unpack_index(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RuntimeError(f"invalid argument to {what}")
    return value


def _allocator(device: object, what: str) -> _DeviceAllocator:
    """``assertValidDevice``: the allocator table exists only after lazy init."""
    index = _unpack_index(device, what)
    if not 0 <= index < len(_proc.allocators):
        raise RuntimeError(f"Invalid device argument {index}: did you call init?")
    return _proc.allocators[index]


# -- the CUDA runtime as c10 drives it (c10/cuda/CUDAFunctions.cpp, CUDA >= 12) -----------------


def _raw_get_device() -> int:
    """``cudaGetDevice``."""
    return sim_cuda.current_device()


def _raw_set_device(ordinal: int) -> None:
    """``cudaSetDevice``: since CUDA 12 it opens the device's primary context."""
    _check_sticky()
    try:
        sim_cuda.set_device(ordinal)
    except SimDeviceError as exc:
        raise _cuda_error("invalid device ordinal", "GPU device may be out of range, do you have enough GPUs?") from exc


def _has_primary_context(ordinal: int) -> bool:
    return sim_cuda.has_context(sim_cuda.unit_of(ordinal))  # contexts live until the process exits


def _target() -> int:
    """c10's ``thread_local targetDeviceIndex`` (CUDA >= 12): a device a guard's exit recorded
    instead of setting it, this thread's; -1 when none."""
    target: int = getattr(_proc.local, "target", -1)
    return target


def _get_device() -> int:
    target = _target()
    return target if target >= 0 else _raw_get_device()


def _set_device(ordinal: int, *, force: bool) -> None:
    if ordinal < 0:
        raise RuntimeError(f"device id must be non-negative!{ordinal}")
    _proc.local.target = -1
    if force or ordinal != _raw_get_device():
        _raw_set_device(ordinal)


def _maybe_set_device(ordinal: int) -> None:
    """A guard's exit: switch back only to a device that has a context, else just record it."""
    if _has_primary_context(ordinal):
        _set_device(ordinal, force=False)
    else:
        _proc.local.target = ordinal


def _exchange_device(to: int) -> int:
    current, _proc.local.target = _target(), -1
    if current < 0:
        current = _raw_get_device()
        if to == current:
            return current
    _raw_set_device(to)
    return current


def _maybe_exchange_device(to: int) -> int:
    current = _raw_get_device()
    if to == current:
        return current
    if _has_primary_context(to):
        _raw_set_device(to)
    else:
        _proc.local.target = to
    return current


@contextmanager
def _device_guard(index: int) -> Iterator[None]:
    """``c10::cuda::CUDAGuard``."""
    previous = _exchange_device(index) if index >= 0 else _get_device()
    try:
        yield
    finally:
        _maybe_set_device(previous)


# -- torch._C bindings (torch/csrc/cuda/Module.cpp) ------------------------------------------


def _c_get_device_count() -> int:
    _proc.poisoned = True
    return sim_cuda.device_count()


def _c_init() -> None:
    torch = _require_torch()
    _proc.poisoned = True
    count = sim_cuda.device_count()
    if count == 0:
        raise RuntimeError("No CUDA GPUs are available")
    _proc.expandable = _alloc_conf().get("expandable_segments", "").lower() == "true"
    kind = _AsyncAllocator if _settings.backend == "cudaMallocAsync" else _DeviceAllocator
    while len(_proc.allocators) < count:
        _proc.allocators.append(kind(len(_proc.allocators)))
    # CPU generators stand in for the per-device CUDA ones (seeds queued before init land here)
    torch.cuda.default_generators = tuple(torch.Generator() for _ in range(count))
    torch.cuda._get_device_properties = _get_device_properties


def _c_set_device(device: object) -> None:
    index = _unpack_index(device, "setDevice")
    _device_lazy_init()
    _set_device(index, force=True)  # torch.cuda.set_device always creates the context (torch >= 2.8)


def _c_get_device() -> int:
    _device_lazy_init()
    return _get_device()


def _c_exchange_device(device: object) -> int:
    index = _unpack_index(device, "exchangeDevice")
    if index < 0:
        return -1
    _device_lazy_init()
    return _exchange_device(index)


def _c_maybe_exchange_device(device: object) -> int:
    index = _unpack_index(device, "exchangeDevice")
    if index < 0:
        return -1
    _device_lazy_init()
    return _maybe_exchange_device(index)


def _c_has_primary_context(device: object) -> bool:
    index = _unpack_index(device, "has_primary_context")
    if not 0 <= index < sim_cuda.device_count():
        raise RuntimeError(f"hasPrimaryContext expects a valid device index, but got device_index={index}")
    return _has_primary_context(index)


def _c_synchronize() -> None:
    _check_sticky()
    sim_cuda.wait_for_kernels()  # cudaDeviceSynchronize: a hung kernel blocks it for ever
    _raw_set_device(_raw_get_device())  # cudaDeviceSynchronize needs (and opens) the current context


def _c_empty_cache(*_mempool: object) -> None:
    _check_sticky()  # emptyCache synchronizes and cudaFrees: the memory stays held
    with _mutex:
        for allocator in _proc.allocators:
            allocator.release_cached_blocks()


def _c_memory_stats(device: object) -> dict[str, Any]:
    return _allocator(device, "memory_allocated").stats.as_dict()


def _c_reset_peak_memory_stats(device: object) -> None:
    for stat in _allocator(device, "reset_peak_memory_stats").stats.stats():
        stat.peak = stat.current


def _c_reset_accumulated_memory_stats(device: object) -> None:
    stats = _allocator(device, "reset_accumulated_memory_stats").stats
    for stat in stats.stats():
        stat.allocated = stat.freed = 0
    stats.counters = dict.fromkeys(_COUNTERS, 0)


def _table_entry(device: object) -> _DeviceAllocator:
    index = _unpack_index(device, "set_memory_fraction")
    if not 0 <= index < len(_proc.allocators):
        raise RuntimeError(f"Allocator not initialized for device {index}: did you call init?")
    return _proc.allocators[index]


def _c_set_memory_fraction(fraction: float, device: object) -> None:
    _table_entry(device).set_fraction(float(fraction))


def _c_get_memory_fraction(device: object) -> float:
    return _table_entry(device).fraction()


def _c_is_in_bad_fork() -> bool:
    return _proc.bad_fork


def _after_fork_in_child() -> None:
    if _proc.poisoned:
        _proc.bad_fork = True


@dataclass(frozen=True)
class _DeviceProperties:
    """``torch._C._CudaDeviceProperties`` of a simulated device."""

    name: str
    total_memory: int
    uuid: str
    major: int = 8
    minor: int = 0
    multi_processor_count: int = 108
    is_integrated: bool = False
    is_multi_gpu_board: bool = False
    max_threads_per_multi_processor: int = 2048
    warp_size: int = 32
    regs_per_multiprocessor: int = 65536
    L2_cache_size: int = 40 * MiB

    @property
    def gcnArchName(self) -> str:  # torch's attribute name
        return self.name

    def __repr__(self) -> str:
        return (
            f"_CudaDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, "
            f"total_memory={self.total_memory // MiB}MB, multi_processor_count={self.multi_processor_count}, "
            f"uuid={self.uuid}, L2_cache_size={self.L2_cache_size // MiB}MB)"
        )


def _get_device_properties(device: int) -> _DeviceProperties:
    """``cudaGetDeviceProperties`` (no context); totalGlobalMem excludes the driver's reserve."""
    count = sim_cuda.device_count()
    if not 0 <= device < count:
        raise RuntimeError(f"device={device}, num_gpus={count}")
    unit = sim_cuda.properties(device)
    uuid = unit.uuid.split("-", 1)[1]  # printed without the GPU-/MIG- prefix, as torch does
    return _DeviceProperties(name=unit.name, total_memory=unit.total - unit.reserved, uuid=uuid)


class _Cudart:
    """The ``torch.cuda.cudart()`` binding the double provides: ``cudaMemGetInfo``."""

    def cudaMemGetInfo(self, device: int) -> tuple[int, int]:  # the binding's name
        _check_sticky()
        with _device_guard(device):
            return sim_cuda.mem_get_info(_raw_get_device())


def _legacy_device_count() -> int:
    """torch 2.0-2.3's ``torch.cuda.device_count``, ``@lru_cache(maxsize=1)``::

    nvml_count = _device_count_nvml()
    return torch._C._cuda_getDeviceCount() if nvml_count < 0 else nvml_count
    """
    if _proc.cached_count is None:
        cuda = _require_torch().cuda
        nvml_count = int(cuda._device_count_nvml())
        _proc.cached_count = _c_get_device_count() if nvml_count < 0 else nvml_count
    return _proc.cached_count


def _nvml_device_count() -> int:
    """``nvmlDeviceGetCount_v2``: every physical GPU, MIG-mode and faulted ones included."""
    return len(ledger().machine().gpus)


def _nvml_device_uuids() -> list[str] | None:
    """torch's ``_raw_device_uuid_nvml``: None (with torch's warning) when NVML refuses a handle."""
    gpus = ledger().machine().gpus
    if any(gpu.fault != "none" for gpu in gpus):
        warnings.warn("Can't get device handle", stacklevel=2)
        return None
    return [gpu.uuid for gpu in gpus]


_C_BINDINGS: dict[str, Callable[..., Any]] = {
    "_cuda_getDeviceCount": _c_get_device_count,
    "_cuda_init": _c_init,
    "_cuda_setDevice": _c_set_device,
    "_cuda_getDevice": _c_get_device,
    "_cuda_exchangeDevice": _c_exchange_device,
    "_cuda_maybeExchangeDevice": _c_maybe_exchange_device,
    "_cuda_hasPrimaryContext": _c_has_primary_context,
    "_cuda_isInBadFork": _c_is_in_bad_fork,
    "_cuda_getArchFlags": lambda: None,
    "_cuda_synchronize": _c_synchronize,
    "_cuda_emptyCache": _c_empty_cache,
    "_cuda_memoryStats": _c_memory_stats,
    "_cuda_resetPeakMemoryStats": _c_reset_peak_memory_stats,
    "_cuda_resetAccumulatedMemoryStats": _c_reset_accumulated_memory_stats,
    "_cuda_setMemoryFraction": _c_set_memory_fraction,
    "_cuda_getMemoryFraction": _c_get_memory_fraction,
    "_cuda_getAllocatorBackend": lambda: _settings.backend,
    "_cuda_ipc_collect": lambda: None,
    # the default stream's handle (NULL): torch._dynamo imports it from a build with CUDA
    "_cuda_getCurrentRawStream": lambda device: 0,
}


# -- public API ---------------------------------------------------------------------------------


#: ``torch.version.hip`` of torch on a fake AMD machine (torch reads its first and third characters).
HIP_VERSION = "6.4.43484-fake"


def install(
    torch: ModuleType,
    *,
    legacy_memory_fraction: bool = False,
    legacy_device_count: bool = False,
    rocm: ModuleType | None = None,
) -> None:
    """Give ``torch.cuda`` of torch's CPU build the simulated GPUs (idempotent).

    ``rocm``: the ``amdsmi`` package of a fake AMD machine. torch then is a ROCm build, as far
    as its Python side can tell: ``torch.version.hip`` is set, and ``device_count`` takes
    torch's own ROCm path, ``_device_count_amdsmi`` (``ROCR_VISIBLE_DEVICES`` first, then
    ``HIP_VISIBLE_DEVICES`` or ``CUDA_VISIBLE_DEVICES``, by torch's ``_parse_visible_devices``,
    whose rules are not HIP's: an empty value hides all, a repeat empties the list), asking
    amdsmi, which the fake ``libamd_smi.so`` answers. Once CUDA has started, the count is the
    simulated HIP's (:func:`pytest_gpu.vendors.amd.rocm_view`), as torch's is HIP's then.

    ``legacy_memory_fraction=True`` models torch < 2.10, whose
    ``set_per_process_memory_fraction(f, d)`` made ``d`` the current device (opening its
    context) and never switched back.

    ``legacy_device_count=True`` models torch 2.0 to 2.3, whose ``device_count`` was
    ``@lru_cache(maxsize=1)``: NVML's count through the ``CUDA_VISIBLE_DEVICES`` of its
    *first* call (torch's own ``_device_count_nvml``; ``cudaGetDeviceCount`` when NVML fails),
    kept for the life of the process whether or not CUDA had started (pytorch/pytorch#122815,
    in torch 2.4, caches it only once CUDA is initialised). ``get_device_properties``,
    ``get_device_name`` and ``can_device_access_peer`` assert ``device < device_count()``
    against it; ``torch.cuda._get_device_properties`` (defined by lazy init) checks the
    driver's count. Refuses a torch built with CUDA.

    Tensors asked for on "cuda" then live on the simulated GPUs
    (:func:`pytest_gpu.sim.torch_tensors.install`).
    """
    binding = getattr(torch._C, "_cuda_getDeviceCount", None)
    if binding is not None and binding is not _c_get_device_count:
        raise RuntimeError("pytest_gpu.sim.torch_cuda.install: this torch has real CUDA support; it needs no double")
    _settings.torch = torch
    _settings.legacy_memory_fraction = legacy_memory_fraction
    _settings.backend = "cudaMallocAsync" if _alloc_conf().get("backend") == "cudaMallocAsync" else "native"
    if _settings.device_count is None:
        _settings.device_count = torch.cuda.device_count  # this torch's own
    torch.cuda.device_count = _legacy_device_count if legacy_device_count else _settings.device_count
    for name, function in _C_BINDINGS.items():
        setattr(torch._C, name, function)
    cuda = torch.cuda
    # names torch.cuda bound from torch._C (or to CPU-build fallbacks) when it was imported
    cuda._exchange_device = _c_exchange_device
    cuda._maybe_exchange_device = _c_maybe_exchange_device
    cuda._is_in_bad_fork = _c_is_in_bad_fork
    cuda._cudart = _Cudart()
    cuda._CudaDeviceProperties = _DeviceProperties
    # NVML as the fake libnvidia-ml reports it, whether or not that library is loadable here
    cuda._raw_device_count_nvml = _nvml_device_count
    cuda._raw_device_uuid_nvml = _nvml_device_uuids
    _settings.libraries = ROCM_LIBRARIES if rocm is not None else CUDA_LIBRARIES
    if rocm is not None:  # torch on ROCm counts through amdsmi (its CPU build imported pynvml instead)
        torch.version.hip = HIP_VERSION
        cuda.amdsmi = rocm
        cuda._HAS_AMDSMI = True
    if not _settings.fork_handler:
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _settings.fork_handler = True
    torch_tensors.install(torch, "cuda", empty)


# -- torch.xpu (torch/csrc/xpu/Module.cpp, c10/xpu/XPUFunctions.h) -------------------------------


def _check_xpu_index(device: object) -> int:
    """c10::xpu's ``check_device_index``."""
    index = _unpack_index(device, "setDevice")
    count = sim_cuda.device_count()
    if not 0 <= index < count:
        raise RuntimeError(f"device is out of range, device is {index}, total number of device is {count}.")
    return index


def _x_init() -> None:
    torch = _require_torch()
    _proc.poisoned = True
    # torch's SYCL runtime starts Level Zero here: the fake loader's driver reads ZE_AFFINITY_MASK and
    # ZES_ENABLE_SYSMAN now (legacy Sysman starts if it is set and no zesInit came first)
    zes.start_runtime()
    count = sim_cuda.device_count()
    if count == 0:
        raise RuntimeError("No XPU devices are available.")
    while len(_proc.allocators) < count:
        _proc.allocators.append(_DeviceAllocator(len(_proc.allocators)))
    torch.xpu.default_generators = tuple(torch.Generator() for _ in range(count))
    torch.xpu._get_device_properties = _x_get_device_properties


def _x_set_device(device: object) -> None:
    _device_lazy_init()
    _set_device(_check_xpu_index(device), force=True)


def _x_get_device_properties(device: int) -> _DeviceProperties:
    index = _check_xpu_index(device)
    unit = sim_cuda.properties(index)
    return _DeviceProperties(name=unit.name, total_memory=unit.total - unit.reserved, uuid=unit.uuid)


def _x_memory_info(device: object) -> tuple[int, int]:
    index = _check_xpu_index(device)
    _check_sticky()
    with _device_guard(index):
        return sim_cuda.mem_get_info(_raw_get_device())


_XPU_BINDINGS: dict[str, Callable[..., Any]] = {
    "_xpu_getDeviceCount": _c_get_device_count,
    "_xpu_init": _x_init,
    "_xpu_setDevice": _x_set_device,
    "_xpu_getDevice": _c_get_device,
    "_xpu_exchangeDevice": _c_exchange_device,
    "_xpu_maybeExchangeDevice": _c_maybe_exchange_device,
    "_xpu_isInBadFork": _c_is_in_bad_fork,
    "_xpu_getArchFlags": lambda: None,
    "_xpu_synchronize": lambda device=None: _c_synchronize(),
    "_xpu_emptyCache": _c_empty_cache,
    "_xpu_memoryStats": _c_memory_stats,
    "_xpu_resetPeakMemoryStats": _c_reset_peak_memory_stats,
    "_xpu_resetAccumulatedMemoryStats": _c_reset_accumulated_memory_stats,
    "_xpu_setMemoryFraction": _c_set_memory_fraction,
    "_xpu_getMemoryFraction": _c_get_memory_fraction,
    "_xpu_getMemoryInfo": _x_memory_info,
    "_xpu_getCurrentRawStream": lambda device: 0,  # as _cuda_getCurrentRawStream
}


#: The torch release the double models on fake GPUs (``2.9``, ``2.13.0``; default: torch 2.13's
#: behaviour). Before 2.10, ``set_per_process_memory_fraction`` moves the current device.
TORCH_VERSION_ENV = "PYTEST_GPU_SIM_TORCH"
LEGACY_FRACTION_BEFORE = (2, 10)


def modelled_torch() -> tuple[int, int]:
    """(major, minor) of :data:`TORCH_VERSION_ENV`; ValueError names it when it is not a version."""
    raw = os.environ.get(TORCH_VERSION_ENV, "").strip()
    if not raw:
        return (2, 13)
    parts = raw.split(".")
    if len(parts) < 2 or not all(p.isdigit() for p in parts[:2]):
        raise ValueError(f"{TORCH_VERSION_ENV}={raw!r}: expected a torch version such as 2.9 or 2.13.0")
    return int(parts[0]), int(parts[1])


def install_for(torch: ModuleType, device_kind: str, *, rocm: ModuleType | None = None) -> None:
    """Give torch's device module for ``device_kind`` (a vendor's
    :attr:`~pytest_gpu.vendors.kinds.Kind.device_kind`: ``torch.cuda`` or ``torch.xpu``) the
    simulated GPUs: :func:`install` (``rocm``: torch on ROCm) or :func:`install_xpu`; as the
    torch release :data:`TORCH_VERSION_ENV` names behaves."""
    older = modelled_torch() < LEGACY_FRACTION_BEFORE
    if device_kind != "cuda":
        install_xpu(torch)
    elif older:
        install(torch, rocm=rocm, legacy_memory_fraction=True)
    elif rocm is None:
        install(torch)
    else:  # a fake AMD machine: torch on ROCm
        install(torch, rocm=rocm)


#: The torch version whose torch.xpu API is modelled (``2.9``: before 2.10); unset, the installed torch's.
XPU_TORCH_VAR = "PYTEST_GPU_SIM_XPU_TORCH"
#: torch.xpu's memory fraction API, which arrived in torch 2.10 (pytorch#165510, #165511).
_XPU_FRACTION_API = ("set_per_process_memory_fraction", "get_per_process_memory_fraction")
_xpu_removed: dict[tuple[str, str], Any] = {}  # (module, name) -> what an older torch lacks, to put back


def _xpu_api_before(version: str) -> bool:
    """Whether ``version`` (``PYTEST_GPU_SIM_XPU_TORCH``) is a torch before 2.10; :class:`ValueError`
    if it is no version."""
    try:
        major, minor = (int(part) for part in version.strip().split(".")[:2])
    except ValueError:
        raise ValueError(f"{XPU_TORCH_VAR}={version!r}: expected a torch version such as 2.9") from None
    return (major, minor) < (2, 10)


def _model_xpu_version(torch: ModuleType, fraction_api: bool) -> None:
    """Take torch.xpu's memory fraction API away (torch < 2.10: no ``_xpu_setMemoryFraction`` in
    torch/csrc/xpu/Module.cpp, no Python function), or put back what was taken."""
    modules = {"torch.xpu": torch.xpu, "torch.xpu.memory": torch.xpu.memory, "torch._C": torch._C}
    if fraction_api:
        for (module, name), value in list(_xpu_removed.items()):
            setattr(modules[module], name, value)
            del _xpu_removed[(module, name)]
        return
    names = {"torch.xpu": _XPU_FRACTION_API, "torch.xpu.memory": _XPU_FRACTION_API}
    names["torch._C"] = ("_xpu_setMemoryFraction", "_xpu_getMemoryFraction")
    for module, listed in names.items():
        for name in listed:
            if hasattr(modules[module], name):
                _xpu_removed[(module, name)] = getattr(modules[module], name)
                delattr(modules[module], name)


def install_xpu(torch: ModuleType, *, fraction_api: bool | None = None) -> None:
    """Give ``torch.xpu`` of torch's CPU build the simulated GPUs of a fake Intel machine (idempotent).

    ``fraction_api=False`` (or ``PYTEST_GPU_SIM_XPU_TORCH=2.9`` when not given) models torch before
    2.10, whose torch.xpu has no ``set_per_process_memory_fraction`` (pytorch#165510).

    ``torch._C`` gets the ``_xpu_*`` bindings an XPU build has (torch/csrc/xpu/Module.cpp), so
    torch.xpu's own Python code (torch 2.13: ``torch/xpu/__init__.py``, ``torch/xpu/memory.py``)
    runs unchanged over the same simulated runtime and caching allocator as :func:`install`'s
    ``torch.cuda``: ``device_count`` (Sysman's count through torch's ``pyzes`` when that is
    installed, else ``_xpu_getDeviceCount``, the simulated runtime's, which honours
    ``ZE_AFFINITY_MASK``), ``set_device`` and ``get_device_properties`` (c10::xpu's
    ``check_device_index``: "device is out of range, device is N, total number of device is
    M."), ``current_device``, ``memory_allocated``/``reserved``, ``max_memory_allocated``,
    ``reset_peak_memory_stats``, ``set_per_process_memory_fraction``, ``empty_cache``,
    ``mem_get_info``. Out-of-memory errors say "XPU out of memory". ``torch.cuda`` stays the
    CPU build's (no CUDA on an Intel machine). Left out: streams, events, memory snapshots
    and pools, custom allocators. Refuses a torch built with XPU support. Tensors asked for on
    "xpu" live on the simulated GPUs (:func:`pytest_gpu.sim.torch_tensors.install`).
    """
    binding = getattr(torch._C, "_xpu_getDeviceCount", None)
    if getattr(torch._C, "_has_xpu", False) and binding is not _c_get_device_count:
        raise RuntimeError("pytest_gpu.sim.torch_cuda.install_xpu: this torch has real XPU support; it needs no double")
    _settings.torch = torch
    _settings.kind = "xpu"
    _settings.libraries = XPU_LIBRARIES
    _settings.backend = "native"
    for name, function in _XPU_BINDINGS.items():
        setattr(torch._C, name, function)
    torch._C._has_xpu = True
    xpu = torch.xpu
    # names torch.xpu bound from torch._C (or to CPU-build dummies) when it was imported
    xpu._exchange_device = _c_exchange_device
    xpu._maybe_exchange_device = _c_maybe_exchange_device
    xpu._is_in_bad_fork = _c_is_in_bad_fork
    xpu._XpuDeviceProperties = _DeviceProperties
    if not _settings.fork_handler:
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _settings.fork_handler = True
    torch_tensors.install(torch, "xpu", empty)
    if fraction_api is None:
        fraction_api = not _xpu_api_before(os.environ.get(XPU_TORCH_VAR) or "2.13")
    _model_xpu_version(torch, fraction_api)


def reset() -> None:
    """Forget this process's CUDA state, as if it were a new process (tests of the double only).

    Frees every segment the allocator holds (live :class:`Block` objects become inert) and
    the simulated runtime's state (:func:`pytest_gpu.sim.cuda.forget`); torch.cuda is
    uninitialised again. Contexts already opened stay in the ledger until the process exits.
    """
    global _proc
    sim_cuda.clear_sticky()  # a new process starts without the old one's sticky error
    with _mutex:
        for allocator in _proc.allocators:
            allocator.release_all()
        _proc = _Process()
    sim_cuda.forget()
    if _settings.torch is not None:
        cuda = getattr(_settings.torch, _settings.kind)  # torch.cuda, or torch.xpu on a fake Intel machine
        cuda._initialized = False
        cuda._cached_device_count = None
        cuda.default_generators = ()
        cuda.__dict__.pop("_get_device_properties", None)


class Block:
    """Device memory from the simulated caching allocator: what a CUDA tensor's storage holds.

    Freed (back to torch's cache, still reserved) by :meth:`free`, or when the object is
    garbage-collected, like a tensor. ``nbytes`` is what was asked for, ``size`` what the
    allocator handed out (rounded up to 512 bytes), ``device`` the ordinal and ``physical``
    the ledger unit (a plain GPU's NVML index).
    """

    def __init__(self, nbytes: int, device: int, key: int | None, size: int) -> None:
        self.nbytes = nbytes
        self.device = device
        self.physical = sim_cuda.unit_of(device)
        self.size = size
        self._key = key
        self._pid = os.getpid()

    @property
    def freed(self) -> bool:
        return self._key is None or self._key not in _proc.blocks

    def free(self) -> None:
        """Return the memory to the cache (idempotent; a no-op in a forked child or after :func:`reset`)."""
        self._free(wait=True)

    def _free(self, *, wait: bool) -> None:
        key, self._key = self._key, None
        if key is None or os.getpid() != self._pid:
            return  # a forked child cannot free its parent's memory
        _mutex.free(key, wait=wait)

    def __del__(self) -> None:
        if sys.is_finalizing():
            return  # the process is going: the ledger frees its memory with it
        with contextlib.suppress(Exception):  # a destructor must not raise; the ledger prunes the dead
            self._free(wait=False)

    def __repr__(self) -> str:
        state = "freed" if self.freed else "live"
        return f"<sim Block {self.nbytes} bytes on {_settings.kind}:{self.device} (GPU {self.physical}) {state}>"


def _index_of(device: int | str | Any, what: str) -> int | None:
    """The ordinal ``device`` names (``None``: the current device), as torch parses it."""
    torch = _require_torch()
    index: int | None
    if isinstance(device, int) and not isinstance(device, bool):
        index = device
    elif device is None:
        index = None
    else:
        parsed = torch.device(device)
        if parsed.type != _settings.kind:
            raise ValueError(f"{what}: expected a {_settings.kind.upper()} device, got {device!r}")
        index = parsed.index
    if index is not None and index < 0:
        raise ValueError(f"{what}: device index must not be negative, got {index}")
    return index


def empty(nbytes: int | str, device: int | str | Any = None) -> Block:
    """``torch.empty(nbytes, dtype=torch.uint8, device=device)`` on a simulated GPU.

    ``device``: None (the current device), an ordinal, ``"cuda"``/``"cuda:N"`` or a
    ``torch.device``. As torch does, this initialises CUDA lazily and allocates under a
    device guard: the target device becomes current (opening its context) and the
    previous one is restored on exit without opening a context there. Raises
    ``torch.OutOfMemoryError`` when neither the cache nor a new segment can serve it.
    """
    torch = _require_torch()
    size = parse_size(nbytes)
    if size >= ONE_EXABYTE:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate more than 1EB memory.")
    index = _index_of(device, "empty")
    _device_lazy_init()
    if index is None:
        index = _get_device()
    with _device_guard(index):
        ordinal = _get_device()
        if size == 0:
            return Block(0, ordinal, None, 0)  # no allocation, so no context
        if not 0 <= ordinal < len(_proc.allocators):
            raise RuntimeError(f"Allocator not initialized for device {ordinal}: did you call init?")
        _check_sticky()  # the allocator's event queries and cudaMalloc fail with it
        allocator = _proc.allocators[ordinal]
        with _mutex:
            block = allocator.malloc(size)
            key = next(_proc.keys)
            _proc.blocks[key] = (allocator, block)
        return Block(size, ordinal, key, block.size)


# -- what a context gains when a kernel or library is first used --------------------------------
#
# The context NVML reports for a process is not the one it opened: CUDA loads each kernel's module
# on its first launch (CUDA_MODULE_LOADING=LAZY: the default since CUDA 12.2, and what torch sets
# when it is unset since torch 1.13), cuBLAS and cuDNN load their kernels and allocate their
# handles' device state on first use, and the local memory a kernel needs grows the context's to
# that size for good (the deprecated CU_CTX_LMEM_RESIZE_TO_MAX is the behaviour since CUDA 11).
# None of it is an allocation of torch's, none is freed by ``empty_cache``, all of it stays until
# the process exits. torch keeps one cuBLAS workspace per (handle, stream) in its own caching
# allocator (aten/src/ATen/cuda/CublasHandlePool.cpp: ``cublas_handle_stream_to_workspace``),
# allocated (``memory_allocated`` counts it) until ``torch._C._cuda_clearCublasWorkspaces()``.
# The sizes below are of the order seen on CUDA 12 with lazy loading; what matters is that each
# first use grows the process's NVML figure and nothing torch counts.
#
# The same holds on the other vendors, whose drivers count a process's code objects, library
# state and scratch memory in its per-process figure as NVIDIA's does (amdsmi's ``vram_mem``, from
# fdinfo's drm-memory-vram; Sysman's ``zes_process_state_t.memSize``). torch on ROCm is torch.cuda:
# HIP loads a kernel's code object on first launch, hipBLAS/hipBLASLt (rocBLAS) and MIOpen stand
# for cuBLAS and cuDNN, and torch keeps a per-stream workspace of its own default size
# (CublasHandlePool.cpp's ``parseChosenWorkspaceSize``: :data:`HIPBLAS_WORKSPACE`; hipBLASLt's
# separate 76 MiB one is not modelled). torch.xpu runs matmul and
# convolution through oneDNN, which JIT-compiles its GPU kernels into Level Zero modules on a
# primitive's first use; its scratchpad is an ordinary tensor freed when the call returns
# (aten/src/ATen/native/mkldnn/xpu/detail/Matmul.cpp: ``scratchpad_mode::user``, ``at::empty``),
# so no workspace outlives the call there. The sizes stay the CUDA magnitudes on every vendor:
# typical orders, not measurements.

KERNEL_MODULE = 2 * MiB  # one lazily loaded module of torch's kernels
CUBLAS_CONTEXT = 48 * MiB  # cuBLAS (and cuBLASLt): its kernels' modules and the handle's state
CUDNN_CONTEXT = 96 * MiB  # cuDNN: its kernels' modules and the handle's state
CUBLAS_WORKSPACE = 4096 * KiB * 2 + 16 * KiB * 8  # CUBLAS_WORKSPACE_CONFIG's default, :4096:2:16:8
HIPBLAS_WORKSPACE = 32 * MiB  # torch on ROCm's default (HIPBLAS_WORKSPACE_CONFIG; 128 MiB on gfx94x/gfx95x)


@dataclass(frozen=True)
class _Libraries:
    """The libraries behind a device module's matmul and convolution (see :func:`matmul`)."""

    blas: str  # their modules' names in the context
    dnn: str
    workspace: int  # the per-stream workspace torch keeps for ``blas`` in its allocator (0: none)


CUDA_LIBRARIES = _Libraries("cublas", "cudnn", CUBLAS_WORKSPACE)
ROCM_LIBRARIES = _Libraries("hipblas", "miopen", HIPBLAS_WORKSPACE)
XPU_LIBRARIES = _Libraries("onednn:matmul", "onednn:convolution", 0)  # oneDNN's scratchpad dies with the call


def _grow(ordinal: int, module: str, nbytes: int) -> None:
    """The context on ``ordinal`` loads ``module`` (``nbytes``) unless it already has."""
    unit = sim_cuda.unit_of(ordinal)
    if (unit, module) in _proc.loaded:
        return
    _check_sticky()
    ledger().grow_context(unit, nbytes, os.environ.get(TAG_ENV), thread=sim_cuda.thread_label())
    _proc.loaded.add((unit, module))


@contextmanager
def _on(device: int | str | Any, what: str) -> Iterator[int]:
    """Work on ``device`` as an operator does: lazy init, then a device guard; yields the ordinal."""
    index = _index_of(device, what)
    _device_lazy_init()
    with _device_guard(_get_device() if index is None else index):
        yield _get_device()


def launch(kernel: str, device: int | str | Any = None, *, local_memory: int | str = 0) -> None:
    """A launch of ``kernel`` (any name: one module per name) on ``device`` (default: the current
    one): its first launch in this process loads its module into the context
    (:data:`KERNEL_MODULE`); ``local_memory``: the local memory the launch needs on the device,
    to which the context's grows, never to shrink."""
    need = parse_size(local_memory) if local_memory else 0
    with _on(device, "launch") as ordinal:
        _grow(ordinal, f"kernel:{kernel}", KERNEL_MODULE)
        unit = sim_cuda.unit_of(ordinal)
        have = _proc.local_memory.get(unit, 0)
        if need > have:
            _check_sticky()
            ledger().grow_context(unit, need - have, os.environ.get(TAG_ENV), thread=sim_cuda.thread_label())
            _proc.local_memory[unit] = need


def matmul(device: int | str | Any = None, stream: int = 0) -> None:
    """A cuBLAS call (``torch.mm``, ``@``, ``F.linear``; hipBLAS on ROCm) on ``stream`` (0: the
    default stream; any other number: another stream) of ``device``: the first on a device loads
    cuBLAS and creates its handle (:data:`CUBLAS_CONTEXT`); the first on each stream takes a
    workspace of :data:`CUBLAS_WORKSPACE` from torch's caching allocator, allocated until
    ``torch._C._cuda_clearCublasWorkspaces()`` (``empty_cache`` alone keeps it); on ROCm the
    workspace is :data:`HIPBLAS_WORKSPACE`. On torch.xpu:
    oneDNN's matmul, whose first use on a device JIT-compiles its kernels into the context
    (:data:`CUBLAS_CONTEXT`'s magnitude) and which keeps no workspace."""
    if isinstance(stream, bool) or not isinstance(stream, int) or stream < 0:
        raise ValueError(f"matmul: expected a stream number >= 0, got {stream!r}")
    with _on(device, "matmul") as ordinal:
        libraries = _settings.libraries or CUDA_LIBRARIES
        _grow(ordinal, libraries.blas, CUBLAS_CONTEXT)
        if not libraries.workspace or (ordinal, stream) in _proc.workspaces:
            return
        allocator = _proc.allocators[ordinal]
        with _mutex:
            block = allocator.malloc(libraries.workspace)
            key = next(_proc.keys)
            _proc.blocks[key] = (allocator, block)
        _proc.workspaces[(ordinal, stream)] = key


def convolution(device: int | str | Any = None) -> None:
    """A cuDNN call (``torch.nn.functional.conv2d`` on a GPU; MIOpen on ROCm, oneDNN's
    convolution on torch.xpu): the first on a device loads the library, or compiles its kernels,
    and creates its handle (:data:`CUDNN_CONTEXT`)."""
    with _on(device, "convolution") as ordinal:
        _grow(ordinal, (_settings.libraries or CUDA_LIBRARIES).dnn, CUDNN_CONTEXT)


def _c_clear_cublas_workspaces() -> None:
    """``torch._C._cuda_clearCublasWorkspaces``: every workspace goes back to torch's cache
    (still reserved until ``empty_cache``)."""
    keys = list(_proc.workspaces.values())
    _proc.workspaces.clear()
    for key in keys:
        _mutex.free(key, wait=True)


_C_BINDINGS["_cuda_clearCublasWorkspaces"] = _c_clear_cublas_workspaces
