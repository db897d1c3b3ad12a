"""pytest-depends (``@pytest.mark.depends(on=[...])``) under ``-n``: chains share a worker.

pytest-depends keeps every outcome in the process that ran the test, so a dependency run
on another xdist worker counts as failed and its dependents are skipped ("depends on
..."). `pytest_gpu.scheduling.dependencies` turns its chains into scheduler groups, resolving names
as pytest-depends does; these tests check the groups against pytest-depends' own
resolution and run chains under ``-n 4`` with the GPU scheduler on and off.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator

import pytest

from conftest import require
from helpers import by_group, patience
from pytest_gpu.scheduling.dependencies import GROUP_PREFIX, dependency_groups

# Like conftest.INNER_ARGS, but with pytest-depends active (this suite's own ini blocks it).
ARGS = ("-p", "no:cacheprovider", "-p", "no:randomly", "-p", "no:benchmark", "-p", "no:hypothesispytest")
XDIST = ("-n", "4", "--gpus", "sim:4x16GiB")
TIMEOUT = 120


@pytest.fixture
def tester(gpu_pytester: pytest.Pytester) -> Iterator[pytest.Pytester]:
    require("pytest-depends", module="pytest_depends")
    yield gpu_pytester


def write(pytester: pytest.Pytester, **files: str) -> None:
    for name, source in files.items():
        path = pytester.path / (name if name.endswith(".py") else f"{name}.py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))


def collect(pytester: pytest.Pytester, *args: str, **files: str) -> list[pytest.Item]:
    write(pytester, **files)
    items, reprec = pytester.inline_genitems(*ARGS, *args)
    assert not reprec.getfailedcollections()
    return items


# Every name form pytest-depends resolves (util.get_names / get_absolute_nodeid).
NAMES = """
    import pytest

    def test_a(): pass

    @pytest.mark.depends(on=["test_a"])                      # a bare test name
    def test_b(): pass

    @pytest.mark.depends(on="test_names.py::test_b")         # a node id, `on` a string
    def test_c(): pass

    @pytest.mark.parametrize("x", [1, 2, 3])
    def test_p(x): pass

    @pytest.mark.depends(on=["test_p[2]"])                   # one parametrized id
    def test_one_param(): pass

    @pytest.mark.parametrize("y", [1, 2])
    def test_q(y): pass

    @pytest.mark.depends(on=["test_q"])                      # the id without parameters: all of them
    def test_all_params(): pass

    @pytest.mark.depends(name=["first", "setup_step"])       # custom names, a list
    def test_named(): pass

    @pytest.mark.depends(on=["setup_step"])
    def test_uses_named(): pass

    @pytest.mark.depends(name="lone")                         # a name nobody uses
    def test_unused_name(): pass

    @pytest.mark.depends(on=["test_missing", "Nope::test_a"])  # unresolved: skipped anywhere
    def test_unknown(): pass

    def test_free(): pass

    class TestK:
        def test_k1(self): pass

        @pytest.mark.depends(on=["test_k1"])                  # the dependent's class
        def test_k2(self): pass

        @pytest.mark.depends(on=["TestK::test_k2"])           # Class::test: the dependent's file
        def test_k3(self): pass

        @pytest.mark.depends(on=["test_a"])                   # not the module's test_a: unknown
        def test_k4(self): pass

    class TestL:
        def test_l1(self): pass

        def test_l2(self): pass

    @pytest.mark.depends(on=["test_names.py::TestL"])         # a class marker; a class: all its tests
    class TestM:
        def test_m(self): pass

    @pytest.mark.depends(on=["test_other.py"])                # a whole file
    def test_whole_file(): pass
"""

OTHER = """
    import pytest

    @pytest.mark.depends(on=["test_names.py::test_free"])     # another file, by node id
    def test_x(): pass

    def test_y(): pass

    def test_z(): pass
"""


def _oracle(items: list[pytest.Item]) -> dict[str, set[str]]:
    """Groups from pytest-depends' own DependencyManager: components of its resolved edges."""
    from pytest_depends.main import DependencyManager

    manager = DependencyManager()
    manager.items = list(items)
    parent = {item.nodeid: item.nodeid for item in items}

    def find(node: str) -> str:
        while parent[node] != node:
            node = parent[node]
        return node

    linked = set()
    for nodeid, info in manager.dependencies.items():
        for dependency in info.dependencies:
            if dependency != nodeid:
                parent[find(dependency)] = find(nodeid)
                linked |= {nodeid, dependency}
    out: dict[str, set[str]] = {}
    for nodeid in linked:
        out.setdefault(find(nodeid), set()).add(nodeid)
    return {min(members, key=[item.nodeid for item in items].index): members for members in out.values()}


def test_groups_resolve_names_as_pytest_depends(tester: pytest.Pytester) -> None:
    items = collect(tester, test_names=NAMES, test_other=OTHER)
    groups = dependency_groups(items)
    n, o = "test_names.py::", "test_other.py::"
    expected = {
        n + "test_a": {n + "test_a", n + "test_b", n + "test_c"},
        n + "test_p[2]": {n + "test_p[2]", n + "test_one_param"},
        n + "test_q[1]": {n + "test_q[1]", n + "test_q[2]", n + "test_all_params"},
        n + "test_named": {n + "test_named", n + "test_uses_named"},
        n + "TestK::test_k1": {n + "TestK::test_k1", n + "TestK::test_k2", n + "TestK::test_k3"},
        n + "TestL::test_l1": {n + "TestL::test_l1", n + "TestL::test_l2", n + "TestM::test_m"},
        # test_x is in test_other.py too: the whole-file name joins test_free's group
        n + "test_free": {n + "test_free", n + "test_whole_file", o + "test_x", o + "test_y", o + "test_z"},
    }
    order = [item.nodeid for item in items]  # pytest-depends' sorted order (dependencies first)
    assert {group: members for group, members in by_group(groups).items()} == {
        GROUP_PREFIX + min(members, key=order.index): members for members in expected.values()
    }
    # ... which is exactly what pytest-depends itself resolves (its own DependencyManager).
    assert {GROUP_PREFIX + first: members for first, members in _oracle(items).items()} == by_group(groups)
    for nodeid in ("test_unused_name", "test_unknown", "TestK::test_k4", "test_p[1]", "test_p[3]"):
        assert n + nodeid not in groups

    # Without pytest-depends a `depends` marker is nobody's: nothing is grouped for it.
    assert dependency_groups(collect(tester, "-p", "no:depends")) == {}


def test_groups_join_pytest_dependency_chains(tester: pytest.Pytester) -> None:
    require("pytest-dependency", module="pytest_dependency")
    items = collect(
        tester,
        test_mixed="""
            import pytest

            @pytest.mark.dependency()
            def test_a(): pass

            @pytest.mark.dependency(depends=["test_a"])
            def test_b(): pass

            @pytest.mark.depends(on=["test_b"])
            def test_c(): pass

            def test_free(): pass
        """,
    )
    group = GROUP_PREFIX + "test_mixed.py::test_a"
    assert dependency_groups(items) == {f"test_mixed.py::{name}": group for name in ("test_a", "test_b", "test_c")}


# Logs, for each test, which worker ran it (in order) and, in the controller, its outcome.
RECORDER = """
    import json
    import os

    import pytest

    HERE = os.path.dirname(__file__)


    @pytest.fixture(autouse=True)
    def _order(request):
        with open(os.path.join(HERE, "order.log"), "a") as log:
            log.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')} {request.node.nodeid}\\n")


    def pytest_runtest_logreport(report):
        if os.environ.get("PYTEST_XDIST_WORKER"):
            return  # the controller (or a serial run) records every report once
        reason = report.longrepr[2] if report.skipped and isinstance(report.longrepr, tuple) else ""
        with open(os.path.join(HERE, "outcomes.log"), "a") as log:
            log.write(json.dumps([report.nodeid, report.when, report.outcome, reason]) + "\\n")
"""

CHAIN = """
    import time

    import pytest

    def test_a(): time.sleep(0.05)

    @pytest.mark.depends(on=["test_a"])                       # by name
    def test_b(): time.sleep(0.05)

    @pytest.mark.depends(on="test_chain.py::test_b")          # by node id
    def test_c(): pass

    @pytest.mark.parametrize("x", [1, 2])
    def test_p(x): time.sleep(0.05)

    @pytest.mark.depends(on=["test_p[2]"])                    # by a parametrized id
    def test_q(): time.sleep(0.05)

    @pytest.mark.depends(on=["test_q"])
    def test_r(): pass

    class TestK:                                              # in a class
        def test_k1(self): time.sleep(0.05)

        @pytest.mark.depends(on=["test_k1"])
        def test_k2(self): time.sleep(0.05)

        @pytest.mark.depends(on=["TestK::test_k2"])
        def test_k3(self): pass

    @pytest.mark.parametrize("i", range(10))
    def test_fill(i): time.sleep(0.05)
"""

FILLER = """
    import time

    import pytest

    @pytest.mark.parametrize("i", range(8))
    def test_more(i): time.sleep(0.05)
"""

CHAINS = (
    ("test_a", "test_b", "test_c"),
    ("test_p[2]", "test_q", "test_r"),
    ("TestK::test_k1", "TestK::test_k2", "TestK::test_k3"),
)


def run(pytester: pytest.Pytester, *args: str) -> tuple[pytest.RunResult, dict[str, tuple[str, str]], list[str]]:
    """Run ``args``; returns the result, nodeid -> (outcome, skip reason), and the order log's lines."""
    for name in ("order.log", "outcomes.log"):
        (pytester.path / name).unlink(missing_ok=True)
    result = pytester.runpytest_subprocess(*ARGS, "-rs", *args, timeout=patience(TIMEOUT))
    outcomes: dict[str, tuple[str, str]] = {}
    log = pytester.path / "outcomes.log"
    for line in log.read_text().splitlines() if log.exists() else []:
        nodeid, _, outcome, reason = json.loads(line)
        if outcomes.get(nodeid, ("passed", ""))[0] == "passed":  # a test's first phase not passed wins
            outcomes[nodeid] = (outcome, reason)
    order = pytester.path / "order.log"
    return result, outcomes, order.read_text().splitlines() if order.exists() else []


def assert_chains_together(order: list[str]) -> None:
    """Each chain ran on one worker, in dependency order, back to back."""
    worker_of = {}
    sequence: dict[str, list[str]] = {}
    for line in order:
        worker, nodeid = line.split(" ", 1)
        worker_of[nodeid] = worker
        sequence.setdefault(worker, []).append(nodeid)
    for chain in CHAINS:
        ids = [f"test_chain.py::{name}" for name in chain]
        workers = {worker_of[nodeid] for nodeid in ids}
        assert len(workers) == 1, (chain, order)
        ran = sequence[workers.pop()]
        start = ran.index(ids[0])
        assert ran[start : start + len(ids)] == ids, (chain, ran)


def test_chains_share_a_worker_under_xdist(tester: pytest.Pytester) -> None:
    write(tester, conftest=RECORDER, test_chain=CHAIN, test_filler=FILLER)
    for _ in range(3):
        result, outcomes, order = run(tester, *XDIST)
        result.assert_outcomes(passed=len(outcomes))
        assert "depends on" not in result.stdout.str()
        assert len(outcomes) == 28
        assert_chains_together(order)
        assert len({line.split()[0] for line in order}) > 1  # the rest still spread over the workers


def test_failed_dependency_skips_as_serially(tester: pytest.Pytester) -> None:
    write(
        tester,
        conftest=RECORDER,
        test_chain=CHAIN.replace("def test_a(): time.sleep(0.05)", "def test_a(): assert False"),
        test_filler=FILLER,
    )
    _, serial, _ = run(tester, "-p", "no:xdist")
    result, parallel, order = run(tester, *XDIST)
    assert parallel == serial
    c = "test_chain.py::"
    assert serial[c + "test_a"][0] == "failed"
    assert serial[c + "test_b"] == ("skipped", f"Skipped: {c}test_b depends on {c}test_a")
    assert serial[c + "test_c"] == ("skipped", f"Skipped: {c}test_c depends on {c}test_b")
    others = {
        outcome for nodeid, (outcome, _) in serial.items() if nodeid not in {c + "test_a", c + "test_b", c + "test_c"}
    }
    assert others == {"passed"}
    result.assert_outcomes(passed=25, failed=1, skipped=2)
    assert_chains_together(order)


def test_schedule_off_keeps_chains_with_loadfile(tester: pytest.Pytester) -> None:
    # --gpu-schedule=off is xdist's own load scheduling, which knows nothing of chains; the
    # the docs' advice (docs/scheduling.md): --dist loadfile keeps each file (and so each in-file chain) on one worker.
    write(tester, conftest=RECORDER, test_chain=CHAIN, test_filler=FILLER)
    result, _, order = run(tester, *XDIST, "--gpu-schedule=off", "--dist", "loadfile")
    result.assert_outcomes(passed=28)
    assert "depends on" not in result.stdout.str()
    workers = {line.split()[1]: line.split()[0] for line in order}
    assert len({workers[nodeid] for nodeid in workers if nodeid.startswith("test_chain.py::")}) == 1
