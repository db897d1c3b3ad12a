"""Verdicts on a real GPU: what pytest-gpu says after each test, checked against what the test did.

Every check here runs inner pytest sessions on the machine's GPU 0 and reads each test's
outcome and its ``gpu_*`` properties from a junit file, so a verdict that is blind ("not
verified"), false (a violation for a test that kept to its lease) or missing (no violation
for one that did not) fails the check. About 4 to 6 minutes on one H100/H200.

Skipped where ``nvidia-smi`` sees no GPU, like the rest of ``tests/gpu``; the optional
frameworks (CuPy, JAX) are skipped, by name, where they are not installed.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from test_real_gpu import GPUS, NO_GPU, nvidia_smi_gpus  # tests/gpu is on sys.path (prepend mode)

from helpers import patience

pytestmark = [pytest.mark.skipif(not GPUS, reason=NO_GPU), pytest.mark.slow]  # inner pytest sessions

GIB = 1024**3


@dataclass
class Case:
    """One inner test as its junit file tells it."""

    outcome: str  # passed, failed (the call), error (setup or teardown), skipped
    text: str  # failure and error messages, and the test's captured output
    props: dict[str, str] = field(default_factory=dict)

    @property
    def violations(self) -> int:
        return int(self.props.get("gpu_violations", "0") or 0)

    @property
    def peak(self) -> int:
        """The highest peak on one GPU (bytes); -1 where the verdict gave none (unmeasured)."""
        text = self.props.get("gpu_peak_bytes", "")
        values = [int(v.split("=")[-1]) for v in text.split(",") if v]
        return max(values) if values else -1


@dataclass
class Inner:
    out: str
    returncode: int
    cases: dict[str, Case]


def inner_run(
    directory: Path, source: str, *args: str, env: dict[str, str] | None = None, timeout: float = 300
) -> Inner:
    """Run ``source`` as ``test_inner.py`` in a pytest of its own on the real GPUs."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "test_inner.py").write_text(source)
    junit = directory / "junit.xml"
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly", "-rA"]
    command += ["--junitxml", str(junit), *args, "test_inner.py"]
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_GPU_") and k != "CUDA_VISIBLE_DEVICES"}
    environ["PYTEST_GPU_MACHINE_DIR"] = str(directory / "machines")
    done = subprocess.run(
        command,
        cwd=directory,
        env={**environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=patience(timeout),
    )
    out = done.stdout + done.stderr
    cases: dict[str, Case] = {}
    if junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            name = case.get("name", "")
            outcome = "passed"
            texts = []
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                    texts.append((child.get("message") or "") + "\n" + (child.text or ""))
                elif child.tag in ("system-out", "system-err"):
                    texts.append(child.text or "")
            props = {p.get("name", ""): p.get("value", "") for p in case.iter("property")}
            cases[name] = Case(outcome, "\n".join(texts), props)
    return Inner(out, done.returncode, cases)


def measured(inner: Inner, peaks: tuple[str, ...] | None = None) -> None:
    """Verification really measured: no "not verified" line, and a peak for each test named
    in ``peaks`` (default: every GPU test; a pool's test has none: NVML keeps no peak)."""
    assert "not verified" not in inner.out, inner.out
    for name, case in inner.cases.items():
        if case.props.get("gpu_indices") and (peaks is None or name in peaks):
            assert case.peak >= 0, f"{name}: no peak measured\n{inner.out}"


@pytest.fixture
def cuda_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
        capture_output=True,
        text=True,
        timeout=patience(300),
    )
    if out.stdout.strip() != "True":
        pytest.skip(f"torch without CUDA here ({(out.stdout + out.stderr).strip()[-200:]}) (real-GPU suite)")


def total_bytes() -> int:
    return nvidia_smi_gpus()[0][2] * 2**20


VERDICTS = """
import multiprocessing, os, subprocess, sys, time
import pytest, torch

MIB = 1024**2
_kept = []

@pytest.mark.gpu(memory="1GiB")
def test_kernels_within_the_lease(gpu):
    d = gpu.device
    a = torch.randn(2048, 2048, device=d)
    (a @ a).sum().item()
    x = torch.randn(8, 16, 64, 64, device=d)
    w = torch.randn(32, 16, 3, 3, device=d)
    torch.nn.functional.conv2d(x, w).sum().item()
    q = torch.randn(4, 8, 256, 64, device=d, dtype=torch.float16)
    torch.nn.functional.scaled_dot_product_attention(q, q, q).sum().item()
    torch.fft.fft(torch.randn(1 << 20, device=d)).abs().sum().item()
    torch.cuda.synchronize()

@pytest.mark.gpu(memory="1GiB")
def test_a_global_tensor_is_a_leak(gpu):
    _kept.append(torch.empty(256 * MIB, dtype=torch.uint8, device=gpu.device))

@pytest.mark.gpu(memory="1GiB")
def test_failing_with_a_live_tensor(gpu):
    x = torch.empty(256 * MIB, dtype=torch.uint8, device=gpu.device)
    assert x.numel() == 0, "meant to fail"

CHILD = (
    "import sys, torch; x = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device='cuda'); "
    "x.fill_(1); torch.cuda.synchronize()"
)

@pytest.mark.gpu(memory="1GiB")
def test_a_spawned_child_within_the_lease(gpu):
    subprocess.run([sys.executable, "-c", CHILD, str(512 * MIB)], env={**os.environ, **gpu.env}, check=True)

@pytest.mark.gpu(memory="1GiB")
def test_a_spawned_child_over_the_budget(gpu):
    subprocess.run([sys.executable, "-c", CHILD, str(1536 * MIB)], env={**os.environ, **gpu.env}, check=True)

def _cpu_work(n):
    return sum(range(n))

@pytest.mark.gpu(memory="1GiB")
def test_a_forked_child_that_does_cpu_work(gpu):
    torch.ones(4, device=gpu.device).sum().item()  # CUDA started before the fork: the child must not use it
    with multiprocessing.get_context("fork").Pool(2) as pool:
        assert pool.map(_cpu_work, [1000, 2000]) == [sum(range(1000)), sum(range(2000))]
"""


def test_verdicts_match_what_each_test_did(tmp_path, cuda_torch):
    inner = inner_run(tmp_path / "verdicts", VERDICTS, "-n", "2", "--gpus", "0", "--gpu-verify=fail")
    cases = inner.cases
    assert set(cases) >= {
        "test_kernels_within_the_lease",
        "test_a_global_tensor_is_a_leak",
        "test_failing_with_a_live_tensor",
        "test_a_spawned_child_within_the_lease",
        "test_a_spawned_child_over_the_budget",
        "test_a_forked_child_that_does_cpu_work",
    }, inner.out
    measured(inner)
    ok = cases["test_kernels_within_the_lease"]
    assert ok.outcome == "passed" and ok.violations == 0 and ok.peak > 0, inner.out
    leak = cases["test_a_global_tensor_is_a_leak"]
    assert leak.outcome == "error" and "still holds" in leak.text, inner.out
    failing = cases["test_failing_with_a_live_tensor"]
    assert failing.outcome == "failed" and "meant to fail" in failing.text, inner.out
    assert "still holds" not in failing.text and failing.violations == 0, inner.out  # no second, false error
    child = cases["test_a_spawned_child_within_the_lease"]
    assert child.outcome == "passed" and child.violations == 0, inner.out
    assert child.peak >= 512 * 2**20, f"the child's 512 MiB is the test's: peak {child.peak}\n{inner.out}"
    over = cases["test_a_spawned_child_over_the_budget"]
    assert over.outcome == "error" and "above its budget" in over.text, inner.out
    forked = cases["test_a_forked_child_that_does_cpu_work"]
    assert forked.outcome == "passed" and forked.violations == 0, inner.out


def test_the_context_is_measured_and_printed(tmp_path, cuda_torch):
    """The first lease of GPU 0 measures the CUDA context; the summary prints the figure."""
    source = "import pytest, torch\n\n@pytest.mark.gpu(memory='1GiB')\ndef test_one(gpu):\n"
    source += "    torch.ones(4, device=gpu.device).sum().item()\n"
    inner = inner_run(tmp_path / "context", source, "-p", "no:xdist", "--gpus", "0")
    assert inner.returncode == 0, inner.out
    lines = [line for line in inner.out.splitlines() if "context" in line and "measured" in line]
    assert lines, inner.out
    print("\n".join(lines))  # the calibration, for the note


PACKING = """
import os, time, pytest, torch

LEASE = int(os.environ["LEASE"])

@pytest.mark.gpu(memory=LEASE)
@pytest.mark.parametrize("n", range(16))
def test_fill_the_lease(gpu, n):
    x = torch.empty(int(LEASE * 0.98), dtype=torch.uint8, device=gpu.device)
    x.fill_(1)
    torch.cuda.synchronize()
    time.sleep(0.3)
"""


def test_eight_workers_pack_one_gpu_without_a_real_oom(tmp_path, cuda_torch):
    """-n 8 on GPU 0: each test fills 98 % of a lease sized so that eight leases and eight
    contexts fill about 90 % of the GPU; no test may meet CUDA's own out-of-memory."""
    lease = int((total_bytes() * 0.9 - 8 * GIB) / 8) // 2**20 * 2**20
    inner = inner_run(
        tmp_path / "packing", PACKING, "-n", "8", "--gpus", "0", "--gpu-verify=fail", env={"LEASE": str(lease)}
    )
    assert "OutOfMemoryError" not in inner.out, inner.out
    assert [c.outcome for c in inner.cases.values()] == ["passed"] * 16, inner.out
    measured(inner)


BACKENDS = """
import pytest, torch

MIB = 1024**2

@pytest.mark.gpu(memory="2GiB")
@pytest.mark.parametrize("n", range(3))
def test_fill_most_of_the_lease(gpu, n):
    xs = [torch.empty(256 * MIB, dtype=torch.uint8, device=gpu.device) for _ in range(6)]  # 1.5 GiB
    for x in xs:
        x.fill_(1)
    torch.cuda.synchronize()

@pytest.mark.gpu(memory="1GiB")
def test_the_cap_holds(gpu):
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(1536 * MIB, dtype=torch.uint8, device=gpu.device)
"""


@pytest.mark.parametrize("conf", ["backend:cudaMallocAsync", "expandable_segments:True"])
def test_allocator_backends_keep_the_cap_and_a_true_peak(tmp_path, cuda_torch, conf):
    inner = inner_run(
        tmp_path / "backend",
        BACKENDS,
        "-n",
        "2",
        "--gpus",
        "0",
        "--gpu-verify=fail",
        env={"PYTORCH_CUDA_ALLOC_CONF": conf},
    )
    assert inner.returncode == 0 and [c.outcome for c in inner.cases.values()] == ["passed"] * 4, inner.out
    assert "above its budget" not in inner.out, inner.out
    measured(inner)


SEQUENCE = """
import pytest, torch

@pytest.fixture(scope="module")
def model(gpu_lease_factory):
    lease = gpu_lease_factory(memory="1GiB")
    weights = torch.randn(1024, 1024, device=lease.device)
    yield weights
    del weights

@pytest.mark.distributed(world_size=1, backend="nccl")
def test_1_a_pool(rank):
    import torch.distributed as dist
    t = torch.ones(4, device=rank.device)
    dist.all_reduce(t)
    assert t.sum().item() == 4

@pytest.mark.gpu(memory="1GiB")
def test_2_plain_after_the_pool(gpu):
    torch.ones(1 << 20, device=gpu.device).sum().item()

def test_3_a_module_fixture_lease(model):
    assert model.is_cuda and model.sum().item() != 0

@pytest.mark.gpu(memory="2GiB")
def test_4_torch_compile(gpu):
    f = torch.compile(lambda x: (x.sin() + x.cos()).sum())
    assert f(torch.randn(1 << 16, device=gpu.device)).item() != 0

@pytest.mark.gpu(memory="1GiB")
def test_5_plain_after_compile(gpu):
    torch.ones(1 << 20, device=gpu.device).sum().item()
"""


def test_pools_fixtures_and_compile_leave_the_next_test_clean(tmp_path, cuda_torch):
    """A warm pool, a module fixture's lease and torch.compile's workers live on after the
    test that started them: the next plain test must not be charged with them."""
    inner = inner_run(
        tmp_path / "sequence", SEQUENCE, "-n", "1", "--gpu-schedule=off", "--gpus", "0", "--gpu-verify=fail"
    )
    assert inner.returncode == 0, inner.out
    assert all(c.outcome == "passed" for c in inner.cases.values()) and len(inner.cases) == 5, inner.out
    assert "0 violations" in inner.out, inner.out
    measured(inner, peaks=("test_2_plain_after_the_pool", "test_5_plain_after_compile"))


ASSERT = """
import pytest, torch

@pytest.mark.gpu(memory="1GiB")
def test_1_device_side_assert(gpu):
    x = torch.ones(4, device=gpu.device)
    x[torch.tensor([10], device=gpu.device)].sum().item()  # out of bounds: a device-side assert

@pytest.mark.gpu(memory="1GiB")
def test_2_the_next_test(gpu):
    assert torch.ones(4, device=gpu.device).sum().item() == 4
"""


def test_a_device_side_assert_does_not_reach_the_next_test(tmp_path, cuda_torch):
    # pytest-gpu's scheduler (no --dist): the quarantined worker ends itself, a fresh one runs the next test
    inner = inner_run(tmp_path / "assert", ASSERT, "-n", "1", "--gpus", "0")
    cases = inner.cases
    assert cases["test_1_device_side_assert"].outcome == "failed", inner.out
    assert cases["test_2_the_next_test"].outcome == "passed", inner.out
    assert "test_1_device_side_assert" in inner.out and "device-side assert" in inner.out, inner.out


CUPY = """
import pytest, cupy

@pytest.mark.gpu(memory="1GiB")
def test_1_capped(gpu):
    pool = cupy.get_default_memory_pool()
    assert 0 < pool.get_limit() <= 1024**3
    with pytest.raises(cupy.cuda.memory.OutOfMemoryError):
        cupy.empty(1536 * 1024**2, dtype=cupy.uint8)
    assert cupy.cuda.Device().id == int(gpu.device.split(":")[1])

def test_2_restored():
    assert cupy.get_default_memory_pool().get_limit() == 0
"""


def test_cupy_is_capped_and_restored(tmp_path):
    if importlib.util.find_spec("cupy") is None:
        pytest.skip("CuPy is not installed here (optional in the real-GPU suite)")
    inner = inner_run(tmp_path / "cupy", CUPY, "-p", "no:xdist", "--gpus", "0", "--gpu-verify=fail")
    assert inner.returncode == 0 and len(inner.cases) == 2, inner.out


JAX = """
import os, subprocess, sys, pytest

CODE = "import jax.numpy as jnp, sys; x = jnp.ones(int(sys.argv[1]) // 4, dtype=jnp.float32); print(float(x[0]))"

@pytest.mark.gpu(memory="1GiB")
def test_jax_within(gpu):
    out = subprocess.run([sys.executable, "-c", CODE, str(256 * 1024**2)], env={**os.environ, **gpu.env},
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr

@pytest.mark.gpu(memory="1GiB")
def test_jax_over_its_lease_is_refused(gpu):
    out = subprocess.run([sys.executable, "-c", CODE, str(2 * 1024**3)], env={**os.environ, **gpu.env},
                         capture_output=True, text=True)
    assert out.returncode != 0 and "RESOURCE_EXHAUSTED" in out.stderr, out.stderr[-2000:]
"""


def test_jax_stays_within_its_lease(tmp_path):
    if importlib.util.find_spec("jax") is None:
        pytest.skip("JAX is not installed here (optional in the real-GPU suite)")
    inner = inner_run(tmp_path / "jax", JAX, "-p", "no:xdist", "--gpus", "0", "--gpu-verify=fail")
    assert inner.returncode == 0 and len(inner.cases) == 2, inner.out


GROWTH = """
import pytest, torch

@pytest.mark.gpu(memory="1GiB")
def test_first_kernel(gpu):
    torch.ones(1024, device=gpu.device).sum().item()

@pytest.mark.gpu(memory="1GiB")
def test_first_matmul_on_two_streams(gpu):  # cuBLAS loads, a workspace per stream
    a = torch.ones(256, 256, device=gpu.device)
    (a @ a).sum().item()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        (a @ a).sum().item()
    torch.cuda.synchronize()

@pytest.mark.gpu(memory="1GiB")
def test_first_conv(gpu):  # cuDNN loads
    x = torch.ones(1, 3, 32, 32, device=gpu.device)
    torch.nn.functional.conv2d(x, torch.ones(8, 3, 3, 3, device=gpu.device)).sum().item()

@pytest.mark.gpu(memory="1GiB")
def test_nothing_new(gpu):
    torch.ones(1024, device=gpu.device).sum().item()
"""


def test_a_worker_meeting_cublas_and_cudnn_for_the_first_time_is_charged_nothing(tmp_path, cuda_torch):
    """Issue 31, findings 5 and 8: in one long-lived worker, a test that first loads cuBLAS or cuDNN
    (the context grows, NVML sees it, torch does not) is no violation, and its peak is torch's own
    (its tensors and cuBLAS's workspace segments), not the libraries' load."""
    inner = inner_run(tmp_path / "growth", GROWTH, "-p", "no:xdist", "--gpus", "0", "--gpu-verify=fail")
    cases = inner.cases
    names = {"test_first_kernel", "test_first_matmul_on_two_streams", "test_first_conv", "test_nothing_new"}
    assert set(cases) == names, inner.out
    for name, case in cases.items():
        assert case.outcome == "passed" and case.violations == 0, f"{name}\n{inner.out}"
        assert case.peak < 128 * 2**20, f"{name}: peak {case.peak} counts the libraries' load\n{inner.out}"
