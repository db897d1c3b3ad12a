"""The vendor interface (:class:`pytest_gpu.vendors.vendor.Vendor`, one object per vendor in
:mod:`pytest_gpu.vendors.registry`): NVIDIA's implementation is the code the NVIDIA path always
ran, AMD's is ROCm's model, Intel's Level Zero's; all answer the same questions."""

from __future__ import annotations

import os

import pytest

from pytest_gpu.sim.spec import amd_uuid, parse, xpu_uuid
from pytest_gpu.vendors import amd, kinds
from pytest_gpu.vendors import registry as vendors
from pytest_gpu.vendors.devices import Device, Inventory
from pytest_gpu.vendors.nvidia import cuda_view

GiB = 1 << 30
NV = parse("sim:4x16GiB").devices()[0]
AMD = tuple(Device(i, amd_uuid(i), 192 * GiB) for i in range(4))
XPU = tuple(Device(i, xpu_uuid(i), 64 * GiB) for i in range(4))
MACHINES = {"nvidia": NV, "amd": AMD, "xpu": XPU}


def test_one_list_of_vendors_for_the_product_and_the_simulated_machines() -> None:
    assert tuple(vendors.VENDORS) == kinds.NAMES == ("nvidia", "amd", "xpu")
    assert [v.kind for v in vendors.VENDORS.values()] == list(kinds.ALL)
    assert vendors.DEFAULT is vendors.NVIDIA and parse("sim:1x1GiB").vendor == kinds.DEFAULT.name
    for kind in kinds.ALL:
        machine = parse(f"{kind.name}:sim:2x16GiB")
        assert [g.uuid for g in machine.gpus] == [kind.sim_uuid(i) for i in range(2)]
        assert [kind.sim_index(g.uuid) for g in machine.gpus] == [0, 1]
        assert all(other.sim_index(kind.sim_uuid(1)) is None for other in kinds.ALL if other is not kind)


@pytest.mark.parametrize("visible", [None, "", "2,0", "1,9,2", "GPU-51a00000-0000-4000-8000-000000000003"])
def test_nvidia_view_is_cudas(visible: str | None) -> None:
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible, "ROCR_VISIBLE_DEVICES": "0"}
    outer = vendors.NVIDIA.outer(env)
    assert vendors.NVIDIA.view(NV, outer) == cuda_view(NV, visible)  # ROCm's variable means nothing to CUDA


def test_nvidia_lease_sets_cuda_and_hip_alike() -> None:
    assert vendors.NVIDIA.lease_env(["GPU-a", "GPU-b"]) == {
        "CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b",
        "HIP_VISIBLE_DEVICES": "GPU-a,GPU-b",
    }
    assert vendors.NVIDIA.lease_env([]) == {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""}


def test_amd_view_honours_rocr_before_cuda() -> None:
    outer = vendors.AMD.outer({"CUDA_VISIBLE_DEVICES": "1", "ROCR_VISIBLE_DEVICES": "2,3", "OTHER": "x"})
    assert outer == (("ROCR_VISIBLE_DEVICES", "2,3"), ("CUDA_VISIBLE_DEVICES", "1"))
    assert vendors.AMD.view(AMD, outer) == [3]


@pytest.mark.parametrize(("vendor", "expected"), [("nvidia", [2, 0]), ("amd", [2, 0]), ("xpu", [0, 2])])
def test_a_lease_env_is_the_view_of_its_names(vendor: str, expected: list[int]) -> None:
    """A subprocess under a lease's variables sees exactly the lease: in the lease's order, but on
    Intel GPUs, where Level Zero keeps the driver's order whatever the mask's."""
    implementation, machine = vendors.of(vendor), MACHINES[vendor]
    env = implementation.lease_env(implementation.lease_names([machine[2], machine[0]]))
    assert implementation.view(machine, implementation.outer(env)) == expected
    assert set(env) <= set(vendors.VISIBILITY)


def test_what_a_run_started_with() -> None:
    nv = Inventory(NV, "nvml", "", NV, "1,2")
    assert vendors.NVIDIA.started_with(nv) == (("CUDA_VISIBLE_DEVICES", "1,2"),)
    amd = Inventory(AMD, "amdsmi", "", AMD, None, "amd", (("ROCR_VISIBLE_DEVICES", "0"),))
    assert vendors.AMD.started_with(amd) == (("ROCR_VISIBLE_DEVICES", "0"),)
    with pytest.raises(KeyError):
        vendors.of("intel")


@pytest.mark.parametrize(
    ("spec", "runtime"),
    [
        ("sim:1x16GiB;context=700MiB", "CUDA"),
        ("amd:sim:1x16GiB;context=700MiB", "HIP"),
        ("xpu:sim:1x16GiB;context=700MiB", "Level Zero"),
    ],
)
def test_each_vendors_driver_measures_the_context(gpu_pytester, fake_run, monkeypatch, spec, runtime):
    """The calibration reads this process's line through the vendor's sampler: NVML's (fake
    libnvidia-ml.so.1), amdsmi's (fake libamd_smi.so) or Level Zero Sysman's (fake loader)."""
    if spec.startswith("amd:"):
        from conftest import amdsmi_site

        site = amdsmi_site()
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")])))
    gpu_pytester.makepyfile(
        test_ctx="""
        import pytest
        from pytest_gpu import sim

        @pytest.mark.gpu(memory="1GiB")
        def test_gpu(gpu):
            sim.allocate("256MiB").free()
        """
    )
    result = fake_run(spec, "--gpus", "auto", "-p", "no:xdist")
    result.assert_outcomes(passed=1)
    measured = f"pytest-gpu: {runtime} context measured: GPU 0: 700MiB (assumed 500MiB until measured)"
    result.stdout.fnmatch_lines([measured])


@pytest.mark.parametrize(("vendor", "lag"), [("nvidia", 0.0), ("amd", 2.0), ("xpu", 0.0)])
def test_only_amds_verification_waits_for_its_process_list(vendor: str, lag: float) -> None:
    """NVML's and Sysman's lists are read live: only amdsmi's may be old, --gpu-amd-process-lag's seconds."""
    from pytest_gpu.gpu.verification import NvmlRankVerifier, NvmlVerifier

    inventory = Inventory(devices=MACHINES[vendor], source="driver", vendor=vendor)
    assert NvmlVerifier(inventory, 0, lag=2.0).lag == NvmlRankVerifier(inventory, 0, lag=2.0).lag == lag


def test_nvidia_has_no_process_list_lag_to_say(gpu_pytester, fake_run):
    """NVML's lists are read live: short tests on NVIDIA GPUs are neither waited for nor counted
    in the summary's AMD blind-spot line, whatever --gpu-amd-process-lag says."""
    gpu_pytester.makepyfile(
        test_short="""
        import pytest
        from pytest_gpu import sim

        @pytest.mark.parametrize("n", range(2))
        @pytest.mark.gpu(memory="1GiB")
        def test_short(gpu, n):
            sim.allocate("256MiB").free()
        """
    )
    result = fake_run("sim:2x16GiB", "--gpus", "auto", "-p", "no:xdist", "--gpu-amd-process-lag=2")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["pytest-gpu: 2 GPUs (2x16GiB) [[]nvml[]]*"])
    assert "process-list lag" not in result.stdout.str()


@pytest.mark.parametrize(
    ("vendor", "caveat"), [("nvidia", ""), ("amd", f" ({amd.caveat(0.0)})"), ("xpu", "")], ids=["nvidia", "amd", "xpu"]
)
def test_every_amd_verdict_says_how_coarse_its_list_is(monkeypatch, vendor: str, caveat: str) -> None:
    """A violation seen in amdsmi's list carries the caveat whichever verifier judged it: a test's
    or a rank pool's (whose own sampling overrides the test's); NVIDIA's and Intel's carry none."""
    from pytest_gpu.gpu.verification import NvmlRankVerifier, NvmlVerifier, Verdict

    def found(self, lease, others=()):
        return Verdict(violations=["GPU 1 outside the lease"])

    for cls in (NvmlVerifier, NvmlRankVerifier):
        monkeypatch.setattr(cls, "_end", found)
        verifier = cls(Inventory(devices=MACHINES[vendor], source="driver", vendor=vendor), 0, lag=0.0)
        assert verifier.end(None).violations == [f"GPU 1 outside the lease{caveat}"], cls  # type: ignore[arg-type]
