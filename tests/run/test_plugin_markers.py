"""End-to-end: the ``gpu`` marker in all its forms, and the default request.

Each inner test records the lease it got (through the public ``gpu`` fixture) into a
JSON-lines file; the outer test compares it with what the marker asked for.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

GiB = 2**30
MiB = 2**20
# what an exclusive lease gets on a 16GiB simulated GPU: everything but this process's context
WHOLE_16GIB = 16 * GiB - 500 * MiB

RECORDER = """
import json
import pytest

@pytest.fixture
def record(request, gpu):
    row = {{
        "name": request.node.name,
        "indices": list(gpu.indices),
        "memory": gpu.memory,
        "exclusive": gpu.exclusive,
    }}
    with open({out!r}, "a") as f:
        f.write(json.dumps(row) + "\\n")
"""

MARKED = """
import pytest

@pytest.mark.gpu
def test_bare(record):
    pass

@pytest.mark.gpu(2)
def test_positional(record):
    pass

@pytest.mark.gpu(count=2, memory="3GiB")
def test_keyword(record):
    pass

@pytest.mark.gpu(memory="8GB")
def test_si_size(record):
    pass

@pytest.mark.gpu(memory=512 * 2**20)
def test_int_bytes(record):
    pass

@pytest.mark.gpu(count=1, exclusive=True)
def test_exclusive_keyword(record):
    pass

@pytest.mark.gpu(2)
class TestClassMarker:
    def test_inherits(self, record):
        pass

    @pytest.mark.gpu(memory="1GiB")
    def test_closest(self, record):
        pass

@pytest.mark.parametrize(
    "n",
    [
        pytest.param(2, marks=pytest.mark.gpu(count=2, memory="2GiB"), id="marked"),
        pytest.param(1, id="plain"),
    ],
)
def test_param(n, record):
    pass

def test_fixture_only(record):
    pass
"""

MODULE_MARKED = """
import pytest

pytestmark = pytest.mark.gpu(count=2, memory="2GiB")

def test_module(record):
    pass

@pytest.mark.gpu(memory="1GiB")
def test_module_closest(record):
    pass
"""


def _records(path: Path) -> dict[str, dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    by_name = {row["name"]: row for row in rows}
    assert len(by_name) == len(rows), "a test recorded twice"
    return by_name


@pytest.mark.parametrize("default_memory", [None, "2GiB"])
def test_marker_forms_and_closest_marker_wins(gpu_pytester, run_inner, default_memory):
    out = gpu_pytester.path / "leases.jsonl"
    gpu_pytester.makeconftest(RECORDER.format(out=str(out)))
    gpu_pytester.makepyfile(test_marked=MARKED, test_module_marked=MODULE_MARKED)
    args = ["--gpus", "sim:4x16GiB", "--strict-markers"]
    if default_memory is not None:
        args += ["--gpu-default-memory", default_memory]
    result = run_inner(*args)
    result.assert_outcomes(passed=13)

    # (count, memory per GPU, exclusive) for a test that gives no memory
    default = (WHOLE_16GIB, True) if default_memory is None else (2 * GiB, False)
    expected = {
        "test_bare": (1, *default),
        "test_positional": (2, *default),
        "test_keyword": (2, 3 * GiB, False),
        "test_si_size": (1, 8 * 10**9, False),
        "test_int_bytes": (1, 512 * MiB, False),
        "test_exclusive_keyword": (1, WHOLE_16GIB, True),
        "test_inherits": (2, *default),  # class marker
        "test_closest": (1, 1 * GiB, False),  # method marker beats class marker
        "test_param[marked]": (2, 2 * GiB, False),  # pytest.param(marks=...)
        "test_param[plain]": (1, *default),  # gpu fixture, no marker: default request
        "test_fixture_only": (1, *default),
        "test_module": (2, 2 * GiB, False),  # module pytestmark
        "test_module_closest": (1, 1 * GiB, False),  # function marker beats pytestmark
    }
    got = _records(out)
    assert sorted(got) == sorted(expected)
    for name, (count, memory, exclusive) in expected.items():
        row = got[name]
        assert (len(row["indices"]), row["memory"], row["exclusive"]) == (count, memory, exclusive), name
        assert len(set(row["indices"])) == count, name
        assert set(row["indices"]) <= {0, 1, 2, 3}, name
    result.stdout.re_match_lines(
        [
            r"pytest-gpu: 4 simulated GPUs \(4x16GiB\) \[sim:4x16GiB\] · 13 GPU tests · "
            r"waited (\d+\.\ds|\d+ms|<1ms|0s) in total · 0 violations$"
        ]
    )


def test_marker_is_registered(run_inner):
    result = run_inner("--markers")
    result.stdout.fnmatch_lines(
        [
            "@pytest.mark.gpu(count=1, memory=None, exclusive=False, cpus=None, host_memory=None): "
            "the test needs COUNT GPUs*"
        ]
    )
    result.stdout.fnmatch_lines(
        ["@pytest.mark.host_resources(cpus=None, host_memory=None): the test leases CPUS CPUs*"]
    )


SKIPPED = """
import pytest

@pytest.mark.skip(reason="not today")
@pytest.mark.gpu(2)
def test_skip(gpu):
    raise AssertionError("must not run")

@pytest.mark.skipif(True, reason="never")
@pytest.mark.gpu(exclusive=True)
def test_skipif(gpu):
    raise AssertionError("must not run")

@pytest.mark.xfail(run=False, reason="not run")
@pytest.mark.gpu
def test_xfail_not_run(gpu):
    raise AssertionError("must not run")

@pytest.mark.gpu
def test_runs(gpu):
    pass

def test_cpu():
    pass
"""

GRANT_COUNTER = """
from pytest_gpu.run.lifecycle import RUN_KEY

def pytest_terminal_summary(terminalreporter, config):
    terminalreporter.write_line(f"broker grants: {config.stash[RUN_KEY].broker.grants}")
"""


def test_skip_and_skipif_do_not_acquire(gpu_pytester, run_inner):
    gpu_pytester.makeconftest(GRANT_COUNTER)
    gpu_pytester.makepyfile(test_skipped=SKIPPED)
    result = run_inner("--gpus", "sim:2x16GiB", "-rsx")
    result.assert_outcomes(passed=2, skipped=2, xfailed=1)
    # only test_runs was granted anything
    result.stdout.fnmatch_lines(["broker grants: 1"])
    result.stdout.re_match_lines([r"pytest-gpu: .* · 1 GPU test · waited .* · 0 violations"])
    result.stdout.fnmatch_lines(["SKIPPED * not today", "SKIPPED * never"])
    assert not [line for line in result.outlines if re.search(r"could not get|broke its GPU lease", line)]


AT_LEAST = """
import pytest

@pytest.mark.gpu(exclusive=True, memory="40GiB")
def test_one_big(record):
    pass

@pytest.mark.gpu(2, exclusive=True, memory="40GiB")
def test_two_big(record):
    pass

@pytest.mark.gpu(exclusive=True, memory="100GiB")
def test_larger_than_any(record):
    raise AssertionError("must not run")

@pytest.mark.gpu(3, exclusive=True, memory="40GiB")
def test_more_big_ones_than_there_are(record):
    raise AssertionError("must not run")

def test_section(gpu_request):
    with gpu_request(exclusive=True, memory="40GiB") as lease:
        with open({out!r}, "a") as f:
            f.write(json.dumps({{"name": "section", "indices": list(lease.indices), "memory": lease.memory}}) + "\\n")
"""


def test_exclusive_with_memory_gets_a_whole_gpu_at_least_that_large(gpu_pytester, run_inner):
    out = gpu_pytester.path / "leases.jsonl"
    gpu_pytester.makeconftest(RECORDER.format(out=str(out)))
    gpu_pytester.makepyfile(test_at_least="import json\n" + AT_LEAST.format(out=str(out)))
    result = run_inner("--gpus", "sim:2x80GiB,2x24GiB", "-rs")
    result.assert_outcomes(passed=3, skipped=2)
    whole_80 = 80 * GiB - 500 * MiB  # what the GPU gives, as for any exclusive lease
    got = _records(out)
    assert (got["test_one_big"]["memory"], got["test_one_big"]["exclusive"]) == (whole_80, True)
    assert set(got["test_one_big"]["indices"]) <= {0, 1}
    assert (sorted(got["test_two_big"]["indices"]), got["test_two_big"]["memory"]) == ([0, 1], whole_80)
    assert set(got["section"]["indices"]) <= {0, 1} and got["section"]["memory"] == whole_80
    inventory = "(4 simulated GPUs (2x80GiB, 2x24GiB))"
    result.stdout.fnmatch_lines_random(
        [
            "SKIPPED * pytest-gpu: needs 1 GPU (whole GPU of at least 100GiB) but this run has 0 GPUs offering "
            f"100GiB after the CUDA context {inventory}",
            "SKIPPED * pytest-gpu: needs 3 GPUs (whole GPU of at least 40GiB each) but this run has 2 GPUs offering "
            f"40GiB after the CUDA context {inventory}",
        ]
    )
