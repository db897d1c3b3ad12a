"""The quarantine feature: after each test, is this process's CUDA still usable?

A sticky CUDA error (a device-side assert, an illegal address) breaks the process's CUDA
until it exits; what then happens to its leases, its report and the worker is
:mod:`pytest_gpu.run.quarantine`'s docstring. This module is the feature's hook object
(:class:`StickyErrors`, in every process that runs tests; :class:`WorkerStickyErrors` in an
xdist worker, which may end itself) and the step the lease feature runs after a test's
fixtures are torn down and before its leases go back (:func:`check`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Generator

import pytest

from .feature import Feature
from .holding import TestState
from .keys import SCHEDULE_KEY
from .quarantine import EXIT_STATUS, Quarantine, probe, sticky_message, write_record
from .session import GpuRun

_CALL_ERROR = pytest.StashKey[str]()  # the sticky error the test's call raised, as it said it
_CALL_FAILED = pytest.StashKey[bool]()  # the test's call raised: its failure is reported already


class StickyErrors(Feature):
    """The quarantine's hooks in a process that runs tests."""

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
        note_call(item, call)
        make_report(item, report, self.run)
        return report


class WorkerStickyErrors(StickyErrors):
    """An xdist worker's: also ends the worker before its next test once it is quarantined,
    its rank pools first (``close_pools``)."""

    def __init__(self, config: pytest.Config, close_pools: Callable[[], object]) -> None:
        super().__init__(config)
        self.close_pools = close_pools

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> None:
        # xdist heard the last test complete: a worker whose CUDA it broke ends before this one
        end_worker(self.config, self.run, self.close_pools)


def note_call(item: pytest.Item, call: pytest.CallInfo[None]) -> None:
    """Remember the sticky CUDA error the test's call raised, if it raised one."""
    if call.when == "call" and call.excinfo is not None:
        item.stash[_CALL_FAILED] = True
        found = sticky_message(call.excinfo.value)
        if found is not None:
            item.stash[_CALL_ERROR] = found


def check(item: pytest.Item, run: GpuRun, state: TestState | None) -> None:
    """After the test's fixtures are torn down and before its leases are given back: is
    CUDA still usable? If not, quarantine this process (see :mod:`pytest_gpu.run.quarantine`)."""
    if run.quarantine is not None:
        return
    devices: list[str] = []
    if state is not None:
        for active in [*state.sections, *([state.main] if state.main is not None else [])]:
            devices += [d for d in active.lease.devices if d not in devices]
    error = item.stash.get(_CALL_ERROR, None)
    if devices or error is not None:
        error = probe(devices) or error
    if error is None:
        return
    run.quarantine = Quarantine(item.nodeid, error, run.worker, _ends_itself(item.config))
    write_record(run.run_dir, run.quarantine)


def make_report(item: pytest.Item, report: pytest.TestReport, run: GpuRun) -> None:
    """The quarantining test's teardown report names it and the error."""
    found = run.quarantine
    if found is None or report.when != "teardown" or found.test != item.nodeid:
        return
    then = (
        f"worker {found.worker} ends itself after this test and xdist starts another"
        if _ends_itself(item.config)
        else "later GPU tests of this process are not run"
    )
    text = (
        f"pytest-gpu: {found.describe()}: a sticky CUDA error lasts until the process exits. "
        f"Its GPU memory and leases stay held till then; {then}."
    )
    if report.passed and not item.stash.get(_CALL_FAILED, False):  # it passed, yet broke CUDA: an error
        report.outcome = "failed"
        report.longrepr = text
    else:
        report.sections.append(("pytest-gpu quarantine", text))


def end_worker(config: pytest.Config, run: GpuRun, close_pools: Callable[[], object]) -> None:
    """Before a quarantined worker's next test: end the process, as a crash would end it,
    so that xdist replaces it (its leases and memory go back when it has exited);
    ``close_pools`` first: its rank pools must not outlive it."""
    if run.quarantine is None or not _ends_itself(config):
        return
    try:
        close_pools()
    finally:
        sys.stderr.write(f"pytest-gpu: worker {run.worker} ends: {run.quarantine.describe()}\n")
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(EXIT_STATUS)


def _ends_itself(config: pytest.Config) -> bool:
    """Whether this process is an xdist worker that may end itself: under pytest-gpu's
    scheduler, which gives the test it holds back to pending instead of calling it crashed."""
    workerinput = getattr(config, "workerinput", None)
    return bool(workerinput is not None and workerinput.get(SCHEDULE_KEY))
