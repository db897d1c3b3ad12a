"""One rank of a launched pytest session: quiet ranks, one summary on rank 0, shards.

Lockstep mode (the default under a launcher): every rank runs the same tests; ranks
other than 0 write their whole pytest output to ``<rank-log-dir>/<launcher>/rankN.log``;
at the end every rank publishes its test reports through the gather directory, and
rank 0 reports the failures of every rank (they appear as ``nodeid@rankN`` in its
terminal summary and its junitxml). Every rank exits non-zero if any rank failed.

Shard mode (``--shard``): each rank runs its share of the suite (balanced by recorded
durations) and rank 0 reports every test exactly once.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import xml.etree.ElementTree as ET
from collections import defaultdict
from collections.abc import Generator
from pathlib import Path
from typing import Any, cast

import pytest

from ..base import privates
from ..base.launch import LaunchContext
from ..base.wording import numbered
from ..run import history
from ..run.history import DURATIONS_KEY
from . import gather, torchenv
from .shard import partition


def log_dir(config: pytest.Config) -> Path:
    # in pytest_load_initial_conftests, only known_args_namespace holds the command line yet
    early = getattr(getattr(config, "known_args_namespace", None), "rank_log_dir", None)
    value = config.getoption("rank_log_dir", None) or early or config.getini("rank_log_dir") or "logs"
    return Path(config.invocation_params.dir) / str(value)


def gather_dir(config: pytest.Config, ctx: LaunchContext) -> Path:
    """Where the ranks of this launch exchange documents (under the rank-log directory: on
    clusters it is on the shared file system)."""
    return log_dir(config) / ctx.launcher / f".gather-{ctx.run_id}"


def early_gather_timeout(config: pytest.Config) -> float:
    """``--rank-gather-timeout`` before the options are read into Settings (which then
    reject a bad value): the command line's, the ini's, or the default."""
    early = getattr(getattr(config, "known_args_namespace", None), "rank_gather_timeout", None)
    try:
        value = float(early or config.getini("rank_gather_timeout") or 300)
    except ValueError:
        return 300.0
    return value if value > 0 else 300.0


def early(config: pytest.Config, ctx: LaunchContext | None) -> None:
    """Before the initial conftests load (and before output capturing starts: it keeps the
    terminal's descriptor), in a launched rank's main process (xdist workers inherit it):
    ranks other than 0 write everything to their log file instead of the terminal, and
    torch.distributed's variables are set, so ``init_process_group(init_method="env://")``
    works under mpirun and srun before a conftest imports torch."""
    if ctx is None or "PYTEST_XDIST_WORKER" in os.environ:
        return
    if not ctx.is_root:
        redirect_output(log_dir(config) / ctx.launcher / f"rank{ctx.rank}.log")
    torchenv.provide(ctx, gather_dir(config, ctx), early_gather_timeout(config))


def launched_rank(config: pytest.Config, ctx: LaunchContext, timeout: float) -> LaunchedRank:
    """At ``pytest_configure``, the launched-rank feature of a rank's main process (the
    controller or a lone process): one junitxml at the path asked for, from rank 0; the
    other ranks keep theirs by their log (junitxml reads the path after this)."""
    if not ctx.is_root and getattr(config.option, "xmlpath", None):
        config.option.xmlpath = str(log_dir(config) / ctx.launcher / f"rank{ctx.rank}.xml")
    return LaunchedRank(config, ctx, timeout, config.getoption("shard"))


def check_shard(config: pytest.Config, ctx: LaunchContext | None) -> None:
    """``--shard`` outside a launcher is a usage error."""
    if config.getoption("shard") and ctx is None:
        raise pytest.UsageError("--shard: not running under a launcher (srun, mpirun or torchrun), nothing to shard")


def redirect_output(path: Path) -> None:
    """Send this process's stdout and stderr (file descriptors 1 and 2) to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for target in (1, 2):
        os.dup2(fd, target)
    os.close(fd)


class LaunchedRank:
    """The launched-rank feature: registered by the controller or lone role of each rank's main process."""

    def __init__(self, config: pytest.Config, ctx: LaunchContext, timeout: float, shard: bool) -> None:
        self.config = config
        self.ctx = ctx
        self.timeout = timeout
        self.shard = shard
        base = log_dir(config) / ctx.launcher
        self.log_path = base / f"rank{ctx.rank}.log"
        self.dir = gather_dir(config, ctx)
        self.reports: list[dict[str, Any]] = []
        self.missing: list[int] = []
        self.mismatch: list[str] = []
        self.table: dict[str, dict[str, list[int]]] = {}
        self.share: tuple[int, int] | None = None  # (this shard's tests, all tests)
        self.merged: dict[str, tuple[str, int]] = {}  # another rank's failure's id -> (the test's id, rank)
        self.terminated = False
        self.loads: dict[int, float] = {}  # rank -> seconds of test time (shard mode)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: object) -> None:
        """A launcher ends the job (torchrun does when any rank dies): stop the tests like
        Ctrl-C would, so this rank still publishes and rank 0 still reports. Once only."""
        if self.terminated:
            return
        self.terminated = True
        raise KeyboardInterrupt("SIGTERM from the launcher")

    # -- collection ------------------------------------------------------------------

    @pytest.hookimpl(wrapper=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> Generator[None, None, None]:
        # after every other selection (-m, -k, the launcher markers): the shares split what runs
        result = yield
        if self.shard:
            self.share = select_share(self.config, self.ctx, items)
        return result

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if self.shard:
            return
        ids = [item.nodeid for item in session.items]
        gather.publish(self.dir, "collected", self.ctx.rank, {"run": self.ctx.run_id, "ids": ids})
        others = gather.collect(self.dir, "collected", self.ctx.world_size, self.timeout)
        missing = sorted(set(range(self.ctx.world_size)) - set(others))
        if missing:
            raise pytest.UsageError(
                f"pytest-gpu: {numbered('rank', missing)} of {self.ctx.launcher} did not finish collecting within "
                f"--rank-gather-timeout={self.timeout:g}s; see {rank_logs(self.log_path.parent, missing)}"
            )
        problems = _differences({r: doc["ids"] for r, doc in others.items()})
        if problems:
            raise pytest.UsageError(
                "pytest-gpu: the ranks collected different tests, so they cannot run in lockstep:\n"
                + "\n".join(problems)
            )

    # -- results -----------------------------------------------------------------------

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if getattr(report, "_pytest_gpu_injected", False):
            return
        data = self.config.hook.pytest_report_to_serializable(config=self.config, report=report)
        self.reports.append({key: value for key, value in data.items() if _jsonable(value)})

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        gather.publish(
            self.dir,
            "results",
            self.ctx.rank,
            {"run": self.ctx.run_id, "exitstatus": int(exitstatus), "reports": self.reports},
        )
        # when the launcher is ending the job, the others are being stopped too: do not wait long
        wait = min(self.timeout, 10.0) if self.terminated else self.timeout
        docs = gather.collect(self.dir, "results", self.ctx.world_size, wait)
        self.missing = sorted(set(range(self.ctx.world_size)) - set(docs))
        failed = bool(self.missing)
        by_rank: dict[int, list[pytest.TestReport]] = {}
        for rank, doc in sorted(docs.items()):
            reports = [self._load(data) for data in doc["reports"]]
            by_rank[rank] = reports
            failed = failed or any(r.failed for r in reports) or doc["exitstatus"] not in (0, 5)
        if not self.shard:
            self.mismatch = _differences(
                {
                    r: sorted({rep.nodeid for rep in reps if rep.when == "call" or rep.skipped})
                    for r, reps in by_rank.items()
                }
            )
            failed = failed or bool(self.mismatch)
        if self.ctx.is_root:
            self._save_durations(by_rank)  # before _report renames other ranks' reports
            self._report(by_rank)
            self._report_missing()
        if failed:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        elif self.shard and session.exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED and any(by_rank.values()):
            session.exitstatus = pytest.ExitCode.OK

    def pytest_unconfigure(self) -> None:
        """Rank 0 leaves first, the others right after: launchers such as torchrun kill every
        rank as soon as one exits non-zero, so the others wait until rank 0 has written its
        summary and its junitxml."""
        others = list(range(1, self.ctx.world_size))
        if self.ctx.is_root:
            self._merge_junitxml()  # junitxml wrote its file at the session's end
            gather.publish(self.dir, "finished", 0, {"run": self.ctx.run_id})
            left = gather.collect(self.dir, "left", self.ctx.world_size, min(self.timeout, 30.0), ranks=others)
            if len(left) == len(others):
                shutil.rmtree(self.dir, ignore_errors=True)  # nobody reads it any more
        else:
            gather.collect(self.dir, "finished", self.ctx.world_size, self.timeout, ranks=[0])
            gather.publish(self.dir, "left", self.ctx.rank, {"run": self.ctx.run_id})

    def _load(self, data: dict[str, Any]) -> pytest.TestReport:
        report = self.config.hook.pytest_report_from_serializable(config=self.config, data=data)
        report.location = tuple(report.location)
        report.user_properties = [tuple(p) for p in report.user_properties]
        report.sections = [tuple(s) for s in report.sections]
        return cast(pytest.TestReport, report)  # pluggy's hook calls are untyped; these data are test reports

    def _report(self, by_rank: dict[int, list[pytest.TestReport]]) -> None:
        """Rank 0: feed the other ranks' reports to this session's reporters.

        Shard mode: every report, as it is (each test ran on one rank). Lockstep: each test
        counts once, as pytest would count it had it run once: rank 0's reports, unless rank 0
        passed where another rank failed; then the first failing rank's failures count in its
        place. The failures of the other failing ranks are shown (tracebacks, short summary
        lines, junitxml) but not counted again.
        """
        self.table = outcome_table(by_rank)
        self.loads = {rank: sum(float(r.duration) for r in reports) for rank, reports in by_rank.items()}
        if self.shard:
            for rank, reports in by_rank.items():
                if rank != self.ctx.rank:
                    for report in reports:
                        self._inject(report)
            return
        own_failed = {report.nodeid for report in by_rank.get(self.ctx.rank, []) if report.failed}
        failing: dict[str, list[int]] = defaultdict(list)  # test -> the other ranks it failed on, in order
        for rank, reports in sorted(by_rank.items()):
            if rank != self.ctx.rank:
                for nodeid in dict.fromkeys(report.nodeid for report in reports if report.failed):
                    failing[nodeid].append(rank)
        for nodeid, ranks in failing.items():
            for position, rank in enumerate(ranks):
                reports = [report for report in by_rank[rank] if report.nodeid == nodeid]
                counted = position == 0 and nodeid not in own_failed
                if counted:  # rank 0's phases that this rank failed (or never reached), and its skips, give way
                    self._uncount(nodeid, {"setup", "call", "teardown"} - {r.when for r in reports if not r.failed})
                for report in reports:
                    if report.failed:
                        self._inject_rank_failure(report, rank, counted=counted)

    def _inject_rank_failure(self, report: pytest.TestReport, rank: int, *, counted: bool) -> None:
        """Another rank's failure of a test, under the test's id with the rank in it."""
        nodeid = rank_nodeid(report.nodeid, rank)
        self.merged[nodeid] = (report.nodeid, rank)
        report.nodeid = nodeid
        fspath, lineno, domain = report.location
        report.location = (fspath, lineno, f"{domain} [rank {rank}]")
        log = self.log_path.parent / f"rank{rank}.log"
        report.sections.append(
            ("pytest-gpu", f"{_outcome(report)} on rank {rank} of {self.ctx.world_size}; its whole output: {log}")
        )
        if not counted:
            report.__class__ = UncountedReport
        self._inject(report)

    def _uncount(self, nodeid: str, phases: set[str]) -> None:
        """Take this rank's own reports of ``nodeid``'s ``phases``, and its skips (a test that
        failed elsewhere is no skip), out of the terminal's counts."""
        terminal = self.config.pluginmanager.get_plugin("terminalreporter")
        if terminal is None:
            return
        for category, reports in terminal.stats.items():
            if category in ("warnings", "rerun"):
                continue
            reports[:] = [
                r
                for r in reports
                if not (
                    isinstance(r, pytest.TestReport)
                    and r.nodeid == nodeid
                    and (r.when in phases or r.skipped)
                    and not getattr(r, "_pytest_gpu_injected", False)
                )
            ]

    def _merge_junitxml(self) -> None:
        """One ``testcase`` per test in rank 0's junitxml: other ranks' failures move into
        their test's case, each message prefixed with its rank ("rank 1: AssertionError ...").
        No testcase property: the default junit_family (xunit2) allows none."""
        logfile = privates.junitxml_file(self.config)
        if logfile is None or not self.merged:
            return
        path = Path(logfile)
        try:
            tree = ET.parse(path)
        except (OSError, ET.ParseError):
            return  # junitxml said why it could not write; the terminal has every failure
        names = {
            privates.junitxml_name(rank_id): (privates.junitxml_name(base), rank)
            for rank_id, (base, rank) in self.merged.items()
        }
        prefixed: set[int] = set()  # cases whose own (this rank's) failures already name the rank
        for suite in tree.getroot().iter("testsuite"):
            cases = {(case.get("classname"), case.get("name")): case for case in suite.findall("testcase")}
            for (classname, name), case in cases.items():
                if name not in names:
                    continue
                base_name, rank = names[name]
                base = cases.get((classname, base_name))
                if base is None:
                    continue
                for skipped in base.findall("skipped"):  # the test failed elsewhere: not a skip
                    base.remove(skipped)
                if id(base) not in prefixed:
                    prefixed.add(id(base))
                    for own in [c for c in base if c.tag in ("failure", "error")]:
                        own.set("message", f"rank {self.ctx.rank}: {own.get('message', '')}")
                for failure in [c for c in case if c.tag in ("failure", "error")]:
                    failure.set("message", f"rank {rank}: {failure.get('message', '')}")
                    # before the case's captured output, as pytest orders them
                    at = next((i for i, c in enumerate(base) if c.tag in ("system-out", "system-err")), len(base))
                    base.insert(at, failure)
                suite.remove(case)
            outcome = [{c.tag for c in case} for case in suite.findall("testcase")]
            suite.set("tests", str(len(outcome)))
            suite.set("failures", str(sum("failure" in tags for tags in outcome)))
            suite.set("errors", str(sum("error" in tags for tags in outcome)))
            suite.set("skipped", str(sum("skipped" in tags and not tags & {"failure", "error"} for tags in outcome)))
        tree.write(path, encoding="utf-8", xml_declaration=True)

    def _report_missing(self) -> None:
        """A rank that never reported is a failure of the run, in the terminal and in junitxml."""
        for rank in self.missing:
            log = self.log_path.parent / f"rank{rank}.log"
            self._inject(
                pytest.TestReport(
                    nodeid=f"pytest-gpu::rank{rank}",
                    location=(str(log), None, f"rank {rank}"),
                    keywords={},
                    outcome="failed",
                    longrepr=f"rank {rank} of {self.ctx.world_size} ({self.ctx.launcher}) did not report its results "
                    f"within --rank-gather-timeout={self.timeout:g}s: it died or hangs. Its output: {log}",
                    when="call",
                )
            )

    def _inject(self, report: pytest.TestReport) -> None:
        """Count another rank's report here: in the terminal's statistics (without a progress
        character for it) and in every other reporter, junitxml included."""
        report._pytest_gpu_injected = True  # type: ignore[attr-defined]
        terminal = self.config.pluginmanager.get_plugin("terminalreporter")
        others = self.config.pluginmanager.subset_hook_caller(
            "pytest_runtest_logreport", remove_plugins=[terminal] if terminal else []
        )
        others(report=report)
        if terminal is not None:
            category, _, _ = self.config.hook.pytest_report_teststatus(report=report, config=self.config)
            if category or report.when == "call":
                terminal.stats.setdefault(category, []).append(report)

    def _save_durations(self, by_rank: dict[int, list[pytest.TestReport]]) -> None:
        fresh: dict[str, float] = defaultdict(float)
        for reports in by_rank.values():
            for report in reports:
                fresh[report.nodeid] += float(report.duration)
        history.merge(self.config, DURATIONS_KEY, fresh)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.ctx.is_root:
            return
        tr = terminalreporter
        mode = "shards" if self.shard else "ranks"
        tr.section(f"pytest-gpu: {self.ctx.world_size} {mode} under {self.ctx.launcher}", sep="-")
        if self.share is not None:
            tr.write_line(f"rank 0 ran {self.share[0]} of {self.share[1]} tests; the other shares came from ranks 1+")
        if self.shard and self.loads:
            mean = sum(self.loads.values()) / len(self.loads)
            spread = (max(self.loads.values()) - min(self.loads.values())) / mean if mean else 0.0
            shares = ", ".join(f"rank {r}: {t:.2f}s" for r, t in sorted(self.loads.items()))
            tr.write_line(f"share durations: {shares} (spread {spread:.0%} of the mean)")
        for rank in self.missing:
            tr.write_line(
                f"rank {rank} did not report within --rank-gather-timeout={self.timeout:g}s "
                f"(it died or hangs); its output: {self.log_path.parent / f'rank{rank}.log'}",
                red=True,
            )
        for line in self.mismatch:
            tr.write_line(line, red=True)
        uneven = 0
        for nodeid, outcomes in sorted(self.table.items()):
            if self.shard or (set(outcomes) <= {"passed"}):
                continue
            uneven += 1
            parts = [
                f"{o} on rank{'s' if len(r) > 1 else ''} {','.join(map(str, sorted(r)))}"
                for o, r in sorted(outcomes.items())
            ]
            tr.write_line(f"{nodeid}: {'; '.join(parts)}")
        if not self.shard and self.table and not uneven and not self.missing and not self.mismatch:
            tr.write_line(f"every test passed on all {self.ctx.world_size} ranks")
        if self.ctx.world_size > 1:
            others = list(range(1, self.ctx.world_size))
            tr.write_line(f"output of {_ranks(others)}: {rank_logs(self.log_path.parent, others)}")


def outcome_table(by_rank: dict[int, list[pytest.TestReport]]) -> dict[str, dict[str, list[int]]]:
    """Test -> outcome -> the ranks it had: a call's outcome ("failed", "xfailed", ...), a skip
    at setup, and errors as pytest counts them, apart from failures ("error at setup",
    "error at teardown")."""
    table: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for rank, reports in by_rank.items():
        for report in reports:
            if report.when == "call" or (report.when == "setup" and not report.passed) or report.failed:
                table[report.nodeid][_outcome(report)].append(rank)
    return {k: dict(v) for k, v in table.items()}


def _outcome(report: pytest.TestReport) -> str:
    if report.when != "call" and report.failed:
        return f"error at {report.when}"
    return "xfailed" if hasattr(report, "wasxfail") and report.skipped else report.outcome


def _ranks(ranks: list[int]) -> str:
    """``rank 1``, ``ranks 1 and 2``, ``ranks 1 to 7``."""
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]} to {ranks[-1]}"
    return numbered("rank", ranks)


def rank_logs(directory: Path, ranks: list[int]) -> str:
    """The log files of ``ranks`` (other ranks than 0 write their whole output there), by name;
    a longer run of ranks as its first and last file."""
    files = [str(directory / f"rank{r}.log") for r in ranks]
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{files[0]} to {files[-1]}"
    return ", ".join(files)


class UncountedReport(pytest.TestReport):
    """Another rank's failure of a test already counted: shown, not counted again."""

    @property
    def count_towards_summary(self) -> bool:
        return False


def rank_nodeid(nodeid: str, rank: int) -> str:
    """The id of ``nodeid``'s report from ``rank``: ``test_x@rank1``, and ``test_x[p@rank1]``
    for a parametrized test, whose id must still end in its closing bracket (pytest's
    terminal and junitxml split an id at its first ``[``)."""
    name = nodeid.rsplit("::", 1)[-1]
    if "[" in name and name.endswith("]"):
        return f"{nodeid[:-1]}@rank{rank}]"
    return f"{nodeid}@rank{rank}"


def select_share(config: pytest.Config, ctx: LaunchContext, items: list[pytest.Item]) -> tuple[int, int]:
    """Shard mode: keep this rank's share of ``items``; every rank computes the same split.

    Returns (tests kept, tests collected).
    """
    durations = history.load(config, DURATIONS_KEY)
    parts = partition([i.nodeid for i in items], ctx.world_size, durations)
    mine = set(parts[ctx.rank])
    total = len(items)
    items[:] = [i for i in items if i.nodeid in mine]
    return len(items), total


def _jsonable(value: Any) -> bool:
    """Whether a report attribute can travel as JSON (xdist adds its WorkerController as ``node``)."""
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _differences(ids_by_rank: dict[int, list[str]]) -> list[str]:
    """Lines naming tests that not every rank has."""
    if not ids_by_rank:
        return []
    everyone = set.intersection(*(set(ids) for ids in ids_by_rank.values()))
    lines = []
    for rank, ids in sorted(ids_by_rank.items()):
        extra = sorted(set(ids) - everyone)
        if extra:
            shown = ", ".join(extra[:10]) + (f" and {len(extra) - 10} more" if len(extra) > 10 else "")
            lines.append(f"  only on rank {rank} (not on every rank): {shown}")
    if not lines:  # the same tests in another order run out of lockstep just as well (pytest-randomly)
        first_rank, first = min(ids_by_rank.items())
        for rank, ids in sorted(ids_by_rank.items()):
            at = next((i for i, (a, b) in enumerate(zip(first, ids, strict=False)) if a != b), None)
            if at is not None:
                lines.append(
                    f"  rank {rank} runs them in another order than rank {first_rank}: test {at + 1} is {ids[at]} "
                    f"there, {first[at]} on rank {first_rank} (pytest-randomly? give every rank the same "
                    "--randomly-seed)"
                )
    return lines
