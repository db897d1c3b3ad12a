"""One plugin object per role: decided once, registered where it applies, gone after unconfigure."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from helpers import patience
from pytest_gpu import roles
from pytest_gpu.roles import Role, decide

pytest_plugins = ["pytester"]

ROLE_NAMES = ("pytest-gpu-controller", "pytest-gpu-worker", "pytest-gpu-lone", "pytest-gpu-launched-rank")

# a conftest that writes, per process, which of pytest-gpu's role objects are registered
RECORDER = f"""
import json, os

NAMES = {ROLE_NAMES!r} + ("pytest-gpu-summary",)
OUT = os.environ["ROLES_OUT"]


def _write(config, when):
    who = os.environ.get("PYTEST_XDIST_WORKER", "main")
    present = [n for n in NAMES if config.pluginmanager.get_plugin(n) is not None]
    with open(os.path.join(OUT, f"{{who}}-{{when}}.json"), "w") as f:
        json.dump(present, f)


def pytest_sessionstart(session):
    _write(session.config, "session")
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


def test_a_lone_process_registers_the_lone_role_and_unregisters_it(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = pytester.mkdir("out")
    pytester.makeconftest(RECORDER)
    monkeypatch.setenv("ROLES_OUT", str(out))
    pytester.makepyfile("def test_a():\n    pass\n")
    calls: list[Any] = []
    real = roles.install

    def spy(config: pytest.Config, run: Any) -> Role:
        calls.append(config)
        return real(config, run)

    monkeypatch.setattr(roles, "install", spy)
    result = pytester.inline_run("--gpus", "sim:1x16GiB", "-p", "no:xdist")
    result.assertoutcome(passed=1)
    assert _recorded(out) == {"main-session": ["pytest-gpu-lone", "pytest-gpu-summary"]}
    (config,) = calls  # the role is decided once
    for name in (*ROLE_NAMES, "pytest-gpu-summary"):
        assert config.pluginmanager.get_plugin(name) is None, f"{name} still registered after unconfigure"


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
def test_controller_and_workers_register_their_own_roles(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = pytester.mkdir("out")
    pytester.makeconftest(RECORDER)
    monkeypatch.setenv("ROLES_OUT", str(out))
    pytester.makepyfile("import pytest\n\n@pytest.mark.gpu(memory='1GiB')\ndef test_a():\n    pass\n")
    result = pytester.runpytest_subprocess("--gpus", "sim:1x16GiB", "-n", "2")
    result.assert_outcomes(passed=1)
    assert _recorded(out) == {
        "main-session": ["pytest-gpu-controller", "pytest-gpu-summary"],
        "gw0-session": ["pytest-gpu-worker"],
        "gw1-session": ["pytest-gpu-worker"],
    }


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
