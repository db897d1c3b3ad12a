"""A distributed test that failed on a warm pool after other tests: contamination, or its own failure?

A pool runs test after test in the same rank processes, so a test can fail because of what an
earlier one left there (a default dtype, a sub-group, a module's global). How it is decided
(docs/distributed.md, "Contamination"):

- a test that **failed** on a pool that had run other tests before it is run once more,
  alone, on fresh ranks (a new pool of the same shape, for that one run, then shut down; the
  warm pool is closed first: it is suspect, and its lease may be what the new pool needs).
  Not rerun: a test that was its pool's first (it ran on fresh ranks already), a test that
  ran past its own timeout (a rerun would cost the timeout again), a test marked ``xfail``
  (its failure is expected), an isolated test, ``--dist-rerun-alone=off``;
- it **passes** alone: the first failure was contamination. The test is still reported
  **failed** (the suite has a real bug: in an earlier test, which a plain process of the
  same suite would hit too), its failure's first line, which the short summary shows, is
  ``pytest-gpu: contaminated by <node id>``: the earlier test that left something the
  residue check names and that was still so when this test started, else the test that ran
  just before it on that pool; the failure on the warm pool follows;
- it **fails** alone too: the failure is its own, reported as usual (the warm pool's run),
  with a line and a section saying it failed again alone on fresh ranks.

What each test leaves on its ranks (:mod:`.residue`) is named on that test, as a section and
a user property (``dist_residue``); what later tests would meet, or what replaced the pool,
also as a :class:`ResidueWarning` in the warnings summary.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import pytest

from ..base.wording import join, plural
from .residue import merge

if TYPE_CHECKING:
    from ..base.distspec import DistSpec
    from .pool import RankRun

SECTION = "pytest-gpu residue"
RERUN_SECTION = "pytest-gpu rerun alone"
RESIDUE_PROPERTY = "dist_residue"
RERUN_PROPERTY = "dist_rerun_alone"  # "passed" (contamination) or "failed" (its own)
BLAMED_PROPERTY = "dist_contaminated_by"


class ResidueWarning(pytest.PytestWarning):
    """A distributed test left state behind on the ranks of its pool (see :mod:`.residue`)."""


def residue_lines(result: RankRun, world_size: int, field: str = "residue") -> list[str]:
    """What the test left on its ranks (``field``: "residue", what later tests meet or what
    replaced the pool; "put_back", what the ranks put back), each line once with its ranks."""
    return merge({rank: res.get(field) or [] for rank, res in result.results.items()}, world_size)


def unusable(result: RankRun) -> bool:
    """A rank can no longer run tests after it (its default process group is gone)."""
    return any(res.get("unusable") for res in result.results.values())


def name_residue(item: pytest.Item, spec: DistSpec, result: RankRun) -> None:
    """Name on ``item`` what it left on its ranks: a section and a user property; a warning for
    what later tests would meet or what replaced the pool (not for what the ranks put back, as
    they always did: a suite that sets a variable in a body would warn at every test)."""
    lines = residue_lines(result, spec.world_size)
    every = lines + residue_lines(result, spec.world_size, "put_back")
    if not every:
        return
    item.add_report_section("call", SECTION, "\n".join(every))
    item.user_properties.append((RESIDUE_PROPERTY, "; ".join(every)))
    if not lines:
        return
    message = ResidueWarning(f"{item.nodeid} left on its rank pool: {'; '.join(lines)}")
    # at the test's own line: the warnings summary would otherwise show this module's
    warnings.warn_explicit(message, ResidueWarning, str(item.path), (item.location[1] or 0) + 1)


def wanted(item: pytest.Item, spec: DistSpec, result: RankRun, on: bool) -> bool:
    """Is ``result``'s failure to be told apart from contamination by a rerun alone?"""
    return (
        on
        and not spec.isolated
        and result.outcome == "failed"
        and result.ran_before > 0
        and not result.timed_out
        and item.get_closest_marker("xfail") is None
    )


def culprits(result: RankRun, world_size: int) -> tuple[list[str], list[str]]:
    """Whom a contaminated ``result`` blames, and what they left: the earlier tests whose residue
    was still there when it started, else the test just before it."""
    left: dict[str, dict[int, list[str]]] = {}
    for rank, res in sorted(result.results.items()):
        for entry in res.get("tainted") or []:
            left.setdefault(entry["test"], {}).setdefault(rank, []).append(entry["what"])
    if not left:
        return [result.previous], []
    lines = [f"{test} left {line}" for test, per_rank in left.items() for line in merge(per_rank, world_size)]
    return list(left), lines


def contaminated(nodeid: str, spec: DistSpec, first: RankRun) -> tuple[str, list[str]]:
    """The failure's head for a test that passed alone: its first line, then why; and the blamed."""
    tests, lines = culprits(first, spec.world_size)
    others = plural(first.ran_before, "other test")
    head = [
        f"pytest-gpu: contaminated by {join(tests)}: failed on its warm rank pool after {others}, "
        "passed alone on fresh ranks"
    ]
    if lines:
        head += [f"  {line}, still so when {nodeid} started" for line in lines]
    else:
        head.append(
            f"  {tests[0]} ran just before it on that pool; what it changed is nothing the residue check "
            "reads (a module's global, a monkeypatch, a thread...): see docs/distributed.md"
        )
    head.append("the failure on the warm pool:")
    return "\n".join(head), tests


def own(first: RankRun) -> str:
    """The line a failure that failed alone too gets: its own, not its pool's."""
    return (
        "pytest-gpu: failed again alone on fresh ranks: the failure is its own, not caused by "
        f"the {plural(first.ran_before, 'test')} before it on its warm pool (the rerun: section '{RERUN_SECTION}')"
    )
