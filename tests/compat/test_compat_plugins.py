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

import importlib
import json
import site
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import require
from helpers import patience

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


def site_dirs() -> list[str]:
    """The site directories this interpreter reads, in its ``sys.path`` order: a venv's own when
    it runs in one (and the base's only if that venv was made to see them), else the base's."""
    candidates = {*site.getsitepackages(), site.getusersitepackages()}
    return [entry for entry in sys.path if entry in candidates]


@pytest.fixture(scope="module")
def randomly_python(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A venv that sees this interpreter's packages plus pytest-randomly.

    Not ``venv --system-site-packages``: made from inside a venv, that sees the base
    interpreter's packages, not this venv's. A ``.pth`` file adds this interpreter's site
    directories with ``site.addsitedir`` (so their own ``.pth`` files, editable installs among
    them, are read too), after the new venv's own, where pytest-randomly goes."""
    venv = tmp_path_factory.mktemp("randomly-venv")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=patience(120))
    python = str(venv / "bin" / "python")
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
        timeout=patience(60),
    ).stdout.strip()
    adds = "; ".join(f"site.addsitedir({entry!r})" for entry in site_dirs())
    (Path(purelib) / "_outer_site.pth").write_text(f"import site; {adds}\n")
    installed = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "pytest-randomly"],
        capture_output=True,
        text=True,
        timeout=patience(300),
    )
    if installed.returncode != 0:
        pytest.skip(f"missing component: pytest-randomly (pip install failed: {installed.stderr.strip()[-300:]})")
    yield python


@pytest.mark.slow  # a venv and pip
def test_the_randomly_venv_runs_this_interpreters_packages(randomly_python: str) -> None:
    """pytest, xdist and pytest-gpu in the helper venv are the ones this suite runs with (in a venv
    or not), not the base interpreter's or none: else the test below tests something else."""
    names = ("pytest", "xdist", "pytest_gpu")
    code = f"import importlib, json; print(json.dumps([importlib.import_module(n).__file__ for n in {names!r}]))"
    seen = subprocess.run(
        [randomly_python, "-c", code], capture_output=True, text=True, check=False, timeout=patience(60)
    )
    assert seen.returncode == 0, seen.stderr
    assert json.loads(seen.stdout) == [importlib.import_module(name).__file__ for name in names]


@pytest.mark.parametrize("seed", [1, 2])
def test_randomly_shuffled_order_under_xdist(gpu_pytester, randomly_python, seed):
    gpu_pytester.makepyfile(test_mix=SUITE)
    command = [randomly_python, "-m", "pytest", *BASE, "-p", "randomly", f"--randomly-seed={seed}"]
    command += ["-n", "2", "--gpus", "sim:2x16GiB"]
    done = subprocess.run(command, cwd=gpu_pytester.path, capture_output=True, text=True, timeout=patience(180))
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
