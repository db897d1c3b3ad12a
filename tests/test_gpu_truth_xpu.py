"""Intel XPU end to end, on a fake Intel machine (``PYTEST_GPU_FAKE_GPUS=xpu:sim:…``): a fake
Level Zero loader answers Sysman; discovery, ZE_AFFINITY_MASK leases, the simulated runtime's
device order, torch.xpu's confinement and Sysman's verification take the code path of a real
Intel machine."""

from __future__ import annotations

import json

import pytest

from conftest import Holder, require
from helpers import patience


@pytest.fixture
def xpu_run(fake_run, monkeypatch):
    for name in ("ZE_AFFINITY_MASK", "ZE_FLAT_DEVICE_HIERARCHY", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)

    def run(spec, *args, **env):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        return fake_run(spec, *args)

    return run


def test_leases_are_mask_indices_and_memory_outside_the_lease_is_seen(gpu_pytester, xpu_run):
    gpu_pytester.makepyfile(
        test_xpu="""
        import os
        import pytest
        from pytest_gpu import sim

        @pytest.mark.parametrize("n", range(3))
        @pytest.mark.gpu(exclusive=True)
        def test_on_the_lease(gpu, n):
            # ZE_AFFINITY_MASK=3,0,2 outside: the worker's Level Zero numbers devices 0, 2, 3 as 0, 1, 2
            assert gpu.device == f"xpu:{[0, 2, 3].index(gpu.indices[0])}"
            assert os.environ["ZE_AFFINITY_MASK"] == gpu.visible_devices == str(gpu.indices[0])
            assert "ROCR_VISIBLE_DEVICES" not in os.environ
            with sim.allocate("1GiB") as block:  # the current device: the lease's
                assert block.physical == gpu.indices[0]

        @pytest.mark.gpu(memory="1GiB")
        def test_outside(gpu):
            other = next(o for o in range(3) if f"xpu:{o}" != gpu.device)
            sim.allocate("256MiB", device=other).free()
        """
    )
    result = xpu_run("xpu:sim:4x64GiB", "--gpus", "xpu:auto", "-p", "no:xdist", ZE_AFFINITY_MASK="3,0,2")
    result.assert_outcomes(passed=4, errors=1)
    result.stdout.fnmatch_lines(["pytest-gpu: 3 Intel GPUs (3x64GiB) [[]sysman[]]*"])
    result.stdout.fnmatch_lines(["*used memory on GPU * outside its lease (GPU *)*"])
    assert "not verified" not in result.stdout.str()


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


def test_torch_xpu_is_confined_to_the_lease(gpu_pytester, xpu_run):
    require("torch", module="torch")
    gpu_pytester.makepyfile(
        test_torch="""
        import pytest
        import torch
        from pytest_gpu.sim import torch_cuda

        @pytest.mark.gpu(memory="2GiB")
        def test_confined(gpu):
            assert not torch.cuda.is_available()  # an Intel machine: torch.xpu
            assert torch.xpu.current_device() == int(gpu.device.split(":")[1])
            kept = torch_cuda.empty(1 << 30)  # torch.empty(..., device="xpu") in the CPU build's stead
            with pytest.raises(torch.OutOfMemoryError):
                torch_cuda.empty(2 << 30)  # beyond the lease's 2GiB
            assert torch.xpu.max_memory_allocated() >= 1 << 30
            kept.free()

        @pytest.mark.gpu(memory="2GiB")
        def test_leaked(gpu):
            test_leaked.kept = torch_cuda.empty(1 << 30)  # a tensor kept after the test
        """
    )
    result = xpu_run("xpu:sim:2x64GiB", "--gpus", "auto", "-p", "no:xdist", ZE_AFFINITY_MASK="1,0")
    result.assert_outcomes(passed=2, errors=1)  # test_leaked passed, and its teardown's verdict errs
    result.stdout.fnmatch_lines(["*torch still allocates it: a tensor kept after the test*"])


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


def test_gpu_required_without_intel_gpus_says_what_gives_a_job_intel_gpus(gpu_pytester, xpu_run):
    gpu_pytester.makepyfile(
        test_req="""
        import pytest

        @pytest.mark.gpu
        def test_gpu(gpu):
            pass
        """
    )
    result = xpu_run("sim:2x16GiB", "--gpus", "xpu:auto", "--gpu-required")  # an NVIDIA machine
    assert result.ret != 0
    out = result.stdout.str() + result.stderr.str()
    assert "the Intel GPU driver and Level Zero loader (libze_loader.so.1), ZE_AFFINITY_MASK, --gpus" in out, out


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


def test_a_rank_pool_gives_each_rank_its_device_by_mask_index(gpu_pytester, xpu_run, tmp_path):
    seen = tmp_path / "seen"
    seen.mkdir()
    gpu_pytester.makepyfile(
        test_pool=f"""
        import json, os
        import pytest

        @pytest.mark.distributed(world_size=2, backend="none", gpus_per_rank=1)
        def test_ranks(rank):
            from pytest_gpu.sim import cuda

            names = ("ZE_AFFINITY_MASK", "CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
            got = {{name: os.environ.get(name) for name in names}}
            got["units"] = cuda.init()
            got["device"] = rank.device
            with open(os.path.join({str(seen)!r}, str(rank.rank)), "w") as f:
                json.dump(got, f)
        """
    )
    result = xpu_run("xpu:sim:2x64GiB", "--gpus", "xpu:auto", "-p", "no:xdist")
    result.assert_outcomes(passed=1)
    units = []
    for r in (0, 1):
        got = json.loads((seen / str(r)).read_text())
        unit = got.pop("units")
        units += unit
        mask = str(unit[0])
        assert got == {
            "ZE_AFFINITY_MASK": mask,
            "CUDA_VISIBLE_DEVICES": mask,
            "ROCR_VISIBLE_DEVICES": None,
            "device": "xpu:0",
        }
    assert sorted(units) == [0, 1]  # one device each


def test_a_request_no_gpu_can_hold_names_the_level_zero_context(gpu_pytester, xpu_run):
    gpu_pytester.makepyfile(
        test_big="""
        import pytest

        @pytest.mark.gpu(exclusive=True, memory="100GiB")
        def test_big(gpu):
            pass
        """
    )
    result = xpu_run("xpu:sim:2x16GiB", "--gpus", "auto", "-p", "no:xdist", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED * offering 100GiB after the Level Zero context (2 Intel GPUs (2x16GiB))"])
    assert "CUDA context" not in result.stdout.str()
