"""AMD ROCm end to end, on a fake AMD machine (``PYTEST_GPU_FAKE_GPUS=amd:sim:…``): the real
``amdsmi`` package loads the fake ``libamd_smi.so``; discovery, leases, the simulated HIP's
device order and verification take the code path of a real AMD machine."""

from __future__ import annotations

import json
import os

import pytest

from conftest import amdsmi_site, require
from pytest_gpu.sim.spec import amd_uuid


@pytest.fixture
def amd_run(fake_run, monkeypatch):
    site = amdsmi_site()
    rest = os.environ.get("PYTHONPATH", "")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([site, rest]) if rest else site)  # the inner run's amdsmi
    for name in ("ROCM_HOME", "ROCM_PATH", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL"):
        monkeypatch.delenv(name, raising=False)

    def run(spec, *args, **env):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        return fake_run(spec, *args)

    return run


def test_leases_are_rocr_uuids_and_memory_outside_the_lease_is_seen(gpu_pytester, amd_run):
    gpu_pytester.makepyfile(
        test_amd="""
        import os
        import pytest
        from pytest_gpu import sim

        @pytest.mark.parametrize("n", range(3))
        @pytest.mark.gpu(exclusive=True)
        def test_on_the_lease(gpu, n):
            # ROCR_VISIBLE_DEVICES=0,2,3 outside: this worker's HIP numbers GPUs 0, 2, 3 as 0, 1, 2
            assert gpu.device == f"cuda:{[0, 2, 3].index(gpu.indices[0])}"
            assert os.environ["ROCR_VISIBLE_DEVICES"] == gpu.uuids[0]
            assert gpu.env["HIP_VISIBLE_DEVICES"] == gpu.env["CUDA_VISIBLE_DEVICES"] == gpu.visible_devices
            with sim.allocate("1GiB") as block:  # the current device: the lease's
                assert block.physical == gpu.indices[0]

        @pytest.mark.gpu(memory="1GiB")
        def test_outside(gpu):
            other = next(o for o in range(3) if f"cuda:{o}" != gpu.device)
            sim.allocate("256MiB", device=other).free()
        """
    )
    result = amd_run("amd:sim:4x192GiB", "--gpus", "auto", "-p", "no:xdist", ROCR_VISIBLE_DEVICES="0,2,3")
    result.assert_outcomes(passed=4, errors=1)
    result.stdout.fnmatch_lines(["pytest-gpu: 3 AMD GPUs (3x192GiB) [[]amdsmi[]]*"])
    result.stdout.fnmatch_lines(
        ["*used memory on GPU * outside its lease (GPU *) (seen in amdsmi's per-process list, which may be*"]
    )
    assert "not verified" not in result.stdout.str()


def test_a_mixed_request_is_a_usage_error(gpu_pytester, amd_run):
    gpu_pytester.makepyfile("def test_a():\n    pass\n")
    result = amd_run("amd:sim:2x192GiB", "--gpus", "nvidia:0,amd:1")
    assert result.ret != 0
    result.stderr.fnmatch_lines(["*names amd and nvidia GPUs; a run leases one vendor's GPUs*"])


def test_uuid_in_the_outer_rocr_variable(gpu_pytester, amd_run):
    gpu_pytester.makepyfile(
        test_one="""
        import pytest

        @pytest.mark.gpu
        def test_gpu(gpu):
            assert gpu.indices == (1,) and gpu.device == "cuda:0"
        """
    )
    result = amd_run("amd:sim:2x192GiB", "--gpus", "amd:auto", ROCR_VISIBLE_DEVICES=amd_uuid(1))
    result.assert_outcomes(passed=1)


def test_a_rank_pool_gives_each_rank_its_gpu_by_rocr_uuid(gpu_pytester, amd_run, tmp_path):
    seen = tmp_path / "seen"
    seen.mkdir()
    gpu_pytester.makepyfile(
        test_pool=f"""
        import json, os
        import pytest

        @pytest.mark.distributed(world_size=2, backend="none", gpus_per_rank=1)
        def test_ranks(rank):
            from pytest_gpu.sim import cuda

            names = ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL")
            got = {{name: os.environ.get(name) for name in names}}
            got["units"] = cuda.init()
            with open(os.path.join({str(seen)!r}, str(rank.rank)), "w") as f:
                json.dump(got, f)
        """
    )
    result = amd_run("amd:sim:2x192GiB", "--gpus", "auto", "-p", "no:xdist")
    result.assert_outcomes(passed=1)
    units = []
    for r in (0, 1):
        got = json.loads((seen / str(r)).read_text())
        unit = got.pop("units")
        units += unit
        assert got == {
            "ROCR_VISIBLE_DEVICES": amd_uuid(unit[0]),
            "HIP_VISIBLE_DEVICES": amd_uuid(unit[0]),
            "CUDA_VISIBLE_DEVICES": amd_uuid(unit[0]),
            "GPU_DEVICE_ORDINAL": "0",
        }
    assert sorted(units) == [0, 1]  # one GPU each


def test_torch_on_rocm_is_confined_to_the_lease(gpu_pytester, amd_run):
    require("torch", module="torch")
    gpu_pytester.makepyfile(
        test_torch="""
        import pytest
        import torch
        from pytest_gpu.sim import torch_cuda

        @pytest.mark.gpu(memory="2GiB")
        def test_confined(gpu):
            assert torch.version.hip  # torch on ROCm, to its Python side
            assert torch.cuda.current_device() == int(gpu.device.split(":")[1])
            kept = torch_cuda.empty(1 << 30)  # torch.empty(..., device="cuda") in the CPU build's stead
            with pytest.raises(torch.OutOfMemoryError):
                torch_cuda.empty(2 << 30)  # beyond the lease's 2GiB
            assert torch.cuda.max_memory_allocated() >= 1 << 30
            kept.free()
        """
    )
    result = amd_run("amd:sim:2x16GiB", "--gpus", "auto", "-p", "no:xdist", ROCR_VISIBLE_DEVICES="1,0")
    result.assert_outcomes(passed=1)
    assert "not verified" not in result.stdout.str()


def test_the_context_is_measured_through_amdsmi(gpu_pytester, amd_run):
    gpu_pytester.makepyfile(
        test_ctx="""
        import pytest
        from pytest_gpu import sim

        @pytest.mark.gpu(memory="1GiB")
        def test_gpu(gpu):
            sim.allocate("256MiB").free()
        """
    )
    result = amd_run("amd:sim:1x16GiB;context=700MiB", "--gpus", "auto", "-p", "no:xdist")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["pytest-gpu: HIP context measured: GPU 0: 700MiB (assumed 500MiB until measured)"])


def test_gpu_required_without_amd_gpus_says_what_gives_a_job_amd_gpus(gpu_pytester, amd_run):
    gpu_pytester.makepyfile(
        test_req="""
        import pytest

        @pytest.mark.gpu
        def test_gpu(gpu):
            pass
        """
    )
    result = amd_run("sim:2x16GiB", "--gpus", "amd:auto", "--gpu-required")  # an NVIDIA machine
    assert result.ret != 0
    out = result.stdout.str() + result.stderr.str()
    assert "give the job its GPUs (the amdgpu driver, amdsmi, ROCR_VISIBLE_DEVICES, --gpus)" in out, out


# amdsmi's list as a driver that refreshes it every 2 s gives it (the fake's proc-refresh=): each
# test below is pinned by a run that waits for it (--gpu-amd-process-lag=2 --gpu-amd-lag-wait), one
# that only re-checks a violation (lag 2, the default: no wait) and one that does neither (lag 0)
LAGGED = """
import os
import time
import pytest
from pytest_gpu import sim
from pytest_gpu.vendors.amd import AmdSampler

@pytest.mark.gpu(memory="2GiB")
def test_freed_at_the_end(gpu):
    time.sleep(2.2)  # the list the lease began with is due for a refresh
    with sim.allocate("1GiB"):
        driver = AmdSampler()
        try:  # the list is refreshed while the GiB is held ...
            assert driver.processes(gpu.uuids[0])[os.getpid()] >= 1 << 30
        finally:
            driver.close()
    # ... and freed: the list goes on showing it for up to 2 s

@pytest.mark.gpu(memory="1GiB")
def test_outside_in_its_last_moment(gpu):
    other = next(o for o in range(2) if f"cuda:{o}" != gpu.device)
    sim.allocate("256MiB", device=other).free()  # a context there, after the list the lease began with
"""


def test_the_verdict_waits_for_amdsmis_list_where_it_lags(gpu_pytester, amd_run):
    gpu_pytester.makepyfile(test_lagged=LAGGED)
    result = amd_run(
        "amd:sim:2x16GiB;proc-refresh=2000",
        "--gpus",
        "auto",
        "-p",
        "no:xdist",
        "-rA",
        "--gpu-amd-process-lag=2",
        "--gpu-amd-lag-wait",
    )
    # the freed GiB is gone from the list read 2 s after the test ended: not a false "still holds"
    # and the late context is in the list read 2 s after the lease began: not missed
    result.assert_outcomes(passed=2, errors=1)
    out = result.stdout.str()
    assert "still holds" not in out, out
    assert "process-list lag" not in out, out  # waited for: no blind spot to say
    result.stdout.fnmatch_lines(
        ["*ERROR at teardown of test_outside_in_its_last_moment*"],
    )
    result.stdout.fnmatch_lines(
        [
            "*used memory on GPU * outside its lease (GPU *) (seen in amdsmi's per-process list, which may be "
            "rounded to 1MiB, and still there 2 s after the test ended (the list may be that old))*"
        ]
    )


def test_without_the_wait_a_lagging_list_errs_both_ways(gpu_pytester, amd_run):
    """What the wait is for: with --gpu-amd-process-lag=0 on the same driver, the freed GiB reads as
    held, and the late context outside the lease is missed."""
    gpu_pytester.makepyfile(test_lagged=LAGGED)
    result = amd_run(
        "amd:sim:2x16GiB;proc-refresh=2000", "--gpus", "auto", "-p", "no:xdist", "-rA", "--gpu-amd-process-lag=0"
    )
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_freed_at_the_end*"])
    result.stdout.fnmatch_lines(
        [
            "*memory this process still holds after the test*(seen in amdsmi's per-process "
            "list, which may be rounded to 1MiB)*"
        ]
    )
    assert "outside its lease" not in result.stdout.str()


BLIND_SPOT = (
    "pytest-gpu: {n} AMD GPU {tests} shorter than amdsmi's process-list lag (2 s): memory {they} last "
    "moments may not have been seen (--gpu-amd-lag-wait waits it out)"
)


def test_by_default_a_violation_is_rechecked_and_the_short_tests_blind_spot_said(gpu_pytester, amd_run):
    """Without --gpu-amd-lag-wait (the default): the GiB freed at the end is still judged again
    from the list read the lag after the test (no false "still holds"); the short test's late
    context is not waited for, so it is missed, and the summary says that it may be."""
    gpu_pytester.makepyfile(test_lagged=LAGGED)
    result = amd_run(
        "amd:sim:2x16GiB;proc-refresh=2000", "--gpus", "auto", "-p", "no:xdist", "-rA", "--gpu-amd-process-lag=2"
    )
    result.assert_outcomes(passed=2)
    out = result.stdout.str()
    assert "still holds" not in out and "outside its lease" not in out, out
    # test_freed_at_the_end ran longer than the lag: only test_outside_in_its_last_moment is counted
    result.stdout.fnmatch_lines([BLIND_SPOT.format(n=1, tests="test ran", they="it took in its")])


# each verdict's verification timed in the inner run's processes (xdist workers included): the
# verifier's own call, not the run's wall clock
TIMED = """
import time
from pathlib import Path
from pytest_gpu.gpu import verification

_end = verification.NvmlVerifier.end

def _timed(self, lease, others=()):
    start = time.monotonic()
    try:
        return _end(self, lease, others)
    finally:
        with open(Path(__file__).with_name("verify-seconds.txt"), "a") as out:
            out.write(f"{time.monotonic() - start}\\n")

verification.NvmlVerifier.end = _timed
"""

SHORT = """
import time
import pytest
from pytest_gpu import sim

@pytest.mark.parametrize("n", range(4))
@pytest.mark.gpu(memory="1GiB")
def test_short(gpu, n):
    with sim.allocate("256MiB"):
        time.sleep(0.05)
"""


@pytest.mark.parametrize("wait", [False, True], ids=["default", "lag-wait"])
def test_a_short_tests_verification_waits_only_when_asked(gpu_pytester, amd_run, wait):
    gpu_pytester.makeconftest(TIMED)
    gpu_pytester.makepyfile(test_short=SHORT)
    args = ["--gpu-amd-process-lag=2", *(["--gpu-amd-lag-wait"] if wait else [])]
    result = amd_run("amd:sim:2x16GiB", "--gpus", "auto", "-p", "no:xdist", *args)
    result.assert_outcomes(passed=4)
    seconds = [float(line) for line in (gpu_pytester.path / "verify-seconds.txt").read_text().split()]
    assert len(seconds) == 4, seconds
    line = BLIND_SPOT.format(n=4, tests="tests ran", they="they took in their")
    if wait:  # each waits out the rest of the 2 s after its lease began
        assert min(seconds) >= 1.5, seconds
        assert "process-list lag" not in result.stdout.str()
    else:  # a clean short test costs no wait: its verification is a sample or two
        assert max(seconds) < 1.0, seconds
        result.stdout.fnmatch_lines([line])


def test_the_blind_spot_is_counted_across_xdist_workers(gpu_pytester, amd_run):
    gpu_pytester.makepyfile(test_short=SHORT)
    result = amd_run("amd:sim:2x16GiB", "--gpus", "auto", "-n", "2", "--gpu-amd-process-lag=2")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines([BLIND_SPOT.format(n=4, tests="tests ran", they="they took in their")])
    assert result.stdout.str().count("process-list lag") == 1  # once per run, not per worker
