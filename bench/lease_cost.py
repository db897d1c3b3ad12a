"""Benchmark what one GPU lease costs a test: the same tiny tests with and without a ``gpu`` marker.

Generates N tests that each allocate and free 256 MiB of simulated GPU memory
(``pytest_gpu.sim``), once with ``@pytest.mark.gpu(memory="1GiB")`` (acquire from the
broker, pin CUDA, confine, verify through the ledger, release) and once without a marker
(the allocation lands on GPU 0, nothing else), and runs both under ``pytest -n 2 --gpus
sim:4x16GiB``, alternating (ABBA). Prints each wall time, the medians, and the cost of
one lease in worker milliseconds: (median with - median without) x workers / N.

Run from the repository root::

    python bench/lease_cost.py            # 200 tests, 5 runs a side
    python bench/lease_cost.py --quick    # 40 tests, 1 run a side
"""

from __future__ import annotations

import argparse
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


def run(directory: Path) -> float:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:benchmark"]
    command += ["-p", "no:randomly", "-n", str(WORKERS), "--gpus", "sim:4x16GiB", str(directory)]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{directory.name} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=int, default=200)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="40 tests, 1 run a side")
    args = parser.parse_args()
    tests, runs = (40, 1) if args.quick else (args.tests, args.runs)
    with tempfile.TemporaryDirectory() as tmp:
        leased, plain = Path(tmp, "leased"), Path(tmp, "plain")
        for directory, mark in ((leased, '@pytest.mark.gpu(memory="1GiB")'), (plain, "")):
            directory.mkdir()
            (directory / "test_tiny.py").write_text(TEST.format(n=tests, mark=mark))
        times: dict[str, list[float]] = {"leased": [], "plain": []}
        for i in range(runs):  # ABBA: a drift in machine load hits both alike
            order = [("leased", leased), ("plain", plain)]
            for name, directory in order if i % 2 == 0 else order[::-1]:
                times[name].append(run(directory))
                print(f"run {i + 1}: {name:6s} {times[name][-1]:6.2f} s", flush=True)
    with_lease, without = statistics.median(times["leased"]), statistics.median(times["plain"])
    per_test = (with_lease - without) * WORKERS / tests * 1000
    print(f"{tests} tests, -n {WORKERS}, median of {runs}: with a lease {with_lease:.2f} s, without {without:.2f} s")
    print(f"one lease costs about {per_test:.1f} ms of worker time per test")


if __name__ == "__main__":
    main()
