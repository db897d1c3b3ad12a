"""Real-GPU paths end to end, on fake GPUs as strict as CUDA, NVML, amdsmi and Level Zero
(``PYTEST_GPU_FAKE_GPUS``).

Each inner run is a fresh pytest process whose driver libraries are the fake ones (nvidia-ml-py
loads the fake ``libnvidia-ml.so.1``, the real ``amdsmi`` package the fake ``libamd_smi.so``, the
plugin the fake Level Zero loader): ``--gpus auto``, index lists, MIG, NVML faults and each
vendor's verifier take exactly the code path of a real machine. What every vendor does alike is
one test parametrized over the vendors; what one vendor alone has is below it (AMD's and Intel's
own in tests/confine/test_gpu_truth_amd.py and tests/confine/test_gpu_truth_xpu.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest

from conftest import Holder, require
from helpers import patience
from pytest_gpu.sim.spec import gpu_uuid, mig_uuid
from pytest_gpu.vendors import kinds
from pytest_gpu.vendors import registry as vendors

# -- every vendor's GPUs: the same behaviour through NVML, amdsmi and Level Zero Sysman --------


@dataclass(frozen=True)
class Case:
    """One vendor's fake machine in the tests that every vendor passes alike."""

    vendor: str
    prefix: str  # of a fake machine's spec: "", "amd:", "xpu:"
    kind: str  # torch's device type
    narrow: str  # the outer variable that narrows a run to some GPUs
    summary: str  # how an inventory names its GPUs: "GPUs", "AMD GPUs", "Intel GPUs"
    source: str
    runtime: str

    def uuid(self, index: int) -> str:
        return kinds.of(self.vendor).sim_uuid(index)


CASES = [
    Case("nvidia", "", "cuda", "CUDA_VISIBLE_DEVICES", "GPUs", "nvml", "CUDA"),
    Case("amd", "amd:", "cuda", "ROCR_VISIBLE_DEVICES", "AMD GPUs", "amdsmi", "HIP"),
    Case("xpu", "xpu:", "xpu", "ZE_AFFINITY_MASK", "Intel GPUs", "sysman", "Level Zero"),
]
EVERY_VENDOR = pytest.mark.parametrize("case", CASES, ids=[c.vendor for c in CASES])

LANDING = """
import os
import pytest
from pytest_gpu import sim

SEEN = {seen!r}  # the GPUs this worker's runtime numbers, in its order

@pytest.mark.parametrize("n", range(3))
@pytest.mark.gpu(exclusive=True)
def test_on_the_lease(gpu, n):
    assert gpu.device == f"{kind}:{{SEEN.index(gpu.indices[0])}}"
    variables = {{k: v for k, v in gpu.env.items() if k in {names!r}}}
    assert variables == {{k: os.environ[k] for k in variables}}  # the test process has the lease's too
    {check}
    with sim.allocate("1GiB") as block:  # the current device: the lease's
        assert block.physical == gpu.indices[0]

@pytest.mark.gpu(memory="1GiB")
def test_outside(gpu):
    sim.allocate("256MiB", device=SEEN.index({outside})).free()
"""
# (how a run takes GPUs 0, 2 and 3 of four; what this worker's runtime then numbers; the lease's variables
#  checked; the GPU outside every lease that test_outside touches)
LANDINGS = {
    # --gpus 0,2,3 without an outer CUDA_VISIBLE_DEVICES: CUDA still numbers all 4 GPUs
    "nvidia": (("--gpus", "0,2,3"), {}, [0, 1, 2, 3], "assert gpu.visible_devices == gpu.uuids[0]", "1"),
    # ROCR_VISIBLE_DEVICES=0,2,3 outside: this worker's HIP numbers GPUs 0, 2, 3 as 0, 1, 2
    "amd": (
        ("--gpus", "auto"),
        {"ROCR_VISIBLE_DEVICES": "0,2,3"},
        [0, 2, 3],
        'assert gpu.env["ROCR_VISIBLE_DEVICES"] == gpu.env["CUDA_VISIBLE_DEVICES"] == gpu.visible_devices'
        ' == gpu.uuids[0] and gpu.env["HIP_VISIBLE_DEVICES"] == "0"',
        "next(i for i in SEEN if i != gpu.indices[0])",
    ),
    # ZE_AFFINITY_MASK=3,0,2 outside: the worker's Level Zero numbers devices 0, 2, 3 as 0, 1, 2
    "xpu": (
        ("--gpus", "xpu:auto"),
        {"ZE_AFFINITY_MASK": "3,0,2"},
        [0, 2, 3],
        'assert gpu.env["ZE_AFFINITY_MASK"] == gpu.visible_devices == str(gpu.indices[0])',
        "next(i for i in SEEN if i != gpu.indices[0])",
    ),
}


@EVERY_VENDOR
def test_leases_land_on_the_leased_gpu_and_use_outside_the_lease_is_seen(gpu_pytester, vendor_run, case):
    """Item 1 (NVIDIA: --gpus 0,2,3), and every vendor: three GPUs of four, each lease on its own
    GPU as the worker's runtime numbers them, and memory used outside the lease seen by the driver."""
    args, env, seen, check, outside = LANDINGS[case.vendor]
    names = vendors.of(case.vendor).visibility
    gpu_pytester.makepyfile(
        test_landing=LANDING.format(seen=seen, kind=case.kind, names=names, check=check, outside=outside)
    )
    result = vendor_run(case.vendor, f"{case.prefix}sim:4x64GiB", *args, "-p", "no:xdist", **env)
    result.assert_outcomes(passed=4, errors=1)
    result.stdout.fnmatch_lines([f"pytest-gpu: 3 {case.summary} (3x64GiB) [[]{case.source}[]]*"])
    result.stdout.fnmatch_lines(["*used memory on GPU * outside its lease (GPU *)*"])
    if case.vendor == "amd":  # amdsmi's list may be coarse: the violation says so
        result.stdout.fnmatch_lines(["*outside its lease (GPU *) (seen in amdsmi's per-process list, which may be*"])
    if case.vendor == "nvidia":
        result.stdout.fnmatch_lines(["*used memory on GPU 1 (*) outside its lease*"])  # the GPU --gpus left out
    assert "not verified" not in result.stdout.str()


@EVERY_VENDOR
def test_gpu_required_without_the_vendors_gpus_says_what_gives_a_job_them(gpu_pytester, vendor_run, case):
    gpu_pytester.makepyfile("import pytest\n\n@pytest.mark.gpu\ndef test_gpu(gpu):\n    pass\n")
    other = "amd:sim:2x16GiB" if case.vendor == "nvidia" else "sim:2x16GiB"  # another vendor's machine
    result = vendor_run(case.vendor, other, "--gpus", f"{case.vendor}:auto", "--gpu-required")
    assert result.ret != 0
    out = result.stdout.str() + result.stderr.str()
    assert f"give the job its GPUs ({vendors.of(case.vendor).gives_gpus}, --gpus)" in out, out


RANKS = """
import json, os
import pytest

@pytest.mark.distributed(world_size=2, backend="none", gpus_per_rank=1)
def test_ranks(rank):
    from pytest_gpu.sim import cuda

    got = {{name: os.environ.get(name) for name in {names!r}}}
    got["units"] = cuda.init()
    got["device"] = rank.device
    with open(os.path.join({seen!r}, str(rank.rank)), "w") as f:
        json.dump(got, f)
"""


@EVERY_VENDOR
def test_a_rank_pool_gives_each_rank_its_gpu(gpu_pytester, vendor_run, case, tmp_path):
    """Each rank sees its own GPU through every variable its vendor's lease sets: by UUID (ROCr's on
    AMD GPUs), by index where the variable takes indices only (ZE_AFFINITY_MASK)."""
    seen = tmp_path / "seen"
    seen.mkdir()
    gpu_pytester.makepyfile(test_pool=RANKS.format(names=list(vendors.VISIBILITY), seen=str(seen)))
    result = vendor_run(case.vendor, f"{case.prefix}sim:2x64GiB", "--gpus", "auto", "-p", "no:xdist")
    result.assert_outcomes(passed=1)
    units = []
    for r in (0, 1):
        got = json.loads((seen / str(r)).read_text())
        unit = got.pop("units")
        units += unit
        lease = vendors.of(case.vendor).lease_env([str(unit[0]) if case.vendor == "xpu" else case.uuid(unit[0])])
        assert got == {**dict.fromkeys(vendors.VISIBILITY), **lease, "device": f"{case.kind}:0"}
    assert sorted(units) == [0, 1]  # one GPU each


CONFINED = """
import pytest
import torch
from pytest_gpu.sim import torch_cuda

@pytest.mark.gpu(memory="2GiB")
def test_confined(gpu):
    device = getattr(torch, gpu.device.split(":")[0])  # torch.cuda (torch on ROCm too), torch.xpu
    {check}
    assert device.current_device() == int(gpu.device.split(":")[1])
    kept = torch_cuda.empty(1 << 30)  # torch.empty(..., device=gpu.device) in the CPU build's stead
    with pytest.raises(torch.OutOfMemoryError):
        torch_cuda.empty(2 << 30)  # beyond the lease's 2GiB
    assert device.max_memory_allocated() >= 1 << 30
    kept.free()

@pytest.mark.gpu(memory="2GiB")
def test_leaked(gpu):
    test_leaked.kept = torch_cuda.empty(1 << 30)  # a tensor kept after the test
"""
TORCH = {
    "nvidia": "assert torch.version.hip is None",
    "amd": "assert torch.version.hip  # torch on ROCm, to its Python side",
    "xpu": "assert not torch.cuda.is_available()  # an Intel machine: torch.xpu",
}


@EVERY_VENDOR
def test_torch_is_confined_to_the_lease(gpu_pytester, vendor_run, case):
    """torch's device module for the vendor's GPUs is capped at the lease, and what it keeps after a
    test is that test's leak: torch.cuda, torch on ROCm, torch.xpu."""
    require("torch", module="torch")
    gpu_pytester.makepyfile(test_torch=CONFINED.format(check=TORCH[case.vendor]))
    result = vendor_run(
        case.vendor, f"{case.prefix}sim:2x16GiB", "--gpus", "auto", "-p", "no:xdist", **{case.narrow: "1,0"}
    )
    result.assert_outcomes(passed=2, errors=1)  # test_leaked passed, and its teardown's verdict errs
    result.stdout.fnmatch_lines(["*torch still allocates it: a tensor kept after the test*"])
    assert "not verified" not in result.stdout.str()


@EVERY_VENDOR
def test_a_request_no_gpu_can_hold_names_the_vendors_context(gpu_pytester, vendor_run, case):
    gpu_pytester.makepyfile(
        "import pytest\n\n@pytest.mark.gpu(exclusive=True, memory='100GiB')\ndef test_big(gpu):\n    pass\n"
    )
    result = vendor_run(case.vendor, f"{case.prefix}sim:2x16GiB", "--gpus", "auto", "-p", "no:xdist", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(
        [f"SKIPPED * offering 100GiB after the {case.runtime} context (2 {case.summary} (2x16GiB))"]
    )
    assert case.vendor == "nvidia" or "CUDA context" not in result.stdout.str()


# (the machine, the outer variable in the vendor's own form, the run's GPUs, their devices, the summary)
OUTER = {
    # CUDA takes UUIDs, and an entry naming no GPU ends the list
    "nvidia": ("sim:4x64GiB", lambda c: f"{c.uuid(3)},{c.uuid(1)},9,2", (1, 3), ("cuda:1", "cuda:0"), "2 GPUs"),
    # ROCr takes its UUIDs (and HIP counts into what ROCr left)
    "amd": ("amd:sim:4x64GiB", lambda c: f"{c.uuid(3)},{c.uuid(1)}", (1, 3), ("cuda:1", "cuda:0"), "2 AMD GPUs"),
    # the mask takes indices only, skips an entry naming no device, and keeps the driver's order
    "xpu": ("xpu:sim:4x64GiB", lambda c: "9,3,1", (1, 3), ("xpu:0", "xpu:1"), "2 Intel GPUs"),
}


@EVERY_VENDOR
def test_an_outer_variable_in_the_vendors_own_form_narrows_the_run(gpu_pytester, vendor_run, case):
    spec, value, indices, devices, summary = OUTER[case.vendor]
    gpu_pytester.makepyfile(
        test_one=f"""
        import pytest

        @pytest.mark.gpu(count=2)
        def test_gpus(gpu):
            assert gpu.indices == {indices!r} and gpu.devices == {devices!r}
        """
    )
    result = vendor_run(case.vendor, spec, "--gpus", "auto", "-p", "no:xdist", **{case.narrow: value(case)})
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"pytest-gpu: {summary} (2x64GiB) [[]{case.source}[]]*"])


ELSEWHERE = """
import os, subprocess, sys
import pytest

# a child still holding its memory when the test ends (the drivers list live processes only)
HOLD = (
    "import time; from pytest_gpu import sim; b = sim.allocate('1GiB'); print('held', flush=True); "
    "time.sleep(5)"
)
ELSEWHERE = {elsewhere!r}  # by GPU: a lease's variables of the other GPU

def start(env):
    child = subprocess.Popen([sys.executable, "-c", HOLD], env=env, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held"
    return child

@pytest.mark.gpu(memory="2GiB")
def test_inside(gpu):
    child = start({{**os.environ, **gpu.env}})
    child.kill()  # gone before the test ends: nothing held after it
    child.wait()

@pytest.mark.gpu(memory="2GiB")
def test_elsewhere(gpu):
    start({{**os.environ, **gpu.env, **ELSEWHERE[gpu.indices[0]]}})  # a child that picks its own device
"""


@EVERY_VENDOR
def test_a_subprocess_outside_its_lease_is_caught_through_the_vendors_driver(gpu_pytester, vendor_run, case):
    """A test's child process that uses another GPU than the lease's is seen in that GPU's process
    list (NVML's, amdsmi's, Sysman's); one gone before the test ends is no violation."""
    implementation = vendors.of(case.vendor)
    names = [str(i) if case.vendor == "xpu" else case.uuid(i) for i in (0, 1)]
    elsewhere = {mine: implementation.lease_env([names[1 - mine]]) for mine in (0, 1)}
    gpu_pytester.makepyfile(test_sub=ELSEWHERE.format(elsewhere=elsewhere))
    # amdsmi's list read live (no lag to wait out): this test is about whose process it lists
    lag = ["--gpu-amd-process-lag=0"] if case.vendor == "amd" else []
    result = vendor_run(case.vendor, f"{case.prefix}sim:2x64GiB", "--gpus", "auto", "-p", "no:xdist", *lag)
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_elsewhere*", "*used memory on GPU * outside its lease*"])


BIG = """
import json
import pytest

@pytest.mark.parametrize("n", range(2))
@pytest.mark.gpu(memory="8GiB")
def test_big(gpu, n):
    with open({where!r} + str(n), "w") as f:
        json.dump(gpu.indices, f)
"""


@EVERY_VENDOR
def test_a_gpu_another_process_fills_is_avoided(gpu_pytester, vendor_run, case, tmp_path):
    """A process outside any run holds most of GPU 0 (seen through NVML, amdsmi or Sysman): the
    leases go to GPU 1."""
    spec = f"{case.prefix}sim:2x64GiB"
    env = {"PYTEST_GPU_FAKE_GPUS": spec, "PYTEST_GPU_SIM_LEDGER": str(tmp_path / "fake-ledger"), "PYTEST_GPU_SIM": spec}
    holder = Holder("--gpu", "0", "--memory", "60GiB", env={**os.environ, **env})  # on fake_run's ledger
    try:
        gpu_pytester.makepyfile(test_big=BIG.format(where=str(tmp_path / "where")))
        result = vendor_run(case.vendor, spec, "--gpus", "auto", "-p", "no:xdist")
    finally:
        holder.kill()
    result.assert_outcomes(passed=2)
    for n in range(2):
        assert json.loads((tmp_path / f"where{n}").read_text()) == [1]  # GPU 0 is taken by another process


# -- NVIDIA's: NVML, MIG, CUDA ---------------------------------------------------------------


def test_cuda_first_used_inside_a_test_does_not_strand_the_worker(gpu_pytester, fake_run):
    """Item 4: the first test starts CUDA (sim and torch); later tests on other GPUs land right."""
    require("torch", module="torch")
    gpu_pytester.makepyfile(
        test_late="""
        import sys
        import pytest
        from pytest_gpu import sim

        def test_0_cpu():
            assert "torch" not in sys.modules

        @pytest.mark.gpu(memory="1GiB")
        def test_1_first_cuda_use(gpu):
            import torch  # imported and started inside a test that sees only its lease
            assert torch.cuda.is_available()
            assert torch.cuda.current_device() == gpu.indices[0]  # confined right after the import
            sim.allocate("64MiB").free()

        @pytest.mark.gpu(2, memory="1GiB")
        def test_2_two_gpus(gpu):
            import torch
            from pytest_gpu.sim import torch_cuda
            assert torch.cuda.device_count() == 2
            for index, device in zip(gpu.indices, gpu.devices):
                block = torch_cuda.empty(2**20, device=device)
                assert block.physical == index
                block.free()

        @pytest.mark.gpu(exclusive=True)
        @pytest.mark.parametrize("n", range(2))
        def test_3_whole_gpu(gpu, n):
            import torch
            assert torch.cuda.current_device() == gpu.indices[0]
            with sim.allocate("1GiB") as block:
                assert block.physical == gpu.indices[0]
        """
    )
    result = fake_run("sim:2x16GiB", "--gpus", "auto", "-p", "no:xdist")
    result.assert_outcomes(passed=5)
    assert "violation" not in result.stdout.str().split("short test summary")[0].replace("0 violations", "")


def test_a_gpu_nvml_refuses_is_left_out_with_a_note(gpu_pytester, fake_run):
    """Item 5: NO_PERMISSION / GPU_IS_LOST on one GPU must not stop a run (CPU-only ones included)."""
    gpu_pytester.makepyfile(
        test_f="""
        import pytest

        def test_cpu():
            pass

        @pytest.mark.gpu(memory="1GiB")
        def test_gpu(gpu):
            assert gpu.indices[0] in (0, 1, 3)
        """
    )
    result = fake_run("sim:4x16GiB;fault:2=no_permission", "--gpus", "auto")
    result.assert_outcomes(passed=2)
    assert result.ret == 0
    result.stdout.fnmatch_lines(
        [
            "pytest-gpu: 3 GPUs (3x16GiB) [[]nvml[]]*",
            "pytest-gpu: note: GPU 2 skipped: NVML: Insufficient Permissions",
        ]
    )
    lost = fake_run("sim:2x16GiB;fault:0=gpu_is_lost", "--gpus", "auto", "-k", "cpu")
    lost.assert_outcomes(passed=1, deselected=1)
    assert "INTERNALERROR" not in lost.stdout.str()


def test_verification_says_what_nvml_cannot_tell(gpu_pytester, fake_run):
    """Item 6: NVML refusing process lists (MIG, unprivileged) or reporting host pids (a
    container) is a note on the report, never an error and never silent."""
    gpu_pytester.makepyfile(
        test_v="""
        import pytest
        from pytest_gpu import sim

        @pytest.mark.gpu(memory="1GiB")
        def test_gpu(gpu):
            sim.allocate("256MiB").free()
        """
    )
    mig = fake_run("sim:1x80GiB;mig:0=2x40GiB", "--gpus", "auto")
    mig.assert_outcomes(passed=1)
    mig.stdout.fnmatch_lines(
        ["pytest-gpu: not verified: NVML cannot list processes on GPU 1 (Insufficient Permissions): not checked there*"]
    )
    assert "on GPU 0 (" not in mig.stdout.str()  # the MIG-mode GPU itself is not a device to check
    container = fake_run("sim:2x16GiB;pidns=100000", "--gpus", "auto")
    container.assert_outcomes(passed=1)
    container.stdout.fnmatch_lines(["pytest-gpu: not verified: *do not exist in this pid namespace (a container?)*"])
    old = fake_run("sim:2x16GiB;no-v3", "--gpus", "auto")
    old.assert_outcomes(passed=1)
    old.stdout.fnmatch_lines(["pytest-gpu: not verified: NVML cannot list processes on GPU 0*(1 test)"])


def test_mig_instances_are_the_inventory(gpu_pytester, fake_run):
    """Item 7: a MIG-mode GPU contributes its instances; an outer MIG UUID selects one."""
    gpu_pytester.makepyfile(
        test_m=f"""
        import pytest
        from pytest_gpu import sim

        @pytest.mark.gpu(memory="8GiB")
        def test_on_mig(gpu):
            assert gpu.uuids[0].startswith("MIG-")
            assert gpu.uuids[0] == {mig_uuid(0, 1)!r}
            with sim.allocate("4GiB") as block:
                assert block.physical == gpu.indices[0]
        """
    )
    result = fake_run("sim:1x80GiB;mig:0=2x20GiB", "--gpus", "auto", visible=mig_uuid(0, 1))
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["pytest-gpu: 1 MIG instance (1x20GiB) [[]nvml[]]*"])
    assert "peaked at 0B" not in result.stdout.str()  # NVML could not measure it: no made-up suggestion


@pytest.mark.slow
def test_inventory_cli_shows_the_fake_machine_as_nvml_reports_it(tmp_path):
    require("C compiler", executable="cc")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_GPU_") and k != "CUDA_VISIBLE_DEVICES"}
    env.update(PYTEST_GPU_FAKE_GPUS="sim:2x80GiB;mig:1=2x40GiB;reserved=1%", PYTEST_GPU_SIM_LEDGER=str(tmp_path / "l"))
    out = subprocess.run(
        [sys.executable, "-m", "pytest_gpu.cli", "inventory", "--gpus", "auto"],
        env=env,
        capture_output=True,
        text=True,
        timeout=patience(60),
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "--gpus auto: 3 GPUs (1x80GiB, 2x40GiB)"
    assert lines[1].split()[:3] == ["GPU", "0", gpu_uuid(0)]
    assert "reserved" in lines[1]
    assert lines[2].split()[:3] == ["MIG", "2", mig_uuid(1, 0)] and lines[2].endswith("(on GPU 1)")
    empty = subprocess.run(
        [sys.executable, "-m", "pytest_gpu.cli", "inventory", "--gpus", "auto"],
        env={**env, "CUDA_VISIBLE_DEVICES": "MIG-nope"},
        capture_output=True,
        text=True,
        timeout=patience(60),
    )
    assert "CUDA_VISIBLE_DEVICES='MIG-nope' matches none of the devices NVML reports" in empty.stdout


@pytest.mark.parametrize("gpus", ["auto", "sim:2x16GiB"])
def test_a_sections_gpu_is_not_the_main_leases_violation(gpu_pytester, fake_run, gpus):
    """Item 8: NVML usage is per process; a gpu_request section's context and memory are its own."""
    gpu_pytester.makepyfile(
        test_s="""
        import pytest
        from pytest_gpu import sim

        @pytest.mark.gpu(exclusive=True)
        def test_main_and_section(gpu, gpu_request):
            sim.allocate("1GiB").free()
            with gpu_request(memory="2GiB") as section:
                assert section.indices != gpu.indices
                sim.allocate("1GiB", device=section.device).free()
        """
    )
    result = fake_run("sim:2x16GiB", "--gpus", gpus, "-p", "no:xdist")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*· 0 violations"])


def test_fake_switch_spec_errors_name_the_variable(gpu_pytester, fake_run):
    gpu_pytester.makepyfile("def test_a():\n    pass\n")
    result = fake_run("sim:4x16GiB;fault:9=gpu_is_lost", "--gpus", "auto")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*PYTEST_GPU_FAKE_GPUS: *fault:9=gpu_is_lost: '9' is not a GPU index (0..3)*"])


def test_one_mig_instance_per_process():
    """CUDA lets a process use one MIG instance, the first it sees; other GPUs stay visible."""
    from pytest_gpu.sim.spec import parse
    from pytest_gpu.vendors.devices import Inventory
    from pytest_gpu.vendors.nvidia import NVIDIA, cuda_view

    machine = parse("sim:2x80GiB;mig:0=3x20GiB")
    units = machine.all_devices()
    assert cuda_view(units, None) == [1, 2]  # GPU 1 and the first instance
    assert cuda_view(units, f"{mig_uuid(0, 2)},{mig_uuid(0, 1)}") == [4]
    assert cuda_view(units, f"1,{gpu_uuid(0)}") == [1]  # a GPU in MIG mode is invalid, by UUID too
    found, _ = machine.devices()
    inventory = Inventory(found, "nvml", machine=found)
    assert [d.index for d in inventory.devices] == [1, 2, 3, 4]  # every instance can be leased
    assert NVIDIA.view(found, NVIDIA.started_with(inventory)) == [1, 2]  # but this process's CUDA uses one


def test_a_mig_lease_this_process_cannot_use_is_for_subprocesses(tmp_path, monkeypatch):
    from pytest_gpu import sim
    from pytest_gpu.gpu.confine import confine
    from pytest_gpu.gpu.isolation import make_lease
    from pytest_gpu.sim.spec import parse
    from pytest_gpu.vendors.devices import Inventory

    monkeypatch.setenv(sim.LEDGER_ENV, str(tmp_path / "ledger"))
    monkeypatch.setenv(sim.SPEC_ENV, "sim:1x80GiB;mig:0=2x20GiB")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    sim.cuda.forget()
    found, _ = parse("sim:1x80GiB;mig:0=2x20GiB").devices()
    inventory = Inventory(found, "sim:1x80GiB;mig:0=2x20GiB", machine=found)
    lease = make_lease("k", [2], 4 * 2**30, False, 0.0, inventory, "tag")  # the second instance
    assert lease.device == "" and lease.devices == ()
    assert lease.visible_devices == "2"
    done = confine(lease, inventory)
    assert "cannot be used by this process's CUDA" in done.notes[0]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2"  # a subprocess gets exactly the instance
    done.undo()
    sim.cuda.forget()


def test_import_hook_keeps_the_module_whole(tmp_path, monkeypatch):
    """The wrapped loader is given back; a failing callback never breaks the import."""
    import importlib.resources

    from pytest_gpu.base import importhook

    pkg = tmp_path / "hooked_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("VALUE = 1\n")
    (pkg / "data.txt").write_text("payload")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    importhook.on_import("hooked_pkg", lambda m: seen.append(m.VALUE))

    def broken(module: object) -> None:
        raise RuntimeError("callback failed")

    importhook.on_import("hooked_pkg", broken)
    try:
        with pytest.warns(RuntimeWarning, match="callback failed"):
            import hooked_pkg  # type: ignore[import-not-found]
        assert seen == [1]
        assert importlib.resources.files("hooked_pkg").joinpath("data.txt").read_text() == "payload"
        assert type(hooked_pkg.__loader__).__module__ != "pytest_gpu.base.importhook"
    finally:
        sys.modules.pop("hooked_pkg", None)


def test_torch_with_real_cuda_is_left_alone_with_a_note(monkeypatch):
    import types

    from pytest_gpu.sim import fake, torch_cuda

    def refuse(torch: object) -> None:
        raise RuntimeError("torch has real CUDA support")

    monkeypatch.setattr(torch_cuda, "install", refuse)
    monkeypatch.setattr(fake, "notes", [])
    fake._install_torch(types.ModuleType("torch"))  # must not raise inside the user's import
    assert fake.notes == ["torch.cuda left as it is: torch has real CUDA support"]
