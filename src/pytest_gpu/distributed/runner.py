"""pytest side of distributed tests: send the body and fixture values to a pool, report every rank.

An *isolated* test (``gpu(..., isolate=True)``) runs the same way on a one-rank pool that
holds the test's lease (:func:`isolated_item_spec`): its body sees exactly its GPUs, as
``cuda:0..count-1``, and the pool's check after it is the test's own verdict.

A test that fails on a warm pool after other tests is run once more alone on fresh ranks
(:func:`rerun_alone`), which tells contamination by an earlier test from its own failure
(:mod:`.contamination`); what each test left on its ranks is named on it (:mod:`.residue`).

The feature's hook object is :class:`Distributed`, in every process that runs tests; it
gives the lease feature its collection check (:func:`stash_spec`) and its reasons a test
can never run here (:func:`never_runs`). The process's pools are its :class:`PoolManager`'s:
at most one warm pool at a time.
"""

from __future__ import annotations

import pickle
import re
import threading
import time
import zlib
from collections.abc import Generator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from ..base import privates
from ..base.distspec import DistSettings, DistSpec, build_spec, isolated_spec
from ..base.requests import GpuRequestError, format_size
from ..base.wording import plural
from ..leasing.client import BrokerError
from ..run.feature import Feature
from ..run.fixture_leases import FACTORY
from ..run.holding import STATE_KEY
from ..run.infra import INIT_TIMEOUT_KEY
from ..run.record import effective, needs, record, skip_why
from . import contamination
from .backends import AUTO_PROPERTY, auto_backend, fit_ranks, nccl_missing
from .rankinfo import RankPlaceholder

if TYPE_CHECKING:  # the pool machinery is imported when the first distributed test runs
    from ..base.spans import LeaseSpan
    from ..gpu.verification import Verdict
    from ..run.session import GpuRun
    from .pool import RankPool, RankRun

MANAGER_KEY = pytest.StashKey["PoolManager"]()
# what the ranks of an interrupted test left (stacks, output): for the failure's full text
ABANDONED_KEY = pytest.StashKey[list[tuple[str, str]]]()
# where its pool was then: "its rank pool of 2 ranks (gloo via spawn) was starting, for 2.1s (...)"
INTERRUPTED_KEY = pytest.StashKey[str]()
STDERR_TAIL_LINES = 20  # of each failing rank's stderr, in the failure's full text


class DistributedFailure(Exception):
    """A distributed test failed; the message lists every failing rank.

    ``detail`` is what the report sections say about the failing ranks (their stacks, the
    tail of their stderr), repeated in the failure's full text for junit readers.
    """

    def __init__(self, message: str, detail: str = "", crash: str = "", isolated: bool = False) -> None:
        super().__init__(message)
        self.detail = detail
        self.crash = crash  # the short summary's text ("": the message's first line)
        self.isolated = isolated  # an isolated test's: reported as a test's own failure


class FailureRepr:
    """A failure's ``longrepr``: the terminal shows ``shown``; ``str()`` adds ``detail``.

    ``--junitxml`` writes ``str(longrepr)`` as the ``<failure>`` body and drops report
    sections (``junit_logging`` only writes the captured stdout/stderr/log ones), so the
    ranks' stacks and stderr tails would be lost there. On the terminal they already follow
    as report sections: shown again in the failure text they would only be noise. An xdist
    worker sends ``str()`` to the controller (see :func:`make_report`).
    """

    def __init__(self, shown: Any, detail: str, crash: Any = None) -> None:
        self.shown = shown
        self.detail = detail
        self.reprcrash = crash if crash is not None else getattr(shown, "reprcrash", None)

    def toterminal(self, tw: Any) -> None:
        if hasattr(self.shown, "toterminal"):
            self.shown.toterminal(tw)
        else:
            tw.line(str(self.shown))

    def __str__(self) -> str:
        return f"{str(self.shown).rstrip()}\n\n{self.detail}" if self.detail else str(self.shown)


class Distributed(Feature):
    """Distributed (and isolated) tests in a process that runs tests: their bodies run on the
    process's pools, their reports say every rank's outcome, and no pool outlives the session."""

    _next: pytest.Item | None = None  # the test this process runs after the current one (warm_ahead)

    @pytest.hookimpl(tryfirst=True)
    def pytest_pyfunc_call(self, pyfuncitem: pytest.Function) -> bool | None:
        if needs(pyfuncitem).dist is None:
            return None
        run_item(pyfuncitem, self.run)
        return True

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
        make_report(item, call, report)
        return report

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> None:
        # the test this process holds next (under -n: the one the scheduler handed it with this one)
        self._next = nextitem

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_call(self, item: pytest.Item) -> None:
        # its pool starts once this test holds its own leases (set up): it never takes them first
        nextitem, self._next = self._next, None
        if nextitem is not None:
            warm_ahead(nextitem, self.run, current=item)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> None:
        nextitem, self._next = self._next, None  # still there: this test was skipped, or failed in its setup
        if nextitem is not None:
            warm_ahead(nextitem, self.run, current=item)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        close(self.config)  # no rank outlives the session, also after Ctrl-C

    def pytest_unconfigure(self) -> None:
        close(self.config)  # before the role closes the run (registered after it: called first)


def never_runs(item: pytest.Item, run: GpuRun) -> tuple[str, str] | None:
    """Why ``run`` can never run the distributed test ``item``, and that in a few words for the
    summary; ``None``: it can, or it is no distributed test. Checked as its pool is placed:
    ``world_size`` x ``gpus_per_rank`` GPUs (the pool's lease), then the backend (nccl needs
    real GPUs and a torch with NCCL); what the test leases itself is the lease feature's."""
    dist = needs(item).dist
    if dist is None:
        return None
    pool = dist.gpu_request(run.settings.default_memory)
    reason = run.never_fits(pool) if pool is not None else None
    if pool is not None and reason is not None:
        return f"its pool of {dist.describe()} {reason}", skip_why(pool, run)
    missing = nccl_missing(run.inventory) if dist.backend == "nccl" else None
    if missing is not None:
        instead = "; backend='auto' would take gloo here" if run.inventory.devices else ""
        return f"backend='nccl' cannot run here: {missing}{instead}", f"nccl unavailable — {missing}"
    return None


def stash_spec(item: pytest.Item, run: GpuRun) -> None:
    """Collection check: validate the ``distributed`` marker and remember the spec."""
    spec = item_spec(item, run)
    if spec is None and needs(item).isolated:
        spec = isolated_item_spec(item)
    if spec is not None:
        record(item).dist = spec
        if not item.config.pluginmanager.has_plugin(PoolsEnd.NAME):
            item.config.pluginmanager.register(PoolsEnd(), PoolsEnd.NAME)


class PoolsEnd:
    """Closes the pools when the test loop ends, before anything else sees that end.

    Registered when collection finds a distributed test (a suite without one pays nothing).
    The innermost ``pytest_runtestloop`` wrapper (trylast): pytest-cov combines its data files
    when the loop ends, and a rank writes its data only when its pool closes it (see
    :mod:`.cover`); closed later, at session end, the ranks' data would be missed and left
    behind as stray ``.coverage.*`` files. ``pytest_sessionfinish`` still closes whatever
    is left (an interrupted collection, say).
    """

    NAME = "pytest-gpu-pools-end"

    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_runtestloop(self, session: pytest.Session) -> Generator[None, object, object]:
        try:
            return (yield)
        finally:
            close(session.config)


def item_spec(item: pytest.Item, run: GpuRun) -> DistSpec | None:
    """The ``distributed`` marker of ``item`` as a spec; raises GpuRequestError naming the test."""
    marker = item.get_closest_marker("distributed")
    if marker is None:
        return None
    auto = auto_backend(run.inventory)  # nccl only on real GPUs with a torch that has it
    try:
        spec = build_spec(marker.args, marker.kwargs, auto_backend=auto.backend)
        if auto.backend in ("nccl", "xccl") and "gpus_per_rank" not in marker.kwargs:  # a GPU a rank: do they fit?
            auto = fit_ranks(auto, spec.world_size, run.inventory)
            spec = build_spec(marker.args, marker.kwargs, auto_backend=auto.backend)
    except GpuRequestError as exc:
        raise GpuRequestError(f"{item.nodeid}: {exc}") from None
    if marker.kwargs.get("backend", "auto") == "auto" and AUTO_PROPERTY not in dict(item.user_properties):
        item.user_properties.append((AUTO_PROPERTY, auto.describe()))  # the summary says what auto chose
    if item.get_closest_marker("gpu") is not None:
        raise GpuRequestError(
            f"{item.nodeid}: a distributed test gets its GPUs through distributed(gpus_per_rank=...), not a gpu marker"
        )
    if not isinstance(item, pytest.Function):
        raise GpuRequestError(f"{item.nodeid}: the distributed marker only applies to test functions")
    return spec


# fixtures whose values are the test process's view of a lease, which the isolated body's process does not have
_WORKER_VIEW = ("gpu", "gpu_request", FACTORY)


def isolated_item_spec(item: pytest.Item) -> DistSpec:
    """The one-rank pool of a test marked ``gpu(..., isolate=True)``; raises GpuRequestError
    naming the test for what cannot run in a process of its own."""
    request = needs(item).request
    assert request is not None, "an isolated test has a request (lifecycle.item_needs)"
    what = f"{item.nodeid}: gpu(..., isolate=True)"
    if not isinstance(item, pytest.Function) or _is_unittest(item):
        # a unittest.TestCase's method runs through unittest, never through the body runner
        raise GpuRequestError(f"{what} only applies to test functions and methods of plain test classes")
    view = []
    info = privates.fixture_info(item)
    assert info is not None  # a pytest.Function's
    # what the body's fixture values are built from (autouse fixtures it does not ask for aside):
    # fixtures holding a lease of their own (gpu_lease_factory) hold it in the test process
    for name in sorted(_reached(info, info.argnames)):
        if name in _WORKER_VIEW or any(
            FACTORY in fd.argnames for fd in effective(info.name2fixturedefs.get(name), name)
        ):
            view.append(name)
    if view:
        raise GpuRequestError(
            f"{what}: the body runs in a process of its own that sees its GPUs as cuda:0..{request.count - 1}, "
            f"but it asks for {', '.join(repr(v) for v in view)}, leasing GPUs in the test process; "
            "use the GPUs directly (torch.cuda.device_count(), 'cuda:0', ...) or drop isolate=True"
        )
    return isolated_spec(request)


def _is_unittest(item: pytest.Function) -> bool:
    import unittest

    return item.cls is not None and issubclass(item.cls, unittest.TestCase)


def _reached(info: Any, roots: Sequence[str]) -> set[str]:
    """The fixtures ``roots`` need, transitively (``info``: a test's fixture info)."""
    seen: set[str] = set()
    pending = list(roots)
    while pending:
        name = pending.pop()
        if name not in seen:
            seen.add(name)
            for fixturedef in effective(info.name2fixturedefs.get(name), name):
                pending.extend(fixturedef.argnames)
    return seen


def manager(config: pytest.Config, run: GpuRun) -> PoolManager:
    found = config.stash.get(MANAGER_KEY, None)
    if found is None:
        settings = DistSettings(
            timeout=run.settings.dist_timeout,
            pool=run.settings.dist_pool,
            idle=run.settings.dist_pool_idle,
            wait_timeout=run.settings.wait_timeout,
        )
        args = ["--rootdir", str(config.rootpath)]
        if config.inipath is not None:
            args += ["-c", str(config.inipath)]
        # the options that decide how a test module is imported, as this run resolved them
        # (addopts included): the ranks read no addopts, which name options of plugins they do not load
        args += [f"--import-mode={config.getoption('importmode')}", f"--assert={config.getoption('assertmode')}"]
        found = PoolManager(run, settings, args, run.run_dir / "pools")
        config.stash[MANAGER_KEY] = found
        run.on_wait.append(found.close_idle)  # a request of this process that must wait: not for an idle pool
        run.on_wait.insert(0, found.ahead_never_waits)  # first: before close_idle gives anything up
    return found


def close(config: pytest.Config) -> None:
    found = config.stash.get(MANAGER_KEY, None)
    if found is not None:
        if found.close_idle in found.run.on_wait:
            found.run.on_wait.remove(found.close_idle)
        if found.ahead_never_waits in found.run.on_wait:
            found.run.on_wait.remove(found.ahead_never_waits)
        found.close()
        del config.stash[MANAGER_KEY]


def _payload(item: pytest.Function, isolated: bool = False) -> dict[str, Any]:
    where = "the test's own process (isolate=True)" if isolated else "the ranks"
    kwargs: dict[str, Any] = {}
    info = privates.fixture_info(item)
    assert info is not None  # a pytest.Function's
    for name in info.argnames:
        value = item.funcargs[name]
        kwargs[name] = value
        problem = None
        try:
            _dumps(value)
        except Exception as exc:
            problem = str(exc)
        if problem is not None:  # failed outside the except: no chained pickling tracebacks
            pytest.fail(
                f"pytest-gpu: {item.nodeid}: the value of fixture {name!r} ({type(value).__name__}) cannot be "
                f"sent to {where}: {problem}. Build it inside the test body, or make it picklable.",
                pytrace=False,
            )
    return {
        "module_file": str(item.path),
        "module_name": item.module.__name__,
        "cls": item.cls.__qualname__ if item.cls is not None else "",
        "func": item.obj.__name__,
        "kwargs": _dumps(kwargs),
        "seed": zlib.crc32(item.nodeid.encode()),
        "nodeid": item.nodeid,
        "tbstyle": item.config.getoption("tbstyle", "auto"),
    }


def _dumps(value: Any) -> bytes:
    try:
        return pickle.dumps(value)
    except Exception:
        try:
            import cloudpickle
        except ImportError:
            raise
        data: bytes = cloudpickle.dumps(value)  # cloudpickle publishes no types
        return data


def run_item(item: pytest.Function, run: GpuRun) -> None:
    """Run a distributed test's body on its pool; raise the outcome as pytest expects."""
    started = time.perf_counter()
    spec = needs(item).dist
    assert spec is not None, "run_item is called for distributed tests only"
    body = _payload(item, spec.isolated)
    timeout = spec.timeout or run.settings.dist_timeout
    pools = manager(item.config, run)
    before = pools.started
    from .pool import PoolError  # local: slow (the pool machinery): loaded by the first distributed test

    alone: RankRun | None = None
    try:
        result, notes = pools.execute(spec, body, timeout)
        pooled = "fresh" if pools.started != before else "warm"
        contamination.name_residue(item, spec, result)
        if contamination.unusable(result):
            pools.discard(spec)
        alone = rerun_alone(item, spec, body, timeout, pools, result, run)
    except PoolError as exc:
        timed_out = init_timeout(str(exc))
        if timed_out is not None:  # evidence of an infrastructure failure (pytest_gpu.run.infra)
            item.stash[INIT_TIMEOUT_KEY] = timed_out
        raise DistributedFailure(f"pytest-gpu: {exc}") from None
    except BrokerError as exc:  # its pool's lease was refused or timed out: one line, as a GPU test's own
        asked = spec.lease.describe() if spec.lease is not None else f"the GPUs of its pool of {spec.describe()}"
        pytest.fail(f"pytest-gpu: {item.nodeid} could not get {asked}: {exc}", pytrace=False)
    except BaseException as exc:
        # interrupted (pytest-timeout, Ctrl-C): the pool was killed; show where its ranks were
        for name, content in pools.abandoned:
            item.add_report_section("call", name, content)
        item.stash[ABANDONED_KEY] = list(pools.abandoned)
        item.stash[INTERRUPTED_KEY] = pools.interrupted
        if isinstance(exc, Exception) and pools.interrupted:  # an error: its traceback stays (make_report)
            item.add_report_section("call", "pytest-gpu pool", f"the test ended while {pools.interrupted}")
        raise
    for ran in (result, alone):  # the rerun's pool held its own lease: judged too
        if ran is not None:
            _judge(item, spec, ran, pools)
    body_seconds = max((r.get("body_seconds", 0.0) for r in result.results.values()), default=0.0)
    item.user_properties.extend(
        [
            ("dist_ranks", spec.world_size),
            ("dist_pool", pooled),
            ("dist_body_seconds", round(body_seconds, 6)),
            ("dist_overhead_seconds", round(time.perf_counter() - started - body_seconds, 6)),
        ]
    )
    item.user_properties.extend(pools.ahead_properties())
    for name, content in result.sections:
        if spec.isolated and name in ("rank 0 stdout", "rank 0 stderr"):
            name = name.removeprefix("rank 0 ")  # its output, as a test's own ("Captured stdout call")
        item.add_report_section("call", name, content)
    for note in notes:
        item.add_report_section("call", "pytest-gpu pool", note)
    if alone is not None:
        told_apart(item, spec, result, alone, pools)  # contamination: raises; its own failure: said below
    outcome = result.outcome
    if outcome == "failed" and spec.isolated:
        text, crash = isolated_failure(result)
        # what its process left (stack, stderr) when it hung or died: the report's sections say the rest
        detail = failure_detail(spec, result) if result.problems else ""
        raise DistributedFailure(text, detail, crash=crash, isolated=True)
    if outcome == "failed":
        text = failure_text(spec, result)
        if alone is not None:
            text += "\n" + contamination.own(result)
        raise DistributedFailure(text, failure_detail(spec, result))
    if outcome == "skipped":
        reasons = sorted({r["message"] for r in result.results.values() if r["outcome"] == "skipped"})
        # reported at the test's location, as for a skip marker, not at this line of the plugin
        raise pytest.skip.Exception("; ".join(reasons), _use_item_location=True)
    if outcome == "xfailed":
        pytest.xfail(result.results[min(result.results)]["message"])


# a pool's start that timed out: its own deadlines' words, or a rank's process group (torch's
# rendezvous: "DistStoreError: Timed out after ...", "Socket Timeout")
_INIT_TIMEOUT = re.compile(r"within [0-9.]+s|timed out|socket timeout|timeout", re.IGNORECASE)


def init_timeout(text: str) -> str | None:
    """The line of a pool's start failure (:class:`~pytest_gpu.distributed.pool.PoolError`)
    that says its collective did not initialise in time; ``None``: it failed otherwise."""
    head, _, rest = text.partition("\n")
    if not head.startswith(("could not start", "could not set up")):
        return None
    for line in [head, *rest.splitlines()]:
        if _INIT_TIMEOUT.search(line):
            return f"{head.rstrip(':')}: {line.strip()}" if line is not head else head
    return None


def _judge(item: pytest.Function, spec: DistSpec, result: RankRun, pools: PoolManager) -> None:
    """What the pool's GPUs did while ``result`` ran: judged with this test, named as the pool's."""
    state = item.stash.get(STATE_KEY, None)
    if result.checked is None or state is None:
        return
    owner, verdict, span = result.checked
    if spec.isolated:  # its pool holds its lease: the test's own verdict, as in the test process
        verdict = with_torch_peaks(verdict, span, result.results.get(0, {}).get("torch_peaks"))
        if verdict.violations:  # what its process still holds would be charged to the next test
            pools.discard(spec)
        state.verdict.merge(verdict)
        state.leases.append(span)
        state.indices.update(span.gpus)
        state.waited += span.granted - span.asked  # its pool's first test waited for the lease
    else:
        state.judged(owner, verdict, [span], during=f" while it ran {item.nodeid}")


# -- contamination: a failure on a warm pool, run again alone (see .contamination) ------------------


def rerun_alone(
    item: pytest.Function,
    spec: DistSpec,
    body: dict[str, Any],
    timeout: float,
    pools: PoolManager,
    first: RankRun,
    run: GpuRun,
) -> RankRun | None:
    """Run a test that failed on a warm pool after other tests once more, alone on fresh ranks;
    the rerun's result (None: not wanted, or its pool could not be had: said in a section)."""
    if not contamination.wanted(item, spec, first, run.settings.dist_rerun_alone):
        return None
    from .pool import PoolError  # local: slow (the pool machinery): loaded by the first distributed test

    try:
        alone, notes = pools.execute(spec, body, timeout, alone=True)
    except (PoolError, BrokerError) as exc:
        item.add_report_section("call", contamination.RERUN_SECTION, f"could not run it alone on fresh ranks: {exc}")
        return None
    for note in notes:
        item.add_report_section("call", contamination.RERUN_SECTION, note)
    return alone


def told_apart(item: pytest.Function, spec: DistSpec, first: RankRun, alone: RankRun, pools: PoolManager) -> None:
    """Report a failure on a warm pool by its rerun alone: passed there, raise it as contamination
    naming the earlier test; failed there too, leave it as its own (with the rerun as a section)."""
    if alone.outcome == "failed":
        item.user_properties.append((contamination.RERUN_PROPERTY, "failed"))
        item.add_report_section("call", contamination.RERUN_SECTION, failure_text(spec, alone))
        return
    pools.discard(spec)  # contaminated: no later test runs there
    head, blamed = contamination.contaminated(item.nodeid, spec, first)
    item.user_properties.append((contamination.RERUN_PROPERTY, alone.outcome))
    item.user_properties.append((contamination.BLAMED_PROPERTY, " ".join(blamed)))
    item.add_report_section(
        "call", contamination.RERUN_SECTION, f"{alone.outcome} alone on fresh ranks (a new pool of {spec.describe()})"
    )
    text = f"{head}\n{failure_text(spec, first)}"
    raise DistributedFailure(text, failure_detail(spec, first), crash=head.splitlines()[0])


def failure_text(spec: DistSpec, result: RankRun) -> str:
    failed = {r: res for r, res in sorted(result.results.items()) if res["outcome"] == "failed"}
    count = len(failed) + (spec.world_size - len(result.results))
    lines = [f"distributed test failed on {count} of {plural(spec.world_size, 'rank')} ({spec.describe()})"]
    lines += [f"  {problem}" for problem in result.problems]
    for rank, res in failed.items():
        lines.append(f"{'=' * 30} rank {rank} {'=' * 30}")
        lines.append(res["longrepr"] or res["message"])
    return "\n".join(lines)


def with_torch_peaks(verdict: Verdict, span: LeaseSpan, peaks: list[int] | None) -> Verdict:
    """An isolated test's verdict with torch's own peaks (by ordinal: the lease's order) where
    its verifier had none (NVML: what was left at the end), as the test process's verifier
    reads torch's where torch allocated; a peak over the budget is a violation."""
    if verdict.measured or not peaks or len(peaks) != len(span.gpus):
        return verdict
    for index, peak in zip(span.gpus, peaks, strict=True):
        verdict.peak[index] = max(verdict.peak.get(index, 0), peak)
        if peak > span.memory:
            verdict.violations.append(
                f"peak {format_size(peak)} on GPU {index} is above its budget of {format_size(span.memory)}"
            )
    verdict.measured = True
    return verdict


def isolated_failure(result: RankRun) -> tuple[str, str]:
    """An isolated test's failure as a test's own: ``(its body's traceback, the crash line)``;
    what happened to its process (a timeout, a crash) first, where anything did."""
    own = result.results.get(0)
    body = "" if own is None or own["outcome"] != "failed" else own["longrepr"] or own["message"]
    text = "\n".join([*(f"pytest-gpu: {problem}" for problem in result.problems), body]).strip()
    crash = own["message"] if own is not None and own["outcome"] == "failed" else ""
    return text, crash or (result.problems[0] if result.problems else (text.splitlines() or ["failed"])[0])


def failure_detail(spec: DistSpec, result: RankRun) -> str:
    """The sections about ranks that did not pass (stacks, stderr tails), as text for junit readers."""
    passed = {r for r, res in result.results.items() if res["outcome"] != "failed"}
    failing = [r for r in range(spec.world_size) if r not in passed]
    return _sections_text(result.sections, failing)


def _sections_text(sections: list[tuple[str, str]], ranks: list[int] | None) -> str:
    """Every ``rank N stack`` section, then a short tail of each ``rank N stderr`` / ``log tail``.

    ``ranks``: only those ranks (None: all).
    """
    by_name = dict(sections)
    parts = []
    for kind in ("stack", "stderr", "log tail"):
        for name, content in sections:
            head, _, rest = name.partition(" ")
            number, _, what = rest.partition(" ")
            if head != "rank" or what != kind or not number.isdigit():
                continue
            if ranks is not None and int(number) not in ranks:
                continue
            if kind == "log tail" and f"rank {number} stderr" in by_name:
                continue  # the test's own stderr says it better than the log's last lines
            text = content.rstrip("\n")
            if kind != "stack":
                lines = text.splitlines()
                text = "\n".join(lines[-STDERR_TAIL_LINES:])
                cut = len(lines) > STDERR_TAIL_LINES
                title = f"rank {number} stderr" + (f" (last {STDERR_TAIL_LINES} lines)" if cut else "")
            else:
                title = f"rank {number} stack"
            parts.append(f"{'-' * 20} {title} {'-' * 20}\n{text}")
    return "\n".join(parts)


def make_report(item: pytest.Item, call: pytest.CallInfo[None], report: pytest.TestReport) -> None:
    """Fail a distributed test with the text of every failing rank.

    The ranks' stacks and stderr tails go into the failure's full text (``str(longrepr)``:
    junit's ``<failure>`` body), not its terminal text (the sections show them there). An
    xdist worker can only send the full text to the controller, whose terminal shows it:
    there the stack sections are dropped from the report instead of shown twice.
    """
    if call.when != "call" or call.excinfo is None or hasattr(report, "wasxfail"):
        return
    if call.excinfo.errisinstance(DistributedFailure):
        exc = call.excinfo.value
        assert isinstance(exc, DistributedFailure)
        summary = str(exc)
        if exc.isolated:
            report.longrepr = _own_failure(item, exc)
            return
        crash = privates.file_location(
            str(item.path), (item.location[1] or 0) + 1, exc.crash or summary.splitlines()[0]
        )
        report.longrepr = FailureRepr(summary, exc.detail, crash)  # type: ignore[assignment]
    elif ABANDONED_KEY in item.stash and report.longrepr is not None:
        detail = _sections_text(item.stash[ABANDONED_KEY], None)
        where = item.stash.get(INTERRUPTED_KEY, "")
        if where and not call.excinfo.errisinstance(Exception):
            # pytest-timeout's signal (pytest's Failed, a BaseException) raised where this process
            # waited for the pool: one line for where the pool was, then the ranks' stacks (the
            # report's sections; the full text's detail), instead of the plugin's frames
            line = interrupted_line(call.excinfo.value, where)
            crash = privates.file_location(str(item.path), (item.location[1] or 0) + 1, line)
            report.longrepr = FailureRepr(line, detail, crash)  # type: ignore[assignment]
        elif detail:
            report.longrepr = FailureRepr(report.longrepr, detail)  # type: ignore[assignment]
    else:
        return
    if hasattr(item.config, "workerinput") and isinstance(report.longrepr, FailureRepr) and report.longrepr.detail:
        report.sections = [(t, c) for t, c in report.sections if not _is_stack_section(t)]


def interrupted_line(exc: BaseException, where: str) -> str:
    """One line: what ended the test (pytest-timeout's message), and where its pool was then."""
    message = str(exc).strip() or type(exc).__name__
    what = "timed out" if "timeout" in message.lower() else "was interrupted"
    return f"pytest-gpu: {what} while {where} ({message})"


def _own_failure(item: pytest.Item, exc: DistributedFailure) -> Any:
    """An isolated test's failure as pytest reports a test's own: its body's traceback (as its
    process formatted it), and the exception's line in the short summary, also from an xdist
    worker (a representation pytest serialises whole, with its crash line)."""
    text = f"{exc}\n\n{exc.detail}" if exc.detail else str(exc)
    crash = privates.file_location(str(item.path), (item.location[1] or 0) + 1, exc.crash or text.splitlines()[0])
    return privates.text_failure(text.splitlines(), crash)


def _is_stack_section(title: str) -> bool:
    # "Captured rank 3 stack call"
    words = title.split()
    return len(words) == 5 and words[1] == "rank" and words[3] == "stack"


def rank_fixture() -> RankPlaceholder:
    return RankPlaceholder()


# -- the pools of this process ------------------------------------------------------------------


class PoolManager:
    """The pools of one pytest process: at most one warm pool at a time.

    It reuses its warm pool when a test's spec has the pool's key (and the pool's process
    group outlasts the test's timeout), and otherwise replaces it. A pool found dead is
    replaced and the test retried once; a pool left broken by a test, or by an interruption,
    is killed; an idle one is closed after ``--dist-pool-idle`` seconds.
    """

    def __init__(self, run: GpuRun, settings: DistSettings, config_args: list[str], base: Path) -> None:
        self.run = run
        self.settings = settings
        self.config_args = config_args
        self.base = base
        self.pool: RankPool | None = None
        self.started = 0
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._running: RankPool | None = None  # the pool a test is running on, while it runs
        self._starting: RankPool | None = None  # the pool being started, while it starts
        self.abandoned: list[tuple[str, str]] = []  # the sections of the last interrupted test
        self.interrupted = ""  # where its pool was then (RankPool.interrupted)
        self.ahead: AheadStart | None = None  # a pool started before its first test (warm_ahead)
        self._ahead_lock = threading.Lock()
        self._adopted: AheadStart | None = None  # the one the current test found, for its report

    def close_idle(self) -> bool:
        """Close the warm pool if it is idle and holds GPUs: a request of this process waits,
        and it may wait for what the pool holds (pools hold exclusive leases by default).
        Whether one was closed."""
        if self._drop_ahead(holding_only=True, wait=False):
            return True  # a pool started ahead that holds GPUs is idle until its test comes
        if not self._lock.acquire(blocking=False):
            return False  # a test runs on it (or one is starting it): not idle
        try:
            if self.pool is None or self.pool.holding is None:
                return False
            self._drop()
            return True
        finally:
            self._lock.release()

    def _fresh(self, spec: DistSpec, timeout: float, test: str = "") -> RankPool:
        from . import pool as module  # local: slow; RankPool looked up at each start (a test substitutes its own)

        fresh = module.RankPool(spec, self.run, self.settings, self.base, timeout, test)
        self._starting = fresh
        fresh.start(self.config_args)
        self._starting = None
        self.started += 1
        return fresh

    def execute(
        self, spec: DistSpec, body: dict[str, Any], timeout: float, alone: bool = False
    ) -> tuple[RankRun, list[str]]:
        """Run a test on a pool for ``spec``; returns the run and notes for the report.
        ``alone``: on fresh ranks of its own (:meth:`_execute_alone`).

        Anything that ends this early (pytest-timeout's signal, KeyboardInterrupt, an error)
        kills the pool in use, so that the next test gets a fresh one; what the interrupted
        ranks had written (their stacks first) is then in ``abandoned``, and where the pool
        was (starting, running the body) in ``interrupted``.
        """
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self.abandoned, self.interrupted = [], ""
            try:
                return (self._execute_alone if alone else self._execute)(spec, body, timeout)
            except BaseException:
                running, self._running = self._running, None
                starting, self._starting = self._starting, None
                stopped = running or starting
                try:
                    if stopped is not None:
                        self.abandoned, self.interrupted = stopped.abandoned, stopped.interrupted
                        stopped.close(graceful=False)
                finally:
                    if self.pool is not None:
                        self.pool.close(graceful=False)
                        self.pool = None
                raise

    def _run(self, pool: RankPool, body: dict[str, Any], timeout: float) -> RankRun:
        self._running = pool
        before, previous = pool.tests_run, pool.last_test
        result = pool.run_test(body, timeout)
        self._running = None
        result.ran_before, result.previous = before, previous  # contamination: who ran there before it
        pool.last_test = str(body.get("nodeid", ""))
        return result

    def _execute_alone(self, spec: DistSpec, body: dict[str, Any], timeout: float) -> tuple[RankRun, list[str]]:
        """Run a test once on fresh ranks of its own, then shut them down (contamination's rerun).

        A warm pool that holds GPUs is closed first: its lease (whole GPUs by default) may be
        what the fresh pool needs. One without stays for the next test unless the rerun shows
        it contaminated (the runner then discards it).
        """
        if self.pool is not None and self.pool.holding is not None:
            self._drop()
        pool: RankPool | None = None
        result = None
        try:
            pool = self._fresh(spec, timeout, str(body.get("nodeid", "")))
            result = self._run(pool, body, timeout)
            return result, []
        finally:
            if pool is not None:
                pool.close(graceful=result is not None and not result.broken)
            if self.pool is not None:  # idle again: closed after --dist-pool-idle, as after any test
                self._timer = threading.Timer(self.settings.idle, self._idle_close)
                self._timer.daemon = True
                self._timer.start()

    def _execute(self, spec: DistSpec, body: dict[str, Any], timeout: float) -> tuple[RankRun, list[str]]:
        from .pool import PoolDied  # local: slow (the pool machinery): loaded by the first distributed test

        notes: list[str] = []
        test = str(body.get("nodeid", ""))  # a pool started for this test is named after it
        if not self.settings.pool:
            pool = self._fresh(spec, timeout, test)
            result = None
            try:
                result = self._run(pool, body, timeout)
                return result, notes
            finally:
                pool.close(graceful=result is not None and not result.broken)
        # a test longer than the pool's process group allows needs a new group (and pool)
        if self.pool is not None and (self.pool.spec.pool_key != spec.pool_key or self.pool.covers < timeout):
            self.pool.close()
            self.pool = None
        if self.pool is not None and not self.pool.alive():
            notes.append(self.pool._death_note() + "; this test ran in a fresh pool")
            self.pool.close()
            self.pool = None
        if self.pool is None:
            self.pool = self._take_ahead(spec, timeout) or self._fresh(spec, timeout, test)
        try:
            result = self._run(self.pool, body, timeout)
        except PoolDied as exc:
            notes.append(f"{exc}; this test was retried once in a fresh pool")
            self.pool.close()
            self.pool = None
            self.pool = self._fresh(spec, timeout, test)
            result = self._run(self.pool, body, timeout)
        if result.broken:
            self.pool.close(graceful=False)
            self.pool = None
        else:
            self._timer = threading.Timer(self.settings.idle, self._idle_close)
            self._timer.daemon = True
            self._timer.start()
        return result, notes

    def _idle_close(self) -> None:
        with self._lock:
            if self.pool is not None and time.monotonic() - self.pool.last_used >= self.settings.idle - 0.01:
                self.pool.close()
                self.pool = None

    def discard(self, spec: DistSpec) -> None:
        """Close the warm pool of ``spec`` now: the test it ran broke its lease (memory it
        still holds would be charged to the next test, which gets a fresh pool)."""
        with self._lock:
            if self.pool is not None and self.pool.spec == spec:
                self._drop()

    def close(self) -> None:
        with self._lock:
            self._drop()
        self._drop_ahead(wait=True)

    def _drop(self) -> None:
        """Close the warm pool, if any, and its idle timer (the caller holds the lock)."""
        if self._timer is not None:
            self._timer.cancel()
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    # -- pools started ahead (warm_ahead) -------------------------------------------------

    def warm(self, spec: DistSpec, timeout: float, test: str) -> str | None:
        """Start the pool of ``spec`` in the background, for ``test``, this process's next test
        of it; why not (``None``: started, or already warm or starting)."""
        pool = self.pool
        if pool is not None and pool.spec.pool_key == spec.pool_key and pool.covers >= timeout:
            return "its pool is warm"
        ahead = self.ahead
        if ahead is not None and ahead.serves(spec, timeout):
            return "its pool is starting"
        self._drop_ahead(wait=True)  # started for a test that never came to it (skipped, say)
        with self._ahead_lock:
            request = spec.gpu_request(self.run.settings.default_memory)
            waiting = bool(self.run.client.status()["waiting"]) if request is not None else False
            budget = self.run.settings.dist_pool_ahead
            why = ahead_refusal(spec, budget, holds_gpus=request is not None, waiting=waiting)
            if why is not None:
                return why
            from . import pool as module  # local: slow (the pool machinery); RankPool looked up as _fresh does

            fresh = module.RankPool(spec, self.run, self.settings, self.base, timeout, test)
            self.ahead = AheadStart(fresh)
            self.ahead.begin(self.config_args)  # once it is self.ahead: its lease's wait is refused
            return None

    def ahead_never_waits(self) -> bool:
        """The lease of a pool started ahead is taken only if the broker grants it at once:
        one that would wait (for GPUs another test holds or waits for) is withdrawn, and the
        pool starts when its test does. Called (first) wherever a request of this process
        must wait; in any other thread than a start's ahead, it gives nothing up."""
        ahead = self.ahead
        if ahead is not None and threading.current_thread() is ahead.thread:
            raise WouldWait("its lease would wait")
        return False

    def _take_ahead(self, spec: DistSpec, timeout: float) -> RankPool | None:
        """The pool started ahead for ``spec``, once its start (already under way) is over;
        ``None``: none was, it was not started for want of a lease at once, or its ranks are
        gone (the test starts its own). A start that failed otherwise is the test's failure, as
        if it had started the pool itself: started again silently, a rendezvous that timed out
        would be a failure nobody hears of (and no infrastructure failure to tell apart)."""
        with self._ahead_lock:
            ahead = self.ahead
            if ahead is None or not ahead.serves(spec, timeout):
                return None
            self.ahead = None
        asked = time.monotonic()
        self._starting = ahead.pool  # interrupted while it waits for the start: the pool is killed
        with ahead.pool.joined():
            ahead.thread.join()
        self._starting = None
        if ahead.error is not None or not ahead.pool.alive():
            self._close_ahead(ahead, wait=True)
            if ahead.error is not None and not isinstance(ahead.error, (WouldWait, BrokerError)):
                raise ahead.error
            return None
        ahead.waited = max(0.0, ahead.ready - asked)
        self._adopted = ahead
        self.started += 1
        return ahead.pool

    def ahead_properties(self) -> list[tuple[str, object]]:
        """The current test's report properties when it found its pool started ahead: the
        seconds of start-up it did not wait for, and those it did."""
        adopted, self._adopted = self._adopted, None
        if adopted is None:
            return []
        hidden = max(0.0, adopted.seconds - adopted.waited)
        return [(AHEAD_PROPERTY, round(hidden, 6)), (AHEAD_WAITED_PROPERTY, round(adopted.waited, 6))]

    def _drop_ahead(self, *, wait: bool, holding_only: bool = False) -> bool:
        """Close the pool started ahead (``holding_only``: only if it holds GPUs); whether one was."""
        with self._ahead_lock:
            ahead = self.ahead
            if ahead is None or (holding_only and ahead.pool.holding is None):
                return False
            self.ahead = None
        self._close_ahead(ahead, wait=wait)
        return True

    @staticmethod
    def _close_ahead(ahead: AheadStart, *, wait: bool) -> None:
        """Kill a pool started ahead, also in the middle of its start (its thread then finds its
        processes gone and ends, giving back what it took since: :meth:`AheadStart._start`).
        ``wait``: for that thread (not where this thread holds the broker's connection, which
        that one may need: a request of this process waiting, :meth:`close_idle`)."""
        ahead.pool.close(graceful=ahead.done.is_set() and ahead.error is None)
        if wait:
            ahead.thread.join(timeout=30)


#: a distributed test's report properties when its pool was started ahead (see warm_ahead)
AHEAD_PROPERTY = "dist_pool_ahead_hidden_seconds"
AHEAD_WAITED_PROPERTY = "dist_pool_ahead_waited_seconds"


class WouldWait(Exception):
    """A pool started ahead would have waited for its lease: it is not started."""


class AheadStart:
    """A pool's start under way in a thread of its own, before its first test asks for it."""

    def __init__(self, pool: RankPool) -> None:
        self.pool = pool
        self.began = 0.0  # when its start began (monotonic)
        self.ready = 0.0  # when it ended
        self.waited = 0.0  # how long the test that took it waited for the rest of the start
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._start, name=f"pytest-gpu-pool-ahead {pool.id}", daemon=True)
        self._args: list[str] = []

    def begin(self, config_args: list[str]) -> None:
        self._args = config_args
        self.began = time.monotonic()
        self.thread.start()

    @property
    def seconds(self) -> float:
        """How long its start took."""
        return self.ready - self.began

    def serves(self, spec: DistSpec, timeout: float) -> bool:
        return self.pool.spec.pool_key == spec.pool_key and self.pool.covers >= timeout

    def _start(self) -> None:
        try:
            self.pool.start(self._args)
        except BaseException as exc:  # a thread's: the test that wanted it starts its own
            self.error = exc
        finally:
            try:
                self.pool.give_back_late()  # closed by another thread while it started
            finally:
                self.ready = time.monotonic()
                self.done.set()


def ahead_refusal(spec: DistSpec, budget: int, *, holds_gpus: bool, waiting: bool) -> str | None:
    """Why the pool of ``spec`` is not started ahead (pure); ``None``: it may be. ``budget``:
    rank processes a process may start ahead (``--dist-pool-ahead``); ``holds_gpus``: its
    pool leases GPUs; ``waiting``: a request of the run waits at the broker (the GPUs it
    waits for are no pool's to take first)."""
    if spec.world_size > budget:
        return f"its {plural(spec.world_size, 'rank')} exceed --dist-pool-ahead={budget}"
    if holds_gpus and waiting:
        return "tests wait for GPUs"
    return None


def warm_ahead(item: pytest.Item, run: GpuRun, current: pytest.Item | None = None) -> str | None:
    """Start the pool of ``item``, a test this process runs soon (after ``current``), before
    it runs; why not (``None``: started, or already warm or starting). Nothing for a test on
    no pool, one that runs on ``current``'s pool, or with ``--dist-pool=off``."""
    spec = needs(item).dist
    if spec is None or not run.settings.dist_pool or not run.settings.dist_pool_ahead:
        return "no pool to start"
    if current is not None and (mine := needs(current).dist) is not None and mine.pool_key == spec.pool_key:
        return "it runs on the pool of the test before it"
    if item.get_closest_marker("skip") is not None or never_runs(item, run) is not None:
        return "it does not run"
    return manager(item.config, run).warm(spec, spec.timeout or run.settings.dist_timeout, item.nodeid)
