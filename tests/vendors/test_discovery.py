"""``--gpus`` by vendor (:mod:`pytest_gpu.gpu.discovery`): one vendor's GPUs per run, AMD's through
amdsmi on a fake AMD machine, and what a lease of them sets."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

from conftest import run_fake_python
from pytest_gpu.gpu.discovery import discover, split
from pytest_gpu.sim.spec import amd_uuid
from pytest_gpu.vendors.devices import Device, DeviceSpecError, Inventory

GiB = 1 << 30


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("auto", (None, "auto")),
        ("0,2", (None, "0,2")),
        ("sim:4x16GiB;mig:0=2x8GiB", (None, "sim:4x16GiB;mig:0=2x8GiB")),
        ("nvidia:auto", ("nvidia", "auto")),
        (" AMD:auto", ("amd", "auto")),
        ("nvidia:0,2", ("nvidia", "0,2")),
    ],
)
def test_split(spec: str, expected: tuple[str | None, str]) -> None:
    assert split(spec) == expected


def run_fake(tmp_path: Path, spec: str, code: str, **extra: str) -> dict[str, Any]:
    """``code`` on the fake machine ``spec`` (:func:`conftest.run_fake_python`)."""
    return run_fake_python(tmp_path, spec, code, amdsmi=True, **extra)


@pytest.mark.parametrize(("spec", "both"), [("nvidia:0,amd:1", "amd and nvidia"), ("nvidia:0,xpu:1", "nvidia and xpu")])
def test_a_mixed_request_names_both_vendors(spec: str, both: str) -> None:
    with pytest.raises(DeviceSpecError, match=f"names {both} GPUs; a run leases one vendor's GPUs"):
        discover(spec)


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ("intel:auto", "unknown vendor 'intel'"),
        ("0,nvidia:1", "the vendor goes first"),
        ("amd:sim:2x16GiB", "expected amd:auto or amd: and amdsmi's indices"),
        ("nvidia:sim:2x16GiB", "simulated devices take no vendor; expected sim:2x16GiB"),
    ],
)
def test_requests_that_cannot_be_met_say_what_was_expected(spec: str, said: str) -> None:
    with pytest.raises(DeviceSpecError, match=said):
        discover(spec, {})


def test_an_amd_inventory_crosses_the_wire_with_its_vendor_and_variables() -> None:
    device = Device(0, amd_uuid(0), 192 * GiB, "MI300X")
    inventory = Inventory((device,), "amdsmi", "", (device,), None, "amd", (("ROCR_VISIBLE_DEVICES", "0"),))
    assert Inventory.from_wire(json.loads(json.dumps(inventory.to_wire()))) == inventory


DESCRIBE = """
from pytest_gpu.gpu.discovery import discover
def describe(inv):
    return {"vendor": inv.vendor, "source": inv.source, "devices": [d.index for d in inv.devices],
            "machine": [d.index for d in inv.machine], "outer": [list(p) for p in inv.outer], "note": inv.note}
"""


def test_auto_finds_amd_gpus_where_nvml_finds_none(tmp_path: Path) -> None:
    out = run_fake(
        tmp_path,
        "amd:sim:4x192GiB",
        DESCRIBE
        + textwrap.dedent(
            """
        out["auto"] = describe(discover("auto"))
        out["amd"] = describe(discover("amd:auto"))
        out["nvidia"] = describe(discover("nvidia:auto"))
        """
        ),
    )
    amd = {
        "vendor": "amd",
        "source": "amdsmi",
        "devices": [0, 1, 2, 3],
        "machine": [0, 1, 2, 3],
        "outer": [],
        "note": "",
    }
    assert out["auto"] == out["amd"] == amd
    assert out["nvidia"]["vendor"] == "nvidia" and out["nvidia"]["devices"] == []
    assert "Driver Not Loaded" in out["nvidia"]["note"]


def test_auto_on_an_nvidia_machine_is_nvidia_and_amd_auto_says_why_not(tmp_path: Path) -> None:
    out = run_fake(
        tmp_path,
        "sim:2x16GiB",
        DESCRIBE
        + textwrap.dedent(
            """
        out["auto"] = describe(discover("auto"))
        out["amd"] = describe(discover("amd:auto"))
        """
        ),
    )
    assert out["auto"]["vendor"] == "nvidia" and out["auto"]["devices"] == [0, 1]
    assert out["amd"]["devices"] == [] and out["amd"]["note"].startswith("amdsmi cannot load libamd_smi.so")


def test_outer_rocm_variables_narrow_the_run_and_its_leases_name_uuids(tmp_path: Path) -> None:
    out = run_fake(
        tmp_path,
        "amd:sim:4x192GiB",
        DESCRIBE
        + textwrap.dedent(
            """
        import os
        from pytest_gpu.gpu import isolation, runtime
        inv = discover("auto")
        out["inv"] = describe(inv)
        out["view"] = runtime.view(inv)
        lease = isolation.make_lease("k", [3], GiB, False, 0.0, inv, "t")
        out["env"] = {k: v for k, v in lease.env.items() if "VISIBLE" in k or "ORDINAL" in k}
        out["device"] = lease.device
        """
        ).replace("GiB", str(GiB)),
        ROCR_VISIBLE_DEVICES=f"1,{amd_uuid(3)},2",
        HIP_VISIBLE_DEVICES="1,2",
    )
    assert out["inv"]["devices"] == [3, 2]  # ROCr kept 1, 3, 2; HIP counts into those
    assert out["inv"]["machine"] == [0, 1, 2, 3]
    assert out["inv"]["outer"] == [["ROCR_VISIBLE_DEVICES", f"1,{amd_uuid(3)},2"], ["HIP_VISIBLE_DEVICES", "1,2"]]
    assert out["view"] == [3, 2]  # this process's simulated HIP enumerates as ROCm would
    assert out["env"] == {
        "ROCR_VISIBLE_DEVICES": amd_uuid(3),
        "GPU_DEVICE_ORDINAL": "0",
        "HIP_VISIBLE_DEVICES": amd_uuid(3),  # outer HIP_VISIBLE_DEVICES=1,2 cannot narrow it
        "CUDA_VISIBLE_DEVICES": amd_uuid(3),
    }
    assert out["device"] == "cuda:0"


def test_a_subprocess_under_a_lease_env_sees_exactly_the_lease(tmp_path: Path) -> None:
    both = f"{amd_uuid(2)},{amd_uuid(0)}"
    lease = {
        "ROCR_VISIBLE_DEVICES": both,
        "GPU_DEVICE_ORDINAL": "0,1",
        "HIP_VISIBLE_DEVICES": both,
        "CUDA_VISIBLE_DEVICES": both,
    }
    out = run_fake(tmp_path, "amd:sim:4x192GiB", "from pytest_gpu.sim import cuda\nout['view'] = cuda.init()", **lease)
    assert out["view"] == [2, 0]


def test_rocr_indices_count_in_rocr_order_where_it_differs_from_amdsmi(tmp_path: Path) -> None:
    """amdsmi's GPU 3 is ROCr's first: ROCR_VISIBLE_DEVICES=0 means it, and leases name UUIDs."""
    out = run_fake(
        tmp_path,
        "amd:sim:4x192GiB;rocr-order=3,0,1,2",
        DESCRIBE
        + textwrap.dedent(
            """
            from pytest_gpu.gpu import isolation, runtime
            from pytest_gpu.sim import cuda
            inv = discover("auto")
            out["inv"] = describe(inv)
            out["view"] = runtime.view(inv)
            out["sim"] = cuda.init()
            out["env"] = isolation.make_lease("k", [3], 1 << 30, False, 0.0, inv, "t").env["ROCR_VISIBLE_DEVICES"]
            """
        ),
        ROCR_VISIBLE_DEVICES="0,1",
    )
    assert out["inv"]["machine"] == [3, 0, 1, 2]  # ROCr's order, amdsmi's indices
    assert out["inv"]["devices"] == out["view"] == out["sim"] == [3, 0]
    assert out["env"] == amd_uuid(3)


def test_amd_index_lists_are_amdsmi_indices_visible_to_rocm(tmp_path: Path) -> None:
    out = run_fake(
        tmp_path,
        "amd:sim:4x192GiB;rocr-order=3,0,1,2",
        DESCRIBE
        + textwrap.dedent(
            """
            from pytest_gpu.vendors.devices import DeviceSpecError
            out["picked"] = describe(discover("amd:2,0"))
            for spec in ("amd:7", "amd:1,1", "amd:1"):
                try:
                    discover(spec)
                except DeviceSpecError as exc:
                    out[spec] = str(exc)
            """
        ),
        ROCR_VISIBLE_DEVICES="0,1,3",  # ROCr's 0, 1, 3: amdsmi's 3, 0, 2
    )
    assert out["picked"]["devices"] == [2, 0] and out["picked"]["vendor"] == "amd"
    assert "no usable AMD GPU with amdsmi index [7]; this machine has [0, 1, 2, 3]" in out["amd:7"]
    assert "an index is listed twice" in out["amd:1,1"]
    assert "AMD GPU [1] is hidden by ROCR_VISIBLE_DEVICES='0,1,3'" in out["amd:1"]


def test_an_ordinal_hip_cannot_see_names_rocms_variables(tmp_path: Path) -> None:
    out = run_fake(
        tmp_path,
        "amd:sim:2x192GiB",
        textwrap.dedent(
            """
            from pytest_gpu.sim import cuda
            from pytest_gpu.sim.ledger import SimDeviceError
            try:
                cuda.unit_of(1)
            except SimDeviceError as exc:
                out["said"] = str(exc)
            """
        ),
        ROCR_VISIBLE_DEVICES="1",
    )
    assert out["said"].endswith("(its CUDA started with ROCR_VISIBLE_DEVICES='1')")


def test_auto_on_a_machine_with_both_takes_nvidias_and_names_amds(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from pytest_gpu.gpu import discovery
    from pytest_gpu.sim.spec import parse
    from pytest_gpu.vendors import registry as vendors

    nvidia = parse("sim:2x80GiB").devices()[0]
    amd = tuple(Device(i, amd_uuid(i), 192 * GiB) for i in range(8))
    monkeypatch.setattr(vendors.NVIDIA, "devices", lambda: (nvidia, ""))
    monkeypatch.setattr(vendors.AMD, "devices", lambda: (amd, ""))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "amdsmi" else real_find_spec(name, *a)
    )
    found = discovery.discover("auto", {})
    assert found.vendor == "nvidia" and found.devices == nvidia
    assert found.note == "this machine also has 8 AMD GPUs (8x192GiB): --gpus amd:auto leases those instead"
    assert discovery.discover("nvidia:auto", {}).note == ""  # asked for NVIDIA's: nothing to say
    assert discovery.discover("amd:auto", {}).devices == amd
