"""pytest hooks: thin wiring of the layers (see the package docstring for the map)."""

from __future__ import annotations

import os
from collections.abc import Callable, Generator
from typing import Any

import pytest

from . import options, raycluster
from .distributed import runner
from .distributed.rankinfo import RankPlaceholder
from .gpu.devices import DeviceSpecError
from .gpu.isolation import GpuLease
from .launched import selection
from .launched.detect import detect
from .launched.session import LaunchedSession, log_dir, redirect_output, select_share
from .report.summary import Summary, foreign_lines
from .run import fixture_leases, lifecycle
from .run.lifecycle import RUN_KEY
from .run.session import WIRE_KEY, GpuRun
from .scheduling import history

SUMMARY_KEY = pytest.StashKey[Summary]()
DIST_CHOSEN_KEY = pytest.StashKey[bool]()
SCHEDULE_KEY = "pytest_gpu_schedule"  # workerinput: the controller uses GpuScheduling

MARKERS = (
    "gpu(count=1, memory=None, exclusive=False, cpus=None, host_memory=None): the test needs COUNT GPUs "
    'with MEMORY each (e.g. "8GiB"), or whole GPUs, and CPUS CPUs and HOST_MEMORY of RAM; see pytest-gpu\'s README.',
    'host_resources(cpus=None, host_memory=None): the test leases CPUS CPUs and HOST_MEMORY of RAM (e.g. "8GiB") '
    "from the machine, with or without GPUs; OMP_NUM_THREADS follows cpus; see pytest-gpu's README.",
    'distributed(world_size, *, backend="auto", gpus_per_rank=None, launcher="spawn", timeout=None): '
    "the test body runs on WORLD_SIZE ranks of a warm pool; see pytest-gpu's README.",
    "gpu_serial: the test runs alone: no other test of the run meanwhile, and every GPU of the run "
    "leased exclusively (no other run's tests on them); see pytest-gpu's README.",
)


def pytest_addoption(parser: pytest.Parser) -> None:
    options.register(parser)


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from . import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


@pytest.hookimpl(wrapper=True)
def pytest_cmdline_main(config: pytest.Config) -> Generator[None, Any, Any]:
    # before xdist turns "-n N" into "--dist load": did the user choose a distribution mode?
    config.stash[DIST_CHOSEN_KEY] = getattr(config.option, "dist", "no") != "no"
    return (yield)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> Generator[None, None, None]:
    # Before output capturing starts (it keeps the terminal's descriptor): ranks other
    # than 0 of a launch write everything to their log file instead of the terminal.
    ctx = detect()
    if ctx is not None and not ctx.is_root and "PYTEST_XDIST_WORKER" not in os.environ:
        redirect_output(log_dir(early_config) / ctx.launcher / f"rank{ctx.rank}.log")
    from .sim import fake

    if fake.requested():  # before conftest.py files import torch
        try:
            fake.activate()
        except ValueError as exc:
            raise pytest.UsageError(f"{fake.FAKE_ENV}: {exc}") from None
    return (yield)


def pytest_configure(config: pytest.Config) -> None:
    for line in MARKERS:
        config.addinivalue_line("markers", line)
    selection.register_markers(config)
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None and WIRE_KEY in workerinput:
        run = GpuRun.join(workerinput[WIRE_KEY], str(workerinput.get("workerid", "worker")))
    else:
        settings = options.read(config)
        from .run.rundir import RunDirError
        from .sim.ledger import LedgerWriteError

        try:
            run = GpuRun.start(settings)
        except (DeviceSpecError, RunDirError, LedgerWriteError) as exc:
            raise pytest.UsageError(str(exc)) from None
    config.stash[RUN_KEY] = run
    if run.settings.learn:
        run.learned_peaks = history.load(config, history.PEAKS_KEY)
    if run.broker is not None:  # the xdist controller (it hears every worker's reports) or a lone process
        summary = Summary()
        config.stash[SUMMARY_KEY] = summary
        config.pluginmanager.register(summary, "pytest-gpu-summary")  # collects test reports
    ctx = detect()
    if ctx is not None and workerinput is None:
        if not ctx.is_root and getattr(config.option, "xmlpath", None):
            # one junitxml at the path asked for, from rank 0; the others keep theirs by their log
            config.option.xmlpath = str(log_dir(config) / ctx.launcher / f"rank{ctx.rank}.xml")
        launched = LaunchedSession(config, ctx, run.settings.rank_gather_timeout, config.getoption("shard"))
        config.pluginmanager.register(launched, "pytest-gpu-launched")
    elif config.getoption("shard") and ctx is None:
        raise pytest.UsageError("--shard: not running under a launcher (srun, mpirun or torchrun), nothing to shard")


def pytest_unconfigure(config: pytest.Config) -> None:
    runner.close(config)
    run = config.stash.get(RUN_KEY, None)
    if run is not None:
        raycluster.stop_head(run)  # the run's owner stops the Ray head a test started
        run.close()
        del config.stash[RUN_KEY]


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """xdist controller: hand each new worker (replacements too) the broker's address."""
    node.workerinput[WIRE_KEY] = node.config.stash[RUN_KEY].to_wire()
    node.workerinput[SCHEDULE_KEY] = _schedules(node.config)


def _schedules(config: pytest.Config) -> bool:
    """Whether this xdist controller hands tests out with :class:`GpuScheduling`."""
    run = config.stash.get(RUN_KEY, None)
    chosen = config.stash.get(DIST_CHOSEN_KEY, False)
    return run is not None and run.broker is not None and run.settings.schedule and not chosen


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if not _schedules(config):
        return None  # xdist's own, as chosen with --dist
    from .scheduling.scheduler import GpuScheduling

    return GpuScheduling(config, log, config.stash[RUN_KEY], history.load(config, history.DURATIONS_KEY))


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto`` with GPUs: workers by GPU memory, CPUs and RAM (see autoworkers); ``None``
    (firstresult: xdist's own answer follows) for ``-n logical``, its env var, or no GPUs."""
    from .scheduling.autoworkers import auto_num_workers

    return auto_num_workers(config)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    # an xdist worker: tell the scheduler what each test needs before xdist sends the node ids
    workerinput = getattr(session.config, "workerinput", None)
    if workerinput is None or not workerinput.get(SCHEDULE_KEY) or not session.items:
        return
    from .scheduling.catalog import entries

    run = session.config.stash[RUN_KEY]
    tests = entries(session.items, run)
    if tests:  # a CPU-only suite needs no entry, and so no connection to the broker
        run.client.catalog(tests)


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    report = yield
    lifecycle.collect_report(report, collector.config.stash[RUN_KEY], (runner.stash_spec,))
    return report


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ctx = detect()
    selection.deselect(config, items, ctx)
    if ctx is not None and config.getoption("shard") and hasattr(config, "workerinput"):
        select_share(config, ctx, items)  # xdist workers collect: each takes the rank's share
    lifecycle.mark_oversize(items, config.stash[RUN_KEY])


def pytest_runtest_setup(item: pytest.Item) -> None:
    # plain (not tryfirst): after the skip/skipif/xfail checks, before fixtures are set up
    lifecycle.setup(item, item.config.stash[RUN_KEY])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    fixture_leases.leave(item)  # fixtures torn down from here on are released once this test is verified
    try:
        return (yield)
    finally:
        lifecycle.teardown(item, item.config.stash[RUN_KEY])


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: Any, request: pytest.FixtureRequest) -> Generator[None, Any, Any]:
    with fixture_leases.setting_up(fixturedef, request):  # gpu_lease_factory/ports_factory calls are its
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    lifecycle.make_report(item, report, item.config.stash[RUN_KEY])
    runner.make_report(item, call, report)
    return report


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if runner.SPEC_KEY not in pyfuncitem.stash:
        return None
    runner.run_item(pyfuncitem, pyfuncitem.config.stash[RUN_KEY])
    return True


def pytest_sessionfinish(session: pytest.Session) -> None:
    runner.close(session.config)  # no rank outlives the session, also after Ctrl-C
    config = session.config
    run = config.stash.get(RUN_KEY, None)
    if run is None or run.broker is None:
        return  # an xdist worker: the controller saw every worker's reports and writes for all
    summary = config.stash[SUMMARY_KEY]
    if run.settings.learn:
        history.merge(config, history.PEAKS_KEY, summary.peaks())
    if detect() is None:  # under a launcher, rank 0 keeps the durations of every rank
        history.merge(config, history.DURATIONS_KEY, summary.durations())
    if run.settings.trace:
        from .report import trace

        data = trace.build(
            summary.timeline,
            [(d.index, d.total_memory) for d in run.inventory.devices],
            run.inventory.describe(),
            run.inventory.source,
        )
        try:
            summary.trace_path = str(trace.write(run.settings.trace, data))
        except OSError as exc:  # reported with the summary; the tests' outcome stands
            summary.trace_error = f"could not write the trace to {run.settings.trace}: {exc}"


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    run = config.stash.get(RUN_KEY, None)
    if run is None or run.broker is None:
        return
    summary = config.stash[SUMMARY_KEY]
    from .scheduling.autoworkers import summary_lines as auto_lines  # how -n auto chose, where pytest-gpu chose

    for line in auto_lines(config):
        terminalreporter.write_line(line)
    if summary.quiet(run.broker.crashes, run.broker.grants):  # the plugin stays inert for CPU-only runs
        for line in selection.summary_lines(config):
            terminalreporter.write_line(line)
        return
    lines = summary.lines(run.inventory, run.broker.crashes) + foreign_lines(run.broker.foreign)
    lines += summary.timeline.summary_lines(
        [d.index for d in run.inventory.devices], with_peaks=run.settings.verify != "off"
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


# -- fixtures --------------------------------------------------------------------------


@pytest.fixture
def gpu(request: pytest.FixtureRequest) -> GpuLease:
    """This test's GPU lease (``indices``, ``uuids``, ``memory``, ``device``, ``env``, ...)."""
    return lifecycle.gpu_fixture(request)


@pytest.fixture
def gpu_request(request: pytest.FixtureRequest) -> Callable[..., Any]:
    """``with gpu_request(count=1, memory="8GiB") as lease:`` — a lease for one section."""
    return lifecycle.gpu_request_fixture(request, request.config.stash[RUN_KEY])


@pytest.fixture
def ports(request: pytest.FixtureRequest) -> Callable[[int], list[int]]:
    """``ports(n=1)``: TCP ports unique across the whole run, reclaimed after the test."""
    return lifecycle.ports_fixture(request, request.config.stash[RUN_KEY])


@pytest.fixture
def port(ports: Callable[[int], list[int]]) -> int:
    """One TCP port unique across the whole run."""
    return ports(1)[0]


@pytest.fixture(scope="session")
def gpu_lease_factory(request: pytest.FixtureRequest) -> fixture_leases.GpuLeaseFactory:
    """For fixtures of any scope: ``lease = gpu_lease_factory(count=1, memory="8GiB")`` in a
    fixture's body is a lease held until that fixture's teardown."""
    return fixture_leases.GpuLeaseFactory(request.config)


@pytest.fixture(scope="session")
def ports_factory(request: pytest.FixtureRequest) -> fixture_leases.PortsFactory:
    """For fixtures of any scope: ``ports_factory(n=1)`` in a fixture's body gives run-unique
    TCP ports, reclaimed at that fixture's teardown."""
    return fixture_leases.PortsFactory(request.config)


@pytest.fixture
def rank() -> RankPlaceholder:
    """In a distributed test: this rank's ``rank``, ``world_size``, ``local_rank``, ``device``,
    ``backend`` and ``group`` (resolved inside each rank process)."""
    return runner.rank_fixture()


@pytest.fixture(scope="session")
def ray_cluster(request: pytest.FixtureRequest) -> Generator[raycluster.RayCluster, None, None]:
    """This process connected to a Ray cluster (``address``, ``resources``, ``started_by_plugin``,
    ``gpus``): ``--ray-address``, else a local head with the run's GPUs, stopped after the run."""
    yield from raycluster.fixture(request, request.config.stash[RUN_KEY])


@pytest.fixture
def shared_artifact(request: pytest.FixtureRequest) -> Callable[..., Any]:
    """``path = shared_artifact("dataset", build, version="3")``: ``build(path)`` fills a
    directory once for the whole run (all workers), reused by later runs of the same version."""
    from .run.artifacts import store

    return store(request.config, request.config.stash[RUN_KEY].run_dir).get
