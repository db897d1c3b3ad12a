"""A sticky CUDA error quarantines the process whose CUDA it broke (issue 19, item 5).

The doubles first: after ``sim.poison()`` every CUDA call of the process fails as real
CUDA's do (torch: ``torch.AcceleratorError`` from ``C10_CUDA_CHECK``), and the memory it
holds stays charged until it exits. Then the plugin: the lease stays charged, the report
names the test and the error, an xdist worker ends itself so xdist replaces it, and no
later test sees a raw CUDA error.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import require
from helpers import patience
from pytest_gpu import sim
from pytest_gpu.run.quarantine import sticky_message

GiB, MiB = 2**30, 2**20


@pytest.fixture
def ledger_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    path = tmp_path / "ledger"
    monkeypatch.setenv(sim.LEDGER_ENV, str(path))
    monkeypatch.setenv(sim.SPEC_ENV, "sim:2x4GiB")
    monkeypatch.setenv(sim.OVERHEAD_ENV, "512MiB")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv(sim.TAG_ENV, raising=False)
    sim.cuda.forget()
    yield path
    sim.cuda.forget()


def test_poison_fails_every_cuda_call_and_keeps_the_memory(ledger_dir):
    held = sim.allocate("1GiB", device=1)
    assert sim.sticky_error() is None
    sim.poison()
    assert sim.sticky_error() == "device-side assert triggered"
    for call in (
        lambda: sim.allocate("1MiB", device=1),
        lambda: sim.set_device(0),
        lambda: sim.mem_get_info(1),
        sim.synchronize,
        held.free,  # cudaFree fails too: the memory is the process's until it exits
    ):
        with pytest.raises(sim.CudaError, match=r"^CUDA error: device-side assert triggered$"):
            call()
    assert sim.usage()[1] == 1 * GiB + 512 * MiB  # still charged: allocation and context
    with pytest.raises(ValueError, match="not a sticky CUDA error"):
        sim.poison("out of memory")
    sim.ledger().release(os.getpid())  # the process exits: the driver frees it all
    assert sim.usage()[1] == 0


def test_sticky_message_reads_torch_and_cupy_errors():
    torch_text = "CUDA error: an illegal memory access was encountered\nSearch for `cudaErrorIllegalAddress' in ..."
    assert sticky_message(torch_text) == "CUDA error: an illegal memory access was encountered"
    assert sticky_message("cudaErrorAssert: device-side assert triggered") is not None
    assert sticky_message("CUDA out of memory. Tried to allocate 2.00 GiB") is None


@pytest.mark.slow
def test_torch_raises_accelerator_error_after_a_device_side_assert(tmp_path):
    require("torch", module="torch")
    require("C compiler", executable="cc")
    code = """
import torch
from pytest_gpu import sim
from pytest_gpu.sim import fake, torch_cuda
assert fake.activate()
x = torch_cuda.empty(64 * 2**20, device=1)
sim.poison()
for name, call in [
    ("synchronize", torch.cuda.synchronize),
    ("empty_cache", torch.cuda.empty_cache),
    ("set_device", lambda: torch.cuda.set_device(0)),
    ("empty", lambda: torch_cuda.empty(1024, device=1)),
    ("mem_get_info", lambda: torch.cuda.mem_get_info(1)),
]:
    try:
        call()
    except torch.AcceleratorError as exc:
        assert str(exc).startswith("CUDA error: device-side assert triggered\\nSearch for `cudaErrorAssert'"), exc
        assert "CUDA_LAUNCH_BLOCKING=1" in str(exc)
    else:
        raise AssertionError(name + " did not raise")
assert torch.cuda.memory_allocated(1) == 64 * 2**20  # host-side statistics still answer
from pytest_gpu.run.quarantine import probe
# the plugin's probe, through torch as on a real GPU: synchronize where torch has a context
assert probe(["cuda:1"]) == "CUDA error: device-side assert triggered"
assert probe(["cuda:0"]) is None  # no context there: none is opened to ask
print("OK")
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_GPU_") and k != "CUDA_VISIBLE_DEVICES"}
    env.update(PYTEST_GPU_FAKE_GPUS="sim:2x16GiB", PYTEST_GPU_SIM_LEDGER=str(tmp_path / "ledger"))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=patience(120))
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout + done.stderr


# -- the plugin -------------------------------------------------------------------------

SUITE = """
import pytest
from pytest_gpu import sim

kept = []

@pytest.mark.gpu(memory="4GiB")
def test_a_breaks_cuda():
    kept.append(sim.allocate("3GiB"))
    sim.poison()
    sim.synchronize()

@pytest.mark.gpu(memory="12GiB")
def test_b_needs_the_gpu():
    sim.allocate("11GiB").free()

@pytest.mark.gpu(memory="12GiB")
def test_c_needs_the_gpu():
    sim.allocate("11GiB").free()

def test_d_cpu():
    pass
"""


def test_one_process_refuses_later_gpu_tests_naming_the_test(gpu_pytester, run_inner):
    """Without xdist the process stays: its later GPU tests fail at once with a message
    that names the test that broke CUDA, never with a raw CUDA error."""
    gpu_pytester.makepyfile(test_sticky=SUITE)
    result = run_inner("--gpus", "sim:1x16GiB", "-p", "no:randomly", "--gpu-wait-timeout=20")
    result.assert_outcomes(passed=1, failed=1, errors=2)  # b and c fail at setup: not run
    out = result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "*test_b_needs_the_gpu could not get 1 GPU*: not run: test_sticky.py::test_a_breaks_cuda left this "
            "process's CUDA unusable (CUDA error: device-side assert triggered)*",
            "pytest-gpu: quarantined: test_sticky.py::test_a_breaks_cuda left CUDA unusable "
            "(CUDA error: device-side assert triggered); the GPU tests after it in this process were not run*",
        ]
    )
    assert out.count("CudaError: CUDA error") == 1  # test_a's own failure only
    assert "violation" not in out.replace("0 violations", "")  # the memory it holds is no leak of its own


def test_worker_ends_itself_and_xdist_replaces_it(gpu_pytester, run_inner):
    """Under xdist the worker whose CUDA broke ends after the test, holding its GPU memory
    till then; a fresh worker runs the tests after it, which need that memory."""
    gpu_pytester.makepyfile(test_sticky=SUITE)
    result = run_inner(
        "--gpus", "sim:1x16GiB", "-n", "1", "-p", "no:randomly", "--gpu-wait-timeout=60", subprocess=True
    )
    result.assert_outcomes(passed=3, failed=1)
    out = result.stdout.str()
    assert "replacing crashed worker gw0" in out
    result.stdout.fnmatch_lines(
        [
            "pytest-gpu: quarantined: test_sticky.py::test_a_breaks_cuda left CUDA unusable "
            "(CUDA error: device-side assert triggered); worker gw0 held its GPU memory until it ended "
            "itself, and xdist replaced it",
        ]
    )
    assert out.count("CUDA error: device-side assert") == out.count("CudaError: CUDA error") + 1
    assert "crashed while running" not in out and "died while running" not in out


def test_under_dist_the_worker_stays_and_refuses_its_later_gpu_tests(gpu_pytester, run_inner):
    """With --dist, xdist's own scheduler would report the test the worker holds as crashed
    if it ended: the worker stays quarantined and refuses its GPU tests, naming the cause."""
    gpu_pytester.makepyfile(test_sticky=SUITE)
    result = run_inner(
        "--gpus",
        "sim:1x16GiB",
        "-n",
        "1",
        "--dist",
        "load",
        "-p",
        "no:randomly",
        "--gpu-wait-timeout=20",
        subprocess=True,
    )
    result.assert_outcomes(passed=1, failed=1, errors=2)
    out = result.stdout.str()
    assert "replacing crashed worker" not in out and "crashed while running" not in out
    result.stdout.fnmatch_lines(
        [
            "*test_b_needs_the_gpu could not get 1 GPU*: not run: test_sticky.py::test_a_breaks_cuda left this "
            "process's CUDA unusable (CUDA error: device-side assert triggered)*",
            "pytest-gpu: quarantined: test_sticky.py::test_a_breaks_cuda left CUDA unusable (CUDA error: "
            "device-side assert triggered); the GPU tests after it in worker gw0 (--dist chosen) were not run*",
        ]
    )


TORCH_SUITE = """
import pytest
import torch
from pytest_gpu import sim
from pytest_gpu.sim import torch_cuda

kept = []

@pytest.mark.gpu(memory="4GiB")
def test_a_breaks_cuda():
    kept.append(torch_cuda.empty("3GiB"))
    sim.poison("an illegal memory access was encountered")  # what a faulty kernel leaves
    torch.cuda.synchronize()

@pytest.mark.gpu(memory="12GiB")
def test_b_needs_the_gpu():
    torch_cuda.empty("11GiB").free()
"""


@pytest.mark.parametrize("workers", [(), ("-n", "1")], ids=["one-process", "xdist"])
def test_torch_after_an_illegal_address(gpu_pytester, run_inner, workers):
    """torch's path: without quarantine the next test's adapter meets the raw
    ``torch.AcceleratorError`` at ``empty_cache()``."""
    require("torch", module="torch")
    gpu_pytester.makepyfile(test_sticky=TORCH_SUITE)
    result = run_inner("--gpus", "sim:1x16GiB", "-p", "no:randomly", "--gpu-wait-timeout=60", *workers, subprocess=True)
    out = result.stdout.str()
    error = "CUDA error: an illegal memory access was encountered"
    assert f"quarantined: test_sticky.py::test_a_breaks_cuda left CUDA unusable ({error})" in out
    if workers:
        result.assert_outcomes(passed=1, failed=1)
        assert "replacing crashed worker gw0" in out
    else:
        result.assert_outcomes(failed=1, errors=1)
        result.stdout.fnmatch_lines([f"*test_b_needs_the_gpu could not get 1 GPU*: not run: *({error})*"])
    assert out.count("AcceleratorError: CUDA error") == 1, out  # test_a's own
