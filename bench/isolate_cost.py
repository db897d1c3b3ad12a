"""Benchmark what ``gpu(..., isolate=True)`` costs a test against a plain ``gpu`` test.

Writes a suite into a temporary directory — ``--tests`` plain ``gpu(2, memory="1GiB")``
tests (default 10), as many isolated ones of the same lease, one isolated test of another
shape (``memory="2GiB"``) and one back on the first shape — and runs it once with
``python -m pytest -q -p no:xdist --gpus sim:4x8GiB --junitxml=...`` (one test process, so
every pool start is seen). If torch is installed, the same suite runs again with
``import torch`` in every body (the isolated ones also check ``torch.cuda.device_count()
== 2``: the body's process sees its lease only).

From the junit report (each test's ``time``: setup, call and teardown; an isolated test's
``dist_pool`` property: ``fresh`` when its process was started for it, else ``warm``) it
prints, side by side for the two suites:

* plain: the first test (the test process's first lease, and torch's import there) and the
  median of the rest;
* isolated, fresh: each test that started a pool (the first of a shape, and every shape
  switch: a test process keeps one warm pool);
* isolated, warm: the median of the tests that ran on a warm pool, and the median of their
  ``dist_overhead_seconds`` (shipping fixture values and the result, clean-up, the check).

Run from the repository root::

    python bench/isolate_cost.py            # 10 + 10 + 2 tests a suite (under a minute)
    python bench/isolate_cost.py --quick    # 3 + 3 + 2
    python bench/isolate_cost.py --no-torch # only the bodies that import nothing
"""

from __future__ import annotations

import argparse
import importlib.util
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

SIM_SPEC = "sim:4x8GiB"

SUITE = """
import pytest


@pytest.mark.parametrize("i", range({n}))
@pytest.mark.gpu(2, memory="1GiB")
def test_plain(i):
{plain}


@pytest.mark.parametrize("i", range({n}))
@pytest.mark.gpu(2, memory="1GiB", isolate=True)
def test_isolated(i):
{isolated}


@pytest.mark.gpu(2, memory="2GiB", isolate=True)
def test_other_shape():
{isolated}


@pytest.mark.gpu(2, memory="1GiB", isolate=True)
def test_back_to_the_first_shape():
{isolated}
"""

BODIES = {
    "nothing": ("    pass", "    pass"),
    "torch": (
        "    import torch  # noqa: F401",
        "    import torch\n\n    assert torch.cuda.device_count() == 2",
    ),
}


@dataclass
class Figures:
    """One suite's run, read from its junit report."""

    plain_first: float
    plain_median: float
    fresh: list[tuple[str, float]]
    warm_median: float
    warm_overhead_median: float
    wall: float


def run_suite(workdir: Path, bodies: str, n: int) -> Figures:
    plain, isolated = BODIES[bodies]
    suite = workdir / bodies
    suite.mkdir()
    (suite / "test_cost.py").write_text(SUITE.format(n=n, plain=plain, isolated=isolated))
    xml = suite / "cost.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "--gpus", SIM_SPEC, f"--junitxml={xml}"]
    cmd.append("test_cost.py")
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=suite, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        sys.exit(f"the suite ({bodies}) failed, exit code {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    rows = []
    for case in ET.parse(xml).iter("testcase"):
        props = {p.get("name", ""): p.get("value", "") for p in case.iter("property")}
        rows.append((case.get("name", ""), float(case.get("time", "0")), props))
    plain_times = [t for name, t, _ in rows if name.startswith("test_plain")]
    fresh = [(name, t) for name, t, p in rows if p.get("dist_pool") == "fresh"]
    warm = [(t, float(p["dist_overhead_seconds"])) for _, t, p in rows if p.get("dist_pool") == "warm"]
    if not plain_times or not fresh or not warm:
        sys.exit(f"the junit report of the suite ({bodies}) lacks plain, fresh or warm tests: {rows}")
    return Figures(
        plain_first=plain_times[0],
        plain_median=statistics.median(plain_times[1:] or plain_times),
        fresh=fresh,
        warm_median=statistics.median(t for t, _ in warm),
        warm_overhead_median=statistics.median(o for _, o in warm),
        wall=wall,
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", type=int, default=10, help="plain and isolated tests (default 10)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 3 of each")
    parser.add_argument("--no-torch", action="store_true", help="skip the suite whose bodies import torch")
    args = parser.parse_args()
    n = 3 if args.quick else args.tests
    if n < 2:
        parser.error("--tests must be at least 2 (the first plain test is reported apart)")
    suites = ["nothing"]
    if not args.no_torch and importlib.util.find_spec("torch") is not None:
        suites.append("torch")
    try:
        load = f"{os.getloadavg()[0]:.1f}"
    except OSError:
        load = "?"
    print(
        f"{n} plain + {n} isolated gpu(2, memory='1GiB') tests, then one isolated of another shape and one back; "
        f"--gpus {SIM_SPEC}, -p no:xdist; Python {platform.python_version()}, {os.cpu_count()} CPUs, load {load}"
    )
    with tempfile.TemporaryDirectory(prefix="isolate-cost-") as tmp:
        figures = {bodies: run_suite(Path(tmp), bodies, n) for bodies in suites}
    header = ["", *(f"bodies import {b}" for b in suites)]
    table = [
        ["plain, first test", *(_ms(f.plain_first) for f in figures.values())],
        ["plain, median of the rest", *(_ms(f.plain_median) for f in figures.values())],
    ]
    fresh_names = [name for name, _ in figures["nothing"].fresh]
    for i, name in enumerate(fresh_names):
        cells = [_ms(f.fresh[i][1]) if i < len(f.fresh) else "-" for f in figures.values()]
        table.append([f"isolated, fresh: {name}", *cells])
    table.append(["isolated, warm: median", *(_ms(f.warm_median) for f in figures.values())])
    table.append(["  of which pool overhead", *(_ms(f.warm_overhead_median) for f in figures.values())])
    table.append(["whole run (wall)", *(f"{f.wall:.1f} s" for f in figures.values())])
    widths = [max(len(row[c]) for row in [header, *table]) for c in range(len(header))]
    for row in [header, *table]:
        print(
            "  ".join(
                cell.ljust(w) if c == 0 else cell.rjust(w) for c, (cell, w) in enumerate(zip(row, widths, strict=True))
            )
        )


if __name__ == "__main__":
    main()
