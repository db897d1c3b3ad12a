"""What a test is charged on the NVML path (fake GPUs: the code path of a real machine).

The test's usage is its process's NVML usage above the baseline of setup (every allocator)
plus the processes it started; processes alive before it began (a pool, the Ray head, a
fixture's server) are their holder's. Inner runs use ``PYTEST_GPU_FAKE_GPUS``: the real
nvidia-ml-py on the fake ``libnvidia-ml.so.1``, which reports what each pid holds.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess

import pytest

from conftest import require
from helpers import patience
from pytest_gpu.gpu import verification
from pytest_gpu.gpu.isolation import GpuLease

MiB, GiB = 2**20, 2**30
FLAGS = ("-p", "no:cacheprovider", "-p", "no:randomly", "-p", "no:xdist", "--gpus", "auto")


def fake_run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, spec: str, *args: str) -> pytest.RunResult:
    require("C compiler", executable="cc")  # the fake libnvidia-ml.so.1 is built from C
    monkeypatch.setenv("PYTEST_GPU_FAKE_GPUS", spec)
    monkeypatch.setenv("PYTEST_GPU_SIM_LEDGER", str(pytester.path / "fake-ledger"))
    return pytester.runpytest_subprocess(*FLAGS, *args, timeout=patience(180))


LEAKS = """
import pytest
from pytest_gpu import sim

KEPT = []

@pytest.mark.gpu(memory="2GiB")
def test_keeps(gpu):
    KEPT.append(sim.allocate("1GiB"))

@pytest.mark.gpu(memory="2GiB")
def test_after(gpu):
    pass
"""


def test_a_global_allocation_is_a_leak_under_fake_gpus(gpu_pytester, monkeypatch):
    gpu_pytester.makepyfile(test_leaks=LEAKS)
    result = fake_run(gpu_pytester, monkeypatch, "sim:1x16GiB")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        [
            "pytest-gpu: test_leaks.py::test_keeps broke its GPU lease:",
            "  - still holds 1GiB on GPU 0 after the test (memory this process still holds after the test)",
        ]
    )
    assert "test_after broke" not in result.stdout.str()  # the next test is not charged for it
    result.stdout.fnmatch_lines(["pytest-gpu: 1 GPU (1x16GiB) [[]nvml[]] · 2 GPU tests · * · 1 violation"])


LEAKS_TORCH = """
import pytest
import torch
from pytest_gpu import sim
from pytest_gpu.sim import torch_cuda

KEPT = []

@pytest.mark.gpu(memory="3GiB")
def test_keeps(gpu):
    torch_cuda.empty("256MiB").free()  # torch is the allocator too, and started CUDA
    KEPT.append(sim.allocate("1GiB"))  # ... but this is another allocator's

@pytest.mark.gpu(memory="3GiB")
def test_tensor(gpu):
    KEPT.append(torch_cuda.empty("1GiB"))
"""


@pytest.mark.slow  # imports torch in the inner run
def test_with_torch_loaded_other_allocators_still_count(gpu_pytester, monkeypatch):
    require("torch", module="torch")
    gpu_pytester.makepyfile(test_leaks=LEAKS_TORCH)
    result = fake_run(gpu_pytester, monkeypatch, "sim:1x16GiB")
    result.assert_outcomes(passed=2, errors=2)
    text = result.stdout.str()
    assert re.search(r"test_keeps broke its GPU lease:\n  - still holds 1GiB on GPU 0 after the test \(memory", text), (
        text
    )
    assert re.search(r"test_tensor broke its GPU lease:\n  - still holds 1GiB on GPU 0 after the test \(torch", text), (
        text
    )


SIZES = """
import pytest
from pytest_gpu import sim

@pytest.mark.parametrize("size", ["100MiB", "512MiB", "1GiB", "5GiB"])
@pytest.mark.gpu(memory="8GiB")
def test_alloc(size, gpu):
    with sim.allocate(size):  # freed before the test ends: NVML's sample at the end cannot see it
        pass
"""


def test_no_suggestion_from_a_peak_that_was_not_seen(gpu_pytester, monkeypatch):
    gpu_pytester.makepyfile(test_sizes=SIZES)
    xml = gpu_pytester.path / "junit.xml"
    result = fake_run(gpu_pytester, monkeypatch, "sim:1x16GiB", f"--junitxml={xml}")
    result.assert_outcomes(passed=4)
    assert "peaked at 0B" not in result.stdout.str()
    assert "suggest memory" not in result.stdout.str()
    # the report says the peak is unknown, not zero
    assert 'name="gpu_peak_bytes" value=""' in xml.read_text()


POOLED = """
import subprocess
import sys

import pytest
from pytest_gpu.gpu import verification

HOLD = "from pytest_gpu import sim; import sys; a = sim.allocate('1GiB'); print('up', flush=True); sys.stdin.read()"


def start():
    # before any lease: the machine's whole view, its GPU 0
    proc = subprocess.Popen([sys.executable, "-c", HOLD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "up\\n"
    return proc


# started at collection, before any test (as torch.compile's workers start before the test
# that finds them): no holder claims it, so it is named
WORKERS = start()


@pytest.fixture(scope="session")
def server():
    proc = start()  # set up during the first test's setup: the fixture's, not that test's
    yield proc
    proc.stdin.close()
    proc.wait()


@pytest.fixture(scope="session")
def pool():
    proc = start()
    verification.claim_processes([proc.pid], "rank pool of test_x")  # its holder answers for it
    yield proc
    verification.release_processes([proc.pid])
    proc.stdin.close()
    proc.wait()


@pytest.mark.gpu(memory="1GiB")
def test_with_server(server, gpu):
    pass


@pytest.mark.gpu(memory="1GiB")
def test_with_pool(pool, gpu):
    pass


@pytest.mark.gpu(memory="1GiB")
def test_last(gpu):
    WORKERS.stdin.close()
    WORKERS.wait()
"""


def test_processes_alive_before_the_test_are_not_charged_to_it(gpu_pytester, monkeypatch):
    gpu_pytester.makepyfile(test_pooled=POOLED)
    result = fake_run(gpu_pytester, monkeypatch, "sim:2x16GiB")
    result.assert_outcomes(passed=3)
    text = result.stdout.str()
    assert "broke its GPU lease" not in text, text
    result.stdout.fnmatch_lines(["pytest-gpu: 2 GPUs (2x16GiB) [[]nvml[]] · 3 GPU tests · * · 0 violations"])
    # the unclaimed process is named (in the two tests it outlived); the fixture's and the pool's are not
    notes = [line for line in text.splitlines() if "started before the test" in line]
    assert len(notes) == 1, text
    assert re.match(
        r"pytest-gpu: not verified: pid \d+ \(python[\d.]*\), started before the test, uses GPU 0: "
        r"not charged to the test .* \(2 tests\)$",
        notes[0],
    ), notes


CHILDREN = """
import subprocess
import sys

import pytest

HOLD = "from pytest_gpu import sim; import sys; a = sim.allocate('1GiB'); print('up', flush=True); sys.stdin.read()"
LEFT = []


@pytest.mark.gpu(memory="2GiB")
def test_leaves_a_child(gpu):
    proc = subprocess.Popen([sys.executable, "-c", HOLD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "up\\n"
    LEFT.append(proc)


@pytest.mark.gpu(memory="2GiB")
def test_next(gpu):
    LEFT.pop().communicate()  # the child ends: the next test is not charged for it
"""


def test_a_child_the_test_started_and_left_running_is_a_leak(gpu_pytester, monkeypatch):
    gpu_pytester.makepyfile(test_children=CHILDREN)
    result = fake_run(gpu_pytester, monkeypatch, "sim:1x16GiB")
    result.assert_outcomes(passed=2, errors=1)
    text = result.stdout.str()
    assert re.search(
        r"test_leaves_a_child broke its GPU lease:\n  - still holds 1\.5GiB on GPU 0 after the test "
        r"\(a process the test started still running: pid \d+ \(python",
        text,
    ), text
    assert "test_next broke" not in text


# -- the rule, in-process ----------------------------------------------------------------------


def test_judge_names_what_holds_the_memory() -> None:
    lease = GpuLease("k", (0,), ("GPU-0",), 2 * GiB, False, "cuda:0", "0", {}, 0.0)
    verdict = verification.judge(lease, {0: GiB}, {0: GiB}, [0], (), {0: "pid 7 (python) still running"})
    assert verdict.violations == ["still holds 1GiB on GPU 0 after the test (pid 7 (python) still running)"]
    plain = verification.judge(lease, {0: GiB}, {0: GiB}, [0])
    assert plain.violations == [
        "still holds 1GiB on GPU 0 after the test (a leaked allocation, or a subprocess still running)"
    ]


@pytest.mark.parametrize(
    ("vendor", "context"),
    [("nvidia", "a CUDA context"), ("amd", "a HIP context"), ("xpu", "a Level Zero context")],
)
def test_judge_names_a_context_outside_the_lease_by_the_vendors_runtime(vendor: str, context: str) -> None:
    lease = GpuLease("k", (0,), ("GPU-0",), 2 * GiB, False, "cuda:0", "0", {}, 0.0, vendor=vendor)
    verdict = verification.judge(lease, {0: GiB}, {}, [0, 1])  # GPU 1 touched, no memory seen at peak
    assert verdict.violations == [f"used memory on GPU 1 ({context}) outside its lease (GPU 0)"]


@pytest.mark.parametrize(("vendor", "runtime"), [("nvidia", "CUDA"), ("amd", "HIP"), ("xpu", "Level Zero")])
def test_the_context_is_named_by_the_inventorys_runtime(vendor: str, runtime: str) -> None:
    from pytest_gpu.report.summary import context_lines
    from pytest_gpu.vendors.devices import Inventory

    inventory = Inventory(devices=(), source="test", vendor=vendor)
    assert inventory.runtime == runtime
    assert context_lines({0: 700 * MiB}, 500 * MiB, False, inventory.runtime) == [
        f"pytest-gpu: {runtime} context measured: GPU 0: 700MiB (assumed 500MiB until measured)"
    ]
    assert context_lines({}, 500 * MiB, True, inventory.runtime) == [
        f"pytest-gpu: {runtime} context: 500MiB per process, as --gpu-context-overhead gives it"
    ]


def test_context_growth_is_allowed_in_each_test_not_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verification, "_grown", {})
    grow = verification._beyond_context
    allowance = verification.CONTEXT_GROWTH
    assert grow(1, 0, 100 * MiB) == 0  # cuBLAS loaded: the context's
    assert grow(1, 0, allowance) == 0  # another test, another library: the context's again
    assert grow(1, 0, allowance + MiB) == allowance + MiB  # more than a context grows by in a test: all held
    for _ in range(10):  # a long-lived worker: test after test within the allowance is never charged
        assert grow(1, 0, 100 * MiB) == 0
    assert verification._grown[(1, 0)] == 1100 * MiB + allowance  # what standing() leaves out as context
    assert grow(1, 1, 100 * MiB) == 0 and grow(2, 0, 100 * MiB) == 0  # per GPU and process


def test_a_claim_lapses_when_its_process_ends() -> None:
    proc = subprocess.Popen(["sleep", "30"])
    try:
        verification.claim_processes([proc.pid], "rank pool")
        assert verification.claimed()[proc.pid] == "rank pool"
    finally:
        proc.kill()
        proc.wait()
    assert proc.pid not in verification.claimed()  # its pid may be another process's now


def test_processes_started_inside_claiming_are_the_holders() -> None:
    before = subprocess.Popen(["sleep", "30"])
    try:
        with verification.claiming("fixture server"):
            inside = subprocess.Popen(["sleep", "30"])
        try:
            found = verification.claimed()
            assert found.get(inside.pid) == "fixture server"
            assert before.pid not in found
        finally:
            inside.kill()
            inside.wait()
            verification.release_processes([inside.pid])
    finally:
        before.kill()
        before.wait()


def test_usage_nvml_does_not_give_is_said_not_guessed(gpu_pytester, monkeypatch):
    """A driver that lists processes without their memory (WDDM: ``usedGpuMemory`` None): no
    leak is claimed or denied, no peak is recorded, and the summary says why."""
    gpu_pytester.makepyfile(test_leaks=LEAKS)
    xml = gpu_pytester.path / "junit.xml"
    result = fake_run(gpu_pytester, monkeypatch, "sim:1x16GiB;no-usage", f"--junitxml={xml}")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        [
            "pytest-gpu: 1 GPU (1x16GiB) [[]nvml[]] · 2 GPU tests · * · 0 violations",
            "pytest-gpu: not verified: NVML does not say how much memory processes use on GPU 0 (2 tests)",
        ]
    )
    assert 'name="gpu_peak_bytes" value=""' in xml.read_text()


def test_a_pools_ranks_outside_this_process_tree_are_sampled_too() -> None:
    """An ``srun`` step's tasks are children of Slurm's step daemon, not of pytest: a rank
    that is not a descendant is sampled with its own descendants all the same."""
    from pytest_gpu.vendors.devices import Inventory

    shell = subprocess.run(["sh", "-c", "sleep 30 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True)
    orphan = int(shell.stdout)  # re-parented once its shell ended
    try:
        verifier = verification.NvmlRankVerifier(Inventory((), "none"), 0, pids=[orphan, 999_999_999])
        assert orphan not in verification.descendants()
        tree = verifier._tree()
        assert orphan in tree and 999_999_999 not in tree  # a rank that ended is nothing to sample
    finally:
        os.kill(orphan, signal.SIGKILL)
