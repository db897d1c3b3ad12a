"""``--gpu-required`` (ini ``gpu_required``): a run with GPU tests and no GPUs fails at start.

Without it such a run skips every GPU test and can end green having tested nothing GPU (the
summary says how many were skipped, and why). With it the run stops with a usage error
naming what is missing, exit code 4, before any test runs.

"At start" is right after collection, ``-m``/``-k`` deselection included: only then is it
known whether the run has GPU tests (a CPU-only selection, ``-m "not gpu"``, runs as ever).
``--collect-only`` runs no test and is left alone. pytest without workers raises the error
itself; an xdist worker cannot (xdist would report an internal error), so it leaves its
finding in the run directory and the controller raises it when that worker's collection
comes in, before the first test is handed out.

The tests it counts are those a run without GPUs skips for it, which the summary's
"N GPU tests skipped: no GPUs" counts on the same selection (:func:`asks_for_gpus`): the
same number, but for a test that takes ``gpu_request`` or ``gpu_lease_factory`` and never
calls it (counted here: only its run can tell).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from ..base.wording import plural
from ..gpu.discovery import candidates
from .feature import Feature
from .fixture_leases import FACTORY
from .record import needs

if TYPE_CHECKING:
    from ..vendors.devices import Inventory
    from .session import GpuRun

OPTION = "--gpu-required (ini gpu_required)"


class Required(Feature):
    """The feature's hooks, registered where ``--gpu-required`` is on: in a process that
    collects, the check after collection (:func:`check`); at the xdist controller,
    ``reported`` raises what each worker found as its collection comes in (the run's nodes
    know where: :meth:`pytest_gpu.nodes.feature.RunNodes.raise_required`)."""

    def __init__(self, config: pytest.Config, reported: Callable[[Any], None] | None = None) -> None:
        super().__init__(config)
        self.reported = reported

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        check(session, self.run)  # GPU tests and no GPUs stop the run here

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: Any, ids: Any) -> None:
        if self.reported is not None:
            self.reported(node)  # as the worker found it, on its node


class WorkerRequired(Required):
    """An xdist worker's: its finding is written before xdist sends the worker's collection."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        super().pytest_collection_finish(session)


def asks_for_gpus(item: pytest.Item) -> bool:
    """Whether ``item`` is a GPU test a run without GPUs skips: a request for GPUs (marker,
    fixture, conventions), a distributed test whose pool leases GPUs, a test that leases a
    ``gpu_request`` block, or one with a fixture that leases (``gpu_lease_factory``); unless its
    own ``skip`` (or ``skipif`` with a true bool) skips it whatever GPUs the run has."""
    if _skipped_anyway(item):
        return False
    test = needs(item)
    if test.request is not None and test.request.count:
        return True
    if test.dist is not None and test.dist.gpus_per_rank:
        return True
    fixtures = getattr(item, "fixturenames", ())
    return "gpu_request" in fixtures or FACTORY in fixtures


def _skipped_anyway(item: pytest.Item) -> bool:
    """Whether the test's own marks skip it (not ours: :func:`~.lifecycle.mark_oversize`'s reasons
    start with "pytest-gpu:"); a string condition is pytest's to evaluate, at setup."""
    for mark in item.iter_markers("skip"):
        if not str(mark.kwargs.get("reason", mark.args[0] if mark.args else "")).startswith("pytest-gpu:"):
            return True
    for mark in item.iter_markers("skipif"):
        conditions = mark.args or ((mark.kwargs["condition"],) if "condition" in mark.kwargs else ())
        if not conditions or any(c is True for c in conditions):
            return True
    return False


def problem(items: list[pytest.Item], run: GpuRun) -> str | None:
    """Why ``--gpu-required`` fails this run (it has GPU tests and no GPUs), or ``None``."""
    if not run.settings.required or run.inventory.devices:
        return None
    gpu_tests = [item.nodeid for item in items if asks_for_gpus(item)]
    if not gpu_tests:
        return None
    first = gpu_tests[0] + (", ..." if len(gpu_tests) > 1 else "")
    return (
        f"pytest-gpu: {OPTION}: this run has {run.inventory.describe()}, and "
        f"{plural(len(gpu_tests), 'selected test')} need{'s' if len(gpu_tests) == 1 else ''} GPUs ({first}); "
        f"give the job its GPUs ({gives_gpus(run.inventory)}, --gpus), "
        "or leave --gpu-required out to let GPU tests be skipped"
    )


def gives_gpus(inventory: Inventory) -> str:
    """What gives a job the GPUs ``inventory`` lacks: its vendor's means, or, where ``auto`` found
    no vendor's GPUs, every vendor's, each named."""
    could = candidates(inventory)
    if len(could) == 1:
        return could[0].gives_gpus
    return "; ".join(f"{vendor.label}: {vendor.gives_gpus}" for vendor in could)


def _finding(run: GpuRun, worker: str) -> Path:
    return run.run_dir / f"gpu-required-{worker}.txt"


def check(session: pytest.Session, run: GpuRun) -> None:
    """After collection, in the process that collected: stop the run if ``--gpu-required`` fails it."""
    if session.config.getoption("collectonly", False):
        return
    message = problem(session.items, run)
    if message is None:
        return
    if hasattr(session.config, "workerinput"):
        _finding(run, run.worker).write_text(message, encoding="utf-8")  # for the controller to raise
        return
    raise pytest.UsageError(message)


def reported(run: GpuRun, worker: str) -> str | None:
    """What ``worker`` found, if anything (read where the run's broker is: its run directory)."""
    try:
        return _finding(run, worker).read_text(encoding="utf-8")
    except FileNotFoundError:
        return None


def raise_reported(run: GpuRun, worker: str) -> None:
    """The xdist controller, as ``worker``'s collection comes in: raise what it found."""
    message = reported(run, worker)
    if message is not None:
        raise pytest.UsageError(message)
