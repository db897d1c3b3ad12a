"""The README's first command: the demo suite on simulated GPUs passes, without OOMs or violations."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import require, with_amdsmi
from helpers import ROOT, patience
from pytest_gpu.report import gantt

pytestmark = pytest.mark.slow  # every test here runs pytest (or a launcher) in a subprocess


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
    ("gpus", "fake", "found"),
    [
        ("sim:4x16GiB", None, "pytest-gpu: 4 simulated GPUs (4x16GiB) "),
        # the README's promise for GPU-less CI: the same suite through NVML (the fake
        # libnvidia-ml.so.1), the NVML verifier and UUID leases, exactly as on a real machine
        ("auto", "sim:4x16GiB", "pytest-gpu: 4 GPUs (4x16GiB) [nvml]"),
        # unchanged on a fake AMD machine: amdsmi's discovery, ROCm's leases, amdsmi's verification
        # (the fake libamd_smi.so through the real amdsmi package)
        ("auto", "amd:sim:4x16GiB", "pytest-gpu: 4 AMD GPUs (4x16GiB) [amdsmi]"),
        # and on a fake Intel machine: Level Zero Sysman's discovery (the fake libze_loader.so.1),
        # ZE_AFFINITY_MASK leases, Sysman's verification
        ("xpu:auto", "xpu:sim:4x64GiB", "pytest-gpu: 4 Intel GPUs (4x64GiB) [sysman]"),
    ],
    ids=["sim-spec", "fake-nvml-auto", "fake-amd", "fake-intel"],
)
def test_the_demo_suite_passes_on_simulated_gpus(tmp_path: Path, gpus: str, fake: str | None, found: str) -> None:
    if fake:
        require("C compiler", executable="cc")  # the fake driver libraries are built from C
    env = {"PYTEST_GPU_FAKE_GPUS": fake, "PYTEST_GPU_SIM_LEDGER": str(tmp_path / "ledger")} if fake else {}
    if fake and fake.startswith("amd:"):
        env = with_amdsmi({**env, "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    result = _demo(tmp_path, gpus, env or None)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "42 passed, 1 skipped" in out, out
    assert "· 0 violations" in out, out
    assert "OutOfMemoryError" not in out, out
    assert "needs 8 GPUs" in out or "needs 8 GPU" in out, out  # the one intended skip says why
    assert found in out, out
    assert [source for source in ("[nvml]", "[amdsmi]", "[sysman]") if source in out] == [
        source for source in ("[nvml]", "[amdsmi]", "[sysman]") if source in found
    ], out  # the vendor's driver, and no other's


# what varies from run to run in a quoted line: durations ("4.4s", "15ms", "<1ms"), ratios
# ("3.6x") and percentages; every other figure (tests, GPUs, outcomes) must be the run's own
_VARYING = re.compile(r"<?\d+(?:\.\d+)?(?: ?m?s\b|x\b|%)")


def _quoted_pattern(line: str) -> re.Pattern[str]:
    parts, at = [], 0
    for found in _VARYING.finditer(line):
        parts += [re.escape(line[at : found.start()]), r"<?\d+(?:\.\d+)?(?: ?m?s\b|x\b|%)"]
        at = found.end()
    return re.compile("".join([*parts, re.escape(line[at:])]))


def test_seeing_the_run_quotes_the_demo_as_it_runs(tmp_path: Path) -> None:
    """docs/seeing-the-run.md runs the demo with --gpu-trace, then pytest-gpu report: the lines it
    quotes from both are those of a real run, but for their times."""
    doc = (ROOT / "docs" / "seeing-the-run.md").read_text(encoding="utf-8")
    assert "pytest examples -n 4 --gpus sim:4x16GiB --gpu-trace=run.json\npytest-gpu report run.json\n" in doc
    quoted, fenced = [], False
    for line in doc.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif fenced and line.startswith(("pytest-gpu:", "=", "43 tests")):
            quoted.append(line.strip("= "))
    assert len(quoted) == 5, quoted
    result = _demo(tmp_path, "sim:4x16GiB")
    report = gantt.build_chart(gantt.load_trace(tmp_path / "trace.json")).summary()
    said = [line.strip("= ") for line in result.stdout.splitlines()] + [report]
    for line in quoted:
        assert any(_quoted_pattern(line).fullmatch(out) for out in said), (line, said)
