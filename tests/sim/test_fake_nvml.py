"""The fake ``libnvidia-ml.so.1`` (:mod:`pytest_gpu.sim.nvml`), driven through the real pynvml.

Each scenario runs in a fresh ``python -c`` process (NVML state is per process) that calls
:func:`preload` and prints a JSON dict of observations; the assertions are made here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import require
from helpers import patience
from pytest_gpu.sim import nvml


@pytest.fixture(autouse=True)
def _compiler() -> None:
    require("C compiler", executable=os.environ.get("CC", "cc").split()[0] or "cc")


GiB = 1 << 30

PRELUDE = """\
import ctypes, json, os, sys
import pynvml
from pytest_gpu.sim.nvml import preload
LIB = preload(no_v3={no_v3})
raw = ctypes.CDLL(str(LIB))
out = {{}}
def err(fn, *args):
    try:
        fn(*args)
    except (pynvml.NVMLError, getattr(pynvml, "NVMLLibraryMismatchError", pynvml.NVMLError)) as exc:
        return type(exc).__name__
    return None
def addr(handle):
    return ctypes.cast(handle, ctypes.c_void_p).value
if not hasattr(pynvml, "nvmlDeviceGetComputeRunningProcesses_v2"):
    # nvidia-ml-py before 12.550 (pyproject's floor, 12.535.108, is older) wraps no v2
    # symbol: 12.550's wrapper, so that the fake's v2 symbol is called at the floor too
    def _compute_procs_v2(handle):
        fn = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetComputeRunningProcesses_v2")
        count = ctypes.c_uint(0)
        ret = fn(handle, ctypes.byref(count), None)
        if ret == pynvml.NVML_SUCCESS:
            return []
        if ret != pynvml.NVML_ERROR_INSUFFICIENT_SIZE:
            raise pynvml.NVMLError(ret)
        count.value = count.value * 2 + 5
        procs = (pynvml.c_nvmlProcessInfo_v2_t * count.value)()
        pynvml._nvmlCheckReturn(fn(handle, ctypes.byref(count), procs))
        rows = [pynvml.nvmlStructToFriendlyObject(procs[i]) for i in range(count.value)]
        for row in rows:
            if row.usedGpuMemory == pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value:
                row.usedGpuMemory = None
        return rows
    pynvml.nvmlDeviceGetComputeRunningProcesses_v2 = _compute_procs_v2
if not hasattr(pynvml, "c_nvmlProcessInfo_v3_t"):  # the same layout, named so from 12.550
    pynvml.c_nvmlProcessInfo_v3_t = pynvml.c_nvmlProcessInfo_v2_t
"""


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private build cache with both variants built once for the whole module."""
    path = tmp_path_factory.mktemp("nvml-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(path))
        mp.delenv("CC", raising=False)
        nvml.library_dir()
        nvml.library_dir(no_v3=True)
    yield path


def write_state(ledger: Path, *lines: str) -> None:
    """Replace ``ledger/nvml.state`` atomically, as the ledger does."""
    ledger.mkdir(parents=True, exist_ok=True)
    temp = ledger / "nvml.state.tmp"
    temp.write_text("\n".join(["v1", *lines]) + "\n")
    os.replace(temp, ledger / "nvml.state")


def run_py(cache_dir: Path, ledger: Path | None, code: str, *, no_v3: bool = False) -> dict[str, Any]:
    """Run ``code`` after the prelude in a fresh interpreter; return its ``out`` dict."""
    full_env = {**os.environ, "XDG_CACHE_HOME": str(cache_dir)}
    full_env.pop("PYTEST_GPU_SIM_LEDGER", None)
    full_env.pop("CC", None)
    if ledger is not None:
        full_env["PYTEST_GPU_SIM_LEDGER"] = str(ledger)
    script = PRELUDE.format(no_v3=no_v3) + textwrap.dedent(code) + "\nprint(json.dumps(out))\n"
    done = subprocess.run(
        [sys.executable, "-c", script], env=full_env, capture_output=True, text=True, timeout=patience(60), check=False
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    result["_stderr"] = done.stderr
    return result


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


PLAIN = (
    f"gpu 0 GPU-00000000-aaaa {80 * GiB} {GiB} {5 * GiB} 0 none NVIDIA H100 80GB HBM3",
    f"gpu 1 GPU-11111111-bbbb {40 * GiB} 0 0 0 none NVIDIA A100-SXM4-40GB",
)


def test_init_shutdown_refcount_and_uninitialized(tmp_path: Path, cache_dir: Path) -> None:
    write_state(tmp_path, *PLAIN)
    out = run_py(
        cache_dir,
        tmp_path,
        """
        out["count_before"] = err(pynvml.nvmlDeviceGetCount)
        out["driver_before"] = err(pynvml.nvmlSystemGetDriverVersion)
        out["shutdown_before"] = err(pynvml.nvmlShutdown)
        out["nvml_version"] = pynvml.nvmlSystemGetNVMLVersion()  # documented to need no init
        pynvml.nvmlInit()
        out["init_v2"] = raw.nvmlInit_v2()
        out["init_v1"] = raw.nvmlInit()
        for _ in range(2):
            pynvml.nvmlShutdown()
        out["count_at_1"] = pynvml.nvmlDeviceGetCount()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        pynvml.nvmlShutdown()
        out["count_after"] = err(pynvml.nvmlDeviceGetCount)
        out["name_after"] = err(pynvml.nvmlDeviceGetName, h)
        out["shutdown_after"] = err(pynvml.nvmlShutdown)
        pynvml.nvmlInit()
        out["again"] = pynvml.nvmlDeviceGetCount()
        out["errors"] = {c: pynvml.nvmlErrorString(c) for c in (0, 1, 4, 6, 9, 15, 25, 999, 12345)}
        """,
    )
    assert out["count_before"] == out["driver_before"] == "NVMLError_Uninitialized"
    assert out["shutdown_before"] == "NVMLError_Uninitialized"
    assert out["nvml_version"] == "12.550.54.15"
    assert out["init_v2"] == out["init_v1"] == 0
    assert out["count_at_1"] == 2
    assert out["count_after"] == out["name_after"] == out["shutdown_after"] == "NVMLError_Uninitialized"
    assert out["again"] == 2
    assert out["errors"] == {
        "0": "Success",
        "1": "Uninitialized",
        "4": "Insufficient Permissions",
        "6": "Not Found",
        "9": "Driver Not Loaded",
        "15": "GPU is lost",
        "25": "Argument version mismatch",
        "999": "Unknown Error",
        "12345": "Unknown Error",
    }


def test_inventory_handles_names_versions_pci(tmp_path: Path, cache_dir: Path) -> None:
    write_state(tmp_path, *PLAIN)
    out = run_py(
        cache_dir,
        tmp_path,
        """
        pynvml.nvmlInit()
        out["driver"] = pynvml.nvmlSystemGetDriverVersion()
        out["cuda"] = [pynvml.nvmlSystemGetCudaDriverVersion(), pynvml.nvmlSystemGetCudaDriverVersion_v2()]
        out["count"] = pynvml.nvmlDeviceGetCount()
        out["count_v1"] = (lambda c: (raw.nvmlDeviceGetCount(ctypes.byref(c)), c.value))(ctypes.c_uint())
        out["devices"] = []
        for i in range(out["count"]):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            by_uuid = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            pci = pynvml.nvmlDeviceGetPciInfo(h)
            out["devices"].append({
                "uuid": uuid,
                "name": pynvml.nvmlDeviceGetName(h),
                "index": pynvml.nvmlDeviceGetIndex(h),
                "same_handle": addr(h) == addr(by_uuid) == addr(pynvml.nvmlDeviceGetHandleByIndex(i)),
                "is_mig": pynvml.nvmlDeviceIsMigDeviceHandle(h).value,
                "bus_id": pci.busId,
                "bus": pci.bus,
            })
        out["bad_index"] = err(pynvml.nvmlDeviceGetHandleByIndex, 2)
        out["bad_uuid"] = err(pynvml.nvmlDeviceGetHandleByUUID, "GPU-nope")
        out["uuid_prefix"] = err(pynvml.nvmlDeviceGetHandleByUUID, "GPU-00000000")
        """,
    )
    assert out["driver"] == "550.54.15"
    assert out["cuda"] == [12040, 12040]
    assert out["count"] == 2
    assert out["count_v1"] == [0, 2]
    assert out["devices"] == [
        {
            "uuid": "GPU-00000000-aaaa",
            "name": "NVIDIA H100 80GB HBM3",
            "index": 0,
            "same_handle": True,
            "is_mig": 0,
            "bus_id": "00000000:01:00.0",
            "bus": 1,
        },
        {
            "uuid": "GPU-11111111-bbbb",
            "name": "NVIDIA A100-SXM4-40GB",
            "index": 1,
            "same_handle": True,
            "is_mig": 0,
            "bus_id": "00000000:02:00.0",
            "bus": 2,
        },
    ]
    assert out["bad_index"] == "NVMLError_InvalidArgument"
    assert out["bad_uuid"] == out["uuid_prefix"] == "NVMLError_NotFound"


def test_memory_info_v1_v2_and_live_updates(tmp_path: Path, cache_dir: Path) -> None:
    write_state(tmp_path, *PLAIN)
    out = run_py(
        cache_dir,
        tmp_path,
        f"""
        def mem(h):
            m1 = pynvml.nvmlDeviceGetMemoryInfo(h)
            m2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
            return [[m1.total, m1.free, m1.used], [m2.total, m2.reserved, m2.free, m2.used]]
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        h1 = pynvml.nvmlDeviceGetHandleByIndex(1)
        out["before"] = mem(h)
        out["wrong_version"] = err(pynvml.nvmlDeviceGetMemoryInfo, h, 0x01000028)
        state = os.path.join(os.environ["PYTEST_GPU_SIM_LEDGER"], "nvml.state")
        with open(state + ".new", "w") as f:
            f.write("v1\\ngpu 0 GPU-00000000-aaaa {80 * GiB} {GiB} {70 * GiB} 0 none NVIDIA H100 80GB HBM3\\n")
        os.replace(state + ".new", state)
        out["after"] = mem(h)
        out["count_after"] = pynvml.nvmlDeviceGetCount()
        out["gone_handle"] = err(pynvml.nvmlDeviceGetName, h1)
        os.remove(state)  # a vanished file keeps the last state
        out["vanished"] = mem(h)
        """,
    )
    total, reserved = 80 * GiB, GiB
    assert out["before"] == [
        [total, total - reserved - 5 * GiB, reserved + 5 * GiB],
        [total, reserved, total - reserved - 5 * GiB, 5 * GiB],
    ]
    assert out["wrong_version"] == "NVMLError_ArgumentVersionMismatch"
    assert out["after"] == [
        [total, total - reserved - 70 * GiB, reserved + 70 * GiB],
        [total, reserved, total - reserved - 70 * GiB, 70 * GiB],
    ]
    assert out["count_after"] == 1
    assert out["gone_handle"] == "NVMLError_InvalidArgument"
    assert out["vanished"] == out["after"]


def test_compute_processes(tmp_path: Path, cache_dir: Path) -> None:
    me, gone = os.getpid(), dead_pid()
    write_state(
        tmp_path,
        "option pidns 100000",
        *PLAIN,
        f"proc GPU-00000000-aaaa {me} {3 * GiB}",
        f"proc GPU-00000000-aaaa {gone} {GiB}",
        f"proc GPU-00000000-aaaa 1 {2 * GiB}",
    )
    out = run_py(
        cache_dir,
        tmp_path,
        """
        pynvml.nvmlInit()
        h0, h1 = pynvml.nvmlDeviceGetHandleByIndex(0), pynvml.nvmlDeviceGetHandleByIndex(1)
        def rows(procs):
            return [[p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId] for p in procs]
        out["v3"] = rows(pynvml.nvmlDeviceGetComputeRunningProcesses(h0))
        out["v2"] = rows(pynvml.nvmlDeviceGetComputeRunningProcesses_v2(h0))
        out["idle"] = pynvml.nvmlDeviceGetComputeRunningProcesses(h1)
        out["graphics"] = pynvml.nvmlDeviceGetGraphicsRunningProcesses(h0)
        # the two-call protocol, by hand
        fn = raw.nvmlDeviceGetComputeRunningProcesses_v3
        count = ctypes.c_uint(0)
        out["size_query"] = [fn(h0, ctypes.byref(count), None), count.value]
        buf = (pynvml.c_nvmlProcessInfo_v3_t * 8)()
        count.value = 1
        out["too_small"] = [fn(h0, ctypes.byref(count), buf), count.value]
        count.value = 8
        out["fits"] = [fn(h0, ctypes.byref(count), buf), count.value, buf[1].pid]
        count.value = 3
        out["null_infos"] = fn(h0, ctypes.byref(count), None)
        out["null_count"] = fn(h0, None, buf)
        count.value = 0
        out["none_running"] = [fn(h1, ctypes.byref(count), None), count.value]
        # the unversioned symbol fills the 16-byte v1 struct
        class V1(ctypes.Structure):
            _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]
        v1 = (V1 * 4)()
        count.value = 4
        out["v1"] = [raw.nvmlDeviceGetComputeRunningProcesses(h0, ctypes.byref(count), v1), count.value,
                     [[v.pid, v.usedGpuMemory] for v in v1[:2]]]
        """,
    )
    na = 0xFFFFFFFF
    live = [[me + 100000, 3 * GiB, na, na], [1 + 100000, 2 * GiB, na, na]]
    assert out["v3"] == out["v2"] == live
    assert out["idle"] == out["graphics"] == []
    assert out["size_query"] == [7, 2]
    assert out["too_small"] == [7, 2]
    assert out["fits"] == [0, 2, 1 + 100000]
    assert out["null_infos"] == out["null_count"] == 2
    assert out["none_running"] == [0, 0]
    assert out["v1"] == [0, 2, [[me + 100000, 3 * GiB], [1 + 100000, 2 * GiB]]]


def test_faulted_gpus_are_counted_but_unreachable(tmp_path: Path, cache_dir: Path) -> None:
    write_state(
        tmp_path,
        f"gpu 0 GPU-0 {GiB} 0 0 0 no_permission Tesla T4",
        f"gpu 1 GPU-1 {GiB} 0 0 0 none Tesla T4",
        f"gpu 2 GPU-2 {GiB} 0 0 0 gpu_is_lost Tesla T4",
        f"gpu 3 GPU-3 {GiB} 0 0 0 unknown Tesla T4",
    )
    out = run_py(
        cache_dir,
        tmp_path,
        """
        pynvml.nvmlInit()
        out["count"] = pynvml.nvmlDeviceGetCount()
        out["by_index"] = [err(pynvml.nvmlDeviceGetHandleByIndex, i) for i in range(4)]
        out["by_uuid"] = [err(pynvml.nvmlDeviceGetHandleByUUID, f"GPU-{i}") for i in range(4)]
        h = ctypes.c_void_p()
        out["raw_v1"] = raw.nvmlDeviceGetHandleByIndex(2, ctypes.byref(h))
        """,
    )
    assert out["count"] == 4
    faults = ["NVMLError_NoPermission", None, "NVMLError_GpuIsLost", "NVMLError_Unknown"]
    assert out["by_index"] == out["by_uuid"] == faults
    assert out["raw_v1"] == 15


def test_mig(tmp_path: Path, cache_dir: Path) -> None:
    me = os.getpid()
    write_state(
        tmp_path,
        f"gpu 0 GPU-plain {80 * GiB} {GiB} {GiB} 0 none NVIDIA H100 80GB HBM3",
        f"gpu 1 GPU-mig {80 * GiB} {GiB} {50 * GiB} 1 none NVIDIA H100 80GB HBM3",
        f"mig 1 0 MIG-aaaa {10 * GiB} {2 * GiB} NVIDIA H100 80GB HBM3 MIG 1g.10gb",
        f"mig 1 3 MIG-bbbb {40 * GiB} {3 * GiB} NVIDIA H100 80GB HBM3 MIG 3g.40gb",
        f"proc MIG-aaaa {me} {2 * GiB}",
        f"proc GPU-mig {me} {GiB}",
    )
    out = run_py(
        cache_dir,
        tmp_path,
        """
        pynvml.nvmlInit()
        plain, gpu = pynvml.nvmlDeviceGetHandleByIndex(0), pynvml.nvmlDeviceGetHandleByIndex(1)
        out["mode"] = [pynvml.nvmlDeviceGetMigMode(plain), pynvml.nvmlDeviceGetMigMode(gpu)]
        out["max"] = [pynvml.nvmlDeviceGetMaxMigDeviceCount(plain), pynvml.nvmlDeviceGetMaxMigDeviceCount(gpu)]
        out["plain_mig"] = err(pynvml.nvmlDeviceGetMigDeviceHandleByIndex, plain, 0)
        out["slots"] = [err(pynvml.nvmlDeviceGetMigDeviceHandleByIndex, gpu, i) for i in range(8)]
        m0 = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0)
        m3 = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 3)
        out["is_mig"] = [pynvml.nvmlDeviceIsMigDeviceHandle(m).value for m in (gpu, m0, m3)]
        out["parent"] = addr(pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m3)) == addr(gpu)
        out["parent_of_gpu"] = err(pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle, gpu)
        out["by_uuid"] = addr(pynvml.nvmlDeviceGetHandleByUUID("MIG-bbbb")) == addr(m3)
        out["uuid"] = pynvml.nvmlDeviceGetUUID(m3)
        out["name"] = pynvml.nvmlDeviceGetName(m3)
        out["index"] = pynvml.nvmlDeviceGetIndex(m3)
        out["mig_mode_of_mig"] = err(pynvml.nvmlDeviceGetMigMode, m3)
        def mem(h):
            m1 = pynvml.nvmlDeviceGetMemoryInfo(h)
            m2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
            return [[m1.total, m1.free, m1.used], [m2.total, m2.reserved, m2.free, m2.used]]
        out["mem_mig"] = mem(m3)
        out["mem_parent"] = mem(gpu)
        out["procs"] = [err(pynvml.nvmlDeviceGetComputeRunningProcesses, h) for h in (gpu, m0, m3)]
        out["procs_v2"] = err(pynvml.nvmlDeviceGetComputeRunningProcesses_v2, m0)
        """,
    )
    assert out["mode"] == [[0, 0], [1, 1]]
    assert out["max"] == [0, 7]
    assert out["plain_mig"] == "NVMLError_NotSupported"
    empty = "NVMLError_NotFound"
    assert out["slots"] == [None, empty, empty, None, empty, empty, empty, "NVMLError_InvalidArgument"]
    assert out["is_mig"] == [0, 1, 1]
    assert out["parent"] is True
    assert out["parent_of_gpu"] == "NVMLError_InvalidArgument"
    assert out["by_uuid"] is True
    assert (out["uuid"], out["name"], out["index"]) == ("MIG-bbbb", "NVIDIA H100 80GB HBM3 MIG 3g.40gb", 3)
    assert out["mig_mode_of_mig"] == "NVMLError_NotSupported"
    assert out["mem_mig"] == [[40 * GiB, 37 * GiB, 3 * GiB], [40 * GiB, 0, 37 * GiB, 3 * GiB]]
    # the parent's used is its instances' (2 + 3 GiB), not the gpu line's 50 GiB
    assert out["mem_parent"] == [[80 * GiB, 74 * GiB, 6 * GiB], [80 * GiB, GiB, 74 * GiB, 5 * GiB]]
    assert out["procs"] == ["NVMLError_NoPermission"] * 3
    assert out["procs_v2"] == "NVMLError_NoPermission"


def test_mig_slot_out_of_range_is_invalid_argument(tmp_path: Path, cache_dir: Path) -> None:
    write_state(tmp_path, f"gpu 0 GPU-mig {GiB} 0 0 1 none X", f"mig 0 6 MIG-z {GiB} 0 X 1g")
    out = run_py(
        cache_dir,
        tmp_path,
        """
        pynvml.nvmlInit()
        gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
        out["slots"] = [err(pynvml.nvmlDeviceGetMigDeviceHandleByIndex, gpu, i) for i in (5, 6, 7, 100)]
        """,
    )
    assert out["slots"] == ["NVMLError_NotFound", None, "NVMLError_InvalidArgument", "NVMLError_InvalidArgument"]


@pytest.mark.slow
def test_no_v3_variant_lacks_the_v3_symbols(tmp_path: Path, cache_dir: Path) -> None:
    write_state(tmp_path, "option no_v3 1", *PLAIN, f"proc GPU-00000000-aaaa {os.getpid()} 5")
    code = """
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        out["v3"] = err(pynvml.nvmlDeviceGetComputeRunningProcesses_v3, h)
        # newer pynvml wraps the unversioned function: a missing symbol becomes NVMLLibraryMismatchError
        out["unversioned"] = err(pynvml.nvmlDeviceGetComputeRunningProcesses, h)
        out["wrapped"] = hasattr(pynvml, "throwOnVersionMismatch")
        out["v2"] = len(pynvml.nvmlDeviceGetComputeRunningProcesses_v2(h))
        out["has_v3"] = hasattr(raw, "nvmlDeviceGetComputeRunningProcesses_v3")
        out["has_graphics_v3"] = hasattr(raw, "nvmlDeviceGetGraphicsRunningProcesses_v3")
        """
    old = run_py(cache_dir, tmp_path, code, no_v3=True)
    new = run_py(cache_dir, tmp_path, code, no_v3=False)
    assert old == {**old, "v3": "NVMLError_FunctionNotFound", "v2": 1, "has_v3": False, "has_graphics_v3": False}
    mismatch = "NVMLLibraryMismatchError" if old["wrapped"] else "NVMLError_FunctionNotFound"
    assert old["unversioned"] == mismatch
    assert new == {**new, "v3": None, "unversioned": None, "v2": 1, "has_v3": True, "has_graphics_v3": True}


@pytest.mark.slow
def test_driver_not_loaded_without_state(tmp_path: Path, cache_dir: Path) -> None:
    code = """
        out["init"] = err(pynvml.nvmlInit)
        out["count"] = err(pynvml.nvmlDeviceGetCount)
        """
    assert run_py(cache_dir, None, code)["init"] == "NVMLError_DriverNotLoaded"
    missing = run_py(cache_dir, tmp_path / "nowhere", code)
    assert (missing["init"], missing["count"]) == ("NVMLError_DriverNotLoaded", "NVMLError_Uninitialized")
    (tmp_path / "nvml.state").write_text("v1\ngpu 1 GPU-x 1 0 0 0 none skipped index 0\n")
    bad = run_py(cache_dir, tmp_path, code)
    assert bad["init"] == "NVMLError_DriverNotLoaded"
    assert "nvml.state:2: gpu lines must come in index order" in bad["_stderr"]
    (tmp_path / "nvml.state").write_text("v2\n")
    assert run_py(cache_dir, tmp_path, code)["init"] == "NVMLError_DriverNotLoaded"
    write_state(tmp_path)  # a machine without GPUs
    empty = run_py(cache_dir, tmp_path, code)
    assert (empty["init"], empty["count"]) == (None, None)


def test_strict_arguments(tmp_path: Path, cache_dir: Path) -> None:
    write_state(tmp_path, *PLAIN)
    out = run_py(
        cache_dir,
        tmp_path,
        """
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        bogus = ctypes.c_void_p(addr(h) + 8)
        buf = ctypes.create_string_buffer(96)
        u = ctypes.c_uint()
        out["null"] = [
            raw.nvmlDeviceGetCount_v2(None),
            raw.nvmlDeviceGetHandleByIndex_v2(0, None),
            raw.nvmlDeviceGetHandleByUUID(None, ctypes.byref(ctypes.c_void_p())),
            raw.nvmlDeviceGetUUID(h, None, 96),
            raw.nvmlDeviceGetMemoryInfo(h, None),
            raw.nvmlDeviceGetMemoryInfo_v2(h, None),
            raw.nvmlDeviceGetMigMode(h, ctypes.byref(u), None),
            raw.nvmlDeviceGetIndex(h, None),
            raw.nvmlSystemGetDriverVersion(None, 80),
            raw.nvmlSystemGetCudaDriverVersion(None),
        ]
        out["bad_handle"] = [
            raw.nvmlDeviceGetName(None, buf, 96),
            raw.nvmlDeviceGetName(bogus, buf, 96),
            raw.nvmlDeviceGetIndex(ctypes.c_void_p(addr(h) - 4096), ctypes.byref(u)),
            raw.nvmlDeviceGetMemoryInfo(bogus, ctypes.byref(pynvml.c_nvmlMemory_t())),
        ]
        out["short"] = [
            raw.nvmlDeviceGetUUID(h, buf, len("GPU-00000000-aaaa")),
            raw.nvmlDeviceGetUUID(h, buf, len("GPU-00000000-aaaa") + 1),
            raw.nvmlDeviceGetName(h, buf, 5),
            raw.nvmlSystemGetDriverVersion(buf, 9),
            raw.nvmlSystemGetDriverVersion(buf, 10),
            raw.nvmlSystemGetNVMLVersion(buf, 12),
        ]
        """,
    )
    assert out["null"] == [2] * 10
    assert out["bad_handle"] == [2] * 4
    assert out["short"] == [7, 0, 7, 7, 0, 7]


def test_preload_reaches_subprocesses_and_replaces_a_loaded_library(tmp_path: Path, cache_dir: Path) -> None:
    write_state(tmp_path, *PLAIN)
    out = run_py(
        cache_dir,
        tmp_path,
        """
        import subprocess
        out["same"] = str(preload()) == str(LIB)  # idempotent
        pynvml.nvmlInit()
        out["count"] = pynvml.nvmlDeviceGetCount()
        old = preload(no_v3=True)  # replaces the library pynvml uses: it needs its own nvmlInit
        out["fresh"] = err(pynvml.nvmlDeviceGetCount)
        pynvml.nvmlInit()
        out["old_v3"] = err(pynvml.nvmlDeviceGetComputeRunningProcesses_v3, pynvml.nvmlDeviceGetHandleByIndex(0))
        new = preload()
        fake_dirs = [p for p in os.environ["LD_LIBRARY_PATH"].split(os.pathsep) if "fake-nvml" in p]
        out["ld_path"] = fake_dirs == [os.path.dirname(new)]
        # a subprocess that only imports pynvml finds the fake by name
        child = "import pynvml as n; n.nvmlInit(); print(n.nvmlDeviceGetName(n.nvmlDeviceGetHandleByIndex(1)))"
        out["child"] = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True).stdout.strip()
        out["variants"] = old != new
        """,
    )
    assert out["same"] is True
    assert out["count"] == 2
    assert out["fresh"] == "NVMLError_Uninitialized"
    assert out["old_v3"] == "NVMLError_FunctionNotFound"
    assert out["ld_path"] is True
    assert out["child"] == "NVIDIA A100-SXM4-40GB"
    assert out["variants"] is True


def test_soname_resolves_to_an_already_loaded_fake(tmp_path: Path, cache_dir: Path) -> None:
    """glibc: once loaded RTLD_GLOBAL, ``CDLL("libnvidia-ml.so.1")`` (what pynvml does) finds it by soname."""
    write_state(tmp_path, *PLAIN)
    script = (
        "import ctypes, pynvml\n"
        "from pytest_gpu.sim.nvml import LIBRARY, library_dir\n"
        "ctypes.CDLL(str(library_dir() / LIBRARY), mode=ctypes.RTLD_GLOBAL)\n"
        "pynvml.nvmlInit()\n"
        "print(pynvml.nvmlDeviceGetCount(), pynvml.nvmlSystemGetDriverVersion())\n"
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(cache_dir), "PYTEST_GPU_SIM_LEDGER": str(tmp_path)}
    env.pop("LD_LIBRARY_PATH", None)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2", "550.54.15"]


@pytest.mark.slow
def test_built_once_and_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "cc.log"
    wrapper = tmp_path / "counting-cc"
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> {log}\nexec cc "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(wrapper))
    script = "from pytest_gpu.sim.nvml import library_dir; print(library_dir())"
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) for _ in range(4)]
    dirs = {p.communicate(timeout=patience(60))[0].strip() for p in procs}
    assert [p.returncode for p in procs] == [0] * 4
    assert len(dirs) == 1
    assert len(log.read_text().splitlines()) == 1  # four concurrent processes, one build
    (built,) = dirs
    lib = Path(built) / nvml.LIBRARY
    stamp = lib.stat().st_mtime_ns
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))  # a rebuild would now fail
    assert nvml.library_dir() == Path(built)
    assert lib.stat().st_mtime_ns == stamp
    assert not list(Path(built).glob(".*.tmp"))
    monkeypatch.setenv("CC", str(wrapper))
    other = nvml.library_dir(no_v3=True)  # the other variant: its own directory and build
    assert other.name.endswith("-nov3") and other != Path(built)
    assert len(log.read_text().splitlines()) == 2
    assert "-DFAKE_NVML_NO_V3" in log.read_text().splitlines()[1]


def test_no_compiler_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(RuntimeError, match=r"needs a C compiler: 'cc' was not found"):
        nvml.library_dir(no_v3=True)
    monkeypatch.setenv("CC", "no-such-cc -m64")
    with pytest.raises(RuntimeError, match=r"'no-such-cc' was not found.*install cc"):
        nvml.library_dir()


@pytest.fixture
def unwritable_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache root no one can create, root included (it lies under a regular file); a private
    temporary directory; a stand-in compiler that only writes its output. Returns the temp dir."""
    (tmp_path / "file").write_text("a file, so nothing can be made under it\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file" / "cache"))
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    cc = tmp_path / "touch-cc"
    cc.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && : > "$2"; shift; done\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    return temp


def test_an_unwritable_cache_falls_back_to_a_private_temporary_directory(unwritable_cache: Path) -> None:
    built = nvml.library_dir(no_v3=True)
    private = unwritable_cache / f"pytest-gpu-{os.getuid()}"
    assert built.parent == private / "fake-nvml" and built.name.endswith("-nov3")
    assert (built / nvml.LIBRARY).is_file()
    for path in (private, private / "fake-nvml"):
        assert stat.S_IMODE(path.lstat().st_mode) == 0o700
    assert nvml.library_dir(no_v3=True) == built  # found there next time


@pytest.mark.parametrize("where", ["pytest-gpu-{uid}", "pytest-gpu-{uid}/fake-nvml"])
def test_the_temporary_fallback_never_follows_a_symbolic_link(unwritable_cache: Path, where: str) -> None:
    elsewhere = unwritable_cache.parent / "elsewhere"  # another user's, say
    elsewhere.mkdir()
    link = unwritable_cache / where.format(uid=os.getuid())
    link.parent.mkdir(mode=0o700, exist_ok=True)
    link.symlink_to(elsewhere)
    with pytest.raises(RuntimeError) as info:
        nvml.library_dir()
    assert str(info.value).startswith(f"cannot cache the fake NVML in {os.environ['XDG_CACHE_HOME']}/pytest-gpu/")
    said = f"nor in the temporary directory ({link} is a symbolic link or not a directory); point XDG_CACHE_HOME at"
    assert said in str(info.value)
    assert list(elsewhere.iterdir()) == []


def test_the_temporary_fallback_refuses_another_users_directory(unwritable_cache: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("making a directory another user owns needs root")
    theirs = unwritable_cache / f"pytest-gpu-{os.getuid()}"
    theirs.mkdir(mode=0o777)
    os.chown(theirs, os.getuid() + 4242, -1)
    with pytest.raises(RuntimeError, match=rf"\({re.escape(str(theirs))} belongs to another user, uid "):
        nvml.library_dir()
    assert list(theirs.iterdir()) == []


def test_a_sim_run_with_a_read_only_home_passes(
    gpu_pytester: pytest.Pytester,
    run_inner: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    """No ``~/.cache`` can be made (was: INTERNALERROR); the library is built in the temp dir."""
    (tmp_path / "file").write_text("a file: HOME under it cannot be written, not even by root\n")
    monkeypatch.setenv("HOME", str(tmp_path / "file" / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.delenv("CC", raising=False)
    # short: the run's sockets live under TMPDIR, and tmp_path is too long for AF_UNIX
    temp = Path(tempfile.mkdtemp(prefix="pg-home-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(temp, ignore_errors=True))
    monkeypatch.setenv("TMPDIR", str(temp))
    gpu_pytester.makepyfile(
        "import pynvml\n\n"
        "def test_nvml_sees_the_fake(gpu):\n"
        "    pynvml.nvmlInit()\n"
        "    assert pynvml.nvmlDeviceGetCount() == 2\n"
    )
    result = run_inner("--gpus", "sim:2x16GiB", subprocess=True)
    result.assert_outcomes(passed=1)
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
    assert list((temp / f"pytest-gpu-{os.getuid()}" / "fake-nvml").glob(f"*/{nvml.LIBRARY}"))


def test_usage_not_available_reads_as_none(tmp_path: Path, cache_dir: Path) -> None:
    """``option no_usage``: NVML lists processes without their memory (Windows WDDM): the
    field holds NVML_VALUE_NOT_AVAILABLE, which pynvml turns into ``None``, in every struct."""
    me = os.getpid()
    write_state(tmp_path, "option no_usage 1", *PLAIN, f"proc GPU-00000000-aaaa {me} {3 * GiB}")
    out = run_py(
        cache_dir,
        tmp_path,
        """
        pynvml.nvmlInit()
        h0 = pynvml.nvmlDeviceGetHandleByIndex(0)
        out["v3"] = [[p.pid, p.usedGpuMemory] for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h0)]
        out["v2"] = [[p.pid, p.usedGpuMemory] for p in pynvml.nvmlDeviceGetComputeRunningProcesses_v2(h0)]
        out["used"] = pynvml.nvmlDeviceGetMemoryInfo(h0).used  # the device's own figure stays
        """,
    )
    assert out["v3"] == out["v2"] == [[me, None]]
    assert out["used"] >= 5 * GiB


def test_a_process_is_charged_every_allocation_it_holds_whatever_its_tag(tmp_path: Path) -> None:
    """The ledger renders NVML's view: per pid, the context plus every allocation, tagged by a
    test, by another test, or by none (a rank pool drops the tag) -- as the driver counts."""
    from pytest_gpu.sim.ledger import Ledger

    led = Ledger.create(tmp_path / "ledger", "sim:2x16GiB", 500 * 2**20)
    led.begin_tag("t1", os.getpid())
    led.allocate(GiB, 0, "t1", None)
    led.allocate(2 * GiB, 0, None, None)
    led.allocate(GiB, 0, "t2", None)
    led.allocate(GiB, 1, None, None)
    procs = [
        line.split() for line in (tmp_path / "ledger" / "nvml.state").read_text().splitlines() if line[:5] == "proc "
    ]
    me = str(os.getpid())
    assert sorted((uuid[-1], pid, int(used)) for _, uuid, pid, used in procs) == [
        ("0", me, 4 * GiB + 500 * 2**20),
        ("1", me, GiB + 500 * 2**20),
    ]
    assert led.tag_usage("t1").current == {0: GiB}  # the simulation's own bookkeeping is per tag
