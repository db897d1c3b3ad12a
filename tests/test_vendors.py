"""The vendor interface (:mod:`pytest_gpu.vendors.registry`): NVIDIA's implementation is the code the
NVIDIA path always ran, AMD's is ROCm's model; both answer the same questions."""

from __future__ import annotations

import os

import pytest

from pytest_gpu.sim.spec import amd_uuid
from pytest_gpu.vendors import registry as vendors
from pytest_gpu.vendors.devices import Device, Inventory, cuda_view, parse_sim_spec

GiB = 1 << 30
NV = parse_sim_spec("sim:4x16GiB")
AMD = tuple(Device(i, amd_uuid(i), 192 * GiB) for i in range(4))


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


def test_a_lease_env_is_the_view_of_its_names() -> None:
    for vendor, machine in ((vendors.NVIDIA, NV), (vendors.AMD, AMD)):
        env = vendor.lease_env([machine[2].uuid, machine[0].uuid])
        assert vendor.view(machine, vendor.outer(env)) == [2, 0], vendor.name
        assert set(env) <= set(vendors.VISIBILITY)


def test_what_a_run_started_with() -> None:
    nv = Inventory(NV, "nvml", "", NV, "1,2")
    assert vendors.started_with(nv) == (("CUDA_VISIBLE_DEVICES", "1,2"),)
    amd = Inventory(AMD, "amdsmi", "", AMD, None, "amd", (("ROCR_VISIBLE_DEVICES", "0"),))
    assert vendors.started_with(amd) == (("ROCR_VISIBLE_DEVICES", "0"),)
    with pytest.raises(KeyError):
        vendors.of("intel")


@pytest.mark.parametrize(
    ("spec", "runtime"), [("sim:1x16GiB;context=700MiB", "CUDA"), ("amd:sim:1x16GiB;context=700MiB", "HIP")]
)
def test_each_vendors_driver_measures_the_context(gpu_pytester, fake_run, monkeypatch, spec, runtime):
    """The calibration reads this process's line through the vendor's sampler: NVML's (fake
    libnvidia-ml.so.1) or amdsmi's (fake libamd_smi.so)."""
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


def test_only_amds_verification_waits_for_its_process_list() -> None:
    from pytest_gpu.gpu.verification import NvmlRankVerifier, NvmlVerifier

    nvidia = Inventory(devices=NV, source="nvml")
    amd = Inventory(devices=AMD, source="amdsmi", vendor="amd")
    # NVML's lists are read live: the NVIDIA path never waits, whatever --gpu-amd-process-lag says
    assert NvmlVerifier(nvidia, 0, lag=2.0).lag == NvmlRankVerifier(nvidia, 0, lag=2.0).lag == 0
    assert NvmlVerifier(amd, 0, lag=2.0).lag == NvmlRankVerifier(amd, 0, lag=2.0).lag == 2.0


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


def test_every_amd_verdict_says_how_coarse_its_list_is(monkeypatch) -> None:
    """A violation seen in amdsmi's list carries the caveat whichever verifier judged it: a test's
    or a rank pool's (whose own sampling overrides the test's); NVIDIA's carry none."""
    from pytest_gpu.gpu.verification import NvmlRankVerifier, NvmlVerifier, Verdict, amd_caveat

    def found(self, lease, others=()):
        return Verdict(violations=["GPU 1 outside the lease"])

    for cls in (NvmlVerifier, NvmlRankVerifier):
        monkeypatch.setattr(cls, "_end", found)
        amd = cls(Inventory(devices=AMD, source="amdsmi", vendor="amd"), 0, lag=0.0)
        assert amd.end(None).violations == [f"GPU 1 outside the lease ({amd_caveat(0.0)})"], cls  # type: ignore[arg-type]
        nvidia = cls(Inventory(devices=NV, source="nvml"), 0, lag=0.0)
        assert nvidia.end(None).violations == ["GPU 1 outside the lease"], cls  # type: ignore[arg-type]
