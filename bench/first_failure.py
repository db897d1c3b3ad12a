"""Benchmark the time to the first failure under ``-x``: the GPU scheduler against ``--gpu-schedule=off``.

Generates a seeded suite into a temporary directory — ``--tests`` tests (default 60) in
modules of 15, a third of them GPU tests on ``sim:4x16GiB`` (``sim.hold`` of 1-6 GiB),
durations log-uniform over 0.05-1.5 s, and ``--failing`` of them (default 3, at seeded
places) that fail at the end of their duration when ``FIRST_FAILURE_FAIL=1`` — records
durations with a first full run, then times ``pytest -x -n 4 --gpus sim:4x16GiB`` with
the scheduler (``sched``) and with ``--gpu-schedule=off`` (``off``), alternating (ABBA),
each timed run on a fresh copy of the recorded cache. Two scenarios:

* ``rerun``: the recording run failed too, so ``cache/lastfailed`` names the failing
  tests (the edit-and-rerun loop: what the scheduler runs first under ``-x``);
* ``new``: the recording run passed (no ``lastfailed``); the failures are new, so only
  the order of the rest matters (the scheduler: shortest first under ``-x``; off:
  collection order).

For each run: the seconds from launching pytest to the first failed report at the
controller (``first``), the wall time of the pytest process (``wall``), and how many tests
reported (``run``). Prints each run and the medians, and whether the scheduler is no
slower than ``off`` to the first failure (the target).

Run from the repository root::

    python bench/first_failure.py               # 60 tests, 3 failing, 3 runs a side per scenario (~3 minutes)
    python bench/first_failure.py --quick       # smoke run: 20 short tests, 1 run a side
    python bench/first_failure.py --runs 5 --seed 7 --scenarios new
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

SIM_SPEC = "sim:4x16GiB"
PER_MODULE = 15
FAIL_ENV = "FIRST_FAILURE_FAIL"
RECORD_ENV = "FIRST_FAILURE_RECORD"
QUIET_PLUGINS = ("-p", "no:benchmark", "-p", "no:hypothesispytest", "-p", "no:depends")
MODES = {"sched": (), "off": ("--gpu-schedule=off",)}

# At the controller (or a serial run): when the first failure was reported, and what reported.
CONFTEST = f"""
import json
import os
import time

_seen = set()
_first = []
_start = []


def pytest_runtest_logreport(report):
    if "PYTEST_XDIST_WORKER" in os.environ:
        return
    _seen.add(report.nodeid)
    _start[:] = [min([*_start, report.start])]
    if report.failed and not _first:
        _first.append(time.time())


def pytest_sessionfinish(session):
    if "PYTEST_XDIST_WORKER" in os.environ or not os.environ.get("{RECORD_ENV}"):
        return
    with open(os.environ["{RECORD_ENV}"], "w") as fh:
        json.dump({{"first": _first[0] if _first else None, "start": min(_start, default=None), "run": len(_seen)}}, fh)
"""


@dataclass
class Case:
    name: str
    duration: float
    gib: int | None
    fails: bool


@dataclass
class Result:
    scenario: str
    mode: str
    first: float | None
    after_start: float | None
    wall: float
    run: int
    rc: int


def make_cases(tests: int, failing: int, seed: int, low: float, high: float) -> list[Case]:
    rng = random.Random(seed)
    bad = set(rng.sample(range(tests), failing))
    cases = []
    for i in range(tests):
        duration = round(low * (high / low) ** rng.random(), 3)
        gib = rng.randint(1, 6) if rng.random() < 1 / 3 else None
        cases.append(Case(f"test_{i:03d}", duration, gib, i in bad))
    return cases


def write_suite(root: Path, cases: Sequence[Case]) -> None:
    root.mkdir(parents=True)
    (root / "conftest.py").write_text(CONFTEST)
    for start in range(0, len(cases), PER_MODULE):
        lines = ["import os", "import time", "", "import pytest", "from pytest_gpu import sim", ""]
        lines.append(f'FAIL = os.environ.get("{FAIL_ENV}") == "1"')
        for case in cases[start : start + PER_MODULE]:
            lines += ["", ""]
            if case.gib is not None:
                lines.append(f'@pytest.mark.gpu(memory="{case.gib}GiB")')
            lines.append(f"def {case.name}():")
            if case.gib is not None:
                lines.append(f'    sim.hold("{case.gib * 0.9:.1f}GiB", {case.duration})')
            else:
                lines.append(f"    time.sleep({case.duration})")
            if case.fails:
                lines.append(f'    assert not FAIL, "{case.name} fails"')
        (root / f"test_m{start // PER_MODULE}.py").write_text("\n".join(lines) + "\n")


def run_env() -> dict[str, str]:
    drop = ("PYTEST_GPU", "PYTEST_ADDOPTS", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", FAIL_ENV, RECORD_ENV)
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # workers would recompile the plugin every run
    return env


def pytest_run(
    suite: Path, cache: Path, args: Sequence[str], env: dict[str, str], fail: bool, timeout: float
) -> tuple[float, float | None, float | None, int, int]:
    """Wall seconds, seconds to the first failed report (from launch; from the first test's start), tests, status."""
    record = suite.parent / "record.json"
    record.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", str(suite), "-q", "-o", f"cache_dir={cache}", *QUIET_PLUGINS, *args]
    extra = {FAIL_ENV: "1" if fail else "0", RECORD_ENV: str(record)}
    launched = time.time()
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=suite, env={**env, **extra}, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - started
    data = json.loads(record.read_text()) if record.exists() else {"first": None, "run": 0}
    first = data["first"] - launched if data["first"] is not None else None
    after = data["first"] - data["start"] if data["first"] is not None and data.get("start") else None
    if proc.returncode not in (0, 1, 2) or not data["run"]:  # 2: xdist's "stopping after 1 failures"
        # pytest itself failed (usage error, internal error, a broken install: exit 1 with no test
        # run): no figure to take
        raise SystemExit(
            f"first_failure: pytest {' '.join(args)} ended with exit status {proc.returncode} and "
            f"{data['run']} tests run, not a test outcome:\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return wall, first, after, int(data["run"]), proc.returncode


def median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if len(known) == len(values) and known else None


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=1, help="seed of the generated suite (default 1)")
    parser.add_argument("--tests", type=int, default=60, help="tests in the suite (default 60)")
    parser.add_argument("--failing", type=int, default=3, help="of which fail (default 3)")
    parser.add_argument("--workers", type=int, default=4, help="xdist workers, -n (default 4)")
    parser.add_argument("--runs", type=int, default=3, help="timed runs per mode and scenario (default 3)")
    parser.add_argument("--scenarios", default="rerun,new", help="comma-separated subset of rerun,new")
    parser.add_argument("--quick", action="store_true", help="smoke run: 20 tests of 0.02-0.3 s, 1 run a side")
    parser.add_argument("--keep", action="store_true", help="keep the generated suite and caches")
    opts = parser.parse_args(argv)
    tests, runs, low, high = opts.tests, opts.runs, 0.05, 1.5
    if opts.quick:
        tests, runs, low, high = 20, 1, 0.02, 0.3
    scenarios = [s for s in opts.scenarios.split(",") if s]
    if not set(scenarios) <= {"rerun", "new"}:
        parser.error(f"--scenarios: rerun and/or new, not {opts.scenarios}")
    cases = make_cases(tests, opts.failing, opts.seed, low, high)
    base = Path(tempfile.mkdtemp(prefix="pytest-gpu-first-failure-"))
    suite = base / "suite"
    write_suite(suite, cases)
    env = run_env()
    timeout = 120 + 4 * sum(c.duration for c in cases)
    common = ("-n", str(opts.workers), "--gpus", SIM_SPEC)
    positions = [i for i, c in enumerate(cases) if c.fails]
    print(f"python {platform.python_version()}, {os.cpu_count()} CPUs, suite of {tests} tests (seed {opts.seed}),")
    print(f"failing (collection index: duration): {', '.join(f'{i}: {cases[i].duration}s' for i in positions)};")
    print(f"sum of durations {sum(c.duration for c in cases):.1f}s, pytest -x {' '.join(common)}\n")
    results: list[Result] = []
    try:
        for scenario in scenarios:
            recorded = base / f"cache-{scenario}"
            wall, _, _, ran, rc = pytest_run(suite, recorded, common, env, scenario == "rerun", timeout)
            print(f"[{scenario}] recording run: {wall:.2f}s, {ran} tests, exit {rc}")
            order = [m for k in range(runs) for m in (("sched", "off") if k % 2 == 0 else ("off", "sched"))]
            for mode in order:
                cache = base / "cache-run"
                shutil.rmtree(cache, ignore_errors=True)
                shutil.copytree(recorded, cache)
                args = (*common, "-x", *MODES[mode])
                wall, first, after, ran, rc = pytest_run(suite, cache, args, env, True, timeout)
                results.append(Result(scenario, mode, first, after, wall, ran, rc))
                print(
                    f"[{scenario}] {mode:5s} first failure {fmt(first)}s (after the first test's start "
                    f"{fmt(after)}s)  wall {wall:.2f}s  tests run {ran}"
                )
    finally:
        if opts.keep:
            print(f"\nkept in {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    print("\n| scenario | mode | first failure s | from first test start s | wall s | tests run |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    verdicts = []
    for scenario in scenarios:
        firsts = {}
        for mode in MODES:
            mine = [r for r in results if r.scenario == scenario and r.mode == mode]
            firsts[mode] = median([r.first for r in mine])
            runs_median = statistics.median(r.run for r in mine)
            print(
                f"| {scenario} | {mode} | {fmt(firsts[mode])} | {fmt(median([r.after_start for r in mine]))} "
                f"| {fmt(median([r.wall for r in mine]))} | {runs_median:g} |"
            )
        ok = firsts["sched"] is not None and firsts["off"] is not None and firsts["sched"] <= firsts["off"]
        verdicts.append(ok)
        print(f"| {scenario} | target: sched no slower to the first failure | {'PASS' if ok else 'MISS'} | | | |")
    print("(medians over the runs of each mode)")
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
