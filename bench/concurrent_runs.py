"""Concurrent runs on one machine against one run of all their tests together.

Two (``--runs``) ``pytest -n 4`` runs, each of 16 memory-heavy tests (6 GiB each, held
``--hold`` seconds), start together on one simulated ``sim:2x16GiB`` machine (one
``PYTEST_GPU_SIM_MACHINE``); against them, one ``pytest -n 8`` run of all their tests.
Alternating (ABBA), ``--reps`` times each. Reports the makespan (first start to last
end, wall clock, process start-up included), the ratio concurrent / combined, and the
simulated out-of-memory errors (target: none, and a ratio within 1.15).

    python bench/concurrent_runs.py            # 2 runs, 3 repetitions a side
    python bench/concurrent_runs.py --runs 4 --reps 2
    python bench/concurrent_runs.py --quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

TEST = """
import os, time, pytest
import pytest_gpu.sim as sim

@pytest.mark.gpu(memory="6GiB")
@pytest.mark.parametrize("i", range({tests}))
def test_heavy_{name}(gpu, i):
    block = sim.allocate(6 * 2**30, gpu.device)
    time.sleep({hold})
    block.free()
"""

ARGS = ["-p", "no:cacheprovider", "-p", "no:randomly", "-q", "--gpus", "sim:2x16GiB"]


def write_suite(root: Path, runs: int, tests: int, hold: float) -> list[Path]:
    files = []
    for i in range(runs):
        path = root / f"test_run{i}.py"
        path.write_text(TEST.format(tests=tests, name=i, hold=hold))
        files.append(path)
    return files


def launch(root: Path, machine: str, workers: int, files: list[Path]) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTEST_GPU_SIM_MACHINE": machine, "PYTEST_GPU_MACHINE_DIR": str(root / "machines")}
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", *ARGS, "-n", str(workers), *map(str, files)],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def measure(root: Path, files: list[Path], concurrent: bool) -> tuple[float, int, int]:
    """(makespan s, tests passed, OOM errors) of one arm."""
    machine = uuid.uuid4().hex[:8]
    start = time.monotonic()
    if concurrent:
        procs = [launch(root, machine, 4, [f]) for f in files]
    else:
        procs = [launch(root, machine, 4 * len(files), files)]
    outputs = [p.communicate()[0] for p in procs]
    makespan = time.monotonic() - start
    passed = sum(int(line.split()[0]) for out in outputs for line in out.splitlines() if " passed" in line[:20])
    ooms = sum(out.count("OutOfMemoryError") for out in outputs)
    for proc, out in zip(procs, outputs, strict=True):
        if proc.returncode != 0:
            print(out[-3000:], file=sys.stderr)
    return makespan, passed, ooms


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2, help="concurrent runs (default 2)")
    parser.add_argument("--tests", type=int, default=16, help="tests per run (default 16)")
    parser.add_argument("--hold", type=float, default=0.5, help="seconds each test holds its 6 GiB (default 0.5)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions a side, alternating (default 3)")
    parser.add_argument("--quick", action="store_true", help="1 repetition, 8 tests, 0.2 s")
    args = parser.parse_args()
    if args.quick:
        args.reps, args.tests, args.hold = 1, 8, 0.2
    print(
        f"{args.runs} concurrent `pytest -n 4` runs x {args.tests} tests (6 GiB, {args.hold:g} s) on sim:2x16GiB "
        f"vs one `pytest -n {4 * args.runs}` run of all {args.runs * args.tests}; {os.cpu_count()} CPUs"
    )
    times: dict[str, list[float]] = {"concurrent": [], "combined": []}
    ooms = 0
    short: list[str] = []  # runs that did not pass every test: their time measures something else
    with tempfile.TemporaryDirectory(prefix="pytest-gpu-bench-runs-") as tmp:
        root = Path(tmp)
        files = write_suite(root, args.runs, args.tests, args.hold)
        order = ["concurrent", "combined", "combined", "concurrent"] * args.reps
        for arm in order[: 2 * args.reps]:
            makespan, passed, oom = measure(root, files, arm == "concurrent")
            ooms += oom
            times[arm].append(makespan)
            print(f"  {arm:10s} {makespan:6.2f} s  {passed} passed  {oom} OOM", file=sys.stderr, flush=True)
            if passed != args.runs * args.tests:
                short.append(f"{arm}: {passed} of {args.runs * args.tests} passed")
    med = {arm: statistics.median(values) for arm, values in times.items()}
    print("\n| arm | runs | min s | median s | max s |\n| --- | ---: | ---: | ---: | ---: |")
    for arm, values in times.items():
        print(f"| {arm} | {len(values)} | {min(values):.2f} | {med[arm]:.2f} | {max(values):.2f} |")
    ratio = med["concurrent"] / med["combined"]
    print(f"\nconcurrent / combined (medians): {ratio:.2f} (target <= 1.15); simulated OOM errors: {ooms} (target 0)")
    if short:
        print(f"not a measurement: {'; '.join(short)} (their output is above)", file=sys.stderr)
    return 0 if ooms == 0 and not short else 1


if __name__ == "__main__":
    sys.exit(main())
