"""The processes that run tests: an xdist worker, or pytest without workers (``Lone``).

Each test's life (request, lease, confinement, verification, report) is
:mod:`pytest_gpu.run.lifecycle`'s; distributed tests are :mod:`pytest_gpu.distributed.runner`'s.
These hooks only call them in pytest's order.
"""

from __future__ import annotations

import gc
from collections.abc import Generator
from typing import Any

import pytest

from ..distributed import runner
from ..gpu import verification
from ..launched import selection
from ..launched.session import select_share
from ..nodes import worker as node_worker
from ..run import fixture_leases, lifecycle, quarantine, required
from ..run.keys import SCHEDULE_KEY, Role
from ..run.record import needs
from .base import RoleBase
from .owner import RunOwner


class TestProcess(RoleBase):
    """Hooks of a process that collects and runs tests."""

    __test__ = False  # not a test class, whatever pytest's python_classes say

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(
        self, collector: pytest.Collector
    ) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
        report = yield
        lifecycle.collect_report(report, self.run, (runner.stash_spec,))
        return report

    @pytest.hookimpl(trylast=True)  # after pytest's -m/-k: the reasons count only the tests they kept
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        selection.deselect(config, items, self.launch)
        workeroutput = getattr(config, "workeroutput", None)
        if workeroutput is not None:  # the controller prints the reasons (a worker's terminal is not shown)
            workeroutput[selection.WORKEROUTPUT_KEY] = dict(config.stash.get(selection.REASONS_KEY, {}))
        self.select(items)
        lifecycle.mark_oversize(items, self.run, node_worker.every_node(config, self.run))

    def select(self, items: list[pytest.Item]) -> None:
        """Narrow the collected tests further (a worker: its rank's shard)."""

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        required.check(session, self.run)  # --gpu-required: GPU tests and no GPUs stop the run here

    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        # plain (not tryfirst): after the skip/skipif/xfail checks, before fixtures are set up
        lifecycle.setup(item, self.run)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Generator[None, None, None]:
        __tracebackhide__ = True  # a fixture's teardown error passes through here: its traceback is the fixture's
        fixture_leases.leave(item)  # fixtures torn down from here on are released once this test is verified
        lifecycle.release_failure(item)  # a failed call's frames no longer hold the test's memory
        try:
            return (yield)
        finally:
            lifecycle.teardown(item, self.run)

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef: Any, request: pytest.FixtureRequest) -> Generator[None, Any, Any]:
        __tracebackhide__ = True  # a fixture's error passes through here: its traceback starts in the fixture
        with fixture_leases.setting_up(fixturedef, request):  # gpu_lease_factory/ports_factory calls are its
            if fixturedef.scope == "function":
                return (yield)
            # processes a longer-lived fixture starts are its own, not the test's it was set up for
            with verification.claiming(f"fixture {fixturedef.argname}"):
                return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
        quarantine.note_call(item, call)
        lifecycle.make_report(item, report, self.run, call.excinfo.value if call.excinfo is not None else None)
        quarantine.make_report(item, report, self.run)
        runner.make_report(item, call, report)
        return report

    @pytest.hookimpl(tryfirst=True)
    def pytest_pyfunc_call(self, pyfuncitem: pytest.Function) -> bool | None:
        if needs(pyfuncitem).dist is None:
            return None
        runner.run_item(pyfuncitem, self.run)
        return True

    def finish_session(self, session: pytest.Session) -> None:
        runner.close(self.config)  # no rank outlives the session, also after Ctrl-C
        super().finish_session(session)

    def close(self) -> None:
        runner.close(self.config)
        super().close()


class Worker(TestProcess):
    """An xdist worker: runs the tests the controller sends it, in the controller's run."""

    role = Role.WORKER

    def select(self, items: list[pytest.Item]) -> None:
        if self.launch is not None and self.config.getoption("shard"):
            select_share(self.config, self.launch, items)  # xdist workers collect: each takes the rank's share

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> None:
        # xdist heard the last test complete: a worker whose CUDA it broke ends before this one
        quarantine.end_worker(self.config, self.run, lambda: runner.close(self.config))
        node = node_worker.node(self.config)
        if node is not None:  # --gpu-nodes: each report (and junitxml's testcase) names the node it ran on
            item.user_properties.append(("gpu_node", node))

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        super().pytest_collection_finish(session)  # before xdist sends the node ids too
        freeze_heap()
        # tell the scheduler what each test needs before xdist sends the node ids
        if not self.config.workerinput.get(SCHEDULE_KEY) or not session.items:  # type: ignore[attr-defined]
            return
        from ..scheduling.catalog import entries

        tests = entries(session.items, self.run)
        if tests:  # a CPU-only suite needs no entry, and so no connection to the broker
            self.run.client.catalog(tests)


def freeze_heap() -> None:
    """Leave what exists after collection (modules, plugins, items) out of the cyclic GC.

    pytest (8.4 and later) ends every process's session with five full ``gc.collect()``
    passes (``_pytest.unraisableexception.cleanup``): 0.1-0.7 s per worker on the bench's
    suites, after its last test. A worker that finishes early pays it while others still
    run tests, but when workers finish together, as the GPU scheduler makes them, all pay it
    at once, after the last test, and the run ends when the slowest has (on 2 cores, 8
    workers: 0.5 s more). Frozen objects are skipped by every later collection; they are
    still freed when their references go (only garbage cycles among them would stay, until
    the worker exits), and nothing a test creates is frozen."""
    gc.collect()  # what collection left in cycles is freed, not frozen
    gc.freeze()


class Lone(TestProcess, RunOwner):
    """pytest without xdist workers: owns the run and runs its tests."""

    role = Role.LONE
