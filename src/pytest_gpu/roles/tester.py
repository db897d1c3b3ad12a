"""The processes that run tests: an xdist worker, or pytest without workers (``Lone``).

A test's life with its leases is the lease feature's (:class:`~pytest_gpu.run.lifecycle.Leases`);
distributed tests are :class:`~pytest_gpu.distributed.runner.Distributed`'s, the quarantine
:class:`~pytest_gpu.run.sticky.StickyErrors`', deselection
:class:`~pytest_gpu.launched.selection.Selection`'s, ``--gpu-required``
:class:`~pytest_gpu.run.required.Required`'s; a worker under the GPU scheduler adds its
catalog (:class:`~pytest_gpu.scheduling.catalog.Catalog`), one of ``--gpu-nodes`` its node's
(:class:`~pytest_gpu.nodes.worker.NodeWorker`). These role objects only register them, and
hand each the others' parts it needs.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import pytest

from ..distributed import runner
from ..distributed.runner import Distributed
from ..launched.selection import Selection
from ..nodes import worker as node_worker
from ..run import sticky
from ..run.infra import Infrastructure
from ..run.keys import SCHEDULE_KEY, Role
from ..run.lifecycle import Leases
from ..run.required import Required, WorkerRequired
from ..run.session import WIRE_KEY, GpuRun
from ..run.sticky import StickyErrors, WorkerStickyErrors
from .base import RoleBase, Switches
from .owner import RunOwner, start_run


class TestProcess(RoleBase):
    """A process that collects and runs tests: the features every such process registers."""

    __test__ = False  # not a test class, whatever pytest's python_classes say
    leases: Leases

    def wanted(self, switches: Switches) -> dict[str, Callable[[], object]]:
        out = super().wanted(switches)
        # the order matters: among trylast hooks the first registered is called first (deselection
        # before the oversize check); among plain hooks and wrappers the last registered is called
        # first (the lease feature's makereport is the innermost: its verdict is in the report
        # before the quarantine and the distributed tests read it)
        out["selection"] = lambda: Selection(self.config, self.launch)
        out["leases"] = self._leases
        out["quarantine"] = lambda: StickyErrors(self.config)
        out["distributed"] = lambda: Distributed(self.config)
        # after the others: its makereport is the outermost (it classes the final report)
        out["infrastructure"] = lambda: Infrastructure(self.config, partial(runner.close, self.config))
        if switches.required:
            out["required"] = lambda: Required(self.config)
        return out

    def _leases(self) -> Leases:
        self.leases = Leases(
            self.config,
            checks=(runner.stash_spec,),  # the distributed marker, read with the request
            never=(runner.never_runs,),  # a rank pool that cannot be placed here, nccl where it cannot run
            before_release=(sticky.check,),  # broken CUDA keeps its memory: nothing is given back then
            elsewhere=partial(node_worker.every_node, self.config),  # --gpu-nodes: a test another node can run
        )
        return self.leases


class Worker(TestProcess):
    """An xdist worker: joins the controller's run and runs the tests it sends."""

    role = Role.WORKER

    def start(self) -> GpuRun:
        workerinput = self.config.workerinput  # type: ignore[attr-defined]
        if WIRE_KEY not in workerinput:  # a controller without pytest-gpu: a run of its own
            return start_run(self.config, self.launch)
        run = GpuRun.join(workerinput[WIRE_KEY], str(workerinput.get("workerid", "worker")))
        run.largest_node = node_worker.largest(self.config, run)  # --gpu-nodes: requests are checked against it
        run.node = node_worker.node(self.config)  # --gpu-nodes: what a request too large for its GPUs names
        return run

    def switches(self) -> Switches:
        workerinput = self.config.workerinput  # type: ignore[attr-defined]
        return replace(
            super().switches(),
            schedule=bool(workerinput.get(SCHEDULE_KEY)),  # the controller says so
            nodes=node_worker.node(self.config) is not None,
        )

    def wanted(self, switches: Switches) -> dict[str, Callable[[], object]]:
        out = super().wanted(switches)
        out["quarantine"] = lambda: WorkerStickyErrors(self.config, partial(runner.close, self.config))
        out["selection"] = lambda: Selection(self.config, self.launch, worker=True)
        if switches.required:  # before xdist sends the collection
            out["required"] = lambda: WorkerRequired(self.config)
        if switches.schedule:
            out["catalog"] = self._catalog
        if switches.nodes:
            out["node"] = lambda: node_worker.NodeWorker(self.config)
        return out

    def _catalog(self) -> object:
        from ..scheduling.catalog import Catalog  # local: slow (the planner): only where the GPU scheduler runs

        return Catalog(self.config, self.leases.never_runs)

    @pytest.hookimpl(tryfirst=True)  # before xdist sends the collection: the tests wait for it
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        freeze_heap()


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
