"""Written requests in the process that owns the run: where each test's request came from
(the summary's count), writing the file from the peaks the tests' reports carry
(``--gpu-write-requests``, ``--gpu-bisect``), and checking a run against it
(``--gpu-check-requests``). The peaks are verification's, as ``--gpu-learn``'s: measured once.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from ..base.launch import LaunchContext
from ..base.spans import gpu_properties, parse_peaks
from ..base.wording import plural
from ..run import bisect as bisect_
from ..run import written
from ..run.feature import Feature
from ..run.lifecycle import SOURCE_DEFAULT, SOURCE_FILE, SOURCE_LEARNED, SOURCE_MARKER, SOURCE_PROPERTY
from ..run.written import Margin, Stale, size_text

PREFIX = "pytest-gpu:"


class WrittenRequests(Feature):
    """The feature's hook object (the owner's): it reads every test's reports."""

    def __init__(self, config: pytest.Config, launch: LaunchContext | None = None) -> None:
        super().__init__(config)
        self.launch = launch  # under a launcher, rank 0 hears every rank's reports: it alone writes and checks
        self.sources: dict[str, str] = {}  # node id -> where its memory came from
        self.peaks: dict[str, int] = {}  # node id -> its peak on one of its GPUs
        self.failed: set[str] = set()
        self.out_of_memory: set[str] = set()
        self.lines: list[str] = []  # said in the summary
        self.stale: list[Stale] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        props = dict(report.user_properties)
        source = props.get(SOURCE_PROPERTY)
        if isinstance(source, str):
            self.sources[report.nodeid] = source
        peak = gpu_properties(props.items()).get("gpu_peak_bytes")
        if peak:
            self.peaks[report.nodeid] = max(parse_peaks(str(peak)).values())
        if report.failed:
            self.failed.add(report.nodeid)
            if "out of memory" in report.longreprtext[:20000].lower():
                self.out_of_memory.add(report.nodeid)

    @pytest.hookimpl(trylast=True)  # after rank 0 of a launch was given the other ranks' reports
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        settings = self.run.settings
        path = settings.requests_path
        if not path or (self.launch is not None and not self.launch.is_root):
            return
        margin = Margin(settings.requests_margin, settings.requests_floor)
        if settings.write_requests or settings.bisect:
            passes = self._bisect(margin) if settings.bisect else {}
            # a test that names its memory keeps it; a failed one may have stopped early
            measured = {
                node: peak
                for node, peak in self.peaks.items()
                if settings.write_requests and self.sources.get(node) != SOURCE_MARKER and node not in self.failed
            }
            old = written.load_if_any(path)
            new = written.updated(old, margin, measured, passes)
            written.save(path, new)
            kept = len(set(new.entries) - set(measured) - set(passes))
            what = plural(len(measured) + len(passes), "request")
            self.lines.append(
                f"{PREFIX} wrote {what} to {_shown(path)} (margin {margin.words()}; "
                f"{kept} kept from tests not measured)"
            )
        if settings.check_requests and self.run.written is not None:
            checked = {n: p for n, p in self.peaks.items() if self.sources.get(n) == SOURCE_FILE}
            oom = {n for n in self.out_of_memory if self.sources.get(n) == SOURCE_FILE}
            self.stale = written.stale(self.run.written, checked, oom)
            if self.stale:
                self.lines.append(
                    f"{PREFIX} --gpu-check-requests: {plural(len(self.stale), 'test')} outgrew "
                    f"{'its' if len(self.stale) == 1 else 'their'} written request in {_shown(path)} "
                    f"(margin {self.run.written.margin.words()}); write it again with --gpu-write-requests:"
                )
                self.lines += [f"  {stale.words()}" for stale in self.stale]
                if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
                    session.exitstatus = pytest.ExitCode.TESTS_FAILED
            else:
                self.lines.append(
                    f"{PREFIX} --gpu-check-requests: {plural(len(checked), 'test')} within "
                    f"{'its' if len(checked) == 1 else 'their'} written request in {_shown(path)}"
                )

    def _bisect(self, margin: Margin) -> dict[str, int]:
        """``--gpu-bisect``: each named test's smallest passing cap (None-free: a test that
        failed under every cap, or cannot be bisected, is said and not written)."""
        run, config = self.run, self.config
        found: dict[str, int] = {}
        plugins = _plugin_args(config.invocation_params.args)
        most = run.largest_node[1] if run.largest_node is not None else run.usable_memory
        for node in run.settings.bisect:
            if self.sources.get(node) == SOURCE_MARKER:
                self.lines.append(f"{PREFIX} --gpu-bisect: {node} names its memory in its marker (which wins): skipped")
                continue
            peak = self.peaks.get(node)
            start = margin.request(peak) if peak is not None else most

            def passes(cap: int, node: str = node) -> bool:
                return bisect_.fresh_try(
                    node,
                    cap,
                    gpus=run.settings.gpus,
                    cwd=str(config.invocation_params.dir),
                    plugins=plugins,
                    workdir=os.path.dirname(run.settings.requests_path),
                )

            try:
                result = bisect_.search(passes, start, max(most, written.STEP))
            except bisect_.BisectError as exc:
                self.lines.append(f"{PREFIX} --gpu-bisect: {exc}")
                continue
            if result.passes is None:
                self.lines.append(
                    f"{PREFIX} --gpu-bisect: {node} failed even with {size_text(result.fails)} per GPU: not written"
                )
                continue
            found[node] = result.passes
            self.lines.append(
                f"{PREFIX} --gpu-bisect: {node} passes with {size_text(result.passes)} per GPU, fails with "
                f"{size_text(result.fails)} ({plural(result.tries, 'try', 'tries')}): "
                f"request {size_text(margin.request(result.passes))}"
            )
        return found

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        counted = self.count_line()
        for line in ([counted] if counted else []) + self.lines:
            terminalreporter.write_line(line)

    def count_line(self) -> str:
        """ "requests: 12 from markers, 30 from gpu-requests.txt, 5 default" (empty: no GPU test)."""
        counts = {s: list(self.sources.values()).count(s) for s in set(self.sources.values())}
        if not counts:
            return ""
        name = os.path.basename(self.run.settings.requests_path) or "the file"
        words = {
            SOURCE_MARKER: "from markers",
            SOURCE_FILE: f"from {name}",
            SOURCE_LEARNED: "from --gpu-learn's cache",
            SOURCE_DEFAULT: "default",
        }
        order = [SOURCE_MARKER, SOURCE_FILE, SOURCE_LEARNED, SOURCE_DEFAULT]
        return f"{PREFIX} requests: " + ", ".join(f"{counts[s]} {words[s]}" for s in order if counts.get(s))


def _shown(path: str) -> str:
    """The file's path as the user would type it: relative to here when under it."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def _plugin_args(args: tuple[str, ...] | list[str]) -> list[str]:
    """The run's own ``-p NAME`` arguments, for a try to load the same plugins."""
    out: list[str] = []
    for n, arg in enumerate(args):
        if arg == "-p" and n + 1 < len(args):
            out += ["-p", args[n + 1]]
        elif arg.startswith("-p") and len(arg) > 2:
            out.append(arg)
    return out
