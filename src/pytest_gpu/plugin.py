"""The ``pytest11`` entry point ``gpu``: a table of contents.

Options (:mod:`.run.options`), hook specs (:mod:`.hookspecs`), markers and fixtures are
declared here; what happens before the role is known (the command line, early conftest
loading, ``-n auto``) is wired here. Everything else is a feature's hook object, registered
by the process's role (:mod:`pytest_gpu.roles`): before the initial conftests load, and at
``pytest_configure``, where the role starts or joins the run.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import pytest

from . import hookspecs, raycluster, roles
from .base.launch import LaunchContext, detect
from .distributed import runner
from .distributed.rankinfo import RankPlaceholder
from .gpu import adapters
from .gpu.isolation import GpuLease
from .launched import selection
from .launched.session import early as launched_early
from .nodes import worker as node_worker
from .run import fixture_leases, lifecycle, options
from .run.artifacts import store
from .run.keys import DIST_CHOSEN_KEY, LAUNCH_KEY, TX_GIVEN_KEY, WORKERS_GIVEN_KEY
from .run.record import RUN_KEY
from .sim import fake
from .vendors import libraries

MARKERS = (
    "gpu(count=1, memory=None, exclusive=False, cpus=None, host_memory=None): the test needs COUNT GPUs "
    'with MEMORY each (e.g. "8GiB"), or whole GPUs, and CPUS CPUs and HOST_MEMORY of RAM; see pytest-gpu\'s README.'
    " With isolate=True its body runs in a process of its own that sees exactly those GPUs (cuda:0..COUNT-1).",
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
    pluginmanager.add_hookspecs(hookspecs)
    pluginmanager.register(adapters, "gpu_adapters")  # torch's and CuPy's pytest_gpu_confine; -p no:gpu_adapters


@pytest.hookimpl(wrapper=True)
def pytest_cmdline_main(config: pytest.Config) -> Generator[None, Any, Any]:
    # before xdist turns "-n N" into "--dist load": did the user choose a distribution mode?
    config.stash[DIST_CHOSEN_KEY] = getattr(config.option, "dist", "no") != "no"
    config.stash[TX_GIVEN_KEY] = list(getattr(config.option, "tx", None) or [])  # --gpu-nodes refuses --tx
    config.stash[WORKERS_GIVEN_KEY] = getattr(config.option, "numprocesses", None)  # and -n auto
    if hasattr(config, "workerinput"):
        node_worker.setup(config)  # a --gpu-nodes worker: on its node, with its temp directory there
    return (yield)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> Generator[None, None, None]:
    ctx = early_config.stash[LAUNCH_KEY] = detect()  # read once per process
    roles.register_early(early_config)  # the role and its features before the initial conftests: their hooks run first
    launched_early(early_config, ctx)  # before output capturing starts, and before conftests import torch
    if fake.requested():  # before conftest.py files import torch
        try:
            release = fake.start_for_run(_launch_id(ctx))
        except fake.ClaimError as exc:
            raise pytest.UsageError(f"{fake.FAKE_ENV}: pytest-gpu: cannot make the run's own machine: {exc}") from None
        except ValueError as exc:
            raise pytest.UsageError(f"{fake.FAKE_ENV}: {exc}") from None
        if release is not None:
            early_config.add_cleanup(release)
    return (yield)


def _launch_id(ctx: LaunchContext | None) -> str | None:
    """The launch this process is a rank of, as the run machines its ranks share are named."""
    return None if ctx is None else f"{ctx.launcher}:{ctx.run_id}"


def pytest_configure(config: pytest.Config) -> None:
    # warnings of the GPU libraries imported so far (the fake machine's NVML) and from now on
    # (discovery's), for pytest's warnings summary
    libraries.report_to(config)
    for line in MARKERS:
        config.addinivalue_line("markers", line)
    selection.register_markers(config)
    roles.install(config)  # the run started or joined; the role's features settled from it


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto`` with GPUs: workers by GPU memory, CPUs and RAM (see autoworkers); ``None``
    (firstresult: xdist's own answer follows) for ``-n logical``, its env var, or no GPUs."""
    from .scheduling.autoworkers import auto_num_workers  # local: slow (statistics, placement): only -n auto

    return auto_num_workers(config)


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
    return store(request.config, request.config.stash[RUN_KEY].run_dir).get
