"""The run as it happened: one record per test, and the figures the summary prints (pure).

Records are built from test reports, so the xdist controller sees every worker's
tests: the reports carry wall-clock phase times, and pytest-gpu adds each lease's
times and GPUs as user properties (written by :mod:`pytest_gpu.run.lifecycle`, typed in
:mod:`pytest_gpu.base.spans`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ..base.requests import format_size
from ..base.spans import HeldRow, LeaseSpan, gpu_properties, parse_held, parse_peaks, parse_spans
from ..base.wording import duration, plural

MIB = 2**20
SUGGEST_FLOOR = 256 * MIB  # as --gpu-learn: never suggest less


@dataclass
class TestRecord:
    """One test of the run (times are wall-clock seconds since the epoch)."""

    nodeid: str
    worker: str = "main"
    start: float = math.inf
    stop: float = 0.0
    duration: float = 0.0  # setup + call + teardown, as pytest measured them
    outcome: str = "passed"  # passed, failed, skipped, error (setup/teardown), crashed
    # what pytest's closing line counts it as, a phase at a time (pytest_category): a call that
    # passed with a teardown that raised is both "passed" and "error", as pytest counts it
    counted: list[str] = field(default_factory=list)
    request: str = ""
    requested: int = 0  # bytes per GPU asked for (an exclusive lease: what it was given)
    peak: int | None = None  # highest bytes measured on one of its GPUs
    leases: list[LeaseSpan] = field(default_factory=list)
    reported_wait: float | None = None  # seconds it waited for GPUs, as the test reported it
    held: list[HeldRow] = field(default_factory=list)  # other holders' leases judged during it (fixtures, pools)
    node: str | None = None  # --gpu-nodes: the node it ran on (its report's ``gpu_node``); its GPUs are that node's

    __test__ = False

    @property
    def gpu_seconds(self) -> float:
        return sum(len(span.gpus) * (span.released - span.granted) for span in self.leases)

    @property
    def exclusive(self) -> bool:
        return any(span.exclusive for span in self.leases)

    @property
    def waited(self) -> float:
        """Seconds the test waited for GPUs: its own ``gpu_wait_seconds``, as its report says.

        The figure every total of the run is summed from (both summary lines, the trace),
        so that they agree; a record without it (built by hand) falls back on its spans.
        """
        if self.reported_wait is not None:
            return self.reported_wait
        return sum(max(span.granted - span.asked, 0.0) for span in self.leases)


def pytest_category(when: str, outcome: str, xfail: bool = False) -> str | None:
    """What pytest's closing line ("3 passed, 1 error") counts a report phase as, or ``None``
    where it counts nothing (a setup or teardown that passed): pytest's own
    ``pytest_report_teststatus`` rules (``xfail``: the report has ``wasxfail``). A test whose
    call passed and whose teardown raised is counted twice, "passed" and "error"."""
    if xfail and outcome in ("skipped", "passed"):
        return "xfailed" if outcome == "skipped" else "xpassed"
    if when in ("setup", "teardown"):
        return {"failed": "error", "skipped": "skipped"}.get(outcome)
    return outcome  # a call (or xdist's "???" for a crash: "failed"); a plugin's own, such as "rerun"


class Timeline:
    """Test records keyed by node id, fed one report phase at a time."""

    def __init__(self) -> None:
        self.records: dict[str, TestRecord] = {}

    def record(self, nodeid: str) -> TestRecord:
        if nodeid not in self.records:
            self.records[nodeid] = TestRecord(nodeid)
        return self.records[nodeid]

    def started(self, nodeid: str, worker: str, at: float) -> None:
        rec = self.record(nodeid)
        rec.worker = worker
        rec.start = min(rec.start, at)

    def phase(
        self,
        nodeid: str,
        worker: str,
        when: str,
        outcome: str,
        start: float,
        stop: float,
        duration: float,
        properties: dict[str, object],
        xfail: bool = False,
    ) -> None:
        """One report phase; ``xfail``: the report has ``wasxfail`` (see :func:`pytest_category`)."""
        rec = self.record(nodeid)
        rec.worker = worker
        if start > 0:
            rec.start = min(rec.start, start)
        rec.stop = max(rec.stop, stop, rec.start if rec.start != math.inf else 0.0)
        rec.duration += duration
        category = pytest_category(when, outcome, xfail)
        if category:
            rec.counted.append(category)
        if when == "???":  # xdist's report for a test whose worker died
            rec.outcome = "crashed"
        elif outcome == "failed" and rec.outcome not in ("crashed", "failed", "error"):
            rec.outcome = "failed" if when == "call" else "error"
        elif outcome == "skipped" and rec.outcome == "passed":
            rec.outcome = "skipped"
        node = properties.get("gpu_node")
        if node is not None:
            rec.node = str(node)
        props = gpu_properties(properties.items())
        if "gpu_leases" in props:
            rec.leases = parse_spans(str(props["gpu_leases"]))
            rec.request = str(props.get("gpu_request", ""))
            rec.requested = int(props.get("gpu_request_bytes", 0) or 0)
            peaks = parse_peaks(str(props.get("gpu_peak_bytes", ""))).values()
            rec.peak = max(peaks) if peaks else None
        if "gpu_held" in props:
            rec.held = parse_held(str(props["gpu_held"]))
        if "gpu_wait_seconds" in props:
            rec.reported_wait = float(props["gpu_wait_seconds"])

    # -- figures --------------------------------------------------------------------

    def tests(self) -> list[TestRecord]:
        return sorted((r for r in self.records.values() if r.start != math.inf), key=lambda r: (r.start, r.nodeid))

    def bounds(self) -> tuple[float, float]:
        tests = self.tests()
        if not tests:
            return (0.0, 0.0)
        return (min(r.start for r in tests), max(max(r.stop, r.start) for r in tests))

    def makespan(self) -> float:
        begin, end = self.bounds()
        return end - begin

    def waited(self) -> float:
        """Seconds all tests of the run waited for GPUs: the one figure the summary prints."""
        return sum(r.waited for r in self.records.values())

    def busy(self, gpus: Iterable[int], node: str | None = None) -> dict[int, float]:
        """Per GPU: the fraction of the makespan during which some test, fixture or rank pool held a lease on it
        (``node``: that node's GPUs, as its tests' leases name them)."""
        makespan = self.makespan()
        tests = [r for r in self.tests() if node is None or r.node == node]
        leases = [s for r in tests for s in r.leases] + [s for r in tests for h in r.held for s in h.spans]
        out = {}
        for gpu in gpus:
            spans = sorted((s.granted, s.released) for s in leases if gpu in s.gpus)
            out[gpu] = _union(spans) / makespan if makespan > 0 else 0.0
        return out

    def node_words(self, node: str, gpus: Sequence[int]) -> str:
        """What ran on ``node`` (``--gpu-nodes``), for its summary line: tests, their busy time
        (setup, call and teardown summed), their waits for GPUs, and each of its GPUs' busy share."""
        tests = [r for r in self.tests() if r.node == node]
        busy = self.busy(gpus, node) if tests else {}
        words = (
            f"{plural(len(tests), 'test')} · busy {duration(sum(r.duration for r in tests))} · "
            f"waited {duration(sum(r.waited for r in tests))} for GPUs"
        )
        if busy:
            words += " · GPU busy " + " ".join(f"{g}:{busy[g]:.0%}" for g in gpus)
        return words

    def summary_lines(
        self, gpus: Sequence[int], with_peaks: bool, *, learn: bool = False, verbose: bool = False
    ) -> list[str]:
        tests = self.tests()
        if not tests:
            return []
        makespan = self.makespan()
        total = sum(r.duration for r in tests)
        busy = self.busy(gpus)
        waited = self.waited()
        # below 1x the figure measures gaps between tiny tests, not parallelism: leave it out
        parallel = f" ({total / makespan:.1f}x in parallel)" if makespan > 0 and total / makespan >= 1.05 else ""
        lines = [
            f"pytest-gpu: makespan {makespan:.1f}s · test time {total:.1f}s{parallel} · "
            f"waited {duration(waited)} for GPUs"
            + (" · GPU busy " + " ".join(f"{g}:{busy[g]:.0%}" for g in gpus) if gpus else "")
        ]
        heavy = sorted((r for r in tests if r.leases), key=lambda r: -r.gpu_seconds)[:5]
        if heavy:
            lines.append("pytest-gpu: largest GPU-second users:")
            lines += [f"  {r.gpu_seconds:7.1f} GPU-s  {r.nodeid}" for r in heavy]
        if with_peaks:
            lines += _request_lines(tests, learn, verbose)
        return lines


def _request_lines(
    tests: Sequence[TestRecord], learn: bool = False, verbose: bool = False, limit: int = 10
) -> list[str]:
    """Tests whose measured peak is above their request, or below a quarter of it, grouped by
    the request they should make (one line per size: a suite of 500 tests gets a few lines);
    ``verbose`` lists every test. An exclusive lease was not sized by its test: no suggestion
    for it unless ``learn`` (``--gpu-learn`` sizes such tests from their peaks)."""
    groups: dict[tuple[int, str], list[TestRecord]] = {}
    for rec in tests:
        if rec.peak is None or not rec.requested or rec.outcome in ("skipped", "crashed"):
            continue  # a peak that was not measured (None) is not zero: nothing to suggest from it
        if rec.exclusive and not learn:
            continue
        if rec.peak > rec.requested:  # also when verification failed the test for it
            why = "above"
        elif rec.peak < rec.requested / 4 and rec.outcome == "passed":  # a failed test may stop early
            why = "far below"
        else:
            continue
        groups.setdefault((suggest(rec.peak), why), []).append(rec)
    if not groups:
        return []
    # above first (those would run out of memory), then the largest groups
    order = sorted(groups.items(), key=lambda kv: (kv[0][1] != "above", -len(kv[1]), kv[0][0]))
    if verbose:
        return ["pytest-gpu: requests that do not match the measured peak:"] + [
            _one(rec, why, size) for (size, why), recs in order for rec in recs
        ]
    lines = [_one(recs[0], why, size) if len(recs) == 1 else _group(recs, why, size) for (size, why), recs in order]
    more = (
        [f"  ... and {plural(len(lines) - limit, 'more suggestion')} (-v lists every test)"]
        if len(lines) > limit
        else []
    )
    return ["pytest-gpu: requests that do not match the measured peak:", *lines[:limit], *more]


def _one(rec: TestRecord, why: str, size: int) -> str:
    asked = "a whole GPU" if rec.exclusive else format_size(rec.requested)
    peak = format_size(rec.peak or 0)
    return f'  {rec.nodeid}: asked {asked}, peaked at {peak} ({why}): suggest memory="{format_size(size)}"'


def _group(recs: Sequence[TestRecord], why: str, size: int, shown: int = 3) -> str:
    top = max(rec.peak or 0 for rec in recs)
    names = ", ".join(rec.nodeid for rec in recs[:shown])
    rest = f" and {len(recs) - shown} more (-v lists them)" if len(recs) > shown else ""
    return (
        f'  suggest memory="{format_size(size)}" for {len(recs)} tests that peaked {why} their request '
        f"(at most {format_size(top)}): {names}{rest}"
    )


def suggest(peak: int) -> int:
    """A request for a test that peaked at ``peak`` bytes: 1.25x, rounded up to 256 MiB."""
    wanted = max(int(peak * 1.25), SUGGEST_FLOOR)
    return -(-wanted // SUGGEST_FLOOR) * SUGGEST_FLOOR


def _union(spans: Sequence[tuple[float, float]]) -> float:
    total = 0.0
    current_start = current_end = None
    for start, end in spans:
        if current_end is None or start > current_end:
            if current_end is not None and current_start is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None and current_start is not None:
        total += current_end - current_start
    return total
