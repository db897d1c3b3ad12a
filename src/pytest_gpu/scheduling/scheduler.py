"""The xdist scheduler: hands tests to workers by their GPU needs and past durations.

Used under ``-n`` unless the user chose ``--dist`` or gave ``--gpu-schedule=off``. It
implements xdist's ``Scheduling`` protocol around :class:`~pytest_gpu.scheduling.planner.Planner`
(the policy). Each worker holds at most two tests: the one running and the next, so
every decision is taken as late as xdist allows.

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

Where the planner planned a GPU test's lease (:meth:`Planner.planned`), the broker is told
as the test is handed out, and places the lease there when it fits (:meth:`Broker.prefer`).
Under ``--gpu-nodes`` the plan names GPUs of the worker's node and goes to that node's
broker only, through its node host (:meth:`Nodes.prefer`).

A worker that dies gives back what it held: xdist reports the test it was running,
the rest returns to pending and goes to the other workers (or xdist's replacement). No
test waits for a dead worker, so the run cannot hang on one.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import pytest

from ..run import history
from . import catalog
from .planner import Grant, Order, Planner

if TYPE_CHECKING:
    from xdist.workermanage import WorkerController

    from ..nodes.hosts import NodeView
    from ..run.session import GpuRun


class Nodes(Protocol):
    """The run's nodes under ``--gpu-nodes`` (:class:`pytest_gpu.nodes.hosts.NodeHosts`):
    each node's broker, as the scheduler reads it instead of the run's own."""

    @property
    def catalog(self) -> Mapping[str, Any]:
        """Every node's catalog, merged; brought up to date by :meth:`refresh`."""
        ...

    def refresh(self) -> Mapping[str, NodeView]:
        """Each live node's broker now: room, grants by worker, contexts (the node's GPU indices)."""
        ...

    def prefer(self, node: str, worker: str, test: str, gpus: tuple[int, ...], memory: int | None) -> None:
        """:meth:`Broker.prefer` on ``node``'s broker (``gpus``: that broker's indices)."""
        ...

    def node_of(self, worker: Any) -> str | None:
        """The node an xdist worker runs on."""
        ...


class GpuScheduling:
    """xdist ``Scheduling`` for pytest-gpu (see the module docstring). ``nodes``: under
    ``--gpu-nodes``, the nodes whose brokers place the tests (each worker packs onto its
    node's GPUs, see :meth:`Planner.add_worker`)."""

    def __init__(
        self, config: pytest.Config, log: Any, run: GpuRun, durations: dict[str, float], nodes: Nodes | None = None
    ) -> None:
        from xdist.remote import Producer

        try:
            from xdist.workermanage import parse_tx_spec_config
        except ImportError:  # pytest-xdist < 3.7 (the floor is 3.5) names it parse_spec_config
            from xdist.workermanage import parse_spec_config as parse_tx_spec_config

        self.numnodes = len(parse_tx_spec_config(config))
        self.config = config
        self.log = log.gpusched if log is not None else Producer("gpusched")
        self.run = run
        self.durations = durations
        self.node2collection: dict[WorkerController, list[str]] = {}
        self._names: dict[WorkerController, str] = {}
        self.collection: list[str] | None = None
        self.planner: Planner | None = None
        self.gpu_nodes = nodes
        self._node: dict[WorkerController, str | None] = {}

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
        self._names[node] = str(node.gateway.id)
        self._node[node] = self.gpu_nodes.node_of(node) if self.gpu_nodes is not None else None
        if self.planner is not None:
            self.planner.add_worker(self._names[node], self._node[node])

    def add_node_collection(self, node: WorkerController, collection: Sequence[str]) -> None:
        if self.collection is not None and list(collection) != self.collection:
            from xdist.report import report_collection_diff

            other = next(iter(self.node2collection))
            self.log(report_collection_diff(self.collection, list(collection), other.gateway.id, node.gateway.id))
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
        from ..run import quarantine

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
            known: Mapping[str, Any] | None = self.run.broker.catalog if self.run.broker is not None else None
            if self.gpu_nodes is not None:
                self.gpu_nodes.refresh()  # every node's catalog, as its workers sent it
                known = self.gpu_nodes.catalog
            jobs = catalog.jobs(self.collection, known or {}, self.durations)
            self.planner = Planner(jobs, self._room(), order_from(self.config, self.collection))
            if known is not None:  # what leasing fixtures hold, as workers set them up (a live mapping)
                self.planner.held = catalog.HeldNeeds(known)
            for node, name in self._names.items():
                self.planner.add_worker(name, self._node.get(node))
        self._fill_all()

    # -- handing out ----------------------------------------------------------------

    def _room(self) -> list[int]:
        if self.run.broker is None or self.gpu_nodes is not None:  # nodes: each node's room (_fill_all)
            return []
        return self.run.broker.room()

    def _fill_all(self) -> None:
        """Top every live worker up to two held tests; stop the ones with nothing left to do.

        In two rounds: every idle worker gets a test before any worker gets a second one,
        so a handful of tests spreads over the workers instead of queueing on the first."""
        planner = self.planner
        assert planner is not None
        planner.capacities = self._room()
        broker = self.run.broker
        # the planner numbers GPUs as the room lists them; the run's GPU indices need not be 0..n-1
        # (``--gpus 0,2,3``): the broker's indices are translated both ways (each node's, by node)
        order = list(broker.capacities) if broker is not None else []
        orders: dict[str | None, list[int]] = {None: order}
        if self.gpu_nodes is not None:  # each node's room, grants and contexts, from its broker
            views = self.gpu_nodes.refresh()
            orders = {node: list(view.order) for node, view in views.items()}
            planner.node_capacities = {node: list(view.room) for node, view in views.items()}
            planner.node_context_size = {node: list(view.context_sizes) for node, view in views.items()}
            planner.node_limits = {node: list(view.limits) for node, view in views.items()}
            placed: dict[str, list[Grant]] = {}
            contexts: dict[str, set[int]] = {}
            for view in views.values():
                at = {index: k for k, index in enumerate(view.order)}
                for w, rows in view.placements.items():
                    placed[w] = [Grant(tuple(at[i] for i in gpus if i in at), memory) for gpus, memory in rows]
                for w, gpus in view.contexts.items():
                    contexts[w] = {at[i] for i in gpus if i in at}
            planner.placed, planner.contexts = placed, contexts
        elif broker is not None:  # what running tests hold, and where: never repacked
            at = {index: k for k, index in enumerate(order)}
            planner.placed = {
                w: [Grant(tuple(at[i] for i in gpus if i in at), memory) for gpus, memory in rows]
                for w, rows in broker.placements().items()
            }
            # where each worker has a CUDA context: a lease elsewhere opens one, beside its memory
            planner.contexts = {w: {at[i] for i in gpus if i in at} for w, gpus in broker.contexts().items()}
            planner.context_size = broker.context_sizes()
        now = time.monotonic()
        live = [node for node in self._names if not node.shutting_down]
        sent: dict[WorkerController, list[int]] = {node: [] for node in live}
        for target in (1, 2):
            for node in live:
                name = self._names[node]
                while len(planner.queue(name)) < target:
                    index = planner.pick(name, now)
                    if index is None:
                        break
                    sent[node].append(index)
                    plan = planner.planned(index)
                    if plan is not None and self.collection is not None:
                        # where its lease should go: the broker's own rule would not know what
                        # the planner counted there for the other tests of this round
                        self._prefer(name, self.collection[index], plan, orders)
        for node in live:
            if sent[node]:
                node.send_runtest_some(sent[node])
            if not planner.pending or not planner.eligible(self._names[node]):
                node.shutdown()  # what is left belongs to other workers' groups, or nothing is

    def _prefer(self, worker: str, test: str, plan: Grant, orders: Mapping[str | None, Sequence[int]]) -> None:
        """Tell the broker of ``worker``'s node (the run's own, without nodes) where ``test``'s
        lease was planned, in that broker's GPU indices; a plan whose node has no view (lost
        since) goes nowhere: a preference is only ever sent to the node the planner packed."""
        node = self.planner.node_of(worker) if self.planner is not None else None
        order = orders.get(node)
        if not order or any(k >= len(order) for k in plan.gpus):
            return
        gpus = tuple(order[k] for k in plan.gpus)
        if node is None:
            if self.run.broker is not None:
                self.run.broker.prefer(worker, test, gpus, plan.memory)
        elif self.gpu_nodes is not None:
            self.gpu_nodes.prefer(node, worker, test, gpus, plan.memory)

    def _same_collections(self) -> bool:
        from xdist.report import report_collection_diff

        (first, col), *rest = self.node2collection.items()
        same = True
        for node, collection in rest:
            message = report_collection_diff(col, collection, first.gateway.id, node.gateway.id)
            if message:
                same = False
                self.log(message)
                report = pytest.CollectReport(nodeid=node.gateway.id, outcome="failed", longrepr=message, result=[])
                self.config.hook.pytest_collectreport(report=report)
        return same


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
