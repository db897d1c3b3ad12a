"""pytest hooks: thin wiring of the layers (see the package docstring for the map)."""

from __future__ import annotations

import os
from collections.abc import Callable, Generator
from typing import Any

import pytest

from . import lifecycle, options, raycluster
from .devices import DeviceSpecError
from .distributed import runner
from .distributed.rankinfo import RankPlaceholder
from .isolation import GpuLease
from .launched import selection
from .launched.detect import detect
from .launched.session import LaunchedSession, log_dir, redirect_output, select_share
from .lifecycle import RUN_KEY
from .reporting import Summary
from .session import WIRE_KEY, GpuRun

SUMMARY_KEY = pytest.StashKey[Summary]()

MARKERS = (
    "gpu(count=1, memory=None, exclusive=False): the test needs COUNT GPUs with MEMORY each "
    '(e.g. "8GiB"), or whole GPUs; see pytest-gpu\'s README.',
    'distributed(world_size, *, backend="auto", gpus_per_rank=None, launcher="spawn", timeout=None): '
    "the test body runs on WORLD_SIZE ranks of a warm pool; see pytest-gpu's README.",
)


def pytest_addoption(parser: pytest.Parser) -> None:
    options.register(parser)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> Generator[None, None, None]:
    # Before output capturing starts (it keeps the terminal's descriptor): ranks other
    # than 0 of a launch write everything to their log file instead of the terminal.
    ctx = detect()
    if ctx is not None and not ctx.is_root and "PYTEST_XDIST_WORKER" not in os.environ:
        redirect_output(log_dir(early_config) / ctx.launcher / f"rank{ctx.rank}.log")
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
        try:
            run = GpuRun.start(settings)
        except DeviceSpecError as exc:
            raise pytest.UsageError(str(exc)) from None
    config.stash[RUN_KEY] = run
    if run.settings.learn:
        run.learned_peaks = dict(_cache(config).get(PEAKS_KEY, {})) if _cache(config) else {}
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
    try:
        return (yield)
    finally:
        lifecycle.teardown(item, item.config.stash[RUN_KEY])


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
    cache = _cache(config)
    if run is not None and run.broker is not None and run.settings.learn and cache is not None:
        # the controller saw every worker's reports: it alone writes what was learned
        peaks = dict(cache.get(PEAKS_KEY, {}))
        peaks.update(config.stash[SUMMARY_KEY].peaks)
        cache.set(PEAKS_KEY, peaks)


PEAKS_KEY = "pytest_gpu/peaks"


def _cache(config: pytest.Config) -> Any:
    return getattr(config, "cache", None)  # absent under -p no:cacheprovider


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    run = config.stash.get(RUN_KEY, None)
    if run is None or run.broker is None:
        return
    for line in config.stash[SUMMARY_KEY].lines(run.inventory, run.broker.crashes) + selection.summary_lines(config):
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
    from .artifacts import store

    return store(request.config, request.config.stash[RUN_KEY].run_dir).get
