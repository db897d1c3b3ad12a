"""Distributed tests beside pytest-cov: code that runs only in rank processes counts in ``--cov``.

The ranks start coverage with coverage's own start-up entry point, save their data when their
pool closes them (they end with ``os._exit``), and the pools close when the test loop ends,
before pytest-cov combines the data files: nothing measured in a rank is lost, and no
``.coverage.*`` file is left behind. Serially and under xdist.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Callable

import pytest

from conftest import require

# Only its ``def`` line runs in the pytest process (at import); its body only in the ranks.
MODULE = """
def only_in_ranks(x):
    y = x * 2
    z = y + 1
    return z
"""

TESTS = """
import pytest

import ranked_code


@pytest.mark.distributed(world_size=2, backend="none")
def test_in_ranks(rank):
    assert ranked_code.only_in_ranks(rank.rank) == 2 * rank.rank + 1


@pytest.mark.distributed(world_size=3, backend="none")
def test_in_another_pool(rank):
    assert ranked_code.only_in_ranks(rank.rank) == 2 * rank.rank + 1
"""


# coverage's own subprocess measurement: the ranks start measuring at interpreter start-up, and
# would save again in os._exit (the last pool's ranks, closed after pytest-cov combined, left
# their data files behind)
PATCHED = """
[run]
patch =
    subprocess
    _exit
"""


@pytest.mark.parametrize(
    ("xdist", "coveragerc"), [(False, ""), (True, ""), (False, PATCHED)], ids=["serial", "xdist", "serial-patched"]
)
def test_code_run_only_in_ranks_is_covered(
    run_inner: Callable[..., pytest.RunResult], gpu_pytester: pytest.Pytester, xdist: bool, coveragerc: str
) -> None:
    require("pytest-cov", module="pytest_cov")
    gpu_pytester.makepyfile(ranked_code=textwrap.dedent(MODULE), test_cov=textwrap.dedent(TESTS))
    if coveragerc:
        (gpu_pytester.path / ".coveragerc").write_text(textwrap.dedent(coveragerc))
    gpu_pytester.syspathinsert()
    args = ["--cov=ranked_code", "--cov-report=term-missing", "-p", "no:timeout"]
    if xdist:
        args += ["-n", "2"]
    result = run_inner(*args, subprocess=True, timeout=180)
    result.assert_outcomes(passed=2)
    out = result.stdout.str()
    row = re.search(r"^ranked_code\.py\s+(\d+)\s+(\d+)\s+(\d+)%", out, flags=re.MULTILINE)
    assert row is not None, out
    assert row.groups() == ("4", "0", "100"), out  # 4 statements, none missed
    stray = sorted(p.name for p in gpu_pytester.path.iterdir() if p.name.startswith(".coverage."))
    assert not stray, f"data files left behind: {stray}\n{out}"
