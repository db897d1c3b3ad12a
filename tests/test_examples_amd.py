"""The demo suite, unchanged, on a fake AMD machine: amdsmi's discovery, ROCm's leases, amdsmi's
verification (the fake libamd_smi.so through the real amdsmi package)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import require, with_amdsmi
from test_examples import _demo

pytestmark = pytest.mark.slow  # pytest in a subprocess, four workers


def test_the_demo_suite_passes_on_a_fake_amd_machine(tmp_path: Path) -> None:
    require("C compiler", executable="cc")  # the fake libamd_smi.so is built from C
    env = {"PYTEST_GPU_FAKE_GPUS": "amd:sim:4x16GiB", "PYTEST_GPU_SIM_LEDGER": str(tmp_path / "ledger")}
    env = with_amdsmi({**env, "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    result = _demo(tmp_path, "auto", env)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "42 passed, 1 skipped" in out, out
    assert "· 0 violations" in out, out
    assert "OutOfMemoryError" not in out, out
    assert "pytest-gpu: 4 AMD GPUs (4x16GiB) [amdsmi]" in out, out
    assert "[nvml]" not in out, out
