"""One plugin object per role, which registers the features that apply: each one hook object,
registered only where its role needs it and only when it is enabled, in an order that keeps
pytest's hook order (a conftest's hooks first); all gone after unconfigure."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from helpers import patience
from pytest_gpu import roles
from pytest_gpu.roles import Role, decide

pytest_plugins = ["pytester"]

ROLE_NAMES = ("pytest-gpu-controller", "pytest-gpu-worker", "pytest-gpu-lone")
# the features every process that runs tests registers, in the order it registers them
TESTER = [
    "pytest-gpu-selection",
    "pytest-gpu-leases",
    "pytest-gpu-quarantine",
    "pytest-gpu-distributed",
    "pytest-gpu-infrastructure",
]
OWNER = ["pytest-gpu-summary", "pytest-gpu-ray-head", "pytest-gpu-requests"]  # and the process that owns the run
LONE = ["pytest-gpu-lone", *OWNER, *TESTER]

# a conftest that writes, per process, which of pytest-gpu's objects are registered: when it is
# imported (the initial conftests load: what was registered before them) and at the session's start
RECORDER = """
import json, os, sys

OUT = os.environ["ROLES_OUT"]


def _write(config, when):
    who = os.environ.get("PYTEST_XDIST_WORKER", "main")
    pm = config.pluginmanager
    present = [name for name, _ in pm.list_name_plugin() if name and name.startswith("pytest-gpu-")]
    with open(os.path.join(OUT, f"{who}-{when}.json"), "w") as f:
        json.dump(present, f)


def pytest_sessionstart(session):
    _write(session.config, "session")


def pytest_plugin_registered(plugin, manager):
    if plugin is sys.modules[__name__]:  # this conftest, as the initial conftests load
        _write(manager.get_plugin("pytestconfig"), "early")
"""


@pytest.mark.parametrize(
    ("worker", "dist", "collect_only", "role"),
    [
        (False, "no", False, Role.LONE),
        (False, "load", False, Role.CONTROLLER),
        (False, "loadgroup", False, Role.CONTROLLER),
        (False, "load", True, Role.LONE),  # xdist starts no workers for --collect-only
        (True, "load", False, Role.WORKER),
        (True, "no", False, Role.WORKER),
    ],
)
def test_decide(worker: bool, dist: str, collect_only: bool, role: Role) -> None:
    assert decide(worker=worker, dist=dist, collect_only=collect_only) is role


def _recorded(out: Path) -> dict[str, list[str]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json"))}


def test_a_lone_process_registers_its_role_and_features_and_unregisters_them(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = pytester.mkdir("out")
    pytester.makeconftest(RECORDER)
    monkeypatch.setenv("ROLES_OUT", str(out))
    pytester.makepyfile("def test_a():\n    pass\n")
    calls: list[Any] = []
    real = roles.install

    def spy(config: pytest.Config) -> Role:
        calls.append(config)
        return real(config)

    monkeypatch.setattr(roles, "install", spy)
    result = pytester.inline_run("--gpus", "sim:1x16GiB", "-p", "no:xdist")
    result.assertoutcome(passed=1)
    # registered before the initial conftests load (hook order), in this order
    assert _recorded(out) == {"main-early": LONE, "main-session": LONE}
    (config,) = calls  # the role is decided once
    left = [name for name, _ in config.pluginmanager.list_name_plugin() if name and name.startswith("pytest-gpu-")]
    assert left == [], "still registered after unconfigure"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("--gpu-required",), [*LONE, "pytest-gpu-required"]),
        (("-o", "gpu_required=true"), [*LONE, "pytest-gpu-required"]),  # the ini key foreseen too
        (("--gpu-required", "--collect-only"), LONE),  # collecting only: nothing to require
        (("--gpu-schedule=off", "--gpu-trace", "t.json"), LONE),  # the scheduler is the controller's only
    ],
)
def test_a_feature_is_registered_only_when_it_is_enabled(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...], expected: list[str]
) -> None:
    out = pytester.mkdir("out")
    pytester.makeconftest(RECORDER)
    monkeypatch.setenv("ROLES_OUT", str(out))
    pytester.makepyfile("def test_a():\n    pass\n")
    pytester.inline_run("--gpus", "sim:1x16GiB", "-p", "no:xdist", *args)
    assert _recorded(out) == {"main-early": expected, "main-session": expected}


def test_a_role_foreseen_wrongly_is_replaced_with_its_features(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pytest started from inside an xdist worker: foreseen as a worker (its environment says
    so), it is a lone process; the worker's object and features go, the lone's come."""
    out = pytester.mkdir("out")
    pytester.makeconftest(RECORDER)
    monkeypatch.setenv("ROLES_OUT", str(out))
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw7")
    pytester.makepyfile("def test_a():\n    pass\n")
    pytester.inline_run("--gpus", "sim:1x16GiB", "-p", "no:xdist", "-p", "no:benchmark").assertoutcome(passed=1)
    recorded = _recorded(out)
    assert recorded["gw7-early"] == ["pytest-gpu-worker", *TESTER, "pytest-gpu-catalog"]
    assert recorded["gw7-session"] == ["pytest-gpu-lone", *OWNER, *TESTER]


def test_the_launch_is_detected_once_per_process(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_gpu import plugin
    from pytest_gpu.base import launch as detect_module

    pytester.makepyfile("def test_a():\n    pass\n")
    calls: list[int] = []
    real = detect_module.detect

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(plugin, "detect", counting)
    monkeypatch.setattr(detect_module, "detect", counting)
    pytester.inline_run("--gpus", "sim:1x16GiB", "-p", "no:xdist").assertoutcome(passed=1)
    assert len(calls) == 1


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "controller", "worker"),
    [
        (
            (),
            [
                "pytest-gpu-controller",
                *OWNER,
                "pytest-gpu-selection",
                "pytest-gpu-lost-workers",
                "pytest-gpu-scheduling",
            ],
            ["pytest-gpu-worker", *TESTER, "pytest-gpu-catalog"],
        ),
        (  # the user's --dist: xdist hands the tests out, no catalog is sent
            ("--dist", "load", "--gpu-required"),
            ["pytest-gpu-controller", *OWNER, "pytest-gpu-selection", "pytest-gpu-lost-workers", "pytest-gpu-required"],
            ["pytest-gpu-worker", *TESTER, "pytest-gpu-required"],
        ),
    ],
)
def test_controller_and_workers_register_their_own_features(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    args: tuple[str, ...],
    controller: list[str],
    worker: list[str],
) -> None:
    out = pytester.mkdir("out")
    pytester.makeconftest(RECORDER)
    monkeypatch.setenv("ROLES_OUT", str(out))
    pytester.makepyfile("import pytest\n\n@pytest.mark.gpu(memory='1GiB')\ndef test_a():\n    pass\n")
    result = pytester.runpytest_subprocess("--gpus", "sim:1x16GiB", "-n", "2", *args, timeout=patience(120))
    result.assert_outcomes(passed=1)
    assert _recorded(out) == {
        "main-early": controller,
        "main-session": controller,
        **{f"gw{n}-{when}": worker for n in (0, 1) for when in ("early", "session")},
    }


# a conftest that writes, per process, which of pytest-gpu's objects (and the conftest itself,
# and xdist's worker) implement each hook, in the order pluggy calls them (for wrappers: the
# outermost first, so the last one's code after its yield runs first)
HOOK_ORDER = """
import json, os

OUT = os.environ["ROLES_OUT"]
HOOKS = (
    "pytest_runtest_setup", "pytest_runtest_teardown", "pytest_runtest_makereport",
    "pytest_collection_modifyitems", "pytest_collection_finish", "pytest_unconfigure",
)


def pytest_runtest_setup(item):
    pass


def pytest_sessionstart(session):
    pm = session.config.pluginmanager
    order = {}
    for hook in HOOKS:
        names = []
        for impl in reversed(getattr(pm.hook, hook).get_hookimpls()):
            name = pm.get_name(impl.plugin) or ""
            if name.startswith("pytest-gpu-"):
                names.append(name.removeprefix("pytest-gpu-"))
            elif name.endswith("conftest.py"):
                names.append("conftest")
            elif type(impl.plugin).__name__ == "WorkerInteractor":
                names.append("xdist")
        order[hook] = names
    who = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(os.path.join(OUT, f"{who}.json"), "w") as f:
        json.dump(order, f)
"""


@pytest.mark.slow
def test_the_features_hooks_keep_their_order(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """A conftest's setup runs before the lease is taken; the lease feature's report wrapper is
    the innermost of pytest-gpu's (the verdict is in the report before the quarantine and the
    distributed tests look at it); deselection runs before the oversize check; pools and the
    Ray head end before the role closes the run; a worker's catalog and its --gpu-required
    finding are written before xdist sends the collection."""
    out = pytester.mkdir("out")
    pytester.makeconftest(HOOK_ORDER)
    monkeypatch.setenv("ROLES_OUT", str(out))
    pytester.makepyfile("def test_a():\n    pass\n")
    pytester.inline_run("--gpus", "sim:1x16GiB", "-p", "no:xdist", "--gpu-required").assertoutcome(passed=1)
    lone = json.loads((out / "main.json").read_text())
    # the infrastructure feature's wrapper around them: what is outside the run once the lease is applied
    assert lone["pytest_runtest_setup"] == ["infrastructure", "conftest", "leases"]
    # the distributed feature's: a test skipped or failed in its setup starts the next test's pool there
    assert lone["pytest_runtest_teardown"] == ["leases", "distributed"]
    # the infrastructure feature's is the outermost: it classes the final report
    assert lone["pytest_runtest_makereport"] == ["infrastructure", "distributed", "quarantine", "leases"]
    assert lone["pytest_collection_modifyitems"] == ["selection", "leases"]
    assert lone["pytest_collection_finish"] == ["required"]
    assert lone["pytest_unconfigure"] == ["infrastructure", "distributed", "ray-head", "lone"]
    result = pytester.runpytest_subprocess(
        "--gpus", "sim:1x16GiB", "-n", "1", "--gpu-required", "-p", "no:randomly", timeout=patience(120)
    )
    result.assert_outcomes(passed=1)
    worker = json.loads((out / "gw0.json").read_text())
    finish = worker["pytest_collection_finish"]
    assert finish.index("catalog") < finish.index("xdist") and finish.index("required") < finish.index("xdist")
    assert worker["pytest_runtest_makereport"] == ["infrastructure", "distributed", "quarantine", "leases"]


def test_a_conftest_confinement_hook_runs_beside_the_builtin_adapters(pytester: pytest.Pytester) -> None:
    """pytest_gpu_confine: a conftest confines its own framework, lazily, and undoes it."""
    pytester.makeconftest(
        """
        import sys, types
        LOG = []

        def pytest_gpu_confine(lease, confinement):
            LOG.append(("confine", lease.indices, list(confinement.ordinals)))
            confinement.when_imported("myframework", lambda m: LOG.append(("applied", m.__name__)))
            confinement.on_undo(lambda: LOG.append(("undone",)))
        """
    )
    pytester.makepyfile(
        myframework="VALUE = 1\n",
        test_it="""
        import pytest
        from conftest import LOG

        @pytest.mark.gpu(memory="1GiB")
        def test_uses_it():
            assert LOG[-1][0] == "confine"
            assert not any(e[0] == "applied" for e in LOG)  # not imported: not applied
            import myframework
            assert LOG[-1] == ("applied", "myframework")

        def test_after():
            assert LOG[-1] == ("undone",)
        """,
    )
    pytester.syspathinsert()
    pytester.inline_run("--gpus", "sim:2x16GiB", "-p", "no:xdist").assertoutcome(passed=2)


def test_the_builtin_adapters_can_be_turned_off(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        def test_it(pytestconfig):
            names = [pytestconfig.pluginmanager.get_name(p) for p in pytestconfig.pluginmanager.get_plugins()]
            assert ("gpu_adapters" in names) is {expected}
        """.replace("{expected}", "True")
    )
    pytester.inline_run("--gpus", "sim:1x16GiB", "-p", "no:xdist").assertoutcome(passed=1)
    pytester.makepyfile(
        """
        def test_it(pytestconfig):
            assert pytestconfig.pluginmanager.get_plugin("gpu_adapters") is None
        """
    )
    pytester.inline_run("--gpus", "sim:1x16GiB", "-p", "no:xdist", "-p", "no:gpu_adapters").assertoutcome(passed=1)


def test_a_conftests_hooks_run_before_the_roles(pytester: pytest.Pytester) -> None:
    """Hook order follows registration: a conftest's setup hook runs before pytest-gpu leases the GPU
    (so one that skips never waits for a GPU, and one that waits for a condition waits before asking)."""
    pytester.makeconftest(
        """
        import os
        import pytest

        SEEN = {}

        def pytest_runtest_setup(item):
            SEEN[item.name] = os.environ.get("CUDA_VISIBLE_DEVICES")
            if item.name == "test_skipped":
                pytest.skip("the conftest says so")
        """
    )
    pytester.makepyfile(
        """
        import pytest
        from conftest import SEEN

        @pytest.mark.gpu(memory="1GiB")
        def test_leased():
            assert SEEN["test_leased"] is None  # the conftest ran before the lease was taken

        @pytest.mark.gpu(exclusive=True)
        def test_skipped():
            pass
        """
    )
    pytester.syspathinsert()
    result = pytester.inline_run("--gpus", "sim:1x16GiB", "-p", "no:xdist")
    result.assertoutcome(passed=1, skipped=1)
    assert "pytest-gpu" not in "\n".join(map(str, result.getcalls("pytest_terminal_summary")))
    run_reports = [r for r in result.getreports("pytest_runtest_logreport") if "test_skipped" in r.nodeid]
    assert all("gpu_leases" not in dict(r.user_properties) for r in run_reports)  # never leased


def test_expected_role_reads_the_command_line_before_xdist_does(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pytest_gpu.roles import expected_role

    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert expected_role(pytester.parseconfig("-n", "2")) is Role.CONTROLLER
    assert expected_role(pytester.parseconfig("-n", "0")) is Role.LONE
    assert expected_role(pytester.parseconfig("-n", "2", "--collect-only")) is Role.LONE
    assert expected_role(pytester.parseconfig()) is Role.LONE
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    assert expected_role(pytester.parseconfig()) is Role.WORKER


def test_a_worker_leaves_what_collection_made_out_of_the_gc(gpu_pytester: pytest.Pytester) -> None:
    """pytest's five gc passes at every worker's end would walk every module and item again
    (``roles.tester.freeze_heap``); what a test creates is not frozen."""
    gpu_pytester.makepyfile(
        """
        import gc, weakref

        class Cycle:
            pass

        def test_frozen_after_collection():
            assert gc.get_freeze_count() > 1000  # modules, plugins, items

        def test_what_a_test_makes_is_still_collected():
            node = Cycle()
            node.me = node
            ref = weakref.ref(node)
            del node
            gc.collect()
            assert ref() is None
        """
    )
    gpu_pytester.runpytest_subprocess("--gpus", "sim:1x16GiB", "-n", "1", timeout=patience(120)).assert_outcomes(
        passed=2
    )
