"""torch's allocator counters on one device, read once and as the lease's cap counts them.

Each of torch's ``memory_allocated``, ``memory_reserved``, ``max_memory_*`` flattens the whole
nested statistics dict anew (torch/cuda/memory.py): a fraction of a millisecond apiece,
several times per GPU test. Read here once per device, by the adapters and the verifiers.
Also the allocator's caps on several devices (:func:`set_fractions`), set without moving the
process's current device.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType


def set_fractions(cuda: ModuleType, fractions: Mapping[int, float]) -> None:
    """``cuda.set_per_process_memory_fraction(f, ordinal)`` for each ordinal, leaving the calling
    thread's current device where it was.

    torch before 2.10 made each device current in ``setMemoryFraction`` and left it there
    (``C10_CUDA_CHECK(c10::cuda::SetDevice(device))``, c10/cuda/CUDACachingAllocator.cpp at
    pytorch/pytorch 001074d): after a loop over several GPUs a body's ``.cuda()`` landed on the
    last one. The way back is ``_maybe_exchange_device``, which switches only to a device that
    has a context and otherwise records it as c10's target (so none is opened there); a torch
    without it is switched back with ``set_device``. Also from a callback of torch's lazy init.
    """
    if not fractions:
        return
    previous = cuda.current_device()
    try:
        for ordinal, fraction in fractions.items():
            cuda.set_per_process_memory_fraction(fraction, ordinal)
    finally:
        if cuda.current_device() != previous:
            back = getattr(cuda, "_maybe_exchange_device", None)
            if back is not None:
                back(previous)
            else:
                cuda.set_device(previous)


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
    return torch_counters(cuda, ordinal).peak


@dataclass(frozen=True)
class TorchCounters:
    """torch's allocator counters on one device, read at once."""

    allocated: int  # memory_allocated
    reserved: int  # memory_reserved
    peak: int  # as the lease's cap counts it: see torch_peak
    capped: int = 0  # what the memory fraction is checked against now: the reserve (allocated under cudaMallocAsync)


def torch_counters(cuda: ModuleType, ordinal: int) -> TorchCounters:
    """One read of torch's statistics (each of ``memory_allocated``, ``max_memory_reserved``
    ... flattens the whole nested statistics dict anew: a fraction of a millisecond apiece,
    several per GPU test), read as those functions read it (torch/cuda/memory.py: the keys
    ``allocated_bytes.all.current`` and so on of ``memory_stats``, which flattens
    ``memory_stats_as_nested_dict``)."""
    nested = getattr(cuda, "memory_stats_as_nested_dict", None)
    if nested is not None:  # what memory_stats flattens, key by key, on every call: read it unflattened
        tree = nested(ordinal)
        stats = {
            f"{name}.all.{kind}": tree.get(name, {}).get("all", {}).get(kind, 0)
            for name in ("allocated_bytes", "reserved_bytes")
            for kind in ("current", "peak")
        }
    else:
        stats = cuda.memory_stats(ordinal)
    backend = getattr(cuda, "get_allocator_backend", lambda: "native")()
    raw = os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or ""
    settings = dict(item.strip().partition(":")[::2] for item in raw.split(",") if item.strip())
    pool = backend == "cudaMallocAsync"
    used = pool or settings.get("expandable_segments", "").strip().lower() == "true"
    allocated = int(stats.get("allocated_bytes.all.current", 0))
    reserved = int(stats.get("reserved_bytes.all.current", 0))
    return TorchCounters(
        allocated=allocated,
        reserved=reserved,
        peak=int(stats.get("allocated_bytes.all.peak" if used else "reserved_bytes.all.peak", 0)),
        capped=allocated if pool else reserved,
    )
