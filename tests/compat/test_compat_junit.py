"""Distributed failures as junit readers see them: the ranks' stacks and stderr are in ``<failure>``.

``--junitxml`` writes a failure's ``str(longrepr)`` and drops report sections, which is where
a timed-out distributed test attaches each rank's stack: CI systems that only show junit
reports would lose what explains the hang. The failure's full text carries them; the
terminal shows them once (as sections serially, in the failure text under xdist).
"""

from __future__ import annotations

import re
import textwrap
import xml.etree.ElementTree as ET
from collections.abc import Callable

import pytest

from conftest import require

INNER = """
import sys
import time

import pytest


def hang_here():
    time.sleep(60)


@pytest.mark.distributed(world_size=2, backend="gloo", timeout=3)
def test_hangs(rank):
    if rank.rank == 1:
        print("RANK-ONE-STDERR before failing", file=sys.stderr)
        assert rank.world_size == 5, "RANK-ONE-FAILED"
    hang_here()
"""


@pytest.mark.parametrize("xdist", [False, True], ids=["serial", "xdist"])
def test_hung_rank_stack_and_failing_rank_traceback_reach_junit(
    run_inner: Callable[..., pytest.RunResult], gpu_pytester: pytest.Pytester, xdist: bool
) -> None:
    require("torch", module="torch")
    gpu_pytester.makepyfile(test_hang=textwrap.dedent(INNER))
    junit = gpu_pytester.path / "junit.xml"
    args = [f"--junitxml={junit}", "-p", "no:timeout"]
    if xdist:
        args += ["-n", "2"]
    result = run_inner(*args, subprocess=True, timeout=180)
    result.assert_outcomes(failed=1)

    cases = [c for c in ET.parse(junit).iter("testcase") if c.get("name") == "test_hangs"]
    assert len(cases) == 1, ET.tostring(ET.parse(junit).getroot()).decode()
    failure = cases[0].find("failure")
    assert failure is not None
    body = failure.text or ""
    # junit's message is the summary line, not the whole text
    assert failure.get("message", "").startswith("distributed test failed on 2 of 2 ranks"), failure.get("message")
    # the hung rank: its stack, down to the function it hung in
    assert "rank 0 stack" in body, body
    assert re.search(r'test_hang\.py", line \d+ in hang_here', body), body
    # the failing (not hanging) rank: its traceback, and the tail of its stderr
    assert "rank 1" in body and "RANK-ONE-FAILED" in body and "AssertionError" in body, body
    assert "RANK-ONE-STDERR before failing" in body, body

    # the terminal shows where rank 0 hung once, not twice (in the failures; on CI, pytest's short
    # summary repeats a string longrepr whole, as for any xdist failure)
    out = result.stdout.str().split("short test summary info")[0]
    assert len(re.findall(r'test_hang\.py", line \d+ in hang_here', out)) == 1, out
    assert "RANK-ONE-FAILED" in out
