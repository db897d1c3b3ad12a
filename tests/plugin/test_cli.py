"""The ``pytest-gpu`` command."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from pytest_gpu.cli import main

GPUS_FORM = "auto, none, an index list such as 0,2,3, or simulated devices such as sim:4x16GiB"


def test_inventory_of_mixed_simulated_devices(capsys):
    assert main(["inventory", "--gpus", "sim:2x80GiB,2x24GiB"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out.splitlines() == [
        "--gpus sim:2x80GiB,2x24GiB: 4 simulated GPUs (2x80GiB, 2x24GiB)",
        "  GPU 0  GPU-51a00000-0000-4000-8000-000000000000     80GiB  Simulated GPU 80GiB",
        "  GPU 1  GPU-51a00000-0000-4000-8000-000000000001     80GiB  Simulated GPU 80GiB",
        "  GPU 2  GPU-51a00000-0000-4000-8000-000000000002     24GiB  Simulated GPU 24GiB",
        "  GPU 3  GPU-51a00000-0000-4000-8000-000000000003     24GiB  Simulated GPU 24GiB",
    ]


def test_inventory_none(capsys):
    assert main(["inventory", "--gpus", "none"]) == 0
    assert capsys.readouterr().out == "--gpus none: no GPUs (--gpus none)\n"


def test_inventory_without_gpus_says_what_every_vendor_lacks(capsys, monkeypatch):
    """Issue 29: `pytest-gpu inventory` on a machine without GPUs names every vendor's missing piece."""
    from pytest_gpu.vendors import amd, intel, nvidia

    def missing(error: type[Exception], said: str):
        def raise_(*args: object) -> None:
            raise error(said)

        return raise_

    monkeypatch.setattr(nvidia, "nvml_devices", missing(nvidia.NvmlUnavailable, "NVML unavailable: no driver"))
    monkeypatch.setattr(amd, "amdsmi_devices", missing(amd.AmdSmiUnavailable, "amdsmi is not installed"))
    monkeypatch.setattr(intel, "sysman_devices", missing(intel.ZesUnavailable, "no Level Zero loader"))
    monkeypatch.delenv("PYTEST_GPU_FAKE_GPUS", raising=False)
    assert main(["inventory", "--gpus", "auto"]) == 0
    assert capsys.readouterr().out == (
        "--gpus auto: no GPUs (NVML unavailable: no driver; amdsmi is not installed; no Level Zero loader)\n"
    )


def test_inventory_sub_gib_sizes(capsys):
    assert main(["inventory", "--gpus", "sim:1x512MiB"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == (
        "  GPU 0  GPU-51a00000-0000-4000-8000-000000000000    512MiB  Simulated GPU 512MiB"
    )


@pytest.mark.parametrize(
    ("gpus", "message"),
    [
        ("garbage", f"--gpus 'garbage': expected {GPUS_FORM}"),
        ("sim:0x16GiB", "--gpus 'sim:0x16GiB': count and size must be positive in '0x16GiB'"),
        ("sim:", "--gpus 'sim:': no simulated devices given; expected e.g. sim:4x16GiB"),
    ],
)
def test_inventory_bad_gpus(capsys, gpus, message):
    assert main(["inventory", "--gpus", gpus]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"pytest-gpu inventory: {message}\n"


def _command() -> list[str]:
    exe = shutil.which("pytest-gpu")
    return [exe] if exe else [sys.executable, "-m", "pytest_gpu.cli"]


def test_installed_command_exit_codes():
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    ok = subprocess.run(
        [*_command(), "inventory", "--gpus", "sim:2x80GiB,2x24GiB"], capture_output=True, text=True, env=env
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines()[0] == "--gpus sim:2x80GiB,2x24GiB: 4 simulated GPUs (2x80GiB, 2x24GiB)"

    bad = subprocess.run([*_command(), "inventory", "--gpus", "garbage"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2
    assert bad.stdout == ""
    assert bad.stderr == f"pytest-gpu inventory: --gpus 'garbage': expected {GPUS_FORM}\n"

    missing = subprocess.run(_command(), capture_output=True, text=True, env=env)
    assert missing.returncode == 2
    assert "the following arguments are required: command" in missing.stderr


def test_module_entry_point():
    done = subprocess.run(
        [sys.executable, "-m", "pytest_gpu.cli", "inventory", "--gpus", "sim:1x8GiB"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "--gpus sim:1x8GiB: 1 simulated GPU (1x8GiB)"
