"""The run's nodes, as the process that owns the run drives them: one or many.

A run on one machine is a run with one node (:class:`OneMachine`), whose view the run's own
broker serves; under ``--gpu-nodes`` the nodes are those whose host started
(:class:`NodesFeature`, over :class:`~pytest_gpu.nodes.hosts.NodeHosts`). Both answer the
same questions: each node's view and where a plan goes (the scheduler's
:class:`~pytest_gpu.scheduling.scheduler.Nodes`), what a new worker is handed, what it
found for ``--gpu-required``, and what the summary and the trace say of the nodes. The
owner role holds the one it has and hands it to the features that read it (the report, the
scheduler, ``--gpu-required``); under ``--gpu-nodes`` it registers :class:`NodesFeature`,
whose hooks are node mode's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import pytest

from ..base import privates
from ..leasing.view import NodeView
from ..run import required
from ..run.session import WIRE_KEY, GpuRun
from .hosts import NODES_KEY, NodeHosts, guard_replacements, node_of, raise_reported, workerinput

if TYPE_CHECKING:
    from ..leasing.broker import Broker
    from ..report.summary import Summary

LOCAL = "local"  # the one node of a run on one machine


class RunNodes(Protocol):
    """The run's nodes, one or many (see the module docstring)."""

    def views(self) -> Mapping[str, NodeView]:
        """Each live node's broker now."""
        ...

    def prefer(self, node: str, worker: str, test: str, gpus: tuple[int, ...], memory: int | None) -> None:
        """The scheduler's plan for ``test``, to ``node``'s broker (``gpus``: its indices)."""
        ...

    def node_of(self, worker: Any) -> str:
        """The node an xdist worker runs on."""
        ...

    def workerinput(self, worker: Any) -> dict[str, Any]:
        """What a new xdist worker is handed: the run it joins (its node's)."""
        ...

    def raise_required(self, worker: Any) -> None:
        """As a worker's collection comes in: raise what it found for ``--gpu-required``."""
        ...

    def summary_lines(self, summary: Summary) -> list[str]:
        """The summary's lines about the nodes, before the run's own."""
        ...

    def gpus_words(self) -> str | None:
        """What the run's summary line calls its GPUs (``None``: the run's own inventory)."""
        ...

    def trace_groups(self) -> dict[str, list[tuple[int, int]]] | None:
        """Each node's GPUs ``(index, bytes)``, the trace's track groups (``None``: one group)."""
        ...

    def fault_lines(self, summary: Summary) -> list[str]:
        """A line per process of a node that went away holding leases or was quarantined
        (``[]`` where the run's own lines say them)."""
        ...


class OneMachine:
    """A run on one machine: one node, served by the run's own broker; the run's own summary
    lines say everything of it."""

    def __init__(self, run: GpuRun) -> None:
        self.run = run

    def _broker(self) -> Broker:
        broker = self.run.broker
        assert broker is not None, "the run's owner has its broker"
        return broker

    def views(self) -> dict[str, NodeView]:
        return {LOCAL: self._broker().view()}

    def prefer(self, node: str, worker: str, test: str, gpus: tuple[int, ...], memory: int | None) -> None:
        assert node == LOCAL, f"a plan for node {node} on a run of one machine"
        self._broker().prefer(worker, test, gpus, memory)

    def node_of(self, worker: Any) -> str:
        return LOCAL

    def workerinput(self, worker: Any) -> dict[str, Any]:
        return {WIRE_KEY: self.run.to_wire()}

    def raise_required(self, worker: Any) -> None:
        required.raise_reported(self.run, privates.worker_id(worker))  # as the worker found it

    def summary_lines(self, summary: Summary) -> list[str]:
        return []

    def gpus_words(self) -> str | None:
        return None

    def trace_groups(self) -> dict[str, list[tuple[int, int]]] | None:
        return None

    def fault_lines(self, summary: Summary) -> list[str]:
        return []


class NodesFeature:
    """``--gpu-nodes`` at the controller: the nodes whose host started (see :mod:`.hosts`),
    and node mode's hooks (the feature's hook object, registered in node mode only)."""

    def __init__(self, config: pytest.Config, hosts: NodeHosts) -> None:
        self.config = config
        self.hosts = hosts

    def views(self) -> dict[str, NodeView]:
        return self.hosts.views()

    def prefer(self, node: str, worker: str, test: str, gpus: tuple[int, ...], memory: int | None) -> None:
        self.hosts.prefer(node, worker, test, gpus, memory)

    def node_of(self, worker: Any) -> str:
        return self.hosts.node_of(worker)

    def workerinput(self, worker: Any) -> dict[str, Any]:
        return workerinput(self.hosts, worker)

    def raise_required(self, worker: Any) -> None:
        raise_reported(self.hosts, worker)  # found in the worker's node's run directory

    def summary_lines(self, summary: Summary) -> list[str]:
        # each node's GPUs, leases and what ran there; a skip that says no why is the node's
        summary.unsaid_why = "larger than the GPUs of the node it ran on"  # not the controller's none
        return self.hosts.lines(summary.timeline.node_words)

    def gpus_words(self) -> str | None:
        count = len(self.hosts.up)  # the controller leases no GPU; each node's line says its own
        return f"{count} node{'' if count == 1 else 's'} (their GPUs above)"

    def trace_groups(self) -> dict[str, list[tuple[int, int]]] | None:
        return self.hosts.gpus()

    def fault_lines(self, summary: Summary) -> list[str]:
        out = []
        for node, (crashes, quarantined) in self.hosts.faults().items():
            said = [summary.quarantine_line(q) for q in quarantined.values()]
            said += [summary.crash_line(c) for c in crashes if c.worker not in quarantined]
            out += [line.replace("pytest-gpu: ", f"pytest-gpu: node {node}: ", 1) for line in said]
        return out

    # -- hooks ---------------------------------------------------------------------------

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_setupnodes(self, config: pytest.Config, specs: Any) -> None:
        guard_replacements(config, self.hosts)  # xdist's session exists now: a lost node's workers stay down

    @pytest.hookimpl(optionalhook=True)
    def pytest_handlecrashitem(self, crashitem: str, report: pytest.TestReport, sched: Any) -> None:
        """A crashed test's report names the node its worker ran on, in the terminal and in
        junitxml, as every test's does."""
        node = node_of(privates.report_worker(report))
        if node is not None:
            report.longrepr = f"{report.longrepr} on node {node}"
            report.user_properties.append(("gpu_node", node))
            privates.junitxml_property(self.config, report, "gpu_node", node)


def run_nodes(config: pytest.Config, run: GpuRun) -> RunNodes:
    """The nodes of the run ``config`` owns: ``--gpu-nodes``' (started at configure), else its one machine."""
    hosts = config.stash.get(NODES_KEY, None)
    return OneMachine(run) if hosts is None else NodesFeature(config, hosts)
