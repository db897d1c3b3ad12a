"""Benchmark the residue check a rank runs after each test (pytest_gpu.distributed.residue).

In one process set up as a gloo rank (torch imported, a one-rank process group, NumPy
imported where installed), it times side by side, per test:

- ``reset``: what a rank did after each test before the check existed, its reseed and
  ``_clean`` (environment and working directory put back, new sub-groups destroyed,
  ``gc.collect()``);
- ``check``: the residue check (``Rank._residue``): torch's defaults against the snapshot,
  the environment, the working directory, the process groups, the seed functions and
  global generators (identities);
- ``check, dirty``: the same after a "test" that changed the default dtype and set a
  variable (and put them back, so every round finds them anew).

Each figure is the median of ``--repeat`` rounds of ``--rounds`` tests (microseconds per
test). Run from the repository root (torch must be installed)::

    python bench/residue.py
    python bench/residue.py --rounds 2000 --repeat 5
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from pytest_gpu.distributed import rankmain, residue


def per_test(fn: Callable[[], Any], rounds: int, repeat: int) -> float:
    """Median microseconds per call of ``fn`` over ``repeat`` rounds of ``rounds`` calls."""
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        for _ in range(rounds):
            fn()
        times.append((time.perf_counter() - started) / rounds * 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    try:
        import numpy  # noqa: F401  (reseeded and checked where imported, as in a rank)
    except ImportError:
        pass
    store = Path(tempfile.mkdtemp()) / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)

    rank = rankmain.Rank.__new__(rankmain.Rank)  # a rank's methods without its connection to a pool
    rank.backend = "gloo"
    rank.residue = residue.Tracker()
    rank.residue.begin()
    body = {"nodeid": "bench.py::test", "seed": 12345}
    env, cwd = dict(os.environ), os.getcwd()
    groups, world = rankmain._groups(), rankmain._world()
    modules = len(sys.modules)
    gc.freeze()  # as a rank does after setting up: long-lived objects out of the collections' sight

    def reset() -> None:
        rankmain._reseed(body["seed"])
        rank._clean(env, cwd, groups, modules)

    def check() -> None:
        rank._residue(body, env, False, groups, world)

    def dirty() -> None:
        torch.set_default_dtype(torch.float64)
        os.environ["BENCH_LEFT"] = "1"
        found = rank._residue(body, env, False, groups, world)
        assert found.lines, "the check found nothing"
        torch.set_default_dtype(torch.float32)
        del os.environ["BENCH_LEFT"]
        rank._residue(body, env, False, groups, world)  # put back: found anew next round

    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} CPUs, load {load}")
    print(f"{args.repeat} rounds of {args.rounds} tests, median per test:")
    figures = {
        "reset (reseed + _clean, before)": per_test(reset, args.rounds, args.repeat),
        "check (Rank._residue)": per_test(check, args.rounds, args.repeat),
        "check, dirty (2 checks a round)": per_test(dirty, args.rounds, args.repeat) / 2,
    }
    for name, micros in figures.items():
        print(f"  {name:<36} {micros:8.1f} us")
    print(f"  check / reset: {figures['check (Rank._residue)'] / figures['reset (reseed + _clean, before)']:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
