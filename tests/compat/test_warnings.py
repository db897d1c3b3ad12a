"""Suites whose warnings are errors (issue 28, item 3): ``filterwarnings = error`` runs with the
plugin, on the floor pytest and the newest; the plugin uses no deprecated pytest API; and the
deprecated ``pynvml`` package (a shim whose import warns) is imported only where the run needs
NVML, its warning handed to pytest's warnings summary instead of printed raw or raised.

The deprecated ``pynvml`` is the real one from PyPI, installed beside the environment as CI
does (``pip install --no-deps --target DIR pynvml``, ``$PYNVML_TEST_SITE``): a ``.pth`` file
that puts a FutureWarning in front of every first ``import pynvml``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import INNER_ARGS, MISSING, require
from helpers import patience
from pytest_gpu.run import options
from pytest_gpu.vendors import libraries

PYNVML_ENV = "PYNVML_TEST_SITE"
PYNVML_PIN = "13.0.1"  # the shim with the FutureWarning (.ci/run installs this one)
DEPRECATED = "The pynvml package is deprecated"

# INNER_ARGS' plugins off (pytest-benchmark warns under xdist), without its deprecation filter:
# it would replace the suites' own filterwarnings here, and "error" covers it
PLUGINS_OFF = tuple(a for pair in zip(INNER_ARGS[::2], INNER_ARGS[1::2], strict=True) if pair[0] == "-p" for a in pair)

ONE_TEST = """
import sys

def test_one():
    # where the run needs no NVML the plugin has not imported pynvml
    assert ("pynvml" in sys.modules) == {nvml_expected}
"""


def _nvml_here() -> bool:
    """Does this machine have NVML's library (a real NVIDIA driver)? Then ``--gpus auto`` needs it.
    Asked in a new process: this one may hold the fake library (simulated GPUs' runs in it)."""
    probe = f"import ctypes; ctypes.CDLL({libraries.NVML_LIBRARY!r})"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


# -- the ini key whose being given matters, read without config.inicfg ----------------------


@pytest.mark.parametrize(
    ("ini", "args", "given", "size"),
    [
        ("", (), False, 500 * 2**20),
        ("gpu_context_overhead = 1GiB\n", (), True, 2**30),
        ("", ("-o", "gpu_context_overhead=1GiB"), True, 2**30),
        ("", ("--gpu-context-overhead=300MiB",), True, 300 * 2**20),
        ("gpu_context_overhead = 1GiB\n", ("--gpu-context-overhead=300MiB",), True, 300 * 2**20),
    ],
    ids=["default", "ini", "override", "command-line", "both"],
)
def test_the_context_overhead_is_given_or_the_default(
    pytester: pytest.Pytester, ini: str, args: tuple[str, ...], given: bool, size: int
) -> None:
    pytester.makeini("[pytest]\n" + ini)
    config = pytester.parseconfig(*args)
    with warnings.catch_warnings():
        warnings.simplefilter("error", pytest.PytestDeprecationWarning)  # config.inicfg on pytest 9.2
        settings = options.read(config)
    assert (settings.context_overhead_given, settings.context_overhead) == (given, size)


def test_an_empty_context_overhead_in_the_ini_is_refused(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\ngpu_context_overhead =\n")
    with pytest.raises(pytest.UsageError, match="ini key 'gpu_context_overhead'"):
        options.read(pytester.parseconfig())


# -- a suite whose warnings are errors ----------------------------------------------------


@pytest.fixture
def strict_suite(gpu_pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """One test under ``filterwarnings = error``, the suite's only filter (the inner runs' own
    deprecation filter, given by ``-o``, would replace it: ``error`` covers it)."""
    monkeypatch.delenv("PYTEST_ADDOPTS")
    gpu_pytester.makeini("[pytest]\nfilterwarnings = error\n")
    return gpu_pytester


@pytest.mark.parametrize("gpus", ["auto", "none", "sim:2x16GiB"])
def test_a_filterwarnings_error_suite_runs_with_the_plugin(strict_suite: pytest.Pytester, gpus: str) -> None:
    """pytest 9.2 deprecated config.inicfg, which the plugin read while it configured: every run of
    such a suite ended in INTERNALERROR, even this one-test folder. (The floor pytest runs this
    file too: .ci/floors.)"""
    strict_suite.makepyfile("def test_one():\n    pass\n")
    result = strict_suite.runpytest_inprocess(*PLUGINS_OFF, "--gpus", gpus)
    result.assert_outcomes(passed=1)
    assert "INTERNALERROR" not in result.stdout.str()


def test_a_filterwarnings_error_suite_runs_under_xdist(strict_suite: pytest.Pytester) -> None:
    """The same in the controller and each worker of ``-n 2``."""
    strict_suite.makepyfile("def test_one():\n    pass\n\ndef test_two():\n    pass\n")
    result = strict_suite.runpytest_subprocess(*PLUGINS_OFF, "-n", "2", "--gpus", "sim:2x16GiB", timeout=patience(120))
    result.assert_outcomes(passed=2)


def test_the_inner_runs_fail_on_the_plugins_own_deprecations(
    run_inner: Callable[..., pytest.RunResult],
    gpu_pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    """The suite's inner runs (conftest.INNER_ARGS, and PYTEST_ADDOPTS for every pytest that
    gpu_pytester starts) fail on a deprecated pytest API in the plugin's code: here the old
    reading of --gpu-context-overhead's ini key through config.inicfg, put back in
    pytest_gpu.run.options' namespace; a deprecation of another module's stays a warning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _ = request.config.inicfg
    if not any(issubclass(w.category, pytest.PytestDeprecationWarning) for w in caught):
        pytest.skip(f"pytest {pytest.__version__} does not deprecate config.inicfg")
    old = textwrap.dedent(
        """
        def _given(config, ini):
            return config.getoption(ini) is not None or ini in config.inicfg
        """
    )
    namespace = {"__name__": options.__name__}  # the warning names the module of the calling frame
    exec(compile(old, options.__file__, "exec"), namespace)
    gpu_pytester.makepyfile("def test_one():\n    pass\n")
    with monkeypatch.context() as patched:
        patched.setattr(options, "_given", namespace["_given"])
        failed = run_inner("--gpus", "none")
    assert failed.ret == pytest.ExitCode.INTERNAL_ERROR
    said = failed.stdout.lines + failed.stderr.lines
    assert any(line.startswith("INTERNALERROR> ") and "config.inicfg is deprecated" in line for line in said)
    # the same deprecated call in the suite's own conftest is not the plugin's: a warning
    gpu_pytester.makeconftest("def pytest_configure(config):\n    config.inicfg\n")
    with pytest.warns(pytest.PytestDeprecationWarning, match="config.inicfg is deprecated"):
        passed = run_inner("--gpus", "none")
    passed.assert_outcomes(passed=1)


# -- the deprecated pynvml package installed ------------------------------------------------


def pynvml_site() -> str:
    """The directory that holds the deprecated ``pynvml`` (``pip install --target``); skips without one."""
    site = os.environ.get(PYNVML_ENV, "").strip()
    if site and (Path(site) / "_pynvml_redirector.pth").is_file():
        return site
    pytest.skip(
        f"{MISSING}: the deprecated pynvml package "
        f"(pip install --no-deps --target DIR pynvml=={PYNVML_PIN}; {PYNVML_ENV}=DIR)"
    )


@pytest.fixture
def deprecated_pynvml(gpu_pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The deprecated ``pynvml`` installed for every Python process the test starts, as pip puts it
    in site-packages: its ``.pth`` file runs at start-up (a ``PYTHONPATH`` entry alone is no site
    directory, so a ``sitecustomize`` there adds it as one)."""
    site = pynvml_site()
    hook = tmp_path / "pynvml-installed"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(f"import site\n\nsite.addsitedir({site!r})\n")
    path = os.environ.get("PYTHONPATH", "")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(hook), path])))
    # the test cannot pass for want of the warning: a process's first import of pynvml raises it
    probe = subprocess.run(
        [sys.executable, "-W", "error::FutureWarning", "-c", "import pynvml"], capture_output=True, text=True
    )
    assert probe.returncode != 0 and DEPRECATED in probe.stderr, probe.stderr


def _summary(result: pytest.RunResult) -> tuple[str, str]:
    """The output before the warnings summary, and the summary."""
    out = result.stdout.str()
    before, _, summary = out.partition("warnings summary")
    return before + result.stderr.str(), summary


@pytest.mark.usefixtures("deprecated_pynvml")
@pytest.mark.parametrize("gpus", ["auto", "none"])
def test_a_cpu_only_run_does_not_import_pynvml(strict_suite: pytest.Pytester, gpus: str) -> None:
    """Without NVIDIA's driver there is nothing NVML could tell: pynvml is not imported, and its
    warning never raised (with the driver, ``--gpus auto`` needs NVML: the summary shows it)."""
    nvml = gpus == "auto" and _nvml_here()
    strict_suite.makepyfile(ONE_TEST.format(nvml_expected=nvml))
    result = strict_suite.runpytest_subprocess(*PLUGINS_OFF, "--gpus", gpus, timeout=patience(120))
    result.assert_outcomes(passed=1)
    before, summary = _summary(result)
    assert DEPRECATED not in before
    assert (DEPRECATED in summary) == nvml


@pytest.mark.usefixtures("deprecated_pynvml")
@pytest.mark.parametrize(
    ("filters", "shown"),
    [
        (["error"], True),
        ([], True),
        (["error", f"ignore:{DEPRECATED}:FutureWarning"], False),
    ],
    ids=["error", "default", "ignored"],
)
def test_simulated_gpus_hand_pynvmls_warning_to_pytest(
    gpu_pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, filters: list[str], shown: bool
) -> None:
    """Simulated GPUs need NVML (the fake libnvidia-ml.so.1): pynvml is imported, and its
    FutureWarning goes to the warnings summary, not raw to the terminal before the run; an
    ``error`` filter shows it there too (the plugin imported it, not the suite); an ``ignore``
    filter hides it."""
    require("C compiler", executable="cc")
    monkeypatch.delenv("PYTEST_ADDOPTS")
    gpu_pytester.makeini("[pytest]\nfilterwarnings =\n" + "".join(f"    {f}\n" for f in filters))
    gpu_pytester.makepyfile(ONE_TEST.format(nvml_expected=True))
    result = gpu_pytester.runpytest_subprocess(*PLUGINS_OFF, "--gpus", "sim:2x16GiB", timeout=patience(120))
    result.assert_outcomes(passed=1, warnings=1 if shown else 0)
    before, summary = _summary(result)
    assert DEPRECATED not in before
    assert summary.count(DEPRECATED) == (1 if shown else 0)


@pytest.mark.usefixtures("deprecated_pynvml")
def test_fake_gpus_under_filterwarnings_error(
    fake_run: Callable[..., pytest.RunResult], gpu_pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PYTEST_GPU_FAKE_GPUS loads the real nvidia-ml-py against the fake libnvidia-ml.so.1 before
    conftest.py files load, so pynvml is imported before pytest configures: the warning still
    reaches the summary, and the suite passes."""
    monkeypatch.delenv("PYTEST_ADDOPTS")
    gpu_pytester.makeini("[pytest]\nfilterwarnings = error\n")
    gpu_pytester.makepyfile(ONE_TEST.format(nvml_expected=True))
    result = fake_run("sim:2x16GiB", *PLUGINS_OFF)
    result.assert_outcomes(passed=1, warnings=1)
    before, summary = _summary(result)
    assert DEPRECATED not in before
    assert DEPRECATED in summary


# -- the import itself (fast) ---------------------------------------------------------------


def test_an_import_warning_is_held_not_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "warns_on_import.py").write_text("import warnings\nwarnings.warn('old', FutureWarning)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(libraries, "_held", [])
    monkeypatch.setattr(libraries, "_reporting", [])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # as under filterwarnings = error, while the plugin configures
        module = libraries.load("warns_on_import")
        assert libraries.load("warns_on_import") is module  # imported once: nothing more to hold
    monkeypatch.delitem(sys.modules, "warns_on_import")
    assert [(w.category, str(w.message)) for w in libraries._held] == [(FutureWarning, "old")]


def test_without_nvidias_driver_pynvml_is_not_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    monkeypatch.setattr(libraries, "NVML_LIBRARY", "libnvidia-ml-not-here.so.1")
    with pytest.raises(libraries.NvmlLibraryMissing, match="NVML Shared Library Not Found"):
        libraries.nvml()
    assert "pynvml" not in sys.modules
