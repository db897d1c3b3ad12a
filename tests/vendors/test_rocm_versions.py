"""ROCm releases as they differ (issue 31), through the fake AMD libraries at the release
``PYTEST_GPU_SIM_ROCM`` names: HIP's variables before and after rocm-6.2.0, amdsmi's process list
before and after rocm-6.1.2, one DRM client under two fds, an APU, and amdsmi kept open once
per process, and GPUs without a unique id."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import run_fake_python
from pytest_gpu.sim.spec import amd_uuid, parse
from pytest_gpu.vendors.amd import lease_env

GiB = 1 << 30
MiB = 1 << 20
SPEC = "amd:sim:4x16GiB;rocr-order=3,0,1,2"  # ROCr's order differs from amdsmi's, as it may


def run_fake(tmp_path: Path, spec: str, code: str, rocm: str = "", **extra: str) -> dict[str, Any]:
    """``code`` on the fake machine ``spec`` at ROCm release ``rocm`` ("": the newest)."""
    return run_fake_python(tmp_path, spec, code, amdsmi=True, quiet=True, PYTEST_GPU_SIM_ROCM=rocm, **extra)


HIP = """
from pytest_gpu.sim.hip import preload
from pytest_gpu.vendors.amd import hip_init
preload()
out["hip"], out["note"] = hip_init()
"""


@pytest.mark.parametrize("rocm", ["6.1.0", "6.2.0", ""], ids=["rocm-6.1", "rocm-6.2", "newest"])
def test_a_lease_reaches_hip_before_and_after_rocm_6_2(tmp_path: Path, rocm: str) -> None:
    """A lease of amdsmi's GPUs 1 and 3 (real UUIDs, as discovery gives them) is what HIP
    enumerates, in that order, whichever clr reads the variables: UUIDs in ROCr's, indices in HIP's."""
    env = lease_env([amd_uuid(1), amd_uuid(3)])
    out = run_fake(tmp_path, SPEC, HIP, rocm, **env)
    assert out["hip"] == [amd_uuid(1)[4:], amd_uuid(3)[4:]], out["note"]


@pytest.mark.parametrize(("rocm", "seen"), [("6.1.0", None), ("6.2.0", [2])])
def test_the_fake_hip_reads_uuids_in_its_variables_only_from_rocm_6_2(
    tmp_path: Path, rocm: str, seen: list[int] | None
) -> None:
    """clr before 52db98ed (rocm-6.2.0) reads every entry as an index: ``GPU-…`` ends the list."""
    out = run_fake(tmp_path, SPEC, HIP, rocm, HIP_VISIBLE_DEVICES=amd_uuid(2))
    assert out["hip"] == (None if seen is None else [amd_uuid(2)[4:]])
    if seen is None:
        assert "hipErrorNoDevice" in out["note"]


LISTED = f"""
import os
from pytest_gpu.sim.ledger import ledger
from pytest_gpu.vendors.amd import AmdSampler, open_amdsmi
ledger().allocate({GiB + 12345}, 1, None, None)
amdsmi, handles = open_amdsmi()
listed = amdsmi.amdsmi_get_gpu_process_list(handles["{amd_uuid(1)}"])
out["shape"] = [type(p).__name__ for p in listed]
out["pid"] = os.getpid()
out["processes"] = {{str(p): n for p, n in AmdSampler().processes("{amd_uuid(1)}").items()}}
"""


@pytest.mark.parametrize(
    ("rocm", "shape"),
    [("6.1.0", "c_uint"), ("6.1.1", "struct_amdsmi_proc_info_t"), ("6.1.2", "dict"), ("", "dict")],
)
def test_the_process_list_of_every_amdsmi_release_is_read(tmp_path: Path, rocm: str, shape: str) -> None:
    """Before rocm-6.1.2 the list holds process handles (6.1.1: structs), which
    ``amdsmi_get_gpu_process_info`` turns into records: no TypeError escapes the sampler."""
    out = run_fake(tmp_path, "amd:sim:2x16GiB;context=512MiB", LISTED, rocm)
    assert out["shape"] == [shape]
    assert out["processes"] == {str(out["pid"]): 512 * MiB + GiB + 12345}


DOUBLED = f"""
import os
from pytest_gpu.sim.ledger import ledger
from pytest_gpu.vendors.amd import AmdSampler, open_amdsmi
from pytest_gpu.vendors.sampling import Unlistable
ledger().allocate({2 * GiB}, 0, None, None)
amdsmi, handles = open_amdsmi()
out["raw"] = [p["memory_usage"]["vram_mem"] for p in amdsmi.amdsmi_get_gpu_process_list(handles["{amd_uuid(0)}"])]
out["used"] = amdsmi.amdsmi_get_gpu_memory_usage(handles["{amd_uuid(0)}"], amdsmi.AmdSmiMemoryType.VRAM)
try:
    out["processes"] = list(AmdSampler().processes("{amd_uuid(0)}").values())
except Unlistable as exc:
    out["unlistable"] = exc.cause
"""


@pytest.mark.parametrize("rocm", ["7.0.2", ""], ids=["summed-per-fd", "per-client"])
def test_one_client_under_two_fds_is_not_believed_twice(tmp_path: Path, rocm: str) -> None:
    """amdsmi up to 7.0 sums drm-memory-vram over every fd of the client: a process's 2.5 GiB
    reads 5 GiB, more than the GPU's used VRAM; the sampler says so instead of charging it."""
    out = run_fake(tmp_path, "amd:sim:2x16GiB;context=512MiB;proc-fds=2", DOUBLED, rocm)
    held = 512 * MiB + 2 * GiB
    assert out["used"] == held
    if rocm:
        assert out["raw"] == [2 * held]  # the model: amdsmi's figure, doubled
        assert "add up to 5GiB, more than the 2.5GiB in use there" in out["unlistable"]
        assert "processes" not in out
    else:
        assert out["raw"] == [held]
        assert out["processes"] == [held]


def test_an_apus_zero_vram_is_not_measured(tmp_path: Path) -> None:
    """MI300A: a process's memory is GTT, vram_mem 0: unknown (None), not a measured 0."""
    out = run_fake(tmp_path, "amd:sim:2x16GiB;context=512MiB;apu", DOUBLED.replace("2 * GiB", "GiB"))
    assert out["raw"] == [0]
    assert out["processes"] == [None]


ONCE = f"""
import ctypes, os
from pytest_gpu.sim.amdsmi import LIBRARY
from pytest_gpu.sim.ledger import ledger
from pytest_gpu.vendors.amd import AmdSampler
lib = ctypes.CDLL(LIBRARY)
lib.fake_amdsmi_inits.restype = ctypes.c_long
for _ in range(20):  # as a verifier opens one at the start and one at the end of each GPU test
    sampler = AmdSampler()
    sampler.processes("{amd_uuid(1)}")
    sampler.close()
sampler.forget("{amd_uuid(1)}")  # a refused GPU: its handles are walked again, amdsmi is not re-opened
out["after_forget"] = list(AmdSampler().processes("{amd_uuid(1)}").values())
out["inits"] = lib.fake_amdsmi_inits()
ledger().allocate({GiB}, 1, None, None)
read, write = os.pipe()
child = os.fork()
if child == 0:  # a forked child opens its own amdsmi and reads its own process list
    figures = AmdSampler().processes("{amd_uuid(1)}")
    os.write(write, f"{{lib.fake_amdsmi_inits()}} {{figures.get(os.getppid(), 0)}}".encode())
    os._exit(0)
os.waitpid(child, 0)
out["child"] = os.read(read, 100).decode().split()
"""


def test_amdsmi_is_opened_once_per_process_and_again_in_a_forked_child(tmp_path: Path) -> None:
    out = run_fake(tmp_path, "amd:sim:2x16GiB;context=512MiB", ONCE)
    assert out["inits"] == 1  # not one amdsmi_init and GPU walk per sample
    assert out["after_forget"] == []  # still answered (nothing there yet)
    assert out["child"] == ["2", str(512 * MiB + GiB)]


@pytest.mark.parametrize("option", ["proc-fds=0", "proc-fds=x", "apu=1", "no-uuid=2", "no-uuid=x"])
def test_the_new_machine_options_are_checked(option: str) -> None:
    with pytest.raises(ValueError, match="amd:sim:2x16GiB"):
        parse(f"amd:sim:2x16GiB;{option}")


NO_ID = "amd:sim:4x16GiB;rocr-order=3,0,1,2;no-uuid=1,2;context=512MiB"  # ROCr's GPUs 2 and 3 have no unique id

UNNAMED = f"""
from pytest_gpu.sim.ledger import ledger
from pytest_gpu.vendors.amd import AMD, AmdSampler, amdsmi_devices, rocm_view
devices, out["note"] = amdsmi_devices()
out["keys"] = [[d.index, d.uuid] for d in devices]
ledger().allocate({GiB}, 2, None, None)
sampler = AmdSampler()
out["processes"] = {{d.uuid: list(sampler.processes(d.uuid).values()) for d in devices}}
by = {{d.index: d for d in devices}}
out["env"] = AMD.lease_env(AMD.lease_names([by[2], by[3]]))
out["predicted"] = rocm_view(devices, out["env"])
"""


def test_gpus_without_a_unique_id_are_keyed_and_leased_by_rocr_index(tmp_path: Path) -> None:
    """HSA calls every GPU without a unique id ``GPU-XX`` and ROCr's filter matches no UUID to it:
    each is keyed by its ROCr index, which is also how a lease names it to ROCr."""
    out = run_fake(tmp_path, NO_ID, UNNAMED)
    assert out["note"] == ""
    assert out["keys"] == [[3, amd_uuid(3)], [0, amd_uuid(0)], [1, "GPU-xx:2"], [2, "GPU-xx:3"]]
    assert out["processes"] == {amd_uuid(3): [], amd_uuid(0): [], "GPU-xx:2": [], "GPU-xx:3": [512 * MiB + GiB]}
    assert out["env"]["ROCR_VISIBLE_DEVICES"] == f"3,{amd_uuid(3)}"
    assert out["env"]["HIP_VISIBLE_DEVICES"] == out["env"]["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert out["predicted"] == [2, 3]
    # what ROCr and HIP (the fake libamdhip64.so) then enumerate: the GPU without an id, then GPU 3
    hip = run_fake(tmp_path, NO_ID, HIP, **out["env"])
    assert hip["hip"] == ["xx", amd_uuid(3)[4:]], hip["note"]
