"""Benchmark warm rank pools: fresh ranks per test vs one warm pool, same suite, same run.

A suite of N two-rank gloo tests (each does a small ``all_reduce``) is written to a
temporary directory and run twice by ``python -m pytest``:

- ``--dist-pool=off``: every test starts its own ranks (import torch, rendezvous,
  process group) and stops them: the reference behaviour, like one torchrun per test;
- ``--dist-pool=on --dist-pool-ahead=0``: one pool, started when the first test asks for it,
  and reused (the behaviour before pools were started ahead);
- ``--dist-pool=on`` (the defaults): the same, but the pool is started ahead, in the
  background, as soon as the run knows a test of it comes next (at the end of collection
  when it is the first test; while the test before it runs otherwise).

``--lead SECONDS`` puts one CPU test of that length before the distributed ones (in every
run): a suite that runs other tests first, behind which a pool started ahead can start.

It prints the wall times (the whole pytest command, start-up included), their ratios, the
distributed tests' own time (junit's, setup to teardown: without pytest's start-up, which is
the same in every run, and without the lead), and the per-test overhead in the warm pool:
``dist_overhead_seconds`` from the junitxml, i.e. the time of the plugin's call beyond the slowest rank's test body
(sending the body and fixture values, waiting for every rank, hygiene, the result
coming back), p50 and p99 over the tests after the first (the first one starts the pool).

Run from the repository root (torch must be installed)::

    python bench/pool.py            # 40 tests
    python bench/pool.py --quick    # 6 tests, a smoke run
    python bench/pool.py --tests 100
    python bench/pool.py --tests 20 --lead 3   # a 3 s CPU test first: the pool starts behind it
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

TARGET_RATIO = 20.0
TARGET_OVERHEAD_P50_MS = 30.0
INNER_ARGS = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "no:benchmark", "-q")

LEAD = """

def test_a_lead_cpu_test():
    import time

    time.sleep({lead})
"""

SUITE = """
import pytest


@pytest.mark.distributed(world_size=2, backend="gloo")
@pytest.mark.parametrize("n", range({tests}))
def test_allreduce(rank, n):
    import torch
    import torch.distributed as dist

    t = torch.full((16,), float(rank.rank + n))
    dist.all_reduce(t)
    assert t[0].item() == 2 * n + 1
"""


@dataclass
class Run:
    mode: str
    wall: float
    ret: int
    output: str
    overhead: list[float]  # seconds, in test order
    body: list[float]
    pools: list[str]  # "fresh" / "warm", in test order
    ahead: str = ""  # the summary's line on pools started ahead ("": none was)
    own: float = 0.0  # seconds the distributed tests took themselves (junit: setup, call, teardown)


def run_suite(directory: Path, mode: str, tests: int, timeout: float, ahead: bool = True) -> Run:
    junit = directory / f"junit-{mode}-{ahead}.xml"
    cmd = [sys.executable, "-m", "pytest", *INNER_ARGS, f"--dist-pool={mode}", f"--junitxml={junit}"]
    if not ahead:
        cmd.append("--dist-pool-ahead=0")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_GPU_", "PYTEST_XDIST_"))}
    env.pop("PYTEST_ADDOPTS", None)
    started = time.perf_counter()
    out = subprocess.run(
        cmd, cwd=directory, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
    )
    wall = time.perf_counter() - started
    overhead, body, pools = [], [], []
    own = 0.0
    if junit.exists():
        for case in ET.parse(junit).iter("testcase"):
            props = {p.get("name"): p.get("value") for p in case.iter("property")}
            if "dist_overhead_seconds" in props:
                own += float(case.get("time") or 0)
                overhead.append(float(props["dist_overhead_seconds"] or 0))
                body.append(float(props["dist_body_seconds"] or 0))
                pools.append(str(props["dist_pool"]))
    said = [line for line in out.stdout.splitlines() if "rank pools:" in line]
    run = Run(mode, wall, out.returncode, out.stdout, overhead, body, pools, said[0] if said else "", own)
    if run.ret != 0 or len(run.overhead) != tests:  # the lead test is no distributed one
        got = f"exit {run.ret}, {len(run.overhead)} of {tests} tests reported"
        sys.exit(f"the --dist-pool={mode} run failed ({got}):\n{out.stdout}")
    return run


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    index = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[index]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", type=int, default=40, help="tests in the suite (default 40)")
    parser.add_argument("--quick", action="store_true", help="6 tests: a smoke run")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds each pytest run may take")
    parser.add_argument("--lead", type=float, default=0.0, help="seconds of a CPU test before the distributed ones")
    args = parser.parse_args(argv)
    tests = 6 if args.quick else args.tests
    if tests < 2:
        parser.error("--tests must be at least 2 (the first test of the warm run starts the pool)")
    try:
        import torch
    except ImportError:
        print("bench/pool.py needs torch (pip install torch==2.13.0)", file=sys.stderr)
        return 2

    lead = f" after a {args.lead:g} s CPU test" if args.lead > 0 else ""
    print(
        f"{tests} two-rank gloo tests (all_reduce of 16 floats){lead} · python {platform.python_version()} · "
        f"torch {torch.__version__} · {os.cpu_count()} CPUs · load {os.getloadavg()[0]:.2f}"
    )
    with tempfile.TemporaryDirectory(prefix="pytest-gpu-bench-pool-") as tmp:
        directory = Path(tmp)
        (directory / "pytest.ini").write_text("[pytest]\n")
        lead_test = LEAD.format(lead=args.lead) if args.lead > 0 else ""
        (directory / "test_pool_bench.py").write_text(lead_test + SUITE.format(tests=tests))
        fresh = run_suite(directory, "off", tests, args.timeout)
        late = run_suite(directory, "on", tests, args.timeout, ahead=False)
        warm = run_suite(directory, "on", tests, args.timeout)

    assert all(p == "fresh" for p in fresh.pools), fresh.pools
    for run in (late, warm):
        assert run.pools[0] == "fresh" and all(p == "warm" for p in run.pools[1:]), run.pools
    ratio = fresh.wall / warm.wall
    steady = [s * 1000 for s in warm.overhead[1:]]
    p50, p99 = percentile(steady, 50), percentile(steady, 99)
    fresh_per_test = statistics.median(fresh.overhead)
    body_p50 = percentile([b * 1000 for b in warm.body[1:]], 50)

    print(f"fresh ranks per test (--dist-pool=off): {fresh.wall:8.2f} s   ({fresh_per_test:.2f} s/test overhead, p50)")
    print(
        f"warm pool, started by its first test (--dist-pool-ahead=0): {late.wall:8.2f} s   "
        f"({fresh.wall / late.wall:5.1f} x; first test, starting the pool: {late.overhead[0]:.2f} s)"
    )
    print(
        f"warm pool, started ahead (defaults):                   {warm.wall:8.2f} s   ({ratio:5.1f} x; "
        f"first test, waiting for the pool: {warm.overhead[0]:.2f} s)"
    )
    print(f"  its summary: {warm.ahead.removeprefix('pytest-gpu: ') or 'no pool started ahead'}")
    print(
        f"ratio (end to end, started ahead):      {ratio:8.1f} x   target >= {TARGET_RATIO:g} x: "
        f"{'met' if ratio >= TARGET_RATIO else 'NOT met'}"
    )
    # what the pools change, without pytest's own start (the same in every run) and the lead
    print(
        f"the {tests} distributed tests' own time (junit): fresh {fresh.own:.2f} s · started by its first "
        f"test {late.own:.2f} s ({fresh.own / late.own:.1f} x) · started ahead {warm.own:.2f} s "
        f"({fresh.own / warm.own:.1f} x)"
    )
    print(
        f"warm per-test overhead, {len(steady)} tests:      p50 {p50:6.2f} ms   p99 {p99:6.2f} ms   "
        f"(body p50 {body_p50:.2f} ms)   target p50 <= {TARGET_OVERHEAD_P50_MS:g} ms: "
        f"{'met' if p50 <= TARGET_OVERHEAD_P50_MS else 'NOT met'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
