"""The README's first command: the demo suite on simulated GPUs passes, without OOMs or violations."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import require
from helpers import patience

pytestmark = pytest.mark.slow  # every test here runs pytest (or a launcher) in a subprocess

ROOT = Path(__file__).resolve().parent.parent


def _demo(tmp_path: Path, gpus: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    require("pytest-dependency", module="pytest_dependency")
    trace = tmp_path / "trace.json"
    command = [sys.executable, "-m", "pytest", "examples", "-n", "4", "--gpus", gpus, "-rs"]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_GPU_") and k != "CUDA_VISIBLE_DEVICES"}
    result = subprocess.run(
        [*command, "-p", "no:cacheprovider", "-p", "no:benchmark", f"--gpu-trace={trace}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=patience(300),
        env={**clean, **(env or {})},
    )
    assert trace.is_file()
    return result


@pytest.mark.parametrize(
    ("gpus", "fake"),
    [
        ("sim:4x16GiB", None),
        # the README's promise for GPU-less CI: the same suite through NVML (the fake
        # libnvidia-ml.so.1), the NVML verifier and UUID leases, exactly as on a real machine
        ("auto", "sim:4x16GiB"),
    ],
    ids=["sim-spec", "fake-nvml-auto"],
)
def test_the_demo_suite_passes_on_simulated_gpus(tmp_path: Path, gpus: str, fake: str | None) -> None:
    if fake:
        require("C compiler", executable="cc")  # the fake libnvidia-ml.so.1 is built from C
    env = {"PYTEST_GPU_FAKE_GPUS": fake, "PYTEST_GPU_SIM_LEDGER": str(tmp_path / "ledger")} if fake else None
    result = _demo(tmp_path, gpus, env)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "42 passed, 1 skipped" in out, out
    assert "· 0 violations" in out, out
    assert "OutOfMemoryError" not in out, out
    assert "needs 8 GPUs" in out or "needs 8 GPU" in out, out  # the one intended skip says why
    assert ("[nvml]" in out) == (fake is not None), out
