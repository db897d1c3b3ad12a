"""A process's context grows when a kernel or library is first used, and none of it is a test's.

CUDA loads each kernel's module on its first launch (lazy loading, the default since CUDA 12.2),
cuBLAS and cuDNN load and create their handles on first use, local memory grows to what a kernel
needs and never shrinks: NVML's figure for the process grows in test after test of a long-lived
worker, while torch counts none of it. The doubles model that (:func:`pytest_gpu.sim.torch_cuda.launch`,
``matmul``, ``convolution``); these inner runs take the real machine's path (``PYTEST_GPU_FAKE_GPUS``:
the fake ``libnvidia-ml.so.1`` and the real verifier).
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest

from conftest import require
from helpers import patience

MiB = 2**20
FLAGS = ("-p", "no:cacheprovider", "-p", "no:randomly", "-p", "no:xdist", "--gpus", "auto")


def fake_run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, *args: str) -> pytest.RunResult:
    require("C compiler", executable="cc")  # the fake libnvidia-ml.so.1 is built from C
    require("torch", module="torch")
    monkeypatch.setenv("PYTEST_GPU_FAKE_GPUS", "sim:1x16GiB")
    monkeypatch.setenv("PYTEST_GPU_SIM_LEDGER", str(pytester.path / "fake-ledger"))
    return pytester.runpytest_subprocess(*FLAGS, *args, timeout=patience(300))


def peaks(xml: str) -> dict[str, int]:
    found = {}
    for case in ET.fromstring(xml).iter("testcase"):
        for prop in case.iter("property"):
            if prop.get("name") == "gpu_peak_bytes" and prop.get("value"):
                # "index=bytes" per GPU
                value = prop.get("value", "")
                found[case.get("name", "")] = max(int(part.partition("=")[2]) for part in value.split(","))
    return found


LONG_LIVED = """
import pytest
import torch
from pytest_gpu.sim import torch_cuda

@pytest.mark.parametrize("i", range(50))
@pytest.mark.gpu(memory="1GiB")
def test_new_library(i, gpu):
    x = torch_cuda.empty("16MiB")  # the test's own memory: its peak
    torch_cuda.launch(f"kernel{i}", local_memory=f"{4 * (i + 1)}MiB")  # a new module, more local memory
    torch_cuda.matmul(stream=i)  # cuBLAS (loaded once), a workspace on a new stream
    if i % 10 == 0:
        torch_cuda.convolution()  # cuDNN, loaded once
    x.free()
"""


@pytest.mark.slow  # imports torch in the inner run
def test_a_long_lived_worker_meeting_new_libraries_is_charged_nothing_for_them(gpu_pytester, monkeypatch):
    """50 clean tests in one worker, each growing its context (a module, local memory, cuBLAS,
    cuDNN: 446 MiB in all, more than a lifetime allowance of 256 MiB): no violation, and each
    test's peak is its own memory, not its context's growth."""
    gpu_pytester.makepyfile(test_growth=LONG_LIVED)
    xml = gpu_pytester.path / "junit.xml"
    result = fake_run(gpu_pytester, monkeypatch, f"--junitxml={xml}")
    result.assert_outcomes(passed=50)
    assert "broke its GPU lease" not in result.stdout.str(), result.stdout.str()[-3000:]
    found = peaks(xml.read_text())
    assert len(found) == 50, found
    # torch's peak: the 16 MiB tensor's segment and the 20 MiB segment of cuBLAS's workspace
    assert max(found.values()) <= 36 * MiB, found


BASELINE = """
import pytest
import torch
from pytest_gpu import sim
from pytest_gpu.sim import torch_cuda

torch_cuda.empty("1GiB").free()  # at collection: torch's cache holds 1 GiB when the first lease begins
KEPT = []

@pytest.mark.gpu(memory="2GiB")
def test_leaks_outside_torch(gpu):
    KEPT.append(sim.allocate("512MiB"))
"""


@pytest.mark.slow  # imports torch in the inner run
def test_a_leak_outside_torch_is_not_hidden_by_the_cache_the_lease_empties(gpu_pytester, monkeypatch):
    """The lease's confinement empties torch's cache: a baseline taken before it counted those
    blocks, and a leak outside torch up to their size netted to zero."""
    gpu_pytester.makepyfile(test_baseline=BASELINE)
    result = fake_run(gpu_pytester, monkeypatch)
    text = result.stdout.str()
    leak = r"still holds 512MiB on GPU 0 after the test \(memory this process still holds"
    assert re.search(leak, text), text[-3000:]


VENDOR_LONG_LIVED = """
import pytest
import torch
from pytest_gpu.sim import torch_cuda

@pytest.mark.parametrize("i", range(50))
@pytest.mark.gpu(memory="1GiB")
def test_new_library(i, gpu):
    x = torch_cuda.empty("16MiB", gpu.device)  # the test's own memory: its peak
    torch_cuda.launch(f"kernel{i}", gpu.device, local_memory=f"{4 * (i + 1)}MiB")
    torch_cuda.matmul(gpu.device, stream=i)  # hipBLAS (a new stream's workspace), oneDNN: loaded once
    if i % 10 == 0:
        torch_cuda.convolution(gpu.device)  # MIOpen, oneDNN: loaded once
    x.free()
"""


@pytest.mark.slow  # imports torch in the inner run
@pytest.mark.parametrize(
    ("vendor", "spec", "gpus", "env", "peak"),
    [  # torch's peak: the tensor's 16 MiB segment, and on ROCm the 32 MiB workspace of a new stream
        ("amd", "amd:sim:2x16GiB;context=512MiB", "auto", {"PYTEST_GPU_SIM_ROCM": ""}, 48 * MiB),
        ("amd", "amd:sim:2x16GiB;context=512MiB", "auto", {"PYTEST_GPU_SIM_ROCM": "6.1.0"}, 48 * MiB),
        ("xpu", "xpu:sim:2x64GiB", "xpu:auto", {}, 16 * MiB),  # oneDNN keeps no workspace
    ],
    ids=["amd-newest", "amd-rocm-6.1.0", "intel"],
)
def test_a_long_lived_worker_meeting_new_libraries_is_charged_nothing_on_every_vendor(
    gpu_pytester, vendor_run, vendor, spec, gpus, env, peak
):
    """The same 50 tests on a fake AMD machine (torch on ROCm: torch.cuda; amdsmi's per-process
    figure, at the newest release and before rocm-6.1.2's dicts) and a fake Intel one (torch.xpu;
    Sysman's per-process memSize): each process's figure grows with its context there too, and
    no test is charged for it."""
    require("torch", module="torch")
    gpu_pytester.makepyfile(test_growth=VENDOR_LONG_LIVED)
    xml = gpu_pytester.path / "junit.xml"
    result = vendor_run(vendor, spec, "--gpus", gpus, "-p", "no:xdist", f"--junitxml={xml}", **env)
    result.assert_outcomes(passed=50)
    out = result.stdout.str()
    assert "· 0 violations" in out, out[-3000:]
    assert "broke its GPU lease" not in out and "still holds" not in out, out[-3000:]
    assert "not checked" not in out and "not verified" not in out, out[-3000:]
    found = peaks(xml.read_text())
    assert len(found) == 50, found
    assert set(found.values()) == {peak}, found  # each test's own memory, none of its context's growth
