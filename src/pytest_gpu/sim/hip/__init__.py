"""A fake ``libamdhip64.so`` for simulated AMD GPUs: what HIP enumerates, read back as on a real one.

The library is compiled on demand from ``fake_hip.c`` (next to this file), as the fake NVML is
(:func:`pytest_gpu.sim.nvml.build_library`: ``cc`` or ``$CC``, cached per user). It answers
``hipInit``, ``hipGetDeviceCount``, ``hipDeviceGet`` and ``hipDeviceGetUuid`` from the state
file of the simulated machine (``$PYTEST_GPU_SIM_LEDGER/nvml.state``, an AMD machine's), with
the device list ROCr and HIP leave a process under its ``ROCR_VISIBLE_DEVICES`` and
``HIP_VISIBLE_DEVICES``/``CUDA_VISIBLE_DEVICES``, fixed at its first call as HIP's is, by the
rules :func:`pytest_gpu.vendors.amd.rocm_view` predicts. Which sources (ROCm/clr, ROCR-Runtime)
it follows, at which commits, is said at the top of ``fake_hip.c``.
:func:`pytest_gpu.gpu.runtime.pin` reads it back on AMD GPUs (:func:`pytest_gpu.vendors.amd.hip_init`).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from ..nvml import FakeLibrary, build_library, load_library

__all__ = ["LIBRARY", "SOURCE", "library_dir", "preload"]

#: The library's file name and soname, as HIP programs (and ``ctypes``) load it.
LIBRARY = "libamdhip64.so"
#: The C source of the fake library.
SOURCE = Path(__file__).with_name("fake_hip.c")

_loaded: dict[Path, ctypes.CDLL] = {}


def library_dir() -> Path:
    """The directory holding the compiled fake ``libamdhip64.so``, building it on first use;
    :class:`RuntimeError` when no C compiler is available, compiling fails, or no cache can be written."""
    return build_library(FakeLibrary("fake-hip", "the fake libamdhip64.so", LIBRARY, (SOURCE,)))


def preload() -> Path:
    """Load the fake library in this process under its soname (``RTLD_GLOBAL``: a later
    ``ctypes.CDLL("libamdhip64.so")`` gets it) and put its directory first on ``LD_LIBRARY_PATH``
    for subprocesses; returns its path. HIP fixes its device list at its first call, so what
    this process enumerates is fixed by the variables of that moment. Calling it again is harmless."""
    directory = library_dir()
    path = directory / LIBRARY
    if path not in _loaded:
        _loaded[path] = load_library(path)
    kept = [e for e in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if e and e != str(directory)]
    os.environ["LD_LIBRARY_PATH"] = os.pathsep.join([str(directory), *kept])
    return path
