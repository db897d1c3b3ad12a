"""pytest's and pytest-xdist's private names: every use of one goes through here.

Neither project promises these names (a leading underscore, or an attribute their docs do
not list), and each release may change them. Each function below wraps one, so a change
breaks one place, and tests/base/test_privates.py, which runs on the floors pyproject.toml
declares (pytest 8.0, pytest-xdist 3.5, see .ci/floors) and on the newest releases, fails
naming it. Where a public API does the same it is used instead (``pytest.ExceptionInfo``,
``pytest.Collector``, ``item.fixturenames``).

The projects are imported when a function is first called: the plugin is loaded into every
pytest process, and rank processes start before they need pytest.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from types import ModuleType

    import pytest
    from _pytest._code.code import ReprExceptionInfo, ReprFileLocation
    from _pytest.junitxml import LogXML

# -- pytest --------------------------------------------------------------------------------


def keep_out_of_rewriting(package: str) -> None:
    """Take ``package``'s modules out of pytest's assertion rewriting, which marks every module
    of a plugin's distribution (``Config._mark_plugins_for_rewrite``; the marks are the import
    hook's ``_must_rewrite``). A rewritten module is parsed and compiled again at every import
    wherever pytest cannot cache it (``PYTHONDONTWRITEBYTECODE``, as many container images set,
    or a read-only ``site-packages``): ~0.33 s of every pytest process and xdist worker for
    this package. Its asserts are its own invariants, not tests: plain ``AssertionError`` is
    what they should raise. Without the hook, or with another shape of it, nothing is done."""
    for finder in sys.meta_path:
        marked = getattr(finder, "_must_rewrite", None)
        if type(finder).__name__ != "AssertionRewritingHook" or not isinstance(marked, set):
            continue
        marked.discard(package)
        decided = getattr(finder, "_marked_for_rewrite_cache", None)
        if isinstance(decided, dict):
            for name in [n for n in decided if n == package or n.startswith(package + ".")]:
                del decided[name]


def prepare_config(args: list[str]) -> pytest.Config:
    """A config from command-line ``args``, plugins loaded, not configured (what ``pytest.main``
    starts from): a rank process's, for assertion rewriting (``_pytest.config._prepareconfig``)."""
    from _pytest.config import _prepareconfig

    return _prepareconfig(args)


def rewrite_asserts(config: pytest.Config) -> None:
    """Rewrite the asserts of test modules imported from now on, as ``config`` says
    (``_pytest.assertion.install_importhook``)."""
    from _pytest.assertion import install_importhook

    install_importhook(config)


def import_test_module(path: str, mode: str, root: Path) -> ModuleType:
    """Import a test module as pytest's collection does (``_pytest.pathlib.import_path``;
    its ``consider_namespace_packages`` is pytest 8.1's: older ones lack it)."""
    from _pytest.pathlib import import_path

    try:
        return import_path(path, mode=mode, root=root, consider_namespace_packages=False)
    except TypeError:  # pytest 8.0
        return import_path(path, mode=mode, root=root)  # type: ignore[call-arg]


def trim_traceback(info: pytest.ExceptionInfo[BaseException], module_file: str | None, full_ends: bool) -> None:
    """Shape ``info``'s traceback as pytest does a test's: from the frame of ``module_file``
    on (if it has one), and with ``full_ends`` the first and last frame in full, those
    between short (``--tb=auto``). (``ExceptionInfo.traceback`` is public, the ``Traceback``
    it holds and its entries' ``with_repr_style`` are ``_pytest._code.code``'s.)"""
    from _pytest._code.code import Traceback

    if module_file:
        cut = info.traceback.cut(path=Path(module_file))
        if cut:
            info.traceback = cut
    tb = info.traceback
    if full_ends and len(tb) > 2:
        info.traceback = Traceback((tb[0], *(e.with_repr_style("short") for e in tb[1:-1]), tb[-1]))


def file_location(path: str, lineno: int, message: str) -> ReprFileLocation:
    """Where a failure is, as a report's ``longrepr.reprcrash`` says (the short summary's line)
    (``_pytest._code.code.ReprFileLocation``)."""
    from _pytest._code.code import ReprFileLocation

    return ReprFileLocation(path, lineno, message)


def text_failure(lines: Sequence[str], crash: ReprFileLocation) -> ReprExceptionInfo:
    """A failure whose traceback is ``lines`` as they are (formatted elsewhere), reported as a
    test's own, serialised whole by xdist (``_pytest._code.code``'s ``ReprExceptionInfo``,
    ``ReprTraceback`` and ``ReprEntry``)."""
    from _pytest._code.code import ReprEntry, ReprExceptionInfo, ReprTraceback

    entry = ReprEntry(lines=list(lines), reprfuncargs=None, reprlocals=None, reprfileloc=None, style="value")
    return ReprExceptionInfo(reprtraceback=ReprTraceback([entry], None, "value"), reprcrash=crash)


def fixture_info(item: pytest.Item) -> Any | None:
    """The fixtures of ``item`` as collection resolved them (``item._fixtureinfo``: its
    ``argnames``, ``names_closure`` and ``name2fixturedefs``); ``None`` for an item that has
    none (not a ``pytest.Function``)."""
    return getattr(item, "_fixtureinfo", None)


def junitxml(config: pytest.Config) -> LogXML | None:
    """The run's ``--junitxml`` reporter, ``None`` without one (``_pytest.junitxml.xml_key``)."""
    from _pytest.junitxml import xml_key

    return config.stash.get(xml_key, None)


def junitxml_file(config: pytest.Config) -> str | None:
    """The file ``--junitxml`` writes (``LogXML.logfile``), ``None`` without one."""
    logxml = junitxml(config)
    return None if logxml is None else str(logxml.logfile)


def junitxml_name(nodeid: str) -> str:
    """The ``name`` junitxml gives the testcase of ``nodeid`` (``_pytest.junitxml.mangle_test_address``)."""
    from _pytest.junitxml import mangle_test_address

    return mangle_test_address(nodeid)[-1]


def junitxml_property(config: pytest.Config, report: pytest.TestReport, name: str, value: str) -> None:
    """A ``property`` on ``report``'s testcase in ``--junitxml``'s file, also for a report
    junitxml never finalizes (xdist's report of a crashed worker's test has no teardown, and
    junitxml writes ``user_properties`` only with one) (``LogXML.node_reporter``)."""
    logxml = junitxml(config)
    if logxml is not None:
        logxml.node_reporter(report).add_property(name, value)


def mark_matcher(text: str) -> Callable[[Callable[..., bool]], bool] | None:
    """``-m TEXT`` as pytest reads it: evaluated with a matcher of marker names (and, from
    pytest 8.3, keyword arguments); ``None`` where pytest cannot read it (pytest's own ``-m``
    reports that) (``_pytest.mark.expression.Expression``)."""
    from _pytest.mark.expression import Expression

    try:
        expression = Expression.compile(text)
    except Exception:  # ParseError (pytest 8), SyntaxError (pytest 9)
        return None
    return expression.evaluate


def run_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> list[pytest.TestReport]:
    """One test's setup, call and teardown as pytest runs them, its reports returned, not
    logged: a ``pytest_runtest_protocol`` that decides what to log (``_pytest.runner.runtestprotocol``)."""
    from _pytest.runner import runtestprotocol

    return runtestprotocol(item, nextitem=nextitem, log=False)


# -- pytest-xdist --------------------------------------------------------------------------


def tx_count(config: pytest.Config) -> int:
    """How many workers xdist starts (``--tx``, ``N*spec`` counted N times): what a scheduler
    waits for before it schedules (``xdist.workermanage.parse_tx_spec_config``, before 3.7
    ``parse_spec_config``)."""
    import xdist.workermanage as workermanage

    parse = getattr(workermanage, "parse_tx_spec_config", None) or workermanage.parse_spec_config
    return len(parse(config))


def collection_diff(first: Sequence[str], other: Sequence[str], first_id: str, other_id: str) -> str | None:
    """What xdist says when two workers collected different tests (``None``: the same)
    (``xdist.report.report_collection_diff``)."""
    from xdist.report import report_collection_diff

    said: str | None = report_collection_diff(list(first), list(other), first_id, other_id)
    return said


def scheduler_log(log: Any, name: str) -> Callable[..., None]:
    """The log a scheduler writes to, under ``name``, from the ``log`` xdist hands
    ``pytest_xdist_make_scheduler`` (an ``xdist.remote.Producer``: an attribute is a sub-log)."""
    sub: Callable[..., None] = getattr(log, name)
    return sub


def worker_id(worker: Any) -> str:
    """An xdist worker's id (``gw0``) from its ``WorkerController`` (``worker.gateway.id``)."""
    return str(worker.gateway.id)


def worker_env(worker: Any) -> Mapping[str, str]:
    """The ``env:`` keys of the execnet spec a worker was started with (``worker.gateway.spec.env``)."""
    spec = getattr(getattr(worker, "gateway", None), "spec", None)
    return dict(getattr(spec, "env", None) or {})


def shutting_down(worker: Any) -> bool:
    """Whether a worker was told to stop or is gone (``WorkerController.shutting_down``)."""
    return bool(worker.shutting_down)


def send_tests(worker: Any, indices: Sequence[int]) -> None:
    """Hand a worker tests, by collection index (``WorkerController.send_runtest_some``)."""
    worker.send_runtest_some(list(indices))


def stop_worker(worker: Any) -> None:
    """Tell a worker to finish its tests and stop (``WorkerController.shutdown``)."""
    worker.shutdown()


def report_worker(report: pytest.TestReport) -> Any | None:
    """The worker whose report xdist relayed to the controller, the report it made of a
    crashed worker's test included (``report.node``); ``None``: not a worker's."""
    return getattr(report, "node", None)


_GUARD = "pytest_gpu_guard"


def refuse_replacements(config: pytest.Config, refusal: Callable[[Any], str | None]) -> bool:
    """Have xdist not replace a crashed worker for which ``refusal(worker)`` says why not.

    xdist replaces every crashed worker with one of the same spec (``DSession.worker_errordown``
    says "replacing crashed worker gwN", then calls ``DSession._clone_node``); xdist has no
    hook to refuse. For a refused worker, this run's session prints the refusal's line in
    place of xdist's and starts no replacement; everything else xdist does for a crashed
    worker (its running test reported crashed, its queued tests to the others) stays.
    ``False`` where xdist's session is not there or lacks these names (xdist's own
    behaviour then stays)."""
    dsession = config.pluginmanager.getplugin("dsession")
    errordown = getattr(dsession, "worker_errordown", None)
    if errordown is None or not all(hasattr(dsession, n) for n in ("report_line", "_clone_node")):
        return False
    if getattr(errordown, _GUARD, False):
        return True

    def worker_errordown(node: Any, error: object | None) -> None:
        said = refusal(node)
        if said is None:
            errordown(node, error)
            return
        replacing = f"replacing crashed worker {worker_id(node)}"
        report_line = dsession.report_line
        shown: list[bool] = []

        def line(text: str) -> None:
            if text.strip() == replacing:
                shown.append(True)
                text = said
            report_line(text)

        saved = {n: vars(dsession)[n] for n in ("report_line", "_clone_node") if n in vars(dsession)}
        dsession.report_line = line
        dsession._clone_node = lambda worker: None
        try:
            errordown(node, error)
        finally:
            for name in ("report_line", "_clone_node"):
                if name in saved:
                    setattr(dsession, name, saved[name])
                else:
                    delattr(dsession, name)
        if not shown:  # xdist said something else (its restart limit reached): ours still holds
            report_line(said)

    setattr(worker_errordown, _GUARD, True)
    dsession.worker_errordown = worker_errordown
    return True
