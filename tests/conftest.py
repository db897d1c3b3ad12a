"""Shared fixtures, and the suite's two tiers.

Tests that need an optional component (torch, Open MPI, SLURM, Ray, ...) call
``require("name")``: when it is absent the test is skipped with the reason
``missing component: name``. `.ci/run` installs every component and fails the build if
any test is skipped with that reason. Helper functions shared by several test files
(no fixtures) live in ``tests/helpers.py``. Test files sit in a folder per subsystem
(CONTRIBUTING.md, "Where a test goes") and import these two by name: pytest's default
"prepend" import mode puts this folder on ``sys.path`` when it loads this conftest.

Tiers (for contributors)
------------------------
``python -m pytest -q -ra`` runs everything: the full tier, CI's command (`.ci/run`).
``python -m pytest -q -ra -m "not slow"`` runs the fast tier: pure logic and in-process
units (the broker, the arbiter, placement, planner, ... in this process), in under a
minute. A test is ``slow`` when it runs a whole pytest session (pytester, in-process or
in a subprocess), starts xdist workers, a launcher (mpirun, srun, torchrun), Ray, the
SLURM cluster, a virtualenv, or processes that cost it more than about half a second
(torch imports, compilers, holders it waits on), or when it waits seconds on purpose.

How a test becomes ``slow`` (``pytest_collection_modifyitems`` below):

* it uses a fixture of :data:`SLOW_FIXTURES`: ``pytester`` (so ``gpu_pytester`` and
  ``run_inner`` too) or ``slurm`` -- nothing to do for those;
* ``@pytest.mark.slow`` on the test, or ``pytestmark = pytest.mark.slow`` in a module
  whose every test is end to end;
* its module, or the test itself, is named in :data:`SLOW_TESTS` (for modules that
  carry no marks of their own).

A test that is not ``slow`` and starts pytest, xdist workers, a launcher, Ray, a virtualenv
or pip in a subprocess fails, in either tier, with a message that says to mark it. A
fast-tier test that takes more than :data:`FAST_BUDGET_S` seconds is named at the end of
the run: mark it, or make it faster.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from helpers import TESTS, patience

pytest_plugins = ["pytester"]

MISSING = "missing component"


def require(component: str, *, module: str | None = None, executable: str | None = None) -> None:
    """Skip the calling test unless ``module`` imports / ``executable`` is on PATH."""
    if module is not None and importlib.util.find_spec(module) is None:
        pytest.skip(f"{MISSING}: {component} (python module {module!r} not installed)")
    if executable is not None and shutil.which(executable) is None:
        pytest.skip(f"{MISSING}: {component} ({executable!r} not on PATH)")


AMDSMI_ENV = "AMDSMI_TEST_SITE"  # not PYTEST_GPU_*: inner runs are cleared of those


def amdsmi_site() -> str:
    """The directory that holds the ``amdsmi`` package for the fake-AMD tests; skips without one.

    CI installs amdsmi beside the test environment (``pip install --target``, named by
    ``$AMDSMI_TEST_SITE``), not in it: without a ``libamd_smi.so`` its import raises
    KeyError, which breaks ``import ray`` (ray's pyamdsmi catches ImportError only). The tests
    put this directory on their subprocesses' ``PYTHONPATH`` (:func:`with_amdsmi`)."""
    site = os.environ.get(AMDSMI_ENV, "").strip()
    if site and (Path(site) / "amdsmi" / "__init__.py").is_file():
        return site
    spec = importlib.util.find_spec("amdsmi")  # installed in this environment after all
    if spec is not None and spec.submodule_search_locations:
        return str(Path(next(iter(spec.submodule_search_locations))).parent)
    pytest.skip(f"{MISSING}: amdsmi, the rocm extra (pip install --target DIR amdsmi; {AMDSMI_ENV}=DIR)")


def with_amdsmi(env: dict[str, str]) -> dict[str, str]:
    """``env`` with :func:`amdsmi_site` first on its ``PYTHONPATH``."""
    site = amdsmi_site()
    rest = env.get("PYTHONPATH", "")
    return {**env, "PYTHONPATH": os.pathsep.join([site, rest]) if rest else site}


# -- tiers: what makes a test `slow` (the module docstring says how to use them) ----------

SLOW = "slow"
# fixtures of whole pytest sessions (pytester: in-process or in a subprocess; gpu_pytester
# and run_inner use it) and of a cluster
SLOW_FIXTURES = frozenset({"pytester", "slurm"})
# modules (name -> None: every test) and single tests (name -> test names, without
# parameters) of modules that carry no marks of their own yet; a module that marks its
# tests itself (@pytest.mark.slow, pytestmark) needs no entry
SLOW_TESTS: dict[str, frozenset[str] | None] = {
    "test_distributed": None,  # every test reads one inner run with rank pools
    "test_raycluster": frozenset(
        {"test_plugin_does_not_import_ray", "test_watchdog_stops_its_command_when_the_owner_dies"}
    ),
    "test_rundir": frozenset({"test_racing_runs_lose_no_live_directory"}),  # processes racing for seconds
}
# a test not marked slow that runs longer than this is named at the end of the run
FAST_BUDGET_S = 2.0


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{SLOW}: runs a pytest session (pytester) or starts costly processes (xdist workers, launchers, "
        "Ray, SLURM, torch) or waits on purpose; the fast tier is -m 'not slow' (tests/conftest.py)",
    )
    if not hasattr(config, "workerinput"):
        _compile_the_package()
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        # started in the background (`cmd &` in a script, nohup): the runs these tests start
        # would inherit SIGINT ignored, and the Ctrl-C tests would test nothing; a handled
        # signal is reset to its default in the processes started from here
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _compile_the_package() -> None:
    """Write pytest_gpu's bytecode once: with PYTHONDONTWRITEBYTECODE set (as in CI's image) no
    process writes it, so every inner pytest, xdist worker and rank of the suite compiled the
    whole package from source again (~0.4 s each, hundreds of processes)."""
    import compileall

    import pytest_gpu

    compileall.compile_dir(str(Path(pytest_gpu.__file__).parent), quiet=2)


def _is_slow(item: pytest.Item) -> bool:
    if item.get_closest_marker(SLOW) is not None:
        return True
    if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
        return True
    module = item.module.__name__ if isinstance(item, pytest.Function) else ""
    if module not in SLOW_TESTS:
        return False
    names = SLOW_TESTS[module]
    return names is None or getattr(item, "originalname", item.name) in names


# -- what a test may not leave behind in this process ---------------------------------------
# Every later test, and every process it starts, would inherit it: a lease's visibility
# variables left set (an inner run's GPUs then match nothing), a SIGINT ignored or blocked
# (Ctrl-C never reaches the runs a later test starts). A test that leaves one changed fails
# at teardown, naming it, and the process is put back.
_WATCHED_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL",
                 "ZE_AFFINITY_MASK", "CUDA_DEVICE_ORDER", "PYTEST_ADDOPTS", "LD_LIBRARY_PATH")  # fmt: skip


def _process_state() -> dict[str, object]:
    state: dict[str, object] = {
        name: value for name, value in os.environ.items() if name in _WATCHED_VARS or name.startswith("PYTEST_GPU_")
    }
    state["SIGINT handler"] = signal.getsignal(signal.SIGINT)
    state["blocked signals"] = sorted(signal.pthread_sigmask(signal.SIG_BLOCK, []))
    return state


@pytest.fixture(autouse=True)
def _leaves_the_process_as_it_found_it() -> Iterator[None]:
    before = _process_state()
    yield
    after = _process_state()
    if after == before:
        return
    changed = {k: (before.get(k), after.get(k)) for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    for name, (was, _) in changed.items():
        if name == "SIGINT handler":
            signal.signal(signal.SIGINT, was)
        elif name == "blocked signals":
            signal.pthread_sigmask(signal.SIG_SETMASK, was)
        elif was is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = str(was)
    pytest.fail(
        "this test left the process changed for the tests after it (before -> after): "
        + "; ".join(f"{k}: {was!r} -> {now!r}" for k, (was, now) in sorted(changed.items())),
        pytrace=False,
    )


@pytest.hookimpl(tryfirst=True)  # before -m selects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker(SLOW) is None and _is_slow(item):
            item.add_marker(SLOW)


def _slow_command(args: object) -> str | None:
    """What makes this command line a slow tier's process, or None."""
    if isinstance(args, (str, bytes, os.PathLike)):
        argv = shlex.split(os.fsdecode(args))
    else:
        argv = [os.fsdecode(a) for a in args]  # type: ignore[union-attr]
    if not argv:
        return None
    names = [os.path.basename(a) for a in argv]
    for launcher in ("mpirun", "mpiexec", "srun", "sbatch", "torchrun", "ray", "raylet", "gcs_server", "pip"):
        if names[0] == launcher:
            return launcher
    modules = {argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "-m"} | {a[2:] for a in argv if a.startswith("-m")}
    for module, what in (
        ("pytest", "pytest in a subprocess"),
        ("torch.distributed.run", "torchrun"),
        ("venv", "a virtualenv"),
        ("pip", "pip"),
    ):
        if module in modules:
            return what
    if any("exec(eval(sys.stdin.readline()))" in a for a in argv):  # execnet's bootstrap: an xdist worker
        return "an xdist worker"
    return None


@pytest.fixture(autouse=True)
def _tier_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A test not marked slow may not start the slow tier's processes (see the module docstring)."""
    if request.node.get_closest_marker(SLOW) is not None:
        yield
        return
    started: list[str] = []
    original = subprocess.Popen.__init__

    def guarded(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> None:
        what = _slow_command(args)
        if what is not None:
            started.append(what)
            pytest.fail(
                f"{request.node.nodeid} starts {what} ({args!r}) but is not marked slow: add "
                "@pytest.mark.slow (or see tests/conftest.py's docstring)",
                pytrace=False,
            )
        original(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded)
    yield
    call = request.node.stash.get(_CALL_REPORT, None)
    if started and call is not None and call.passed:  # the test swallowed the failure, or a thread of it started one
        pytest.fail(f"{request.node.nodeid} started {', '.join(started)} but is not marked slow", pytrace=False)


_CALL_REPORT = pytest.StashKey[pytest.TestReport]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.when == "call":
        item.stash[_CALL_REPORT] = report
    return report


_over_budget: list[tuple[float, str]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" and report.duration > FAST_BUDGET_S and SLOW not in report.keywords:
        _over_budget.append((report.duration, report.nodeid))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _over_budget:
        terminalreporter.section(f"tests not marked slow that took over {FAST_BUDGET_S:g}s", sep="-")
        for duration, nodeid in sorted(_over_budget, reverse=True):
            terminalreporter.write_line(f"{duration:6.1f}s {nodeid}")


# -- end-to-end runs of the plugin through pytester ----------------------------------

# A deprecated pytest API the plugin's own code uses fails an inner run (pytest 9.2's
# config.inicfg did: a warning at the top of every run, an INTERNALERROR in a
# "filterwarnings = error" suite). Other plugins' deprecations (pytest-dependency, ... in the
# compatibility tests) are theirs. An ini filter, given by -o: it matches the module as a
# regular expression, so "pytest_gpu" is every module of the package (-W matches one module
# exactly). It replaces an inner ini's own filterwarnings: an inner test that writes one adds
# this line to it (tests/compat/test_warnings.py does).
PLUGIN_DEPRECATIONS = "error::pytest.PytestDeprecationWarning:pytest_gpu"
DEPRECATIONS_ARGS = ("-o", f"filterwarnings={PLUGIN_DEPRECATIONS}")

# Inner pytest runs: no cache files in the test directory, and no unrelated plugins
# (their start-up cost is paid by every xdist worker).
# pytest-depends reorders collected tests, pytest-randomly shuffles them: only the tests of
# their compatibility turn them on.
INNER_ARGS = (
    "-p",
    "no:cacheprovider",
    "-p",
    "no:benchmark",
    "-p",
    "no:hypothesispytest",
    "-p",
    "no:depends",
    "-p",
    "no:randomly",
    *DEPRECATIONS_ARGS,
)
# CI and BUILD_NUMBER: pytest stops cutting short-summary lines to the terminal width on a
# CI machine, so an inner run's output would differ between CI and a laptop
_OUTER_VARS = (
    "CUDA_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "PYTEST_ADDOPTS",
    "CI",
    "BUILD_NUMBER",
)
# pytester points HOME at each test's directory; the fake libnvidia-ml.so.1 is built once
# per cache directory, so inner runs share the user's (as real runs would)
_CACHE = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")


MACHINE_DIR_ENV = "PYTEST_GPU_MACHINE_DIR"


@pytest.fixture(autouse=True)
def _no_outer_xdist_worker_vars(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``pytest -n``, xdist puts ``PYTEST_XDIST_WORKER`` (and its siblings) in this
    process's environment: the pytest runs a test starts would inherit them, and their
    conftests (and a launched rank's start) would take an inner run for an outer worker.
    (Named to sort after ``_leaves_the_process_as_it_found_it``: pytest sets autouse fixtures
    up in name order, and ``monkeypatch`` must be undone before that one looks.)"""
    for name in [n for n in os.environ if n.startswith("PYTEST_XDIST_")]:
        monkeypatch.delenv(name)


@pytest.fixture(autouse=True)
def private_machines(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test its own machine directory: the runs it starts (in-process, subprocesses,
    xdist) meet only each other, and its simulated machines are its own, never a concurrent
    test's (this suite runs under xdist) nor a developer's real runs'.

    No simulated machine is named (``PYTEST_GPU_SIM_MACHINE``, ``PYTEST_GPU_SIM_RUN`` unset):
    each run a test starts has its own, as a user's run has; tests whose runs share one name it.
    """
    path = tmp_path_factory.mktemp("machines")
    monkeypatch.setenv(MACHINE_DIR_ENV, str(path))
    monkeypatch.delenv("PYTEST_GPU_SIM_MACHINE", raising=False)
    monkeypatch.delenv("PYTEST_GPU_SIM_RUN", raising=False)
    from pytest_gpu.machine import domain

    domain._warned.clear()  # a new machine directory: its warnings are said anew
    domain.hold_warnings(False)  # printed as they come, unless the test's own run holds them
    return path


@pytest.fixture
def gpu_pytester(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, private_machines: Path) -> pytest.Pytester:
    """``pytester`` with an environment free of GPU selection and pytest-gpu variables.

    An inner run must not inherit a lease (or a simulated ledger) from the run that
    executes this test suite; it meets other runs in this test's own machine directory.
    Every pytest it starts, in this process or another (xdist workers, ``python -m pytest``),
    fails on a deprecated pytest API in the plugin's code (:data:`PLUGIN_DEPRECATIONS`,
    through ``PYTEST_ADDOPTS``).
    """
    for name in list(os.environ):
        if name in _OUTER_VARS or name.startswith("PYTEST_GPU_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("PYTEST_ADDOPTS", shlex.join(DEPRECATIONS_ARGS))
    monkeypatch.setenv(MACHINE_DIR_ENV, str(private_machines))
    monkeypatch.setenv("XDG_CACHE_HOME", _CACHE)
    return pytester


@pytest.fixture
def run_inner(gpu_pytester: pytest.Pytester) -> Callable[..., pytest.RunResult]:
    """``run_inner(*args, subprocess=False, timeout=120)``: pytest on ``gpu_pytester``'s files.

    In-process by default; ``subprocess=True`` for anything with ``-n`` (xdist needs
    real processes) or that must start from a fresh interpreter. ``timeout`` (subprocess
    only) is the bound on an idle machine, stretched by the load (``helpers.patience``).
    """

    def run(*args: str, subprocess: bool = False, timeout: float = 120) -> pytest.RunResult:
        full = (*INNER_ARGS, *args)
        if subprocess:
            return gpu_pytester.runpytest_subprocess(*full, timeout=patience(timeout))
        return gpu_pytester.runpytest_inprocess(*full)

    return run


@pytest.fixture
def fake_run(
    gpu_pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Callable[..., pytest.RunResult]:
    """``fake_run(spec, *args, visible=None)``: an inner pytest run (own process) on the fake
    GPU machine ``spec`` (``PYTEST_GPU_FAKE_GPUS``: the real-GPU code path against the fake NVML)."""
    require("C compiler", executable="cc")  # the fake libnvidia-ml.so.1 is built from C

    def run(spec: str, *args: str, visible: str | None = None) -> pytest.RunResult:
        monkeypatch.setenv("PYTEST_GPU_FAKE_GPUS", spec)
        monkeypatch.setenv("PYTEST_GPU_SIM_LEDGER", str(tmp_path / "fake-ledger"))
        if visible is not None:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        return gpu_pytester.runpytest_subprocess(
            "-p", "no:cacheprovider", "-p", "no:randomly", *args, timeout=patience(180)
        )

    return run


#: The variables that narrow a run's GPUs on AMD and Intel machines, and where ROCm is (cleared for a fake machine).
VENDOR_VARS = (
    "ROCM_HOME",
    "ROCM_PATH",
    "ROCR_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "GPU_DEVICE_ORDINAL",
    "ZE_AFFINITY_MASK",
    "ZE_FLAT_DEVICE_HIERARCHY",
)


@pytest.fixture
def vendor_run(
    fake_run: Callable[..., pytest.RunResult], monkeypatch: pytest.MonkeyPatch
) -> Callable[..., pytest.RunResult]:
    """``vendor_run(vendor, spec, *args, **env)``: :func:`fake_run` for a test of ``vendor``'s GPUs
    ("nvidia", "amd", "xpu") on the fake machine ``spec``, under ``env`` (no outer AMD or Intel
    variable else); AMD's has the ``amdsmi`` package (:func:`amdsmi_site`; skips without it)."""
    for name in VENDOR_VARS:
        monkeypatch.delenv(name, raising=False)

    def run(vendor: str, spec: str, *args: str, **env: str) -> pytest.RunResult:
        if vendor == "amd":
            site, rest = amdsmi_site(), os.environ.get("PYTHONPATH", "")
            monkeypatch.setenv("PYTHONPATH", os.pathsep.join([site, rest]) if rest else site)  # the inner run's amdsmi
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        return fake_run(spec, *args)

    return run


def run_fake_python(
    tmp_path: Path, spec: str, code: str, *, amdsmi: bool = False, quiet: bool = False, **extra: str
) -> dict[str, Any]:
    """``code`` in a fresh interpreter on the fake machine ``spec`` (its own ledger, fake GPUs
    switched on, no outer visibility variable but ``extra``'s); the dict it fills, ``out``.
    ``amdsmi``: the interpreter has the amdsmi package (:func:`with_amdsmi`); ``quiet``: it prints
    nothing else (the amdsmi package prints its load failures)."""
    require("C compiler", executable=os.environ.get("CC", "cc").split()[0] or "cc")
    env = {**os.environ, "PYTEST_GPU_FAKE_GPUS": spec, "PYTEST_GPU_SIM_LEDGER": str(tmp_path / "ledger")}
    if amdsmi:
        env = with_amdsmi(env)
    for name in ("PYTEST_GPU_SIM", "CUDA_VISIBLE_DEVICES", *VENDOR_VARS):
        env.pop(name, None)
    env.update(extra)
    script = "import json\nfrom pytest_gpu.sim import fake\nassert fake.activate()\nout = {}\n"
    script += textwrap.dedent(code) + "\nprint(json.dumps(out))\n"
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=patience(120)
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    lines = done.stdout.strip().splitlines()
    assert not quiet or len(lines) == 1, done.stdout  # nothing printed on the way
    result: dict[str, Any] = json.loads(lines[-1])
    return result


# -- foreign processes on simulated GPUs -------------------------------------------------


class Holder:
    """A process outside any pytest run holding simulated GPU memory (``python -m pytest_gpu.sim hold``)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pytest_gpu.sim", "hold", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("holding "):
            _, err = self.proc.communicate(timeout=patience(30))
            raise AssertionError(f"hold {' '.join(args)} did not start (exit {self.proc.returncode}): {line}{err}")
        self.pid = int(line.split()[1])
        assert self.pid == self.proc.pid

    def kill(self, *, reap: bool = True) -> None:
        """SIGKILL it (the driver, and the ledger, free what it held); ``reap=False`` leaves a zombie."""
        self.proc.kill()
        if reap:
            self.proc.wait(timeout=patience(30))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate(timeout=patience(30))


@pytest.fixture
def hold() -> Iterator[Callable[..., Holder]]:
    """``hold("--machine", name, "--spec", spec, "--gpu", "1", "--memory", "1GiB")``: a
    :class:`Holder`, killed at the end of the test."""
    made: list[Holder] = []

    def start(*args: str, env: dict[str, str] | None = None) -> Holder:
        holder = Holder(*args, env=env)
        made.append(holder)
        return holder

    yield start
    for holder in made:
        holder.close()


# -- a one-node SLURM cluster, shared by every test of the session that needs one ---------

SLURM_SCRIPT = TESTS / "tools" / "slurm-single-node.sh"


@pytest.fixture(scope="session")
def slurm() -> Iterator[str]:
    """A one-node SLURM cluster (fake gpu:4, 8 CPUs) for this session; yields its SLURM_CONF.

    Started once from this project's own ``tests/tools/slurm-single-node.sh`` (one cluster
    per machine: its daemons listen on SLURM's fixed ports) and stopped at the end.
    """
    require("SLURM", executable="slurmctld")
    require("SLURM", executable="srun")
    if os.geteuid() != 0:
        pytest.skip("the single-node SLURM cluster needs root (munge, slurmd)")
    # Not under pytest's basetemp: that is 0700, and munged runs as the munge user.
    base = Path(tempfile.mkdtemp(prefix="pytest-gpu-slurm-"))
    base.chmod(0o755)
    try:
        started = subprocess.run(
            ["bash", str(SLURM_SCRIPT), "start", str(base), "4", "8"],
            capture_output=True,
            text=True,
            timeout=patience(90),
        )
        others = [
            f"{p.pid}: {' '.join(p.info['cmdline'] or ())}"
            for p in psutil.process_iter(["name", "cmdline"])
            if p.info["name"] == "slurmctld" and str(base) not in " ".join(p.info["cmdline"] or ())
        ]
        assert started.returncode == 0, f"SLURM did not start:\n{started.stdout}\n{started.stderr}" + (
            f"another SLURM cluster runs on this machine (its ports are taken): {others}" if others else ""
        )
        conf = str(base / "slurm.conf")
        assert f"export SLURM_CONF={conf}" in started.stdout
        yield conf
    finally:
        daemons = []
        for name in ("slurmd", "ctld", "munged"):
            try:
                daemons.append(psutil.Process(int((base / f"{name}.bgpid").read_text())))
            except (OSError, ValueError, psutil.Error):
                pass
        subprocess.run(["bash", str(SLURM_SCRIPT), "stop", str(base)], timeout=patience(60), check=False)
        _, alive = psutil.wait_procs(daemons, timeout=patience(10))
        for proc in alive:  # a daemon that ignored SIGTERM
            proc.kill()
        shutil.rmtree(base, ignore_errors=True)
