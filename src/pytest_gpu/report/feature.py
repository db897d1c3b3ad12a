"""The report feature, in the process that owns the run (the xdist controller, or pytest
without workers): every test report gathered (:class:`~.summary.Summary`), pytest-gpu's
lines of the terminal summary, the trace (``--gpu-trace``), and what later runs keep
(:mod:`pytest_gpu.run.history`: durations for the scheduler, peaks for ``--gpu-learn``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import pytest

from ..base.launch import LaunchContext
from ..launched import selection
from ..machine import domain
from ..run import history, quarantine
from ..run.keys import DIST_CHOSEN_KEY
from ..run.record import RUN_KEY
from ..run.session import GpuRun
from . import trace
from .summary import Summary, context_lines, foreign_lines


class NodesSaid(Protocol):
    """What the report says of the run's nodes (:class:`pytest_gpu.nodes.feature.RunNodes`)."""

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
        """A line per process of a node that went away holding leases or was quarantined."""
        ...


class RunReport(Summary):
    """The feature's hook object: the :class:`Summary` it gathers, and what it does with it.

    ``nodes`` gives the run's nodes once they are known (``pytest_configure``); ``said``
    the lines of other parts of the run that go before the run's own (how ``-n auto``
    chose)."""

    def __init__(
        self,
        config: pytest.Config,
        launch: LaunchContext | None,
        nodes: Callable[[], NodesSaid],
        said: Callable[[pytest.Config], list[str]] = lambda config: [],
    ) -> None:
        super().__init__()
        self.config = config
        self.launch = launch
        self._nodes = nodes
        self._said = said

    @property
    def run(self) -> GpuRun:
        return self.config.stash[RUN_KEY]

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        config, run = self.config, self.run
        if run.settings.learn:
            history.merge(config, history.PEAKS_KEY, self.peaks())
        if self.launch is None:  # under a launcher, rank 0 keeps the durations of every rank
            history.merge(config, history.DURATIONS_KEY, self.durations())
        if run.settings.trace:
            data = trace.build(
                self.timeline,
                [(d.index, d.total_memory) for d in run.inventory.devices],
                run.inventory.describe(),
                run.inventory.source,
                self._nodes().trace_groups(),
            )
            try:
                self.trace_path = str(trace.write(run.settings.trace, data))
            except OSError as exc:  # reported with the summary; the tests' outcome stands
                self.trace_error = f"could not write the trace to {run.settings.trace}: {exc}"

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        config, run, nodes = self.config, self.run, self._nodes()
        assert run.broker is not None  # the owner's
        for line in nodes.summary_lines(self):  # each node's GPUs, leases and what ran there
            terminalreporter.write_line(line)
        for line in self._said(config) + domain.said:  # how -n auto chose; how the machine is shared
            terminalreporter.write_line(line)
        self.quarantined = quarantine.records(run.run_dir)  # workers (or this process) a sticky CUDA error ended
        if self.quiet(run.broker.crashes, run.broker.grants):  # the plugin stays inert for CPU-only runs
            for line in self.backend_lines() + selection.summary_lines(config):
                terminalreporter.write_line(line)
            return
        lines = self.lines(run.inventory, run.broker.crashes) + nodes.fault_lines(self)
        lines += foreign_lines(run.broker.foreign)
        words = nodes.gpus_words()
        if words is not None:  # the run's GPUs are not this process's own
            lines[0] = lines[0].replace(f"{run.inventory.describe()} [{run.inventory.source}]", words, 1)
        lines += context_lines(
            run.broker.measured,
            run.settings.context_overhead,
            run.settings.context_overhead_given,
            run.inventory.runtime,  # a HIP or Level Zero context on AMD or Intel GPUs
        )
        lines += self.timeline.summary_lines(
            [d.index for d in run.inventory.devices],
            with_peaks=run.settings.verify != "off",
            learn=run.settings.learn,
            verbose=config.option.verbose > 0,
        )
        if self.trace_path:
            lines.append(f"pytest-gpu: trace written to {self.trace_path} (open in ui.perfetto.dev)")
        if self.trace_error:
            lines.append(f"pytest-gpu: --gpu-trace: {self.trace_error}")
        dist = getattr(config.option, "dist", "no")
        if config.stash.get(DIST_CHOSEN_KEY, False) and dist != "no" and run.settings.schedule:
            # the user's --dist wins over the GPU scheduler: say so, it changes how tests are placed
            lines.append(f"pytest-gpu: --dist {dist} chosen: xdist places the tests, the GPU scheduler is off")
        for line in lines + selection.summary_lines(config):
            terminalreporter.write_line(line)
