"""A run trace (``pytest --gpu-trace``) drawn as a Gantt chart picture.

Two halves: a pure one that validates the trace and lays it out as rows and bars
(`load_trace`, `build_chart`; no matplotlib needed, so it is unit-testable anywhere),
and `render`, which draws a `Chart` with matplotlib (the optional ``report`` extra).
"""

from __future__ import annotations

import io
import json
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeGuard, cast
from xml.sax.saxutils import escape

from ..base.safefiles import replace_file
from .trace import GPU_PID, WORKERS_PID

EXPECTED = "expected a trace written by pytest --gpu-trace"
MAX_DEPTH = 12  # a trace nests 7 levels deep: one nested deeper is not ours (and costs a stack to read)
FORMATS = ("png", "svg")

# Okabe-Ito colours: distinguishable with the common colour-vision deficiencies.
OUTCOME_COLORS: dict[str, str] = {
    "passed": "#009E73",
    "failed": "#D55E00",
    "error": "#CC79A7",
    "crashed": "#000000",
    "skipped": "#BBBBBB",
}
UNKNOWN_COLOR = "#0072B2"
WAIT_COLOR = "#F0E442"
EXCLUSIVE_HATCH = "///"

# Layout in row units (a worker row is 1 unit tall); rows grow downwards from y=0.
_PAD = 0.12  # empty space above and below the bars of a row
_GROUP_GAP = 0.5  # between the GPU rows and the worker rows
_MAX_GPU_ROW = 3.0  # a GPU with many tenants gets a taller row, up to this

# Drawing, in inches and points.
_FIG_WIDTH = 14.0
_LEFT, _RIGHT, _TOP, _BOTTOM = 1.5, 0.3, 0.6, 0.95
_MIN_HEIGHT, _MAX_HEIGHT, _INCH_PER_UNIT = 3.0, 24.0, 0.3
_CHAR_WIDTH = 0.6  # average glyph width, in ems, for deciding whether a label fits
_MIN_CUT = 8  # a cut label shorter than this ("tes…") is noise, not information
_MIN_FONT = 4.0  # points: a bar's key number is drawn at least this large, however thin the bar
_KEY_FONT, _KEY_LINE = 7.0, 10.0  # points: the key's text, and its line pitch
_MAX_KEY_LINES = 150  # lines per column of the key at most (a huge run's picture stays sane)


class TraceError(ValueError):
    """A file that is not a readable pytest-gpu trace; the message says what was expected."""


class MissingMatplotlib(ImportError):
    """matplotlib (the ``report`` extra) is not installed."""

    def __init__(self) -> None:
        super().__init__("needs matplotlib (pip install 'pytest-gpu[report]')")


@dataclass(frozen=True)
class Row:
    """One horizontal track: a GPU (split into ``lanes`` for concurrent tenants) or a worker."""

    label: str
    kind: Literal["gpu", "worker"]
    y: float  # top edge, in row units
    height: float
    lanes: int


@dataclass(frozen=True)
class Bar:
    """One span on a row, in seconds from the run start, already placed and styled."""

    row: int  # index into Chart.rows
    kind: Literal["test", "wait", "lease"]
    start: float
    end: float
    label: str
    nodeid: str
    outcome: str | None
    color: str
    y: float  # top edge, in row units
    height: float
    exclusive: bool = False
    hatch: str | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Chart:
    """A trace laid out for drawing: rows top to bottom, bars in drawing order."""

    title: str
    inventory: str
    makespan: float
    rows: tuple[Row, ...]
    bars: tuple[Bar, ...]
    # every test's (or holder's) number, in order of first start: what a bar too short for
    # its name shows, and what the key below the picture spells out (see bar_text)
    keys: Mapping[str, int] = field(default_factory=dict)
    # outcome -> how many times pytest's closing line counts it (see pytest_counts)
    counts: Mapping[str, int] = field(default_factory=dict)

    def full_name(self, bar: Bar) -> str:
        """What a bar stands for, whole: the test's node id, or the holder's name."""
        return bar.nodeid or bar.label

    def key(self, bar: Bar) -> int:
        return self.keys[self.full_name(bar)]

    @property
    def height(self) -> float:
        """Total height in row units."""
        return max((row.y + row.height for row in self.rows), default=1.0)

    @property
    def tests(self) -> tuple[Bar, ...]:
        return tuple(bar for bar in self.bars if bar.kind == "test")

    def summary(self) -> str:
        """One line: tests, GPUs, workers, makespan and the outcomes as pytest's closing line
        counts them ("3 passed, 1 error", in its order: a test may count twice)."""
        gpus = sum(row.kind == "gpu" for row in self.rows)
        workers = sum(row.kind == "worker" for row in self.rows)
        order = {outcome: n for n, outcome in enumerate(_PYTEST_ORDER)}
        ranked = sorted(self.counts.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0]))
        counts = ", ".join(_plural(n, outcome) if outcome == "error" else f"{n} {outcome}" for outcome, n in ranked)
        line = (
            f"{_plural(len(self.tests), 'test')} on {_plural(gpus, 'GPU')}, {_plural(workers, 'worker')}, "
            f"makespan {format_seconds(self.makespan)} s"
        )
        return f"{line} ({counts})" if counts else line


# the order of pytest's closing line (its KNOWN_TYPES), where it says "errors"
_PYTEST_ORDER = ("failed", "passed", "skipped", "xfailed", "xpassed", "error")


def pytest_counts(spans: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Outcome -> count over the test spans' ``args``, as pytest's closing line counts them:
    each span's ``counted`` (a phase at a time); a trace from before it was written, the
    span's one ``outcome``."""
    counts: Counter[str] = Counter()
    for args in spans:
        counted = args.get("counted")
        if isinstance(counted, list):
            counts.update(str(c) for c in counted)
        else:
            counts[str(args.get("outcome") or "unknown")] += 1
    return dict(counts)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def format_seconds(seconds: float) -> str:
    """Seconds with precision that suits their size (0.42, 12.3, 345)."""
    if seconds < 10:
        return f"{seconds:.2f}"
    if seconds < 100:
        return f"{seconds:.1f}"
    return f"{seconds:.0f}"


def outcome_color(outcome: str | None) -> str:
    """The fill colour for a test outcome."""
    return OUTCOME_COLORS.get(outcome or "", UNKNOWN_COLOR)


def fit_label(label: str, width_pt: float, fontsize: float) -> str:
    """``label`` as it fits a bar ``width_pt`` wide: whole, cut with an ellipsis, or empty."""
    room = int((width_pt - fontsize * 0.5) / (fontsize * _CHAR_WIDTH))
    if len(label) <= room:
        return label
    if room >= _MIN_CUT:
        return label[: room - 1] + "…"
    return ""


def bar_text(label: str, key: int, width_pt: float, fontsize: float) -> tuple[str, bool]:
    """What a bar ``width_pt`` wide shows, and whether it is abbreviated: its whole label where
    it fits; else its key and as much of the label as fits ("12 test_lo…"); else its key
    alone, which every bar shows however short (the key below the picture names it)."""
    if fit_label(label, width_pt, fontsize) == label:
        return label, False
    return fit_label(f"{key} {label}", width_pt, fontsize) or str(key), True


# -- reading and validating -------------------------------------------------------


def load_trace(path: str | Path) -> dict[str, Any]:
    """Read a trace file; `TraceError` (without the path, which the caller names) if it is not one."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TraceError(f"no such file; {EXPECTED}") from None
    except UnicodeDecodeError:
        raise TraceError(f"not JSON (not UTF-8 text); {EXPECTED}") from None
    except OSError as exc:
        raise TraceError(f"cannot read it ({exc.strerror or exc}); {EXPECTED}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"not JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); {EXPECTED}") from None
    except RecursionError:  # the decoder's own bound, far deeper than MAX_DEPTH
        raise TraceError(f"nested deeper than {MAX_DEPTH} levels; {EXPECTED}") from None
    if _depth(data) > MAX_DEPTH:
        raise TraceError(f"nested deeper than {MAX_DEPTH} levels; {EXPECTED}")
    _metadata(data)
    return cast("dict[str, Any]", data)  # _metadata checked it is a JSON object


def _depth(data: object) -> int:
    """How deep ``data`` nests (a scalar: 0), counted without recursion."""
    deepest = 0
    todo: list[tuple[object, int]] = [(data, 0)]
    while todo:
        item, level = todo.pop()
        if isinstance(item, dict):
            children: Sequence[object] = list(item.values())
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, level + 1)
        if deepest > MAX_DEPTH:
            break
        todo.extend((child, level + 1) for child in children)
    return deepest


def _metadata(data: object) -> Mapping[str, Any]:
    other = data.get("otherData") if isinstance(data, Mapping) else None
    meta = other.get("pytest_gpu") if isinstance(other, Mapping) else None
    if not isinstance(data, Mapping) or not isinstance(meta, Mapping):
        raise TraceError(f"not a pytest-gpu trace (no otherData.pytest_gpu); {EXPECTED}")
    if not isinstance(data.get("traceEvents"), list):
        raise TraceError(f"traceEvents is missing or not a list; {EXPECTED}")
    return meta


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class _Span:
    cat: str
    name: str
    pid: int
    tid: int
    start: float
    end: float
    args: Mapping[str, Any]


def _spans(events: Sequence[object]) -> list[_Span]:
    """The test, wait and lease spans; other events are left to other readers of the trace."""
    spans: list[_Span] = []
    for i, event in enumerate(events):
        if not isinstance(event, Mapping) or event.get("ph") != "X":
            continue
        cat = event.get("cat")
        if cat not in ("test", "wait", "lease"):
            continue
        ts, dur, pid, tid = (event.get(key) for key in ("ts", "dur", "pid", "tid"))
        if not (_is_number(ts) and _is_number(dur) and _is_int(pid) and _is_int(tid)):
            raise TraceError(
                f"traceEvents[{i}] ({cat} {event.get('name')!r}) needs numeric ts and dur and integer pid and tid; "
                f"{EXPECTED}"
            )
        args = event.get("args")
        args = args if isinstance(args, Mapping) else {}
        start = ts / 1e6
        spans.append(_Span(cat, str(event.get("name", "")), pid, tid, start, start + max(dur, 0) / 1e6, args))
    return spans


def _names(events: Sequence[object]) -> tuple[dict[int, str], dict[tuple[int, int], str]]:
    """process_name and thread_name metadata: pid -> name, (pid, tid) -> name."""
    processes: dict[int, str] = {}
    threads: dict[tuple[int, int], str] = {}
    for event in events:
        if not isinstance(event, Mapping) or event.get("ph") != "M":
            continue
        pid, tid, args = event.get("pid"), event.get("tid"), event.get("args")
        name = args.get("name") if isinstance(args, Mapping) else None
        if not _is_int(pid) or not isinstance(name, str):
            continue
        if event.get("name") == "process_name":
            processes[pid] = name
        elif event.get("name") == "thread_name" and _is_int(tid):
            threads[(pid, tid)] = name
    return processes, threads


# -- layout -----------------------------------------------------------------------


def build_chart(data: Mapping[str, Any], *, title: str | None = None) -> Chart:
    """Lay a trace out as rows (GPUs, then workers) and bars; `TraceError` if it is malformed."""
    meta = _metadata(data)
    events: list[object] = data["traceEvents"]
    spans = _spans(events)
    processes, threads = _names(events)

    # --gpu-nodes: each node's workers are a process of their own (their tids are the run's)
    worker_pids = {WORKERS_PID}
    for node in meta.get("nodes") or []:
        if isinstance(node, Mapping) and _is_int(node.get("workers_pid")):
            worker_pids.add(node["workers_pid"])
    # GPU rows: every GPU the trace lists (idle ones too), and any that only leases name.
    gpu_pids: set[int] = set()
    for gpu in meta.get("gpus") or []:
        if isinstance(gpu, Mapping) and _is_int(gpu.get("index")):
            gpu_pids.add(GPU_PID + gpu["index"])
    gpu_pids.update(pid for pid in processes if pid >= GPU_PID and pid not in worker_pids)
    gpu_pids.update(span.pid for span in spans if span.cat == "lease")

    # Worker rows: tid = position in the workers list + 1, as the trace writer numbers them.
    worker_tids: dict[int, str] = {}
    for position, name in enumerate(meta.get("workers") or []):
        worker_tids[position + 1] = str(name)
    for (pid, tid), name in threads.items():
        if pid in worker_pids:
            worker_tids[tid] = name
    for span in spans:
        if span.cat in ("test", "wait") and span.tid not in worker_tids:
            worker_tids[span.tid] = str(span.args.get("worker") or f"worker {span.tid}")

    rows: list[Row] = []
    gpu_lanes: dict[int, dict[int, int]] = {}  # pid -> tid -> lane index
    y = 0.0
    for pid in sorted(gpu_pids):
        tids = {tid for (p, tid) in threads if p == pid}
        tids.update(span.tid for span in spans if span.cat == "lease" and span.pid == pid)
        lanes = {tid: lane for lane, tid in enumerate(sorted(tids))}
        gpu_lanes[pid] = lanes
        height = min(_MAX_GPU_ROW, 0.5 + 0.5 * max(len(lanes), 1))
        rows.append(Row(processes.get(pid, f"GPU {pid - GPU_PID}"), "gpu", y, height, max(len(lanes), 1)))
        y += height
    if rows and worker_tids:
        y += _GROUP_GAP
    worker_rows: dict[int, int] = {}
    for tid in sorted(worker_tids):
        worker_rows[tid] = len(rows)
        rows.append(Row(worker_tids[tid], "worker", y, 1.0, 1))
        y += 1.0
    gpu_rows = {pid: i for i, pid in enumerate(sorted(gpu_pids))}

    outcomes = {str(s.args.get("nodeid")): s.args.get("outcome") for s in spans if s.cat == "test"}
    bars: list[Bar] = []
    for span in spans:
        nodeid = str(span.args.get("nodeid", ""))
        if span.cat == "lease" and span.pid in gpu_rows:
            row = rows[gpu_rows[span.pid]]
            exclusive = bool(span.args.get("exclusive"))
            top, height = row.y + _PAD, row.height - 2 * _PAD
            if not exclusive:  # a shared tenant takes its lane; an exclusive one has the GPU to itself
                height /= row.lanes
                top += gpu_lanes[span.pid].get(span.tid, 0) * height
            outcome = span.args.get("outcome") or outcomes.get(nodeid)
            bars.append(
                Bar(
                    gpu_rows[span.pid],
                    "lease",
                    span.start,
                    span.end,
                    span.name,
                    nodeid,
                    outcome,
                    outcome_color(outcome),
                    top,
                    height,
                    exclusive,
                    EXCLUSIVE_HATCH if exclusive else None,
                )
            )
        elif span.cat in ("test", "wait") and span.pid in worker_pids:
            index = worker_rows[span.tid]
            row = rows[index]
            outcome = span.args.get("outcome") if span.cat == "test" else None
            color = outcome_color(outcome) if span.cat == "test" else WAIT_COLOR
            kind: Literal["test", "wait"] = "test" if span.cat == "test" else "wait"
            bars.append(
                Bar(index, kind, span.start, span.end, span.name, nodeid, outcome, color, row.y + _PAD, 1 - 2 * _PAD)
            )
    # Waits sit inside their test span, so they must be drawn after (over) it.
    bars.sort(key=lambda bar: (bar.kind == "wait", bar.row, bar.start))

    inventory = str(meta.get("inventory") or meta.get("source") or "")
    ends = max((bar.end for bar in bars), default=0.0)
    makespan = meta.get("makespan")
    makespan = max(float(makespan), ends) if _is_number(makespan) else ends
    if title is None:
        title = f"pytest-gpu run: {inventory}, makespan {format_seconds(makespan)} s"
    keys: dict[str, int] = {}
    for bar in sorted(bars, key=lambda bar: (bar.start, bar.row)):
        if bar.kind != "wait":
            keys.setdefault(bar.nodeid or bar.label, len(keys) + 1)
    for bar in bars:  # a wait whose test has no bar of its own
        keys.setdefault(bar.nodeid or bar.label, len(keys) + 1)
    counts = pytest_counts([span.args for span in spans if span.cat == "test" and span.pid in worker_pids])
    return Chart(title, inventory, makespan, tuple(rows), tuple(bars), keys, counts)


# -- drawing ----------------------------------------------------------------------


def figure_height(chart: Chart) -> float:
    """Inches: grows with the rows, within bounds so a huge run stays a sane picture (the key
    below it, :func:`key_height`, comes on top)."""
    return min(_MAX_HEIGHT, max(_MIN_HEIGHT, _TOP + _BOTTOM + _INCH_PER_UNIT * chart.height))


@dataclass(frozen=True)
class Label:
    """The text a bar shows: ``text`` at ``fontsize``; ``abbreviated``: the key names it in full."""

    bar: Bar
    text: str
    fontsize: float
    abbreviated: bool
    rotation: int = 0  # 90: a key number upright, in a bar narrower than it is wide


def bar_labels(chart: Chart, height: float | None = None) -> list[Label]:
    """Every test's and lease's bar with its text, laid out as :func:`render` draws the chart
    in a figure ``height`` inches tall (default :func:`figure_height`). Waits show their
    colour only (they sit on their test's bar)."""
    height = figure_height(chart) if height is None else height
    ax_width, ax_height = _FIG_WIDTH - _LEFT - _RIGHT, height - _TOP - _BOTTOM
    unit_pt = ax_height * 72 / chart.height
    pt_per_second = ax_width * 72 / (chart.makespan * 1.01 or 1.0)
    out = []
    for bar in chart.bars:
        if bar.kind == "wait":
            continue
        fontsize = max(_MIN_FONT, min(7.0, bar.height * unit_pt * 0.7))
        width = bar.duration * pt_per_second
        text, abbreviated = bar_text(bar.label, chart.key(bar), width, fontsize)
        if abbreviated and len(text) * fontsize * _CHAR_WIDTH > width:  # the key alone, wider than its bar:
            # upright, so that the keys of neighbouring short tests do not run into each other
            out.append(Label(bar, text, max(_MIN_FONT, min(fontsize, width)), abbreviated, 90))
        else:
            out.append(Label(bar, text, fontsize, abbreviated))
    return out


def key_lines(chart: Chart, labels: Sequence[Label]) -> list[str]:
    """The key below the picture: ``12  tests/test_x.py::test_long_name[param]`` for every
    test or holder some bar shows abbreviated, in key order."""
    shown = {chart.key(label.bar) for label in labels if label.abbreviated}
    names = {key: name for name, key in chart.keys.items()}
    width = len(str(max(shown, default=0)))
    return [f"{key:>{width}}  {names[key]}" for key in sorted(shown)]


def key_layout(lines: Sequence[str]) -> tuple[int, list[list[str]], int]:
    """The key's columns (count, then each column's lines) and the lines left out where a
    huge run's key would not fit (:data:`_MAX_KEY_LINES` lines at most)."""
    if not lines:
        return 0, [], 0
    widest = max(len(line) for line in lines) * _KEY_FONT * _CHAR_WIDTH + 24  # points
    columns = max(1, min(4, int((_FIG_WIDTH - 0.6) * 72 // widest)))
    per_column = -(-len(lines) // columns)
    left_out = 0
    if per_column > _MAX_KEY_LINES:
        per_column = _MAX_KEY_LINES
        left_out = len(lines) - per_column * columns + 1  # the last line says how many
        lines = list(lines[: per_column * columns - 1])
    return columns, [list(lines[i : i + per_column]) for i in range(0, len(lines), per_column)], left_out


def key_height(lines: Sequence[str]) -> float:
    """Inches the key takes below the chart (0 without one)."""
    _, cols, left_out = key_layout(lines)
    rows = max((len(c) for c in cols), default=0) + (1 if left_out else 0)
    return 0.0 if not rows else 0.25 + rows * _KEY_LINE / 72


def render(chart: Chart, out: str | Path, fmt: str, *, dpi: int = 100) -> None:
    """Draw ``chart`` and save it to ``out`` as ``fmt`` (png or svg).

    Every test's and lease's bar is labelled: its name where it fits, else its key number
    with as much of the name as fits; the key below the chart names those in full. In an
    SVG, every bar also carries its full name and times as a tooltip (``<title>``).

    The picture is written aside under an unpredictable name, then renamed over ``out``: a
    link planted at ``out`` (a shared directory) is replaced, never followed.

    Raises `MissingMatplotlib` without matplotlib, and OSError if ``out`` cannot be written.
    """
    try:
        # matplotlib itself first: a cached submodule would import even with it blocked.
        import matplotlib  # noqa: F401
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise MissingMatplotlib() from None

    # Figure directly, not pyplot: no GUI backend, no global state.
    base = figure_height(chart)
    labels = bar_labels(chart, base)
    key = key_lines(chart, labels)
    below = key_height(key)
    height = base + below
    fig = Figure(figsize=(_FIG_WIDTH, height), dpi=dpi)
    ax_width, ax_height = _FIG_WIDTH - _LEFT - _RIGHT, base - _TOP - _BOTTOM
    ax = fig.add_axes((_LEFT / _FIG_WIDTH, (_BOTTOM + below) / height, ax_width / _FIG_WIDTH, ax_height / height))
    xmax = chart.makespan * 1.01 or 1.0
    ax.set_xlim(0, xmax)
    ax.set_ylim(chart.height, 0)  # first row on top
    ax.set_xlabel("seconds from run start")
    ax.set_title(chart.title, fontsize=11, loc="left")
    ax.grid(axis="x", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)

    unit_pt = ax_height * 72 / chart.height
    ax.set_yticks([row.y + row.height / 2 for row in chart.rows])
    ax.set_yticklabels([row.label for row in chart.rows], fontsize=max(4.0, min(9.0, unit_pt * 0.55)))
    ax.tick_params(axis="y", length=0)
    for i, row in enumerate(chart.rows):
        if i % 2:  # banding makes a long row easy to follow across the picture
            ax.axhspan(row.y, row.y + row.height, color="#f4f4f4", zorder=0, linewidth=0)
    workers = [row for row in chart.rows if row.kind == "worker"]
    if workers and len(workers) < len(chart.rows):
        ax.axhline(workers[0].y - _GROUP_GAP / 2, color="#888888", linewidth=0.8)

    tooltips: dict[str, str] = {}
    for hatch in (None, EXCLUSIVE_HATCH):
        group = [bar for bar in chart.bars if bar.hatch == hatch]
        for kind in ("test", "lease", "wait"):  # waits over their tests
            bars = [bar for bar in group if bar.kind == kind]
            if bars:
                drawn = ax.barh(
                    [bar.y for bar in bars],
                    [max(bar.duration, xmax * 1e-4) for bar in bars],  # an instant still shows
                    left=[bar.start for bar in bars],
                    height=[bar.height for bar in bars],
                    align="edge",
                    color=[bar.color for bar in bars],
                    edgecolor="#333333",
                    linewidth=0.3,
                    hatch=hatch,
                )
                for bar, patch in zip(bars, drawn.patches, strict=True):
                    gid = f"pytest-gpu-bar-{len(tooltips)}"
                    patch.set_gid(gid)
                    tooltips[gid] = tooltip(chart, bar)

    for label in labels:
        bar = label.bar
        dark = bar.color in (OUTCOME_COLORS["crashed"], UNKNOWN_COLOR)
        ax.text(
            bar.start + max(bar.duration, xmax * 1e-4) / 2,
            bar.y + bar.height / 2,
            label.text,
            ha="center",
            va="center",
            fontsize=label.fontsize,
            rotation=label.rotation,
            color="white" if dark else "black",
            clip_on=True,
        )

    handles = [
        Patch(facecolor=color, edgecolor="#333333", linewidth=0.3, label=outcome)
        for outcome, color in OUTCOME_COLORS.items()
        if any(bar.outcome == outcome for bar in chart.bars)
    ]
    if any(bar.color == UNKNOWN_COLOR for bar in chart.bars):
        handles.append(Patch(facecolor=UNKNOWN_COLOR, edgecolor="#333333", linewidth=0.3, label="unknown"))
    if any(bar.kind == "wait" for bar in chart.bars):
        handles.append(Patch(facecolor=WAIT_COLOR, edgecolor="#333333", linewidth=0.3, label="waiting for GPU"))
    if any(bar.exclusive for bar in chart.bars):
        handles.append(Patch(facecolor="white", edgecolor="#333333", hatch=EXCLUSIVE_HATCH, label="exclusive GPU"))
    if handles:
        fig.legend(
            handles=handles,
            loc="lower center",
            bbox_to_anchor=(0.5, below / height),
            ncol=len(handles),
            frameon=False,
            fontsize=8,
        )
    _draw_key(fig, key, below, height)

    # No timestamp in the SVG, so the same trace gives the same file.
    metadata = {"Date": None} if fmt == "svg" else None
    if fmt != "svg":
        picture = io.BytesIO()
        fig.savefig(picture, format=fmt, metadata=metadata)
        data = picture.getvalue()
    else:
        buffer = io.StringIO()
        fig.savefig(buffer, format=fmt, metadata=metadata)
        data = with_tooltips(buffer.getvalue(), tooltips).encode("utf-8")
    replace_file(Path(out), data, 0o644)  # os.umask() cannot be read without setting it: not with threads


def _draw_key(fig: Any, lines: Sequence[str], below: float, height: float) -> None:
    """The key below the chart: the full names of the bars that show a number."""
    columns, cols, left_out = key_layout(lines)
    if not cols:
        return
    width = (_FIG_WIDTH - 0.6) / columns
    top = (below - 0.15) / height
    fig.text(0.3 / _FIG_WIDTH, top + 0.02 / height, "key:", fontsize=_KEY_FONT, fontweight="bold", va="bottom")
    for c, column in enumerate(cols):
        for r, line in enumerate(column):
            y = top - (r + 1) * _KEY_LINE / 72 / height
            fig.text((0.3 + c * width) / _FIG_WIDTH, y, line, fontsize=_KEY_FONT, va="bottom", family="monospace")
    if left_out:
        y = top - (max(len(c) for c in cols) + 1) * _KEY_LINE / 72 / height
        fig.text(
            0.3 / _FIG_WIDTH,
            y,
            f"... and {left_out} more: every bar of the SVG picture (--format svg) names its test as a tooltip",
            fontsize=_KEY_FONT,
            va="bottom",
        )


def tooltip(chart: Chart, bar: Bar) -> str:
    """A bar's tooltip in the SVG picture: its full name, what it is, when."""
    what = {"test": bar.outcome or "unknown outcome", "wait": "waiting for a GPU", "lease": "GPU lease"}[bar.kind]
    if bar.kind == "lease":
        what = f"{what} on {chart.rows[bar.row].label}{', exclusive' if bar.exclusive else ''}"
    return (
        f"[{chart.key(bar)}] {chart.full_name(bar)}: {what}, {format_seconds(bar.start)} s to "
        f"{format_seconds(bar.end)} s ({format_seconds(bar.duration)} s)"
    )


def with_tooltips(svg: str, tooltips: Mapping[str, str]) -> str:
    """``svg`` (matplotlib's) with a ``<title>`` in each group whose id ``tooltips`` names."""

    def add(match: re.Match[str]) -> str:
        text = tooltips.get(match.group(1))
        return match.group(0) if text is None else f"{match.group(0)}\n   <title>{escape(text)}</title>"

    return re.sub(r'<g id="(pytest-gpu-bar-\d+)">', add, svg)
