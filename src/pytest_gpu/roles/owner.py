"""The process that owns a run (the xdist controller, or pytest without workers).

It holds the run's broker, hears every test report (its :class:`Summary`), keeps what the
run measured for later runs, writes the trace, and prints pytest-gpu's summary. The run's
GPUs are its nodes' (:mod:`pytest_gpu.nodes.feature`): one machine's, or ``--gpu-nodes``';
the summary, the trace and the scheduler read them the same way for one node or many.
"""

from __future__ import annotations

from typing import Any

import pytest

from .. import raycluster
from ..launched import selection
from ..machine import domain
from ..nodes.feature import RunNodes, run_nodes
from ..report.summary import Summary, context_lines, foreign_lines
from ..run import history
from ..run.keys import DIST_CHOSEN_KEY, SCHEDULE_KEY, Role
from ..run.session import GpuRun
from .base import RoleBase, register


class RunOwner(RoleBase):
    """Hooks of the process that owns the run; see :class:`Controller` and ``Lone``."""

    summary: Summary
    nodes: RunNodes

    def attach(self, run: GpuRun) -> None:
        super().attach(run)
        self.summary = Summary()
        register(self.config, self.summary, "pytest-gpu-summary")  # collects test reports
        self.nodes = run_nodes(self.config, run)
        register(self.config, self.nodes, "pytest-gpu-nodes")  # node mode's hooks are its own

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
                self.nodes.trace_groups(),
            )
            try:
                summary.trace_path = str(trace.write(run.settings.trace, data))
            except OSError as exc:  # reported with the summary; the tests' outcome stands
                summary.trace_error = f"could not write the trace to {run.settings.trace}: {exc}"

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        config, run, summary = self.config, self.run, self.summary
        assert run.broker is not None  # the owner's
        from ..scheduling.autoworkers import summary_lines as auto_lines

        for line in self.nodes.summary_lines(summary):  # each node's GPUs, leases and what ran there
            terminalreporter.write_line(line)
        for line in auto_lines(config) + domain.said:  # how -n auto chose; how the machine is shared
            terminalreporter.write_line(line)
        from ..run import quarantine

        summary.quarantined = quarantine.records(run.run_dir)  # workers (or this process) a sticky CUDA error ended
        if summary.quiet(run.broker.crashes, run.broker.grants):  # the plugin stays inert for CPU-only runs
            for line in summary.backend_lines() + selection.summary_lines(config):
                terminalreporter.write_line(line)
            return
        lines = summary.lines(run.inventory, run.broker.crashes) + self.nodes.fault_lines(summary)
        lines += foreign_lines(run.broker.foreign)
        words = self.nodes.gpus_words()
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

    def close(self) -> None:
        super().close()
        raycluster.stop_head(self.run)  # the Ray head a test started is the owner's to stop


class Controller(RunOwner):
    """The xdist controller: hands each worker the run, and (unless ``--dist`` was chosen)
    hands tests out by what they need (:class:`GpuScheduling`)."""

    role = Role.CONTROLLER

    @property
    def schedules(self) -> bool:
        return self.run.settings.schedule and not self.config.stash.get(DIST_CHOSEN_KEY, False)

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node: Any) -> None:
        """Each new worker (replacements too) gets the run it joins: its node's."""
        node.workerinput.update(self.nodes.workerinput(node))
        node.workerinput[SCHEDULE_KEY] = self.schedules

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: Any, ids: Any) -> None:
        self.nodes.raise_required(node)  # --gpu-required, as the worker found it on its node

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

        durations = history.load(config, history.DURATIONS_KEY)
        return GpuScheduling(config, log, self.run, durations, self.nodes)
