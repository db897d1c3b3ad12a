"""Infrastructure failures: their evidence in a test process, their report, ``--gpu-retry-infra``.

What makes a failure *infrastructure* is :mod:`pytest_gpu.run.transient`'s decision; this
module gathers the evidence where the test runs (:class:`Infrastructure`, in every process
that runs tests) and where a worker is lost (:class:`LostWorkers`, the xdist controller):

- memory outside the run on the test's GPUs, sampled once its lease is applied and its
  fixtures set up, and again when it fails with an out-of-memory error
  (:class:`~pytest_gpu.gpu.foreign.OutsideRun`);
- the process's quarantine (:mod:`pytest_gpu.run.quarantine`) when a test's lease was refused;
- the ports the test leased (the ``ports`` fixture's,
  :data:`~pytest_gpu.run.lifecycle.LEASED_PORTS_KEY`) when it fails with ``EADDRINUSE``;
- its rank pool's start timing out (:data:`INIT_TIMEOUT_KEY`, set by the distributed runner);
- the worker that crashed under it (xdist's ``pytest_handlecrashitem``).

A classed failure's report gets a section (:data:`~pytest_gpu.run.transient.SECTION`, shown
with the failure and under ``-rA``) and two properties (``gpu_failure_class``,
``gpu_failure_reason``: ``--junitxml`` writes them, and the summary lists them); both cross
from a worker to the controller with the report.

With ``--gpu-retry-infra`` such a test runs once more: in a test process, at once, after
its leases were given back, with its warm rank pools closed (fresh ranks) and its leases
kept off the GPUs of the failure where the run has others (:attr:`GpuRun.avoid
<pytest_gpu.run.session.GpuRun.avoid>`); a lost worker's test on a fresh worker, put back
into the scheduler's pending tests. The retry's reports are the test's (the first run's
are not logged); they keep the first failure in a section and in ``gpu_first_failure``,
and say ``gpu_retry``: "passed on retry" or "failed on retry". A test's own failure never
runs again. A test refused by a quarantined process is not retried there (its CUDA stays
broken until it exits; under ``-n`` with pytest-gpu's scheduler the worker ends itself
before that could happen).

pytest-rerunfailures: a test it would rerun (``--reruns``, a ``flaky`` marker) is its own:
this module leaves its protocol to it (it still classes the failures), so no test is run
again by both.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator
from contextlib import suppress
from pathlib import Path
from typing import Any

import psutil
import pytest

from ..base import privates
from ..base.procs import read_owner
from . import transient
from .feature import Feature
from .holding import STATE_KEY
from .lifecycle import LEASED_PORTS_KEY, out_of_memory
from .rundir import OWNER_FILE
from .transient import Classified, Evidence, classify

INIT_TIMEOUT_KEY = pytest.StashKey[str]()  # its rank pool's collective did not start in time: why
_BASELINE_KEY = pytest.StashKey[dict[int, int]]()  # GPU index -> bytes outside the run at the test's start
_CLASSED_KEY = pytest.StashKey[Classified]()  # the test's infrastructure failure, once classed
RERUN_OUTCOME = "rerun"  # a lost worker's test, put back to run on a fresh worker


class Infrastructure(Feature):
    """Infrastructure failures in a process that runs tests: the evidence, the report, the
    retry (``--gpu-retry-infra``). ``fresh``: closes this process's warm rank pools, so that
    a retried test gets fresh ranks."""

    def __init__(self, config: pytest.Config, fresh: Callable[[], object] = lambda: None) -> None:
        super().__init__(config)
        self.fresh = fresh
        self._outside: Any = None  # OutsideRun, made at the first GPU test's start

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, None, None]:
        __tracebackhide__ = True  # a fixture's error passes through here: its traceback starts in the fixture
        try:
            return (yield)
        finally:  # the lease applied, the fixtures set up (or failed to): what is outside the run now
            gpus = self._gpus(item)
            if gpus:
                item.stash[_BASELINE_KEY] = self._sample(gpus)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
        if report.failed and report.when in ("setup", "call") and _CLASSED_KEY not in item.stash:
            exc = call.excinfo.value if call.excinfo is not None else None
            found = classify(self.evidence(item, report.when, exc))
            if found is not None:
                item.stash[_CLASSED_KEY] = found
                mark(item, report, found)
        return report

    def evidence(self, item: pytest.Item, when: str, exc: BaseException | None) -> Evidence:
        """What this process saw around ``item``'s failed phase ``when``, raising ``exc``."""
        run = self.run
        gpus = self._gpus(item)
        oom = exc is not None and out_of_memory(exc)
        grown: dict[int, int] = {}
        before = item.stash.get(_BASELINE_KEY, None)
        if oom and before:
            grown = transient.growth(before, self._sample(gpus))
        ports: list[int] = item.stash.get(LEASED_PORTS_KEY, [])
        found = run.quarantine  # an earlier test's: its refusal names it (quarantine.refuse)
        refused = when == "setup" and found is not None and found.test != item.nodeid and found.describe() in str(exc)
        by = found.test if refused and found is not None else None
        return Evidence(
            out_of_memory=oom,
            foreign_growth=grown,
            quarantined_by=by,
            address_in_use=exc is not None and transient.address_in_use(exc),
            leased_ports=tuple(ports),
            init_timeout=item.stash.get(INIT_TIMEOUT_KEY, None),
            gpus=tuple(sorted(gpus)),
        )

    def _gpus(self, item: pytest.Item) -> set[int]:
        state = item.stash.get(STATE_KEY, None)
        return set() if state is None else state.indices | state.fixture_gpus

    def _sample(self, gpus: set[int]) -> dict[int, int]:
        if self._outside is None:
            from ..gpu.foreign import OutsideRun  # local: slow (the machine's arbiter), for GPU tests only

            self._outside = OutsideRun(run_roots(self.run.run_dir))
        names = {d.index: d.uuid for d in self.run.inventory.devices if d.index in gpus}
        try:
            found: dict[int, int] = self._outside.sample(names)
        except Exception:  # the driver went away: nothing is known, the test's outcome stands
            return {}
        return found

    def pytest_unconfigure(self) -> None:
        if self._outside is not None:
            self._outside.close()

    # -- the retry ----------------------------------------------------------------------

    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
        if not self.has_run or not self.run.settings.retry_infra or rerunfailures_owns(item):
            return None
        ihook = item.ihook
        ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        properties = list(item.user_properties)
        reports = privates.run_protocol(item, nextitem)
        found = item.stash.get(_CLASSED_KEY, None)
        if found is not None and found.retryable and self.run.quarantine is None:
            first = next(r for r in reports if r.failed)
            item.user_properties[:] = properties  # the retry's leases and verdicts, not the first run's too
            del item.stash[_CLASSED_KEY]
            reports = self._again(item, nextitem, found, first)
        for report in reports:
            ihook.pytest_runtest_logreport(report=report)
        ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True

    def _again(
        self, item: pytest.Item, nextitem: pytest.Item | None, found: Classified, first: pytest.TestReport
    ) -> list[pytest.TestReport]:
        run = self.run
        item.stash[LEASED_PORTS_KEY] = []  # the first run's evidence is not the retry's
        if INIT_TIMEOUT_KEY in item.stash:
            del item.stash[INIT_TIMEOUT_KEY]
        if _BASELINE_KEY in item.stash:
            del item.stash[_BASELINE_KEY]
        forget_depends_results(item)
        self.fresh()  # warm rank pools: fresh ranks for the retry
        run.avoid = frozenset(found.gpus)
        try:
            reports = privates.run_protocol(item, nextitem)
        finally:
            run.avoid = frozenset()
        outcome = "failed on retry" if any(r.failed for r in reports) else "passed on retry"
        text = transient.first_failure(found.reason, crash_line(first))
        for report in reports:
            report.user_properties += [(transient.RETRY_PROPERTY, outcome), (transient.FIRST_PROPERTY, text)]
        main = next((r for r in reports if r.when == "call"), reports[-1])
        main.sections.append((transient.FIRST_SECTION, f"{found.reason}\n\n{first.longreprtext}"))
        return reports


class LostWorkers(Feature):
    """The xdist controller's part: a test whose worker was lost under it is an
    infrastructure failure; with ``--gpu-retry-infra`` it goes back to the scheduler's
    pending tests once (xdist starts a fresh worker in the lost one's place), and its report
    from that run keeps the first failure."""

    def __init__(self, config: pytest.Config) -> None:
        super().__init__(config)
        self.retried: dict[str, str] = {}  # node id -> its first failure, as the retry's report keeps it

    @pytest.hookimpl(optionalhook=True)
    def pytest_handlecrashitem(self, crashitem: str, report: pytest.TestReport, sched: Any) -> None:
        node = privates.report_worker(report)
        worker = privates.worker_id(node) if node is not None else "?"
        found = classify(Evidence(lost=f"worker {worker} crashed while running it"))
        assert found is not None
        mark(None, report, found)
        retry = self.has_run and self.run.settings.retry_infra
        if retry and crashitem not in self.retried and hasattr(sched, "mark_test_pending"):
            self.retried[crashitem] = transient.first_failure(found.reason, report.longreprtext)
            sched.mark_test_pending(crashitem)
            report.outcome = RERUN_OUTCOME  # type: ignore[assignment]  # counted once: as the retry ends
            return
        # junitxml writes a crashed test's properties only with a teardown: these two here (the
        # others, such as its node's, are written by whoever added them)
        for name, value in report.user_properties:
            if name in (transient.CLASS_PROPERTY, transient.REASON_PROPERTY):
                privates.junitxml_property(self.config, report, name, str(value))

    @pytest.hookimpl(tryfirst=True)  # before the terminal and junit read it
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        text = self.retried.get(report.nodeid)
        if text is None or report.outcome == RERUN_OUTCOME:
            return
        outcome = "failed on retry" if report.failed else "passed on retry"
        if (transient.RETRY_PROPERTY, outcome) not in report.user_properties:
            report.user_properties += [(transient.RETRY_PROPERTY, outcome), (transient.FIRST_PROPERTY, text)]
        if report.when == "call":
            report.sections.append((transient.FIRST_SECTION, text))

    def pytest_report_teststatus(self, report: pytest.TestReport) -> tuple[str, str, str] | None:
        if report.outcome == RERUN_OUTCOME:
            return RERUN_OUTCOME, "R", "RERUN"
        return None


def mark(item: pytest.Item | None, report: pytest.TestReport, found: Classified) -> None:
    """Say in ``report`` (and, for its later reports, ``item``'s properties) that its failure
    is an infrastructure failure, and why."""
    properties = [(transient.CLASS_PROPERTY, found.kind), (transient.REASON_PROPERTY, found.reason)]
    if item is not None:
        item.user_properties.extend(properties)  # the teardown report's: what --junitxml writes
    report.user_properties.extend(properties)
    report.sections.append((transient.SECTION, found.reason))


def crash_line(report: pytest.TestReport) -> str:
    """The failure's one line, as pytest's short summary says it."""
    crash = getattr(report.longrepr, "reprcrash", None)
    message = getattr(crash, "message", None)
    if message:
        return str(message).splitlines()[0]
    lines = report.longreprtext.strip().splitlines()
    return lines[-1] if lines else ""


def run_roots(run_dir: Path) -> dict[int, float]:
    """The run's processes' roots (pid -> create time): its owner, and this process (a
    ``--gpu-nodes`` worker descends from its node's host, not from the owner); every process
    descending from one of them is the run's."""
    roots = {os.getpid(): psutil.Process().create_time()}
    with suppress(OSError, ValueError, KeyError, TypeError):  # no owner file: this process's tree alone
        pid, ctime = read_owner(run_dir / OWNER_FILE)
        roots[pid] = ctime
    return roots


def forget_depends_results(item: pytest.Item) -> None:
    """pytest-depends keeps one result per step of each test and refuses a second (an error
    from its makereport hook): the retry's results replace the first run's there. Its
    manager (``pytest_depends.managers[-1].results``, node id -> its ``TestResult``) is not
    public API: where it changed, nothing is done."""
    plugin = item.config.pluginmanager.get_plugin("depends") or item.config.pluginmanager.get_plugin("pytest_depends")
    managers = getattr(plugin, "managers", None)
    if not managers:
        return
    found = getattr(managers[-1], "results", {}).get(item.nodeid.replace("::()::", "::"))
    steps = getattr(found, "results", None)
    if isinstance(steps, dict):
        steps.clear()


def rerunfailures_owns(item: pytest.Item) -> bool:
    """Whether pytest-rerunfailures would rerun ``item`` (``--reruns``, its ``flaky``
    marker): then its protocol runs the test, and this one leaves it alone."""
    plugin = item.config.pluginmanager.get_plugin("rerunfailures")
    count = getattr(plugin, "get_reruns_count", None)
    if count is None:
        return False
    try:
        return bool(count(item))
    except Exception:  # a release that changed it: it runs its own protocol if it has one
        return True
