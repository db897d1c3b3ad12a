"""Benchmark the test suite itself: the same test targets at this checkout and at a baseline
revision, run in turn (A B A B ...) so drift of the machine hits both alike.

    python bench/suite.py --baseline beca009                 # the tests the restructuring sped up
    python bench/suite.py --baseline beca009 --runs 1 tests  # the whole suite once each (~30 min)

The baseline is checked out into a temporary git worktree and run with ``PYTHONPATH`` at its
``src``, so its inner pytest runs, xdist workers and ranks import its own package. Before
every run both trees lose their ``src`` bytecode: each run starts as a fresh clone does
(with ``PYTHONDONTWRITEBYTECODE`` set, as in CI's image, nothing else would write it).
A target missing at either revision is an error, so both arms always run the same tests; a
test file is found by its name wherever the revision keeps it (issue 29 moved the suite's
files from ``tests/`` into a folder per subsystem).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the tests whose time issue 13 went after: bytecode, a waiter never queued, fixed waits
DEFAULT_TARGETS = (
    "tests/e2e/test_crash_safety.py::test_sigkill_of_worker_holding_two_gpus",
    "tests/e2e/test_plugin_xdist.py::test_32_workers_on_4_gpus",
    "tests/launched/test_launched.py::test_killed_rank_is_reported_by_rank_0",
    "tests/distributed/test_distributed.py::test_main_run_outcomes",
)
MPI_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def drop_bytecode(src: Path) -> None:
    for cache in src.rglob("__pycache__"):
        shutil.rmtree(cache, ignore_errors=True)


def locate(tree: Path, target: str) -> str:
    """``target`` as ``tree`` spells it: a test file's path there, found by the file's name (unique
    in the suite) where ``tree`` keeps it in another folder; as given if missing there (pytest
    then says so)."""
    path, sep, rest = target.partition("::")
    if not path.endswith(".py") or (tree / path).exists():
        return target
    found = sorted((tree / "tests").rglob(Path(path).name))
    if len(found) != 1:
        return target
    return found[0].relative_to(tree).as_posix() + sep + rest


def run_once(tree: Path, targets: Sequence[str], timeout: float) -> tuple[float, str]:
    """Wall seconds of one ``pytest`` over ``targets`` in ``tree``, and its last line."""
    targets = [locate(tree, target) for target in targets]
    drop_bytecode(tree / "src")
    env = dict(os.environ, PYTHONPATH=str(tree / "src"), OMPI_MCA_rmaps_base_oversubscribe="1")
    if os.geteuid() == 0:
        env.update(MPI_ROOT)
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *targets],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    wall = time.monotonic() - start
    last = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    if proc.returncode != 0 or not re.search(r"\d+ passed", last):
        raise SystemExit(f"{tree}: pytest {' '.join(targets)} did not pass: {last}\n{proc.stdout[-3000:]}")
    return wall, last


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("targets", nargs="*", help=f"test targets (default: {', '.join(DEFAULT_TARGETS)})")
    parser.add_argument("--baseline", required=True, help="the revision to compare with (e.g. beca009)")
    parser.add_argument("--runs", type=int, default=3, help="runs of each arm (default 3)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds one run may take")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    targets = args.targets or list(DEFAULT_TARGETS)
    with tempfile.TemporaryDirectory(prefix="pytest-gpu-bench-suite-") as tmp:
        base = Path(tmp) / "baseline"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(base), args.baseline], cwd=ROOT, check=True)
        try:
            print(f"targets: {' '.join(targets)}")
            print(f"A: this checkout ({ROOT}), B: {args.baseline}; {args.runs} run(s) each, alternating")
            walls: dict[str, list[float]] = {"A": [], "B": []}
            for number in range(1, args.runs + 1):
                for arm, tree in (("A", ROOT), ("B", base)):
                    wall, last = run_once(tree, targets, args.timeout)
                    walls[arm].append(wall)
                    print(f"  {arm} #{number}: {wall:7.1f} s  {last}", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, check=False)
    a, b = statistics.median(walls["A"]), statistics.median(walls["B"])
    print(f"median wall: A {a:.1f} s, B {b:.1f} s, A/B {a / b:.2f}")
    ratios = [x / y for x, y in zip(walls["A"], walls["B"], strict=True)]
    print(f"A/B pair by pair: min {min(ratios):.2f}, median {statistics.median(ratios):.2f}, max {max(ratios):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
