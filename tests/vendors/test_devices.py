"""--gpus values (:mod:`pytest_gpu.gpu.discovery`), simulated devices (:mod:`pytest_gpu.sim.spec`),
CUDA_VISIBLE_DEVICES selection (:mod:`pytest_gpu.vendors.nvidia`), the wire form (:mod:`pytest_gpu.vendors.devices`)."""

from __future__ import annotations

import pytest

from pytest_gpu.base.requests import SIZE_FORM
from pytest_gpu.gpu.discovery import discover, simulated
from pytest_gpu.sim.spec import gpu_uuid as sim_uuid
from pytest_gpu.sim.spec import parse
from pytest_gpu.vendors import amd, intel, nvidia
from pytest_gpu.vendors.devices import Device, DeviceSpecError, Inventory
from pytest_gpu.vendors.nvidia import GPUS_FORM, NVIDIA, NvmlUnavailable, select_visible

GiB = 2**30

# A hand-made "real" machine: UUIDs shaped like NVML's, two of them sharing a prefix.
A100 = Device(0, "GPU-aaaa1111-0000-0000-0000-000000000000", 80 * GiB, "NVIDIA A100")
H100 = Device(1, "GPU-bbbb2222-0000-0000-0000-000000000000", 80 * GiB, "NVIDIA H100")
L4_A = Device(2, "GPU-cccc3333-0000-0000-0000-000000000000", 24 * GiB, "NVIDIA L4")
L4_B = Device(3, "GPU-cccc4444-0000-0000-0000-000000000000", 24 * GiB, "NVIDIA L4")
MACHINE = (A100, H100, L4_A, L4_B)


def _no_nvml() -> tuple[Device, ...]:
    raise NvmlUnavailable("NVML unavailable: NVML Shared Library Not Found")


def _no_amdsmi() -> tuple[Device, ...]:
    raise amd.AmdSmiUnavailable("amdsmi is not installed (No module named 'amdsmi')")


def _no_level_zero(environ: object) -> tuple[Device, ...]:
    raise intel.ZesUnavailable("no Level Zero loader (libze_loader.so.1: cannot open shared object file)")


@pytest.fixture
def without_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPU driver of any vendor: NVML, amdsmi and Level Zero's loader are all missing."""
    monkeypatch.setattr(nvidia, "nvml_devices", _no_nvml)
    monkeypatch.setattr(amd, "amdsmi_devices", _no_amdsmi)
    monkeypatch.setattr(intel, "sysman_devices", _no_level_zero)


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvidia, "nvml_devices", lambda: (MACHINE, ""))


def parse_sim_spec(spec: str) -> tuple[Device, ...]:
    """The usable devices of a simulated machine (what its driver reports)."""
    return parse(spec).devices()[0]


# -- simulated machines ------------------------------------------------------------------


def test_sim_spec_uniform() -> None:
    got = parse_sim_spec("sim:4x16GiB")
    assert [d.index for d in got] == [0, 1, 2, 3]
    assert {d.total_memory for d in got} == {16 * GiB}
    assert all(d.simulated for d in got)
    assert [d.uuid for d in got] == [sim_uuid(i) for i in range(4)]
    assert got[0].name == "Simulated GPU 16GiB"


def test_sim_spec_mixed_sizes_keep_their_order() -> None:
    got = parse_sim_spec("sim:2x80GiB,2x24GiB")
    assert [(d.index, d.total_memory) for d in got] == [(0, 80 * GiB), (1, 80 * GiB), (2, 24 * GiB), (3, 24 * GiB)]


@pytest.mark.parametrize(
    ("spec", "sizes"),
    [
        ("sim:16GiB", [16 * GiB]),  # count defaults to 1
        ("sim: 2 x 1GiB ", [GiB, GiB]),
        ("sim:2X1GiB", [GiB, GiB]),
        ("sim:1x8GB", [8 * 10**9]),
        ("2x1GiB", [GiB, GiB]),  # the prefix is optional here
    ],
)
def test_sim_spec_forms(spec: str, sizes: list[int]) -> None:
    assert [d.total_memory for d in parse_sim_spec(spec)] == sizes


def test_sim_uuids_are_unique_and_nvml_shaped() -> None:
    uuids = [d.uuid for d in parse_sim_spec("sim:12x1GiB")]
    assert len(set(uuids)) == 12
    assert all(u.startswith("GPU-") and len(u) == len(A100.uuid) for u in uuids)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("sim:", "--gpus 'sim:': no simulated devices given; expected e.g. sim:4x16GiB"),
        ("sim:  ", "--gpus 'sim:  ': no simulated devices given; expected e.g. sim:4x16GiB"),
        ("sim:0x16GiB", "--gpus 'sim:0x16GiB': count and size must be positive in '0x16GiB'"),
        ("sim:4x0GiB", "--gpus 'sim:4x0GiB': count and size must be positive in '4x0GiB'"),
        ("sim:4x16", "--gpus 'sim:4x16': '4x16' has no unit; expected COUNTxSIZE with a unit, such as 4x16GiB"),
        ("sim:4x", "--gpus 'sim:4x': no size after '4x'; expected COUNTxSIZE such as 4x16GiB"),
        ("sim:4x16GiB,,", "--gpus 'sim:4x16GiB,,': cannot read ''; expected COUNTxSIZE such as 4x16GiB"),
        ("sim:4xlots", f"--gpus 'sim:4xlots': bad size in '4xlots': expected {SIZE_FORM}, got 'lots'"),
        (
            "sim:4*16GiB",
            "--gpus 'sim:4*16GiB': unknown separator '*' in '4*16GiB'; expected COUNTxSIZE such as 4x16GiB",
        ),
        ("sim:2/1GiB", "--gpus 'sim:2/1GiB': unknown separator '/' in '2/1GiB'; expected COUNTxSIZE such as 2x1GiB"),
        (
            "sim:4x1KiB;context=1MiB",
            "--gpus 'sim:4x1KiB;context=1MiB': a device of 1KiB is no larger than one CUDA context (1MiB, context=); "
            "expected COUNTxSIZE with sizes larger than that, such as 4x16GiB",
        ),
        (
            "sim:1x16GiB;mig:0=1x1MiB;context=2MiB",
            "--gpus 'sim:1x16GiB;mig:0=1x1MiB;context=2MiB': a device of 1MiB is no larger than one CUDA context "
            "(2MiB, context=); expected COUNTxSIZE with sizes larger than that, such as 4x16GiB",
        ),
        (
            "sim:4x16GiBs",
            f"--gpus 'sim:4x16GiBs': bad size in '4x16GiBs': unknown unit 'GiBs' in '16GiBs': expected {SIZE_FORM}",
        ),
        # bounds: the machine is never built (sim:30000x1GiB took minutes)
        ("sim:30000x1GiB", "--gpus 'sim:30000x1GiB': 30000 GPUs; a simulated machine has at most 64"),
        ("sim:60x1GiB,5x1GiB", "--gpus 'sim:60x1GiB,5x1GiB': 65 GPUs; a simulated machine has at most 64"),
        ("sim:2x2TiB", "--gpus 'sim:2x2TiB': '2x2TiB': a simulated GPU has at most 1TiB"),
        (
            "sim:1x80GiB;mig:0=4x1GiB,4x1GiB",
            "--gpus 'sim:1x80GiB;mig:0=4x1GiB,4x1GiB': 8 MIG instances; GPU 0 has at most 7",
        ),
        (
            "sim:1x16GiB;reserved=-5%",
            "--gpus 'sim:1x16GiB;reserved=-5%': reserved=-5%: expected a percentage from 0% to below 100%",
        ),
        (
            "sim:1x16GiB;reserved=nan%",
            "--gpus 'sim:1x16GiB;reserved=nan%': reserved=nan%: expected a percentage from 0% to below 100%",
        ),
        pytest.param(
            "sim:1x" + "9" * 400 + "GiB",
            f"--gpus 'sim:1x{'9' * 400}GiB': bad size in '1x{'9' * 400}GiB': expected a finite size, "
            f"got '{'9' * 400}GiB'",
            id="400-digit-size",
        ),
    ],
)
def test_sim_spec_errors(spec: str, message: str) -> None:
    with pytest.raises(DeviceSpecError) as info:
        simulated(NVIDIA, spec, {})
    assert str(info.value) == message


def test_sim_spec_bounds_are_inclusive() -> None:
    assert len(parse_sim_spec("sim:64x1TiB")) == 64
    assert len(parse_sim_spec("sim:1x1TiB;mig:0=7x1GiB")) == 7  # the MIG instances are the devices


def test_device_spec_error_is_a_value_error() -> None:
    assert issubclass(DeviceSpecError, ValueError)


# -- discover --------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["none", "NONE", " none "])
def test_discover_none(spec: str) -> None:
    inventory = discover(spec)
    assert inventory == Inventory((), "none", "--gpus none")
    assert inventory.describe() == "no GPUs (--gpus none)"
    assert not inventory.simulated


def test_discover_sim() -> None:
    inventory = discover("sim:2x80GiB,2x24GiB")
    assert inventory.source == "sim:2x80GiB,2x24GiB"
    assert inventory.devices == parse_sim_spec("sim:2x80GiB,2x24GiB")
    assert inventory.simulated
    assert inventory.describe() == "4 simulated GPUs (2x80GiB, 2x24GiB)"


def test_discover_sim_honours_cuda_visible_devices_as_a_real_machine_does() -> None:
    inventory = discover("sim:4x16GiB", environ={"CUDA_VISIBLE_DEVICES": "3,1"})
    assert [d.index for d in inventory.devices] == [3, 1]
    assert len(inventory.machine) == 4
    empty = discover("sim:4x16GiB", environ={"CUDA_VISIBLE_DEVICES": ""})
    assert empty.devices == ()
    assert "CUDA_VISIBLE_DEVICES='' matches none" in empty.note


def test_discover_sim_prefix_is_case_insensitive() -> None:
    assert discover("SIM:2x1GiB").devices == parse_sim_spec("sim:2x1GiB")


def test_discover_bad_sim_spec_raises() -> None:
    with pytest.raises(DeviceSpecError, match=r"^--gpus 'sim:nope': bad size in 'nope'"):
        discover("sim:nope")


def test_discover_auto_without_a_driver_is_empty_and_says_every_vendors_reason(without_nvml: None) -> None:
    """Issue 29: `auto` with no GPUs at all names what each vendor's GPUs lack, not NVIDIA's alone."""
    inventory = discover("auto")
    assert inventory.devices == ()
    assert inventory.source == "auto"
    reasons = (
        "NVML unavailable: NVML Shared Library Not Found; "
        "amdsmi is not installed (No module named 'amdsmi'); "
        "no Level Zero loader (libze_loader.so.1: cannot open shared object file)"
    )
    assert inventory.note == reasons
    assert inventory.describe() == f"no GPUs ({reasons})"
    # a vendor asked for by name: its own reason only
    assert discover("nvidia:auto").note == "NVML unavailable: NVML Shared Library Not Found"


def test_discover_auto_on_this_machine_never_raises() -> None:
    # the real NVML: no driver here (empty, with a note), a real GPU elsewhere
    inventory = discover("auto")
    if inventory.devices:
        assert inventory.source == "nvml"
    else:
        assert inventory.note
        assert inventory.describe().startswith("no GPUs (")


def test_discover_index_list_without_nvml(without_nvml: None) -> None:
    with pytest.raises(DeviceSpecError) as info:
        discover("0,2,3")
    assert str(info.value) == "--gpus '0,2,3': NVML unavailable: NVML Shared Library Not Found"


def test_discover_auto_with_nvml(fake_nvml: None) -> None:
    inventory = discover("auto", environ={})
    assert inventory == Inventory(MACHINE, "nvml", "", MACHINE, None)
    assert inventory.describe() == "4 GPUs (2x80GiB, 2x24GiB)"


def test_discover_auto_honours_cuda_visible_devices_indices(fake_nvml: None) -> None:
    inventory = discover("auto", environ={"CUDA_VISIBLE_DEVICES": "3,1"})
    assert inventory.devices == (L4_B, H100)


def test_discover_auto_honours_cuda_visible_devices_uuids(fake_nvml: None) -> None:
    inventory = discover("auto", environ={"CUDA_VISIBLE_DEVICES": f"{L4_A.uuid},{A100.uuid}"})
    assert inventory.devices == (L4_A, A100)


def test_discover_auto_with_empty_cuda_visible_devices(fake_nvml: None) -> None:
    inventory = discover("auto", environ={"CUDA_VISIBLE_DEVICES": ""})
    assert inventory.devices == ()
    assert inventory.note.startswith("CUDA_VISIBLE_DEVICES='' matches none of the devices NVML reports (0=GPU-aaaa")


def test_discover_index_list(fake_nvml: None) -> None:
    inventory = discover("2, 0", environ={})
    assert inventory.devices == (L4_A, A100)
    assert inventory.source == "nvml"


def test_discover_index_list_unknown_index(fake_nvml: None) -> None:
    with pytest.raises(DeviceSpecError) as info:
        discover("0,7,9", environ={})
    assert str(info.value) == "--gpus '0,7,9': no usable GPU with index [7, 9]; this machine has [0, 1, 2, 3]"


def test_discover_index_list_duplicate(fake_nvml: None) -> None:
    with pytest.raises(DeviceSpecError) as info:
        discover("1,1", environ={})
    assert str(info.value) == "--gpus '1,1': an index is listed twice"


@pytest.mark.parametrize("spec", ["bogus", "all", "0-3", "gpu0", "-1", ""])
def test_discover_unknown_spec(spec: str) -> None:
    with pytest.raises(DeviceSpecError) as info:
        discover(spec)
    assert str(info.value) == f"--gpus {spec!r}: expected {GPUS_FORM}"


# -- select_visible --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        ("0,1,2,3", MACHINE),
        ("2,0", (L4_A, A100)),
        (" 3 , 1 ", (L4_B, H100)),
        ("1", (H100,)),
        ("", ()),
    ],
)
def test_select_visible_by_index(visible: str, expected: tuple[Device, ...]) -> None:
    assert select_visible(MACHINE, visible) == expected


def test_select_visible_full_uuids_keep_their_order() -> None:
    assert select_visible(MACHINE, f"{L4_B.uuid},{A100.uuid}") == (L4_B, A100)


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        ("GPU-bbbb", (H100,)),
        ("bbbb2222", (H100,)),  # the GPU- prefix may be left out, as CUDA allows
        ("GPU-cccc4,aaaa", (L4_B, A100)),
    ],
)
def test_select_visible_uuid_prefixes(visible: str, expected: tuple[Device, ...]) -> None:
    assert select_visible(MACHINE, visible) == expected


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        ("1,7,2", (H100,)),  # unknown index ends the list
        ("0,-1,2", (A100,)),  # a negative index too
        ("1,GPU-cccc,0", (H100,)),  # an ambiguous prefix (two L4s) too
        ("GPU-ffff,0", ()),  # an unknown UUID too
        ("2,2,3", (L4_A,)),  # a repeated device too
        ("0,,1", (A100,)),  # an empty entry too
    ],
)
def test_select_visible_invalid_entry_ends_the_list(visible: str, expected: tuple[Device, ...]) -> None:
    assert select_visible(MACHINE, visible) == expected


def test_select_visible_indices_are_physical_not_positions() -> None:
    # a machine whose NVML list was already filtered: indices 4 and 6 remain
    gpus = (Device(4, "GPU-4444", GiB), Device(6, "GPU-6666", GiB))
    assert select_visible(gpus, "6,4") == (gpus[1], gpus[0])
    assert select_visible(gpus, "0,1") == ()


# -- Inventory -------------------------------------------------------------------------


def test_inventory_describe_single_and_plural() -> None:
    assert Inventory((A100,), "nvml").describe() == "1 GPU (1x80GiB)"
    assert Inventory(parse_sim_spec("sim:1x16GiB"), "sim:1x16GiB").describe() == "1 simulated GPU (1x16GiB)"
    assert Inventory(parse_sim_spec("sim:4x16GiB"), "sim:4x16GiB").describe() == "4 simulated GPUs (4x16GiB)"


def test_inventory_describe_empty_without_note_uses_source() -> None:
    assert Inventory((), "nvml").describe() == "no GPUs (nvml)"


def test_inventory_by_index() -> None:
    inventory = Inventory((H100, L4_B), "nvml")
    assert inventory.by_index(3) is L4_B
    with pytest.raises(KeyError):
        inventory.by_index(0)


@pytest.mark.parametrize(
    "inventory",
    [
        Inventory(MACHINE, "nvml"),
        Inventory(parse_sim_spec("sim:2x80GiB,2x24GiB"), "sim:2x80GiB,2x24GiB"),
        Inventory((), "auto", "NVML unavailable: no driver"),
        Inventory((L4_B,), "nvml", "picked by hand"),
    ],
)
def test_inventory_wire_round_trip(inventory: Inventory) -> None:
    wire = inventory.to_wire()
    assert Inventory.from_wire(wire) == inventory
    assert Inventory.from_wire(wire).simulated == inventory.simulated


def test_inventory_wire_form_is_plain_data() -> None:
    import json

    wire = Inventory((A100,), "nvml", "").to_wire()
    assert json.loads(json.dumps(wire)) == {
        "source": "nvml",
        "note": "",
        "devices": [[0, A100.uuid, 80 * GiB, "NVIDIA A100", False, 0, None]],
        "machine": [],
        "visible": None,
    }


def test_inventory_from_wire_without_note() -> None:
    data = {"source": "sim:1x1GiB", "devices": [[0, sim_uuid(0), GiB, "Simulated GPU 1GiB", True]]}
    assert Inventory.from_wire(data) == Inventory(parse_sim_spec("sim:1x1GiB"), "sim:1x1GiB", "")
