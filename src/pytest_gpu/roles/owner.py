"""The process that owns a run (the xdist controller, or pytest without workers).

It holds the run's broker, hears every test report (its :class:`Summary`), keeps what the
run measured for later runs, writes the trace, and prints pytest-gpu's summary.
"""

from __future__ import annotations

from typing import Any

import pytest

from .. import raycluster
from ..launched import selection
from ..machine import domain
from ..nodes.hosts import NODES_KEY, NodeHosts, configure_node, guard_replacements, node_of
from ..nodes.hosts import raise_reported as nodes_required
from ..report.summary import Summary, context_lines, foreign_lines
from ..run import history, required
from ..run.keys import DIST_CHOSEN_KEY, SCHEDULE_KEY, Role
from ..run.session import WIRE_KEY, GpuRun
from .base import RoleBase, register


class RunOwner(RoleBase):
    """Hooks of the process that owns the run; see :class:`Controller` and ``Lone``."""

    summary: Summary

    def attach(self, run: GpuRun) -> None:
        super().attach(run)
        self.summary = Summary()
        register(self.config, self.summary, "pytest-gpu-summary")  # collects test reports

    def finish_session(self, session: pytest.Session) -> None:
        super().finish_session(session)
        config, run, summary = self.config, self.run, self.summary
        if run.settings.learn:
            history.merge(config, history.PEAKS_KEY, summary.peaks())
        if self.launch is None:  # under a launcher, rank 0 keeps the durations of every rank
            history.merge(config, history.DURATIONS_KEY, summary.durations())
        if run.settings.trace:
            from ..report import trace

            data = trace.build(
                summary.timeline,
                [(d.index, d.total_memory) for d in run.inventory.devices],
                run.inventory.describe(),
                run.inventory.source,
                self.node_gpus(),
            )
            try:
                summary.trace_path = str(trace.write(run.settings.trace, data))
            except OSError as exc:  # reported with the summary; the tests' outcome stands
                summary.trace_error = f"could not write the trace to {run.settings.trace}: {exc}"

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        config, run, summary = self.config, self.run, self.summary
        assert run.broker is not None  # the owner's
        from ..scheduling.autoworkers import summary_lines as auto_lines

        for line in auto_lines(config) + domain.said:  # how -n auto chose; how the machine is shared
            terminalreporter.write_line(line)
        from ..run import quarantine

        summary.quarantined = quarantine.records(run.run_dir)  # workers (or this process) a sticky CUDA error ended
        if summary.quiet(run.broker.crashes, run.broker.grants):  # the plugin stays inert for CPU-only runs
            for line in summary.backend_lines() + selection.summary_lines(config):
                terminalreporter.write_line(line)
            return
        lines = summary.lines(run.inventory, run.broker.crashes) + self.node_fault_lines()
        lines += foreign_lines(run.broker.foreign)
        words = self.gpus_words()
        if words is not None:  # the run's GPUs are not this process's own
            lines[0] = lines[0].replace(f"{run.inventory.describe()} [{run.inventory.source}]", words, 1)
        lines += context_lines(
            run.broker.measured,
            run.settings.context_overhead,
            run.settings.context_overhead_given,
            run.inventory.runtime,  # a HIP or Level Zero context on AMD or Intel GPUs
        )
        lines += summary.timeline.summary_lines(
            [d.index for d in run.inventory.devices],
            with_peaks=run.settings.verify != "off",
            learn=run.settings.learn,
            verbose=config.option.verbose > 0,
        )
        if summary.trace_path:
            lines.append(f"pytest-gpu: trace written to {summary.trace_path} (open in ui.perfetto.dev)")
        if summary.trace_error:
            lines.append(f"pytest-gpu: --gpu-trace: {summary.trace_error}")
        dist = getattr(config.option, "dist", "no")
        if config.stash.get(DIST_CHOSEN_KEY, False) and dist != "no" and run.settings.schedule:
            # the user's --dist wins over the GPU scheduler: say so, it changes how tests are placed
            lines.append(f"pytest-gpu: --dist {dist} chosen: xdist places the tests, the GPU scheduler is off")
        for line in lines + selection.summary_lines(config):
            terminalreporter.write_line(line)

    def gpus_words(self) -> str | None:
        """What the summary's first line calls the run's GPUs, where they are not this
        process's inventory (``None``: they are)."""
        return None

    def node_gpus(self) -> dict[str, list[tuple[int, int]]] | None:
        """``--gpu-nodes``: each node's GPUs (the trace's track groups); ``None``: one machine."""
        return None

    def node_fault_lines(self) -> list[str]:
        """``--gpu-nodes``: a line per process of a node that went away holding leases or was
        quarantined, the node named (on one machine :meth:`Summary.lines` says them)."""
        return []

    def close(self) -> None:
        super().close()
        raycluster.stop_head(self.run)  # the Ray head a test started is the owner's to stop


class Controller(RunOwner):
    """The xdist controller: hands each worker the run, and (unless ``--dist`` was chosen)
    hands tests out by what they need (:class:`GpuScheduling`)."""

    role = Role.CONTROLLER

    @property
    def nodes(self) -> NodeHosts | None:
        """``--gpu-nodes``: every node's host (see :mod:`pytest_gpu.nodes`); ``None``: one machine."""
        return self.config.stash.get(NODES_KEY, None)

    @property
    def schedules(self) -> bool:
        return self.run.settings.schedule and not self.config.stash.get(DIST_CHOSEN_KEY, False)

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node: Any) -> None:
        """Each new worker (replacements too) gets the broker's address: its node's, under ``--gpu-nodes``."""
        if self.nodes is not None:
            configure_node(self.nodes, node)
        else:
            node.workerinput[WIRE_KEY] = self.run.to_wire()
        node.workerinput[SCHEDULE_KEY] = self.schedules

    def gpus_words(self) -> str | None:
        if self.nodes is None:
            return None
        count = len(self.nodes.up)  # --gpu-nodes: the controller leases no GPU; each node's line says its own
        return f"{count} node{'' if count == 1 else 's'} (their GPUs above)"

    def node_gpus(self) -> dict[str, list[tuple[int, int]]] | None:
        return self.nodes.gpus() if self.nodes is not None else None

    def node_fault_lines(self) -> list[str]:
        if self.nodes is None:
            return []
        out = []
        for node, (crashes, quarantined) in self.nodes.faults().items():
            said = [self.summary.quarantine_line(q) for q in quarantined.values()]
            said += [self.summary.crash_line(c) for c in crashes if c.worker not in quarantined]
            out += [line.replace("pytest-gpu: ", f"pytest-gpu: node {node}: ", 1) for line in said]
        return out

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.nodes is not None:  # each node's GPUs, leases and what ran there, before the run's own lines
            self.summary.unsaid_why = "larger than the GPUs of the node it ran on"  # not the controller's none
            for line in self.nodes.lines(self.summary.timeline.node_words):
                terminalreporter.write_line(line)
        super().pytest_terminal_summary(terminalreporter)

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_setupnodes(self, config: pytest.Config, specs: Any) -> None:
        if self.nodes is not None:  # xdist's session exists now: a lost node's workers are not replaced
            guard_replacements(config, self.nodes)

    @pytest.hookimpl(optionalhook=True)
    def pytest_handlecrashitem(self, crashitem: str, report: pytest.TestReport, sched: Any) -> None:
        """Under ``--gpu-nodes``, a crashed test's report names the node its worker ran on."""
        node = node_of(getattr(report, "node", None)) if self.nodes is not None else None
        if node is not None:
            report.longrepr = f"{report.longrepr} on node {node}"
            report.user_properties.append(("gpu_node", node))

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: Any, ids: Any) -> None:
        if self.nodes is not None:  # found in the worker's node's run directory
            nodes_required(self.nodes, node)
        else:
            required.raise_reported(self.run, str(node.gateway.id))  # --gpu-required, as the worker found it

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: object) -> None:
        """A worker's deselection reasons, for this process's summary (a worker's terminal is not shown)."""
        reasons = getattr(node, "workeroutput", {}).get(selection.WORKEROUTPUT_KEY)
        if reasons:
            selection.add_reasons(self.config, reasons)

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log: Any) -> Any:
        if not self.schedules:
            return None  # xdist's own, as chosen with --dist
        from ..scheduling.scheduler import GpuScheduling

        return GpuScheduling(config, log, self.run, history.load(config, history.DURATIONS_KEY), self.nodes)
