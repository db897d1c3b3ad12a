"""The plugins users run beside pytest-gpu, installed for real: each with a small GPU suite.

pytest-timeout, pytest-depends and pytest-cov have files of their own
(test_compat_timeout.py, test_compat_lease_cancel.py, test_depends_compat.py,
test_compat_cov.py); here pytest-rerunfailures, pytest-randomly and pytest-repeat.
pytest-rerunfailures and pytest-repeat come with the ``test`` extra (they act only when
asked). pytest-randomly acts on every run it is installed in — it would shuffle and
reseed this whole suite and every launcher run in it, whose ranks must agree on the
order — so it lives in a virtual environment of its own, made here on top of this one.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from conftest import require

BASE = ("-p", "no:cacheprovider", "-p", "no:benchmark", "-p", "no:hypothesispytest", "-p", "no:depends")

SUITE = """
import os
import pytest
from pytest_gpu import sim

@pytest.mark.gpu(memory="4GiB")
@pytest.mark.parametrize("n", range(6))
def test_gpu(gpu, n):
    with sim.allocate("3GiB") as block:
        assert block.physical == gpu.indices[0]

@pytest.mark.gpu(exclusive=True)
def test_whole(gpu):
    sim.hold("8GiB", 0.05)

def test_cpu(port):
    assert port > 0
"""


def test_rerunfailures_reruns_a_gpu_test_with_a_fresh_lease(gpu_pytester):
    require("pytest-rerunfailures", module="pytest_rerunfailures")
    gpu_pytester.makepyfile(
        test_flaky="""
        import pytest
        from pytest_gpu import sim

        @pytest.mark.gpu(memory="2GiB")
        def test_flaky(gpu, tmp_path_factory):
            marker = tmp_path_factory.getbasetemp().parent / "tried"
            sim.allocate("1GiB").free()
            if not marker.exists():
                marker.touch()
                raise AssertionError("first try fails")
        """
    )
    result = gpu_pytester.runpytest_subprocess(*BASE, "-p", "no:randomly", "--reruns", "1", "--gpus", "sim:2x16GiB")
    assert result.parseoutcomes() == {"passed": 1, "rerun": 1}, result.stdout.str()
    result.stdout.fnmatch_lines(["pytest-gpu: * · 2 GPU tests · * · 0 violations"])


@pytest.fixture(scope="module")
def randomly_python(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A venv that sees this environment's packages plus pytest-randomly."""
    venv = tmp_path_factory.mktemp("randomly-venv")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    installed = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "pytest-randomly"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if installed.returncode != 0:
        pytest.skip(f"missing component: pytest-randomly (pip install failed: {installed.stderr.strip()[-300:]})")
    yield python


@pytest.mark.parametrize("seed", [1, 2])
def test_randomly_shuffled_order_under_xdist(gpu_pytester, randomly_python, seed):
    gpu_pytester.makepyfile(test_mix=SUITE)
    command = [randomly_python, "-m", "pytest", *BASE, "-p", "randomly", f"--randomly-seed={seed}"]
    command += ["-n", "2", "--gpus", "sim:2x16GiB"]
    done = subprocess.run(command, cwd=gpu_pytester.path, capture_output=True, text=True, timeout=180)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert f"Using --randomly-seed={seed}" in out, out  # the plugin really acted
    assert "8 passed" in out and "· 0 violations" in out, out
    assert "OutOfMemoryError" not in out


def test_repeat_gives_every_repetition_its_own_lease(gpu_pytester):
    require("pytest-repeat", module="pytest_repeat")
    gpu_pytester.makepyfile(test_mix=SUITE)
    result = gpu_pytester.runpytest_subprocess(
        *BASE, "-p", "no:randomly", "--count", "3", "-n", "2", "--gpus", "sim:2x16GiB"
    )
    result.assert_outcomes(passed=24)
    result.stdout.fnmatch_lines(["pytest-gpu: * · 21 GPU tests · * · 0 violations"])
