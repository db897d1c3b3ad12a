"""``pytest-gpu report``: a run trace drawn as a Gantt chart (pytest_gpu.report.gantt and the CLI)."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from conftest import require
from pytest_gpu.cli import main
from pytest_gpu.report import gantt

GIB = 2**30
EXPECTED = "expected a trace written by pytest --gpu-trace"


def _test(tid: int, name: str, start: float, dur: float, outcome: str, gpus: list[int]) -> dict[str, Any]:
    return {
        "ph": "X",
        "cat": "test",
        "name": name,
        "pid": 1,
        "tid": tid,
        "ts": start * 1e6,
        "dur": dur * 1e6,
        "args": {
            "nodeid": f"test_m.py::{name}",
            "worker": f"gw{tid - 1}",
            "outcome": outcome,
            "gpus": gpus,
            "request": "1 GPU x 4GiB" if gpus else None,
            "wait_s": 0.0,
        },
    }


def _lease(gpu: int, lane: int, name: str, start: float, dur: float, outcome: str, exclusive: bool = False):
    return {
        "ph": "X",
        "cat": "lease",
        "name": name,
        "pid": 100 + gpu,
        "tid": lane,
        "ts": start * 1e6,
        "dur": dur * 1e6,
        "args": {
            "nodeid": f"test_m.py::{name}",
            "worker": "gw0",
            "gpu": gpu,
            "memory": 16 * GIB if exclusive else 4 * GIB,
            "exclusive": exclusive,
            "peak": None,
            "outcome": outcome,
        },
    }


def make_trace() -> dict[str, Any]:
    """2 GPUs, 2 workers; on GPU 0 test_a and test_c share (lanes 1, 2), test_d waits for it;
    test_b has GPU 1 to itself and fails; test_e is skipped without a GPU."""
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "workers"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "gw0"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 2, "args": {"name": "gw1"}},
        {"ph": "M", "name": "process_name", "pid": 100, "args": {"name": "GPU 0 (16GiB)"}},
        {"ph": "M", "name": "thread_name", "pid": 100, "tid": 1, "args": {"name": "GPU 0 / 1"}},
        {"ph": "M", "name": "thread_name", "pid": 100, "tid": 2, "args": {"name": "GPU 0 / 2"}},
        {"ph": "M", "name": "process_name", "pid": 101, "args": {"name": "GPU 1 (16GiB)"}},
        {"ph": "M", "name": "thread_name", "pid": 101, "tid": 1, "args": {"name": "GPU 1 / 1"}},
        _test(1, "test_a", 0.0, 2.0, "passed", [0]),
        _lease(0, 1, "test_a", 0.0, 2.0, "passed"),
        _test(1, "test_b", 2.0, 3.0, "failed", [1]),
        _lease(1, 1, "test_b", 2.0, 3.0, "failed", exclusive=True),
        _test(1, "test_e", 5.0, 0.5, "skipped", []),
        _test(2, "test_c", 0.0, 3.0, "passed", [0]),
        _lease(0, 2, "test_c", 0.0, 3.0, "passed"),
        _test(2, "test_d", 3.0, 3.0, "passed", [0]),
        {
            "ph": "X",
            "cat": "wait",
            "name": "wait for GPU",
            "pid": 1,
            "tid": 2,
            "ts": 3.0e6,
            "dur": 1.0e6,
            "args": {"nodeid": "test_m.py::test_d", "request": "1 GPU x 4GiB"},
        },
        _lease(0, 1, "test_d", 4.0, 2.0, "passed"),
        {"ph": "C", "name": "leased memory", "pid": 100, "ts": 0, "args": {"GiB": 8.0}},
    ]
    return {
        "displayTimeUnit": "ms",
        "otherData": {
            "pytest_gpu": {
                "version": 1,
                "inventory": "2 simulated GPUs (2x16GiB)",
                "source": "sim:2x16GiB",
                "gpus": [{"index": 0, "memory": 16 * GIB}, {"index": 1, "memory": 16 * GIB}],
                "started": 1_700_000_000.0,
                "makespan": 6.25,
                "workers": ["gw0", "gw1"],
            }
        },
        "traceEvents": events,
    }


def _bar(chart: gantt.Chart, kind: str, label: str) -> gantt.Bar:
    (bar,) = [bar for bar in chart.bars if bar.kind == kind and bar.label == label]
    return bar


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    path = tmp_path / "run.trace.json"
    path.write_text(json.dumps(make_trace()))
    return path


# -- the pure part ----------------------------------------------------------------


def test_rows_gpus_then_workers():
    chart = gantt.build_chart(make_trace())
    assert [(row.label, row.kind, row.lanes) for row in chart.rows] == [
        ("GPU 0 (16GiB)", "gpu", 2),
        ("GPU 1 (16GiB)", "gpu", 1),
        ("gw0", "worker", 1),
        ("gw1", "worker", 1),
    ]
    gpu0, gpu1, gw0, gw1 = chart.rows
    assert gpu0.height > gpu1.height == gw0.height  # two tenants get a taller row
    # Top to bottom without overlap, and a gap between GPUs and workers.
    assert gpu0.y == 0 and gpu1.y == gpu0.y + gpu0.height and gw0.y > gpu1.y + gpu1.height
    assert gw1.y == gw0.y + gw0.height and chart.height == gw1.y + gw1.height


def test_bars_in_seconds_on_their_rows():
    chart = gantt.build_chart(make_trace())
    assert sorted((bar.kind, bar.label, bar.row, bar.start, bar.end) for bar in chart.bars) == [
        ("lease", "test_a", 0, 0.0, 2.0),
        ("lease", "test_b", 1, 2.0, 5.0),
        ("lease", "test_c", 0, 0.0, 3.0),
        ("lease", "test_d", 0, 4.0, 6.0),
        ("test", "test_a", 2, 0.0, 2.0),
        ("test", "test_b", 2, 2.0, 5.0),
        ("test", "test_c", 3, 0.0, 3.0),
        ("test", "test_d", 3, 3.0, 6.0),
        ("test", "test_e", 2, 5.0, 5.5),
        ("wait", "wait for GPU", 3, 3.0, 4.0),
    ]
    assert _bar(chart, "test", "test_d").duration == 3.0
    assert _bar(chart, "lease", "test_a").nodeid == "test_m.py::test_a"
    assert chart.makespan == 6.25  # the trace's own, not the last bar's end
    assert chart.bars[-1].kind == "wait"  # drawn over its test


def test_colours_by_outcome_and_wait():
    chart = gantt.build_chart(make_trace())
    assert _bar(chart, "test", "test_b").color == _bar(chart, "lease", "test_b").color == gantt.OUTCOME_COLORS["failed"]
    assert _bar(chart, "test", "test_a").color == gantt.OUTCOME_COLORS["passed"]
    assert _bar(chart, "test", "test_e").color == gantt.OUTCOME_COLORS["skipped"]
    wait = _bar(chart, "wait", "wait for GPU")
    assert wait.color == gantt.WAIT_COLOR and wait.outcome is None
    assert len(set(gantt.OUTCOME_COLORS.values()) | {gantt.WAIT_COLOR, gantt.UNKNOWN_COLOR}) == 7
    assert gantt.outcome_color("xpassed") == gantt.outcome_color(None) == gantt.UNKNOWN_COLOR


def test_shared_leases_take_lanes_exclusive_takes_the_row():
    chart = gantt.build_chart(make_trace())
    gpu0, gpu1 = chart.rows[:2]
    a, c, d = (_bar(chart, "lease", name) for name in ("test_a", "test_c", "test_d"))
    assert a.height == c.height < gpu0.height / 2
    assert a.y + a.height <= c.y  # lane 1 above lane 2, no overlap
    assert d.y == a.y  # the same lane as test_a, later
    assert gpu0.y < a.y and c.y + c.height < gpu0.y + gpu0.height
    assert not a.exclusive and a.hatch is None
    b = _bar(chart, "lease", "test_b")
    assert b.exclusive and b.hatch == gantt.EXCLUSIVE_HATCH
    assert gpu1.y < b.y and b.y + b.height < gpu1.y + gpu1.height


def test_lease_outcome_falls_back_to_its_test():
    trace = make_trace()
    for event in trace["traceEvents"]:
        if event.get("cat") == "lease":
            del event["args"]["outcome"]
    chart = gantt.build_chart(trace)
    assert _bar(chart, "lease", "test_b").outcome == "failed"


def test_title_and_summary():
    chart = gantt.build_chart(make_trace())
    assert chart.title == "pytest-gpu run: 2 simulated GPUs (2x16GiB), makespan 6.25 s"
    assert gantt.build_chart(make_trace(), title="nightly").title == "nightly"
    assert chart.summary() == "5 tests on 2 GPUs, 2 workers, makespan 6.25 s (1 failed, 3 passed, 1 skipped)"


def test_the_summary_counts_each_span_as_pytest_counted_it():
    """``counted`` (a phase at a time) rather than the one outcome of a bar: a passing call with
    a teardown that raised is "passed" and "error"; a trace without it counts its outcomes."""
    trace = make_trace()
    tests = [e for e in trace["traceEvents"] if e.get("cat") == "test"]
    tests[0]["args"]["outcome"] = "error"  # test_a's bar: an error ...
    tests[0]["args"]["counted"] = ["passed", "error"]  # ... that pytest counts twice
    tests[1]["args"]["counted"] = ["failed", "error"]  # test_b
    tests[2]["args"]["counted"] = ["xfailed"]  # test_e
    chart = gantt.build_chart(trace)
    assert chart.summary() == (
        "5 tests on 2 GPUs, 2 workers, makespan 6.25 s (1 failed, 3 passed, 1 xfailed, 2 errors)"
    )
    assert _bar(chart, "test", "test_a").outcome == "error"  # the colour is the bar's one outcome


# every way pytest counts a test, teardown errors after a passing and a failing call among them
OUTCOMES = """
import pytest

@pytest.fixture
def raises_at_teardown():
    yield
    raise RuntimeError("teardown")

@pytest.fixture
def raises_at_setup():
    raise RuntimeError("setup")

@pytest.mark.gpu(memory="1GiB")
def test_pass():
    pass

def test_pass_then_teardown_error(raises_at_teardown):
    pass

@pytest.mark.gpu(memory="1GiB")
def test_fail_then_teardown_error(raises_at_teardown):
    assert False

def test_setup_error(raises_at_setup):
    pass

def test_fail():
    assert False

def test_skip():
    pytest.skip("no")

@pytest.mark.xfail
def test_xfail():
    assert False

@pytest.mark.xfail
def test_xpass():
    pass

@pytest.mark.xfail(strict=True)
def test_xpass_strict():
    pass
"""


@pytest.mark.parametrize("workers", ["0", "2"])
def test_the_report_counts_outcomes_as_pytest_does(gpu_pytester, run_inner, workers):
    gpu_pytester.makepyfile(test_outcomes=OUTCOMES)
    trace = gpu_pytester.path / "run.json"
    result = run_inner("--gpus", "sim:2x16GiB", f"--gpu-trace={trace}", "-n", workers, subprocess=workers != "0")
    said = result.parseoutcomes()
    assert said == {"failed": 3, "passed": 2, "skipped": 1, "xfailed": 1, "xpassed": 1, "errors": 3}
    chart = gantt.build_chart(gantt.load_trace(trace))
    counts = chart.summary().partition(" s (")[2].rstrip(")")
    assert counts == "3 failed, 2 passed, 1 skipped, 1 xfailed, 1 xpassed, 3 errors"  # pytest's, in its order


def test_idle_and_unnamed_tracks():
    """A listed GPU with no leases still gets a row; tracks without metadata get plain names."""
    trace = make_trace()
    meta = trace["otherData"]["pytest_gpu"]
    meta["gpus"].append({"index": 2, "memory": 16 * GIB})
    meta["workers"] = []
    del meta["makespan"]
    trace["traceEvents"] = [e for e in trace["traceEvents"] if e["ph"] != "M"]
    trace["traceEvents"].append(_lease(3, 0, "test_z", 6.0, 1.0, "passed"))
    chart = gantt.build_chart(trace)
    assert [row.label for row in chart.rows] == ["GPU 0", "GPU 1", "GPU 2", "GPU 3", "gw0", "gw1"]
    assert chart.makespan == 7.0  # the last bar's end when the trace has none
    assert chart.summary().startswith("5 tests on 4 GPUs, 2 workers, makespan 7.00 s")


def test_no_tests():
    trace = make_trace()
    trace["traceEvents"] = []
    trace["otherData"]["pytest_gpu"]["makespan"] = 0.0
    chart = gantt.build_chart(trace)
    assert not chart.bars
    assert chart.summary() == "0 tests on 2 GPUs, 2 workers, makespan 0.00 s"


def test_malformed_span():
    trace = make_trace()
    trace["traceEvents"][9]["dur"] = "2s"
    with pytest.raises(gantt.TraceError, match=r"traceEvents\[9\] \(lease 'test_a'\) needs numeric ts and dur"):
        gantt.build_chart(trace)


@pytest.mark.parametrize(
    ("label", "width", "shown"),
    [
        ("test_model[cfg1]", 200.0, "test_model[cfg1]"),
        ("test_model[cfg1]", 50.0, "test_model…"),
        ("test_model[cfg1]", 38.0, "test_mo…"),
        ("test_model[cfg1]", 30.0, ""),  # too short a cut to say anything
        ("test_model[cfg1]", 20.0, ""),
    ],
)
def test_fit_label(label: str, width: float, shown: str):
    assert gantt.fit_label(label, width, fontsize=7.0) == shown


@pytest.mark.parametrize(
    ("width", "shown", "abbreviated"),
    [
        (200.0, "test_model[cfg1]", False),
        (60.0, "12 test_mode…", True),  # its key, and as much of the name as fits
        (30.0, "12", True),  # too short for any of the name: the key alone
        (0.5, "12", True),  # however short the bar
    ],
)
def test_bar_text_labels_every_bar(width: float, shown: str, abbreviated: bool):
    assert gantt.bar_text("test_model[cfg1]", 12, width, fontsize=7.0) == (shown, abbreviated)


def _many_short_tests() -> dict[str, Any]:
    trace = make_trace()
    for i in range(12):
        name = f"test_a_long_parametrized_name[config-{i}]"
        trace["traceEvents"] += [
            _test(1, name, 5.5 + i * 0.06, 0.05, "passed", [0]),
            _lease(0, 2, name, 5.5 + i * 0.06, 0.05, "passed"),
        ]
    return trace


def test_every_bar_is_labelled_and_the_key_names_the_abbreviated_in_full():
    chart = gantt.build_chart(_many_short_tests())
    labels = gantt.bar_labels(chart)
    assert {id(label.bar) for label in labels} == {id(bar) for bar in chart.bars if bar.kind != "wait"}
    assert all(label.text for label in labels)
    by_name = {(label.bar.kind, label.bar.label): label for label in labels}
    assert by_name["test", "test_a"].text == "test_a" and not by_name["test", "test_a"].abbreviated
    short = by_name["test", "test_a_long_parametrized_name[config-3]"]
    key = chart.keys["test_m.py::test_a_long_parametrized_name[config-3]"]
    assert short.abbreviated
    assert by_name["lease", "test_a_long_parametrized_name[config-3]"].text.split()[0] == str(key)  # one key per test
    two_digits = [label for label in labels if label.abbreviated and chart.key(label.bar) >= 10]
    assert two_digits and all(label.rotation == 90 for label in two_digits)  # too short for the key lying down
    assert all(label.text == str(chart.key(label.bar)) for label in two_digits)
    assert by_name["test", "test_a"].rotation == 0
    lines = gantt.key_lines(chart, labels)
    assert len(lines) == 12  # the twelve short tests, each once
    assert f"{key:>2}  test_m.py::test_a_long_parametrized_name[config-3]" in lines
    assert sorted(chart.keys.values()) == list(range(1, len(chart.keys) + 1))


def test_a_huge_key_is_capped_and_says_how_many_it_left_out():
    lines = [f"{i}  test_m.py::test_{'x' * 150}_{i}" for i in range(1000)]
    columns, cols, left_out = gantt.key_layout(lines)
    assert columns == 1 and len(cols[0]) == 150 - 1 and left_out == 1000 - 149
    assert gantt.key_height(lines) < 25


def test_the_svg_names_every_bar_in_full_as_a_tooltip(tmp_path: Path):
    require("matplotlib (pytest-gpu[report])", module="matplotlib")
    path = tmp_path / "run.json"
    path.write_text(json.dumps(_many_short_tests()))
    assert main(["report", str(path), "-o", str(tmp_path / "run.svg")]) == 0
    root = ET.parse(tmp_path / "run.svg").getroot()
    titles = [t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}title")]
    chart = gantt.build_chart(_many_short_tests())
    assert len(titles) == len(chart.bars)
    key = chart.keys["test_m.py::test_a_long_parametrized_name[config-11]"]
    assert f"[{key}] test_m.py::test_a_long_parametrized_name[config-11]: passed, 6.16 s to 6.21 s (0.05 s)" in titles
    assert any(t.startswith("[4] test_m.py::test_d: waiting for a GPU, 3.00 s to 4.00 s") for t in titles)
    assert any(": GPU lease on GPU 1 (16GiB), exclusive, 2.00 s" in t for t in titles)


def test_figure_height_grows_then_caps():
    small = gantt.build_chart(make_trace())
    trace = make_trace()
    trace["otherData"]["pytest_gpu"]["workers"] = [f"gw{i}" for i in range(200)]
    huge = gantt.build_chart(trace)
    assert 3.0 <= gantt.figure_height(small) < gantt.figure_height(huge) == 24.0


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, f"no such file; {EXPECTED}"),
        ("{not json", f"not JSON (Expecting property name enclosed in double quotes at line 1 column 2); {EXPECTED}"),
        (b"\xff\xfe", f"not JSON (not UTF-8 text); {EXPECTED}"),
        ('{"traceEvents": []}', f"not a pytest-gpu trace (no otherData.pytest_gpu); {EXPECTED}"),
        ("[]", f"not a pytest-gpu trace (no otherData.pytest_gpu); {EXPECTED}"),
        ('{"otherData": {"pytest_gpu": {}}}', f"traceEvents is missing or not a list; {EXPECTED}"),
    ],
)
def test_load_trace_errors(tmp_path: Path, content: str | bytes | None, message: str):
    path = tmp_path / "t.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(gantt.TraceError) as info:
        gantt.load_trace(path)
    assert str(info.value) == message


def test_no_matplotlib_at_import():
    """The CLI and the pure part must work (and start fast) without the report extra."""
    code = "import sys, pytest_gpu.cli, pytest_gpu.report.gantt; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# -- the command ------------------------------------------------------------------


def test_report_png(trace_file: Path, capsys: pytest.CaptureFixture[str]):
    require("matplotlib (pytest-gpu[report])", module="matplotlib")
    assert main(["report", str(trace_file)]) == 0
    out = trace_file.with_suffix(".png")
    assert capsys.readouterr().out.splitlines() == [
        str(out),
        "5 tests on 2 GPUs, 2 workers, makespan 6.25 s (1 failed, 3 passed, 1 skipped)",
    ]
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(data) > 10_000


@pytest.mark.parametrize(
    "args", [["-o", "{dir}/chart.svg"], ["--format", "svg"], ["-o", "{dir}/c.img", "--format", "SVG"]]
)
def test_report_svg(trace_file: Path, capsys: pytest.CaptureFixture[str], args: list[str]):
    require("matplotlib (pytest-gpu[report])", module="matplotlib")
    args = [arg.format(dir=trace_file.parent) for arg in args]
    assert main(["report", str(trace_file), *args, "--title", "nightly run"]) == 0
    out = Path(args[1]) if args[0] == "-o" else trace_file.with_suffix(".svg")
    assert capsys.readouterr().out.splitlines()[0] == str(out)
    root = ET.parse(out).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert "<svg" in out.read_text()


def _fails(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["report", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err


def test_report_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    missing = tmp_path / "missing.json"
    assert _fails([str(missing)], capsys) == f"pytest-gpu report: {missing}: no such file; {EXPECTED}\n"
    bad = tmp_path / "bad.json"
    bad.write_text("nope")
    assert _fails([str(bad)], capsys) == (
        f"pytest-gpu report: {bad}: not JSON (Expecting value at line 1 column 1); {EXPECTED}\n"
    )
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"traceEvents": [], "otherData": {"tool": "x"}}))
    assert _fails([str(other)], capsys) == (
        f"pytest-gpu report: {other}: not a pytest-gpu trace (no otherData.pytest_gpu); {EXPECTED}\n"
    )
    assert not list(tmp_path.glob("*.png"))


def test_report_bad_format(trace_file: Path, capsys: pytest.CaptureFixture[str]):
    assert _fails([str(trace_file), "--format", "jpg"], capsys) == (
        "pytest-gpu report: --format 'jpg': expected png or svg\n"
    )
    out = trace_file.parent / "chart.pdf"
    assert _fails([str(trace_file), "-o", str(out)], capsys) == (
        f"pytest-gpu report: -o '{out}': cannot tell the format from its suffix; "
        "expected a name ending in .png or .svg, or --format png|svg\n"
    )
    assert _fails([str(trace_file), "-o", str(trace_file), "--format", "png"], capsys) == (
        f"pytest-gpu report: -o '{trace_file}' is the trace itself; expected another path\n"
    )


def test_report_unwritable_output(trace_file: Path, capsys: pytest.CaptureFixture[str]):
    require("matplotlib (pytest-gpu[report])", module="matplotlib")
    out = trace_file.parent / "no-such-dir" / "chart.png"
    assert _fails([str(trace_file), "-o", str(out)], capsys).startswith(f"pytest-gpu report: cannot write {out}: ")


def test_report_without_matplotlib(
    trace_file: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    # None in sys.modules makes the import fail even where matplotlib is installed.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert _fails([str(trace_file)], capsys) == (
        "pytest-gpu report: needs matplotlib (pip install 'pytest-gpu[report]')\n"
    )
    assert not trace_file.with_suffix(".png").exists()
