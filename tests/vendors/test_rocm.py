"""AMD ROCm (:mod:`pytest_gpu.vendors.amd`): ROCm's visibility variables, and GPUs and process lists
through the real ``amdsmi`` package on a fake AMD machine (``PYTEST_GPU_FAKE_GPUS=amd:sim:…``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import require, run_fake_python
from pytest_gpu.sim.spec import amd_uuid
from pytest_gpu.vendors.amd import lease_env, rocm_view, select
from pytest_gpu.vendors.devices import Device

GiB = 1 << 30
MiB = 1 << 20

# ROCr's order (the tuple's) differs from amdsmi's indices, as it may on a real machine
MACHINE = tuple(Device(index, amd_uuid(index), 192 * GiB) for index in (2, 0, 3, 1))


def run_fake(tmp_path: Path, spec: str, code: str, **extra: str) -> dict[str, Any]:
    """``code`` on the fake machine ``spec`` (:func:`conftest.run_fake_python`)."""
    return run_fake_python(tmp_path, spec, code, amdsmi=True, quiet=True, **extra)


def view(**env: str) -> list[int]:
    return rocm_view(MACHINE, env)


def test_no_variables_see_every_gpu_in_rocr_order() -> None:
    assert view() == [2, 0, 3, 1]


def test_rocr_indices_count_in_rocr_order_not_amdsmi_indices() -> None:
    assert view(ROCR_VISIBLE_DEVICES="0,1") == [2, 0]


def test_rocr_takes_uuids_and_unique_prefixes_in_any_case() -> None:
    assert view(ROCR_VISIBLE_DEVICES=f"{amd_uuid(3)},{amd_uuid(1).upper()}") == [3, 1]
    assert view(ROCR_VISIBLE_DEVICES=amd_uuid(0)[:-1]) == []  # a prefix of all four names none


def test_hip_indexes_into_what_rocr_left() -> None:
    assert view(ROCR_VISIBLE_DEVICES="1,2,3", HIP_VISIBLE_DEVICES="0") == [0]
    assert view(ROCR_VISIBLE_DEVICES="1,2,3", CUDA_VISIBLE_DEVICES="2,0") == [1, 0]


def test_hip_wins_over_cuda_when_both_are_set() -> None:
    assert view(HIP_VISIBLE_DEVICES="1", CUDA_VISIBLE_DEVICES="2") == [0]


def test_hip_does_not_read_gpu_device_ordinal() -> None:
    """ROCclr reads ``GPU_DEVICE_ORDINAL`` for OpenCL only (ROCm/clr ``rocdevice.cpp`` at f9f995c6)."""
    assert view(GPU_DEVICE_ORDINAL="1") == [2, 0, 3, 1]
    assert view(ROCR_VISIBLE_DEVICES="3,2,1", GPU_DEVICE_ORDINAL="1,2", HIP_VISIBLE_DEVICES="1") == [3]


def test_rocr_empty_hides_all_and_a_bad_or_repeated_entry_ends_its_list() -> None:
    assert view(ROCR_VISIBLE_DEVICES="") == []
    assert view(ROCR_VISIBLE_DEVICES="1,9,2") == [0]
    assert view(ROCR_VISIBLE_DEVICES="1,1,2") == [0]  # ROCr's RvdFilter: a repeat terminates
    assert view(ROCR_VISIBLE_DEVICES=" 1 , 2") == [0, 3]  # its tokens are trimmed
    assert select(MACHINE, "GPU-") == ()


def test_hip_empty_is_unset_a_bad_entry_ends_and_a_repeat_is_skipped() -> None:
    """HIP's rules, ROCm/clr ``rocdevice.cpp`` at f9f995c6, not ROCr's."""
    assert view(HIP_VISIBLE_DEVICES="") == [2, 0, 3, 1]  # empty: no filter
    assert view(HIP_VISIBLE_DEVICES="", CUDA_VISIBLE_DEVICES="2") == [3]  # ... and CUDA's is read
    assert view(HIP_VISIBLE_DEVICES="1,7,2") == [0]
    assert view(HIP_VISIBLE_DEVICES="1,1,2") == [0, 3]
    assert view(HIP_VISIBLE_DEVICES="1,") == [0]
    assert view(HIP_VISIBLE_DEVICES=" 1") == view(HIP_VISIBLE_DEVICES="01") == []  # an index written exactly
    assert view(HIP_VISIBLE_DEVICES="GPU-") == [2]  # the first device whose UUID contains it
    assert view(HIP_VISIBLE_DEVICES=amd_uuid(3).upper()) == []  # ROCr's UUIDs are lower-case


def test_a_lease_names_its_uuids_in_rocr_and_counts_into_them_in_hips_variables() -> None:
    env = lease_env((MACHINE[2].uuid, MACHINE[0].uuid))
    assert env == {
        "ROCR_VISIBLE_DEVICES": f"{amd_uuid(3)},{amd_uuid(2)}",
        "GPU_DEVICE_ORDINAL": "0,1",  # ROCclr's takes indices only
        "HIP_VISIBLE_DEVICES": "0,1",  # HIP before rocm-6.2 reads no UUID there: indices into what ROCr left
        "CUDA_VISIBLE_DEVICES": f"{amd_uuid(3)},{amd_uuid(2)}",  # HIP reads it only without HIP's
    }
    assert rocm_view(MACHINE, env) == [3, 2]  # the lease's order: cuda:0 is the first GPU asked for
    # whatever the outer variables said: the lease's replace every one of them
    outer = {"ROCR_VISIBLE_DEVICES": "0", "HIP_VISIBLE_DEVICES": "0"}
    assert rocm_view(MACHINE, {**outer, **env}) == [3, 2]
    # a simulated machine's indices are counted, not repeated, in HIP's
    assert lease_env(("2", "3"))["HIP_VISIBLE_DEVICES"] == "0,1"


# -- through the real amdsmi package and the fake libamd_smi.so ---------------------------------


def test_discovery_through_amdsmi_skips_a_gpu_it_cannot_query(tmp_path: Path) -> None:
    out = run_fake(
        tmp_path,
        "amd:sim:4x192GiB;fault:2=no_permission",
        """
        from pytest_gpu.vendors.amd import amdsmi_devices
        devices, note = amdsmi_devices()
        out["devices"] = [[d.index, d.uuid, d.total_memory, d.name] for d in devices]
        out["note"] = note
        """,
    )
    assert out["devices"] == [
        [0, amd_uuid(0), 192 * GiB, "Simulated AMD GPU 192GiB (0000:05:00.0)"],
        [1, amd_uuid(1), 192 * GiB, "Simulated AMD GPU 192GiB (0000:25:00.0)"],
        [3, amd_uuid(3), 192 * GiB, "Simulated AMD GPU 192GiB (0000:65:00.0)"],
    ]
    assert out["note"].startswith("GPU 2 skipped: amdsmi: AMDSMI_STATUS_NO_PERM")


def test_an_nvidia_machine_has_no_amd_driver(tmp_path: Path) -> None:
    out = run_fake(
        tmp_path,
        "sim:2x16GiB",
        """
        from pytest_gpu.vendors.amd import AmdSmiUnavailable, amdsmi_devices
        try:
            amdsmi_devices()
        except AmdSmiUnavailable as exc:
            out["said"] = str(exc)
        """,
    )
    # no ROCm here: the package finds no libamd_smi.so (what it prints about it is in the message)
    assert out["said"].startswith("amdsmi cannot load libamd_smi.so (")
    assert "libamd_smi.so" in out["said"][len("amdsmi cannot load libamd_smi.so") :]


def test_usage_sees_this_process_allocations_with_the_driver_granularity(tmp_path: Path) -> None:
    out = run_fake(
        tmp_path,
        "amd:sim:2x192GiB;proc-unit=1MiB;context=512MiB",
        f"""
        import os
        from pytest_gpu.sim.ledger import ledger
        from pytest_gpu.vendors.amd import AmdSampler
        from pytest_gpu.vendors.sampling import Refused
        ledger().allocate({GiB + 12345}, 1, None, None)
        driver = AmdSampler()
        uuids = ["{amd_uuid(0)}", "{amd_uuid(1).upper()}"]
        out["pid"] = os.getpid()
        out["processes"] = {{u: {{str(p): n for p, n in driver.processes(u).items()}} for u in uuids}}
        out["used"] = {{u: driver.memory(u) for u in uuids}}
        try:
            driver.memory("GPU-ffffffffffffffff")
        except Refused as exc:
            out["refused"] = str(exc)
        driver.close()
        """,
    )
    pid = str(out["pid"])
    held = 512 * MiB + GiB + 12345
    assert out["processes"] == {amd_uuid(0): {}, amd_uuid(1).upper(): {pid: held - held % MiB}}
    assert out["used"] == {amd_uuid(0): [0, None], amd_uuid(1).upper(): [held, None]}  # device totals stay exact
    assert out["refused"] == "amdsmi does not report it"


@pytest.mark.parametrize(
    ("env", "count", "hip"),
    [
        ({}, 4, 4),
        ({"ROCR_VISIBLE_DEVICES": "1,2,3"}, 3, 3),
        ({"ROCR_VISIBLE_DEVICES": "1,2,3", "HIP_VISIBLE_DEVICES": "0"}, 1, 1),
        ({"HIP_VISIBLE_DEVICES": "0,1", "CUDA_VISIBLE_DEVICES": "0"}, 2, 2),  # HIP's wins, as in torch
        ({"CUDA_VISIBLE_DEVICES": "2,9"}, 1, 1),
        ({"ROCR_VISIBLE_DEVICES": amd_uuid(1), "HIP_VISIBLE_DEVICES": amd_uuid(1)}, 1, 1),  # a lease's
        # torch's _parse_visible_devices and HIP (ROCm/clr rocdevice.cpp) part here:
        ({"GPU_DEVICE_ORDINAL": "1"}, 4, 4),  # neither reads it
        ({"HIP_VISIBLE_DEVICES": "1,1,2"}, 0, 2),  # torch: a repeat empties the list; HIP skips it
        ({"HIP_VISIBLE_DEVICES": "", "CUDA_VISIBLE_DEVICES": "2"}, 0, 1),  # torch: empty hides all; HIP: unset
    ],
)
def test_torch_counts_as_torch_on_rocm_does(tmp_path: Path, env: dict[str, str], count: int, hip: int) -> None:
    """torch's own ROCm path (``_device_count_amdsmi``), through amdsmi and the fake library, before
    CUDA starts; HIP's count (the simulated HIP's, ``torch._C._cuda_getDeviceCount``) once it has."""
    require("torch", module="torch")
    out = run_fake(
        tmp_path,
        "amd:sim:4x192GiB",
        """
        import torch
        out["hip"] = torch.version.hip
        out["count"] = torch.cuda.device_count()
        out["uuids"] = torch.cuda._raw_device_uuid_amdsmi()
        out["hip_count"] = torch._C._cuda_getDeviceCount()
        """,
        **env,
    )
    assert out["hip"].startswith("6.4.")
    assert out["count"] == count
    assert out["hip_count"] == hip
    assert out["uuids"] == [amd_uuid(i)[4:] for i in range(4)]  # the ASIC serial, as torch matches HIP's UUIDs


def test_a_ray_head_on_amd_gpus_counts_hip_ids_into_the_runs_gpus() -> None:
    from pytest_gpu.raycluster.head import head_env

    environ = {"ROCR_VISIBLE_DEVICES": amd_uuid(2), "HIP_VISIBLE_DEVICES": "0", "GPU_DEVICE_ORDINAL": "0"}  # a lease's
    from pytest_gpu.vendors.amd import AMD

    env = head_env(environ, gpu_env=AMD.ray_env([Device(i, amd_uuid(i), 192 * GiB) for i in (1, 3)]))
    assert env["ROCR_VISIBLE_DEVICES"] == f"{amd_uuid(1)},{amd_uuid(3)}"
    # ray 2.60 reads HIP_VISIBLE_DEVICES on AMD (and refuses ROCR_VISIBLE_DEVICES without it)
    assert env["HIP_VISIBLE_DEVICES"] == env["CUDA_VISIBLE_DEVICES"] == env["GPU_DEVICE_ORDINAL"] == "0,1"
    assert rocm_view(MACHINE, env) == [1, 3]


def test_foreign_usage_by_difference_where_amdsmi_cannot_list(tmp_path: Path) -> None:
    """A process list amdsmi refuses (no permission, say): foreign is used VRAM less what pytest-gpu
    accounts for, the driver's reserve included, and the note says so in amdsmi's name."""
    out = run_fake(
        tmp_path,
        "amd:sim:1x16GiB;reserved=1GiB",
        f"""
        from pytest_gpu.vendors import amd, sampling
        from pytest_gpu.gpu.foreign import ForeignSampler

        def refuse(self, uuid):
            raise sampling.Unlistable("amdsmi cannot list the processes there (AMDSMI_STATUS_NO_PERM)")

        amd.AmdSampler.processes = refuse
        found = ForeignSampler(["{amd_uuid(0)}"]).sample(set(), {{"{amd_uuid(0)}": 0}})["{amd_uuid(0)}"]
        out["bytes"], out["note"] = found.bytes, found.note
        """,
    )
    assert out["bytes"] == GiB  # the reserve: amdsmi has no figure for it
    assert out["note"] == (
        f"amdsmi cannot list the processes there (AMDSMI_STATUS_NO_PERM): foreign usage on {amd_uuid(0)} is its used "
        "memory less the 0B pytest-gpu accounts for (the driver's reserve, which this amdsmi does not report, "
        "counts as foreign)"
    )
