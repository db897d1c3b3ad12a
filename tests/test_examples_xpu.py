"""The demo suite, unchanged, on a fake Intel machine: Level Zero Sysman's discovery (the fake
libze_loader.so.1), ZE_AFFINITY_MASK leases, Sysman's verification."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import require
from test_examples import _demo

pytestmark = pytest.mark.slow  # pytest in a subprocess, four workers


def test_the_demo_suite_passes_on_a_fake_intel_machine(tmp_path: Path) -> None:
    require("C compiler", executable="cc")  # the fake Level Zero loader is built from C
    env = {
        "PYTEST_GPU_FAKE_GPUS": "xpu:sim:4x64GiB",
        "PYTEST_GPU_SIM_LEDGER": str(tmp_path / "ledger"),
        "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
    }
    result = _demo(tmp_path, "xpu:auto", env)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "42 passed, 1 skipped" in out, out
    assert "· 0 violations" in out, out
    assert "OutOfMemoryError" not in out, out
    assert "pytest-gpu: 4 Intel GPUs (4x64GiB) [sysman]" in out, out
    assert "[nvml]" not in out and "[amdsmi]" not in out, out
