"""``--gpus`` by vendor (:mod:`pytest_gpu.gpu.discovery`): one vendor's GPUs per run, each
vendor's through its driver on a fake machine of its own (what every vendor does alike is one
test parametrized over the vendors; ROCm's own rules after them), and what a lease of them sets."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

from conftest import run_fake_python
from pytest_gpu.gpu.discovery import discover, split
from pytest_gpu.sim.spec import amd_uuid, parse
from pytest_gpu.vendors import registry as vendors
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


# each vendor's fake machine, and the words of each vendor's driver library where it is absent
MACHINES = {
    "nvidia": ("sim:4x16GiB", "nvml"),
    "amd": ("amd:sim:4x16GiB", "amdsmi"),
    "xpu": ("xpu:sim:4x16GiB", "sysman"),
}
ABSENT = {
    "nvidia": "NVML unavailable: Driver Not Loaded",  # a fake machine loads the fake NVML, answering so
    "amd": "amdsmi cannot load libamd_smi.so",
    "xpu": "no Level Zero loader",
}


@pytest.mark.parametrize("vendor", list(MACHINES))
def test_auto_is_the_machines_vendor_and_each_other_vendor_says_why_not(tmp_path: Path, vendor: str) -> None:
    """``--gpus auto`` takes the GPUs of the vendor whose driver answers; another vendor's
    ``auto`` finds none and says what its driver said."""
    spec, source = MACHINES[vendor]
    asked = "".join(f'out["{v}"] = describe(discover("{v}:auto"))\n' for v in MACHINES)
    out = run_fake(tmp_path, spec, DESCRIBE + 'out["auto"] = describe(discover("auto"))\n' + asked)
    found = {"vendor": vendor, "source": source, "devices": [0, 1, 2, 3], "machine": [0, 1, 2, 3], "outer": []}
    assert out["auto"] == out[vendor] == {**found, "note": ""}
    for other in [v for v in MACHINES if v != vendor]:
        assert out[other]["vendor"] == other and out[other]["devices"] == [], out[other]
        assert out[other]["note"].startswith(ABSENT[other]), out[other]


PRESENT = {
    "nvidia": "NVML unavailable: Driver Not Loaded",
    "amd": "amdsmi unavailable: AMDSMI_STATUS_DRIVER_NOT_LOADED",
    "xpu": "Level Zero Sysman unavailable (zesInit returned ZE_RESULT_ERROR_UNINITIALIZED)",
}


@pytest.mark.parametrize("vendor", list(MACHINES))
def test_a_vendors_driver_on_a_machine_without_its_gpus_says_so(tmp_path: Path, vendor: str) -> None:
    """The vendor's driver library is there (its fake, loaded) but no GPU of its vendor answers:
    ``{vendor}:auto`` finds none, in the driver's own words, on every other vendor's machine."""
    for other in [v for v in MACHINES if v != vendor]:
        out = run_fake(
            tmp_path / other,
            MACHINES[other][0],
            f"""
            from pytest_gpu.sim import amdsmi, zes
            amdsmi.preload()  # every vendor's library is there: the machine has its vendor's GPUs only
            zes.preload()
            from pytest_gpu.gpu.discovery import discover
            found = discover("{vendor}:auto")
            out["devices"], out["note"] = len(found.devices), found.note
            """,
        )
        assert out == {"devices": 0, "note": PRESENT[vendor]}, other


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
        "HIP_VISIBLE_DEVICES": "0",  # into what ROCr left: outer HIP_VISIBLE_DEVICES=1,2 cannot narrow it
        "CUDA_VISIBLE_DEVICES": amd_uuid(3),  # read by HIP only without HIP's: programs read it
    }
    assert out["device"] == "cuda:0"


@pytest.mark.parametrize(
    ("vendor", "seen"), [("nvidia", [2, 0]), ("amd", [2, 0]), ("xpu", [0, 2])], ids=["nvidia", "amd", "xpu"]
)
def test_a_subprocess_under_a_lease_env_sees_exactly_the_lease(tmp_path: Path, vendor: str, seen: list[int]) -> None:
    """The simulated runtime of a fresh process under a lease's variables (of GPUs 2 and 0)
    enumerates exactly the lease, as the vendor's runtime would: in the lease's order, but on
    Intel GPUs, where Level Zero keeps the driver's order."""
    implementation = vendors.of(vendor)
    machine = parse(MACHINES[vendor][0]).devices()[0]
    lease = implementation.lease_env(implementation.lease_names([machine[2], machine[0]]))
    out = run_fake(tmp_path, MACHINES[vendor][0], "from pytest_gpu.sim import cuda\nout['view'] = cuda.init()", **lease)
    assert out["view"] == seen


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


# (the machine, the outer variable that leaves GPUs 0, 2 and 3 visible, what an index the machine
# lacks and one the variable hides are told); AMD's indices are amdsmi's, ROCr's order another
INDEX_LISTS = {
    "nvidia": (
        "sim:4x16GiB",
        {"CUDA_VISIBLE_DEVICES": "0,2,3"},
        "no usable GPU with index [7]; this machine has [0, 1, 2, 3]",
        "GPU [1] is hidden by CUDA_VISIBLE_DEVICES='0,2,3'",
    ),
    "amd": (
        "amd:sim:4x192GiB;rocr-order=3,0,1,2",
        {"ROCR_VISIBLE_DEVICES": "0,1,3"},  # ROCr's 0, 1, 3: amdsmi's 3, 0, 2
        "no usable AMD GPU with amdsmi index [7]; this machine has [0, 1, 2, 3]",
        "AMD GPU [1] is hidden by ROCR_VISIBLE_DEVICES='0,1,3'",
    ),
    "xpu": (
        "xpu:sim:4x64GiB",
        {"ZE_AFFINITY_MASK": "3,0,2"},
        "no Intel GPU device [7]; Level Zero Sysman reports [0, 1, 2, 3]",
        "Intel GPU [1] is hidden by ZE_AFFINITY_MASK='3,0,2'",
    ),
}


@pytest.mark.parametrize("vendor", list(INDEX_LISTS))
def test_an_index_list_is_the_drivers_indices_the_outer_variable_leaves(tmp_path: Path, vendor: str) -> None:
    """``--gpus {vendor}:2,0`` takes those GPUs by the driver's indices; one the machine lacks, one
    listed twice and one the outer variable hides are each an error that says so."""
    spec, outer, unknown, hidden = INDEX_LISTS[vendor]
    out = run_fake(
        tmp_path,
        spec,
        DESCRIBE
        + textwrap.dedent(
            f"""
            from pytest_gpu.vendors.devices import DeviceSpecError
            out["picked"] = describe(discover("{vendor}:2,0"))
            for spec in ("{vendor}:7", "{vendor}:1,1", "{vendor}:1"):
                try:
                    discover(spec)
                except DeviceSpecError as exc:
                    out[spec] = str(exc)
            """
        ),
        **outer,
    )
    assert out["picked"]["devices"] == [2, 0] and out["picked"]["vendor"] == vendor
    assert unknown in out[f"{vendor}:7"]
    assert "an index is listed twice" in out[f"{vendor}:1,1"]
    assert hidden in out[f"{vendor}:1"]


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
