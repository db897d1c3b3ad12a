"""Intel XPU end to end: what Intel's GPUs alone have, simulated Intel GPUs from ``--gpus
xpu:sim:…`` (a machine of the run's own, without PYTEST_GPU_FAKE_GPUS). What every vendor does
alike on a fake machine (ZE_AFFINITY_MASK's leases and its rules, the simulated runtime's device
order, torch.xpu's confinement, Sysman's verification and foreign usage) is
tests/confine/test_gpu_truth.py's, over vendors; the mask and Sysman themselves are
tests/vendors/test_xpu.py's."""

from __future__ import annotations

from conftest import require
from helpers import patience


def test_simulated_intel_gpus_from_the_gpus_option(gpu_pytester, monkeypatch):
    """``--gpus xpu:sim:…`` without PYTEST_GPU_FAKE_GPUS: the run's own simulated Intel machine."""
    require("C compiler", executable="cc")
    for name in ("PYTEST_GPU_FAKE_GPUS", "PYTEST_GPU_SIM_LEDGER", "CUDA_VISIBLE_DEVICES", "ZE_FLAT_DEVICE_HIERARCHY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ZE_AFFINITY_MASK", "2,0")
    gpu_pytester.makepyfile(
        test_sim="""
        import os
        import pytest
        from pytest_gpu import sim

        @pytest.mark.gpu(count=2)
        def test_both(gpu):
            assert gpu.indices == (0, 2) and gpu.devices == ("xpu:0", "xpu:1")
            assert os.environ["ZE_AFFINITY_MASK"] == gpu.visible_devices == "0,2"
            with sim.allocate("1GiB", device="xpu:1") as block:
                assert block.physical == 2
        """
    )
    result = gpu_pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--gpus", "xpu:sim:4x64GiB", timeout=patience(180)
    )
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["pytest-gpu: 2 simulated Intel GPUs (2x64GiB)*"])
