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

Versions and states the real driver has (``fake_zes.c``'s header gives the compute-runtime files):

- ``PYTEST_GPU_SIM_ZES=no-zesinit`` (:data:`PRODUCT_VAR`): a product without ``zesInit`` support.
  After a ``zeInit`` under ``ZES_ENABLE_SYSMAN=1`` (legacy Sysman), ``zesInit`` answers
  ``ZE_RESULT_ERROR_UNSUPPORTED_FEATURE`` for the rest of the process, and Sysman's calls take
  the core API's device handles, which follow ``ZE_AFFINITY_MASK``. Unset: a product with it.
- :func:`share_client`: a process reaches its DRM client through several fds (dup, fork, fd
  passing); Sysman's per-process figure then reads that many times its memory, as compute-runtime's
  fdinfo reader sums every fd without de-duplicating clients.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from ..nvml import FakeLibrary, build_library, load_library

__all__ = ["LIBRARY", "PRODUCT_VAR", "SOURCE", "library_dir", "preload", "share_client", "start_runtime"]

#: The loader's soname, as :mod:`pytest_gpu.vendors.intel` (and torch's ``pyzes``) load it.
LIBRARY = "libze_loader.so.1"
#: The C source of the fake library.
SOURCE = Path(__file__).with_name("fake_zes.c")
#: The product the fake driver models: unset, one with zesInit support; ``no-zesinit``, one without.
PRODUCT_VAR = "PYTEST_GPU_SIM_ZES"
#: In the ledger's directory: ``<pid> <fds>`` lines, processes whose DRM client has several fds.
CLIENTS_FILE = "zes.fds"

_loaded: dict[Path, ctypes.CDLL] = {}


def library_dir() -> Path:
    """The directory holding the compiled fake loader, building it on first use; :class:`RuntimeError`
    when no C compiler is available, compiling fails, or no cache can be written."""
    return build_library(FakeLibrary("fake-zes", "the fake Level Zero loader", LIBRARY, (SOURCE,)))


def preload() -> Path:
    """Make this process, and its subprocesses, load the fake loader; returns its path
    (:class:`RuntimeError` for a ``PYTEST_GPU_SIM_ZES`` that names no modelled product)."""
    product = os.environ.get(PRODUCT_VAR, "")
    if product not in ("", "no-zesinit"):
        raise RuntimeError(f"{PRODUCT_VAR}={product!r}: expected no-zesinit, or leave it unset")
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


def share_client(ledger_dir: Path | str, pid: int, fds: int) -> None:
    """Model process ``pid`` reaching its DRM client through ``fds`` file descriptors (``dup``, a
    ``fork`` that kept them, fd passing): from now on the fake Sysman reports ``fds`` times its
    memory for it (``ledger_dir``: the simulated machine's, ``$PYTEST_GPU_SIM_LEDGER``)."""
    if fds < 1:
        raise ValueError(f"share_client: fds must be at least 1, got {fds}")
    path = Path(ledger_dir) / CLIENTS_FILE
    kept = []
    if path.exists():
        kept = [line for line in path.read_text().splitlines() if line.split()[:1] != [str(pid)]]
    temporary = path.with_name(f".{CLIENTS_FILE}.{os.getpid()}")
    temporary.write_text("".join(f"{line}\n" for line in [*kept, f"{pid} {fds}"]))
    os.replace(temporary, path)  # the library reads whole files only


def start_runtime() -> int | None:
    """``zeInit(0)`` on the fake loader this process loaded, as a framework's runtime does when it
    starts (torch's SYCL runtime: its driver reads ``ZE_AFFINITY_MASK`` and ``ZES_ENABLE_SYSMAN``
    now); its result, or ``None`` where no fake loader is loaded (nothing to start)."""
    if not _loaded:
        return None
    library = next(iter(_loaded.values()))
    code: int = library.zeInit(ctypes.c_uint32(0))
    return code
