"""Intel XPU end to end, on a fake Intel machine (``PYTEST_GPU_FAKE_GPUS=xpu:sim:…``): a fake
Level Zero loader answers Sysman; discovery, ZE_AFFINITY_MASK leases, the simulated runtime's
device order, torch.xpu's confinement and Sysman's verification take the code path of a real
Intel machine. What Intel's GPUs alone have: the mask's rules, Sysman's process list, simulated
Intel GPUs from --gpus. (What every vendor does alike is tests/confine/test_gpu_truth.py's, over vendors.)"""

from __future__ import annotations

import functools
import json

import pytest

from conftest import Holder, require
from helpers import patience


@pytest.fixture
def xpu_run(vendor_run):
    return functools.partial(vendor_run, "xpu")


def test_an_outer_mask_entry_naming_no_device_is_skipped(gpu_pytester, xpu_run):
    gpu_pytester.makepyfile(
        test_one="""
        import pytest

        @pytest.mark.gpu(count=2)
        def test_gpus(gpu):
            assert gpu.indices == (1, 3) and gpu.devices == ("xpu:0", "xpu:1")
        """
    )
    result = xpu_run("xpu:sim:4x64GiB", "--gpus", "auto", "-p", "no:xdist", ZE_AFFINITY_MASK="9,3,1")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["pytest-gpu: 2 Intel GPUs (2x64GiB) [[]sysman[]]*"])


def test_a_subprocess_outside_its_lease_is_caught_through_sysman(gpu_pytester, xpu_run):
    gpu_pytester.makepyfile(
        test_sub="""
        import os, subprocess, sys
        import pytest

        # a child still holding its memory when the test ends (Sysman lists live processes only)
        HOLD = (
            "import time; from pytest_gpu import sim; b = sim.allocate('1GiB'); print('held', flush=True); "
            "time.sleep(3)"
        )

        def start(env):
            child = subprocess.Popen([sys.executable, "-c", HOLD], env=env, stdout=subprocess.PIPE, text=True)
            assert child.stdout.readline().strip() == "held"
            return child

        @pytest.mark.gpu(memory="2GiB")
        def test_inside(gpu):
            child = start({**os.environ, **gpu.env})
            child.kill()  # gone before the test ends: nothing held after it
            child.wait()

        @pytest.mark.gpu(memory="2GiB")
        def test_elsewhere(gpu):
            other = str(next(i for i in range(2) if i != gpu.indices[0]))
            start({**os.environ, **gpu.env, "ZE_AFFINITY_MASK": other})  # a child that picks its own device
        """
    )
    result = xpu_run("xpu:sim:2x64GiB", "--gpus", "xpu:auto", "-p", "no:xdist")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_elsewhere*", "*used memory on GPU * outside its lease*"])


def test_foreign_usage_is_avoided(gpu_pytester, xpu_run, tmp_path, monkeypatch):
    spec = "xpu:sim:2x64GiB"
    ledger = tmp_path / "fake-ledger"  # fake_run's
    env = {"PYTEST_GPU_FAKE_GPUS": spec, "PYTEST_GPU_SIM_LEDGER": str(ledger), "PYTEST_GPU_SIM": spec}
    import os

    holder = Holder("--gpu", "0", "--memory", "60GiB", env={**os.environ, **env})
    try:
        gpu_pytester.makepyfile(
            test_big=f"""
            import json
            import pytest

            @pytest.mark.parametrize("n", range(2))
            @pytest.mark.gpu(memory="8GiB")
            def test_big(gpu, n):
                with open({str(tmp_path / "where")!r} + str(n), "w") as f:
                    json.dump(gpu.indices, f)
            """
        )
        result = xpu_run(spec, "--gpus", "xpu:auto", "-p", "no:xdist")
    finally:
        holder.kill()
    result.assert_outcomes(passed=2)
    for n in range(2):
        assert json.loads((tmp_path / f"where{n}").read_text()) == [1]  # GPU 0 is taken by another process


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
