"""The real-GPU paths on a real GPU: run this where a GPU is at hand, put its output in the note.

Runs only where ``nvidia-smi`` sees a GPU (and, for the torch tests, torch has CUDA);
elsewhere every test is skipped with a reason that says so.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Callable

import pytest

from helpers import patience
from pytest_gpu.gpu.discovery import discover

NO_GPU = "no GPU on this machine (real-GPU suite)"


def nvidia_smi_gpus() -> list[tuple[int, str, int]]:
    """(index, uuid, MiB total) for each GPU ``nvidia-smi`` lists; empty without one."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,uuid,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=patience(60),
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    rows = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit():
            rows.append((int(parts[0]), parts[1], int(float(parts[2]))))
    return rows


GPUS = nvidia_smi_gpus()


# Skipped where no GPU is at hand: not a missing component (CI has no GPU by design), so
# .ci/check_skips.py accepts it.
pytestmark = pytest.mark.skipif(not GPUS, reason=NO_GPU)


@pytest.fixture
def real_gpus() -> list[tuple[int, str, int]]:
    return GPUS


@pytest.fixture
def cuda_torch() -> None:
    """torch with CUDA in this environment (the suite's subprocesses import it)."""
    out = subprocess.run(
        ["python", "-c", "import torch; print(torch.cuda.is_available())"],
        capture_output=True,
        text=True,
        timeout=patience(300),
    )
    if out.stdout.strip() != "True":
        pytest.skip(f"torch without CUDA here ({(out.stdout + out.stderr).strip()[-200:]}) (real-GPU suite)")


@pytest.fixture
def real_run(gpu_pytester: pytest.Pytester) -> Callable[..., pytest.RunResult]:
    """An inner pytest run in its own process, on the real GPUs (no fake switch)."""

    def run(*args: str, timeout: float = 300) -> pytest.RunResult:
        return gpu_pytester.runpytest_subprocess(
            "-p", "no:cacheprovider", "-p", "no:randomly", *args, timeout=patience(timeout)
        )

    return run


def test_inventory_matches_nvidia_smi(real_gpus):
    inventory = discover("auto", environ={})
    assert [(d.index, d.uuid) for d in inventory.devices] == [(i, u) for i, u, _ in real_gpus]
    for device, (_, _, mib) in zip(inventory.devices, real_gpus, strict=True):
        assert abs(device.total_memory // 2**20 - mib) <= 1
        assert 0 <= device.reserved < device.total_memory // 10
    cli = subprocess.run(
        [sys.executable, "-m", "pytest_gpu.cli", "inventory", "--gpus", "auto"], capture_output=True, text=True
    )
    assert cli.returncode == 0 and real_gpus[0][1] in cli.stdout, cli.stdout + cli.stderr


CO_TENANTS = """
import pytest
import torch

@pytest.mark.gpu(memory="2GiB")
@pytest.mark.parametrize("n", range(6))
def test_within_the_lease(gpu, n):
    assert torch.cuda.current_device() == int(gpu.device.split(":")[1])
    x = torch.empty(1024**3, dtype=torch.uint8, device=gpu.device)  # 1 GiB
    x.fill_(1)
    torch.cuda.synchronize()
    del x

@pytest.mark.gpu(memory="1GiB")
def test_over_the_cap_is_an_oom(gpu):
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(2 * 1024**3, dtype=torch.uint8, device=gpu.device)
"""


def test_torch_leases_with_caps_and_verification_under_xdist(gpu_pytester, real_run, cuda_torch):
    gpu_pytester.makepyfile(test_co=CO_TENANTS)
    result = real_run("-n", "2", "--gpus", "0", "-v")
    result.assert_outcomes(passed=7)
    result.stdout.fnmatch_lines(["*· 0 violations"])


LATE = """
import sys
import pytest

def test_0_cpu():
    assert "torch" not in sys.modules

@pytest.mark.gpu(memory="1GiB")
def test_1_torch_starts_here(gpu):
    import torch
    x = torch.ones(1024, device="cuda")  # the default device: confined after the import
    assert x.device.index == int(gpu.device.split(":")[1])

@pytest.mark.gpu(exclusive=True)
def test_2_later_test(gpu):
    import torch
    assert torch.cuda.device_count() >= len(gpu.indices)
    x = torch.ones(1024, device=gpu.device)
    assert x.sum().item() == 1024
"""


def test_cuda_first_started_inside_a_test(gpu_pytester, real_run, cuda_torch):
    gpu_pytester.makepyfile(test_late=LATE)
    result = real_run("-p", "no:xdist", "--gpus", "auto", "-v")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["*· 0 violations"])


NCCL = """
import pytest

@pytest.mark.distributed(world_size=1, backend="nccl")
def test_one_rank_nccl(rank):
    import torch
    import torch.distributed as dist
    t = torch.ones(4, device=rank.device)
    dist.all_reduce(t)
    assert t.sum().item() == 4
"""


def test_one_rank_nccl_pool(gpu_pytester, real_run, cuda_torch):
    gpu_pytester.makepyfile(test_nccl=NCCL)
    real_run("--gpus", "auto", "-v").assert_outcomes(passed=1)


JAX = """
import pytest

@pytest.mark.gpu(memory="2GiB")
def test_jax_in_a_subprocess(gpu):
    import os, subprocess, sys
    code = "import jax, jax.numpy as jnp; print(jax.devices()); print(float(jnp.ones(4).sum()))"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **gpu.env}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("4.0")
"""


def test_jax_respects_the_lease(gpu_pytester, real_run):
    if importlib.util.find_spec("jax") is None:
        pytest.skip("JAX is not installed here (optional in the real-GPU suite)")
    gpu_pytester.makepyfile(test_jax=JAX)
    real_run("-n", "2", "--gpus", "0", "-v").assert_outcomes(passed=1)


SHARE = """
import os, time, pytest, torch

@pytest.mark.gpu(memory=os.environ["LEASE"])
@pytest.mark.parametrize("i", range(6))
def test_share(gpu, i):
    x = torch.empty(int(os.environ["USE"]), dtype=torch.uint8, device=gpu.device)
    x.fill_(1)
    torch.cuda.synchronize()
    time.sleep(0.5)
"""


def test_two_runs_share_the_real_gpus(gpu_pytester, real_gpus, cuda_torch, tmp_path):
    """Two pytest runs at once, each leasing 30 % of GPU 0 per test on two workers: together
    they would need 120 % if neither saw the other's leases."""
    total = real_gpus[0][2] * 2**20
    gpu_pytester.makepyfile(test_share=SHARE)
    env = {
        **os.environ,
        "LEASE": str(int(total * 0.3)),
        "USE": str(int(total * 0.28)),
        "PYTEST_GPU_MACHINE_DIR": str(tmp_path / "machines"),
    }
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly", "-q", "-n", "2"]
    command += ["--gpus", "0", "test_share.py"]
    procs = [
        subprocess.Popen(
            command, cwd=gpu_pytester.path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=patience(600))[0] for p in procs]
    for proc, out in zip(procs, outs, strict=True):
        assert proc.returncode == 0 and "6 passed" in out, out
        assert "OutOfMemoryError" not in out and "· 0 violations" in out, out


FOREIGN_WAIT = """
import os, pytest, torch

@pytest.mark.gpu(memory=os.environ["LEASE"])
def test_after_the_foreign_process(gpu):
    x = torch.empty(int(os.environ["LEASE"]) // 2, dtype=torch.uint8, device=gpu.device)
    x.fill_(1)
"""

HOG = (
    "import sys, time, torch; x = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device='cuda:0'); "
    "x.fill_(1); torch.cuda.synchronize(); print('holding', flush=True); time.sleep(float(sys.argv[2]))"
)


def test_a_foreign_process_on_the_real_gpu_is_waited_for(gpu_pytester, real_gpus, cuda_torch, tmp_path):
    """NVML sees a process outside pytest-gpu holding 60 % of GPU 0; a test that needs 50 %
    waits until it exits, and the summary says why."""
    total = real_gpus[0][2] * 2**20
    hog = subprocess.Popen([sys.executable, "-c", HOG, str(int(total * 0.6)), "6"], stdout=subprocess.PIPE, text=True)
    try:
        assert hog.stdout is not None and hog.stdout.readline().strip() == "holding"
        gpu_pytester.makepyfile(test_foreign=FOREIGN_WAIT)
        env = {**os.environ, "LEASE": str(int(total * 0.5)), "PYTEST_GPU_MACHINE_DIR": str(tmp_path / "machines")}
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly", "-q", "--gpus", "0"],
            cwd=gpu_pytester.path,
            env=env,
            capture_output=True,
            text=True,
            timeout=patience(300),
        )
        text = out.stdout + out.stderr
        assert out.returncode == 0 and "1 passed" in text, text
        assert "held back" in text and "by processes outside pytest-gpu" in text, text
    finally:
        hog.kill()
        hog.wait()
