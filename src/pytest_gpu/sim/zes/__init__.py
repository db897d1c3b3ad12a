"""A fake Level Zero loader, ``libze_loader.so.1``, for simulated Intel GPUs: the Sysman calls
:mod:`pytest_gpu.vendors.intel` makes through ctypes, answered from the simulated ledger, and the
core API's device list (``zeInit``, ``zeDriverGet``, ``zeDeviceGet``, ``zeDeviceGetProperties``),
which applies ``ZE_AFFINITY_MASK`` once, at the process's first ``zeInit``, as compute-runtime
does: what the worker pins and reads back (:func:`pytest_gpu.vendors.intel.ze_init`).

Compiled on demand from ``fake_zes.c`` (next to this file) as the fake NVML is
(:func:`pytest_gpu.sim.nvml.build_library`: ``cc`` or ``$CC``, cached per user). It reads the
same state file (``$PYTEST_GPU_SIM_LEDGER/nvml.state``) and serves it only when the file says
``option vendor xpu`` (``PYTEST_GPU_FAKE_GPUS=xpu:sim:4x64GiB``); elsewhere ``zesInit``
answers ``ZE_RESULT_ERROR_UNINITIALIZED``, as the loader does without a driver.

:func:`preload` loads it ``RTLD_GLOBAL`` under its soname, so ``ctypes.CDLL("libze_loader.so.1")``
in this process finds it, and puts its directory first on ``LD_LIBRARY_PATH`` for subprocesses.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from ..nvml import FakeLibrary, build_library, load_library

__all__ = ["LIBRARY", "SOURCE", "library_dir", "preload"]

#: The loader's soname, as :mod:`pytest_gpu.vendors.intel` (and torch's ``pyzes``) load it.
LIBRARY = "libze_loader.so.1"
#: The C source of the fake library.
SOURCE = Path(__file__).with_name("fake_zes.c")

_loaded: dict[Path, ctypes.CDLL] = {}


def library_dir() -> Path:
    """The directory holding the compiled fake loader, building it on first use; :class:`RuntimeError`
    when no C compiler is available, compiling fails, or no cache can be written."""
    return build_library(FakeLibrary("fake-zes", "the fake Level Zero loader", LIBRARY, (SOURCE,)))


def preload() -> Path:
    """Make this process, and its subprocesses, load the fake loader; returns its path."""
    directory = library_dir()
    path = directory / LIBRARY
    if path not in _loaded:
        _loaded[path] = load_library(path)
    kept = [
        entry
        for entry in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep)
        if entry and Path(entry).parent != directory.parent  # other builds' directories
    ]
    os.environ["LD_LIBRARY_PATH"] = os.pathsep.join([str(directory), *kept])
    return path
