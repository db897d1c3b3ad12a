"""The run's GPU summary, gathered from test reports (so it works under xdist too).

The report feature (:class:`~pytest_gpu.report.feature.RunReport`, a :class:`Summary`) is the
hook object that gathers them, in the process that owns the run.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import pytest

from ..base import privates
from ..base.requests import format_size
from ..base.spans import gpu_properties, parse_held
from ..base.wording import duration, join, numbered, plural, verb
from ..distributed.backends import AUTO_PROPERTY
from ..distributed.runner import AHEAD_PROPERTY, AHEAD_WAITED_PROPERTY
from ..run import transient
from ..run.record import HOST_SKIP_WORDS, SKIP_PROPERTY, gpu_skip_words
from ..vendors import registry as vendors
from .timeline import Timeline

if TYPE_CHECKING:
    from ..leasing.protocol import CrashRecord
    from ..run.quarantine import Quarantine
    from ..vendors.devices import Inventory


@dataclass(eq=False)  # registered as a plugin (RunReport): must stay hashable
class Summary:
    gpu_tests: int = 0
    violations: int = 0
    violating: list[str] = field(default_factory=list)
    notes: dict[str, int] = field(default_factory=dict)  # what verification could not check -> tests
    gpu_skipped: int = 0
    skipped_why: dict[str | None, int] = field(default_factory=dict)  # why, in a few words -> tests (None: unsaid)
    auto_backends: dict[str, set[str]] = field(default_factory=dict)  # "gloo: why" -> distributed tests
    unseen: dict[float, int] = field(default_factory=dict)  # process-list lag (AMD's) -> tests verified within it
    timeline: Timeline = field(default_factory=Timeline)
    trace_path: str = ""
    trace_error: str = ""
    interrupted: bool = False  # the run was cut short (Ctrl-C, pytest.exit, xdist's -x shutdown)
    down: dict[str, str] = field(default_factory=dict)  # xdist worker -> why it went down while the run went on
    cut_short: dict[str, list[str]] = field(default_factory=dict)  # xdist worker -> tests it left unfinished
    # a test started and not finished -> its worker ("": no report yet, it is still setting up)
    running: dict[str, str] = field(default_factory=dict)
    quarantined: dict[str, Quarantine] = field(default_factory=dict)  # worker -> the sticky CUDA error it had
    # why a GPU test skipped at run time without saying so was skipped (None: too large for the run's
    # inventory); --gpu-nodes: the controller's inventory is no GPU, the test's node had some
    unsaid_why: str | None = None
    infra: dict[str, str] = field(default_factory=dict)  # node id -> why its failure was infrastructure
    retried: dict[str, str] = field(default_factory=dict)  # node id -> "passed on retry" or "failed on retry"
    # rank pools started before their first test (--dist-pool-ahead): how many, the start-up
    # seconds their first tests did not wait for, and those they still waited
    ahead_started: int = 0
    ahead_hidden: float = 0.0
    ahead_waited: float = 0.0

    @property
    def waited(self) -> float:
        """Seconds the tests waited for GPUs in all: the figure both summary lines print."""
        return self.timeline.waited()

    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        # under xdist the controller hears this when a worker starts the test: the start
        # of a test whose worker dies (its crash report carries no times)
        self.timeline.started(nodeid, "main", time.time())
        self.running.setdefault(nodeid, "")

    def pytest_runtest_logfinish(self, nodeid: str, location: Any) -> None:
        self.running.pop(nodeid, None)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.add(report)
        node = privates.report_worker(report)  # xdist: the WorkerController that ran it
        worker = privates.worker_id(node) if node is not None else "main"
        # xdist: the test its worker was running when it went down (a `when` outside pytest's Literal)
        if cast(str, report.when) == "???":
            self.cut_short.setdefault(worker, []).append(report.nodeid)
            self.running.pop(report.nodeid, None)
        elif report.nodeid in self.running:  # (another rank's report, under a launcher, never is)
            self.running[report.nodeid] = worker
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
            xfail=hasattr(report, "wasxfail"),
        )

    def pytest_keyboard_interrupt(self, excinfo: pytest.ExceptionInfo[BaseException]) -> None:
        # Ctrl-C, pytest.exit(), or xdist's Interrupted (a worker got Ctrl-C, -x stopped the run):
        # called before xdist tears its workers down, so before their leases come back
        self.interrupted = True

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: object | None) -> None:
        # xdist calls this while its loop runs: a worker that went down with an error then
        # died while the run went on (or, "keyboard-interrupt", was itself interrupted)
        if error is not None:
            self.down[privates.worker_id(node)] = str(error)

    def peaks(self) -> dict[str, int]:
        """Node id -> highest peak measured on one of its GPUs (for ``--gpu-learn``)."""
        return {r.nodeid: r.peak for r in self.timeline.records.values() if r.peak is not None}

    def durations(self) -> dict[str, float]:
        """Node id -> seconds, for every test that ran to its end here (crashes excluded).

        Without the time it waited for GPUs: that was the run's crowding, not the test's own
        work, and the scheduler plans the GPUs as busy for as long as a test is expected to take."""
        return {
            r.nodeid: max(r.duration - r.waited, 0.0) for r in self.timeline.records.values() if r.outcome != "crashed"
        }

    def add(self, report: pytest.TestReport) -> None:
        given = dict(report.user_properties)
        if report.skipped and "pytest-gpu:" in str(report.longrepr):
            self.gpu_skipped += 1  # a GPU test this machine could not run: worth a summary
            why = given.get(SKIP_PROPERTY)  # set at collection; a skip at run time (a gpu_request block) says none
            key = str(why) if why else None
            self.skipped_why[key] = self.skipped_why.get(key, 0) + 1
        self.add_infra(report, given)
        chosen = given.get(AUTO_PROPERTY)
        if chosen and report.when == "call":  # it ran on a pool (or tried to): not skipped before
            self.auto_backends.setdefault(str(chosen), set()).add(report.nodeid)
        if report.when == "call" and AHEAD_PROPERTY in given:
            self.ahead_started += 1
            self.ahead_hidden += float(cast(float, given[AHEAD_PROPERTY]))
            self.ahead_waited += float(cast(float, given.get(AHEAD_WAITED_PROPERTY, 0.0)))
        if report.when != "teardown":
            return
        props = gpu_properties(report.user_properties)
        if "gpu_indices" not in props:
            return
        held_rows = parse_held(str(props.get("gpu_held", "[]")))  # fixtures' and pools' holdings judged then
        if props["gpu_indices"] or any(h.kind == "pool" for h in held_rows):  # a test on a pool's GPUs is one
            self.gpu_tests += 1
        count = int(props.get("gpu_violations", 0))
        if count:
            self.violations += count
            self.violating.append(report.nodeid)
        for held in held_rows:
            if held.violations:
                self.violations += held.violations
                self.violating.append(f"{held.name} (judged during {report.nodeid})")
        for note in str(props.get("gpu_notes", "")).splitlines():
            if note:
                self.notes[note] = self.notes.get(note, 0) + 1
        lag = float(props.get("gpu_unseen_lag", 0.0))
        if lag > 0:
            self.unseen[lag] = self.unseen.get(lag, 0) + 1

    def quiet(self, crashes: list[CrashRecord], grants: int = 0) -> bool:
        """Nothing GPU happened (a CPU-only suite, ``--co``, a collection error): say nothing.
        ``grants``: leases the run's broker granted (fixtures' too, which no test reports)."""
        return not (
            self.gpu_tests
            or self.gpu_skipped
            or crashes
            or grants
            or self.trace_path
            or self.trace_error
            or self.quarantined
            or self.infra
            or self.retried
        )

    def lines(self, inventory: Inventory, crashes: list[CrashRecord]) -> list[str]:
        out = [
            f"pytest-gpu: {inventory.describe()} [{inventory.source}] · {plural(self.gpu_tests, 'GPU test')} · "
            f"waited {duration(self.waited)} in total · {plural(self.violations, 'violation')}"
        ]
        if inventory.note and inventory.devices:  # what discovery left out (a GPU NVML refused, ...)
            out.append(f"pytest-gpu: note: {inventory.note}")
        out += self.skipped_lines(inventory) + self.backend_lines() + self.unseen_lines(inventory)
        for nodeid in self.violating[:10]:
            out.append(f"pytest-gpu: lease broken by {nodeid}")
        for note, tests in list(self.notes.items())[:10]:
            out.append(f"pytest-gpu: not verified: {note} ({plural(tests, 'test')})")
        out += [self.quarantine_line(found) for found in self.quarantined.values()]
        out += [self.crash_line(crash) for crash in crashes if crash.worker not in self.quarantined]
        return out + self.running_lines(crashes) + self.infra_lines()

    def skipped_lines(self, inventory: Inventory) -> list[str]:
        """One line: how many tests were skipped because this run cannot run them, and why
        (a run green only because its GPU tests were skipped must say so)."""
        if not self.gpu_skipped:
            return []
        counts: dict[str, int] = {}
        for why, tests in self.skipped_why.items():
            if why is None:  # a skip at run time (a gpu_request block, a fixture's lease): a request too large
                why = self.unsaid_why or gpu_skip_words(inventory)
            counts[why] = counts.get(why, 0) + tests
        if len(counts) == 1:
            reasons = next(iter(counts))
        else:
            reasons = "; ".join(f"{n} {why}" for why, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
        # "GPU tests" only when every one was for GPUs: the count --gpu-required gives on the same run
        what = "test" if HOST_SKIP_WORDS in counts else "GPU test"
        return [f"pytest-gpu: {plural(self.gpu_skipped, what)} skipped: {reasons} (-rs lists them)"]

    def unseen_lines(self, inventory: Inventory) -> list[str]:
        """How many tests were verified from a process list that may not show them yet (AMD's:
        shorter than its lag, nothing waited: :meth:`~pytest_gpu.gpu.verification.NvmlVerifier.end`),
        once per run, so that the blind spot is said rather than waited out for every test; in
        the words of the run's vendor (:meth:`~pytest_gpu.vendors.vendor.Vendor.unseen`)."""
        if not self.unseen:
            return []
        vendor = vendors.of(inventory.vendor)
        return [vendor.unseen(tests, lag) for lag, tests in sorted(self.unseen.items())]

    def backend_lines(self) -> list[str]:
        """What ``backend="auto"`` chose for the run's distributed tests, and why (one line a choice),
        then the pools started ahead (:meth:`ahead_lines`): the distributed tests' lines, said also
        in a run that is otherwise quiet (gloo on CPUs)."""
        out = []
        for chosen, tests in sorted(self.auto_backends.items()):
            backend, _, why = chosen.partition(": ")
            tests_ = plural(len(tests), "distributed test")
            out.append(f"pytest-gpu: backend='auto' chose {backend} for {tests_}: {why}")
        return out + self.ahead_lines()

    def ahead_lines(self) -> list[str]:
        """How much rank-pool start-up the run hid by starting pools ahead, as their first tests
        measured it (a pool's start against the time its test still waited for it)."""
        if not self.ahead_started:
            return []
        line = (
            f"pytest-gpu: rank pools: {self.ahead_started} started ahead, {self.ahead_hidden:.1f} s of start-up hidden"
        )
        if self.ahead_waited >= 0.05:
            line += f" ({self.ahead_waited:.1f} s still waited for)"
        return [line]

    @staticmethod
    def quarantine_line(found: Quarantine) -> str:
        """A process whose CUDA a test broke for good (see :mod:`pytest_gpu.run.quarantine`)."""
        if found.ends:
            then = f"worker {found.worker} held its GPU memory until it ended itself, and xdist replaced it"
        else:
            where = "this process" if found.worker == "main" else f"worker {found.worker} (--dist chosen)"
            then = f"the GPU tests after it in {where} were not run (-n without --dist gives them a fresh worker)"
        return f"pytest-gpu: quarantined: {found.test} left CUDA unusable ({found.error}); {then}"

    def was_interrupted(self, crash: CrashRecord) -> bool:
        """Whether ``crash``'s worker went away because the run was interrupted, not by dying.

        A worker xdist saw go down while the run went on died (unless it went down with
        Ctrl-C itself); any other worker that went away holding something in an
        interrupted run was stopped with the run (by Ctrl-C, or by xdist tearing it down).
        """
        error = self.down.get(crash.worker)
        if error is not None:
            return error == "keyboard-interrupt"
        return self.interrupted

    def running_lines(self, crashes: list[CrashRecord]) -> list[str]:
        """An interrupted run: the tests still running then on the workers that no crash line
        names (one that gave back what it held itself, such as a distributed test's pool; one
        that held nothing), so that every test the interruption cut short is named."""
        if not (self.interrupted or "keyboard-interrupt" in self.down.values()):
            return []
        named = {crash.worker for crash in crashes if crash.worker not in self.quarantined}
        by_worker: dict[str, list[str]] = {}
        for test, worker in self.running.items():
            if not worker or worker not in named:
                by_worker.setdefault(worker, []).append(test)
        out = []
        for worker, tests in sorted(by_worker.items()):
            if not worker:  # started, no report yet: in its setup (waiting for its GPUs, say)
                out.append(f"pytest-gpu: interrupted while {join(tests)} {verb(len(tests), 'was', 'were')} setting up")
            elif worker == "main":
                out.append(f"pytest-gpu: interrupted while running {join(tests)}")
            else:
                out.append(f"pytest-gpu: interrupted while {worker} ran {join(tests)}")
        return out

    def crash_line(self, crash: CrashRecord) -> str:
        """What a worker that went away holding GPUs or ports left: the test it ran, what came back."""
        # xdist knows the test its worker ran; the broker's name for a holder may be another's
        # (the rank pool a test started holds its GPUs and port for the tests after it)
        test = ", ".join(self.cut_short.get(crash.worker, ())) or crash.test or "an unknown test"
        ran = [nodeid for nodeid, worker in self.running.items() if worker == crash.worker]
        if ran and self.was_interrupted(crash):  # the tests it ran when the run stopped
            test = join(ran)
        held = []
        if crash.gpus:
            held.append(numbered("GPU", crash.gpus))
        if crash.ports:
            held.append(plural(len(crash.ports), "port"))
        were = verb(len(crash.gpus) + len(crash.ports), "was", "were")
        what = f"its {' and its '.join(held)} {were}"
        if self.was_interrupted(crash):
            return f"pytest-gpu: interrupted while {crash.worker} ran {test}; {what} given back"
        return f"pytest-gpu: worker {crash.worker} (pid {crash.pid}) died while running {test}; {what} reclaimed"

    # -- infrastructure failures (pytest_gpu.run.transient) ----------------------------------------

    def add_infra(self, report: pytest.TestReport, given: Mapping[str, object]) -> None:
        """A report's infrastructure failure and retry, from its properties (a worker's too);
        a failure run again (its report's outcome "rerun": pytest-rerunfailures', a lost
        worker's test put back) is said by the report of the run that ends it."""
        if report.failed and given.get(transient.CLASS_PROPERTY) == transient.INFRASTRUCTURE:
            self.infra[report.nodeid] = str(given.get(transient.REASON_PROPERTY, ""))
        retry = given.get(transient.RETRY_PROPERTY)
        if retry:
            self.retried[report.nodeid] = str(retry)

    def infra_lines(self) -> list[str]:
        """The tests whose failure came from outside them, each with why; the retried ones' count."""
        out = []
        if self.infra:
            hint = "" if self.retried else "; --gpu-retry-infra reruns them once"
            failures = plural(len(self.infra), "infrastructure failure")
            out.append(f"pytest-gpu: {failures} (the cause was outside the test{hint}):")
            out += [f"pytest-gpu:   {nodeid}: {why}" for nodeid, why in list(self.infra.items())[:10]]
            if len(self.infra) > 10:
                out.append(f"pytest-gpu:   ... and {len(self.infra) - 10} more (-rA shows each one's reason)")
        passed = sorted(n for n, outcome in self.retried.items() if outcome == "passed on retry")
        if passed:
            more = ", ..." if len(passed) > 5 else ""
            out.append(f"pytest-gpu: passed on retry: {len(passed)} ({', '.join(passed[:5])}{more})")
        failed = len(self.retried) - len(passed)
        if failed:
            out.append(f"pytest-gpu: failed on retry: {failed}")
        return out


def context_lines(measured: Mapping[int, int], assumed: int, given: bool, runtime: str = "CUDA") -> list[str]:
    """What one context of ``runtime`` (the inventory's: CUDA, HIP, Level Zero) took on each GPU, as
    the run's processes measured it (right after it opened), beside the size assumed until then;
    or that the size was given."""
    if given:
        given_as = "as --gpu-context-overhead gives it"
        return [f"pytest-gpu: {runtime} context: {format_size(assumed)} per process, {given_as}"]
    if not measured:
        return []
    sizes = ", ".join(f"GPU {index}: {format_size(n)}" for index, n in sorted(measured.items()))
    return [f"pytest-gpu: {runtime} context measured: {sizes} (assumed {format_size(assumed)} until measured)"]


def foreign_lines(entries: Iterable[Mapping[str, object]]) -> list[str]:
    """Summary lines for grants that avoided a GPU or waited because processes outside
    pytest-gpu used memory there (the broker's ``foreign`` records)."""
    avoided: dict[int, list[Mapping[str, object]]] = {}
    waited: list[Mapping[str, object]] = []
    for entry in entries:
        for index in _avoided(entry):
            avoided.setdefault(index, []).append(entry)
        if entry.get("waited"):
            waited.append(entry)
    lines = []
    for index, rows in sorted(avoided.items()):
        most = max(int(_bytes(r).get(index, 0)) for r in rows)
        lines.append(
            f"pytest-gpu: GPU {index} was avoided by {plural(len(rows), 'test')}: processes outside "
            f"pytest-gpu used {format_size(most)} there"
        )
    if waited:
        gpus = sorted({int(i) for r in waited for i in _bytes(r)})
        most_on = {i: max(int(_bytes(r).get(i, 0)) for r in waited) for i in gpus}
        where = ", ".join(f"{format_size(most_on[i])} on GPU {i}" for i in gpus)
        total = sum(float(cast(float, r.get("seconds", 0.0))) for r in waited)  # the broker's wait, seconds
        lines.append(
            f"pytest-gpu: {plural(len(waited), 'test')} {verb(len(waited), 'was', 'were')} held back "
            f"{duration(total)} in total by processes outside pytest-gpu" + (f" ({where})" if where else "")
        )
    return lines


# The broker's foreign records are its ForeignNote fields (pytest_gpu.leasing.protocol) plus
# "test" and "seconds"; these read the two that are containers.


def _avoided(entry: Mapping[str, object]) -> list[int]:
    return cast("list[int]", entry.get("avoided", []))  # ForeignNote.avoided: GPU indices


def _bytes(entry: Mapping[str, object]) -> Mapping[int, int]:
    return cast("Mapping[int, int]", entry.get("bytes", {}))  # ForeignNote.bytes: GPU index -> bytes
