"""Benchmark the makespan of a mixed GPU suite: pytest-gpu against plain xdist and the pinning recipe.

Generates a seeded synthetic suite into a temporary directory — 30 % CPU-only tests, 10 %
2-GPU tests (0.5-8 GiB per GPU), 4 % exclusive ones, four 2-rank gloo ``distributed`` tests
(when torch is installed) and the rest 1-GPU tests asking for 0.5-12 GiB, on 4 simulated
16 GiB GPUs, durations log-uniform over 0.05-3 s — and runs it, one mode after the other:

1. ``serial``: ``pytest --gpus sim:4x16GiB`` (the plugin, one process);
2. ``xdist``: ``pytest -n 8 -p no:gpu`` on the simulated ledger (every worker on GPU 0);
3. ``pin``: ``pytest -n 8 -p no:gpu`` with the usual conftest recipe, worker gwI on GPU I mod 4;
4. ``off``: ``pytest -n 8 --gpus sim:4x16GiB --gpu-schedule=off`` (xdist's scheduling, leases);
5. ``sched``: ``pytest -n 8 --gpus sim:4x16GiB`` (the scheduler), run twice on one cache
   directory: the first run has no past durations, the second has them.

GPU tests really use their memory: ``sim.hold`` of 80-95 % of the request for the test's
duration, so over-commitment raises ``pytest_gpu.sim.OutOfMemoryError`` (counted from
the junitxml). For each run it prints the wall time of the pytest process, pytest's own
duration, the outcomes, the simulated OOMs, and the ratio to two lower bounds: the GPU
bound max(longest test, GPU-memory-seconds / capacity) and that bound with the workers
(sum of durations / workers) — then the targets, PASS or MISS, measured side by side.

Two more scenarios (``--scenario``; the default, ``mixed``, is the above):

- ``fixtures``: 8 modules x 10 tests, each module with a module-scoped ``model`` fixture
  that loads for 1-2 s (a sleep) and takes 3-8 GiB (``sim.allocate``), its tests holding
  0.25-1.5 GiB more on the model's GPU for 0.05-0.5 s, under ``-n 8`` on ``sim:4x16GiB``.
  Modes, alternating (``--runs``): ``module`` (the fixture leases with
  ``gpu_lease_factory``: one load per module), ``test`` (every test has a ``gpu`` marker
  and loads the model in a function-scoped fixture, as a suite without fixture leases
  must), ``pin`` (the fixture as it was: ``-p no:gpu``, workers pinned to GPU worker_id %
  4). Load time is part of every makespan; the generated modules count the loads.
- ``auto``: 100 tests of the mixed kind (no distributed ones) on ``sim:8x16GiB``:
  ``-n auto`` (pytest-gpu's choice) against ``-n <os.cpu_count()>`` (xdist's ``-n auto``
  without pytest-gpu), alternating (``--runs``), both with leases.
- ``spread``: compute-bound GPU tests on GPUs that share their compute
  (``sim:4x16GiB;slowdown=share``: a test's ``sim.hold`` runs 1/k as fast while k processes
  compute on its GPU), ``-n 4``: placement that spreads (idle GPUs first, the default)
  against the rule before (a worker's context GPUs first, busy or not:
  ``PYTEST_GPU_PLACEMENT=affinity``), alternating (``--runs``), both with the scheduler.
  Each run: wall, test span against the bound (the longest test, or the sum over the GPUs),
  how much longer the GPU tests took than alone (the slowdown they met), pytest-gpu's GPU busy line.
- ``shapes``: the scheduler against ``--gpu-schedule=off`` on suite shapes of 160 tests
  (``--shapes``: ``worker``-bound, 30 % CPU and GPU tests of 1-12 GiB and whole GPUs;
  ``memory``-bound, mostly 8.25-12 GiB and 2-GPU tests, at most one such lease a GPU;
  ``pairing``, 30 % CPU and GPU tests of 3-12 GiB; ``packing``, 10 % CPU and GPU tests of
  4-11 GiB, where which leases share a GPU decides the makespan), durations 0.05-3 s and one of 6 s,
  ``-n 8`` on ``sim:4x16GiB``, over ``--seeds`` (default 1,2,3): per seed a history run, then
  ``--runs`` of each mode alternating (ABBA). Each run: span against a lower bound (the
  largest of the longest test, sum / workers, leased GiB-s / capacity, and GPU-s of leases
  over half a GPU / GPUs), idle time between a worker's tests and at its tail, seconds
  waited for GPUs (``--gpu-trace``), when the longest tests started, and the scheduler's
  decision latency at the controller.

Run from the repository root::

    python bench/makespan.py                  # 200 tests + 4 distributed, all modes (about 5 minutes here)
    python bench/makespan.py --quick          # smoke run: 40 short tests + 1 distributed (under a minute)
    python bench/makespan.py --dist 0         # the same 200 tests without the distributed ones
    python bench/makespan.py --modes pin,sched --seed 7 --tests 400 --keep
    python bench/makespan.py --scenario fixtures,auto          # about 5 minutes here
    python bench/makespan.py --scenario fixtures,auto --quick  # smoke run (under a minute)
    python bench/makespan.py --scenario shapes                # about 16 minutes here
    python bench/makespan.py --scenario shapes --quick        # smoke run (about a minute)
    python bench/makespan.py --scenario spread                # about 3 minutes here
"""

from __future__ import annotations

import argparse
import heapq
import importlib.util
import itertools
import json
import math
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

GIB = 2**30
GPUS, GPU_GIB = 4, 16
SIM_SPEC = f"sim:{GPUS}x{GPU_GIB}GiB"
TESTS_PER_MODULE = 25
TARGET_RATIO = 1.3
# Off in every mode: unrelated plugins of this environment would only add start-up time.
QUIET_PLUGINS = ("-p", "no:benchmark", "-p", "no:hypothesispytest")
PIN_ENV = "MAKESPAN_PIN_GPUS"
SPANS_ENV = "MAKESPAN_SPANS"
DECISIONS_ENV = "MAKESPAN_DECISIONS"
LOADS_ENV = "MAKESPAN_LOADS"
CONTEXT = 500 * 2**20  # pytest-gpu's default --gpu-context-overhead, also the simulated ledger's
MODES = ("serial", "xdist", "pin", "off", "sched")
SCENARIOS = ("mixed", "fixtures", "auto", "shapes", "dynamo", "spread")
FIXTURE_MODES = ("module", "test", "pin")  # a lease (and a load) per module / per test / no plugin, pinned
AUTO_GPUS = 8
AUTO_SPEC = f"sim:{AUTO_GPUS}x{GPU_GIB}GiB"
MIB = 2**20

CONFTEST = f'''\
"""Generated by pytest-gpu's bench/makespan.py."""

import os
import time

import pytest


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # when each test (setup, call, teardown: lease waits included) ran, the same way in every mode
    start = time.time()
    try:
        return (yield)
    finally:
        spans = os.environ.get("{SPANS_ENV}")
        if spans:
            with open(os.path.join(spans, f"{{os.getpid()}}.txt"), "a") as fh:
                fh.write(f"{{start}} {{time.time()}} {{item.name}}\\n")


_DECISIONS = []  # (seconds, tests pending) per call into the scheduler, at the controller


def _timed(method):
    def wrapper(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            planner = getattr(self, "planner", None)
            _DECISIONS.append((time.perf_counter() - start, planner.pending if planner is not None else -1))
    return wrapper


def _time_decisions():
    # the controller's decision latency: what pytest-gpu's scheduler spends per call from xdist
    try:
        from pytest_gpu.scheduling.scheduler import GpuScheduling
    except ImportError:
        return
    for name in ("schedule", "mark_test_complete"):
        method = getattr(GpuScheduling, name)
        if not getattr(method, "_timed", False):
            wrapped = _timed(method)
            wrapped._timed = True
            setattr(GpuScheduling, name, wrapped)


def pytest_unconfigure(config):
    where = os.environ.get("{DECISIONS_ENV}")
    if where and _DECISIONS and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(where, "w") as fh:
            fh.writelines(f"{{seconds}} {{pending}}\\n" for seconds, pending in _DECISIONS)


def pytest_configure(config):
    if os.environ.get("{DECISIONS_ENV}") and not os.environ.get("PYTEST_XDIST_WORKER"):
        _time_decisions()
    if not config.pluginmanager.hasplugin("gpu"):
        # -p no:gpu: the markers are unknown; registered so the run stays quiet
        config.addinivalue_line("markers", "gpu(count=1, memory=None, exclusive=False): pytest-gpu's marker")
        config.addinivalue_line("markers", "distributed(world_size): pytest-gpu's marker")
    gpus = os.environ.get("{PIN_ENV}")
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if gpus and worker:
        # The common recipe: worker gwI on GPU I mod N. The other GPUs follow in turn, so
        # a 2-GPU test finds its second device (GPU I+1 mod N) instead of an invalid ordinal.
        n, i = int(gpus), int(worker[2:])
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str((i + k) % n) for k in range(n))


@pytest.fixture
def gpu_pair(request):
    # A 2-GPU test's devices as this process numbers them. With pytest-gpu: the lease's
    # (cuda:K, K the GPU's place in the run's list, not 0 and 1). Without it: cuda:0 and
    # cuda:1 (under the pinning recipe, the worker's GPU and the next one).
    if request.config.pluginmanager.hasplugin("gpu"):
        return request.getfixturevalue("gpu").devices[:2]
    return [0, 1]


def pytest_collection_finish(session):
    # when each worker finished collecting (pytest-gpu's catalog sent): start-up apart from hand-out
    spans = os.environ.get("{SPANS_ENV}")
    if spans and os.environ.get("PYTEST_XDIST_WORKER"):
        with open(os.path.join(spans, f"{{os.getpid()}}.collected"), "w") as fh:
            fh.write(f"{{time.time()}}\\n")
'''

MODULE_HEAD = '''\
"""Generated by pytest-gpu's bench/makespan.py (seed {seed})."""

import time

import pytest

from pytest_gpu import sim
'''

CPU_TEMPLATE = """

def test_cpu_{index:03d}():
    time.sleep({duration:.3f})
"""

GPU_TEMPLATE = """

@pytest.mark.gpu(memory="{request_mib}MiB")
def test_gpu_{index:03d}():
    sim.hold({hold}, {duration:.3f})
"""

MULTI_TEMPLATE = """

@pytest.mark.gpu(2, memory="{request_mib}MiB")
def test_multi_{index:03d}(gpu_pair):
    with sim.allocate({hold}, device=gpu_pair[0]), sim.allocate({hold}, device=gpu_pair[1]):
        time.sleep({duration:.3f})
"""

EXCLUSIVE_TEMPLATE = """

@pytest.mark.gpu(exclusive=True)
def test_exclusive_{index:03d}():
    sim.hold({hold}, {duration:.3f})
"""

DIST_TEMPLATE = """

@pytest.mark.distributed(2, backend="gloo")
def test_dist_{index:03d}(rank):
    assert rank.world_size == 2
    time.sleep({duration:.3f})
"""


@dataclass(frozen=True)
class Case:
    kind: str  # cpu, gpu, multi, exclusive, dist
    index: int
    duration: float
    count: int = 0  # GPUs
    memory: int = 0  # bytes requested per GPU (exclusive: the whole GPU)
    hold: int = 0  # bytes the body allocates per GPU

    @property
    def gpu_memory_seconds(self) -> float:
        return self.duration * self.count * self.memory / GIB


def make_suite(seed: int, tests: int, dist: int, lo: float, hi: float, workers: int) -> list[Case]:
    """Draw ``tests`` cases, the kinds in a shuffled order, and put ``dist`` distributed ones among them.

    The distributed tests come from a random stream of their own, so ``--dist 0`` leaves
    exactly the same suite without them (as the runs without torch do).
    """
    rng = random.Random(seed)
    # An exclusive lease gets the GPU less every process's CUDA context on it: with one
    # context per worker at worst, that is what its test may rely on.
    exclusive_usable = GPU_GIB * GIB - max(workers, 1) * CONTEXT

    def duration() -> float:  # from ``rng`` as it is when called
        return round(math.exp(rng.uniform(math.log(lo), math.log(hi))), 3)  # log-uniform: many short, a long tail

    def mib(lo_gib: float, hi_gib: float) -> int:
        return 256 * round(4 * math.exp(rng.uniform(math.log(lo_gib), math.log(hi_gib))))  # quarter-GiB steps

    # exact shares, so every seed has the same mix: 30 % CPU-only, 10 % 2-GPU, 4 % exclusive, the rest 1-GPU
    shares = {"cpu": 0.30, "multi": 0.10, "exclusive": 0.04}
    kinds: list[str] = []
    for kind, share in shares.items():
        kinds += [kind] * min(round(share * tests), tests - len(kinds))
    kinds += ["gpu"] * (tests - len(kinds))
    rng.shuffle(kinds)
    cases: list[Case] = []
    for index, kind in enumerate(kinds):
        if kind == "cpu":
            cases.append(Case(kind, index, duration()))
        elif kind == "multi":
            memory = mib(0.5, 8.0) * 2**20
            cases.append(Case(kind, index, duration(), 2, memory, int(memory * rng.uniform(0.80, 0.95))))
        elif kind == "exclusive":
            hold = int(exclusive_usable * rng.uniform(0.80, 0.95))
            cases.append(Case(kind, index, duration(), 1, GPU_GIB * GIB, hold))
        else:
            memory = mib(0.5, 12.0) * 2**20
            cases.append(Case(kind, index, duration(), 1, memory, int(memory * rng.uniform(0.80, 0.95))))
    rng = random.Random(f"{seed}-dist")
    for index in range(tests, tests + dist):
        cases.insert(rng.randrange(len(cases) + 1), Case("dist", index, duration()))
    return cases


def write_suite(root: Path, cases: list[Case], seed: int) -> None:
    templates = {
        "cpu": CPU_TEMPLATE,
        "gpu": GPU_TEMPLATE,
        "multi": MULTI_TEMPLATE,
        "exclusive": EXCLUSIVE_TEMPLATE,
        "dist": DIST_TEMPLATE,
    }
    suite = root / "suite"
    suite.mkdir()
    (suite / "pytest.ini").write_text("[pytest]\n")  # pins the rootdir: no outer config applies
    (suite / "conftest.py").write_text(CONFTEST)
    for start in range(0, len(cases), TESTS_PER_MODULE):
        body = [MODULE_HEAD.format(seed=seed)]
        for case in cases[start : start + TESTS_PER_MODULE]:
            body.append(
                templates[case.kind].format(
                    index=case.index, duration=case.duration, request_mib=case.memory // 2**20, hold=case.hold
                )
            )
        (suite / f"test_mix_{start // TESTS_PER_MODULE:02d}.py").write_text("".join(body))


@dataclass
class Bounds:
    longest: float
    total: float
    gpu_seconds: float  # GiB-seconds
    workers: int
    gpus: int = GPUS

    @property
    def gpu(self) -> float:
        return max(self.longest, self.gpu_seconds / (self.gpus * GPU_GIB))

    @property
    def with_workers(self) -> float:
        return max(self.gpu, self.total / self.workers)

    @property
    def dominant(self) -> str:
        if self.total / self.workers > self.gpu:
            return f"worker parallelism (sum of durations / {self.workers})"
        if self.longest >= self.gpu_seconds / (self.gpus * GPU_GIB):
            return "the longest test"
        return "GPU memory (memory-seconds / capacity)"


@dataclass
class Result:
    label: str
    mode: str
    wall: float
    hung: bool = False
    span: float | None = None  # first test's start to last test's end, from the generated conftest
    before: float | None = None  # launch to the first test's start: start-up and collection
    after: float | None = None  # the last test's end to exit: shutdown
    rc: int | None = None
    internal_error: str = ""  # the last INTERNALERROR line: pytest itself broke (e.g. a scheduler bug)
    reported: float | None = None  # pytest's own "in X s"
    counts: dict[str, int] = field(default_factory=dict)
    ooms: int = 0
    ordinals: int = 0  # SimDeviceError: invalid device ordinal
    dist_errors: int = 0  # distributed tests without the plugin (no rank fixture)
    undone: float = 0.0  # planned seconds of the tests that failed or errored: work the run did not do
    summary: str = ""
    plugin_lines: list[str] = field(default_factory=list)  # pytest-gpu's summary lines
    problems: list[str] = field(default_factory=list)  # FAILED/ERROR lines, for the report
    loads: list[str] = field(default_factory=list)  # modules whose model was loaded, once per load (fixtures)
    workers: int | None = None  # what -n auto chose, from the plugin's summary line
    per_worker: list[list[tuple[float, float, str]]] = field(default_factory=list)  # (start, end, test) per worker
    gpu_wait: float | None = None  # seconds tests spent waiting for GPUs inside their span (--gpu-trace)
    decisions: list[tuple[float, int]] = field(default_factory=list)  # (seconds, pending) per scheduler call
    collected: list[float] = field(default_factory=list)  # when each worker finished collecting (epoch)
    launched: float | None = None  # epoch at launch


def run_env(root: Path) -> dict[str, str]:
    """The children's environment: nothing of pytest-gpu or PYTEST_ADDOPTS from outside, and a bytecode cache.

    This environment sets PYTHONDONTWRITEBYTECODE, so every worker would recompile the
    editable-installed plugin and pytest rewrite every test module again; a private
    ``PYTHONPYCACHEPREFIX`` (warmed before the first mode) gives every mode the cache a
    normal installation has.
    """
    drop = ("PYTEST_GPU", "PYTEST_ADDOPTS", "PYTEST_XDIST_AUTO_NUM_WORKERS", "CUDA_VISIBLE_DEVICES")
    drop += ("HIP_VISIBLE_DEVICES", PIN_ENV, LOADS_ENV)
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(root / "pycache")
    # a machine of the bench's own: its simulated GPUs and leases meet no other run on this host
    env["PYTEST_GPU_MACHINE_DIR"] = str(root / "machines")
    return env


def warm_bytecode(root: Path, env: dict[str, str], *suites: Path) -> None:
    spec = importlib.util.find_spec("pytest_gpu")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            subprocess.run([sys.executable, "-m", "compileall", "-q", location], env=env, check=False)
    # collection rewrites and caches the test modules and conftest
    for suite in suites or (root / "suite",):
        subprocess.run(
            [sys.executable, "-m", "pytest", str(suite), "--co", "-q", "-p", "no:cacheprovider", *QUIET_PLUGINS],
            cwd=suite,
            env=env,
            capture_output=True,
            check=False,
        )


def mode_command(mode: str, root: Path, workers: int) -> tuple[list[str], dict[str, str]]:
    """The pytest arguments and extra environment of one mode."""
    args: list[str] = []
    extra: dict[str, str] = {}
    if mode == "serial":
        args = ["--gpus", SIM_SPEC, "-p", "no:cacheprovider"]
    elif mode in ("xdist", "pin"):
        args = ["-n", str(workers), "-p", "no:gpu", "-p", "no:cacheprovider"]
        ledger = root / f"ledger-{mode}"
        shutil.rmtree(ledger, ignore_errors=True)
        extra = {"PYTEST_GPU_SIM": SIM_SPEC, "PYTEST_GPU_SIM_LEDGER": str(ledger)}
        if mode == "pin":
            extra[PIN_ENV] = str(GPUS)
    elif mode == "off":
        args = ["-n", str(workers), "--gpus", SIM_SPEC, "--gpu-schedule=off", "-p", "no:cacheprovider"]
    elif mode == "sched":
        # pytest's cache is kept (one directory for both runs): the scheduler reads past durations from it
        args = ["-n", str(workers), "--gpus", SIM_SPEC, "-o", f"cache_dir={root / 'cache-sched'}"]
    else:
        raise ValueError(mode)
    return args, extra


def run_mode(
    label: str, mode: str, root: Path, workers: int, env: dict[str, str], timeout: float, durations: dict[str, float]
) -> Result:
    args, extra = mode_command(mode, root, workers)
    return run_pytest(label, mode, root, root / "suite", args, extra, env, timeout, durations)


def run_pytest(
    label: str,
    mode: str,
    root: Path,
    suite: Path,
    args: list[str],
    extra: dict[str, str],
    env: dict[str, str],
    timeout: float,
    durations: dict[str, float],
) -> Result:
    """One pytest run of ``suite``: wall time, outcomes, OOMs, the test span, model loads."""
    tag = re.sub(r"[^A-Za-z0-9_.-]+", "-", label).strip("-")
    junit = root / f"junit-{tag}.xml"
    out = root / f"out-{tag}.txt"
    cmd = [sys.executable, "-m", "pytest", str(suite), *args, *QUIET_PLUGINS, "-q", "-rfE"]
    cmd += [f"--junitxml={junit}"]
    spans = root / f"spans-{tag}"
    loads = root / f"loads-{tag}"
    for path in (spans, loads):
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir()
    decisions = root / f"decisions-{tag}.txt"
    decisions.unlink(missing_ok=True)
    extra = {**extra, SPANS_ENV: str(spans), LOADS_ENV: str(loads), DECISIONS_ENV: str(decisions)}
    with out.open("w") as fh:
        launched = time.time()  # epoch, to line up with the conftest's records
        started = time.perf_counter()
        # own session: a hung run is killed with every worker and rank process it started
        proc = subprocess.Popen(
            cmd, cwd=suite, env={**env, **extra}, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
        hung = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            hung = True
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        wall = time.perf_counter() - started
        ended = time.time()
    result = Result(label, mode, wall, hung=hung, rc=proc.returncode)
    text = out.read_text(errors="replace")
    lines = [line for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if re.search(r"\b(passed|failed|errors?|skipped|no tests ran)\b.* in [\d.]+s", line):
            result.summary = line.strip("= ")
            break
    for number, word in re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)", result.summary):
        result.counts["error" if word.startswith("error") else word] = int(number)
    if match := re.search(r" in ([\d.]+)s", result.summary):
        result.reported = float(match.group(1))
    result.plugin_lines = [line for line in lines if line.startswith("pytest-gpu:") and not line.endswith(":")]
    if internal := [line for line in lines if line.startswith("INTERNALERROR>")]:
        result.internal_error = internal[-1]
    result.problems = [line for line in lines if line.startswith(("FAILED ", "ERROR "))]
    if junit.exists():
        parse_junit(junit, result, durations)
    marks = []
    for file in spans.glob("*.txt"):  # one file per worker process: "start end name" per test
        runs = []
        for line in file.read_text().splitlines():
            start, end, *name = line.split()
            runs.append((float(start), float(end), name[0] if name else ""))
            marks += [float(start), float(end)]
        result.per_worker.append(sorted(runs))
    if marks:
        result.span = max(marks) - min(marks)
        result.before, result.after = min(marks) - launched, ended - max(marks)
    result.loads = [name for file in loads.glob("*.txt") for name in file.read_text().split()]
    result.collected = [float(f.read_text().split()[0]) for f in spans.glob("*.collected") if f.read_text().strip()]
    result.launched = launched
    if decisions.exists():
        result.decisions = [
            (float(a), int(b)) for a, b in (line.split() for line in decisions.read_text().splitlines())
        ]
    trace = next((a.split("=", 1)[1] for a in args if a.startswith("--gpu-trace=")), None)
    if trace and os.path.exists(trace):
        events = json.loads(Path(trace).read_text()).get("traceEvents", [])
        result.gpu_wait = sum(e["args"].get("wait_s") or 0.0 for e in events if e.get("cat") == "test")
    if match := re.search(r"-n auto chose (\d+) worker", text):
        result.workers = int(match.group(1))
    if hung:
        result.problems.append(f"HUNG: killed after {timeout:.0f} s; last output: {' | '.join(lines[-5:])}")
    elif not result.summary:
        # pytest ended without running the suite (a broken install, a usage error): every
        # figure of this run would be a blank, and a table of blanks is not a measurement
        raise SystemExit(
            f"makespan: the {label} {mode} run ended without a pytest summary (exit status {proc.returncode});"
            f" see {out}; last output: {' | '.join(lines[-3:])[:600]}"
        )
    return result


def parse_junit(path: Path, result: Result, durations: dict[str, float]) -> None:
    """Count simulated OOMs, invalid ordinals and plugin-less distributed errors, one per test."""
    try:
        tree = ET.parse(path)
    except ET.ParseError:
        return
    for case in tree.iter("testcase"):
        texts = [f"{el.get('message', '')}\n{el.text or ''}" for el in case if el.tag in ("failure", "error")]
        if not texts:
            continue
        text = "\n".join(texts)
        result.undone += durations.get(case.get("name", ""), 0.0)  # an OOM fails at once: its sleep never ran
        if "OutOfMemoryError" in text:
            result.ooms += 1
        elif "SimDeviceError" in text or "invalid device ordinal" in text:
            result.ordinals += 1
        elif case.get("name", "").startswith("test_dist_") and "fixture 'rank' not found" in text:
            result.dist_errors += 1


def scheduler_present() -> bool:
    """Whether the plugin has its xdist scheduler yet (until then ``sched`` runs as ``off``)."""
    spec = importlib.util.find_spec("pytest_gpu")
    if spec is None or not spec.submodule_search_locations:
        return False
    pattern = re.compile(r"class GpuScheduling|def pytest_xdist_make_scheduler")
    for location in spec.submodule_search_locations:
        for file in Path(location).rglob("*.py"):
            if pattern.search(file.read_text(errors="replace")):
                return True
    return False


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--scenario",
        default="mixed",
        help="comma-separated: mixed (the default: the mixed suite, --modes), fixtures (module-scoped model "
        "fixtures: a lease per module against one per test), auto (-n auto against -n <CPUs> on "
        f"{AUTO_SPEC}), shapes, spread (spread placement against affinity on GPUs that share compute), or all",
    )
    parser.add_argument("--seed", type=int, default=1, help="seed of the generated suite (default 1)")
    parser.add_argument(
        "--tests",
        type=int,
        default=None,
        help="mixed and auto: tests besides the distributed ones (default 200, auto 100; quick 40, auto 24)",
    )
    parser.add_argument("--workers", type=int, default=8, help="mixed and fixtures: xdist workers, -n (default 8)")
    parser.add_argument("--dist", type=int, default=None, help="mixed: 2-rank distributed tests (default 4; quick 1)")
    parser.add_argument("--quick", action="store_true", help="smoke run: short tests (mixed: 40 tests of 0.02-0.5 s)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"mixed: comma-separated subset of {','.join(MODES)}")
    parser.add_argument(
        "--fixture-modes",
        default=",".join(FIXTURE_MODES),
        help=f"fixtures: comma-separated subset of {','.join(FIXTURE_MODES)}",
    )
    parser.add_argument("--modules", type=int, default=None, help="fixtures: test modules (default 8; quick 3)")
    parser.add_argument(
        "--module-tests", type=int, default=None, help="fixtures: tests per module (default 10; quick 4)"
    )
    parser.add_argument(
        "--runs", type=int, default=None, help="fixtures and auto: runs of each mode, alternating (default 2; quick 1)"
    )
    parser.add_argument(
        "--shapes", default=",".join(SHAPES), help=f"shapes: comma-separated subset of {','.join(SHAPES)}"
    )
    parser.add_argument(
        "--long-first",
        action="store_true",
        help="shapes: the long test first in collection order (xdist starts it at once)",
    )
    parser.add_argument("--seeds", default=None, help="shapes: comma-separated seeds (default 1,2,3; quick 1)")
    parser.add_argument(
        "--scale",
        type=float,
        default=None,
        help="dynamo: factor on the 1-30 s durations, so a run fits a couple of minutes (default 0.1; quick 0.02)",
    )
    parser.add_argument("--timeout", type=float, default=None, help="seconds per pytest run (default from the suite)")
    parser.add_argument("--keep", action="store_true", help="keep the generated suite, outputs and junitxml")
    args = parser.parse_args(argv)
    scenarios = [x.strip() for x in args.scenario.split(",") if x.strip()]
    if scenarios == ["all"]:
        scenarios = list(SCENARIOS)
    if not scenarios or (unknown := set(scenarios) - set(SCENARIOS)):
        parser.error(f"--scenario: choose from {', '.join(SCENARIOS)} or all")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown mode(s) {', '.join(sorted(unknown))}; choose from {', '.join(MODES)}")
    fixture_modes = [m.strip() for m in args.fixture_modes.split(",") if m.strip()]
    if unknown := set(fixture_modes) - set(FIXTURE_MODES):
        parser.error(f"unknown fixture mode(s) {', '.join(sorted(unknown))}; choose from {', '.join(FIXTURE_MODES)}")
    if args.runs is not None and args.runs < 1:
        parser.error("--runs must be at least 1")
    for number, scenario in enumerate(scenarios):
        if number:
            print()
        if scenario == "mixed":
            run_mixed(args, modes)
        elif scenario == "fixtures":
            run_fixtures(args, fixture_modes)
        elif scenario == "shapes":
            run_shapes(args)
        elif scenario == "dynamo":
            run_dynamo(args)
        elif scenario == "spread":
            run_spread(args)
        else:
            run_auto(args)
    return 0


def run_mixed(args: argparse.Namespace, modes: list[str]) -> None:
    """The mixed suite: serial, plain xdist, pinning, --gpu-schedule=off and the scheduler."""
    tests = args.tests if args.tests is not None else (40 if args.quick else 200)
    lo, hi = (0.02, 0.5) if args.quick else (0.05, 3.0)
    dist = args.dist if args.dist is not None else (1 if args.quick else 4)
    has_torch = importlib.util.find_spec("torch") is not None
    torch_note = ""
    if not has_torch and dist:
        torch_note = f"torch is not installed: the {dist} distributed tests are left out"
        dist = 0

    cases = make_suite(args.seed, tests, dist, lo, hi, args.workers)
    bounds = Bounds(
        longest=max(c.duration for c in cases),
        total=sum(c.duration for c in cases),
        gpu_seconds=sum(c.gpu_memory_seconds for c in cases),
        workers=args.workers,
    )
    kinds = {k: sum(c.kind == k for c in cases) for k in ("gpu", "multi", "exclusive", "cpu", "dist")}
    timeout = args.timeout or max(120.0, 2 * bounds.total + 120)  # a serial run with slack: beyond it, hung
    sched = scheduler_present()

    root = Path(tempfile.mkdtemp(prefix="pytest-gpu-makespan-"))
    results: list[Result] = []
    try:
        write_suite(root, cases, args.seed)
        print(
            f"pytest-gpu makespan benchmark · Python {platform.python_version()} · {os.cpu_count()} CPUs · "
            f"{SIM_SPEC} · seed {args.seed} · -n {args.workers} · "
            f"scheduler in the plugin: {'yes' if sched else 'NOT YET (sched runs as off)'}"
        )
        print(
            f"suite: {len(cases)} tests = {kinds['gpu']} 1-GPU (0.5-12 GiB) + {kinds['multi']} 2-GPU (0.5-8 GiB each) "
            f"+ {kinds['exclusive']} exclusive + {kinds['cpu']} CPU-only "
            f"+ {kinds['dist']} distributed (2 ranks, gloo); "
            f"durations log-uniform {lo:g}-{hi:g} s; GPU tests hold 80-95 % of their request"
        )
        if torch_note:
            print(torch_note)
        print(
            f"sum of durations {bounds.total:.1f} s · longest {bounds.longest:.2f} s · "
            f"GPU memory-seconds {bounds.gpu_seconds:.0f} GiB·s / {GPUS * GPU_GIB} GiB = "
            f"{bounds.gpu_seconds / (GPUS * GPU_GIB):.1f} s"
        )
        print(
            f"lower bounds: GPU LB = max(longest, mem·s/capacity) = {bounds.gpu:.1f} s; "
            f"with {args.workers} workers LBw = max(LB, sum/{args.workers}) = {bounds.with_workers:.1f} s "
            f"(dominated by {bounds.dominant})"
        )
        print(
            f"children run with PYTHONDONTWRITEBYTECODE unset and a warmed PYTHONPYCACHEPREFIX; "
            f"timeout {timeout:.0f} s per run; load average before: {load()}"
        )
        env = run_env(root)
        durations = {f"test_{c.kind}_{c.index:03d}": c.duration for c in cases}
        warm_bytecode(root, env)
        plan = [(m, m) for m in modes if m != "sched"]
        if "sched" in modes:
            plan += [("sched (no history)", "sched"), ("sched (history)", "sched")]
        for label, mode in plan:
            print(f"  running {label} ...", flush=True)
            results.append(run_mode(label, mode, root, args.workers, env, timeout, durations))
        print(f"load average after: {load()} (other load on the machine inflates every figure, start-up most)")
        print()
        report(results, bounds)
        targets(results, bounds, sched)
        if args.keep:
            print(f"suite and outputs kept in {root}")
        if args.quick:
            print("(quick run: a smoke test; worker start-up dominates such short suites)")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


def report(results: list[Result], bounds: Bounds) -> None:
    head = (
        f"| {'mode':20} | {'wall s':>7} | {'pytest s':>8} | {'passed':>6} | {'failed':>6} | {'errors':>6} "
        f"| {'skipped':>7} | {'sim OOMs':>8} | {'undone s':>8} | {'x LB':>5} | {'x LBw':>5} "
        f"| {'to 1st test s':>13} | {'test span s':>11} | {'after s':>7} | {'span x LBw':>10} |"
    )
    print(head)
    print("|" + "|".join("-" * (len(cell)) for cell in head.split("|")[1:-1]) + "|")
    for r in results:
        wall = f"{r.wall:.1f}" + ("!" if r.hung else "*" if r.internal_error else "")
        span_ratio = None if r.span is None else r.span / bounds.with_workers
        print(
            f"| {r.label:20} | {wall:>7} | {fmt(r.reported, '.1f'):>8} | {r.counts.get('passed', 0):6d} "
            f"| {r.counts.get('failed', 0):6d} | {r.counts.get('error', 0):6d} | {r.counts.get('skipped', 0):7d} "
            f"| {r.ooms:8d} | {r.undone:8.1f} | {r.wall / bounds.gpu:5.2f} | {r.wall / bounds.with_workers:5.2f} "
            f"| {fmt(r.before, '.1f'):>13} | {fmt(r.span, '.1f'):>11} | {fmt(r.after, '.1f'):>7} "
            f"| {fmt(span_ratio, '.2f'):>10} |"
        )
    print(
        f"LB = {bounds.gpu:.1f} s (GPU bound), LBw = {bounds.with_workers:.1f} s (with workers); "
        "to 1st test: start-up and collection; test span: first test's start to last test's end; after: shutdown; "
        "undone: planned seconds of failed/errored tests; ! = hung, killed; * = INTERNALERROR"
    )
    for r in results:
        notes = []
        if r.dist_errors:
            notes.append(f"{r.dist_errors} distributed tests error without the plugin (no 'rank' fixture)")
        if r.ordinals:
            notes.append(f"{r.ordinals} invalid device ordinals")
        notes += r.plugin_lines
        if r.internal_error:
            notes.append(f"exit status {r.rc}, pytest INTERNALERROR: {r.internal_error}")
        elif r.mode in ("serial", "off", "sched") and r.rc not in (0, None) and not r.hung:
            notes.append(f"exit status {r.rc}")
        if r.mode in ("serial", "off", "sched") and r.problems:  # with pytest-gpu, any failure is news
            notes.append(f"{len(r.problems)} failures/errors: " + " | ".join(p[:200] for p in r.problems[:8]))
        elif r.hung:
            notes.append(r.problems[-1])
        for note in notes:
            print(f"  {r.label}: {note}")


def targets(results: list[Result], bounds: Bounds, sched: bool) -> None:
    by_label = {r.label: r for r in results}
    plugin_runs = [r for r in results if r.mode in ("serial", "off", "sched")]
    best = by_label.get("sched (history)") or by_label.get("off")
    pin = by_label.get("pin")
    print()
    print("targets (measured side by side in this run):")

    def verdict(ok: bool | None) -> str:
        return "n/a " if ok is None else ("PASS" if ok else "MISS")

    ooms = sum(r.ooms for r in plugin_runs)
    broken = [f"{r.label} (exit {'hung' if r.hung else r.rc})" for r in plugin_runs if r.hung or r.rc != 0]
    ok = None if not plugin_runs else ooms == 0 and not broken
    print(
        f"  {verdict(ok)}  zero simulated OOMs with pytest-gpu: {ooms} in {len(plugin_runs)} run(s)"
        + (f"; runs that did not complete cleanly: {', '.join(broken)}" if broken else "")
    )
    if best is None:
        print(f"  {verdict(None)}  makespan <= {TARGET_RATIO}x the lower bound: no -n run with pytest-gpu")
        print(f"  {verdict(None)}  faster than the pinning recipe: no -n run with pytest-gpu")
        return
    ok_clean = best.counts.get("failed", 0) == 0 and best.counts.get("error", 0) == 0 and not best.hung and best.rc == 0
    for name, bound in (("LB", bounds.gpu), ("LBw", bounds.with_workers)):
        ratio = best.wall / bound
        print(
            f"  {verdict(ratio <= TARGET_RATIO and ok_clean)}  {best.label}: makespan <= {TARGET_RATIO}x {name}: "
            f"{best.wall:.1f} s / {bound:.1f} s = {ratio:.2f}x"
        )
    if best.span is not None:
        print(
            f"        (its test span alone, without start-up and shutdown: {best.span:.1f} s = "
            f"{best.span / bounds.gpu:.2f}x LB, {best.span / bounds.with_workers:.2f}x LBw)"
        )
    if pin is None:
        print(f"  {verdict(None)}  faster than the pinning recipe: pin not run")
    else:
        faster = best.wall < pin.wall and ok_clean
        print(
            f"  {verdict(faster)}  {best.label} faster than pin: {best.wall:.1f} s vs {pin.wall:.1f} s "
            f"(pin: {pin.ooms} OOMs and {pin.dist_errors} distributed errors; it skipped {pin.undone:.1f} s of "
            "planned test time, as its failures end at once)"
        )
    if not sched:
        print("  (the scheduler is not in the plugin yet: 'sched' ran xdist's scheduling, as 'off' does)")


# -- scenario "fixtures": module-scoped model fixtures ------------------------------------

MODEL_HEAD = '''\
"""Generated by pytest-gpu's bench/makespan.py (fixtures scenario, seed {seed}): {what}."""

import os
import time

import pytest

from pytest_gpu import sim

LOAD_SECONDS = {load:.3f}  # reading the checkpoint
WEIGHTS = {weights}  # bytes the model takes on its GPU


def load_model():
    time.sleep(LOAD_SECONDS)
    weights = sim.allocate(WEIGHTS)  # on the current device, as model.to("cuda")
    where = os.environ.get("{loads_env}")
    if where:  # the bench counts the loads
        with open(os.path.join(where, f"{{os.getpid()}}.txt"), "a") as fh:
            fh.write(__name__ + "\\n")
    return weights
'''

MODEL_FIXTURES = {
    "module": """

@pytest.fixture(scope="module")
def model(gpu_lease_factory):
    gpu_lease_factory(memory="{lease_mib}MiB")  # the weights and the largest test's working memory
    weights = load_model()  # once per module: its tests run on one worker, back to back
    yield weights
    weights.free()
""",
    "test": """

pytestmark = pytest.mark.gpu(memory="{lease_mib}MiB")  # every test leases the model's memory ...


@pytest.fixture
def model(gpu):
    weights = load_model()  # ... and loads the model itself
    yield weights
    weights.free()
""",
    "pin": """

@pytest.fixture(scope="module")
def model():
    weights = load_model()  # on the worker's GPU (the conftest pins worker_id % 4)
    yield weights
    weights.free()
""",
}

MODEL_TEST = """

def test_m{module:02d}_{index:02d}(model):
    sim.hold({work}, {duration:.3f})  # the test's working memory, on the model's GPU
"""

FIXTURE_WHAT = {
    "module": "a module-scoped model fixture leasing with gpu_lease_factory",
    "test": "every test leases and loads the model itself",
    "pin": "a module-scoped model fixture, no plugin, workers pinned to GPU worker_id % 4",
}


@dataclass(frozen=True)
class Model:
    index: int
    load: float  # seconds to load
    weights: int  # bytes on the GPU
    lease: int  # bytes leased: the weights, the largest test's working memory, 256 MiB of slack
    tests: tuple[tuple[float, int], ...]  # (seconds, working bytes) of each test

    @property
    def chain(self) -> float:
        """One load and every test, back to back: the module under a lease per module."""
        return self.load + sum(d for d, _ in self.tests)


def make_models(seed: int, modules: int, per_module: int, quick: bool) -> list[Model]:
    """Seeded modules: load 1-2 s (quick 0.3-0.6 s), weights 3-8 GiB, tests of 0.05-0.5 s
    (quick 0.02-0.2 s, log-uniform) with 0.25-1.5 GiB of working memory each."""
    rng = random.Random(f"{seed}-fixtures")
    load_lo, load_hi = (0.3, 0.6) if quick else (1.0, 2.0)
    lo, hi = (0.02, 0.2) if quick else (0.05, 0.5)
    models: list[Model] = []
    for index in range(modules):
        load_seconds = round(rng.uniform(load_lo, load_hi), 3)
        weights = 256 * round(4 * rng.uniform(3.0, 8.0)) * MIB
        tests = tuple(
            (round(math.exp(rng.uniform(math.log(lo), math.log(hi))), 3), 256 * MIB * rng.randint(1, 6))
            for _ in range(per_module)
        )
        lease = weights + max(w for _, w in tests) + 256 * MIB
        models.append(Model(index, load_seconds, weights, lease, tests))
    return models


def write_fixture_suites(root: Path, models: list[Model], seed: int, modes: list[str]) -> dict[str, Path]:
    """One suite directory per mode, the same tests in each; only the model fixture differs."""
    suites: dict[str, Path] = {}
    for mode in modes:
        suite = suites[mode] = root / f"suite-fixtures-{mode}"
        suite.mkdir()
        (suite / "pytest.ini").write_text("[pytest]\n")
        (suite / "conftest.py").write_text(CONFTEST)
        for model in models:
            body = [
                MODEL_HEAD.format(
                    seed=seed, what=FIXTURE_WHAT[mode], load=model.load, weights=model.weights, loads_env=LOADS_ENV
                ),
                MODEL_FIXTURES[mode].format(lease_mib=model.lease // MIB),
            ]
            body += [
                MODEL_TEST.format(module=model.index, index=i, work=work, duration=duration)
                for i, (duration, work) in enumerate(model.tests)
            ]
            (suite / f"test_model_{model.index:02d}.py").write_text("".join(body))
    return suites


@dataclass(frozen=True)
class Work:
    """What one way of running the fixtures suite must do, and its lower bound."""

    loads: int
    load_seconds: float
    test_seconds: float
    longest: float  # the longest piece that cannot be split: a module's chain, or one test with its load
    gib_seconds: float  # leased GiB x seconds
    workers: int
    gpus: int = GPUS

    @property
    def total(self) -> float:
        return self.load_seconds + self.test_seconds

    @property
    def bound(self) -> float:
        return max(self.longest, self.total / self.workers, self.gib_seconds / (self.gpus * GPU_GIB))


def fixture_work(models: list[Model], per: str, workers: int) -> Work:
    tests = sum(d for m in models for d, _ in m.tests)
    if per == "test":
        return Work(
            loads=sum(len(m.tests) for m in models),
            load_seconds=sum(m.load * len(m.tests) for m in models),
            test_seconds=tests,
            longest=max(m.load + d for m in models for d, _ in m.tests),
            gib_seconds=sum(m.lease / GIB * (m.load + d) for m in models for d, _ in m.tests),
            workers=workers,
        )
    return Work(
        loads=len(models),
        load_seconds=sum(m.load for m in models),
        test_seconds=tests,
        longest=max(m.chain for m in models),
        gib_seconds=sum(m.lease / GIB * m.chain for m in models),
        workers=workers,
    )


def fixture_command(mode: str, root: Path, workers: int, tag: str) -> tuple[list[str], dict[str, str]]:
    if mode in ("module", "test"):
        return ["-n", str(workers), "--gpus", SIM_SPEC, "-p", "no:cacheprovider"], {}
    ledger = root / f"ledger-{tag}"  # plain xdist on a fresh simulated machine
    shutil.rmtree(ledger, ignore_errors=True)
    extra = {"PYTEST_GPU_SIM": SIM_SPEC, "PYTEST_GPU_SIM_LEDGER": str(ledger), PIN_ENV: str(GPUS)}
    return ["-n", str(workers), "-p", "no:gpu", "-p", "no:cacheprovider"], extra


def alternating(arms: Sequence[str], runs: int) -> list[tuple[str, int]]:
    """(arm, run number) in ABBA order: forward on even rounds, backward on odd ones."""
    plan: list[tuple[str, int]] = []
    for number in range(runs):
        plan += [(arm, number + 1) for arm in (arms if number % 2 == 0 else list(reversed(arms)))]
    return plan


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def run_fixtures(args: argparse.Namespace, modes: list[str]) -> None:
    """Module-scoped model fixtures: a lease per module (gpu_lease_factory) against one per test."""
    modules = args.modules if args.modules is not None else (3 if args.quick else 8)
    per_module = args.module_tests if args.module_tests is not None else (4 if args.quick else 10)
    runs = args.runs if args.runs is not None else (1 if args.quick else 2)
    models = make_models(args.seed, modules, per_module, args.quick)
    work = {mode: fixture_work(models, "test" if mode == "test" else "module", args.workers) for mode in modes}
    durations = {f"test_m{m.index:02d}_{i:02d}": d for m in models for i, (d, _) in enumerate(m.tests)}
    loads = {f"test_model_{m.index:02d}": m.load for m in models}
    slowest = max(w.total for w in work.values())
    timeout = args.timeout or max(120.0, 2 * slowest + 120)
    root = Path(tempfile.mkdtemp(prefix="pytest-gpu-makespan-fixtures-"))
    results: list[Result] = []
    try:
        suites = write_fixture_suites(root, models, args.seed, modes)
        print(
            f"pytest-gpu makespan benchmark, fixtures scenario · Python {platform.python_version()} · "
            f"{os.cpu_count()} CPUs · {SIM_SPEC} · seed {args.seed} · -n {args.workers} · {runs} run(s) a mode, "
            "alternating"
        )
        print(
            f"suite: {modules} modules x {per_module} tests; each module's model loads in "
            f"{min(m.load for m in models):.2f}-{max(m.load for m in models):.2f} s (sleep) and takes "
            f"{min(m.weights for m in models) / GIB:.2f}-{max(m.weights for m in models) / GIB:.2f} GiB "
            f"(lease {min(m.lease for m in models) / GIB:.2f}-{max(m.lease for m in models) / GIB:.2f} GiB with the "
            "largest test's working memory); tests hold 0.25-1.5 GiB on the model's GPU for "
            f"{min(durations.values()):.2f}-{max(durations.values()):.2f} s"
        )
        for mode in modes:
            w = work[mode]
            print(
                f"  {mode:6} {FIXTURE_WHAT[mode]}: {w.loads} loads = {w.load_seconds:.1f} s + tests "
                f"{w.test_seconds:.1f} s = {w.total:.1f} s of work; LB = max(longest piece {w.longest:.1f} s, "
                f"work/{args.workers} {w.total / args.workers:.1f} s, leased GiB·s/capacity "
                f"{w.gib_seconds / (GPUS * GPU_GIB):.1f} s) = {w.bound:.1f} s"
                + (" (if every module loaded once per run)" if mode == "pin" else "")
            )
        print(f"timeout {timeout:.0f} s per run; load average before: {load()}")
        env = run_env(root)
        warm_bytecode(root, env, *suites.values())
        for mode, number in alternating(modes, runs):
            label = f"{mode} #{number}" if runs > 1 else mode
            print(f"  running {label} ...", flush=True)
            cmd_args, extra = fixture_command(mode, root, args.workers, f"fixtures-{mode}-{number}")
            result = run_pytest(label, mode, root, suites[mode], cmd_args, extra, env, timeout, durations)
            results.append(result)
        print(f"load average after: {load()} (other load on the machine inflates every figure, start-up most)")
        print()
        report_fixtures(results, work, loads)
        if args.keep:
            print(f"suites and outputs kept in {root}")
        if args.quick:
            print("(quick run: a smoke test; worker start-up dominates such short suites)")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


def violations(result: Result) -> int | None:
    for line in result.plugin_lines:
        if match := re.search(r"· (\d+) violations?\b", line):
            return int(match.group(1))
    return None


def report_fixtures(results: list[Result], work: dict[str, Work], loads: dict[str, float]) -> None:
    head = (
        f"| {'mode':10} | {'wall s':>7} | {'pytest s':>8} | {'passed':>6} | {'failed':>6} | {'errors':>6} "
        f"| {'sim OOMs':>8} | {'loads':>5} | {'load s':>6} | {'x LB':>5} | {'to 1st test s':>13} "
        f"| {'test span s':>11} | {'after s':>7} |"
    )
    print(head)
    print("|" + "|".join("-" * len(cell) for cell in head.split("|")[1:-1]) + "|")
    for r in results:
        wall = f"{r.wall:.1f}" + ("!" if r.hung else "*" if r.internal_error else "")
        load_seconds = sum(loads.get(name, 0.0) for name in r.loads)
        print(
            f"| {r.label:10} | {wall:>7} | {fmt(r.reported, '.1f'):>8} | {r.counts.get('passed', 0):6d} "
            f"| {r.counts.get('failed', 0):6d} | {r.counts.get('error', 0):6d} | {r.ooms:8d} | {len(r.loads):5d} "
            f"| {load_seconds:6.1f} | {r.wall / work[r.mode].bound:5.2f} | {fmt(r.before, '.1f'):>13} "
            f"| {fmt(r.span, '.1f'):>11} | {fmt(r.after, '.1f'):>7} |"
        )
    print(
        "loads: models loaded (once per module per worker under a module-scoped fixture); load s: their seconds; "
        "x LB: wall / the mode's own lower bound; sim OOMs: tests failed or errored by a simulated OOM; "
        "! = hung, killed; * = INTERNALERROR"
    )
    for r in results:
        notes: list[str] = []
        if r.mode != "pin":
            count = violations(r)
            if count is not None:
                notes.append(f"{count} violations (pytest-gpu's summary)")
            else:  # the summary counts tests' own leases; a fixture's violation fails a teardown (an error)
                notes.append("no pytest-gpu summary line: no test had a lease of its own (the fixtures had)")
            if r.problems:
                notes.append(f"{len(r.problems)} failures/errors: " + " | ".join(p[:200] for p in r.problems[:6]))
        if r.internal_error:
            notes.append(f"exit status {r.rc}, pytest INTERNALERROR: {r.internal_error}")
        elif r.hung:
            notes.append(r.problems[-1])
        elif r.rc not in (0, None) and r.mode != "pin":
            notes.append(f"exit status {r.rc}")
        for note in notes:
            print(f"  {r.label}: {note}")
    walls = {mode: median([r.wall for r in results if r.mode == mode and not r.hung]) for mode in work}
    print()
    print("side by side (median wall of each mode's runs):")
    for mode in work:
        runs = [r for r in results if r.mode == mode]
        print(
            f"  {mode:6} {fmt(walls[mode], '.1f'):>6} s · loads {'/'.join(str(len(r.loads)) for r in runs)} · "
            f"sim OOMs {'/'.join(str(r.ooms) for r in runs)} · {FIXTURE_WHAT[mode]}"
        )
    if walls.get("module") and walls.get("test"):
        print(
            f"  a lease per test takes {walls['test'] / walls['module']:.2f}x the wall time of a lease per module "
            f"({walls['test']:.1f} s against {walls['module']:.1f} s)"
        )


# -- scenario "auto": GPU-aware -n auto against xdist's CPU count -------------------------


def run_auto(args: argparse.Namespace) -> None:
    """The mixed suite (without distributed tests) on 8 GPUs: -n auto against -n <CPUs>."""
    tests = args.tests if args.tests is not None else (24 if args.quick else 100)
    lo, hi = (0.02, 0.5) if args.quick else (0.05, 3.0)
    runs = args.runs if args.runs is not None else (1 if args.quick else 2)
    cpus = os.cpu_count() or 1
    # exclusive tests hold what a GPU gives with 8 contexts on it (every worker of -n auto)
    cases = make_suite(args.seed, tests, 0, lo, hi, AUTO_GPUS)
    bounds = Bounds(
        longest=max(c.duration for c in cases),
        total=sum(c.duration for c in cases),
        gpu_seconds=sum(c.gpu_memory_seconds for c in cases),
        workers=cpus,
        gpus=AUTO_GPUS,
    )
    kinds = {k: sum(c.kind == k for c in cases) for k in ("gpu", "multi", "exclusive", "cpu")}
    timeout = args.timeout or max(120.0, 2 * bounds.total + 120)
    durations = {f"test_{c.kind}_{c.index:03d}": c.duration for c in cases}
    arms = {"auto": ["-n", "auto"], "cpus": ["-n", str(cpus)]}
    root = Path(tempfile.mkdtemp(prefix="pytest-gpu-makespan-auto-"))
    results: list[Result] = []
    try:
        write_suite(root, cases, args.seed)
        print(
            f"pytest-gpu makespan benchmark, auto scenario · Python {platform.python_version()} · {cpus} CPUs · "
            f"{AUTO_SPEC} · seed {args.seed} · -n auto (pytest-gpu's choice) against -n {cpus} (xdist's CPU "
            f"count, what -n auto gives without pytest-gpu) · {runs} run(s) each, alternating"
        )
        print(
            f"suite: {len(cases)} tests = {kinds['gpu']} 1-GPU (0.5-12 GiB) + {kinds['multi']} 2-GPU (0.5-8 GiB "
            f"each) + {kinds['exclusive']} exclusive + {kinds['cpu']} CPU-only; durations log-uniform {lo:g}-{hi:g} s; "
            f"sum {bounds.total:.1f} s; GPU bound max(longest, mem·s/capacity) = {bounds.gpu:.1f} s"
        )
        print(f"timeout {timeout:.0f} s per run; load average before: {load()}")
        env = run_env(root)
        warm_bytecode(root, env)
        for arm, number in alternating(list(arms), runs):
            label = f"{arm} #{number}" if runs > 1 else arm
            print(f"  running {label} ...", flush=True)
            cmd_args = [*arms[arm], "--gpus", AUTO_SPEC, "-p", "no:cacheprovider"]
            results.append(run_pytest(label, arm, root, root / "suite", cmd_args, {}, env, timeout, durations))
        print(f"load average after: {load()} (other load on the machine inflates every figure, start-up most)")
        print()
        report_auto(results, bounds, cpus)
        if args.keep:
            print(f"suite and outputs kept in {root}")
        if args.quick:
            print("(quick run: a smoke test; worker start-up dominates such short suites)")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


def report_auto(results: list[Result], bounds: Bounds, cpus: int) -> None:
    head = (
        f"| {'mode':10} | {'-n':>3} | {'wall s':>7} | {'pytest s':>8} | {'passed':>6} | {'failed':>6} "
        f"| {'errors':>6} | {'sim OOMs':>8} | {'LBw s':>5} | {'x LBw':>5} | {'to 1st test s':>13} "
        f"| {'test span s':>11} | {'after s':>7} |"
    )
    print(head)
    print("|" + "|".join("-" * len(cell) for cell in head.split("|")[1:-1]) + "|")
    for r in results:
        workers = r.workers if r.mode == "auto" else cpus
        wall = f"{r.wall:.1f}" + ("!" if r.hung else "*" if r.internal_error else "")
        lbw = None if workers is None else max(bounds.gpu, bounds.total / workers)
        print(
            f"| {r.label:10} | {fmt(workers, 'd'):>3} | {wall:>7} | {fmt(r.reported, '.1f'):>8} "
            f"| {r.counts.get('passed', 0):6d} | {r.counts.get('failed', 0):6d} | {r.counts.get('error', 0):6d} "
            f"| {r.ooms:8d} | {fmt(lbw, '.1f'):>5} | {fmt(None if lbw is None else r.wall / lbw, '.2f'):>5} "
            f"| {fmt(r.before, '.1f'):>13} | {fmt(r.span, '.1f'):>11} | {fmt(r.after, '.1f'):>7} |"
        )
    print(
        "-n: workers (auto: as pytest-gpu's summary says); LBw = max(GPU bound, sum of durations / workers); "
        "! = hung, killed; * = INTERNALERROR"
    )
    for line in dict.fromkeys(line for r in results for line in r.plugin_lines if "-n auto" in line):
        print(f"  {line}")
    for r in results:
        notes: list[str] = []
        count = violations(r)
        if count:
            notes.append(f"{count} violations")
        if r.problems:
            notes.append(f"{len(r.problems)} failures/errors: " + " | ".join(p[:200] for p in r.problems[:6]))
        if r.internal_error:
            notes.append(f"exit status {r.rc}, pytest INTERNALERROR: {r.internal_error}")
        elif r.hung:
            notes.append(r.problems[-1])
        elif r.rc not in (0, None):
            notes.append(f"exit status {r.rc}")
        for note in notes:
            print(f"  {r.label}: {note}")
    walls = {arm: median([r.wall for r in results if r.mode == arm and not r.hung]) for arm in ("auto", "cpus")}
    ooms = {arm: sum(r.ooms for r in results if r.mode == arm) for arm in ("auto", "cpus")}
    print()
    print(
        f"side by side (median wall): -n auto {fmt(walls['auto'], '.1f')} s, -n {cpus} {fmt(walls['cpus'], '.1f')} s"
        + (f" ({walls['cpus'] / walls['auto']:.2f}x)" if walls["auto"] and walls["cpus"] else "")
        + f"; sim OOMs {ooms['auto']} and {ooms['cpus']}"
    )


# -- scenario "shapes": the scheduler against xdist's order, worker-bound and memory-bound ----

SHAPES = ("worker", "memory", "pairing", "packing")
SHAPE_WHAT = {
    "worker": "30 % CPU, 10 % 2-GPU (1-8 GiB each), 4 % exclusive, the rest 1-GPU 1-12 GiB",
    "memory": "30 % CPU, 20 % 2-GPU (8.25-10 GiB each), 4 % exclusive, the rest 1-GPU 8.25-12 GiB",
    "pairing": "30 % CPU, 15 % 2-GPU (3-10 GiB each), 4 % exclusive, the rest 1-GPU 3-12 GiB (which pairs fit matters)",
    "packing": "10 % CPU, 10 % 2-GPU (4-10 GiB each), 4 % exclusive, the rest 1-GPU 4-11 GiB (packing matters)",
}
_SIZES = {
    "worker": ((1.0, 12.0), (1.0, 8.0)),
    "memory": ((8.25, 12.0), (8.25, 10.0)),
    "pairing": ((3.0, 12.0), (3.0, 10.0)),
    "packing": ((4.0, 11.0), (4.0, 10.0)),
}
_MULTI_SHARE = {"worker": 0.10, "memory": 0.20, "pairing": 0.15, "packing": 0.10}
_CPU_SHARE = {"worker": 0.30, "memory": 0.30, "pairing": 0.30, "packing": 0.10}
BIG = GPU_GIB * GIB // 2  # two leases of more than this cannot share a GPU


def make_shape(
    shape: str, seed: int, tests: int, lo: float, hi: float, long: float, workers: int, long_first: bool = False
) -> list[Case]:
    """A seeded suite of ``shape``: durations log-uniform ``lo``-``hi`` s, one 1-GPU test of ``long`` s
    (first in collection order with ``long_first``, where xdist's own order starts it at once too)."""
    if shape in SHAPE_MAKERS:  # shapes with a collection order of their own (blocks at the end of this file)
        return SHAPE_MAKERS[shape](seed, tests, lo, hi, long, workers)
    rng = random.Random(f"{seed}-{shape}")
    exclusive_usable = GPU_GIB * GIB - max(workers, 1) * CONTEXT

    def duration() -> float:
        return round(math.exp(rng.uniform(math.log(lo), math.log(hi))), 3)

    def mib(lo_gib: float, hi_gib: float) -> int:
        return 256 * round(4 * math.exp(rng.uniform(math.log(lo_gib), math.log(hi_gib))))

    single, multi = _SIZES[shape]
    shares = {"cpu": _CPU_SHARE[shape], "multi": _MULTI_SHARE[shape], "exclusive": 0.04}
    kinds: list[str] = []
    for kind, share in shares.items():
        kinds += [kind] * min(round(share * tests), tests - len(kinds))
    kinds += ["gpu"] * (tests - len(kinds))
    rng.shuffle(kinds)
    longest = rng.choice([i for i, k in enumerate(kinds) if k == "gpu"])  # anywhere in collection order
    if long_first:
        kinds[0], kinds[longest] = kinds[longest], kinds[0]
        longest = 0
    cases: list[Case] = []
    for index, kind in enumerate(kinds):
        seconds = long if index == longest else duration()
        if kind == "cpu":
            cases.append(Case(kind, index, seconds))
        elif kind == "exclusive":
            hold = int(exclusive_usable * rng.uniform(0.80, 0.95))
            cases.append(Case(kind, index, seconds, 1, GPU_GIB * GIB, hold))
        else:
            memory = mib(*(multi if kind == "multi" else single)) * MIB
            count = 2 if kind == "multi" else 1
            cases.append(Case(kind, index, seconds, count, memory, int(memory * rng.uniform(0.80, 0.95))))
    return cases


@dataclass(frozen=True)
class ShapeBound:
    """Lower bounds on any schedule's test span (each holds for every mode that leases)."""

    longest: float  # a test runs on one worker, at one stretch
    per_worker: float  # sum of durations / workers: a worker runs one test at a time
    memory: float  # leased GiB-seconds / GPU capacity: the broker never promises a GPU more than it has
    big: float  # GPU-seconds of leases over half a GPU (exclusive ones too) / GPUs: two never share a GPU

    @classmethod
    def of(cls, cases: list[Case], workers: int) -> ShapeBound:
        return cls(
            longest=max(c.duration for c in cases),
            per_worker=sum(c.duration for c in cases) / workers,
            memory=sum(c.gpu_memory_seconds for c in cases) / (GPUS * GPU_GIB),
            big=sum(c.count * c.duration for c in cases if c.memory > BIG) / GPUS,
        )

    @property
    def value(self) -> float:
        return max(self.longest, self.per_worker, self.memory, self.big)

    @property
    def which(self) -> str:
        named = {"longest": self.longest, "work/W": self.per_worker, "mem": self.memory, "big/G": self.big}
        return max(named, key=lambda k: named[k])


def idle_figures(result: Result) -> dict[str, float]:
    """From the per-test spans: idle between a worker's tests, and at its head and tail."""
    runs = [r for r in result.per_worker if r]
    if not runs:
        return {}
    begin = min(r[0][0] for r in runs)
    end = max(r[-1][1] for r in runs)
    gaps = [b[0] - a[1] for r in runs for a, b in itertools.pairwise(r)]
    return {
        "gap_ms": 1000 * statistics.mean(gaps) if gaps else 0.0,  # between two tests of one worker
        "gap_p90_ms": 1000 * sorted(gaps)[int(0.9 * (len(gaps) - 1))] if gaps else 0.0,
        "between_s": sum(gaps) / len(runs),  # per worker
        "head_s": sum(r[0][0] - begin for r in runs) / len(runs),
        "tail_s": sum(end - r[-1][1] for r in runs) / len(runs),
    }


def starts(result: Result, names: list[str]) -> list[float]:
    """When each of ``names`` started, seconds after the first test of the run."""
    tests = {name: start for r in result.per_worker for start, _, name in r}
    if not tests:
        return []
    begin = min(tests.values())
    return [tests[n] - begin for n in names if n in tests]


def run_shapes(args: argparse.Namespace) -> None:
    """Worker-bound and memory-bound suites, several seeds: the scheduler against --gpu-schedule=off."""
    shapes = [x.strip() for x in args.shapes.split(",") if x.strip()]
    if unknown := set(shapes) - set(SHAPES):
        raise SystemExit(f"--shapes: unknown {', '.join(sorted(unknown))}; choose from {', '.join(SHAPES)}")
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else ([1] if args.quick else [1, 2, 3])
    tests = args.tests if args.tests is not None else (48 if args.quick else 160)
    lo, hi, long = (0.02, 0.5, 1.0) if args.quick else (0.05, 3.0, 6.0)
    runs = args.runs if args.runs is not None else (1 if args.quick else 2)
    print(
        f"pytest-gpu makespan benchmark, shapes scenario · Python {platform.python_version()} · {os.cpu_count()} CPUs "
        f"· {SIM_SPEC} · -n {args.workers} · seeds {','.join(map(str, seeds))} · per seed: a history run "
        f"(the scheduler, recording durations), then {runs} run(s) of each mode, alternating (ABBA)"
    )
    print(
        f"{tests} tests a suite, durations log-uniform {lo:g}-{hi:g} s and one 1-GPU test of {long:g} s"
        f"{' (first in collection order)' if args.long_first else ''}; "
        f"GPU tests hold 80-95 % of their request. Bound = max(longest; sum/W; leased GiB·s / "
        f"{GPUS * GPU_GIB} GiB; GPU-s of leases > {BIG // GIB} GiB / {GPUS}) on the test span"
    )
    print(f"load average before: {load()}")
    rows: list[tuple[str, int, ShapeBound, list[Result]]] = []
    for shape in shapes:
        for seed in seeds:
            cases = make_shape(shape, seed, tests, lo, hi, long, args.workers, args.long_first)
            bound = ShapeBound.of(cases, args.workers)
            if shape in SHAPE_MAKERS:  # how close xdist's own order comes, ignoring GPUs
                xdist = xdist_load_span([c.duration for c in cases], args.workers)
                ratio = xdist / bound.value
                print(f"  {shape} seed {seed}: xdist's order, simulated: {xdist:.1f} s, {ratio:.3f}x bound")
            durations = {f"test_{c.kind}_{c.index:03d}": c.duration for c in cases}
            longest = sorted(durations, key=lambda n: -durations[n])[:3]
            root = Path(tempfile.mkdtemp(prefix=f"pytest-gpu-makespan-{shape}-{seed}-"))
            results: list[Result] = []
            try:
                write_suite(root, cases, seed)
                env = run_env(root)
                warm_bytecode(root, env)
                timeout = args.timeout or max(120.0, 2 * sum(durations.values()) + 120)
                plan = [("history", "sched", 0)] + [(m, m, n) for m, n in alternating(["sched", "off"], runs)]
                for label, mode, number in plan:
                    tag = f"{shape}-{seed}-{label}-{number}"
                    cmd = ["-n", str(args.workers), "--gpus", SIM_SPEC, f"--gpu-trace={root / f'trace-{tag}.json'}"]
                    cmd += ["-o", f"cache_dir={root / 'cache'}"]  # the history run's durations, for the scheduler
                    if mode == "off":
                        cmd.append("--gpu-schedule=off")
                    print(f"  {shape} seed {seed}: {label} {number or ''} (load {load()}) ...", flush=True)
                    result = run_pytest(tag, mode, root, root / "suite", cmd, {}, env, timeout, durations)
                    result.label = label
                    result.summary = f"load {os.getloadavg()[0]:.2f}"
                    result.problems = result.problems or []
                    results.append(result)
                    report_shape_run(result, bound, longest)
            finally:
                if not args.keep:
                    shutil.rmtree(root, ignore_errors=True)
                else:
                    print(f"  kept {root}")
            rows.append((shape, seed, bound, results))
    print(f"load average after: {load()}")
    report_shapes(rows)
    report_breakdown(rows)


def report_shape_run(r: Result, bound: ShapeBound, longest: list[str]) -> None:
    idle = idle_figures(r)
    latency = sorted(s for s, _ in r.decisions)
    lat = "decide -"
    if latency:
        p50, p99 = latency[len(latency) // 2], latency[int(0.99 * (len(latency) - 1))]
        lat = f"decide p50 {1000 * p50:.2f} ms p99 {1000 * p99:.2f} ms ({len(latency)} calls)"
    problems = f" · {len(r.problems)} failed/errors: {r.problems[0][:120]}" if r.problems else ""
    print(
        f"    {r.label:7} wall {r.wall:5.1f} s · to 1st test {fmt(r.before)} s · after last {fmt(r.after)} s · span "
        f"{fmt(r.span, '.1f')} s ({fmt(r.span and r.span / bound.value)}x bound {bound.value:.1f}) · gap "
        f"{idle.get('gap_ms', 0):.0f} ms mean / {idle.get('gap_p90_ms', 0):.0f} p90"
        f" · idle between {idle.get('between_s', 0):.2f} s, tail {idle.get('tail_s', 0):.2f} s per worker · "
        f"GPU waits {fmt(r.gpu_wait, '.1f')} s · longest starts at "
        f"{'/'.join(f'{x:.1f}' for x in starts(r, longest))} s · {lat} · OOMs {r.ooms} · {r.summary}{problems}"
        f"{startup_line(r)}"
    )


def report_shapes(rows: list[tuple[str, int, ShapeBound, list[Result]]]) -> None:
    print()
    print(
        "| shape | seed | bound s (by) | sched wall s | off wall s | sched span s | off span s "
        "| sched span x bound | off span x bound | sched/off wall | sched/off span | OOMs | load |"
    )
    print("| --- | ---: | --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    ratios: dict[str, list[float]] = {}
    for shape, seed, bound, results in rows:
        sched = [r for r in results if r.label == "sched"]
        off = [r for r in results if r.label == "off"]

        def walls(rs: list[Result]) -> str:
            return " / ".join(f"{r.wall:.1f}" for r in rs)

        def spans(rs: list[Result]) -> str:
            return " / ".join(fmt(r.span, ".1f") for r in rs)

        def med(rs: list[Result], what: str) -> float | None:
            values = [getattr(r, what) for r in rs if getattr(r, what) is not None and not r.hung]
            return median(values)

        sw, ow, ss, os_ = med(sched, "wall"), med(off, "wall"), med(sched, "span"), med(off, "span")
        wall_ratio = sw / ow if sw and ow else None
        span_ratio = ss / os_ if ss and os_ else None
        if span_ratio is not None:
            ratios.setdefault(shape, []).append(span_ratio)
        loads = " / ".join(r.summary.removeprefix("load ") for r in results if r.label != "history")
        print(
            f"| {shape} | {seed} | {bound.value:.1f} ({bound.which}) | {walls(sched)} | {walls(off)} | {spans(sched)} "
            f"| {spans(off)} | {fmt(ss and ss / bound.value)} | {fmt(os_ and os_ / bound.value)} "
            f"| {fmt(wall_ratio)} | {fmt(span_ratio)} | {sum(r.ooms for r in results)} | {loads} |"
        )
    print()
    for shape, values in ratios.items():
        listed = " ".join(f"{v:.2f}" for v in values)
        print(f"{shape}: sched/off test span over seeds {listed}, median {fmt(median(values))}")


# -- shape "ordered": a suite whose collection order xdist already runs near the bound --------


def xdist_load_span(durations: Sequence[float], workers: int) -> float:
    """The span xdist's ``--dist load`` gives tests of ``durations`` in this collection order on
    ``workers`` workers, if every test ran alone and no hand-out took time (its ``schedule`` and
    ``check_schedule``, as in xdist 3.8: an initial chunk of a quarter of each worker's share,
    then refills to half of what is left per worker when a worker drops below an eighth)."""
    pending = list(range(len(durations)))
    queues: list[list[int]] = [[] for _ in range(workers)]
    chunk = max(min(len(durations) // workers // 4, len(durations)), 2)
    if len(pending) < 2 * workers:
        for k in range(len(pending)):
            queues[k % workers].append(pending.pop(0))
    else:
        for queue in queues:
            queue += pending[:chunk]
            del pending[:chunk]
    clock = [0.0] * workers
    ends: list[tuple[float, int]] = []
    for w, queue in enumerate(queues):  # xdist starts a worker's test once it holds the next (or shuts down)
        if queue:
            heapq.heappush(ends, (durations[queue[0]], w))
    span = 0.0
    while ends:
        at, w = heapq.heappop(ends)
        span = max(span, at)
        clock[w] = at
        done = queues[w].pop(0)
        last = durations[done]
        if pending:
            low = max(2, len(pending) // workers // 4)
            high = max(2, len(pending) // workers // 2)
            if len(queues[w]) < low and not (last >= 0.1 and len(queues[w]) >= 2):
                take = high - len(queues[w])
                queues[w] += pending[:take]
                del pending[:take]
        if queues[w]:
            heapq.heappush(ends, (at + durations[queues[w][0]], w))
    return span


def make_ordered(seed: int, tests: int, lo: float, hi: float, long: float, workers: int) -> list[Case]:
    """The ``worker`` mix without whole-GPU tests (30 % CPU, 10 % 2-GPU of 1-8 GiB, the rest 1-GPU
    of 1-12 GiB; no 6 s test: ``long`` is unused), durations log-uniform ``lo``-``hi`` s, in a
    collection order xdist's load scheduling already runs close to the bound: longest first,
    then seeded swaps of two tests kept where they do not lengthen xdist's span as
    :func:`xdist_load_span` simulates it (the worst of eight variants with 0-40 ms more a
    test), until it is within 1 % of the workers' bound."""
    del long
    rng = random.Random(f"{seed}-ordered")

    def duration() -> float:
        return round(math.exp(rng.uniform(math.log(lo), math.log(hi))), 3)

    def mib(lo_gib: float, hi_gib: float) -> int:
        return 256 * round(4 * math.exp(rng.uniform(math.log(lo_gib), math.log(hi_gib))))

    kinds = ["cpu"] * round(0.30 * tests) + ["multi"] * round(0.10 * tests)
    kinds += ["gpu"] * (tests - len(kinds))
    rng.shuffle(kinds)
    drawn: list[tuple[str, float, int, int, int]] = []
    for kind in kinds:
        seconds = duration()
        if kind == "cpu":
            drawn.append((kind, seconds, 0, 0, 0))
        else:
            memory = mib(*((1.0, 8.0) if kind == "multi" else (1.0, 12.0))) * MIB
            drawn.append((kind, seconds, 2 if kind == "multi" else 1, memory, int(memory * rng.uniform(0.80, 0.95))))
    drawn.sort(key=lambda d: -d[1])
    # then swaps that do not lengthen xdist's simulated span, seeded: an order tuned for xdist.
    # Scored on a few variants where each test takes 0-40 ms more (a lease, the hand-out), so
    # the order does not hang on exact ties that a real run breaks otherwise.
    noise = [[rng.uniform(0.0, 0.04) for _ in range(tests)] for _ in range(8)]

    def score() -> float:
        return max(xdist_load_span([d[1] + extra[k] for k, d in enumerate(drawn)], workers) for extra in noise)

    span = score()
    bound = max(drawn[0][1], sum(d[1] + 0.02 for d in drawn) / workers)
    for _ in range(3000):
        if span <= 1.01 * bound:
            break
        a, b = rng.randrange(tests), rng.randrange(tests)
        drawn[a], drawn[b] = drawn[b], drawn[a]
        tried = score()
        if tried <= span:
            span = tried
        else:
            drawn[a], drawn[b] = drawn[b], drawn[a]
    ordered = drawn
    return [
        Case(kind, index, seconds, count, memory, hold)
        for index, (kind, seconds, count, memory, hold) in enumerate(ordered)
    ]


def startup_figures(r: Result) -> dict[str, float]:
    """Start-up apart: launch to the last worker's collection (catalog sent), then to the first test."""
    runs = [x for x in r.per_worker if x]
    if not r.collected or not runs or r.launched is None:
        return {}
    first = min(x[0][0] for x in runs)
    return {"collect_s": max(r.collected) - r.launched, "handout_s": first - max(r.collected)}


def startup_line(r: Result) -> str:
    f = startup_figures(r)
    if not f:
        return ""
    return f" · collected at {f['collect_s']:.2f} s, 1st test {1000 * f['handout_s']:.0f} ms after"


def report_breakdown(rows: list[tuple[str, int, ShapeBound, list[Result]]]) -> None:
    """Where each mode's wall time goes, medians over its runs (see bench/README.md, "scheduler tax")."""
    print()
    print(
        "| shape | seed | mode | wall s | to last collected s | collected to 1st test ms | gap ms mean / p90 "
        "| idle between s/worker | tail s/worker | span x bound | after last s | GPU waits s |"
    )
    print("| --- | ---: | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for shape, seed, bound, results in rows:
        for mode in ("sched", "off"):
            rs = [r for r in results if r.label == mode and not r.hung]
            if not rs:
                continue
            idle = [idle_figures(r) for r in rs]
            up = [startup_figures(r) for r in rs]

            def m(values: list[float | None]) -> float | None:
                return median([v for v in values if v is not None])

            gap, p90 = m([i.get("gap_ms") for i in idle]), m([i.get("gap_p90_ms") for i in idle])
            gaps = f"{fmt(gap, '.1f')} / {fmt(p90, '.1f')}"

            print(
                f"| {shape} | {seed} | {mode} | {fmt(m([r.wall for r in rs]), '.1f')} "
                f"| {fmt(m([u.get('collect_s') for u in up]))} | {fmt(m([u.get('handout_s') for u in up]), '.3f')} "
                f"| {gaps} "
                f"| {fmt(m([i.get('between_s') for i in idle]))} | {fmt(m([i.get('tail_s') for i in idle]))} "
                f"| {fmt(m([r.span / bound.value if r.span else None for r in rs]), '.3f')} "
                f"| {fmt(m([r.after for r in rs]))} | {fmt(m([r.gpu_wait for r in rs]), '.1f')} |"
            )


SHAPE_MAKERS = {"ordered": make_ordered}
SHAPES = (*SHAPES, "ordered")
SHAPE_WHAT["ordered"] = (
    "30 % CPU, 10 % 2-GPU (1-8 GiB each), the rest 1-GPU 1-12 GiB, in an order xdist already runs near the bound"
)


# -- scenario "dynamo": packing by measured memory on one big GPU (ai-dynamo, PR 9236) --------

DYNAMO_GPU_GIB = 80
DYNAMO_SPEC = f"sim:1x{DYNAMO_GPU_GIB}GiB"
DYNAMO_TESTS = 54  # 1-30 s log-uniform: about 454 s in all, ai-dynamo's serial run
DYNAMO_TEMPLATE = """

@pytest.mark.gpu
def test_gpu_{index:03d}():
    sim.hold({hold}, {duration:.3f})
"""


def make_dynamo(seed: int, tests: int, scale: float) -> list[Case]:
    """``tests`` 1-GPU tests whose marker names no memory, each holding 2-20 GiB (log-uniform)
    for 1-30 s (log-uniform) times ``scale``; ``Case.memory`` is what ``--gpu-learn`` asks for
    them once their peaks are recorded (1.25 x the peak)."""
    rng = random.Random(f"{seed}-dynamo")
    cases = []
    for index in range(tests):
        seconds = round(scale * math.exp(rng.uniform(0.0, math.log(30.0))), 3)
        hold = 256 * round(4 * math.exp(rng.uniform(math.log(2.0), math.log(20.0)))) * MIB
        cases.append(Case("gpu", index, seconds, 1, int(1.25 * hold), hold))
    return cases


def run_dynamo(args: argparse.Namespace) -> None:
    """One 80 GiB GPU, tests sized by their measured peaks: a serial run (which records the peaks
    and durations, as ai-dynamo measured them), then the scheduler and ``--gpu-schedule=off``
    under ``-n`` with ``--gpu-learn``, alternating; speedup over serial beside span / bound."""
    seed = args.seed
    scale = args.scale if args.scale is not None else (0.02 if args.quick else 0.1)
    tests = args.tests if args.tests is not None else (24 if args.quick else DYNAMO_TESTS)
    runs = args.runs if args.runs is not None else (1 if args.quick else 2)
    if scale <= 0:
        raise SystemExit(f"--scale: expected a positive factor on the durations, got {scale}")
    cases = make_dynamo(seed, tests, scale)
    workers = args.workers
    total = sum(c.duration for c in cases)
    capacity = DYNAMO_GPU_GIB * GIB - workers * CONTEXT  # every worker's CUDA context takes its share
    bound = max(max(c.duration for c in cases), total / workers, sum(c.duration * c.memory for c in cases) / capacity)
    which = "longest" if bound == max(c.duration for c in cases) else ("work/W" if bound == total / workers else "mem")
    print(
        f"pytest-gpu makespan benchmark, dynamo scenario · Python {platform.python_version()} · {os.cpu_count()} CPUs "
        f"· {DYNAMO_SPEC} · -n {workers} · seed {seed} · {tests} tests holding "
        f"{min(c.hold for c in cases) / GIB:.2f}-{max(c.hold for c in cases) / GIB:.2f} GiB for 1-30 s x {scale:g} "
        f"({total:.1f} s in all; {total / scale:.0f} s unscaled)"
    )
    print(
        "serial: --gpus sim:1x80GiB --gpu-learn, one process (records each test's peak and duration); then "
        f"-n {workers} --gpu-learn (requests 1.25 x the peak) with the scheduler (sched) and --gpu-schedule=off "
        f"(off), {runs} run(s) each, alternating (ABBA). Bound = max(longest; sum/W; requested GiB·s / "
        f"({DYNAMO_GPU_GIB} GiB - {workers} contexts)) = {bound:.2f} s ({which})"
    )
    print(f"load average before: {load()}")
    durations = {f"test_gpu_{c.index:03d}": c.duration for c in cases}
    root = Path(tempfile.mkdtemp(prefix=f"pytest-gpu-makespan-dynamo-{seed}-"))
    results: list[Result] = []
    try:
        suite = root / "suite"
        suite.mkdir()
        (suite / "pytest.ini").write_text("[pytest]\n")
        (suite / "conftest.py").write_text(CONFTEST)
        for start in range(0, len(cases), TESTS_PER_MODULE):
            body = [MODULE_HEAD.format(seed=seed)]
            body += [
                DYNAMO_TEMPLATE.format(index=c.index, hold=c.hold, duration=c.duration)
                for c in cases[start:][:TESTS_PER_MODULE]
            ]
            (suite / f"test_dynamo_{start // TESTS_PER_MODULE:02d}.py").write_text("".join(body))
        env = run_env(root)
        warm_bytecode(root, env)
        timeout = args.timeout or max(120.0, 3 * total + 120)
        plan = [("serial", 0), *alternating(["sched", "off"], runs)]
        for mode, number in plan:
            tag = f"dynamo-{seed}-{mode}-{number}"
            cmd = ["--gpus", DYNAMO_SPEC, "--gpu-learn", "-o", f"cache_dir={root / 'cache'}"]
            cmd += [f"--gpu-trace={root / f'trace-{tag}.json'}"]
            if mode != "serial":
                cmd += ["-n", str(workers)] + (["--gpu-schedule=off"] if mode == "off" else [])
            print(f"  {mode} {number or ''} (load {load()}) ...", flush=True)
            result = run_pytest(tag, mode, root, suite, cmd, {}, env, timeout, durations)
            result.label = mode
            result.summary = f"load {os.getloadavg()[0]:.2f}"
            results.append(result)
            print(
                f"    {mode:6} wall {result.wall:5.1f} s · span {fmt(result.span, '.1f')} s "
                f"({fmt(result.span and result.span / bound)}x bound) · GPU waits {fmt(result.gpu_wait, '.1f')} s · "
                f"OOMs {result.ooms} · {result.counts} · {result.summary}"
                + (f" · {result.problems[0][:120]}" if result.problems else "")
            )
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"  kept {root}")
    print(f"load average after: {load()}")
    serial = results[0]
    print()
    print(
        "| mode | wall s | span s | speedup over serial (wall) | speedup over serial (span) | span x bound "
        "| GPU waits s | OOMs | load |"
    )
    print("| --- | --- | --- | ---: | ---: | ---: | --- | ---: | --- |")
    for mode in ("serial", "sched", "off"):
        rs = [r for r in results if r.label == mode and not r.hung]
        wall = median([r.wall for r in rs])
        span = median([r.span for r in rs if r.span is not None])
        print(
            f"| {mode} | {' / '.join(f'{r.wall:.1f}' for r in rs)} | {' / '.join(fmt(r.span, '.1f') for r in rs)} "
            f"| {fmt(wall and serial.wall / wall)} | {fmt(span and serial.span and serial.span / span)} "
            f"| {fmt(span and span / bound)} | {' / '.join(fmt(r.gpu_wait, '.1f') for r in rs)} "
            f"| {sum(r.ooms for r in rs)} | {' / '.join(r.summary.removeprefix('load ') for r in rs)} |"
        )


# -- scenario "spread": spread compute against the rule before, GPUs that share their compute ---

SPREAD_GPUS = 4
SPREAD_SPEC = f"sim:{SPREAD_GPUS}x{GPU_GIB}GiB;slowdown=share"
# what each arm sets: PYTEST_GPU_PLACEMENT (machine/domain.placement_spreads), read at the run's start
SPREAD_ARMS = {"spread": "spread", "affinity": "affinity"}


def make_spread_suite(seed: int, tests: int, lo: float, hi: float) -> list[Case]:
    """GPU tests only, 1-4 GiB (memory never binds: 4 on a GPU fit), durations log-uniform lo-hi."""
    rng = random.Random(f"{seed}-spread")
    cases = []
    for index in range(tests):
        memory = 256 * rng.randint(4, 16) * 2**20
        duration = round(math.exp(rng.uniform(math.log(lo), math.log(hi))), 3)
        cases.append(Case("gpu", index, duration, 1, memory, int(memory * 0.9)))
    return cases


def stretch(result: Result, durations: dict[str, float]) -> float | None:
    """How much longer the tests took than alone: sum of measured spans / sum of their durations."""
    measured = planned = 0.0
    for runs in result.per_worker:
        for start, end, name in runs:
            if name in durations:
                measured += end - start
                planned += durations[name]
    return measured / planned if planned else None


def run_spread(args: argparse.Namespace) -> None:
    """Spread (idle GPUs first) against affinity (a worker's context GPUs first) with the slowdown on."""
    tests = args.tests if args.tests is not None else (16 if args.quick else 60)
    lo, hi = (0.05, 0.3) if args.quick else (0.1, 1.5)
    runs = args.runs if args.runs is not None else (1 if args.quick else 2)
    workers = SPREAD_GPUS
    cases = make_spread_suite(args.seed, tests, lo, hi)
    total = sum(c.duration for c in cases)
    longest = max(c.duration for c in cases)
    bound = max(longest, total / min(workers, SPREAD_GPUS))  # a GPU computes one test at full speed at a time
    durations = {f"test_gpu_{c.index:03d}": c.duration for c in cases}
    timeout = args.timeout or max(120.0, 4 * total + 60)
    root = Path(tempfile.mkdtemp(prefix="pytest-gpu-makespan-spread-"))
    results: list[Result] = []
    try:
        write_suite(root, cases, args.seed)
        print(
            f"pytest-gpu makespan benchmark, spread scenario · Python {platform.python_version()} · "
            f"{os.cpu_count()} CPUs · {SPREAD_SPEC} · -n {workers} · seed {args.seed} · spread (idle GPUs first) "
            f"against affinity (PYTEST_GPU_PLACEMENT=affinity: a worker's context GPUs first) · {runs} run(s) "
            "each, alternating"
        )
        print(
            f"suite: {tests} GPU tests of 1-4 GiB, sim.hold for a duration log-uniform {lo:g}-{hi:g} s (compute "
            f"shared by who computes on a GPU at once); sum {total:.1f} s; bound max(longest, sum / GPUs) = "
            f"{bound:.1f} s"
        )
        print(f"timeout {timeout:.0f} s per run; load average before: {load()}")
        env = run_env(root)
        warm_bytecode(root, env)
        for arm, number in alternating(list(SPREAD_ARMS), runs):
            label = f"{arm} #{number}" if runs > 1 else arm
            print(f"  running {label} ...", flush=True)
            cmd_args = ["-n", str(workers), "--gpus", SPREAD_SPEC, "-p", "no:cacheprovider"]
            extra = {"PYTEST_GPU_PLACEMENT": SPREAD_ARMS[arm]}
            result = run_pytest(label, arm, root, root / "suite", cmd_args, extra, env, timeout, durations)
            result.summary += f" · load {load()}"
            results.append(result)
        print(f"load average after: {load()}")
        print()
        report_spread(results, bound, durations)
        if args.keep:
            print(f"suite and outputs kept in {root}")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


def report_spread(results: list[Result], bound: float, durations: dict[str, float]) -> None:
    print("| arm | wall s | test span s | span x bound | tests x alone | passed | sim OOMs | GPU busy | load |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    for r in results:
        busy = next((m.group(1) for line in r.plugin_lines if (m := re.search(r"GPU busy ([\d:% ]+)", line))), "-")
        print(
            f"| {r.label} | {r.wall:.1f}{'!' if r.hung else ''} | {fmt(r.span, '.1f')} "
            f"| {fmt(r.span and r.span / bound)} | {fmt(stretch(r, durations))} | {r.counts.get('passed', 0)} "
            f"| {r.ooms} | {busy.strip()} | {r.summary.rpartition('load ')[2]} |"
        )
        for problem in r.problems[:4]:
            print(f"  {r.label}: {problem[:200]}")
    print("tests x alone: the GPU tests' time over their durations (1.00: no test shared a GPU's compute)")
    spans = {arm: median([r.span for r in results if r.mode == arm and r.span is not None]) for arm in SPREAD_ARMS}
    walls = {arm: median([r.wall for r in results if r.mode == arm and not r.hung]) for arm in SPREAD_ARMS}
    a, b = spans["affinity"], spans["spread"]
    print()
    print(
        f"side by side (medians): test span spread {fmt(b, '.1f')} s, affinity {fmt(a, '.1f')} s"
        + (f" ({a / b:.2f}x)" if a and b else "")
        + f"; wall spread {fmt(walls['spread'], '.1f')} s, affinity {fmt(walls['affinity'], '.1f')} s"
    )


if __name__ == "__main__":
    sys.exit(main())
