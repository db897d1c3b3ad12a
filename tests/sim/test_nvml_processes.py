"""NVML lists a process without its memory (issue 31, "smaller"): not measured, never 0 nor absent.

The fake NVML lists processes with ``usedGpuMemory`` NVML_VALUE_NOT_AVAILABLE (``na``) and has a
graphics list (``gfx`` lines); the foreign sampler's NVML reader keeps "listed without memory"
(None: estimated by difference) apart from "absent" and from a figure another list gives.
"""

from __future__ import annotations

import os
from pathlib import Path

from test_fake_nvml import PLAIN, cache_dir, run_py, write_state

__all__ = ["cache_dir"]  # the fake NVML's build cache, a fixture

GiB = 1 << 30


def test_a_process_listed_without_its_memory_is_not_measured(tmp_path: Path, cache_dir: Path) -> None:
    me, parent = os.getpid(), os.getppid()
    write_state(
        tmp_path,
        *PLAIN,
        f"proc GPU-00000000-aaaa {me} na",  # compute: listed, memory not available
        f"gfx GPU-00000000-aaaa {me} {2 * GiB}",  # graphics: a figure
        f"proc GPU-00000000-aaaa 1 {3 * GiB}",
        "gfx GPU-00000000-aaaa 1 na",
        f"gfx GPU-00000000-aaaa {parent} {GiB}",  # only in the graphics list
        f"proc GPU-11111111-bbbb {me} 0",  # a context-less listing: measured, 0
    )
    out = run_py(
        cache_dir,
        tmp_path,
        """
        from pytest_gpu.vendors.nvidia import NvmlSampler
        driver = NvmlSampler()
        out["a"] = {str(k): v for k, v in driver.processes("GPU-00000000-aaaa").items()}
        out["b"] = {str(k): v for k, v in driver.processes("GPU-11111111-bbbb").items()}
        out["raw"] = [p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(
            pynvml.nvmlDeviceGetHandleByIndex(0))]
        """,
    )
    assert out["raw"] == [None, 3 * GiB]  # the double: pynvml reads NVML_VALUE_NOT_AVAILABLE as None
    # was {me: 2GiB, 1: 3GiB}: one list's "not available" read as absent, or as 0 beside the other's figure
    assert out["a"] == {str(me): None, "1": None, str(parent): GiB}
    assert out["b"] == {str(me): 0}
