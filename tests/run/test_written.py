"""Written requests: --gpu-requests' file, --gpu-write-requests, --gpu-check-requests, --gpu-bisect."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from pytest_gpu.run.bisect import search
from pytest_gpu.run.written import (
    STEP,
    Entry,
    Margin,
    Written,
    WrittenError,
    parse,
    render,
    stale,
    updated,
)

GiB, MiB = 2**30, 2**20
Run = Callable[..., pytest.RunResult]

# -- the format (pure) ------------------------------------------------------------------------


def test_render_is_sorted_and_parse_reads_it_back() -> None:
    written = Written(
        Margin(0.25, 256 * MiB),
        {
            "tests/b.py::test_x[a = 1]": Entry(1280 * MiB, peak=GiB),  # " = " inside a node id
            "tests/a.py::test_y": Entry(768 * MiB, passes=600 * MiB),
            "tests/a.py::test_by_hand": Entry(2 * GiB),
        },
    )
    text = render(written)
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    assert lines == [
        "margin = 25%, floor 256MiB",
        "tests/a.py::test_by_hand = 2GiB",
        "tests/a.py::test_y = 768MiB (passes at 600MiB)",
        "tests/b.py::test_x[a = 1] = 1280MiB (peak 1GiB)",
    ]
    assert parse(text, "req.txt") == written


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("margin = 25%, floor 256MiB\nt.py::a 1GiB\n", r"req\.txt:2: cannot read 't\.py::a 1GiB'; expected 'NODEID ="),
        ("t.py::a = 1GiB\n", r"req\.txt:1: a test before the margin line; expected 'margin = PCT%, floor SIZE' first"),
        ("margin = 25%, floor 256MiB\nt.py::a = 1GiB\nt.py::a = 2GiB\n", r"req\.txt:3: t\.py::a is written twice"),
        ("margin = 25%, floor 256MiB\nt.py::a = 1GiBs\n", r"req\.txt:2: t\.py::a's request: .*1GiBs"),
        ("margin = 25%, floor 256MiB\nt.py::a = 0\n", r"req\.txt:2: t\.py::a's request is '0'; expected a pos"),
        ("margin = 25%, floor 256MiB\nt.py::a = 1GiB (peak lots)\n", r"req\.txt:2: t\.py::a's peak: "),
        ("margin = 25%, floor 256MiB\n\n# c\nmargin = 10%, floor 1GiB\n", r"req\.txt:4: a second margin line"),
        ("margin = 25%\n", r"req\.txt:1: cannot read 'margin = 25%'; expected"),
    ],
)
def test_a_bad_line_names_the_file_the_line_and_what_was_expected(text: str, error: str) -> None:
    with pytest.raises(WrittenError, match=error):
        parse(text, "req.txt")


def test_margin() -> None:
    assert Margin.parse("25%") == Margin(0.25, 256 * MiB)
    assert Margin.parse(" 10 % , 1GiB") == Margin(0.10, GiB)
    for bad in ("25", "%", "25%,lots", "-5%"):
        with pytest.raises(WrittenError, match="expected a percentage and an optional floor"):
            Margin.parse(bad)
    margin = Margin(0.25, 256 * MiB)
    assert margin.request(GiB) == 1280 * MiB
    assert margin.request(100 * MiB) == 256 * MiB  # the floor
    assert margin.request(GiB + 1) == 1280 * MiB + STEP  # rounded up to a step


def test_updated_keeps_tests_not_measured_and_resizes_them_under_a_new_margin() -> None:
    old = Written(
        Margin(0.25, 256 * MiB),
        {
            "t.py::not_run": Entry(1280 * MiB, peak=GiB),
            "t.py::by_hand": Entry(3 * GiB),
            "t.py::measured": Entry(256 * MiB, peak=100 * MiB),
        },
    )
    new = updated(old, Margin(0.5, 256 * MiB), {"t.py::measured": 2 * GiB, "t.py::new": 300 * MiB})
    assert new.entries == {
        "t.py::not_run": Entry(1536 * MiB, peak=GiB),  # its peak under the new margin
        "t.py::by_hand": Entry(3 * GiB),  # set by hand: as written
        "t.py::measured": Entry(3 * GiB, peak=2 * GiB),
        "t.py::new": Entry(512 * MiB, peak=300 * MiB),
    }


def test_stale_names_a_peak_that_ate_its_margin_and_an_out_of_memory() -> None:
    written = Written(Margin(0.25, 256 * MiB), {"t.py::a": Entry(1280 * MiB, peak=GiB), "t.py::b": Entry(256 * MiB)})
    assert stale(written, {"t.py::a": GiB, "t.py::b": 200 * MiB, "t.py::other": 9 * GiB}) == []
    found = stale(written, {"t.py::a": 1100 * MiB}, out_of_memory=["t.py::b"])
    assert [s.words() for s in found] == [
        "t.py::a: written 1280MiB, peaked at 1100MiB: now needs 1408MiB",
        "t.py::b: ran out of memory under its written request of 256MiB",
    ]


@pytest.mark.parametrize("need", [1, 700 * MiB, STEP, 5 * GiB + 3, 16 * GiB])
@pytest.mark.parametrize("start", [256 * MiB, 8 * GiB])
def test_bisect_search_finds_the_need_within_one_step(need: int, start: int) -> None:
    found = search(lambda cap: cap >= need, start, 16 * GiB)
    assert found.passes is not None and found.passes >= need > found.fails
    assert found.passes - found.fails <= STEP


def test_bisect_search_says_when_nothing_passes() -> None:
    found = search(lambda cap: False, GiB, 4 * GiB)
    assert found.passes is None and found.fails == 4 * GiB


# -- end to end, on simulated GPUs under -n 2 ----------------------------------------------------

SUITE = """
import json, os
import pytest
from pytest_gpu import sim

def record(name, gpu):
    with open(os.environ["LEASES"], "a") as f:
        f.write(json.dumps([name, gpu.memory, gpu.exclusive]) + "\\n")

@pytest.fixture(scope="module")
def model(gpu_lease_factory):
    lease = gpu_lease_factory(memory="2GiB")
    weights = sim.allocate("1536MiB")
    yield lease
    weights.free()

@pytest.mark.gpu
def test_big(gpu):
    record("big", gpu)
    with sim.allocate("1GiB"):
        pass

def test_tiny(gpu):
    record("tiny", gpu)
    with sim.allocate("{tiny}"):
        pass

@pytest.mark.gpu(memory="3GiB")
def test_named(gpu):
    record("named", gpu)
    with sim.allocate("1GiB"):
        pass

def test_with_model(model, gpu):
    record("with_model", gpu)
    with sim.allocate("300MiB"):
        pass

@pytest.mark.gpu(isolate=True)
def test_isolated():
    import torch
    x = torch.empty(600 * 2**20, dtype=torch.uint8, device="cuda")
"""
# every test's lease, as its report says (an isolated test's is its one-rank pool's)
CONFTEST = """
import json, os
from pytest_gpu.base.spans import parse_spans

def pytest_runtest_logreport(report):
    props = dict(report.user_properties)
    if report.when == "teardown" and "gpu_leases" in props:
        memory = parse_spans(props["gpu_leases"])[0].memory
        with open(os.environ["GRANTED"], "a") as f:
            name = report.nodeid.split("::")[-1].removeprefix("test_")
            f.write(json.dumps([name, props.get("gpu_request_source"), memory]) + "\\n")
"""
ARGS = ("--gpus", "sim:2x16GiB", "-n", "2")


def granted(pytester: pytest.Pytester) -> dict[str, list[object]]:
    """Each test's (source, memory per GPU of its lease) from its report, read once."""
    path = pytester.path / "granted"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.unlink()
    (pytester.path / "leases").unlink(missing_ok=True)
    return {name: [source, memory] for name, source, memory in rows}


@pytest.fixture
def suite(gpu_pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    gpu_pytester.makepyfile(test_suite=SUITE.replace("{tiny}", "100MiB"))
    gpu_pytester.makeconftest(CONFTEST)
    monkeypatch.setenv("LEASES", str(gpu_pytester.path / "leases"))
    monkeypatch.setenv("GRANTED", str(gpu_pytester.path / "granted"))
    return gpu_pytester


def test_written_then_read_under_n2(suite: pytest.Pytester, run_inner: Run) -> None:
    whole = 16 * GiB - 500 * MiB
    result = run_inner(*ARGS, "--gpu-requests=req.txt", "--gpu-write-requests", subprocess=True)
    result.assert_outcomes(passed=5)
    result.stdout.fnmatch_lines(["pytest-gpu: requests: 1 from markers, 4 default"])
    result.stdout.fnmatch_lines(["pytest-gpu: wrote 4 requests to req.txt (margin 25%, floor 256MiB; 0 kept *)"])
    assert granted(suite)["big"] == ["default", whole]
    lines = (suite.path / "req.txt").read_text().splitlines()
    assert [line for line in lines if not line.startswith("#")] == [
        "margin = 25%, floor 256MiB",
        "test_suite.py::test_big = 1280MiB (peak 1GiB)",
        "test_suite.py::test_isolated = 768MiB (peak 600MiB)",
        "test_suite.py::test_tiny = 256MiB (peak 100MiB)",
        # its own peak: the model's 1536MiB are the fixture's lease's
        "test_suite.py::test_with_model = 384MiB (peak 300MiB)",
    ]  # test_named names its memory: its marker's wins, nothing to write

    result = run_inner(*ARGS, "--gpu-requests=req.txt", "--gpu-check-requests", subprocess=True)
    result.assert_outcomes(passed=5)
    result.stdout.fnmatch_lines(
        [
            "pytest-gpu: requests: 1 from markers, 4 from req.txt",
            "pytest-gpu: --gpu-check-requests: 4 tests within their written request in req.txt",
        ]
    )
    assert granted(suite) == {
        "big": ["file", 1280 * MiB],
        "tiny": ["file", 256 * MiB],
        "named": ["marker", 3 * GiB],
        "with_model": ["file", 384 * MiB],
        "isolated": ["file", 768 * MiB],  # its one-rank pool's lease
    }


def test_check_fails_the_run_when_a_peak_outgrew_its_written_request(suite: pytest.Pytester, run_inner: Run) -> None:
    (suite.path / "req.txt").write_text(
        "margin = 25%, floor 256MiB\n"
        "test_suite.py::test_big = 1280MiB (peak 1GiB)\n"
        "test_suite.py::test_tiny = 256MiB (peak 100MiB)\n"
    )
    suite.makepyfile(test_suite=SUITE.replace("{tiny}", "230MiB"))  # grew, still under its 256MiB: no OOM
    result = run_inner(*ARGS, "--gpu-requests=req.txt", "--gpu-check-requests", "-k", "big or tiny", subprocess=True)
    result.assert_outcomes(passed=2)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "pytest-gpu: --gpu-check-requests: 1 test outgrew its written request in req.txt (margin 25%, floor*",
            "  test_suite.py::test_tiny: written 256MiB, peaked at 230MiB: now needs 320MiB",
        ]
    )
    assert "test_big:" not in result.stdout.str()
    # without the check, the same run passes
    result = run_inner(*ARGS, "--gpu-requests=req.txt", "-k", "big or tiny", subprocess=True)
    assert result.ret == pytest.ExitCode.OK


def test_precedence_marker_then_file_then_learned_then_default(
    gpu_pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    suite = gpu_pytester
    suite.makepyfile(test_suite=SUITE.replace("{tiny}", "100MiB"))
    suite.makeconftest(CONFTEST)
    monkeypatch.setenv("LEASES", str(suite.path / "leases"))
    monkeypatch.setenv("GRANTED", str(suite.path / "granted"))
    args = (*ARGS, "-p", "no:benchmark", "-p", "no:hypothesispytest")  # with pytest's cache: --gpu-learn's
    suite.runpytest_subprocess(*args, "--gpu-learn", "-k", "not isolated").assert_outcomes(passed=4)
    granted(suite)
    (suite.path / "req.txt").write_text(
        "margin = 25%, floor 256MiB\n"
        "test_suite.py::test_named = 512MiB (peak 400MiB)\n"  # its marker's 3GiB wins
        "test_suite.py::test_big = 2GiB\n"  # beats --gpu-learn's 1.25GiB
    )
    result = suite.runpytest_subprocess(*args, "--gpu-learn", "--gpu-requests=req.txt")
    result.assert_outcomes(passed=5)
    result.stdout.fnmatch_lines(
        ["pytest-gpu: requests: 1 from markers, 1 from req.txt, 2 from --gpu-learn's cache, 1 default"]
    )
    got = granted(suite)
    # no peak learned, no line: a whole GPU, less the contexts on it when granted (its pool's
    # rank's, and its worker's where that worker ran a test on this GPU before: the placement's)
    source, size = got.pop("isolated")
    assert source == "default" and size in (16 * GiB - 500 * MiB, 16 * GiB - 2 * 500 * MiB), size
    assert got == {
        "named": ["marker", 3 * GiB],
        "big": ["file", 2 * GiB],
        "tiny": ["learned", 256 * MiB],
        "with_model": ["learned", 375 * MiB],  # max(1.25 x 300MiB, 256MiB)
    }


NEEDS = """
import pytest
from pytest_gpu import sim

@pytest.mark.gpu
def test_needs(gpu):
    with sim.allocate("700MiB"):
        pass

def test_other(gpu):
    pass
"""


def test_bisect_finds_the_smallest_cap_within_a_step(gpu_pytester: pytest.Pytester, run_inner: Run) -> None:
    gpu_pytester.makepyfile(test_bisect=NEEDS)
    result = run_inner(
        *ARGS, "--gpu-requests=req.txt", "--gpu-bisect=test_bisect.py::test_needs", subprocess=True, timeout=300
    )
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        ["pytest-gpu: --gpu-bisect: test_bisect.py::test_needs passes with 704MiB per GPU, fails with 640MiB *"]
    )
    written = parse((gpu_pytester.path / "req.txt").read_text(), "req.txt")
    entry = written.entries["test_bisect.py::test_needs"]
    assert entry.passes is not None and 0 <= entry.passes - 700 * MiB < STEP
    assert entry.request == Margin().request(entry.passes)
    assert list(written.entries) == ["test_bisect.py::test_needs"]  # without --gpu-write-requests: it alone


# -- bad options ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (("--gpu-requests-margin=lots",), "--gpu-requests-margin: expected a percentage and an optional floor*"),
        (("--gpu-write-requests",), "--gpu-write-requests: expected --gpu-requests=PATH*"),
        (("--gpu-check-requests",), "--gpu-check-requests: expected --gpu-requests=PATH*"),
        (("--gpu-bisect=t.py::a",), "--gpu-bisect: expected --gpu-requests=PATH*"),
        (("--gpu-requests=r.txt", "--gpu-bisect=t.py"), "--gpu-bisect: expected a test's node id*"),
        (
            ("--gpu-requests=r.txt", "--gpu-write-requests", "--gpu-check-requests"),
            "--gpu-write-requests and --gpu-check-requests: expected one of the two*",
        ),
        (("--gpu-requests=missing.txt",), "*--gpu-requests: */missing.txt: cannot read it: *"),
        (("--gpu-requests=bad.txt",), "*--gpu-requests: */bad.txt:3: cannot read 'test_x.py::a=1GiB'; expected*"),
        (("--gpu-requests=bad.txt", "--gpu-write-requests"), "*--gpu-requests: */bad.txt:3: cannot read*"),
    ],
)
def test_bad_options_and_files_stop_the_run_naming_them(
    gpu_pytester: pytest.Pytester, run_inner: Run, args: tuple[str, ...], error: str
) -> None:
    gpu_pytester.makepyfile(test_x="def test_a(): pass")
    (gpu_pytester.path / "bad.txt").write_text("# mine\nmargin = 25%, floor 256MiB\ntest_x.py::a=1GiB\n")
    result = run_inner("--gpus", "sim:1x16GiB", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: {error}"])


def test_an_ini_key_path_is_relative_to_the_ini_file(gpu_pytester: pytest.Pytester, run_inner: Run) -> None:
    sub = gpu_pytester.mkdir("sub")
    gpu_pytester.makeini("[pytest]\ngpu_requests = sub/req.txt\n")
    (sub / "req.txt").write_text("margin = 25%, floor 256MiB\ntest_x.py::test_a = 512MiB\n")
    gpu_pytester.makepyfile(test_x="def test_a(gpu):\n    assert gpu.memory == 512 * 2**20\n")
    result = run_inner("--gpus", "sim:1x16GiB", "-p", "no:xdist")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["pytest-gpu: requests: 1 from req.txt"])
