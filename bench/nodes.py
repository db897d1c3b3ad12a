"""One run over 4 nodes: dynamic placement (``--gpu-nodes``) against static ``--shard`` shares.

Generates a seeded suite into a temporary directory: ``--tests`` GPU tests (default 80) of
4-12 GiB on one GPU, whose bodies sleep their *true* duration (log-uniform over 0.3-4 s,
``--quick``: 0.1-0.6 s) and record when they started and ended. The recorded history
(pytest's cache, ``pytest_gpu/durations``) is wrong for a third of the tests: half of
those are new (no duration: both modes guess the median), half changed since (recorded at
x0.3-x3 of their true duration). The cache is put back before every run, so both arms
see the same history.

Four simulated nodes, each ``--gpus sim:2x16GiB`` with 2 xdist workers:

* ``dynamic``: one ``pytest -n 2 --gpu-nodes=local:4`` (each node its own machine
  directory, temp directory and network namespace; the scheduler places each test on a
  worker as one frees up, longest first by the history);
* ``static``: four ``pytest -n 2 --shard`` processes, ranks of one launch (torchrun's
  variables, one rank per node: ``LOCAL_WORLD_SIZE=1``), each with its own machine
  directory and temp directory as a simulated node has (``nodes.spec.sim_node_env``),
  started together; each runs the share ``--shard`` cut from the history, rank 0 merges.

Alternating (ABBA), ``--runs`` a side, in the same invocation. For each run: the makespan
(first test start to last test end, from the bodies' own records: the same clock for both
arms), the wall time of the command (start-up and teardown included), and tests run.
The lower bound: max(the longest test, the sum of true durations / 8 workers); GPU memory
never binds (two tests of at most 12 GiB always fit one node's two 16 GiB GPUs).
Target (issue 22, item 7): dynamic <= 1.15x the bound and faster than the static shares.

    python bench/nodes.py              # 80 tests, 2 runs a side (~4 minutes on 2 cores)
    python bench/nodes.py --quick      # smoke run: 24 short tests, 1 run a side
    python bench/nodes.py --runs 3 --seed 7
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NODES, PER_NODE, GPUS = 4, 2, "sim:2x16GiB"
OUT_ENV = "BENCH_NODES_OUT"
QUIET_PLUGINS = ("-p", "no:benchmark", "-p", "no:hypothesispytest", "-p", "no:depends", "-p", "no:randomly")
COMMON = ("-q", "-p", "no:rerunfailures", *QUIET_PLUGINS, "--gpus", GPUS, "-n", str(PER_NODE))

TEST = """
import json, os, time
import pytest

@pytest.mark.gpu(memory="{memory}GiB")
def test_{index:03d}():
    start = time.time()
    time.sleep({seconds!r})
    with open(os.path.join(os.environ["{out}"], "{index:03d}.json"), "w") as f:
        json.dump({{"start": start, "end": time.time(), "node": os.environ.get("PYTEST_GPU_NODE")}}, f)
"""


@dataclass(frozen=True)
class Case:
    index: int
    seconds: float  # how long it really runs
    memory: int  # GiB on one GPU
    recorded: float | None  # what the history says (None: a new test)


def make_suite(seed: int, tests: int, low: float, high: float) -> list[Case]:
    """The seeded suite: a third mispredicted (half new, half off by x0.3-x3)."""
    rng = random.Random(seed)
    cases = []
    wrong = set(rng.sample(range(tests), tests // 3))
    new = set(sorted(wrong)[::2])
    for i in range(tests):
        seconds = round(math.exp(rng.uniform(math.log(low), math.log(high))), 3)
        memory = rng.choice((4, 6, 8, 12))
        if i in new:
            recorded = None
        elif i in wrong:
            factor = rng.choice((rng.uniform(0.3, 0.7), rng.uniform(1.5, 3.0)))
            recorded = round(seconds * factor, 3)
        else:
            recorded = seconds
        cases.append(Case(i, seconds, memory, recorded))
    return cases


def write_suite(root: Path, cases: list[Case]) -> dict[str, float]:
    """The test modules (8 tests a module) and the history to restore before each run."""
    history = {}
    for start in range(0, len(cases), 8):
        chunk = cases[start : start + 8]
        module = f"test_m{start // 8:02d}.py"
        source = "".join(TEST.format(memory=c.memory, index=c.index, seconds=c.seconds, out=OUT_ENV) for c in chunk)
        (root / module).write_text(source)
        history.update({f"{module}::test_{c.index:03d}": c.recorded for c in chunk if c.recorded is not None})
    (root / "pytest.ini").write_text("[pytest]\n")
    return history


def restore_cache(root: Path, history: dict[str, float]) -> None:
    cache = root / ".pytest_cache"
    shutil.rmtree(cache, ignore_errors=True)
    target = cache / "v" / "pytest_gpu" / "durations"
    target.parent.mkdir(parents=True)
    target.write_text(json.dumps(history))


def run_env(root: Path) -> dict[str, str]:
    drop = ("PYTEST_GPU", "PYTEST_ADDOPTS", "CUDA_VISIBLE_DEVICES", "TORCHELASTIC", "SLURM_", "OMPI_", "PMI")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # workers would recompile the plugin every run
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), *filter(None, [env.get("PYTHONPATH")])])
    env[OUT_ENV] = str(root / "out")
    return env


def dynamic(root: Path, env: dict[str, str], timeout: float) -> list[subprocess.Popen[str]]:
    cmd = [sys.executable, "-m", "pytest", *COMMON, f"--gpu-nodes=local:{NODES}"]
    return [subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]


def static(root: Path, env: dict[str, str], timeout: float) -> list[subprocess.Popen[str]]:
    """Four ranks of one launch, each on a simulated node of its own (as ``nodes.spec`` makes them)."""
    sys.path.insert(0, str(REPO / "src"))
    from pytest_gpu.nodes.spec import sim_node_env

    nodes = Path(tempfile.mkdtemp(prefix="pgb-"))  # short: the nodes' arbiter sockets live below it
    launch = uuid.uuid4().hex[:12]
    procs = []
    for rank in range(NODES):
        node = sim_node_env(str(nodes), f"node{rank}")
        for key in ("PYTEST_GPU_MACHINE_DIR", "TMPDIR"):
            Path(node[key]).mkdir(parents=True, exist_ok=True)
        node.pop("PYTEST_GPU_NODE")  # not a --gpu-nodes node: a rank of its own pytest
        launcher = {
            "TORCHELASTIC_RUN_ID": launch,
            "RANK": str(rank),
            "WORLD_SIZE": str(NODES),
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
        }
        cmd = [sys.executable, "-m", "pytest", *COMMON, "--shard"]
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=root,
                env={**env, **node, **launcher},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    procs[0].nodes_root = nodes  # type: ignore[attr-defined]
    return procs


def measure(arm: str, root: Path, history: dict[str, float], timeout: float) -> tuple[float, float, int]:
    """(makespan s, wall s, tests run) of one run of ``arm``."""
    restore_cache(root, history)
    out = root / "out"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    shutil.rmtree(root / "logs", ignore_errors=True)
    env = run_env(root)
    start = time.monotonic()
    procs = (dynamic if arm == "dynamic" else static)(root, env, timeout)
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        nodes_root = getattr(procs[0], "nodes_root", None)
        if nodes_root is not None:
            shutil.rmtree(nodes_root, ignore_errors=True)
    wall = time.monotonic() - start
    for proc, text in zip(procs, outputs, strict=False):
        if proc.returncode != 0:
            print(f"--- {arm}: exit {proc.returncode}\n{text[-3000:]}", file=sys.stderr)
    records = [json.loads(p.read_text()) for p in out.glob("*.json")]
    if not records:
        return math.nan, wall, 0
    makespan = max(r["end"] for r in records) - min(r["start"] for r in records)
    return makespan, wall, len(records)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tests", type=int, default=80, help="tests in the suite (default 80)")
    parser.add_argument("--runs", type=int, default=2, help="runs a side, alternating ABBA (default 2)")
    parser.add_argument("--seed", type=int, default=1, help="the suite's seed (default 1)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 24 tests of 0.1-0.6 s, 1 run a side")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one run may take (default 300)")
    args = parser.parse_args()
    low, high = (0.1, 0.6) if args.quick else (0.3, 4.0)
    if args.quick:
        args.tests, args.runs = 24, 1
    cases = make_suite(args.seed, args.tests, low, high)
    total = sum(c.seconds for c in cases)
    workers = NODES * PER_NODE
    bound = max(max(c.seconds for c in cases), total / workers)
    new = sum(c.recorded is None for c in cases)
    changed = sum(c.recorded is not None and c.recorded != c.seconds for c in cases)
    print(
        f"{args.tests} GPU tests (seed {args.seed}, {total:.1f} s in all; {new} new, {changed} changed since the "
        f"history) on {NODES} simulated nodes x {GPUS}, {PER_NODE} workers each; lower bound {bound:.2f} s; "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}"
    )
    times: dict[str, list[tuple[float, float]]] = {"dynamic": [], "static": []}
    ok = True
    with tempfile.TemporaryDirectory(prefix="pytest-gpu-bench-nodes-") as tmp:
        root = Path(tmp)
        history = write_suite(root, cases)
        order = ["dynamic", "static", "static", "dynamic"] * args.runs
        for arm in order[: 2 * args.runs]:
            makespan, wall, ran = measure(arm, root, history, args.timeout)
            ok &= ran == args.tests
            times[arm].append((makespan, wall))
            print(
                f"  {arm:8s} makespan {makespan:6.2f} s ({makespan / bound:.2f}x bound)  wall {wall:6.2f} s  "
                f"{ran}/{args.tests} tests",
                file=sys.stderr,
                flush=True,
            )
    print(f"\n| arm | runs | makespan s (median) | x lower bound ({bound:.2f} s) | wall s (median) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    med = {}
    for arm, values in times.items():
        med[arm] = statistics.median(m for m, _ in values)
        wall = statistics.median(w for _, w in values)
        print(f"| {arm} | {len(values)} | {med[arm]:.2f} | {med[arm] / bound:.2f} | {wall:.2f} |")
    print(
        f"\ndynamic / static (makespan medians): {med['dynamic'] / med['static']:.2f}; "
        f"dynamic {med['dynamic'] / bound:.2f}x the bound (target <= 1.15, and faster than static)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
