"""Benchmark written requests: guessed markers, defaults, --gpu-learn's cache and the written file.

Generates a seeded suite of GPU tests into a temporary directory: each test really holds its
need (``sim.hold``: 1-7 GiB, log-uniform 1-3 s) on ``sim:4x16GiB``, run with ``-n 8``.
Two copies of it differ only in their markers:

- ``guessed``: ``@pytest.mark.gpu(memory=GUESS)`` as a team writes them: a fifth over-sized
  2x, a tenth under-sized (0.6x: those run out of memory), the rest the need plus 25 %;
- ``bare``: ``@pytest.mark.gpu``: the memory comes from elsewhere.

Arms, each run ``--runs`` times alternating, every run timed the same way:

1. ``guessed``: the guessed suite, fresh machine;
2. ``default``: the bare suite, ``--gpu-default-memory`` (a whole GPU each), fresh machine --
   what ``--gpu-learn`` gives on a fresh CI machine too (its cache is empty there);
3. ``learned``: the bare suite under ``--gpu-learn``, its cache warmed by one learning run
   (the cache's past durations removed before each run: no arm orders by durations);
4. ``written``: the bare suite with ``--gpu-requests`` read from the file one
   ``--gpu-write-requests`` run wrote, no cache (a fresh CI machine with the committed file).

The learning and writing runs are timed too (printed apart: each measures under the default).
For each arm: pytest's own duration (median), the wall time, OOMs (from the junitxml),
passed/failed. Helpers are bench/makespan.py's (run_pytest, run_env, warm_bytecode).

Run from the repository root::

    python bench/written_requests.py               # 40 tests, --runs 2 (about 5 minutes here)
    python bench/written_requests.py --quick       # 20 tests, --runs 1 (about 2 minutes)
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import makespan  # bench/ is no package: its helpers are imported from beside it

GIB, MIB = 2**30, 2**20
SPEC = "sim:4x16GiB"
WORKERS = 8
ARMS = ("guessed", "default", "learned", "written")
HEAD = "import pytest\nfrom pytest_gpu import sim\n"
TEST = """

@pytest.mark.gpu{marker}
def test_{index:03d}():
    sim.hold({need}, {duration:.3f})
"""


@dataclass(frozen=True)
class Case:
    index: int
    need: int  # bytes the body holds
    guess: int  # what the guessed marker asks for
    duration: float
    kind: str  # right, over, under


def make_cases(seed: int, tests: int) -> list[Case]:
    rng = random.Random(seed)
    kinds = ["over"] * round(tests / 5) + ["under"] * round(tests / 10)
    kinds += ["right"] * (tests - len(kinds))
    rng.shuffle(kinds)
    cases = []
    for index, kind in enumerate(kinds):
        need = rng.randint(1 * GIB // MIB, 7 * GIB // MIB) * MIB
        duration = math.exp(rng.uniform(math.log(1.0), math.log(3.0)))
        right = -(-int(need * 1.25) // (256 * MIB)) * 256 * MIB
        guess = {"right": right, "over": 2 * need, "under": int(need * 0.6)}[kind]
        cases.append(Case(index, need, guess, duration, kind))
    return cases


def write_suites(root: Path, cases: list[Case]) -> dict[str, Path]:
    suites = {}
    for name in ("guessed", "bare"):
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "conftest.py").write_text("")
        body = HEAD
        for c in cases:
            marker = f'(memory="{c.guess // MIB}MiB")' if name == "guessed" else ""
            body += TEST.format(marker=marker, index=c.index, need=c.need, duration=c.duration)
        (folder / "test_suite.py").write_text(body)
        suites[name] = folder
    return suites


def arm_args(arm: str, root: Path) -> tuple[str, list[str]]:
    """The suite and the pytest arguments of an arm."""
    base = ["-n", str(WORKERS), "--gpus", SPEC]
    if arm == "guessed":
        return "guessed", [*base, "-p", "no:cacheprovider"]
    if arm == "default":
        return "bare", [*base, "-p", "no:cacheprovider"]
    if arm == "learned":
        return "bare", [*base, "--gpu-learn", "-o", f"cache_dir={root / 'cache-learned'}"]
    if arm == "written":
        return "bare", [*base, "-p", "no:cacheprovider", f"--gpu-requests={root / 'gpu-requests.txt'}"]
    raise ValueError(arm)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tests", type=int, default=40)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="20 tests, one run of each arm")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args(argv)
    if args.quick:
        args.tests, args.runs = 20, 1
    cases = make_cases(args.seed, args.tests)
    root = Path(tempfile.mkdtemp(prefix="written-requests-"))
    suites = write_suites(root, cases)
    env = makespan.run_env(root)
    makespan.warm_bytecode(root, env, *suites.values())
    timeout = 900.0
    work = sum(c.duration for c in cases)
    kinds = {k: sum(c.kind == k for c in cases) for k in ("right", "over", "under")}
    print(
        f"{args.tests} GPU tests on {SPEC}, -n {WORKERS}, seed {args.seed}: {kinds['over']} guessed 2x over, "
        f"{kinds['under']} guessed 0.6x under, {kinds['right']} need + 25 %; {work:.1f} s of test bodies; "
        f"load {makespan.load()}"
    )

    def run(label: str, suite: str, extra: list[str]) -> makespan.Result:
        return makespan.run_pytest(label, label, root, suites[suite], extra, {}, env, timeout, {})

    # the measuring runs, one each: the cache --gpu-learn reads, the file --gpu-requests reads
    _, learn = arm_args("learned", root)
    prep = [run("learn-once", "bare", learn)]
    write = ["-n", str(WORKERS), "--gpus", SPEC, "-p", "no:cacheprovider"]
    write += [f"--gpu-requests={root / 'gpu-requests.txt'}", "--gpu-write-requests"]
    prep.append(run("write-once", "bare", write))
    results: dict[str, list[makespan.Result]] = {arm: [] for arm in ARMS}
    for arm, n in makespan.alternating(list(ARMS), args.runs):
        suite, extra = arm_args(arm, root)
        # no arm has past durations (the scheduler's longest-first): the requests alone differ
        (root / "cache-learned" / "v" / "pytest_gpu" / "durations").unlink(missing_ok=True)
        results[arm].append(run(f"{arm}-{n}", suite, extra))
    print(f"\nmeasuring runs (each under the default: a whole GPU per test): load {makespan.load()}")
    for r in prep:
        print(f"  {r.label:<12} {makespan.fmt(r.reported)} s  ({r.summary})")
    print(f"\n{'arm':<9} {'pytest s':>9} {'wall s':>8} {'OOMs':>5}  outcomes (per run)")
    for arm in ARMS:
        rs = results[arm]
        reported = statistics.median(r.reported or 0.0 for r in rs)
        wall = statistics.median(r.wall for r in rs)
        ooms = "/".join(str(r.ooms) for r in rs)
        print(f"{arm:<9} {reported:>9.2f} {wall:>8.2f} {ooms:>5}  {' | '.join(r.summary for r in rs)}")
        for line in sorted({ln for r in rs for ln in r.plugin_lines if "requests:" in ln}):
            print(f"          {line}")
    print(f"\nload {makespan.load()}; files in {root}" if args.keep else f"\nload {makespan.load()}")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
