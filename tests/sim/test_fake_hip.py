"""The fake ``libamdhip64.so`` (:mod:`pytest_gpu.sim.hip`) and the HIP read-back of
:func:`pytest_gpu.gpu.runtime.pin` on AMD GPUs (:func:`pytest_gpu.vendors.amd.hip_init`).

Each scenario runs in a fresh ``python -c`` process: HIP fixes its device list at its first call.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import require
from helpers import patience
from pytest_gpu.sim import hip as fake_hip
from pytest_gpu.sim.ledger import render_state
from pytest_gpu.sim.spec import amd_uuid, parse
from pytest_gpu.vendors.amd import rocm_view
from pytest_gpu.vendors.devices import Device

GiB = 1 << 30
SPEC = "amd:sim:4x16GiB;rocr-order=3,0,1,2"  # ROCr enumerates amdsmi's GPU 3 first
MACHINE = tuple(Device(i, amd_uuid(i), 16 * GiB) for i in (3, 0, 1, 2))  # in ROCr's order, as discovery gives it
VARS = ("ROCR_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")

PRELUDE = """\
import ctypes, json, os
from pytest_gpu.gpu import runtime
from pytest_gpu.vendors.amd import hip_init
from pytest_gpu.vendors.devices import Device, Inventory
from pytest_gpu.sim.spec import amd_uuid
if os.environ.get("PRELOAD"):
    from pytest_gpu.sim.hip import preload
    preload()
machine = tuple(Device(i, amd_uuid(i), 16 << 30) for i in (3, 0, 1, 2))
inventory = Inventory(devices=tuple(sorted(machine, key=lambda d: d.index)), source="amdsmi", vendor="amd",
                      machine=machine)
out = {}
"""


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One build of the library for the module (its own cache: the build itself is under test)."""
    require("C compiler", executable="cc")
    path = tmp_path_factory.mktemp("fake-hip-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(path))
        mp.delenv("CC", raising=False)
        fake_hip.library_dir()
    yield path


def ledger(tmp_path: Path, spec: str = SPEC) -> Path:
    machine = parse(spec)
    state = {"spec": machine.spec, "overhead": 0, "procs": {}, "tags": {}, "users": {}}
    folder = tmp_path / "ledger"
    folder.mkdir(exist_ok=True)
    (folder / "nvml.state").write_text(render_state(machine, state))
    return folder


def run_py(cache_dir: Path, folder: Path, code: str, env: dict[str, str], preload: bool = True) -> dict[str, Any]:
    full = {**os.environ, "XDG_CACHE_HOME": str(cache_dir), "PYTEST_GPU_SIM_LEDGER": str(folder), **env}
    for name in ("PYTEST_GPU_FAKE_GPUS", "CC", "ROCM_HOME", "ROCM_PATH", *(v for v in VARS if v not in env)):
        full.pop(name, None)
    if preload:
        full["PRELOAD"] = "1"
    script = PRELUDE + textwrap.dedent(code) + "\nprint(json.dumps(out))\n"
    done = subprocess.run(
        [sys.executable, "-c", script], env=full, capture_output=True, text=True, timeout=patience(60)
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


READ_BACK = """
out["hip"], out["note"] = hip_init()
runtime.forget()
out["view"] = runtime.pin(inventory)
"""


SIMULATED = """
from pytest_gpu.sim import cuda
out["units"] = cuda.init()
"""


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, [3, 0, 1, 2]),  # ROCr's order, not amdsmi's
        ({"ROCR_VISIBLE_DEVICES": "1,0", "HIP_VISIBLE_DEVICES": "1"}, [3]),  # each indexes what the last left
        ({"ROCR_VISIBLE_DEVICES": amd_uuid(2), "CUDA_VISIBLE_DEVICES": "0"}, [2]),
        ({"HIP_VISIBLE_DEVICES": f"{amd_uuid(1)},{amd_uuid(0)}"}, [1, 0]),  # UUIDs, in their order
        ({"HIP_VISIBLE_DEVICES": "2,x,0"}, [1]),  # an invalid entry ends the list
        # clr's rules (rocdevice.cpp at f9f995c6), where pytest-gpu's model once differed:
        ({"GPU_DEVICE_ORDINAL": "1"}, [3, 0, 1, 2]),  # OpenCL's variable: HIP does not read it
        ({"ROCR_VISIBLE_DEVICES": "3,2,1", "GPU_DEVICE_ORDINAL": "1,2", "HIP_VISIBLE_DEVICES": "1"}, [1]),
        ({"HIP_VISIBLE_DEVICES": "1,1,2"}, [0, 1]),  # a repeated entry is skipped
        ({"HIP_VISIBLE_DEVICES": "", "CUDA_VISIBLE_DEVICES": "2"}, [1]),  # HIP's empty: CUDA's is read
        ({"HIP_VISIBLE_DEVICES": "", "CUDA_VISIBLE_DEVICES": ""}, [3, 0, 1, 2]),  # empty narrows nothing
        ({"HIP_VISIBLE_DEVICES": "1,"}, [0]),  # a comma at the end is no entry
        ({"HIP_VISIBLE_DEVICES": "1,,2"}, [0]),  # an empty one in the middle is invalid
        ({"HIP_VISIBLE_DEVICES": " 1"}, []),  # indices are written exactly: no blank ...
        ({"HIP_VISIBLE_DEVICES": "01"}, []),  # ... and no leading zero
        ({"HIP_VISIBLE_DEVICES": "GPU-51a"}, [3]),  # the first device (ROCr's order) whose UUID contains it
        ({"HIP_VISIBLE_DEVICES": amd_uuid(1).upper()}, []),  # ROCr spells UUIDs in lower case: no match
        ({"ROCR_VISIBLE_DEVICES": amd_uuid(1).upper(), "HIP_VISIBLE_DEVICES": "0"}, [1]),  # ROCr: any case
    ],
)
def test_hip_the_simulated_hip_and_the_prediction_agree(
    tmp_path: Path, cache_dir: Path, env: dict[str, str], expected: list[int]
) -> None:
    folder = ledger(tmp_path)
    out = run_py(cache_dir, folder, READ_BACK, env)  # the fake libamdhip64.so, read back
    if expected:
        assert out["hip"] == [amd_uuid(i)[4:] for i in expected] and out["note"] == ""
    else:  # no device left: HIP's hipInit says so, and the view is predicted
        assert out["hip"] is None and "hipErrorNoDevice" in out["note"]
    assert out["view"] == expected
    assert rocm_view(MACHINE, env) == expected  # the model, without HIP
    simulated = run_py(cache_dir, folder, SIMULATED, {**env, "PYTEST_GPU_SIM": SPEC}, preload=False)
    assert simulated["units"] == expected  # pytest_gpu.sim.cuda on an AMD machine


def test_without_hip_the_view_is_predicted_and_says_why(tmp_path: Path, cache_dir: Path) -> None:
    code = (
        READ_BACK + 'out["unreachable"] = str(__import__("pytest").raises(runtime.LeaseUnreachable, '
        "runtime.in_process, inventory, [0]).value)\n"
    )
    env = {"ROCR_VISIBLE_DEVICES": "0", "LD_LIBRARY_PATH": ""}
    out = run_py(cache_dir, ledger(tmp_path), code, env, preload=False)
    assert out["hip"] is None and "libamdhip64.so not loadable" in out["note"]
    assert out["view"] == [3]  # predicted: ROCr's first
    assert "its HIP device list is predicted from ROCm's variables" in out["unreachable"]


def test_the_fake_is_as_strict_as_clr(tmp_path: Path, cache_dir: Path) -> None:
    code = """
    lib = ctypes.CDLL("libamdhip64.so")
    count, device, uuid = ctypes.c_int(-1), ctypes.c_int(-1), (ctypes.c_char * 16)()
    out["init"] = [lib.hipInit(1), lib.hipInit(0)]
    os.environ["HIP_VISIBLE_DEVICES"] = "0"  # too late: the list was fixed at the first call
    out["count"] = [lib.hipGetDeviceCount(None), lib.hipGetDeviceCount(ctypes.byref(count)), count.value]
    out["get"] = [lib.hipDeviceGet(None, 0), lib.hipDeviceGet(ctypes.byref(device), 4),
                  lib.hipDeviceGet(ctypes.byref(device), -1), lib.hipDeviceGet(ctypes.byref(device), 3), device.value]
    out["uuid"] = [lib.hipDeviceGetUuid(uuid, 4), lib.hipDeviceGetUuid(None, 0), lib.hipDeviceGetUuid(uuid, 0),
                   bytes(uuid).decode()]
    """
    out = run_py(cache_dir, ledger(tmp_path), code, {})
    assert out["init"] == [1, 0]  # hipErrorInvalidValue: flags must be 0
    assert out["count"] == [1, 0, 4]
    assert out["get"] == [1, 101, 101, 0, 3]  # hipErrorInvalidDevice for an ordinal out of range
    assert out["uuid"] == [101, 1, 0, amd_uuid(3)[4:]]  # the device first, then the pointer; ASCII hex


@pytest.mark.parametrize(
    ("spec", "env", "init", "count"),
    [
        ("sim:2x16GiB", {}, 101, [100, 0]),  # an NVIDIA machine: ROCr does not start, nor HIP
        (SPEC, {"ROCR_VISIBLE_DEVICES": ""}, 100, [100, 0]),  # none left: hipErrorNoDevice
    ],
)
def test_no_amd_gpu_for_hip(
    tmp_path: Path, cache_dir: Path, spec: str, env: dict[str, str], init: int, count: list[int]
) -> None:
    code = """
    lib = ctypes.CDLL("libamdhip64.so")
    n = ctypes.c_int(-1)
    out["init"] = lib.hipInit(0)
    out["count"] = [lib.hipGetDeviceCount(ctypes.byref(n)), n.value]
    out["hip"], out["note"] = hip_init()
    """
    out = run_py(cache_dir, ledger(tmp_path, spec), code, env)
    assert out["init"] == init and out["count"] == count
    assert out["hip"] is None and "hipInit failed with hipError" in out["note"]
