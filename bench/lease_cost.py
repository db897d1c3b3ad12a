"""Benchmark what one GPU lease costs a test: the same tiny tests with and without a ``gpu`` marker.

Generates N tests that each allocate and free 256 MiB of simulated GPU memory
(``pytest_gpu.sim``), once with ``@pytest.mark.gpu(memory="1GiB")`` (acquire from the
broker, pin CUDA, confine, verify through the ledger, release) and once without a marker
(the allocation lands on GPU 0, nothing else), and runs both under ``pytest -n 2 --gpus
sim:4x16GiB``, alternating (ABBA). Prints each wall time, the medians, and the cost of
one lease in worker milliseconds: (median with - median without) x workers / N.

With ``--baseline-src DIR`` (the ``src`` folder of another checkout, e.g. a
``git worktree`` of an older commit) the same two suites also run on that code, in the
same rotation, and the lease costs of both are printed side by side.

Run from the repository root::

    python bench/lease_cost.py            # 200 tests, 5 runs a side
    python bench/lease_cost.py --quick    # 40 tests, 1 run a side
    git worktree add /tmp/old b49dd27 && python bench/lease_cost.py --baseline-src /tmp/old/src
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKERS = 2
TEST = """
import pytest
from pytest_gpu import sim

@pytest.mark.parametrize("n", range({n}))
{mark}
def test_tiny(n):
    with sim.allocate("256MiB"):
        pass
"""


def run(directory: Path, src: str | None) -> float:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:benchmark"]
    command += ["-p", "no:randomly", "-n", str(WORKERS), "--gpus", "sim:4x16GiB", str(directory)]
    env = dict(os.environ, PYTHONPATH=src) if src else None  # PYTHONPATH comes before the installed package
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{directory.name} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=int, default=200)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="40 tests, 1 run a side")
    parser.add_argument("--baseline-src", help="the src folder of another checkout, measured in the same rotation")
    args = parser.parse_args()
    tests, runs = (40, 1) if args.quick else (args.tests, args.runs)
    codes: list[tuple[str, str | None]] = [("this", None)]
    if args.baseline_src:
        codes.append(("baseline", str(Path(args.baseline_src).resolve())))
    with tempfile.TemporaryDirectory() as tmp:
        leased, plain = Path(tmp, "leased"), Path(tmp, "plain")
        for directory, mark in ((leased, '@pytest.mark.gpu(memory="1GiB")'), (plain, "")):
            directory.mkdir()
            (directory / "test_tiny.py").write_text(TEST.format(n=tests, mark=mark))
        arms = [(code, src, name, d) for code, src in codes for name, d in (("leased", leased), ("plain", plain))]
        times: dict[tuple[str, str], list[float]] = {(code, name): [] for code, _, name, _ in arms}
        for i in range(runs):  # ABBA: a drift in machine load hits every arm alike
            for code, src, name, directory in arms if i % 2 == 0 else arms[::-1]:
                times[code, name].append(run(directory, src))
                print(f"run {i + 1}: {code:8s} {name:6s} {times[code, name][-1]:6.2f} s", flush=True)
    for code, _ in codes:
        with_lease, without = statistics.median(times[code, "leased"]), statistics.median(times[code, "plain"])
        per_test = (with_lease - without) * WORKERS / tests * 1000
        print(
            f"{code}: {tests} tests, -n {WORKERS}, median of {runs}: with a lease {with_lease:.2f} s, "
            f"without {without:.2f} s; one lease costs about {per_test:.1f} ms of worker time per test"
        )


if __name__ == "__main__":
    main()
