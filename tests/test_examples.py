"""The README's first command: the demo suite on simulated GPUs passes, without OOMs or violations."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import require

ROOT = Path(__file__).resolve().parent.parent


def test_the_demo_suite_passes_on_simulated_gpus(tmp_path: Path) -> None:
    require("pytest-dependency", module="pytest_dependency")
    trace = tmp_path / "trace.json"
    command = [sys.executable, "-m", "pytest", "examples", "-n", "4", "--gpus", "sim:4x16GiB", "-rs"]
    result = subprocess.run(
        [*command, "-p", "no:cacheprovider", "-p", "no:benchmark", f"--gpu-trace={trace}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "42 passed, 1 skipped" in out, out
    assert "· 0 violations" in out, out
    assert "OutOfMemoryError" not in out, out
    assert "needs 8 GPUs" in out or "needs 8 GPU" in out, out  # the one intended skip says why
    assert trace.is_file()
