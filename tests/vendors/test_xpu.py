"""Intel XPU: ZE_AFFINITY_MASK as compute-runtime applies it, the fake Level Zero loader as strict
as zes_api.h says, discovery and samples through Sysman, the simulated torch.xpu, XCCL pools."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from conftest import require, run_fake_python
from helpers import patience
from pytest_gpu.base.distspec import build_spec
from pytest_gpu.base.requests import GpuRequestError
from pytest_gpu.distributed.backends import build_xccl_missing
from pytest_gpu.sim.spec import SpecError, parse, xpu_uuid
from pytest_gpu.vendors import intel as xpu
from pytest_gpu.vendors import registry as vendors
from pytest_gpu.vendors.devices import Device

GiB, MiB = 2**30, 2**20
MACHINE = tuple(Device(i, xpu_uuid(i), 64 * GiB) for i in range(4))


# -- ZE_AFFINITY_MASK ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("outer", "seen"),
    [
        ({}, [0, 1, 2, 3]),
        ({"ZE_AFFINITY_MASK": ""}, [0, 1, 2, 3]),  # empty: no mask at all (unlike CUDA's "")
        ({"ZE_AFFINITY_MASK": "2"}, [2]),
        ({"ZE_AFFINITY_MASK": "3,1"}, [1, 3]),  # the driver's order, not the mask's
        ({"ZE_AFFINITY_MASK": "9,2,1"}, [1, 2]),  # an entry naming no device is skipped, not an end
        ({"ZE_AFFINITY_MASK": "1,1"}, [1]),
        ({"ZE_AFFINITY_MASK": "0.1,2"}, [2]),  # X.Y under FLAT (the default): ignored
        ({"ZE_AFFINITY_MASK": "0.1,2", "ZE_FLAT_DEVICE_HIERARCHY": "COMPOSITE"}, [0, 2]),
        ({"ZE_AFFINITY_MASK": "x,3"}, [3]),
    ],
)
def test_the_mask_selects_as_compute_runtime_does(outer: dict[str, str], seen: list[int]) -> None:
    assert xpu.xpu_view(MACHINE, outer) == seen
    assert vendors.XPU.view(MACHINE, tuple(outer.items())) == seen


def run_fake(tmp_path: Path, spec: str, code: str, **extra: str) -> dict[str, Any]:
    """``code`` on the fake machine ``spec`` (:func:`conftest.run_fake_python`)."""
    return run_fake_python(tmp_path, spec, code, **extra)


def test_tiles_are_devices_under_flat_and_cards_under_composite() -> None:
    cards = [xpu.Card(0, xpu_uuid(0), 128 * GiB, "Max 1550", 2), xpu.Card(1, xpu_uuid(1), 48 * GiB, "Max 1100", 0)]
    flat = xpu.devices_of(cards, xpu.flat({}))
    assert [(d.index, d.uuid, d.total_memory) for d in flat] == [
        (0, f"{xpu_uuid(0)}/tile0", 64 * GiB),
        (1, f"{xpu_uuid(0)}/tile1", 64 * GiB),
        (2, xpu_uuid(1), 48 * GiB),
    ]
    composite = xpu.devices_of(cards, xpu.flat({"ZE_FLAT_DEVICE_HIERARCHY": "COMPOSITE"}))
    assert [(d.index, d.uuid) for d in composite] == [(0, xpu_uuid(0)), (1, xpu_uuid(1))]
    assert xpu.flat({"ZE_FLAT_DEVICE_HIERARCHY": "COMBINED"})  # COMBINED exposes tiles as devices too


def test_a_lease_sets_the_mask_and_its_process_sees_exactly_the_lease() -> None:
    env = vendors.XPU.lease_env(["3", "1"])
    assert env == {"ZE_AFFINITY_MASK": "3,1", "CUDA_VISIBLE_DEVICES": "3,1"}
    assert not any(name.startswith(("ROCR_", "HIP_", "GPU_DEVICE")) for name in env)
    assert vendors.XPU.view(MACHINE, vendors.XPU.outer(env)) == [1, 3]
    assert "ZE_AFFINITY_MASK" in vendors.VISIBILITY  # rank pools and Ray heads drop it as a lease variable


# -- fake machines -------------------------------------------------------------------------


def test_an_xpu_spec_is_an_intel_machine() -> None:
    machine = parse("xpu:sim:4x64GiB")
    assert machine.vendor == "xpu"
    assert [g.uuid for g in machine.gpus] == [xpu_uuid(i) for i in range(4)]
    assert machine.gpus[0].name == "Simulated Intel GPU 64GiB"
    with pytest.raises(SpecError, match="NVIDIA driver's option"):
        parse("xpu:sim:2x64GiB;mig:0=2x10GiB")
    with pytest.raises(SpecError, match="amdsmi's process list"):
        parse("xpu:sim:2x64GiB;proc-unit=1MiB")


STRICT = """
import ctypes
lib = ctypes.CDLL("libze_loader.so.1")
U32 = ctypes.c_uint32
out["before_init"] = lib.zesDriverGet(ctypes.byref(U32(0)), None)
out["bad_flags"] = lib.zesInit(U32(2))
out["init"] = lib.zesInit(U32(0))
out["null_count"] = lib.zesDriverGet(None, None)
n = U32(0)
lib.zesDriverGet(ctypes.byref(n), None)
drivers = (ctypes.c_void_p * 1)()
lib.zesDriverGet(ctypes.byref(n), drivers)
count = U32(0)
driver = ctypes.c_void_p(drivers[0])
out["device_count_rc"] = lib.zesDeviceGet(driver, ctypes.byref(count), None)
out["device_count"] = count.value
many = U32(99)
handles = (ctypes.c_void_p * 99)()
lib.zesDeviceGet(driver, ctypes.byref(many), handles)
out["lowered"] = many.value
out["null_handle"] = lib.zesDeviceGet(None, ctypes.byref(count), None)
out["bad_driver"] = lib.zesDeviceGet(ctypes.c_void_p(handles[0]), ctypes.byref(count), None)
junk = ctypes.create_string_buffer(1024)
out["bad_device"] = lib.zesDeviceEnumMemoryModules(junk, ctypes.byref(count), None)
from pytest_gpu.sim.ledger import ledger
ledger().allocate(2 << 30, 1, None, None)
two = U32(0)
out["procs_rc"] = lib.zesDeviceProcessesGetState(ctypes.c_void_p(handles[1]), ctypes.byref(two), None)
out["procs"] = two.value
none = U32(0)
lib.zesDeviceProcessesGetState(ctypes.c_void_p(handles[0]), ctypes.byref(none), None)
out["procs_elsewhere"] = none.value
"""


def test_the_fake_loader_is_as_strict_as_zes_api_h(tmp_path: Path) -> None:
    out = run_fake(tmp_path, "xpu:sim:2x64GiB", STRICT)
    assert out["before_init"] == 0x78000001  # ZE_RESULT_ERROR_UNINITIALIZED
    assert out["bad_flags"] == 0x7800000C  # ZE_RESULT_ERROR_INVALID_ENUMERATION
    assert out["init"] == 0
    assert out["null_count"] == 0x78000007  # ZE_RESULT_ERROR_INVALID_NULL_POINTER
    assert (out["device_count_rc"], out["device_count"], out["lowered"]) == (0, 2, 2)
    assert out["null_handle"] == 0x78000005  # ZE_RESULT_ERROR_INVALID_NULL_HANDLE
    assert out["bad_driver"] == out["bad_device"] == 0x78000004  # ZE_RESULT_ERROR_INVALID_ARGUMENT
    assert (out["procs_rc"], out["procs"], out["procs_elsewhere"]) == (0, 1, 0)


# -- Level Zero's device list, pinned ------------------------------------------------------

ZE = """
import ctypes, json, os
from pytest_gpu.sim import zes
zes.preload()
lib = ctypes.CDLL("libze_loader.so.1")
U32 = ctypes.c_uint32

def enumerated():
    # what a framework that starts Level Zero (torch's SYCL runtime) enumerates in this process
    assert lib.zeInit(U32(0)) == 0
    n = U32(0)
    drivers = (ctypes.c_void_p * 1)()
    lib.zeDriverGet(ctypes.byref(n), drivers)
    count = U32(0)
    lib.zeDeviceGet(ctypes.c_void_p(drivers[0]), ctypes.byref(count), None)
    return count.value

out = {}
"""


def run_level_zero(tmp_path: Path, code: str, **env: str) -> dict[str, Any]:
    """``code`` in a fresh interpreter (Level Zero reads its mask once per process) that loads the
    fake loader over a fake Intel machine's state, without the fake-GPU switch: the real path."""
    require("C compiler", executable=os.environ.get("CC", "cc").split()[0] or "cc")
    from pytest_gpu.sim.ledger import render_state

    machine = parse("xpu:sim:4x64GiB")
    folder = tmp_path / "ledger"
    folder.mkdir(exist_ok=True)
    state = {"spec": machine.spec, "overhead": 0, "procs": {}, "tags": {}, "users": {}}
    (folder / "nvml.state").write_text(render_state(machine, state))
    full = {**os.environ, "PYTEST_GPU_SIM_LEDGER": str(folder), **env}
    for name in ("PYTEST_GPU_FAKE_GPUS", "PYTEST_GPU_SIM", *(n for n in ("ZE_AFFINITY_MASK",) if n not in env)):
        full.pop(name, None)
    script = ZE + textwrap.dedent(code) + "\nprint(json.dumps(out))\n"
    done = subprocess.run(
        [sys.executable, "-c", script], env=full, capture_output=True, text=True, timeout=patience(120)
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_level_zero_keeps_the_mask_of_its_first_init(tmp_path: Path) -> None:
    """The fake loader is the real runtime's double here: compute-runtime reads ZE_AFFINITY_MASK when
    the first zeInit creates its driver, and a later mask changes nothing in the process."""
    out = run_level_zero(
        tmp_path,
        """
        out["first"] = enumerated()
        os.environ["ZE_AFFINITY_MASK"] = "0,1,2"
        out["later"] = enumerated()
        out["flags"] = lib.zeInit(U32(4))
        """,
        ZE_AFFINITY_MASK="9, 2",
    )
    assert (out["first"], out["later"]) == (1, 1)  # 9 names no device: skipped; " 2" is device 2
    assert out["flags"] == 0x7800000C  # ZE_RESULT_ERROR_INVALID_ENUMERATION


@pytest.mark.parametrize(("mask", "view"), [(None, [0, 1, 2, 3]), ("3,1", [1, 3])])
def test_the_worker_pins_level_zeros_device_list_before_a_lease(
    tmp_path: Path, mask: str | None, view: list[int]
) -> None:
    """Issue 29: the Intel worker pins Level Zero's device list under the run's ZE_AFFINITY_MASK, as
    CUDA's is pinned, and reads it back: a framework that starts Level Zero inside a test (under the
    lease's mask) still enumerates the run's devices, so the lease's xpu:N is the device leased."""
    out = run_level_zero(
        tmp_path,
        """
        from pytest_gpu.gpu import runtime
        from pytest_gpu.sim.spec import xpu_uuid
        from pytest_gpu.vendors.devices import Device, Inventory
        from pytest_gpu.vendors.intel import XPU
        machine = tuple(Device(i, xpu_uuid(i), 64 << 30) for i in range(4))
        outer = XPU.outer(os.environ)
        inventory = Inventory(tuple(machine[i] for i in XPU.view(machine, outer)), "sysman", "", machine, None,
                              "xpu", outer)
        out["pinned"] = runtime.pin(inventory)
        out["read_back"] = runtime._state.uuids is not None
        os.environ["ZE_AFFINITY_MASK"] = "3"  # a lease's, as the test process has it during the test
        out["enumerated"] = enumerated()
        out["ordinal"] = runtime.in_process(inventory, [3])
        """,
        **({} if mask is None else {"ZE_AFFINITY_MASK": mask}),
    )
    assert out["enumerated"] == len(view)  # not the lease's one device: the list was pinned
    assert out["ordinal"] == [view.index(3)]
    assert out["pinned"] == view and out["read_back"]  # what Level Zero enumerates, read back


def test_discovery_through_sysman_and_an_outer_mask(tmp_path: Path) -> None:
    out = run_fake(
        tmp_path,
        "xpu:sim:4x64GiB;reserved=1GiB",
        """
        from pytest_gpu.gpu.discovery import discover
        from pytest_gpu.vendors.devices import DeviceSpecError
        auto = discover("auto")
        out["auto"] = [auto.vendor, auto.source, auto.describe(), [d.index for d in auto.devices]]
        out["outer"] = [list(p) for p in auto.outer]
        out["uuids"] = [d.uuid for d in auto.machine]
        simulated = discover("xpu:sim:2x64GiB")
        out["sim"] = [simulated.describe(), [d.index for d in simulated.devices], simulated.source]
        for bad in ("xpu:sim:2x64GiB;mig:0=1x8GiB", "xpu:gpu"):  # index lists: test_discovery.py
            try:
                discover(bad)
            except DeviceSpecError as exc:
                out[bad] = str(exc)
        """,
        ZE_AFFINITY_MASK="3,1",
    )
    assert out["auto"] == ["xpu", "sysman", "2 Intel GPUs (2x63GiB)", [1, 3]]
    assert out["outer"] == [["ZE_AFFINITY_MASK", "3,1"]]
    assert out["uuids"] == [xpu_uuid(i) for i in range(4)]
    assert out["sim"] == ["1 simulated Intel GPU (1x64GiB)", [1], "xpu:sim:2x64GiB"]  # the mask's 3 names none
    assert "is an NVIDIA driver's option" in out["xpu:sim:2x64GiB;mig:0=1x8GiB"]
    assert "or simulated Intel GPUs such as xpu:sim:4x64GiB" in out["xpu:gpu"]


def test_a_tile_is_not_verified_from_card_wide_figures() -> None:
    from pytest_gpu.vendors.intel import XpuSampler
    from pytest_gpu.vendors.sampling import Refused

    sampler = XpuSampler.__new__(XpuSampler)  # no driver needed: a tile is refused before asking it
    sampler._handles = {}
    with pytest.raises(Refused, match="per card, not per tile"):
        sampler.memory(f"{xpu_uuid(0)}/tile1")


# -- the simulated torch.xpu -------------------------------------------------------------------


TORCH_XPU = """
import torch
from pytest_gpu.sim import torch_cuda
out["count"] = torch.xpu.device_count()
out["cuda"] = torch.cuda.is_available()
torch.xpu.set_device(1)
out["current"] = torch.xpu.current_device()
out["total"] = torch.xpu.get_device_properties(0).total_memory
try:
    torch.xpu.set_device(out["count"])
except RuntimeError as exc:
    out["bad"] = str(exc)
torch.xpu.set_per_process_memory_fraction(0.25, 1)
kept = torch_cuda.empty(8 << 30)
out["allocated"] = torch.xpu.memory_allocated(1)
try:
    torch_cuda.empty(16 << 30)
except torch.OutOfMemoryError as exc:
    out["oom"] = str(exc).split(".")[0]
kept.free()
out["peak"] = torch.xpu.max_memory_allocated(1)
torch.xpu.reset_peak_memory_stats(1)
out["reserved_before_empty"] = torch.xpu.memory_reserved(1)
torch.xpu.empty_cache()
out["after"] = [torch.xpu.max_memory_allocated(1), torch.xpu.memory_reserved(1)]
"""


def test_torch_xpu_of_the_cpu_build_runs_on_the_fake_machine(tmp_path: Path) -> None:
    require("torch", module="torch")
    out = run_fake(tmp_path, "xpu:sim:4x64GiB", TORCH_XPU, ZE_AFFINITY_MASK="0,2,3")
    assert (out["count"], out["cuda"], out["current"], out["total"]) == (3, False, 1, 64 * GiB)
    assert out["bad"] == "device is out of range, device is 3, total number of device is 3."
    assert out["allocated"] == 8 * GiB
    assert out["oom"] == "XPU out of memory"
    assert out["peak"] == 8 * GiB
    assert out["reserved_before_empty"] == 8 * GiB
    assert out["after"] == [0, 0]


# -- pools ---------------------------------------------------------------------------------


def test_xccl_missing_from_a_torch_version_file() -> None:
    assert build_xccl_missing("__version__ = '2.13.0+cpu'\nxpu: Optional[str] = None\n", "xpu") == (
        "torch 2.13.0+cpu has no XCCL (not an XPU build)"
    )
    assert build_xccl_missing("__version__ = '2.7.0+xpu'\nxpu: Optional[str] = '20250101'\n", "xpu") == (
        "torch 2.7.0+xpu has no XCCL (torch >= 2.8)"
    )
    assert build_xccl_missing("__version__ = '2.9.0+xpu'\nxpu: Optional[str] = '20250101'\n", "xpu") is None


def test_xccl_and_ccl_pools_give_each_rank_a_gpu() -> None:
    for backend in ("xccl", "ccl"):
        spec = build_spec((2,), {"backend": backend})
        assert (spec.backend, spec.gpus_per_rank) == (backend, 1)
        with pytest.raises(GpuRequestError, match=f"backend='{backend}' needs gpus_per_rank >= 1"):
            build_spec((2,), {"backend": backend, "gpus_per_rank": 0})
