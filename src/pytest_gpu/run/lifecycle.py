"""A test's life with a lease: read its marker, acquire before fixtures, verify after teardown.

:class:`Leases` is the feature's hook object, in every process that runs tests; other
features hand it what it must also check (see its docstring).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, suppress
from dataclasses import replace
from types import TracebackType
from typing import TYPE_CHECKING, Any

import pytest

from ..base import privates
from ..base.requests import (
    GpuRequest,
    GpuRequestError,
    build_host_request,
    build_request,
    learned,
    split_isolate,
    with_host,
)
from ..base.spans import GpuProperties, format_held, format_peaks, format_spans
from ..gpu import verification
from ..gpu.runtime import LeaseUnreachable
from ..leasing.client import BrokerError
from ..machine.ports import PortOwner
from . import fixture_leases
from .conventions import convention_request, item_kwargs
from .feature import Feature
from .holding import STATE_KEY, Holding, Owner, TestState, broke, hold
from .keys import SCHEDULE_KEY
from .record import RUN_KEY as RUN_KEY  # re-exported: where conftests have long found it
from .record import SKIP_PROPERTY, effective, needs, record, skip_at_run_time, skip_why
from .session import GpuRun
from .transient import chain

if TYPE_CHECKING:
    from ..gpu.isolation import GpuLease

# where a test's memory came from (see _sized), in its reports' user property SOURCE_PROPERTY
SOURCE_PROPERTY = "gpu_request_source"
SOURCE_MARKER, SOURCE_FILE, SOURCE_LEARNED, SOURCE_DEFAULT = "marker", "file", "learned", "default"
GPU_FIXTURE_FORM = 'gpu_request(count=1, memory="8GiB", exclusive=False)'
HOST_MARKER = "host_resources"  # CPUs and RAM, with or without GPUs: see pytest_gpu.leasing.host
SERIAL_MARKER = "gpu_serial"  # the test runs alone: see alone_request and the scheduler's rule 0

# what other features give the lease feature (see Leases)
CollectionCheck = Callable[[pytest.Item, GpuRun], None]  # raises GpuRequestError naming the test
NeverRuns = Callable[[pytest.Item, GpuRun], tuple[str, str] | None]  # (reason, in a few words); None: it can
BeforeRelease = Callable[[pytest.Item, GpuRun, TestState | None], None]
Elsewhere = Callable[[GpuRun], Mapping[str, GpuRun] | None]


class Leases(Feature):
    """A test's leases, in a process that runs tests: its request read and checked at
    collection, a test this run can never run skipped, its lease acquired before its fixtures
    and verified and given back after their teardown, fixtures' leases (``gpu_lease_factory``)
    and the verdict in the teardown report.

    Other features give it ``checks`` (their markers, validated at collection with the
    request: the distributed marker), ``never`` (their own reasons a test can never run here,
    asked before its request's: a rank pool's), ``before_release`` (steps after a test's
    fixtures are torn down, before anything is given back: the quarantine's probe) and
    ``elsewhere`` (``--gpu-nodes``: every node's run, for the oversize check)."""

    def __init__(
        self,
        config: pytest.Config,
        *,
        checks: Sequence[CollectionCheck] = (),
        never: Sequence[NeverRuns] = (),
        before_release: Sequence[BeforeRelease] = (),
        elsewhere: Elsewhere | None = None,
    ) -> None:
        super().__init__(config)
        self.checks = tuple(checks)
        self.never = tuple(never)
        self.before_release = tuple(before_release)
        self.elsewhere = elsewhere

    def never_runs(self, item: pytest.Item, run: GpuRun) -> tuple[str, str] | None:
        """Why ``run`` can never run ``item``, and that in a few words; ``None``: it can
        (the other features' reasons first, then its request's: :func:`never_runs`)."""
        for check in self.never:
            found = check(item, run)
            if found is not None:
                return found
        return never_runs(item, run)

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(
        self, collector: pytest.Collector
    ) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
        report = yield
        collect_report(report, self.run, self.checks)
        return report

    @pytest.hookimpl(trylast=True)  # after pytest's -m/-k and the launcher markers: only the tests they kept
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        run = self.run
        mark_oversize(items, run, self.elsewhere(run) if self.elsewhere is not None else None, self.never_runs)

    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        # plain (not tryfirst): after the skip/skipif/xfail checks, before fixtures are set up
        setup(item, self.run)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Generator[None, None, None]:
        __tracebackhide__ = True  # a fixture's teardown error passes through here: its traceback is the fixture's
        fixture_leases.leave(item)  # fixtures torn down from here on are released once this test is verified
        release_failure(item)  # a failed call's frames no longer hold the test's memory
        try:
            return (yield)
        finally:
            teardown(item, self.run, self.before_release)

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef: Any, request: pytest.FixtureRequest) -> Generator[None, Any, Any]:
        __tracebackhide__ = True  # a fixture's error passes through here: its traceback starts in the fixture
        with fixture_leases.setting_up(fixturedef, request):  # gpu_lease_factory/ports_factory calls are its
            if fixturedef.scope == "function":
                return (yield)
            # processes a longer-lived fixture starts are its own, not the test's it was set up for
            with verification.claiming(f"fixture {fixturedef.argname}"):
                return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
        make_report(item, report, self.run, call.excinfo.value if call.excinfo is not None else None)
        return report


def item_needs(item: pytest.Item, run: GpuRun) -> tuple[GpuRequest | None, bool]:
    """``(request, isolated)``: the test's request, and whether it asked for ``isolate=True``
    (its body then runs in a process of its own that sees exactly the lease: see
    :func:`pytest_gpu.distributed.runner.isolated_item_spec`).

    The request comes from the first of: its closest ``gpu`` marker, the
    ``pytest_gpu_item_request`` hook, the ``gpu_marker_map`` ini key, the default request
    for a ``gpu`` fixture user (see :mod:`pytest_gpu.run.conventions`); with the CPUs and RAM of
    its closest ``host_resources`` marker added (a test with only that one asks for no GPU).
    Memory none of them names comes from the written requests, else ``--gpu-learn`` (:func:`_sized`).

    A ``gpu_serial`` test asks for every GPU of the run, exclusively (:func:`alone_request`).

    Raises :class:`GpuRequestError` naming the test and the expected form.
    """
    request, isolate = _gpu_request(item, run)
    host = item.get_closest_marker(HOST_MARKER)
    if host is None:
        return request, isolate
    try:
        return with_host(request, build_host_request(host.args, host.kwargs), f"{HOST_MARKER} marker"), isolate
    except GpuRequestError as exc:
        raise GpuRequestError(f"{item.nodeid}: {exc}") from None


def _gpu_request(item: pytest.Item, run: GpuRun) -> tuple[GpuRequest | None, bool]:
    if item.get_closest_marker(SERIAL_MARKER) is not None:
        return alone_request(item, run), False
    marker = item.get_closest_marker("gpu")
    what = "gpu marker"
    try:
        if marker is not None:
            kwargs, isolate = split_isolate(marker.kwargs, what)
            request = build_request(marker.args, kwargs, run.settings.default_memory)
            named = "memory" in kwargs or "exclusive" in kwargs
        elif (convention := item_kwargs(item, run.settings.default_memory)) is not None:
            given, what, form = convention
            kwargs, isolate = split_isolate(given, what, form)
            request = convention_request(kwargs, run.settings.default_memory, what=what, form=form)
            named = "memory" in kwargs or "exclusive" in kwargs
        elif "gpu" in getattr(item, "fixturenames", ()):
            request = build_request((), {}, run.settings.default_memory, what="gpu fixture")
            named, isolate = False, False
        else:
            return None, False
        if isolate and not request.count:
            raise GpuRequestError(f"{what}: isolate=True runs the body on the test's GPUs, but it asks for none")
    except GpuRequestError as exc:
        raise GpuRequestError(f"{item.nodeid}: {exc}") from None
    usable = run.usable_memory
    if run.largest_node is not None and run.largest_node[1] > usable:  # --gpu-nodes: another node's GPUs give more
        usable = run.largest_node[1]
    request = _sized(item, run, request, named, usable)
    # memory= larger than any GPU gives is no invalid request, only one this run can never give:
    # mark_oversize skips it with the reason (or --gpu-oversize=fail fails it), as a count too large
    return request, isolate


def _sized(item: pytest.Item, run: GpuRun, request: GpuRequest, named: bool, usable: int) -> GpuRequest:
    """The memory of a request for GPUs, by precedence: the memory (or ``exclusive``) its
    marker or convention names, else its line in the written requests (``--gpu-requests``),
    else the peak ``--gpu-learn`` recorded, else the default; which one is kept in its record
    (:attr:`TestNeeds.source`) for the summary's count."""
    if not request.count:
        return request
    entry = run.written.entries.get(item.nodeid) if run.written is not None else None
    peak = run.learned_peaks.get(item.nodeid)
    if named:
        source = SOURCE_MARKER
    elif entry is not None:
        # as measured: never cut to the GPU (a request larger than any is skipped, or failed, saying so)
        source, request = SOURCE_FILE, replace(request, memory=entry.request, exclusive=False, min_memory=None)
    elif run.settings.learn and peak is not None and usable > 0:
        source, request = SOURCE_LEARNED, learned(request, peak, usable)
    else:
        source = SOURCE_DEFAULT
    record(item).source = source
    return request


def alone_request(item: pytest.Item, run: GpuRun) -> GpuRequest | None:
    """A ``gpu_serial`` test's request: every GPU of the run, exclusively, so that no other
    run's test shares them either (``None`` without GPUs: the test is still alone in the run).

    Raises :class:`GpuRequestError` for what cannot be combined with it: arguments, a ``gpu``
    or ``distributed`` marker, leases of its own besides (a ``gpu_request`` section, a fixture
    calling ``gpu_lease_factory``: they would wait for the GPUs the test itself holds)."""
    form = f"@pytest.mark.{SERIAL_MARKER} (no arguments)"
    for mark in item.iter_markers(SERIAL_MARKER):
        if mark.args or mark.kwargs:
            given = ", ".join([*map(repr, mark.args), *(f"{k}={v!r}" for k, v in mark.kwargs.items())])
            raise GpuRequestError(f"{item.nodeid}: {SERIAL_MARKER} takes no arguments, got ({given}); expected {form}")
    holds = f"a {SERIAL_MARKER} test holds every GPU of the run exclusively"
    if item.get_closest_marker("gpu") is not None:
        raise GpuRequestError(
            f"{item.nodeid}: both {SERIAL_MARKER} and a gpu marker: {holds} (its gpu fixture is that "
            "lease); remove the gpu marker (from the test, or its class or module)"
        )
    if item.get_closest_marker("distributed") is not None:
        raise GpuRequestError(
            f"{item.nodeid}: both {SERIAL_MARKER} and a distributed marker: a distributed test's rank "
            f"pool leases GPUs of its own, which {holds} would keep from it; remove one of the two"
        )
    info = privates.fixture_info(item)
    leasing = ["gpu_request"] if "gpu_request" in getattr(item, "fixturenames", ()) else []
    if info is not None:
        for name in info.names_closure:
            if any(fixture_leases.FACTORY in fd.argnames for fd in effective(info.name2fixturedefs.get(name), name)):
                leasing.append(name)
    if leasing:
        raise GpuRequestError(
            f"{item.nodeid}: {SERIAL_MARKER} with a lease of its own besides ({', '.join(leasing)}): "
            f"{holds}, so that lease would wait for the test itself; use the test's gpu fixture instead "
            "(its lease: every GPU)"
        )
    if not run.inventory.devices:
        return None
    return GpuRequest(count=len(run.inventory.devices), exclusive=True)


def collect_report(
    report: pytest.CollectReport, run: GpuRun, checks: Sequence[Callable[[pytest.Item, GpuRun], None]] = ()
) -> None:
    """Validate the markers of freshly collected items; a bad one fails the collector."""
    if not report.passed:
        return
    problems = []
    for node in report.result:
        if not isinstance(node, pytest.Item):
            continue
        try:
            needs_ = record(node)
            needs_.request, needs_.isolated = item_needs(node, run)
            needs_.serial = node.get_closest_marker(SERIAL_MARKER) is not None
            for check in checks:
                check(node, run)
        except GpuRequestError as exc:
            problems.append(str(exc))
    if problems:
        report.outcome = "failed"
        report.longrepr = "pytest-gpu: invalid GPU request\n" + "\n".join(problems)
        report.result = []


def mark_oversize(
    items: list[pytest.Item],
    run: GpuRun,
    elsewhere: Mapping[str, GpuRun] | None = None,
    never: NeverRuns | None = None,
) -> None:
    """Skip (or flag to fail) tests this run can never run (``never``, :meth:`Leases.never_runs`:
    a request larger than its GPUs or machine, a distributed test whose rank pool cannot be
    placed on them or whose ``backend="nccl"`` cannot run here; default: :func:`never_runs`).

    ``elsewhere`` (``--gpu-nodes``: node -> that node's run, this worker's node included): a test
    one of them can run is left alone (the scheduler keeps it off the nodes it cannot fit); one
    none can run is skipped with the largest node's reason, naming that node."""
    never = never or never_runs
    for item in items:
        found = never(item, run)
        if found is None:
            continue
        if elsewhere:
            if any(never(item, other) is None for other in elsewhere.values()):
                continue
            name, largest = max(
                elsewhere.items(), key=lambda kv: (kv[1].usable_memory, len(kv[1].inventory.devices), kv[0])
            )
            reason, _ = never(item, largest) or found
            found = (
                f"fits no node of the run, not even the largest: {reason}",  # the reason names the node
                f"larger than the largest node's (node {name}: {largest.inventory.describe()})",
            )
        reason, why = found
        if run.settings.oversize == "skip":
            item.add_marker(pytest.mark.skip(reason=f"pytest-gpu: {reason}"))
            item.user_properties.append((SKIP_PROPERTY, why))
        else:
            record(item).oversize = reason


def never_runs(item: pytest.Item, run: GpuRun) -> tuple[str, str] | None:
    """Why this run can never run ``item``'s request, and that in a few words for the summary;
    ``None``: it can (or the test asks for nothing). A distributed test's pool is the
    distributed feature's to check (:meth:`Leases.never_runs` asks it first)."""
    request = needs(item).request
    if request is None:
        return None
    reason = run.never_fits(request)
    return None if reason is None else (reason, skip_why(request, run))


def setup(item: pytest.Item, run: GpuRun) -> None:
    """Before fixtures: acquire the test's lease and confine the process to it."""
    state = TestState()
    item.stash[STATE_KEY] = state
    fixture_leases.begin(item)
    reason = needs(item).oversize
    if reason is not None:
        pytest.fail(f"pytest-gpu: {reason} (--gpu-oversize=fail)", pytrace=False)
    alone = _cannot_run_alone(item, run)
    if alone is not None:
        pytest.fail(alone, pytrace=False)
    request = needs(item).request
    if needs(item).source is not None:  # for the summary's count of where requests came from
        item.user_properties.append((SOURCE_PROPERTY, needs(item).source))
    if request is not None and needs(item).isolated:
        state.request = request  # held by its one-rank pool, for its body's process (distributed.runner)
    elif request is not None:
        state.request = request
        state.main = _hold(run, request, item)
        state.waited += state.main.lease.waited
        state.indices.update(state.main.lease.indices)
    fixture_leases.apply_view(item, run)  # wider-scoped fixtures it uses that hold leases already


def _cannot_run_alone(item: pytest.Item, run: GpuRun) -> str | None:
    """Why this ``gpu_serial`` test cannot run alone: an xdist worker among several, where
    xdist's own scheduling hands out the tests (``--dist``, ``--gpu-schedule=off``)."""
    if not needs(item).serial:
        return None
    workerinput = getattr(item.config, "workerinput", None)
    if workerinput is None or workerinput.get(SCHEDULE_KEY):
        return None  # one process, or pytest-gpu's scheduler: it runs alone
    if int(workerinput.get("workercount", 2)) < 2:
        return None  # one worker
    chosen = _dist_chosen(workerinput.get("mainargv", ())) if run.settings.schedule else "--gpu-schedule=off"
    return (
        f"pytest-gpu: {item.nodeid} is marked {SERIAL_MARKER}, but under {chosen} xdist hands out the tests "
        f"and other tests would run beside it; drop {chosen} (pytest-gpu's scheduler then runs it alone), "
        f"or give these tests a pass of their own: -m {SERIAL_MARKER} without -n, and -m 'not {SERIAL_MARKER}' "
        f"with {chosen}"
    )


def _dist_chosen(argv: Sequence[str]) -> str:
    """``--dist MODE`` as the controller's command line gave it (a worker's own ``dist`` is "no")."""
    for n, arg in enumerate(argv):
        if arg.startswith("--dist="):
            return f"--dist {arg.partition('=')[2]}"
        if arg == "--dist" and n + 1 < len(argv):
            return f"--dist {argv[n + 1]}"
    return "--dist"  # from addopts, say


def _hold(run: GpuRun, request: GpuRequest, item: pytest.Item) -> Holding:
    try:
        return hold(run, Owner("test", item.nodeid, item.nodeid), request)
    except BrokerError as exc:
        message = f"pytest-gpu: {item.nodeid} could not get {request.describe()}: {exc}"
    except LeaseUnreachable as exc:
        message = f"pytest-gpu: {item.nodeid} was given {request.describe()}, but {exc}"
    pytest.fail(message, pytrace=False)


def release_failure(item: pytest.Item) -> None:
    """Teardown starts: clear the locals of the frames of the setup's or call's exception, which
    pytest keeps (``sys.last_traceback``, a cycle through ``CallInfo.from_call``'s frame) past
    the verdict, so a tensor in them is no "leak"; the report and any ``--pdb`` session are done
    (``unittest`` clears frames likewise). A CPU test's failure stays as pytest keeps it."""
    state = item.stash.get(STATE_KEY, None)
    if state is None:
        return
    pending, state.failures, seen = state.failures, [], set[int]()
    if not (state.indices or state.fixture_gpus):  # no lease of its own or a fixture's
        return
    while pending:  # the exception, its cause and context, an exception group's members
        exc = pending.pop()
        if id(exc) not in seen:
            seen.add(id(exc))
            _clear_frames(exc.__traceback__)
            group = exc.exceptions if isinstance(getattr(exc, "exceptions", None), tuple) else ()  # type: ignore[attr-defined]
            pending += [e for e in (exc.__cause__, exc.__context__, *group) if isinstance(e, BaseException)]


def _clear_frames(tb: TracebackType | None) -> None:
    # traceback.clear_frames, and the f_locals snapshot (-l, debuggers) frame.clear() leaves before 3.13
    while tb is not None:
        with suppress(RuntimeError):  # a frame still running (none of a finished call's is)
            tb.tb_frame.clear()
            _ = tb.tb_frame.f_locals
        tb = tb.tb_next


def teardown(item: pytest.Item, run: GpuRun, before_release: Sequence[BeforeRelease] = ()) -> None:
    """After fixtures are torn down: ``before_release`` (the quarantine's probe: broken CUDA
    keeps its memory), then verify, give everything back, record properties."""
    state = item.stash.get(STATE_KEY, None)
    for step in before_release:
        step(item, run, state)
    ended = fixture_leases.end(item, run)  # fixtures (any scope) torn down in this teardown
    if state is None and ended:
        state = item.stash[STATE_KEY] = TestState()
    if state is None:
        return
    for owner, verdict, spans in ended:
        state.judged(owner, verdict, spans)
    while state.sections:  # a gpu_request block left open (e.g. a generator not closed)
        state.finish(run, state.sections.pop())
    if state.main is not None:
        main, state.main = state.main, None
        state.finish(run, main)
    if state.ports_owner is not None:
        run.client.release_ports(state.ports_owner)
        state.ports_owner = None
    if state.indices or state.held:
        item.user_properties.extend(report_properties(state, needs(item).serial).items())


def report_properties(state: TestState, alone: bool) -> GpuProperties:
    """What the test's report says about its leases (read by :mod:`pytest_gpu.report.timeline`
    and :mod:`pytest_gpu.report.summary`); ``alone``: a ``gpu_serial`` test."""
    peak = format_peaks({i: state.verdict.peak.get(i, 0) for i in sorted(state.indices)})
    if not state.verdict.measured:
        peak = ""  # unknown, not zero: no suggestion is made from it
    props = GpuProperties(
        gpu_indices=",".join(map(str, sorted(state.indices))),
        gpu_wait_seconds=round(state.waited, 4),
        gpu_peak_bytes=peak,
        gpu_violations=len(state.verdict.violations),
        gpu_request=state.request.describe() if state.request else "",
        # a gpu_serial test's lease is not its to size: no suggestion from it
        gpu_request_bytes=0 if alone else _requested_bytes(state),
        gpu_leases=format_spans(state.leases),
    )
    notes = state.verdict.notes + state.held_notes
    if notes:  # what could not be checked (its own leases', other holders'): said in the summary, never silent
        props["gpu_notes"] = "\n".join(notes)
    if state.held:  # other holders' leases judged now (fixtures', pools'): the summary and trace show them
        props["gpu_held"] = format_held(state.held)
    unseen = max(state.verdict.unseen_lag, state.unseen_lag)
    if unseen:  # AMD: verified from a list that may not show the test yet: the summary counts these
        props["gpu_unseen_lag"] = unseen
    return props


def _requested_bytes(state: TestState) -> int:
    """Memory per GPU the test asked for: its marker's, or what an exclusive lease gave (0: none)."""
    if state.request is not None and state.request.memory is not None:
        return state.request.memory
    return max((span.memory for span in state.leases), default=0)


def make_report(item: pytest.Item, report: pytest.TestReport, run: GpuRun, failed: BaseException | None) -> None:
    """Put the verdict into the teardown report; keep ``failed`` (setup, call) for release_failure."""
    state = item.stash.get(STATE_KEY, None)
    if state is None or report.when != "teardown":
        if state is not None and failed is not None:
            state.failures.append(failed)
            if out_of_memory(failed):
                _name_leftovers(report, run, state)
        return
    if state.notes:
        report.sections.append(("pytest-gpu verification", "\n".join(state.notes)))
    texts = list(state.violations)  # other holders', named: not this test's
    if state.verdict.violations:
        texts.insert(0, broke(Owner("test", item.nodeid, item.nodeid), state.verdict.violations))
    if not texts:
        return
    text = "\n".join(texts)
    if run.settings.verify == "fail" and report.outcome == "passed":
        report.outcome = "failed"
        report.longrepr = text
    else:
        report.sections.append(("pytest-gpu verification", text))
        if run.settings.verify == "warn":
            item.warn(pytest.PytestWarning(text))


LEFTOVERS_SECTION = "pytest-gpu: memory left by earlier tests"


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a GPU's out-of-memory error: torch's and CuPy's
    ``OutOfMemoryError``, the simulated GPUs', or a framework's "out of memory" text (JAX's
    ``RESOURCE_EXHAUSTED``, torch before 1.13's ``RuntimeError``)."""
    return any(
        type(found).__name__ == "OutOfMemoryError" or "out of memory" in str(found)[:300].lower()
        for found in chain(exc)
    )


def _name_leftovers(report: pytest.TestReport, run: GpuRun, state: TestState) -> None:
    """The test ran out of GPU memory while its process still held what earlier tests left
    there: name them in its report (their own reports said so), so it is not taken for the cause."""
    lines = run.leftovers.described(state.indices | state.fixture_gpus)
    if lines:
        report.sections.append((LEFTOVERS_SECTION, "\n".join(lines)))


# -- fixtures ------------------------------------------------------------------------


def gpu_fixture(request: pytest.FixtureRequest) -> GpuLease:
    state: TestState | None = request.node.stash.get(STATE_KEY, None)  # pytest leaves request.node unannotated
    if state is None or state.main is None:
        raise RuntimeError("pytest-gpu: no lease for this test (is the gpu fixture used outside a test?)")
    return state.main.lease


@contextmanager
def _section(node: pytest.Item, run: GpuRun, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[GpuLease]:
    __tracebackhide__ = True
    problem = ""
    try:
        request = build_request(args, kwargs, run.settings.default_memory, what="gpu_request", form=GPU_FIXTURE_FORM)
    except GpuRequestError as exc:
        problem = str(exc)
    if problem:  # one line naming the test and the form expected: no frames of ours or contextlib's
        pytest.fail(f"pytest-gpu: {node.nodeid}: {problem}", pytrace=False)
    reason = run.never_fits(request)
    if reason is not None:
        if run.settings.oversize == "skip":
            skip_at_run_time(node, request, run)
            raise pytest.skip.Exception(f"pytest-gpu: {reason}", _use_item_location=True)
        pytest.fail(f"pytest-gpu: {reason} (--gpu-oversize=fail)", pytrace=False)
    state = node.stash[STATE_KEY]
    holding = _hold(run, request, node)
    state.sections.append(holding)
    state.waited += holding.lease.waited
    state.indices.update(holding.lease.indices)
    try:
        yield holding.lease
    finally:
        if holding in state.sections:
            state.sections.remove(holding)
            state.finish(run, holding)


def gpu_request_fixture(request: pytest.FixtureRequest, run: GpuRun) -> Callable[..., AbstractContextManager[GpuLease]]:
    node = request.node

    def gpu_request(*args: Any, **kwargs: Any) -> AbstractContextManager[GpuLease]:
        return _section(node, run, args, kwargs)

    return gpu_request


# the ports a test leased: an EADDRINUSE on one is no fault of its own (pytest_gpu.run.infra)
LEASED_PORTS_KEY = pytest.StashKey[list[int]]()


def ports_fixture(request: pytest.FixtureRequest, run: GpuRun) -> Callable[[int], list[int]]:
    node = request.node
    state = node.stash[STATE_KEY]

    def ports(n: int = 1) -> list[int]:
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"{node.nodeid}: ports(n) expects a positive int, got {n!r}")
        if state.ports_owner is None:
            state.ports_owner = str(PortOwner.of_this_process(node.nodeid))
        got = run.client.ports(n, state.ports_owner)
        node.stash.setdefault(LEASED_PORTS_KEY, []).extend(got)
        return got

    return ports
