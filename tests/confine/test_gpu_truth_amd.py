"""AMD ROCm end to end, on a fake AMD machine (``PYTEST_GPU_FAKE_GPUS=amd:sim:…``): the real
``amdsmi`` package loads the fake ``libamd_smi.so``; discovery, leases, the simulated HIP's
device order and verification take the code path of a real AMD machine. What AMD's GPUs alone
have: amdsmi's coarse and lagging process list, and a request that names two vendors. (What every
vendor does alike, leases, pools, torch, --gpu-required, outer variables in the vendor's own form
(ROCr's UUIDs), foreign usage, a child outside the lease, is tests/confine/test_gpu_truth.py's,
over vendors.)"""

from __future__ import annotations

import functools

import pytest


@pytest.fixture
def amd_run(vendor_run):
    return functools.partial(vendor_run, "amd")


def test_a_mixed_request_is_a_usage_error(gpu_pytester, amd_run):
    gpu_pytester.makepyfile("def test_a():\n    pass\n")
    result = amd_run("amd:sim:2x192GiB", "--gpus", "nvidia:0,amd:1")
    assert result.ret != 0
    result.stderr.fnmatch_lines(["*names amd and nvidia GPUs; a run leases one vendor's GPUs*"])


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
    """What the wait is for: with --gpu-amd-process-lag=0 on the same (hypothetical: amdsmi reads
    live) driver, the late context outside the lease is missed; the freed GiB the stale list still
    shows is not read as held, since the figures then add up to more than the GPU's used VRAM,
    which no list that is true can (the GPU is said not verified instead)."""
    gpu_pytester.makepyfile(test_lagged=LAGGED)
    result = amd_run(
        "amd:sim:2x16GiB;proc-refresh=2000", "--gpus", "auto", "-p", "no:xdist", "-rA", "--gpu-amd-process-lag=0"
    )
    result.assert_outcomes(passed=2)
    out = result.stdout.str()
    assert "still holds" not in out and "outside its lease" not in out, out
    result.stdout.fnmatch_lines(
        [
            "pytest-gpu: not verified: amdsmi cannot list processes on GPU 0 (its processes' figures add up to *, more "
            "than the * in use there: counted once per fd of a DRM client, or out of date): not checked there (*"
        ]
    )


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

def _timed(self, lease, *args, **kwargs):
    start = time.monotonic()
    try:
        return _end(self, lease, *args, **kwargs)
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
