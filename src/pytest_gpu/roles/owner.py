"""The process that owns a run (the xdist controller, or pytest without workers).

It starts the run (its broker, or ``--gpu-nodes``' node hosts), closes it at the end, and
registers the owner's features: the report (summary, trace, history), stopping the run's
Ray head, the launched rank's (under a launcher). The run's GPUs are its nodes'
(:mod:`pytest_gpu.nodes.feature`): one machine's, or ``--gpu-nodes``'; the report and the
scheduler read them the same way for one node or many. The controller also hands each
worker the run and registers the controller's features.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from ..launched.selection import Selection
from ..launched.session import launched_rank
from ..nodes.feature import NodesFeature, RunNodes, run_nodes
from ..nodes.hosts import configure as configure_nodes
from ..raycluster import RayHead
from ..report.feature import RunReport
from ..report.written import WrittenRequests
from ..run import options
from ..run.infra import LostWorkers
from ..run.keys import DIST_CHOSEN_KEY, Role
from ..run.required import Required
from ..run.rundir import RunDirError
from ..run.session import GpuRun
from ..sim.ledger import LedgerWriteError
from ..vendors.devices import DeviceSpecError
from .base import RoleBase, Switches


class RunOwner(RoleBase):
    """The process that owns the run; see :class:`Controller` and ``Lone``."""

    nodes: RunNodes  # known at pytest_configure

    def start(self) -> GpuRun:
        return start_run(self.config, self.launch)

    def attach(self, run: GpuRun) -> None:
        self.nodes = run_nodes(self.config, run)
        super().attach(run)

    def wanted(self, switches: Switches) -> dict[str, Callable[[], object]]:
        out = super().wanted(switches)
        out["summary"] = lambda: RunReport(self.config, self.launch, lambda: self.nodes, autoworkers_lines)
        out["ray-head"] = lambda: RayHead(self.config)
        out["requests"] = lambda: WrittenRequests(self.config, self.launch)
        if switches.known and self.launch is not None:
            launch = self.launch
            out["launched-rank"] = lambda: launched_rank(self.config, launch, self.run.settings.rank_gather_timeout)
        return out


class Controller(RunOwner):
    """The xdist controller: hands each worker the run; its features gather the workers'
    findings and (unless ``--dist`` was chosen) hand tests out by what they need."""

    role = Role.CONTROLLER

    def switches(self) -> Switches:
        chosen = self.config.stash.get(DIST_CHOSEN_KEY, False)
        nodes = isinstance(self.nodes, NodesFeature)
        return replace(super().switches(), schedule=self.run.settings.schedule and not chosen, nodes=nodes)

    def wanted(self, switches: Switches) -> dict[str, Callable[[], object]]:
        out = super().wanted(switches)
        if switches.nodes:
            out["nodes"] = lambda: self.nodes  # node mode's own hooks
        out["selection"] = lambda: Selection(self.config, self.launch)  # the workers' deselection reasons
        out["lost-workers"] = lambda: LostWorkers(self.config)  # a crashed worker's test: infrastructure
        if switches.required:
            out["required"] = lambda: Required(self.config, reported=lambda node: self.nodes.raise_required(node))
        if switches.schedule:
            out["scheduling"] = lambda: scheduling(self.config, lambda: self.nodes)
        return out

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node: Any) -> None:
        """Each new worker (replacements too) gets the run it joins: its node's."""
        node.workerinput.update(self.nodes.workerinput(node))


def start_run(config: pytest.Config, launch: Any) -> GpuRun:
    """Start this process's run: ``--gpu-nodes``' node hosts first (each node's host owns that
    node's GPUs: the controller leases none), then the run's broker."""
    settings = options.read(config)
    if configure_nodes(config, settings, launch) is not None:
        settings = replace(settings, gpus="none")
    try:
        return GpuRun.start(settings, launch=launch)
    except (DeviceSpecError, RunDirError, LedgerWriteError) as exc:
        raise pytest.UsageError(str(exc)) from None


def autoworkers_lines(config: pytest.Config) -> list[str]:
    """How ``-n auto`` chose (the summary's line)."""
    from ..scheduling.autoworkers import summary_lines  # local: slow (statistics): where the summary is printed

    return summary_lines(config)


def scheduling(config: pytest.Config, nodes: Callable[[], RunNodes]) -> object:
    """The controller's scheduling feature."""
    from ..scheduling.scheduler import Scheduling  # local: slow (the planner): only where the GPU scheduler runs

    return Scheduling(config, nodes)
