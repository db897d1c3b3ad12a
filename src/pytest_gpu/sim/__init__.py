"""Simulated GPUs as strict as real ones: the test doubles pytest-gpu is tested against.

- :mod:`.spec`: the fake machine a spec such as ``sim:4x16GiB;mig:0=2x8GiB`` describes;
- :mod:`.ledger`: device memory shared by every process (the "physics"), rendered for NVML;
  one ledger per simulated machine (:func:`machine_ledger`), shared by every run that names it;
- :mod:`.cuda`: a process's CUDA runtime (device list fixed at first use, current device per thread,
  contexts, allocations) — the public API below comes from here;
- :mod:`.nvml`: a fake ``libnvidia-ml.so.1`` built from C and loaded by nvidia-ml-py;
- :mod:`.torch_cuda`: ``torch.cuda`` of torch's CPU build given these semantics;
- :mod:`.torch_tensors`: tensors on the simulated GPUs (host tensors charged through torch_cuda's allocator);
- :mod:`.cupy_cuda`: a CuPy stand-in (``Device``, the default memory pool) on the same runtime;
- :mod:`.fake`: the one switch, ``PYTEST_GPU_FAKE_GPUS=<spec>``, that turns them all on;
- ``python -m pytest_gpu.sim hold``: a process outside any run holding simulated memory.
"""

from __future__ import annotations

from .cuda import (
    STICKY_ERRORS,
    Allocation,
    CudaError,
    allocate,
    compute,
    current_device,
    device_count,
    hang,
    hold,
    init,
    mem_get_info,
    poison,
    release_hang,
    set_device,
    set_memory_cap,
    sticky_error,
    synchronize,
    usage,
)
from .ledger import (
    DEFAULT_OVERHEAD,
    DEFAULT_SPEC,
    LEDGER_ENV,
    OVERHEAD_ENV,
    SPEC_ENV,
    TAG_ENV,
    Ledger,
    LedgerWriteError,
    OutOfMemoryError,
    SimDeviceError,
    SimMachineError,
    TagUsage,
    default_ledger_dir,
    ledger,
    machine_ledger,
    machine_ledger_dir,
)

__all__ = [
    "DEFAULT_OVERHEAD",
    "DEFAULT_SPEC",
    "LEDGER_ENV",
    "OVERHEAD_ENV",
    "SPEC_ENV",
    "STICKY_ERRORS",
    "TAG_ENV",
    "Allocation",
    "CudaError",
    "Ledger",
    "LedgerWriteError",
    "OutOfMemoryError",
    "SimDeviceError",
    "SimMachineError",
    "TagUsage",
    "allocate",
    "compute",
    "current_device",
    "default_ledger_dir",
    "device_count",
    "hang",
    "hold",
    "init",
    "ledger",
    "machine_ledger",
    "machine_ledger_dir",
    "mem_get_info",
    "poison",
    "release_hang",
    "set_device",
    "set_memory_cap",
    "sticky_error",
    "synchronize",
    "usage",
]
