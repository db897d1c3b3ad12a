"""End-to-end: verification after each GPU test, and what gets reported (junitxml, summary)."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from conftest import require

GiB = 2**30

VIOLATORS = """
import os
import subprocess
import sys

import pytest

from pytest_gpu import sim

LEAK = []

@pytest.mark.gpu(memory="2GiB")
def test_outside(gpu):
    # the worker's CUDA sees every GPU of the run: a hard-coded ordinal lands outside the lease
    other = 1 - int(gpu.device.split(":")[1])
    sim.allocate("1GiB", device=other).free()

@pytest.mark.gpu(memory="1GiB")
def test_peak(gpu):
    # a subprocess is not capped in-process: it allocates 2GiB (+ its context) on a 1GiB lease
    code = "from pytest_gpu import sim; sim.allocate('2GiB').free()"
    subprocess.run([sys.executable, "-c", code], check=True)

@pytest.mark.gpu(memory="2GiB")
def test_leak(gpu):
    LEAK.append(sim.allocate("1GiB"))

@pytest.mark.gpu(memory="2GiB")
def test_good(gpu):
    sim.hold("1GiB", 0.01)
"""

OUTSIDE = r"  - used memory on GPU (\d) \(1GiB at peak\) outside its lease \(GPU (\d)\)"
PEAK = r"  - peak 2\.5GiB on GPU \d is above its budget of 1GiB"
LEAKED = r"  - still holds 1GiB on GPU \d after the test \(a leaked allocation, or a subprocess still running\)"


def _check_outside(text: str) -> None:
    match = re.search(OUTSIDE, text)
    assert match is not None, text
    assert match.group(1) != match.group(2)


def test_verify_fail_turns_violations_into_teardown_errors(gpu_pytester, run_inner):
    gpu_pytester.makepyfile(test_v=VIOLATORS)
    result = run_inner("--gpus", "sim:2x16GiB")  # --gpu-verify=fail is the default
    result.assert_outcomes(passed=4, errors=3)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        ["*_ ERROR at teardown of test_outside _*", "pytest-gpu: test_v.py::test_outside broke its GPU lease:"]
    )
    result.stdout.fnmatch_lines(
        ["*_ ERROR at teardown of test_peak _*", "pytest-gpu: test_v.py::test_peak broke its GPU lease:"]
    )
    result.stdout.fnmatch_lines(
        ["*_ ERROR at teardown of test_leak _*", "pytest-gpu: test_v.py::test_leak broke its GPU lease:"]
    )
    result.stdout.re_match_lines([PEAK])
    result.stdout.re_match_lines([LEAKED])
    _check_outside(result.stdout.str())
    assert "test_good broke" not in result.stdout.str()
    assert "INTERNALERROR" not in result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "pytest-gpu: 2 simulated GPUs (2x16GiB) [[]sim:2x16GiB[]] · 4 GPU tests · "
            "waited *s in total · 3 violations",
            "pytest-gpu: lease broken by test_v.py::test_outside",
            "pytest-gpu: lease broken by test_v.py::test_peak",
            "pytest-gpu: lease broken by test_v.py::test_leak",
        ]
    )


def test_verify_warn_passes_with_warnings(gpu_pytester, run_inner):
    gpu_pytester.makepyfile(test_v=VIOLATORS)
    result = run_inner("--gpus", "sim:2x16GiB", "--gpu-verify=warn")
    result.assert_outcomes(passed=4, warnings=3)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(
        [
            "*= warnings summary =*",
            "test_v.py::test_outside",
            "*PytestWarning: pytest-gpu: test_v.py::test_outside broke its GPU lease:",
        ]
    )
    result.stdout.fnmatch_lines(
        ["test_v.py::test_leak", "*PytestWarning: pytest-gpu: test_v.py::test_leak broke its GPU lease:"]
    )
    result.stdout.re_match_lines([r"\s+- peak 2\.5GiB on GPU \d is above its budget of 1GiB"])
    result.stdout.fnmatch_lines(["pytest-gpu: * · 4 GPU tests · * · 3 violations"])


def test_verify_off_checks_nothing(gpu_pytester, run_inner):
    gpu_pytester.makepyfile(test_v=VIOLATORS)
    result = run_inner("--gpus", "sim:2x16GiB", "--gpu-verify=off")
    result.assert_outcomes(passed=4)
    assert "broke its GPU lease" not in result.stdout.str()
    result.stdout.fnmatch_lines(["pytest-gpu: * · 4 GPU tests · * · 0 violations"])


def test_verify_under_xdist(gpu_pytester, run_inner):
    gpu_pytester.makepyfile(test_v=VIOLATORS)
    result = run_inner("--gpus", "sim:2x16GiB", "-n", "2", subprocess=True)
    result.assert_outcomes(passed=4, errors=3)
    result.stdout.re_match_lines([PEAK])
    result.stdout.re_match_lines([LEAKED])
    _check_outside(result.stdout.str())
    result.stdout.fnmatch_lines(["pytest-gpu: * · 4 GPU tests · * · 3 violations"])


def test_in_process_allocation_is_capped_at_the_lease(gpu_pytester, run_inner):
    gpu_pytester.makepyfile(
        test_cap="""
        import pytest
        from pytest_gpu import sim

        @pytest.mark.gpu(memory="1GiB")
        def test_cap(gpu):
            with sim.allocate("768MiB"):
                with pytest.raises(sim.OutOfMemoryError, match=r"is capped at 1GiB \\(its pytest-gpu lease\\)"):
                    sim.allocate("512MiB")

        def test_uncapped_afterwards():
            sim.allocate("4GiB").free()  # no lease, no cap
        """
    )
    run_inner("--gpus", "sim:1x16GiB").assert_outcomes(passed=2)


REPORTED = """
import pytest

from pytest_gpu import sim

@pytest.mark.gpu(memory="2GiB")
def test_one(gpu):
    sim.hold("1GiB", 0.01)

@pytest.mark.gpu(count=2, memory="3GiB")
def test_two(gpu):
    sim.hold("512MiB", 0.01, device=1)  # the second leased GPU only

LEAK = []

@pytest.mark.gpu(memory="1GiB")
def test_leaky(gpu):
    LEAK.append(sim.allocate("256MiB"))

def test_cpu():
    pass
"""


def _properties(xml: Path) -> dict[str, dict[str, str]]:
    out = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        out[case.get("name")] = props
    return out


@pytest.mark.parametrize("xdist", [False, True], ids=["single", "xdist"])
def test_user_properties_in_junitxml(gpu_pytester, run_inner, xdist):
    gpu_pytester.makepyfile(test_r=REPORTED)
    xml = gpu_pytester.path / "junit.xml"
    args = ["--gpus", "sim:2x16GiB", f"--junitxml={xml}"]
    if xdist:
        args += ["-n", "2"]
    result = run_inner(*args, subprocess=xdist)
    result.assert_outcomes(passed=4, errors=1)
    props = _properties(xml)
    assert props["test_cpu"] == {}

    one = props["test_one"]
    assert set(one) == {
        "gpu_indices",
        "gpu_wait_seconds",
        "gpu_peak_bytes",
        "gpu_violations",
        "gpu_request",
        "gpu_request_bytes",
        "gpu_request_source",
        "gpu_leases",
    }
    assert one["gpu_request"] == "1 GPU (2GiB)"
    assert one["gpu_request_source"] == "marker"  # where its memory came from (written requests)
    assert one["gpu_request_bytes"] == str(2 * GiB)
    (lease,) = json.loads(one["gpu_leases"])  # [gpus, bytes, exclusive, asked, granted, released]
    assert lease[:3] == [[int(one["gpu_indices"])], 2 * GiB, False]
    assert lease[3] <= lease[4] <= lease[5]
    assert one["gpu_indices"] in ("0", "1")
    assert float(one["gpu_wait_seconds"]) >= 0
    assert one["gpu_peak_bytes"] == f"{one['gpu_indices']}={GiB}"
    assert one["gpu_violations"] == "0"

    two = props["test_two"]
    assert two["gpu_indices"] == "0,1"
    assert two["gpu_peak_bytes"] == f"0=0,1={512 * 2**20}"
    assert two["gpu_violations"] == "0"

    leaky = props["test_leaky"]
    assert leaky["gpu_violations"] == "1"
    assert leaky["gpu_peak_bytes"] == f"{leaky['gpu_indices']}={256 * 2**20}"

    result.stdout.re_match_lines(
        [
            r"pytest-gpu: 2 simulated GPUs \(2x16GiB\) \[sim:2x16GiB\] · 3 GPU tests · "
            r"waited (\d+\.\ds|\d+ms|<1ms|0s) in total · 1 violation$"
        ]
    )
    result.stdout.fnmatch_lines(["pytest-gpu: lease broken by test_r.py::test_leaky"])


def test_summary_counts_wait_time(gpu_pytester, run_inner):
    # two exclusive tests on one GPU under -n 2: the second asks once the first holds the
    # GPU (for 1.5s after that), so it waits and the first does not
    held = str(gpu_pytester.path / "held")
    gpu_pytester.makeconftest(
        f"""
        import os
        import time
        import pytest

        @pytest.hookimpl(tryfirst=True)
        def pytest_runtest_setup(item):
            if item.name == "test_exclusive[1]":
                deadline = time.monotonic() + 30
                while not os.path.exists({held!r}) and time.monotonic() < deadline:
                    time.sleep(0.02)
        """
    )
    gpu_pytester.makepyfile(
        test_w=f"""
        import pytest
        from pytest_gpu import sim

        @pytest.mark.parametrize("i", range(2))
        @pytest.mark.gpu(exclusive=True)
        def test_exclusive(i, gpu):
            if i == 0:
                open({held!r}, "w").close()
                sim.hold("1GiB", 1.5)
        """
    )
    xml = gpu_pytester.path / "junit.xml"
    # xdist's load scheduling puts them on both workers at once (pytest-gpu's scheduler would
    # run them one after the other on one worker, and nothing would wait)
    args = ("--gpus", "sim:1x16GiB", "-n", "2", "--gpu-schedule=off", f"--junitxml={xml}")
    result = run_inner(*args, subprocess=True)
    result.assert_outcomes(passed=2)
    props = _properties(xml)
    first = float(props["test_exclusive[0]"]["gpu_wait_seconds"])
    second = float(props["test_exclusive[1]"]["gpu_wait_seconds"])
    assert first < 0.5 < second  # the second waited for the first's hold
    total = _seconds(re.search(r"· waited (\S+) in total ·", result.stdout.str()).group(1))
    assert total == pytest.approx(first + second, abs=0.1)
    # the timeline's line prints the same figure, from the same per-test waits
    timeline = _seconds(re.search(r"· waited (\S+) for GPUs", result.stdout.str()).group(1))
    assert timeline == total


THREADED = """
import threading

import pytest
from pytest_gpu import sim


@pytest.mark.gpu(memory="4GiB")
def test_thread_on_its_default_device(gpu):
    assert sim.current_device() == 1  # the lease confined this thread to GPU 1
    seen = []

    def load():
        seen.append(sim.current_device())  # a new thread's current device is its own: 0
        sim.allocate("256MiB").free()

    worker = threading.Thread(target=load, name="loader")
    worker.start()
    worker.join()
    assert seen == [0]


@pytest.mark.gpu(memory="4GiB")
def test_thread_that_chooses_the_lease(gpu):
    def load():
        sim.set_device(gpu.device)
        sim.allocate("256MiB").free()

    worker = threading.Thread(target=load)
    worker.start()
    worker.join()
"""


def test_a_thread_left_on_cuda0_is_named(gpu_pytester, run_inner):
    """Issue 19 (6): the current device is per thread, so a thread the test starts works on
    cuda:0, outside a lease on GPU 1; verification names it and says what the thread must do."""
    gpu_pytester.makepyfile(test_t=THREADED)
    result = run_inner("--gpus", "sim:2GiB,16GiB")  # only GPU 1 fits a 4GiB lease
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*used memory on GPU 0 (256MiB at peak; cuda:0 from another thread (loader)) outside its lease (GPU 1): "
            "a thread's current device is its own*torch.cuda.set_device(lease.device)*"
        ]
    )
    assert "test_thread_that_chooses_the_lease broke" not in result.stdout.str()


def test_a_thread_left_on_cuda0_under_fake_gpus(gpu_pytester, fake_run):
    """The NVML path cannot see threads: it names the process's cuda:0 and says a thread may have used it."""
    gpu_pytester.makepyfile(test_t=THREADED)
    result = fake_run("sim:2GiB,16GiB", "-p", "no:xdist", "--gpus", "auto")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*used memory on GPU 0 (*; this process's cuda:0: perhaps from another thread, which NVML cannot "
            "tell apart) outside its lease (GPU 1): a thread's current device is its own*"
        ]
    )


BACKENDS = """
import pytest
import torch
from pytest_gpu.sim import torch_cuda

MiB = 2**20


@pytest.mark.gpu(memory="1GiB")
def test_pool_keeps_what_was_freed(gpu):
    torch_cuda.empty(600 * MiB, device=gpu.device).free()  # stays reserved in the pool
    block = torch_cuda.empty(700 * MiB, device=gpu.device)  # does not fit the freed chunk: a new one
    assert torch.cuda.get_allocator_backend() == "cudaMallocAsync"
    assert torch.cuda.max_memory_reserved(gpu.device) == 1300 * MiB  # above the lease, no allocation refused
    assert torch.cuda.max_memory_allocated(gpu.device) == 700 * MiB
    with pytest.raises(torch.OutOfMemoryError, match="would exceed allowed memory"):
        torch_cuda.empty(400 * MiB, device=gpu.device)  # 700 + 400 in use: the cap holds
    block.free()


@pytest.mark.gpu(memory="1GiB")
def test_pages_round_past_the_cap(gpu):
    block = torch_cuda.empty(1022 * MiB, device=gpu.device)  # allowed: 0 + 1022MiB <= 1GiB
    assert torch.cuda.max_memory_reserved(gpu.device) == 1040 * MiB  # 52 pages of 20MiB
    block.free()
"""


@pytest.mark.parametrize(
    ("conf", "test"),
    [
        ("backend:cudaMallocAsync", "test_pool_keeps_what_was_freed"),
        ("expandable_segments:True", "test_pages_round_past_the_cap"),
    ],
)
def test_allocator_backends_peak_as_the_cap_counts(gpu_pytester, fake_run, monkeypatch, conf, test):
    """Issue 19 (6): under cudaMallocAsync and expandable segments torch's cap holds while
    max_memory_reserved passes it; the peak is read as the cap counts it (no false violation)."""
    require("torch", module="torch")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
    gpu_pytester.makepyfile(test_b=BACKENDS)
    result = fake_run("sim:2x16GiB", "-p", "no:xdist", "--gpus", "auto", "-k", test)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["pytest-gpu: 2 GPUs (2x16GiB) [[]nvml[]] · 1 GPU test · * · 0 violations"])


def _seconds(text: str) -> float:
    """A wait as the summary prints it ("1.5s", "46ms", "<1ms", "0s"), in seconds."""
    if text.endswith("ms"):
        return 0.0005 if text == "<1ms" else int(text[:-2]) / 1000
    return float(text[:-1])
