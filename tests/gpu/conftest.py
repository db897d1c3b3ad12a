"""The real-GPU suite: runs only where ``nvidia-smi`` sees a GPU (and torch has CUDA).

Elsewhere every test here is skipped with a reason that says so; that is not a missing
component (CI has no GPU by design), so ``.ci/check_skips.py`` accepts it.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable

import pytest

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
            timeout=60,
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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if GPUS:
        return
    for item in items:
        if item.path.parent.name == "gpu":
            item.add_marker(pytest.mark.skip(reason=NO_GPU))


@pytest.fixture
def real_gpus() -> list[tuple[int, str, int]]:
    return GPUS


@pytest.fixture
def cuda_torch() -> None:
    """torch with CUDA in this environment (the suite's subprocesses import it)."""
    out = subprocess.run(
        ["python", "-c", "import torch; print(torch.cuda.is_available())"], capture_output=True, text=True, timeout=300
    )
    if out.stdout.strip() != "True":
        pytest.skip(f"torch without CUDA here ({(out.stdout + out.stderr).strip()[-200:]}) (real-GPU suite)")


@pytest.fixture
def real_run(gpu_pytester: pytest.Pytester) -> Callable[..., pytest.RunResult]:
    """An inner pytest run in its own process, on the real GPUs (no fake switch)."""

    def run(*args: str, timeout: float = 300) -> pytest.RunResult:
        return gpu_pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly", *args, timeout=timeout)

    return run
