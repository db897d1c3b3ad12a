"""Requests from a suite's own conventions: the ``gpu_marker_map`` ini key and the
``pytest_gpu_item_request`` hook (pytest_gpu.run.conventions, hookspecs, lifecycle.item_request).

The grammar is tested pure; the rest end-to-end: the same tests written three ways (gpu
markers, mapped markers, a hook) get the same leases, in-process and under xdist, and
a probe conftest reads the request each collected test was given.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import ROOT
from pytest_gpu.base.requests import DefaultMemory, GpuRequest, build_request
from pytest_gpu.run.conventions import MAP_FORM, MarkerMapError, parse_marker_map

GiB, MiB = 2**30, 2**20
WHOLE_16GIB = 16 * GiB - 500 * MiB  # what an exclusive lease gets on a 16GiB simulated GPU
EXCLUSIVE = DefaultMemory(exclusive=True)
TWO_GIB = DefaultMemory(exclusive=False, memory=2 * GiB)


# -- the grammar (pure) ---------------------------------------------------------------


def test_parse_every_form_in_line_order() -> None:
    lines = [
        "# our markers",
        "",
        "large: exclusive",
        "multi_gpu: count=2 memory=8GiB",
        "needs_gpu:",
        "shared: memory='1GiB', exclusive=false",
        'big_pair:count=2,exclusive=TRUE   memory="10GiB"',
        "  EXCLUSIVE_one :  EXCLUSIVE ",
    ]
    mapping = parse_marker_map(lines)
    assert mapping == {
        "large": {"exclusive": True},
        "multi_gpu": {"count": 2, "memory": "8GiB"},
        "needs_gpu": {},
        "shared": {"memory": "1GiB", "exclusive": False},
        "big_pair": {"count": 2, "exclusive": True, "memory": "10GiB"},
        "EXCLUSIVE_one": {"exclusive": True},
    }
    assert list(mapping) == ["large", "multi_gpu", "needs_gpu", "shared", "big_pair", "EXCLUSIVE_one"]


@pytest.mark.parametrize(
    ("line", "marker_kwargs"),
    [
        ("large: exclusive", {"exclusive": True}),
        ("multi_gpu: count=2 memory=8GiB", {"count": 2, "memory": "8GiB"}),
        ("needs_gpu:", {}),
        ("shared: memory=1GiB exclusive=false", {"memory": "1GiB", "exclusive": False}),
        ("big_pair: count=2 exclusive memory=10GiB", {"count": 2, "exclusive": True, "memory": "10GiB"}),
        ("bytes: memory=1073741824", {"memory": 1073741824}),
    ],
)
@pytest.mark.parametrize("default", [EXCLUSIVE, TWO_GIB], ids=["exclusive", "2GiB"])
def test_a_mapped_line_is_the_same_request_as_the_gpu_marker(
    line: str, marker_kwargs: dict, default: DefaultMemory
) -> None:
    ((_name, kwargs),) = parse_marker_map([line], default).items()
    assert build_request((), kwargs, default) == build_request((), marker_kwargs, default)


def test_an_empty_right_side_is_a_bare_gpu_marker() -> None:
    kwargs = parse_marker_map(["requires_gpu:"])["requires_gpu"]
    assert build_request((), kwargs, EXCLUSIVE) == GpuRequest(count=1, memory=None, exclusive=True)
    assert build_request((), kwargs, TWO_GIB) == GpuRequest(count=1, memory=2 * GiB, exclusive=False)


def test_no_lines_no_map() -> None:
    assert parse_marker_map([]) == {}
    assert parse_marker_map(["", "# nothing yet"]) == {}


@pytest.mark.parametrize(
    ("line", "detail"),
    [
        ("multi_gpu count=2", "no 'MARKER:' at its start"),
        (": count=2", "no 'MARKER:' at its start"),
        ("multi-gpu: count=2", "no 'MARKER:' at its start"),
        ("gpu: count=2", "'gpu' is pytest-gpu's own marker, not one to map"),
        ("distributed: count=2", "'distributed' is pytest-gpu's own marker, not one to map"),
        ("large: size=3", "unknown key 'size'"),
        ("large: count=2 count=3", "count given twice"),
        ("large: exclusive exclusive=false", "exclusive given twice"),
        ("large: 2", "'2' is neither KEY=VALUE nor exclusive"),
        ("large: shared", "'shared' is neither KEY=VALUE nor exclusive"),
        ("large: count=two", "count must be a positive int, got 'two'"),
        ("large: count=1.5", "count must be a positive int, got '1.5'"),
        ("large: exclusive=maybe", "exclusive must be true or false, got 'maybe'"),
    ],
)
def test_bad_lines_name_the_key_the_line_and_the_form(line: str, detail: str) -> None:
    with pytest.raises(MarkerMapError) as info:
        parse_marker_map(["large: exclusive", line] if not line.startswith("large") else [line])
    assert str(info.value) == f"ini key 'gpu_marker_map': line {line!r}: {detail}; expected {MAP_FORM}"


@pytest.mark.parametrize(
    ("line", "detail"),
    [
        ("large: count=0", "marker 'large': count must be a positive int, got 0"),
        ("large: count=-1", "marker 'large': count must be a positive int, got -1"),
        ("large: memory=lots", "marker 'large': memory='lots' is not a size"),
        ("large: memory=0", "marker 'large': memory must be positive, got '0'"),
    ],
)
def test_values_are_checked_as_the_markers_are(line: str, detail: str) -> None:
    with pytest.raises(MarkerMapError) as info:
        parse_marker_map([line])
    message = str(info.value)
    assert message.startswith(f"ini key 'gpu_marker_map': line {line!r}: {detail}")
    assert "expected" in message


def test_a_marker_mapped_twice_is_an_error() -> None:
    with pytest.raises(MarkerMapError, match=r"line 'large: count=2': marker 'large' is mapped twice"):
        parse_marker_map(["large: exclusive", "large: count=2"])


def test_exclusive_false_without_memory_depends_on_the_default_memory() -> None:
    assert parse_marker_map(["shared: exclusive=false"], TWO_GIB) == {"shared": {"exclusive": False}}
    with pytest.raises(MarkerMapError) as info:
        parse_marker_map(["shared: exclusive=false"], EXCLUSIVE)
    assert str(info.value).startswith(
        "ini key 'gpu_marker_map': line 'shared: exclusive=false': marker 'shared': exclusive=False needs memory="
    )


# -- the same tests, written three ways ------------------------------------------------

RECORDER = """
import json
import pytest

@pytest.fixture
def record(request, gpu):
    row = {{
        "way": request.node.path.parent.name,
        "name": request.node.name,
        "indices": list(gpu.indices),
        "memory": gpu.memory,
        "exclusive": gpu.exclusive,
    }}
    with open({out!r}, "a") as f:
        f.write(json.dumps(row) + "\\n")
"""

EXPLICIT = """
import pytest

@pytest.mark.gpu(exclusive=True)
def test_large(record):
    pass

@pytest.mark.gpu(count=2, memory="8GiB")
def test_multi(record):
    pass

@pytest.mark.gpu
def test_plain(record):
    pass

@pytest.mark.gpu(memory="1GiB", exclusive=False)
def test_shared(record):
    pass

@pytest.mark.gpu(2, exclusive=True, memory="10GiB")
def test_big_pair(record):
    pass
"""

MAPPED = """
import pytest

@pytest.mark.large
def test_large(record):
    pass

@pytest.mark.multi_gpu
def test_multi(record):
    pass

@pytest.mark.needs_gpu
def test_plain(record):
    pass

@pytest.mark.shared
def test_shared(record):
    pass

@pytest.mark.big_pair
def test_big_pair(record):
    pass
"""

MAP_INI = """
[pytest]
markers =
    large: a big test
    multi_gpu: needs two GPUs
    needs_gpu: needs a GPU
    shared: shares a GPU
    big_pair: two big GPUs
gpu_marker_map =
    large: exclusive
    multi_gpu: count=2 memory=8GiB
    needs_gpu:
    shared: memory=1GiB exclusive=false
    big_pair: count=2 exclusive memory=10GiB
"""

HOOKED = """
def needs(**gpu):  # the suite's own decorator
    def mark(fn):
        fn.gpu_needs = gpu
        return fn
    return mark

@needs(exclusive=True)
def test_large(record):
    pass

@needs(count=2, memory="8GiB")
def test_multi(record):
    pass

@needs()
def test_plain(record):
    pass

@needs(memory="1GiB", exclusive=False)
def test_shared(record):
    pass

@needs(count=2, exclusive=True, memory="10GiB")
def test_big_pair(record):
    pass
"""

HOOK_CONFTEST = """
def pytest_gpu_item_request(item):
    return getattr(getattr(item, "obj", None), "gpu_needs", None)
"""


def _leases(path: Path) -> dict[tuple[str, str], dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    by_key = {(row["way"], row["name"]): row for row in rows}
    assert len(by_key) == len(rows), "a test recorded twice"
    return by_key


@pytest.mark.parametrize("workers", [None, "2"], ids=["in-process", "xdist"])
def test_the_map_and_the_hook_give_the_same_leases_as_explicit_markers(gpu_pytester, run_inner, workers):
    out = gpu_pytester.path / "leases.jsonl"
    gpu_pytester.makeini(MAP_INI)
    gpu_pytester.makeconftest(RECORDER.format(out=str(out)))
    for way, source in (("explicit", EXPLICIT), ("mapped", MAPPED), ("hooked", HOOKED)):
        gpu_pytester.mkpydir(way)
        (gpu_pytester.path / way / f"test_{way}.py").write_text(source)
    (gpu_pytester.path / "hooked" / "conftest.py").write_text(HOOK_CONFTEST)
    args = ["--gpus", "sim:4x16GiB", "--gpu-default-memory", "2GiB", "--strict-markers"]
    if workers is None:
        result = run_inner(*args)
    else:
        result = run_inner(*args, "-n", workers, subprocess=True)
    result.assert_outcomes(passed=15)

    expected = {  # (GPUs, memory per GPU, exclusive)
        "test_large": (1, WHOLE_16GIB, True),
        "test_multi": (2, 8 * GiB, False),
        "test_plain": (1, 2 * GiB, False),  # the default memory, as a bare marker's
        "test_shared": (1, 1 * GiB, False),
        "test_big_pair": (2, WHOLE_16GIB, True),
    }
    got = _leases(out)
    assert sorted(got) == sorted((way, name) for way in ("explicit", "mapped", "hooked") for name in expected)
    for (way, name), row in got.items():
        assert (len(row["indices"]), row["memory"], row["exclusive"]) == expected[name], (way, name)
        assert len(set(row["indices"])) == len(row["indices"]), (way, name)
    result.stdout.re_match_lines([r"pytest-gpu: 4 simulated GPUs .* · 15 GPU tests · "])


# -- precedence: read from the requests the collected tests were given ------------------

PROBE = """
import dataclasses, json
import pytest
from pytest_gpu.run.record import needs

def pytest_collection_finish(session):
    rows = {{}}
    for item in session.items:
        request = needs(item).request
        rows[item.nodeid] = None if request is None else dataclasses.asdict(request)
    with open({out!r}, "w") as f:
        json.dump(rows, f)
"""

NEEDS = """
def needs(**gpu):  # the suite's own decorator
    def mark(fn):
        fn.gpu_needs = gpu
        return fn
    return mark
"""

PRECEDENCE_TOML = """
[tool.pytest.ini_options]
markers = ["large: big", "multi_gpu: two GPUs", "needs_gpu: a GPU"]
gpu_marker_map = [
    "multi_gpu: count=2 memory=8GiB",
    "large: exclusive",
    "needs_gpu:",
]
"""

PRECEDENCE = """
import pytest
from gpuneeds import needs

@pytest.mark.gpu(memory="1GiB")
@pytest.mark.large
@needs(count=3)
def test_marker_beats_hook_and_map(gpu):
    pass

@pytest.mark.large
@needs(count=2, memory="3GiB")
def test_hook_beats_map(gpu):
    pass

@pytest.mark.large
def test_map_when_the_hook_says_none(gpu):
    pass

@pytest.mark.large
@pytest.mark.multi_gpu
def test_first_line_of_the_map_wins(gpu):
    pass

@pytest.mark.multi_gpu
@pytest.mark.large
def test_first_line_of_the_map_wins_in_either_order(gpu):
    pass

@pytest.mark.large
class TestMappedClass:
    def test_inherits(self, gpu):
        pass

    @pytest.mark.gpu(memory="1GiB")
    def test_gpu_marker_on_the_method(self, gpu):
        pass

@pytest.mark.large
@pytest.mark.parametrize("n", [pytest.param(1, marks=pytest.mark.gpu(memory="2GiB"), id="marked"), 2])
def test_param(n, gpu):
    pass

pytestmark = pytest.mark.needs_gpu  # the whole module: one GPU each, unless closer says otherwise

def test_module_mark_without_the_gpu_fixture():
    pass
"""

UNMAPPED = """
import pytest
from gpuneeds import needs

def test_fixture_default(gpu):
    pass

def test_cpu():
    pass

@needs()
def test_hook_without_the_gpu_fixture():
    pass

@pytest.mark.large
@needs(count=2)
@pytest.mark.distributed(world_size=2, backend="gloo")
def test_distributed_gets_its_gpus_from_its_marker(rank):
    pass
"""


def _requests(gpu_pytester, run_inner, *args: str) -> dict[str, dict | None]:
    """The request of each collected test, under the hook of HOOK_CONFTEST and ``needs``."""
    out = gpu_pytester.path / "requests.json"
    gpu_pytester.makeconftest(PROBE.format(out=str(out)) + HOOK_CONFTEST)
    (gpu_pytester.path / "gpuneeds.py").write_text(NEEDS)
    gpu_pytester.syspathinsert()
    result = run_inner("--gpus", "sim:4x16GiB", "--collect-only", "--strict-markers", *args)
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    return json.loads(out.read_text())


def _req(count: int = 1, memory: int | None = None, exclusive: bool = True, min_memory: int | None = None) -> dict:
    return {
        "count": count,
        "memory": memory,
        "exclusive": exclusive,
        "min_memory": min_memory,
        "cpus": 0,
        "host_memory": 0,
    }


def test_precedence_marker_then_hook_then_map_then_fixture_default(gpu_pytester, run_inner):
    gpu_pytester.makepyprojecttoml(PRECEDENCE_TOML)
    gpu_pytester.makepyfile(test_precedence=PRECEDENCE, test_unmapped=UNMAPPED)
    got = _requests(gpu_pytester, run_inner)
    p, u = "test_precedence.py::", "test_unmapped.py::"
    assert got == {
        p + "test_marker_beats_hook_and_map": _req(memory=1 * GiB, exclusive=False),
        p + "test_hook_beats_map": _req(2, 3 * GiB, exclusive=False),
        p + "test_map_when_the_hook_says_none": _req(),
        p + "test_first_line_of_the_map_wins": _req(2, 8 * GiB, exclusive=False),
        p + "test_first_line_of_the_map_wins_in_either_order": _req(2, 8 * GiB, exclusive=False),
        p + "TestMappedClass::test_inherits": _req(),  # a mapped marker on the class
        p + "TestMappedClass::test_gpu_marker_on_the_method": _req(memory=1 * GiB, exclusive=False),
        p + "test_param[marked]": _req(memory=2 * GiB, exclusive=False),
        p + "test_param[2]": _req(),
        # "large" (exclusive) is not on it; the module's needs_gpu is: the default request
        p + "test_module_mark_without_the_gpu_fixture": _req(),
        u + "test_fixture_default": _req(),
        u + "test_cpu": None,
        u + "test_hook_without_the_gpu_fixture": _req(),
        u + "test_distributed_gets_its_gpus_from_its_marker": None,
    }


def test_the_map_follows_the_default_memory(gpu_pytester, run_inner):
    gpu_pytester.makepyprojecttoml(PRECEDENCE_TOML)
    gpu_pytester.makepyfile(test_precedence=PRECEDENCE)
    got = _requests(gpu_pytester, run_inner, "--gpu-default-memory", "2GiB")
    assert got["test_precedence.py::test_module_mark_without_the_gpu_fixture"] == _req(memory=2 * GiB, exclusive=False)
    assert got["test_precedence.py::test_map_when_the_hook_says_none"] == _req()  # exclusive stays whole


LEARN_PROBE = """
from pytest_gpu.run.lifecycle import RUN_KEY

def pytest_sessionstart(session):  # as if an earlier --gpu-learn run had measured 1GiB peaks
    run = session.config.stash[RUN_KEY]
    run.learned_peaks = {{f"test_learned.py::{{name}}": 2**30 for name in {names!r}}}
"""

LEARNED = """
import pytest
from gpuneeds import needs

@pytest.mark.needs_gpu
def test_map_names_no_memory(gpu):
    pass

@pytest.mark.large
def test_map_says_exclusive(gpu):
    pass

@needs(count=2)
def test_hook_names_no_memory(gpu):
    pass

@needs(memory="3GiB")
def test_hook_names_memory(gpu):
    pass
"""


def test_gpu_learn_replaces_only_requests_that_name_no_memory(gpu_pytester, run_inner):
    gpu_pytester.makepyprojecttoml(PRECEDENCE_TOML)
    gpu_pytester.makepyfile(test_learned=LEARNED)
    names = [
        "test_map_names_no_memory",
        "test_map_says_exclusive",
        "test_hook_names_no_memory",
        "test_hook_names_memory",
    ]
    (gpu_pytester.path / "learn_probe.py").write_text(LEARN_PROBE.format(names=names))
    got = _requests(gpu_pytester, run_inner, "--gpu-learn", "-p", "learn_probe")
    learned = int(1.25 * GiB)
    assert got == {
        "test_learned.py::test_map_names_no_memory": _req(memory=learned, exclusive=False),
        "test_learned.py::test_map_says_exclusive": _req(),
        "test_learned.py::test_hook_names_no_memory": _req(2, learned, exclusive=False),
        "test_learned.py::test_hook_names_memory": _req(memory=3 * GiB, exclusive=False),
    }


README_HOOK = """
import pytest


@pytest.hookimpl(optionalhook=True)  # so this conftest also loads with -p no:gpu
def pytest_gpu_item_request(item):
    if getattr(getattr(item, "obj", None), "needs_big_gpu", False):  # set by your decorator
        return {"exclusive": True, "memory": "40GiB"}
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "world_size" in callspec.params:  # a parametrization
        return {"count": callspec.params["world_size"], "memory": "4GiB"}
    if item.name.startswith("test_cuda_"):  # a naming rule
        return {}  # a bare @pytest.mark.gpu
    return None  # no opinion: the map decides
"""

README_SUITE = """
import pytest

def big_gpu(fn):
    fn.needs_big_gpu = True
    return fn

@big_gpu
def test_decorated():
    pass

@pytest.mark.parametrize("world_size", [1, 2])
def test_param(world_size):
    pass

def test_cuda_kernel():
    pass

@pytest.mark.large
@pytest.mark.multi_gpu
def test_both_mapped():
    pass

def test_cpu():
    pass
"""

README_INI = """
[pytest]
markers =
    large: needs a whole GPU
    multi_gpu: needs two GPUs
    requires_gpu: needs a GPU
gpu_marker_map =
    large: exclusive
    multi_gpu: count=2 memory=8GiB
    requires_gpu:
"""


def test_the_readme_example(gpu_pytester, run_inner):
    """The docs' ini and conftest (docs/requests.md), verbatim: a decorator, a parametrization, a naming rule."""
    out = gpu_pytester.path / "requests.json"
    gpu_pytester.makeini(README_INI)
    gpu_pytester.makeconftest(PROBE.format(out=str(out)) + README_HOOK)
    gpu_pytester.makepyfile(test_readme=README_SUITE)
    result = run_inner("--gpus", "sim:2x80GiB,2x24GiB", "--collect-only", "--strict-markers")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    t = "test_readme.py::"
    assert json.loads(out.read_text()) == {
        t + "test_decorated": _req(min_memory=40 * GiB),
        t + "test_param[1]": _req(1, 4 * GiB, exclusive=False),
        t + "test_param[2]": _req(2, 4 * GiB, exclusive=False),
        t + "test_cuda_kernel": _req(),
        t + "test_both_mapped": _req(),  # large's line comes first: one whole GPU
        t + "test_cpu": None,
    }
    page = (ROOT / "docs" / "requests.md").read_text()
    assert README_HOOK.strip() in page
    assert "\n".join(README_INI.strip().splitlines()[1:]) in page


# -- the hook: conftest scope, first result, bad results ---------------------------------

ROOT_HOOK = """
def pytest_gpu_item_request(item):
    return {"memory": "1GiB"}
"""

SUB_HOOK = """
def pytest_gpu_item_request(item):
    return {"count": 2} if item.name == "test_a" else None
"""


def test_the_deepest_conftest_answers_first_and_only_for_its_own_tests(gpu_pytester, run_inner):
    out = gpu_pytester.path / "requests.json"
    gpu_pytester.makeconftest(PROBE.format(out=str(out)) + ROOT_HOOK)
    for sub in ("deep", "other"):  # deep/ first: its conftest is loaded before other/ is collected
        gpu_pytester.mkpydir(sub)
        (gpu_pytester.path / sub / f"test_{sub}.py").write_text("def test_a():\n    pass\n\ndef test_b():\n    pass\n")
    (gpu_pytester.path / "deep" / "conftest.py").write_text(SUB_HOOK)
    result = run_inner("--gpus", "sim:4x16GiB", "--collect-only")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    shared_1gib = _req(memory=1 * GiB, exclusive=False)
    assert json.loads(out.read_text()) == {
        "deep/test_deep.py::test_a": _req(2),  # deep/conftest.py's answer wins over the root conftest's
        "deep/test_deep.py::test_b": shared_1gib,  # deep's None: the root conftest answers
        "other/test_other.py::test_a": shared_1gib,  # deep/conftest.py is not on its path
        "other/test_other.py::test_b": shared_1gib,
    }


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        ("3", "pytest_gpu_item_request returned 3; expected None or a dict of gpu marker keywords such as {"),
        ("[2]", "pytest_gpu_item_request returned [2]; expected None or a dict"),
        ("{2: 1}", "pytest_gpu_item_request returned {2: 1}; expected None or a dict"),
        ("{'size': 3}", "pytest_gpu_item_request: unknown keyword 'size'; expected None or a dict"),
        ("{'count': 0}", "pytest_gpu_item_request: count must be a positive int, got 0; expected None or a dict"),
        ("{'memory': 'lots'}", "pytest_gpu_item_request: memory='lots' is not a size: "),
        ("int('x')", "pytest_gpu_item_request raised ValueError: invalid literal for int() with base 10: 'x' ("),
    ],
)
def test_a_bad_hook_result_fails_collection_naming_the_test(gpu_pytester, run_inner, returned, message):
    gpu_pytester.makeconftest(
        f"def pytest_gpu_item_request(item):\n    if item.name == 'test_bad':\n        return {returned}\n"
    )
    gpu_pytester.makepyfile(test_hooked="def test_bad():\n    pass\n\ndef test_innocent():\n    pass\n")
    result = run_inner("--gpus", "sim:4x16GiB")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(["*pytest-gpu: invalid GPU request"])
    # once in the error, and again in the short summary where pytest does not truncate (CI=true)
    lines = {line for line in result.outlines if line.startswith("test_hooked.py::test_bad: ")}
    assert len(lines) == 1, lines
    (line,) = lines
    assert line.startswith(f"test_hooked.py::test_bad: {message}"), line
    if returned == "int('x')":  # where the hook raised
        assert line.endswith(f"{gpu_pytester.path / 'conftest.py'}:3)"), line
    assert "test_innocent:" not in result.stdout.str()


def test_a_conftest_with_an_optional_hookimpl_loads_with_the_plugin_off(gpu_pytester, run_inner):
    gpu_pytester.makeconftest(
        "import pytest\n\n@pytest.hookimpl(optionalhook=True)\n"
        "def pytest_gpu_item_request(item):\n    return {'count': 2}\n"
    )
    gpu_pytester.makepyfile(test_cpu="def test_cpu():\n    pass\n")
    run_inner("-p", "no:gpu").assert_outcomes(passed=1)
    # with the plugin on, the same conftest makes test_cpu a 2-GPU test
    result = run_inner("--gpus", "sim:4x16GiB")
    result.assert_outcomes(passed=1)
    result.stdout.re_match_lines([r"pytest-gpu: 4 simulated GPUs .* · 1 GPU test · "])


# -- the map at start-up and under --strict-markers --------------------------------------


@pytest.mark.parametrize(
    ("line", "detail"),
    [
        ("multi_gpu count=2", "no 'MARKER:' at its start; expected one 'MARKER: KEY=VALUE ...' per line *"),
        ("large: size=3", "unknown key 'size'; expected one 'MARKER: KEY=VALUE ...' per line *"),
        ("multi_gpu: count=0", "marker 'multi_gpu': count must be a positive int, got 0; expected one 'MARKER: *"),
        ("shared: exclusive=false", "marker 'shared': exclusive=False needs memory= (the default memory is*"),
    ],
)
def test_a_bad_map_line_is_a_usage_error_at_start_up(gpu_pytester, run_inner, line, detail):
    gpu_pytester.makeini(f"[pytest]\ngpu_marker_map =\n    fine: exclusive\n    {line}\n")
    gpu_pytester.makepyfile("def test_cpu():\n    pass\n")
    result = run_inner("--gpus", "sim:4x16GiB")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: ini key 'gpu_marker_map': line {line!r}: {detail}"])
    assert "test_cpu" not in result.stdout.str()  # nothing ran


def test_the_default_memory_makes_exclusive_false_valid(gpu_pytester, run_inner):
    gpu_pytester.makeini("[pytest]\nmarkers = shared: s\ngpu_marker_map =\n    shared: exclusive=false\n")
    gpu_pytester.makepyfile("import pytest\n\n@pytest.mark.shared\ndef test_s(gpu):\n    assert gpu.memory == 2**31\n")
    run_inner("--gpus", "sim:4x16GiB", "--gpu-default-memory", "2GiB").assert_outcomes(passed=1)


def test_a_request_from_a_convention_too_large_for_any_gpu_is_skipped_like_a_markers(gpu_pytester, run_inner):
    """Larger than any GPU is no invalid request: skipped with the reason (--gpu-oversize=skip)."""
    gpu_pytester.makeini("[pytest]\nmarkers = huge: h\ngpu_marker_map =\n    huge: memory=100GiB\n")
    gpu_pytester.makeconftest(
        "def pytest_gpu_item_request(item):\n    if item.name == 'test_hooked':\n        return {'memory': '100GiB'}\n"
    )
    gpu_pytester.makepyfile(
        "import pytest\n\n@pytest.mark.huge\ndef test_h():\n    pass\n\ndef test_hooked():\n    pass\n"
    )
    result = run_inner("--gpus", "sim:4x16GiB", "-rs")
    assert result.ret == pytest.ExitCode.OK
    result.assert_outcomes(skipped=2)
    over = "needs 100GiB per GPU but the largest GPU offers 15.5GiB after the CUDA context (4 simulated GPUs (4x16GiB))"
    result.stdout.fnmatch_lines_random(
        [f"SKIPPED [[]1[]] test_*.py:3: pytest-gpu: {over}", f"SKIPPED [[]1[]] test_*.py: pytest-gpu: {over}"]
    )


def test_mapped_markers_are_the_suites_to_register_under_strict_markers(gpu_pytester, run_inner):
    gpu_pytester.makeini("[pytest]\ngpu_marker_map =\n    large: exclusive\n")
    gpu_pytester.makepyfile("import pytest\n\n@pytest.mark.large\ndef test_l(gpu):\n    pass\n")
    # pytest-gpu does not register them: pytest's own error, as without the map (in a fresh
    # process: pytest.mark remembers the markers an earlier in-process run registered)
    result = run_inner("--gpus", "sim:4x16GiB", "--strict-markers", subprocess=True)
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(["*'large' not found in `markers` configuration option*"])
    assert "@pytest.mark.large" not in run_inner("--markers").stdout.str()
    # without --strict-markers: pytest's warning for an unknown mark, and the mapped request
    result = run_inner("--gpus", "sim:4x16GiB", "-W", "ignore::pytest.PytestUnknownMarkWarning")
    result.assert_outcomes(passed=1)
    result.stdout.re_match_lines([r"pytest-gpu: 4 simulated GPUs .* · 1 GPU test · "])
