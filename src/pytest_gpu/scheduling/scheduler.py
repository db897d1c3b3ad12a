"""The xdist scheduler: hands tests to workers by their GPU needs and past durations.

Used under ``-n`` unless the user chose ``--dist`` or gave ``--gpu-schedule=off``. It
implements xdist's ``Scheduling`` protocol around :class:`~pytest_gpu.scheduling.planner.Planner`
(the policy). Each worker holds the test it runs and the next (xdist starts a test only
once its worker holds the one after), so every decision is taken as late as xdist allows;
a worker whose held tests end within half a second also holds the one after, so that it
starts its next test without waiting for the controller's answer (:meth:`Planner.fill`).

Which tests go first follows the run's options, as pytest orders ``items`` for them
(:func:`order`): ``--ff`` (and ``--lf``) puts last run's failures first, ``--nf`` new
tests, and ``-x``/``--maxfail`` last failures then the shortest tests (the developer
waits for the first failure, not for the end of the run). Without these options: longest
first, for the shortest makespan.

``gpu_serial`` tests come before all of these, one after another on one worker, while
the other workers are given nothing (the planner's rule 0): at the start of the run no
worker runs a test yet, so the drain costs nothing. The worker's next test is handed to
it with the last of them (xdist starts a test only once its worker holds the next one)
and starts once that one finished; then every worker gets work again.

The run's GPUs are its nodes' (:class:`Nodes`): a run on one machine is a run with one
node, whose view the run's own broker serves; under ``--gpu-nodes`` each node's host sends
its broker's. Before each round the scheduler reads every node's view (room, grants,
contexts and their sizes, limits, catalog: :class:`~pytest_gpu.leasing.view.NodeView`) and
the planner packs each worker's tests onto its node's GPUs. Where the planner planned a GPU
test's lease (:meth:`Planner.planned`), the plan goes to the broker of the worker's node as
the test is handed out (:meth:`Nodes.prefer`, in that broker's GPU indices: the view
translates), which places the lease there when it fits (:meth:`Broker.prefer`).

A worker that dies gives back what it held: xdist reports the test it was running,
the rest returns to pending and goes to the other workers (or xdist's replacement). No
test waits for a dead worker, so the run cannot hang on one.
"""

from __future__ import annotations

import time
from collections import ChainMap
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import pytest

from ..base import privates
from ..leasing.view import NodeView
from ..run import history, quarantine
from ..run.feature import Feature
from ..run.keys import SCHEDULE_KEY
from . import catalog
from .planner import Grant, Order, Planner

if TYPE_CHECKING:
    from xdist.workermanage import WorkerController

    from ..run.session import GpuRun


class Nodes(Protocol):
    """The run's nodes as the scheduler drives them: one, served by the run's own broker
    (:class:`pytest_gpu.nodes.feature.OneMachine`), or those of ``--gpu-nodes``
    (:class:`pytest_gpu.nodes.feature.NodesFeature`)."""

    def views(self) -> Mapping[str, NodeView]:
        """Each live node's broker now (a node that stopped answering is left out)."""
        ...

    def prefer(self, node: str, worker: str, test: str, gpus: tuple[int, ...], memory: int | None) -> None:
        """:meth:`Broker.prefer` on ``node``'s broker (``gpus``: that broker's indices)."""
        ...

    def node_of(self, worker: Any) -> str:
        """The node an xdist worker runs on."""
        ...


class Scheduling(Feature):
    """The feature's hook object at the xdist controller, registered where the GPU scheduler
    hands the tests out (``--gpu-schedule=on``, the default, and no ``--dist`` chosen): each
    worker is told so (its catalog, :class:`~pytest_gpu.scheduling.catalog.Catalog`), and
    xdist is given :class:`GpuScheduling` over the run's ``nodes`` (known at ``pytest_configure``)."""

    def __init__(self, config: pytest.Config, nodes: Callable[[], Nodes]) -> None:
        super().__init__(config)
        self._nodes = nodes

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node: Any) -> None:
        node.workerinput[SCHEDULE_KEY] = True  # each new worker (replacements too)

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log: Any) -> GpuScheduling:
        durations = history.load(config, history.DURATIONS_KEY)
        return GpuScheduling(config, log, self.run, durations, self._nodes())


class GpuScheduling:
    """xdist ``Scheduling`` for pytest-gpu (see the module docstring): the tests of the
    run's ``nodes``' workers, each worker's packed onto its node's GPUs."""

    def __init__(self, config: pytest.Config, log: Any, run: GpuRun, durations: dict[str, float], nodes: Nodes) -> None:
        self.numnodes = privates.tx_count(config)
        self.config = config
        self.log = privates.scheduler_log(log, "gpusched")
        self.run = run
        self.durations = durations
        self.node2collection: dict[WorkerController, list[str]] = {}
        self._names: dict[WorkerController, str] = {}
        self.collection: list[str] | None = None
        self.planner: Planner | None = None
        self.gpu_nodes = nodes
        self._node: dict[WorkerController, str] = {}

    # -- what xdist asks ------------------------------------------------------------

    @property
    def nodes(self) -> list[WorkerController]:
        return list(self._names)

    @property
    def collection_is_completed(self) -> bool:
        return len(self.node2collection) >= self.numnodes

    @property
    def tests_finished(self) -> bool:
        if not self.collection_is_completed or self.planner is None:
            return False
        if self.planner.pending:
            return False
        return all(len(self.planner.queue(name)) < 2 for name in self._names.values())

    @property
    def has_pending(self) -> bool:
        if self.planner is None:
            return False
        return bool(self.planner.pending) or any(self.planner.queue(name) for name in self._names.values())

    def add_node(self, node: WorkerController) -> None:
        self._names[node] = privates.worker_id(node)
        self._node[node] = self.gpu_nodes.node_of(node)
        if self.planner is not None:
            self.planner.add_worker(self._names[node], self._node[node])

    def add_node_collection(self, node: WorkerController, collection: Sequence[str]) -> None:
        if self.collection is not None and list(collection) != self.collection:
            other = next(iter(self.node2collection))
            ids = privates.worker_id(other), privates.worker_id(node)
            self.log(privates.collection_diff(self.collection, list(collection), *ids))
            return
        self.node2collection[node] = list(collection)

    def mark_test_complete(self, node: WorkerController, item_index: int, duration: float = 0) -> None:
        assert self.planner is not None
        self.planner.complete(self._names[node], item_index, time.monotonic())
        self._fill_all()

    def mark_test_pending(self, item: str) -> None:
        assert self.planner is not None and self.collection is not None
        self.planner.requeue(self.collection.index(item))
        self._fill_all()

    def remove_pending_tests_from_node(self, node: WorkerController, indices: Sequence[int]) -> None:
        raise NotImplementedError  # only work stealing (--dist worksteal) asks this

    def remove_node(self, node: WorkerController) -> str | None:
        name = self._names.pop(node)  # its collection stays: collection_is_completed must not flip back
        if self.planner is None:
            return None
        held = self.planner.remove_worker(name)
        if not held:
            return None
        assert self.collection is not None

        if quarantine.ended(self.run.run_dir, name):
            # it ended itself between two tests (a sticky CUDA error): the one it held never started
            self.log(f"{name} ended itself (quarantined); its {len(held)} test(s) go back to pending")
            self.planner.requeue(held[0])
            self._fill_all()
            return None
        self.log(f"{name} went away holding {len(held)} test(s); {len(held) - 1} go back to pending")
        self._fill_all()
        return self.collection[held[0]]

    def schedule(self) -> None:
        assert self.collection_is_completed
        if self.collection is None:
            if not self._same_collections():
                self.log("**Different tests collected, aborting run**")
                return
            self.collection = next(iter(self.node2collection.values()))
            known = _catalog(self.gpu_nodes.views())  # every node's, as its workers sent it (live)
            jobs = catalog.jobs(self.collection, known, self.durations)
            self.planner = Planner(jobs, order_from(self.config, self.collection))
            self.planner.held = catalog.HeldNeeds(known)  # what leasing fixtures hold, as workers set them up
            for node, name in self._names.items():
                self.planner.add_worker(name, self._node[node])
        self._fill_all()

    # -- handing out ----------------------------------------------------------------

    def _fill_all(self) -> None:
        """Top every live worker up (:meth:`Planner.fill`: the running test, the next, and one
        more while it fits); stop the ones with nothing left to do."""
        planner = self.planner
        assert planner is not None
        views = planner.nodes = self.gpu_nodes.views()  # each node's room, grants and contexts, from its broker
        live = [node for node in self._names if not privates.shutting_down(node)]
        sent: dict[str, list[int]] = {self._names[node]: [] for node in live}
        for name, index in planner.fill(list(sent), time.monotonic()):
            sent[name].append(index)
            plan = planner.planned(index)
            if plan is not None and self.collection is not None:
                # where its lease should go: the broker's own rule would not know what
                # the planner counted there for the other tests of this round
                self._prefer(name, self.collection[index], plan, views)
        for node in live:
            if sent[self._names[node]]:
                privates.send_tests(node, sent[self._names[node]])
            if not planner.pending or not planner.eligible(self._names[node]):
                privates.stop_worker(node)  # what is left belongs to other workers' groups, or nothing is

    def _prefer(self, worker: str, test: str, plan: Grant, views: Mapping[str, NodeView]) -> None:
        """Tell the broker of ``worker``'s node where ``test``'s lease was planned, in that
        broker's GPU indices; a plan whose node has no view (lost since) goes nowhere: a
        preference is only ever sent to the node the planner packed."""
        node = self.planner.node_of(worker) if self.planner is not None else None
        view = views.get(node) if node is not None else None
        gpus = view.indices(plan.gpus) if view is not None else None
        if node is not None and gpus:
            self.gpu_nodes.prefer(node, worker, test, gpus, plan.memory)

    def _same_collections(self) -> bool:
        (first, col), *rest = self.node2collection.items()
        same = True
        for node, collection in rest:
            message = privates.collection_diff(col, collection, privates.worker_id(first), privates.worker_id(node))
            if message:
                same = False
                self.log(message)
                where = privates.worker_id(node)
                report = pytest.CollectReport(nodeid=where, outcome="failed", longrepr=message, result=[])
                self.config.hook.pytest_collectreport(report=report)
        return same


def _catalog(views: Mapping[str, NodeView]) -> Mapping[str, Any]:
    """What the scheduler knows of the tests: every node's catalog (each a live mapping), as one."""
    catalogs = list({id(v.catalog): v.catalog for v in views.values()}.values())
    return catalogs[0] if len(catalogs) == 1 else ChainMap(*catalogs)  # type: ignore[arg-type]


# -- what goes first ------------------------------------------------------------------


def order(
    collection: Sequence[str],
    failed: Collection[str],
    known: Collection[str] | None,
    *,
    failed_first: bool,
    new_first: bool,
    stop_early: bool,
) -> Order:
    """The planner's :class:`Order` for xdist's ``collection`` (pure).

    ``failed``: node ids that failed last time (a collector's id covers the tests under
    it); ``known``: node ids earlier runs collected (``None``: nothing recorded).
    ``new_first`` (``--nf``) moves new tests ahead of everything, as pytest does;
    ``failed_first`` (``--ff``) or ``stop_early`` (``-x``/``--maxfail``) moves last run's
    failures ahead, and ``stop_early`` hands the rest out shortest first."""
    ahead: dict[int, int] = {}
    for index, nodeid in enumerate(collection):
        level = 0
        if new_first and known is not None and nodeid not in known:
            level += 2
        if (failed_first or stop_early) and failed and _failed(nodeid, failed):
            level += 1
        if level:
            ahead[index] = level
    return Order(ahead, shortest_first=stop_early)


def _failed(nodeid: str, failed: Collection[str]) -> bool:
    if nodeid in failed:
        return True
    parts = nodeid.split("::")  # a module or class that failed to collect last time
    return any("::".join(parts[:n]) in failed for n in range(1, len(parts)))


def order_from(config: pytest.Config, collection: Sequence[str]) -> Order:
    """:func:`order` from the run's options and pytest's cache (read at the controller)."""
    new_first = bool(config.getoption("newfirst", False))
    return order(
        collection,
        history.last_failed(config),
        history.known_nodeids(config) if new_first else None,
        failed_first=bool(config.getoption("failedfirst", False) or config.getoption("lf", False)),
        new_first=new_first,
        stop_early=bool(config.getoption("maxfail", 0)),
    )
