"""The run's GPU summary, gathered from test reports (so it works under xdist too)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest

from .timeline import Timeline

if TYPE_CHECKING:
    from .broker import CrashRecord
    from .gpu.devices import Inventory


@dataclass(eq=False)  # registered as a plugin: must stay hashable
class Summary:
    gpu_tests: int = 0
    waited: float = 0.0
    violations: int = 0
    violating: list[str] = field(default_factory=list)
    notes: dict[str, int] = field(default_factory=dict)  # what verification could not check -> tests
    gpu_skipped: int = 0
    timeline: Timeline = field(default_factory=Timeline)
    trace_path: str = ""
    trace_error: str = ""

    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        # under xdist the controller hears this when a worker starts the test: the start
        # of a test whose worker dies (its crash report carries no times)
        self.timeline.started(nodeid, "main", time.time())

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.add(report)
        node = getattr(report, "node", None)  # xdist: the WorkerController that ran it
        worker = str(node.gateway.id) if node is not None else "main"
        stop = float(getattr(report, "stop", 0.0) or 0.0) or time.time()
        self.timeline.phase(
            report.nodeid,
            worker,
            report.when or "",
            report.outcome,
            float(getattr(report, "start", 0.0) or 0.0),
            stop,
            float(report.duration or 0.0),
            dict(report.user_properties),
        )

    def peaks(self) -> dict[str, int]:
        """Node id -> highest peak measured on one of its GPUs (for ``--gpu-learn``)."""
        return {r.nodeid: r.peak for r in self.timeline.records.values() if r.peak is not None}

    def durations(self) -> dict[str, float]:
        """Node id -> seconds, for every test that ran to its end here (crashes excluded)."""
        return {r.nodeid: r.duration for r in self.timeline.records.values() if r.outcome != "crashed"}

    def add(self, report: pytest.TestReport) -> None:
        if report.skipped and "pytest-gpu:" in str(report.longrepr):
            self.gpu_skipped += 1  # a GPU test this machine could not run: worth a summary
        if report.when != "teardown":
            return
        props = dict(report.user_properties)
        if "gpu_indices" not in props:
            return
        self.gpu_tests += 1
        self.waited += float(props.get("gpu_wait_seconds", 0.0))
        count = int(props.get("gpu_violations", 0))
        if count:
            self.violations += count
            self.violating.append(report.nodeid)
        for note in str(props.get("gpu_notes", "")).splitlines():
            if note:
                self.notes[note] = self.notes.get(note, 0) + 1

    def quiet(self, crashes: list[CrashRecord]) -> bool:
        """Nothing GPU happened (a CPU-only suite, ``--co``, a collection error): say nothing."""
        return not (self.gpu_tests or self.gpu_skipped or crashes or self.trace_path or self.trace_error)

    def lines(self, inventory: Inventory, crashes: list[CrashRecord]) -> list[str]:
        out = [
            f"pytest-gpu: {inventory.describe()} [{inventory.source}] · {self.gpu_tests} GPU test"
            f"{'s' if self.gpu_tests != 1 else ''} · waited {self.waited:.1f}s in total · "
            f"{self.violations} violation{'s' if self.violations != 1 else ''}"
        ]
        if inventory.note and inventory.devices:  # what discovery left out (a GPU NVML refused, ...)
            out.append(f"pytest-gpu: note: {inventory.note}")
        for nodeid in self.violating[:10]:
            out.append(f"pytest-gpu: lease broken by {nodeid}")
        for note, tests in list(self.notes.items())[:10]:
            out.append(f"pytest-gpu: not verified: {note} ({tests} test{'s' if tests != 1 else ''})")
        for crash in crashes:
            what = []
            if crash.gpus:
                what.append(f"GPU {','.join(map(str, crash.gpus))}")
            if crash.ports:
                what.append(f"{len(crash.ports)} port{'s' if len(crash.ports) != 1 else ''}")
            out.append(
                f"pytest-gpu: worker {crash.worker} (pid {crash.pid}) died while running "
                f"{crash.test or 'an unknown test'}; its {' and '.join(what)} were reclaimed"
            )
        return out
