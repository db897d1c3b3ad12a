"""pytest_gpu.base.privates: every private pytest and pytest-xdist name the plugin uses still
does what the plugin needs, on the pytest and xdist installed (CI runs this file on the
floors too: .ci/floors, pytest 8.0 and pytest-xdist 3.5).

One test per name; each fails naming the name that changed. All run in this process (the
fast tier): real pytest and xdist objects, a stand-in only for what would start processes
(an xdist worker's execnet gateway and channel).
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from xml.etree import ElementTree

import execnet
import pytest
import xdist

from pytest_gpu.base import privates

VERSIONS = f"pytest {pytest.__version__}, pytest-xdist {xdist.__version__}"


@contextmanager
def uses(name: str) -> Iterator[None]:
    """Fail naming ``name`` (and the versions installed) where the block fails: the private name changed."""
    try:
        yield
    except (AssertionError, AttributeError, ImportError, TypeError, KeyError, ValueError) as exc:
        pytest.fail(f"{name} changed under {VERSIONS}: {type(exc).__name__}: {exc}", pytrace=True)


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> pytest.Config:
    """A second config in this process, as a rank process makes one (plugins loaded, not configured)."""
    monkeypatch.chdir(tmp_path)
    with uses("_pytest.config._prepareconfig"):
        made = privates.prepare_config(["-p", "no:gpu", "-p", "no:cacheprovider", "-p", "no:randomly", str(tmp_path)])
        assert isinstance(made, pytest.Config)
        assert made.pluginmanager.hasplugin("xdist.plugin") or made.pluginmanager.hasplugin("xdist")
    return made


# -- pytest ----------------------------------------------------------------------------------


def test_a_rank_s_config_rewrites_the_asserts_of_the_test_module_it_imports(
    config: pytest.Config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))  # the import hook goes with the test
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    module = tmp_path / "test_rewritten.py"
    module.write_text("def test_x():\n    a = 1\n    assert a == 2\n")
    with uses("_pytest.assertion.install_importhook"):
        privates.rewrite_asserts(config)
    with uses("_pytest.pathlib.import_path"):
        imported = privates.import_test_module(str(module), "importlib", tmp_path)
        assert imported.__file__ == str(module)
    with uses("_pytest.assertion.install_importhook (the rewritten message)"), pytest.raises(AssertionError) as info:
        imported.test_x()
    assert "assert 1 == 2" in str(info.value)


def _deep(n: int) -> None:
    if n:
        _deep(n - 1)
    raise ValueError("bottom")


def test_a_rank_s_traceback_is_cut_and_shortened_as_pytest_does() -> None:
    try:
        _deep(3)
    except ValueError as exc:
        info = pytest.ExceptionInfo.from_exception(exc)
    with uses("_pytest._code.code.Traceback (cut, with_repr_style)"):
        privates.trim_traceback(info, __file__, full_ends=True)
        entries = list(info.traceback)
        assert len(entries) == 5 and all(str(e.path) == __file__ for e in entries)
        styles = [getattr(e, "_repr_style", None) for e in entries]
        assert styles == [None, "short", "short", "short", None], styles
        assert "bottom" in str(info.getrepr(style="long"))


def test_a_failure_made_of_text_survives_the_way_to_the_controller(pytestconfig: pytest.Config) -> None:
    with uses("_pytest._code.code.ReprFileLocation"):
        crash = privates.file_location("t.py", 3, "RuntimeError: rank 1 failed")
    with uses("_pytest._code.code (ReprExceptionInfo, ReprTraceback, ReprEntry)"):
        longrepr = privates.text_failure(["Traceback (rank 1):", "RuntimeError: rank 1 failed"], crash)
        report = pytest.TestReport("t.py::x", ("t.py", 2, "x"), {}, "failed", longrepr, "call")
        hook = pytestconfig.hook
        data = hook.pytest_report_to_serializable(config=pytestconfig, report=report)  # as an xdist worker sends it
        back = hook.pytest_report_from_serializable(config=pytestconfig, data=data)
        assert "Traceback (rank 1):\nRuntimeError: rank 1 failed" in str(back.longrepr)
        assert back.longrepr.reprcrash.message == "RuntimeError: rank 1 failed"
        assert back.longrepr.reprcrash.lineno == 3


@pytest.fixture
def leased(tmp_path_factory: pytest.TempPathFactory) -> int:
    return 1


def test_an_item_s_fixtures_as_collection_resolved_them(request: pytest.FixtureRequest, leased: int) -> None:
    with uses("Item._fixtureinfo"):
        info = privates.fixture_info(request.node)
        assert info is not None
        assert tuple(info.argnames) == ("request", "leased")
        assert {"leased", "request"} <= set(info.names_closure)
        assert tuple(info.name2fixturedefs["leased"][-1].argnames) == ("tmp_path_factory",)
        assert "tmp_path_factory" in info.names_closure
    assert privates.fixture_info(SimpleNamespace()) is None  # type: ignore[arg-type]  # not a Function


def test_a_test_s_protocol_run_again_without_logging(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
        import pytest
        from pytest_gpu.base import privates

        @pytest.hookimpl(tryfirst=True)
        def pytest_runtest_protocol(item, nextitem):
            first = privates.run_protocol(item, nextitem)  # not logged: the run does not count it
            assert [r.outcome for r in first] == ["passed", "failed", "passed"]
            for report in privates.run_protocol(item, nextitem):  # its fixtures set up anew
                item.ihook.pytest_runtest_logreport(report=report)
            return True
        """
    )
    pytester.makepyfile("RUNS = []\n\ndef test_x(tmp_path):\n    RUNS.append(1)\n    assert len(RUNS) == 2\n")
    with uses("_pytest.runner.runtestprotocol"):
        # (pytest-depends refuses a second result for one step: pytest_gpu.run.infra forgets the first)
        pytester.runpytest("-p", "no:cacheprovider", "-p", "no:depends").assert_outcomes(passed=1)


def test_junitxml_names_and_a_property_on_a_report_it_never_finalizes(tmp_path: Path) -> None:
    from _pytest.junitxml import LogXML

    with uses("_pytest.junitxml.mangle_test_address"):
        assert privates.junitxml_name("tests/test_a.py::TestC::test_x") == "test_x"
        assert privates.junitxml_name("t.py::test_x[1]") == "test_x[1]"
        assert privates.junitxml_name("t.py::test_x@rank1") == "test_x@rank1"  # another rank's (launched)
    config: Any = SimpleNamespace(stash=pytest.Stash())
    assert privates.junitxml(config) is None and privates.junitxml_file(config) is None
    logxml = LogXML(str(tmp_path / "report.xml"), None)
    with uses("_pytest.junitxml.xml_key"):
        from _pytest.junitxml import xml_key

        config.stash[xml_key] = logxml
        assert privates.junitxml(config) is logxml
        assert privates.junitxml_file(config) == str(tmp_path / "report.xml")
    # xdist's report of a crashed worker's test: failed outside every phase, never a teardown
    crash = pytest.TestReport("t.py::test_x", ("t.py", None, "t.py"), {}, "failed", "worker crashed", "???")  # type: ignore[arg-type]
    crash.node = _worker("gw1")  # type: ignore[attr-defined]
    with uses("LogXML.node_reporter / _NodeReporter.add_property"):
        privates.junitxml_property(config, crash, "gpu_node", "node1")
        logxml.pytest_sessionstart()
        logxml.pytest_runtest_logreport(crash)
        logxml.pytest_sessionfinish()
        (case,) = ElementTree.parse(tmp_path / "report.xml").getroot().iter("testcase")
        assert [(p.get("name"), p.get("value")) for p in case.iter("property")] == [("gpu_node", "node1")]
        assert case.find("error") is not None


def test_m_expressions_as_pytest_reads_them() -> None:
    with uses("_pytest.mark.expression.Expression"):
        evaluate = privates.mark_matcher("hpc and not slow")
        assert evaluate is not None
        assert evaluate(lambda name, **kw: name == "hpc") is True
        assert evaluate(lambda name, **kw: name in ("hpc", "slow")) is False
        assert privates.mark_matcher("hpc and (") is None  # pytest's own -m says what is wrong
        if tuple(int(p) for p in pytest.__version__.split(".")[:2]) >= (8, 3):  # keyword arguments
            evaluate = privates.mark_matcher("device(serial='1')")
            assert evaluate is not None
            assert evaluate(lambda name, **kw: name == "device" and kw == {"serial": "1"}) is True


# -- pytest-xdist ----------------------------------------------------------------------------


def test_the_workers_xdist_starts_are_counted_from_tx(
    pytestconfig: pytest.Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pytestconfig.option, "tx", ["2*popen", "popen//env:A=1"], raising=False)
    with uses("xdist.workermanage.parse_tx_spec_config (parse_spec_config before 3.7)"):
        assert privates.tx_count(pytestconfig) == 3


def test_what_xdist_says_of_two_different_collections() -> None:
    with uses("xdist.report.report_collection_diff"):
        assert privates.collection_diff(["a", "b"], ["a", "b"], "gw0", "gw1") is None
        said = privates.collection_diff(["a", "b"], ["a", "c"], "gw0", "gw1")
        assert said is not None and "Different tests were collected between gw0 and gw1" in said


def test_a_scheduler_s_log_is_a_sub_log_of_xdist_s() -> None:
    with uses("xdist.remote.Producer"):
        from xdist.remote import Producer

        log = privates.scheduler_log(Producer("dsession", enabled=False), "gpusched")
        assert isinstance(log, Producer) and log.name == "gpusched"
        log("nothing shown: disabled")


class _Channel:
    """An execnet channel that records what is sent (no process behind it)."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, item: Any) -> None:
        self.sent.append(item)


def _worker(name: str, env: str = "") -> Any:
    """xdist's own ``WorkerController``, with a gateway that started nothing."""
    from xdist.workermanage import WorkerController

    spec = execnet.XSpec("popen" + (f"//env:{env}" if env else ""))
    gateway = SimpleNamespace(id=name, spec=spec)
    manager = SimpleNamespace(specs=[spec], testrunuid="abc", roots=[])
    config = SimpleNamespace(pluginmanager=pytest.PytestPluginManager(), option=SimpleNamespace(debug=False))
    worker = WorkerController(manager, gateway, config, lambda event: None)  # type: ignore[arg-type]
    worker.channel = _Channel()
    return worker


def test_a_worker_controller_as_the_scheduler_and_the_nodes_use_it() -> None:
    with uses("WorkerController(nodemanager, gateway, config, putevent)"):
        worker = _worker("gw3", "PYTEST_GPU_NODE=n1")
    with uses("WorkerController.gateway (id, spec.env)"):
        assert privates.worker_id(worker) == "gw3"
        assert privates.worker_env(worker) == {"PYTEST_GPU_NODE": "n1"}
        assert privates.worker_env(SimpleNamespace()) == {}
    with uses("WorkerController.shutting_down, send_runtest_some, shutdown"):
        assert privates.shutting_down(worker) is False
        privates.send_tests(worker, [4, 7])
        privates.stop_worker(worker)
        assert worker.channel.sent == [("runtests", {"indices": [4, 7]}), ("shutdown", {})]
        assert privates.shutting_down(worker) is True


def test_a_refused_worker_is_not_replaced_and_xdist_s_line_says_why(config: pytest.Config) -> None:
    """xdist's own ``DSession``: a crashed worker whose refusal says why is reported crashed as
    ever (its test, with the worker on the report), but not replaced, and the refusal's line
    is said instead of "replacing crashed worker"; another crashed worker is replaced."""
    from xdist.dsession import DSession

    crashed: list[pytest.TestReport] = []

    class Reports:
        @pytest.hookimpl
        def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
            crashed.append(report)

    config.pluginmanager.register(Reports())
    with uses("xdist.dsession.DSession(config)"):
        dsession = DSession(config)
    config.pluginmanager.register(dsession, "dsession")
    lost, other = _worker("gw3", "PYTEST_GPU_NODE=n1"), _worker("gw4", "PYTEST_GPU_NODE=n0")
    lines: list[str] = []
    clones: list[Any] = []
    dsession.report_line = lines.append  # type: ignore[method-assign]
    dsession._clone_node = clones.append  # type: ignore[method-assign]
    dsession.sched = SimpleNamespace(remove_node=lambda worker: f"t.py::test_on_{privates.worker_id(worker)}")
    dsession._active_nodes = {lost, other}

    def refusal(worker: Any) -> str | None:
        return "node n1 lost: gw3 not replaced" if privates.worker_env(worker).get("PYTEST_GPU_NODE") == "n1" else None

    with uses("DSession.worker_errordown, report_line, _clone_node"):
        assert privates.refuse_replacements(config, refusal) is True
        assert privates.refuse_replacements(config, refusal) is True  # once is enough
        dsession.worker_errordown(lost, "crashed")
        assert lines == ["node n1 lost: gw3 not replaced"] and clones == []
        dsession.worker_errordown(other, "crashed")
        assert lines[1:] == ["\nreplacing crashed worker gw4"] and clones == [other]
    with uses("DSession.handle_crashitem (report.node)"):
        assert [r.nodeid for r in crashed] == ["t.py::test_on_gw3", "t.py::test_on_gw4"]
        assert [privates.report_worker(r) for r in crashed] == [lost, other]
    assert privates.report_worker(pytest.TestReport("t.py::y", ("t.py", 1, "y"), {}, "passed", None, "call")) is None


def test_the_package_is_out_of_pytest_s_assertion_rewriting(pytester: pytest.Pytester) -> None:
    """pytest marks every module of a plugin's distribution for rewriting (``_must_rewrite`` of
    its import hook); the package takes itself out, so that, without a bytecode cache, no
    pytest process parses and compiles it again. A test module is still rewritten."""
    pytester.makepyfile(
        """
        import sys

        def test_loaders():
            from _pytest.assertion.rewrite import AssertionRewritingHook

            hook = next(f for f in sys.meta_path if isinstance(f, AssertionRewritingHook))
            assert "pytest_gpu" not in hook._must_rewrite
            for name in ("pytest_gpu.plugin", "pytest_gpu.run.lifecycle", "pytest_gpu.leasing.broker"):
                assert not isinstance(sys.modules[name].__loader__, AssertionRewritingHook), name
            assert isinstance(sys.modules[__name__].__loader__, AssertionRewritingHook)

        def test_still_rewritten():
            found = [1, 2]
            assert found == [1, 3]
        """
    )
    with uses("AssertionRewritingHook._must_rewrite"):
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:depends")
    with uses("AssertionRewritingHook._must_rewrite"):
        result.assert_outcomes(passed=1, failed=1)
    assert "assert [1, 2] == [1, 3]" in result.stdout.str()


def test_without_xdist_s_session_nothing_is_wrapped(config: pytest.Config) -> None:
    assert privates.refuse_replacements(config, lambda worker: "never") is False


def test_the_adapter_names_each_private_it_wraps() -> None:
    """Each function's docstring names what it wraps (this file's tests are by that name)."""
    source = textwrap.dedent(Path(privates.__file__).read_text())
    for name in ("_prepareconfig", "install_importhook", "import_path", "Traceback", "ReprFileLocation",
                 "ReprExceptionInfo", "_fixtureinfo", "xml_key", "mangle_test_address", "node_reporter",
                 "Expression", "parse_tx_spec_config", "report_collection_diff", "Producer", "gateway.id",
                 "shutting_down", "send_runtest_some", "shutdown", "report.node", "_clone_node",
                 "runtestprotocol", "_must_rewrite"):  # fmt: skip
        assert name in source, name
