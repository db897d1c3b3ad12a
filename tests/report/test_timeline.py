"""report.timeline (records built from report phases, summary figures) and report.trace (Perfetto JSON)."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pytest_gpu.base.wording import duration
from pytest_gpu.report import trace
from pytest_gpu.report.timeline import SUGGEST_FLOOR, LeaseSpan, Timeline, suggest

MIB = 2**20
GIB = 2**30
T0 = 1_700_000_000.0  # wall-clock epoch seconds; offsets below are binary fractions, so exact


def lease_row(
    gpus: Sequence[int], memory: int, asked: float, granted: float, released: float, exclusive: bool = False
) -> list[object]:
    """One ``gpu_leases`` row as lifecycle writes it: [gpus, memory, exclusive, asked, granted, released]."""
    return LeaseSpan(tuple(gpus), memory, exclusive, T0 + asked, T0 + granted, T0 + released).to_wire()


def props(
    leases: Sequence[Sequence[object]], *, peak: str = "", request: str = "1 GPU", requested: int = 0
) -> dict[str, object]:
    return {
        "gpu_leases": json.dumps(leases),
        "gpu_peak_bytes": peak,
        "gpu_request": request,
        "gpu_request_bytes": requested,
    }


def run_test(
    tl: Timeline,
    nodeid: str,
    worker: str,
    start: float,
    stop: float,
    *,
    outcomes: Mapping[str, str] | None = None,
    properties: Mapping[str, object] | None = None,
) -> None:
    """Feed setup/call/teardown phases (seconds after T0); setup and teardown take a quarter second each."""
    outcomes = dict(outcomes or {})
    bounds = {"setup": (start, start + 0.25), "call": (start + 0.25, stop - 0.25), "teardown": (stop - 0.25, stop)}
    for when, (a, b) in bounds.items():
        extra = dict(properties or {}) if when == "teardown" else {}  # lifecycle adds them at teardown
        tl.phase(nodeid, worker, when, outcomes.get(when, "passed"), T0 + a, T0 + b, b - a, extra)


# -- records ---------------------------------------------------------------------------


def test_phases_give_start_stop_duration_and_outcome() -> None:
    tl = Timeline()
    run_test(tl, "t.py::ok", "gw0", 1.0, 3.0)
    rec = tl.records["t.py::ok"]
    assert (rec.worker, rec.start, rec.stop, rec.duration, rec.outcome) == ("gw0", T0 + 1, T0 + 3, 2.0, "passed")
    assert rec.leases == [] and rec.peak is None and rec.requested == 0


@pytest.mark.parametrize(
    ("outcomes", "expected"),
    [
        ({"call": "failed"}, "failed"),
        ({"setup": "failed"}, "error"),
        ({"teardown": "failed"}, "error"),
        ({"call": "failed", "teardown": "failed"}, "failed"),  # the first failure names it
        ({"setup": "failed", "teardown": "failed"}, "error"),
        ({"setup": "skipped"}, "skipped"),
        ({"call": "skipped"}, "skipped"),
        ({"call": "failed", "teardown": "skipped"}, "failed"),
    ],
)
def test_outcome(outcomes: dict[str, str], expected: str) -> None:
    tl = Timeline()
    run_test(tl, "t.py::x", "gw1", 0.0, 2.0, outcomes=outcomes)
    assert tl.records["t.py::x"].outcome == expected


@pytest.mark.parametrize(
    ("phases", "counted"),
    [
        ([("setup", "passed"), ("call", "passed"), ("teardown", "passed")], ["passed"]),
        ([("setup", "passed"), ("call", "passed"), ("teardown", "failed")], ["passed", "error"]),
        ([("setup", "passed"), ("call", "failed"), ("teardown", "failed")], ["failed", "error"]),
        ([("setup", "failed"), ("teardown", "passed")], ["error"]),
        ([("setup", "skipped"), ("teardown", "passed")], ["skipped"]),
        ([("setup", "passed"), ("call", "skipped", True), ("teardown", "passed")], ["xfailed"]),
        ([("setup", "passed"), ("call", "passed", True), ("teardown", "passed")], ["xpassed"]),
        ([("setup", "passed"), ("call", "failed"), ("teardown", "passed")], ["failed"]),  # a strict xpass too
        ([("setup", "passed"), ("call", "rerun"), ("call", "passed"), ("teardown", "passed")], ["rerun", "passed"]),
        ([("???", "failed")], ["failed"]),  # xdist: its worker died under it
    ],
)
def test_counted_as_pytest_counts_each_phase(phases: list[tuple[Any, ...]], counted: list[str]) -> None:
    """What pytest's closing line counts, not the one outcome of the record's bar."""
    tl = Timeline()
    tl.started("t.py::x", "gw0", T0)
    for when, outcome, *xfail in phases:
        tl.phase("t.py::x", "gw0", when, outcome, T0, T0 + 1.0, 1.0, {}, xfail=bool(xfail))
    assert tl.records["t.py::x"].counted == counted
    span = next(e for e in trace.build(tl, [], "none", "none")["traceEvents"] if e.get("cat") == "test")
    assert span["args"]["counted"] == counted


def test_crash_report_takes_start_from_started() -> None:
    # xdist's report for a test whose worker died carries no start; logstart gave it
    tl = Timeline()
    tl.started("t.py::boom", "main", T0 + 2.0)
    tl.phase("t.py::boom", "gw3", "???", "failed", 0.0, T0 + 5.0, 0.0, {})
    rec = tl.records["t.py::boom"]
    assert (rec.worker, rec.start, rec.stop, rec.outcome) == ("gw3", T0 + 2.0, T0 + 5.0, "crashed")
    assert tl.makespan() == 3.0


def test_crashed_outcome_is_not_overwritten() -> None:
    tl = Timeline()
    tl.started("t.py::boom", "main", T0)
    tl.phase("t.py::boom", "gw0", "???", "failed", 0.0, T0 + 1.0, 0.0, {})
    tl.phase("t.py::boom", "gw0", "teardown", "failed", T0 + 1.0, T0 + 2.0, 1.0, {})
    assert tl.records["t.py::boom"].outcome == "crashed"


def test_started_keeps_the_earliest_start() -> None:
    tl = Timeline()
    tl.started("t.py::a", "main", T0 + 1.0)
    run_test(tl, "t.py::a", "gw0", 1.5, 3.0)  # the worker's own clock: a bit later than logstart
    assert tl.records["t.py::a"].start == T0 + 1.0
    assert tl.records["t.py::a"].worker == "gw0"


def test_record_without_start_is_not_a_test() -> None:
    tl = Timeline()
    tl.phase("t.py::ghost", "gw0", "???", "failed", 0.0, T0 + 1.0, 0.0, {})
    assert "t.py::ghost" in tl.records
    assert tl.tests() == []
    assert tl.bounds() == (0.0, 0.0) and tl.makespan() == 0.0
    assert tl.summary_lines([0], with_peaks=True) == []


def test_leases_peak_and_request_from_user_properties() -> None:
    tl = Timeline()
    rows = [lease_row([0, 1], 4 * GIB, 0.5, 1.0, 3.0), lease_row([1], 2 * GIB, 3.0, 3.0, 3.5, exclusive=True)]
    run_test(
        tl,
        "t.py::g",
        "gw0",
        0.0,
        4.0,
        properties=props(rows, peak="0=123,1=456", request="2 GPUs, 4GiB each", requested=4 * GIB),
    )
    rec = tl.records["t.py::g"]
    assert rec.leases == [
        LeaseSpan((0, 1), 4 * GIB, False, T0 + 0.5, T0 + 1.0, T0 + 3.0),
        LeaseSpan((1,), 2 * GIB, True, T0 + 3.0, T0 + 3.0, T0 + 3.5),
    ]
    assert rec.peak == 456
    assert rec.requested == 4 * GIB and rec.request == "2 GPUs, 4GiB each"
    assert rec.exclusive
    assert rec.gpu_seconds == pytest.approx(2 * 2.0 + 1 * 0.5)
    assert rec.waited == pytest.approx(0.5)


def test_missing_peak_is_none() -> None:
    tl = Timeline()
    run_test(tl, "t.py::g", "gw0", 0.0, 2.0, properties=props([lease_row([0], GIB, 0.5, 0.5, 1.5)]))
    rec = tl.records["t.py::g"]
    assert rec.peak is None and not rec.exclusive and len(rec.leases) == 1


def test_makespan_and_tests_order() -> None:
    tl = Timeline()
    run_test(tl, "t.py::b", "gw1", 2.0, 9.0)
    run_test(tl, "t.py::a", "gw0", 1.0, 4.0)
    run_test(tl, "t.py::c", "gw0", 4.0, 6.0)
    assert [r.nodeid for r in tl.tests()] == ["t.py::a", "t.py::b", "t.py::c"]
    assert tl.bounds() == (T0 + 1.0, T0 + 9.0)
    assert tl.makespan() == 8.0


def test_busy_is_the_union_of_overlapping_leases() -> None:
    tl = Timeline()
    # GPU 0: [0, 4] and [2, 6] overlap -> 6 s busy of 10, not 8; GPU 1: [5, 7.5] only
    run_test(tl, "t.py::a", "gw0", 0.0, 4.0, properties=props([lease_row([0], GIB, 0.0, 0.0, 4.0)]))
    run_test(tl, "t.py::b", "gw1", 2.0, 10.0, properties=props([lease_row([0, 1], GIB, 2.0, 2.0, 6.0)]))
    run_test(tl, "t.py::c", "gw0", 4.0, 8.0, properties=props([lease_row([1], GIB, 5.0, 5.0, 7.5)]))
    busy = tl.busy([0, 1, 2])
    assert busy[0] == pytest.approx(0.6)
    assert busy[1] == pytest.approx((6.0 - 2.0 + 7.5 - 5.0 - 1.0) / 10)  # [2, 6] with [5, 7.5]: 5.5 s
    assert busy[2] == 0.0


def test_busy_with_nested_and_disjoint_leases() -> None:
    tl = Timeline()
    run_test(tl, "t.py::a", "gw0", 0.0, 10.0, properties=props([lease_row([0], GIB, 0.0, 0.0, 8.0)]))
    run_test(tl, "t.py::b", "gw1", 1.0, 3.0, properties=props([lease_row([0], GIB, 1.0, 1.0, 2.0)]))  # inside
    run_test(tl, "t.py::c", "gw1", 9.0, 10.0, properties=props([lease_row([0], GIB, 9.0, 9.0, 9.5)]))
    assert tl.busy([0])[0] == pytest.approx(0.85)


# -- summary ---------------------------------------------------------------------------


def test_summary_first_line() -> None:
    tl = Timeline()
    run_test(tl, "t.py::a", "gw0", 0.0, 4.0, properties=props([lease_row([0], GIB, 0.0, 1.0, 4.0)]))
    run_test(tl, "t.py::b", "gw1", 0.0, 8.0)
    first = tl.summary_lines([0, 1], with_peaks=False)[0]
    assert first == (
        "pytest-gpu: makespan 8.0s · test time 12.0s (1.5x in parallel) · waited 1.0s for GPUs · GPU busy 0:38% 1:0%"
    )
    assert "GPU busy" not in tl.summary_lines([], with_peaks=False)[0]


def test_a_short_wait_reads_as_the_trace_shows_it_not_as_none() -> None:
    """46 ms of waiting was "waited 0.0s": it reads as the trace's figure instead."""
    tl = Timeline()
    run_test(tl, "t.py::a", "gw0", 0.0, 4.0, properties=props([lease_row([0], GIB, 0.0, 0.046875, 4.0)]))
    assert " · waited 47ms for GPUs" in tl.summary_lines([0], with_peaks=False)[0]


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0, "0s"),
        (-1.0, "0s"),
        (0.0004, "<1ms"),
        (0.046, "46ms"),
        (0.9994, "999ms"),
        (0.9996, "1.0s"),
        (12.34, "12.3s"),
    ],
)
def test_duration_reads_as_a_trace_viewer_shows_it(seconds: float, text: str) -> None:
    assert duration(seconds) == text


def test_summary_lists_top_five_gpu_second_users_sorted() -> None:
    tl = Timeline()
    seconds = [3.0, 7.0, 1.0, 5.0, 2.0, 6.0, 4.0]
    for n, s in enumerate(seconds):
        run_test(tl, f"t.py::g{n}", "gw0", 0.0, 8.0, properties=props([lease_row([0], GIB, 0.0, 0.0, s)]))
    run_test(tl, "t.py::cpu", "gw1", 0.0, 8.0)
    lines = tl.summary_lines([0], with_peaks=False)
    at = lines.index("pytest-gpu: largest GPU-second users:")
    listed = lines[at + 1 :]
    assert listed == [f"  {s:7.1f} GPU-s  t.py::g{seconds.index(s)}" for s in (7.0, 6.0, 5.0, 4.0, 3.0)]


def test_summary_without_gpu_tests_has_no_user_list() -> None:
    tl = Timeline()
    run_test(tl, "t.py::cpu", "gw0", 0.0, 1.0)
    assert len(tl.summary_lines([0], with_peaks=True)) == 1


def _peaked(tl: Timeline, nodeid: str, requested: int, peak: int, **kwargs: Any) -> None:
    exclusive = kwargs.pop("exclusive", False)
    rows = [lease_row([0], requested, 0.0, 0.0, 1.0, exclusive=exclusive)]
    run_test(tl, nodeid, "gw0", 0.0, 1.0, properties=props(rows, peak=f"0={peak}", requested=requested), **kwargs)


def test_summary_requests_above_and_far_below_their_peak() -> None:
    tl = Timeline()
    _peaked(tl, "t.py::above", 2 * GIB, 4 * GIB)
    _peaked(tl, "t.py::below", 8 * GIB, 800 * MIB)
    _peaked(tl, "t.py::fine", 4 * GIB, 3 * GIB)
    _peaked(tl, "t.py::quarter", 4 * GIB, GIB)  # exactly a quarter: not "far below"
    _peaked(tl, "t.py::whole", 16 * GIB, 2 * GIB, exclusive=True)  # not sized by its test: no suggestion
    # over its budget and failed for it (--gpu-verify=fail): the suggestion is what it needs
    _peaked(tl, "t.py::failed", 2 * GIB, 3 * GIB, outcomes={"teardown": "failed"})
    _peaked(tl, "t.py::stopped", 8 * GIB, 0, outcomes={"call": "failed"})  # stopped early: its low peak says little
    run_test(tl, "t.py::noask", "gw0", 0.0, 1.0, properties=props([lease_row([0], GIB, 0, 0, 1)], peak="0=99"))
    lines = tl.summary_lines([0], with_peaks=True)
    at = lines.index("pytest-gpu: requests that do not match the measured peak:")
    assert lines[at + 1 :] == [
        '  t.py::failed: asked 2GiB, peaked at 3GiB (above): suggest memory="3.8GiB"',
        '  t.py::above: asked 2GiB, peaked at 4GiB (above): suggest memory="5GiB"',
        '  t.py::below: asked 8GiB, peaked at 800MiB (far below): suggest memory="1GiB"',
    ]
    assert not any("requests that do not match" in line for line in tl.summary_lines([0], with_peaks=False))
    # --gpu-learn sizes exclusive tests from their peaks: then they get one too
    learned = tl.summary_lines([0], with_peaks=True, learn=True)
    assert '  t.py::whole: asked a whole GPU, peaked at 2GiB (far below): suggest memory="2.5GiB"' in learned


def test_summary_requests_are_grouped_by_the_size_to_ask() -> None:
    tl = Timeline()
    for n in range(500):  # a suite of small tests that all ask too much
        _peaked(tl, f"t.py::small{n:03d}", 4 * GIB, 100 * MIB + n)
    for n in range(2):
        _peaked(tl, f"t.py::over{n}", GIB, 2 * GIB)
    lines = tl.summary_lines([0], with_peaks=True)
    at = lines.index("pytest-gpu: requests that do not match the measured peak:")
    assert lines[at + 1 :] == [
        '  suggest memory="2.5GiB" for 2 tests that peaked above their request (at most 2GiB): '
        "t.py::over0, t.py::over1",
        '  suggest memory="256MiB" for 500 tests that peaked far below their request (at most 100MiB): '
        "t.py::small000, t.py::small001, t.py::small002 and 497 more (-v lists them)",
    ]
    every = tl.summary_lines([0], with_peaks=True, verbose=True)  # -v: one line per test
    at = every.index("pytest-gpu: requests that do not match the measured peak:")
    assert len(every[at + 1 :]) == 502
    assert every[at + 1] == '  t.py::over0: asked 1GiB, peaked at 2GiB (above): suggest memory="2.5GiB"'


def test_summary_request_groups_beyond_ten_are_counted() -> None:
    tl = Timeline()
    for n in range(12):  # twelve sizes: twelve suggestions
        _peaked(tl, f"t.py::over{n:02d}", GIB, (2 + n) * GIB)
    lines = tl.summary_lines([0], with_peaks=True)
    at = lines.index("pytest-gpu: requests that do not match the measured peak:")
    assert len(lines[at + 1 :]) == 11
    assert all(line.startswith("  t.py::over") for line in lines[at + 1 : at + 11])
    assert lines[-1] == "  ... and 2 more suggestions (-v lists every test)"


def test_summary_exactly_ten_requests_has_no_more_line() -> None:
    tl = Timeline()
    for n in range(10):
        _peaked(tl, f"t.py::over{n}", GIB, (2 + n) * GIB)
    assert not any("more" in line for line in tl.summary_lines([0], with_peaks=True))


# -- suggest ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("peak", "expected"),
    [
        (0, 256 * MIB),
        (100 * MIB, 256 * MIB),
        (204 * MIB, 256 * MIB),  # 255 MiB after 1.25x
        (205 * MIB, 512 * MIB),  # 256.25 MiB: rounded up
        (GIB, 1280 * MIB),  # 1.25 GiB is a multiple already
        (GIB + 1, 1536 * MIB),
        (4 * GIB, 5 * GIB),
    ],
)
def test_suggest(peak: int, expected: int) -> None:
    assert suggest(peak) == expected


@given(st.integers(min_value=0, max_value=2**40))
def test_suggest_is_the_smallest_256mib_multiple_above_125_percent(peak: int) -> None:
    got = suggest(peak)
    wanted = max(int(peak * 1.25), SUGGEST_FLOOR)
    assert got % (256 * MIB) == 0
    assert got >= wanted
    assert got - 256 * MIB < wanted


# -- trace -----------------------------------------------------------------------------

GPUS = [(0, 16 * GIB), (1, 16 * GIB)]


def sample_timeline() -> Timeline:
    """Four GPU tests on two workers, a CPU test on gw10 and a crash on gw2; no exclusive lease shares its GPU."""
    tl = Timeline()
    # a waits 0.5 s for GPU 0; b shares GPU 0 with it (a second lane)
    run_test(tl, "t.py::a", "gw0", 0.0, 4.0, properties=props([lease_row([0], 4 * GIB, 0.5, 1.0, 3.5)]))
    run_test(tl, "t.py::b", "gw1", 0.5, 5.0, properties=props([lease_row([0], 8 * GIB, 1.0, 1.0, 4.5)]))
    # c: GPU 1 alone, after a wait too short to draw (0.5 ms)
    rows = [lease_row([1], 16 * GIB, 4.5, 4.5005, 8.0, exclusive=True)]
    run_test(tl, "t.py::c", "gw0", 4.25, 9.0, properties=props(rows))
    # d: both GPUs once c has released GPU 1, after a 3 s wait
    run_test(tl, "t.py::d", "gw1", 5.0, 10.0, properties=props([lease_row([0, 1], 2 * GIB, 5.5, 8.5, 9.5)]))
    run_test(tl, "t.py::e", "gw10", 1.0, 2.0)
    tl.started("t.py::f", "main", T0 + 2.0)
    tl.phase("t.py::f", "gw2", "???", "failed", 0.0, T0 + 3.0, 0.0, {})
    return tl


def spans(data: dict[str, Any], cat: str) -> list[dict[str, Any]]:
    return [e for e in data["traceEvents"] if e["ph"] == "X" and e.get("cat") == cat]


def overlaps(data: dict[str, Any], gpu: int) -> list[tuple[str, str]]:
    """Pairs of lease spans on ``gpu`` that run at once while one of them is exclusive."""
    leases = sorted((e for e in spans(data, "lease") if e["pid"] == trace.GPU_PID + gpu), key=lambda e: e["ts"])
    found = []
    for n, first in enumerate(leases):
        for second in leases[n + 1 :]:
            at_once = second["ts"] < first["ts"] + first["dur"]
            if at_once and (first["args"]["exclusive"] or second["args"]["exclusive"]):
                found.append((first["args"]["nodeid"], second["args"]["nodeid"]))
    return found


def test_trace_events_are_well_formed() -> None:
    data = trace.build(sample_timeline(), GPUS, "2 x sim 16GiB", "sim")
    for event in data["traceEvents"]:
        assert {"ph", "pid", "name"} <= event.keys(), event
        if event["ph"] == "X":
            assert isinstance(event["ts"], int) and event["ts"] >= 0, event
            assert isinstance(event["dur"], int) and event["dur"] >= 1, event
            assert isinstance(event["tid"], int), event


def test_trace_has_one_test_span_per_record() -> None:
    tl = sample_timeline()
    data = trace.build(tl, GPUS, "inv", "sim")
    tests = spans(data, "test")
    assert sorted(e["args"]["nodeid"] for e in tests) == sorted(r.nodeid for r in tl.tests())
    assert len(tests) == 6
    by_id = {e["args"]["nodeid"]: e for e in tests}
    assert by_id["t.py::a"]["ts"] == 0 and by_id["t.py::a"]["dur"] == 4_000_000
    assert by_id["t.py::a"]["name"] == "a"
    assert by_id["t.py::d"]["args"]["gpus"] == [0, 1]
    assert by_id["t.py::f"]["args"]["outcome"] == "crashed"
    assert by_id["t.py::e"]["args"]["request"] is None and by_id["t.py::e"]["args"]["gpus"] == []


def test_trace_waits_nest_in_their_test_on_its_worker() -> None:
    data = trace.build(sample_timeline(), GPUS, "inv", "sim")
    tests = {e["args"]["nodeid"]: e for e in spans(data, "test")}
    waits = spans(data, "wait")
    assert sorted(e["args"]["nodeid"] for e in waits) == ["t.py::a", "t.py::d"]  # c's 0.5 ms is not drawn
    for wait in waits:
        test = tests[wait["args"]["nodeid"]]
        assert (wait["pid"], wait["tid"]) == (test["pid"], test["tid"])
        assert test["ts"] <= wait["ts"] and wait["ts"] + wait["dur"] <= test["ts"] + test["dur"]
    assert {e["args"]["nodeid"]: e["dur"] for e in waits} == {"t.py::a": 500_000, "t.py::d": 3_000_000}


def test_trace_draws_no_wait_for_a_test_that_waited_for_none() -> None:
    """Granted at once (the test's gpu_wait_seconds: 0, "waited 0s for GPUs" in the summary), the
    12 ms from asking to the grant are the broker's round trip: no "waiting for GPU" span."""
    tl = Timeline()
    for nodeid, reported in (("t.py::at_once", 0.0), ("t.py::queued", 0.5)):
        properties = props([lease_row([0], GIB, 1.0, 1.0 + (0.012 if not reported else reported), 2.0)])
        run_test(tl, nodeid, "gw0", 0.5, 2.5, properties=properties | {"gpu_wait_seconds": reported})
    waits = spans(trace.build(tl, GPUS, "inv", "sim"), "wait")
    assert [(e["args"]["nodeid"], e["dur"]) for e in waits] == [("t.py::queued", 500_000)]
    assert " · waited 500ms for GPUs" in tl.summary_lines([0], with_peaks=False)[0]


def test_trace_leases_on_gpu_processes_in_non_overlapping_lanes() -> None:
    data = trace.build(sample_timeline(), GPUS, "inv", "sim")
    leases = spans(data, "lease")
    assert sorted((e["pid"], e["args"]["nodeid"]) for e in leases) == [
        (100, "t.py::a"),
        (100, "t.py::b"),
        (100, "t.py::d"),
        (101, "t.py::c"),
        (101, "t.py::d"),
    ]
    lanes: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for e in leases:
        assert e["pid"] == trace.GPU_PID + e["args"]["gpu"]
        lanes.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for intervals in lanes.values():
        intervals.sort()
        assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(intervals))
    assert {tid for pid, tid in lanes if pid == 100} == {0, 1}  # a and b at once: two lanes
    assert {tid for pid, tid in lanes if pid == 101} == {0}  # d follows c: one lane
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in data["traceEvents"] if e["name"] == "thread_name"}
    assert names[(100, 1)] == "GPU 0 / 1"


def test_trace_exclusive_lease_shares_no_gpu() -> None:
    data = trace.build(sample_timeline(), GPUS, "inv", "sim")
    assert overlaps(data, 0) == [] and overlaps(data, 1) == []
    # the check itself catches a violation: an exclusive lease next to a shared one
    bad = Timeline()
    run_test(bad, "t.py::x", "gw0", 0.0, 4.0, properties=props([lease_row([1], 16 * GIB, 0, 0, 3, exclusive=True)]))
    run_test(bad, "t.py::y", "gw1", 1.0, 4.0, properties=props([lease_row([1], GIB, 2.0, 2.0, 3.5)]))
    assert overlaps(trace.build(bad, GPUS, "inv", "sim"), 1) == [("t.py::x", "t.py::y")]


def test_trace_memory_counter_returns_to_zero() -> None:
    data = trace.build(sample_timeline(), GPUS, "inv", "sim")
    for pid in (100, 101):
        levels = [e["args"]["GiB"] for e in data["traceEvents"] if e["ph"] == "C" and e["pid"] == pid]
        assert levels and levels[-1] == 0
        assert all(level >= 0 for level in levels)
    gpu0 = [e["args"]["GiB"] for e in data["traceEvents"] if e["ph"] == "C" and e["pid"] == 100]
    assert max(gpu0) == 12.0  # a (4 GiB) and b (8 GiB) at once


def test_trace_other_data_and_worker_threads() -> None:
    tl = sample_timeline()
    data = trace.build(tl, GPUS, "2 x sim 16GiB", "sim")
    meta = data["otherData"]["pytest_gpu"]
    assert meta == {
        "version": 1,
        "inventory": "2 x sim 16GiB",
        "source": "sim",
        "gpus": [{"index": 0, "memory": 16 * GIB}, {"index": 1, "memory": 16 * GIB}],
        "started": T0,
        "makespan": tl.makespan(),
        "workers": ["gw0", "gw1", "gw2", "gw10"],  # by number, not by text
    }
    threads = {
        e["args"]["name"]: e["tid"]
        for e in data["traceEvents"]
        if e["name"] == "thread_name" and e["pid"] == trace.WORKERS_PID
    }
    assert threads == {"gw0": 1, "gw1": 2, "gw2": 3, "gw10": 4}
    tests = {e["args"]["nodeid"]: e for e in spans(data, "test")}
    assert all(tests[n]["tid"] == threads[r.worker] for n, r in tl.records.items())
    processes = {e["pid"]: e["args"]["name"] for e in data["traceEvents"] if e["name"] == "process_name"}
    assert processes == {1: "workers", 100: "GPU 0 (16GiB)", 101: "GPU 1 (16GiB)"}


def test_trace_json_round_trip() -> None:
    data = trace.build(sample_timeline(), GPUS, "inv", "sim")
    assert json.loads(json.dumps(data)) == data


def test_trace_of_empty_timeline() -> None:
    data = trace.build(Timeline(), GPUS, "inv", "sim")
    assert all(e["ph"] == "M" for e in data["traceEvents"])
    assert data["otherData"]["pytest_gpu"]["workers"] == [] and data["otherData"]["pytest_gpu"]["makespan"] == 0.0


def test_trace_write_is_atomic_and_makes_no_directory(tmp_path: Path) -> None:
    data = trace.build(sample_timeline(), GPUS, "inv", "sim")
    target = tmp_path / "deep" / "er" / "run.json"
    with pytest.raises(FileNotFoundError):  # the run checked the directory at start-up; gone since
        trace.write(target, data)
    assert not (tmp_path / "deep").exists()
    target.parent.mkdir(parents=True)
    assert trace.write(target, data) == target
    assert json.loads(target.read_text()) == data
    assert [p.name for p in target.parent.iterdir()] == ["run.json"]  # no temporary file left
    trace.write(str(target), {"traceEvents": []})  # replaced in place
    assert json.loads(target.read_text()) == {"traceEvents": []}
    assert [p.name for p in target.parent.iterdir()] == ["run.json"]


def test_short_names() -> None:
    assert trace.short("tests/test_x.py::TestY::test_z[1]") == "TestY::test_z[1]"
    assert trace.short("plain") == "plain"
    assert math.isfinite(sample_timeline().makespan())


def test_summary_leaves_out_a_parallel_factor_below_one() -> None:
    """Tiny tests with gaps between them give 0.4x: that measures the gaps, not parallelism."""
    tl = Timeline()
    run_test(tl, "t.py::a", "gw0", 0.0, 0.1)
    run_test(tl, "t.py::b", "gw0", 0.2, 0.3)
    first = tl.summary_lines([0], with_peaks=False)[0]
    assert "· test time 0.2s · waited" in first
    assert "in parallel" not in first


def test_other_holders_leases_are_drawn_and_busy_under_their_own_name() -> None:
    """A pool's (or fixture's) lease judged during a test: on its GPU's track, named after the
    holder, with the test it was judged during; it makes the GPU busy too."""
    from pytest_gpu.base.spans import HeldRow, format_held

    pool = HeldRow("pool", "the rank pool of 2 ranks", (LeaseSpan((1,), GIB, False, T0, T0, T0 + 2.0),), 1)
    tl = Timeline()
    held = {"gpu_indices": "", "gpu_leases": "[]", "gpu_held": format_held([pool])}
    tl.phase("t.py::dist", "gw0", "teardown", "passed", T0, T0 + 2.0, 2.0, held)
    tl.phase("t.py::plain", "gw1", "teardown", "passed", T0, T0 + 2.0, 2.0, {})
    assert tl.busy([0, 1]) == {0: 0.0, 1: 1.0}
    data = trace.build(tl, [(0, 8 * GIB), (1, 8 * GIB)], "2 GPUs", "sim:2x8GiB")
    (event,) = [e for e in data["traceEvents"] if e.get("cat") == "lease"]
    assert event["pid"] == trace.GPU_PID + 1 and event["name"] == "the rank pool of 2 ranks"
    assert event["args"]["holder"] == "pool" and event["args"]["nodeid"] == "t.py::dist"
    assert event["args"]["violations"] == 1 and event["args"]["memory"] == GIB


def test_recorded_durations_leave_out_the_wait_for_gpus() -> None:
    """The scheduler's history: a test's own time, not the crowding of the run it waited in."""
    from pytest_gpu.report.summary import Summary

    summary = Summary()
    waited = {**props([lease_row([0], GIB, 1.0, 2.5, 3.0)]), "gpu_wait_seconds": 1.5}
    run_test(summary.timeline, "t.py::crowded", "gw0", 1.0, 4.0, properties=waited)
    run_test(summary.timeline, "t.py::cpu", "gw1", 1.0, 2.0)
    assert summary.durations() == {"t.py::crowded": 1.5, "t.py::cpu": 1.0}
