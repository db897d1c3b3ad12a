"""One plugin object per role a pytest process plays in a run; it registers the features that apply.

    controller   (Controller)  the xdist controller: starts and owns the run (broker, or
                               --gpu-nodes' node hosts), hands each worker the run
    worker       (Worker)      an xdist worker: joins the controller's run
    lone         (Lone)        pytest without xdist workers: owns the run and runs its tests

A role only says who owns the run; everything else is a feature: one hook object in its
own folder (:class:`~pytest_gpu.run.feature.Feature`), registered only where its role needs
it and only when it is enabled, under the name ``pytest-gpu-<name>``:

    feature          controller  worker  lone   enabled
    summary          x                   x      always (report/feature: summary, trace, history)
    ray-head         x                   x      always (raycluster: the head a test started stops with the run)
    requests         x                   x      always (report/written: where requests came from, --gpu-requests' file)
    launched-rank    x                   x      under srun, mpirun or torchrun (launched/session)
    nodes            x                          --gpu-nodes (nodes/feature)
    selection        x           x       x      always (launched/selection: launcher markers, their reasons)
    required         x           x       x      --gpu-required, not --collect-only (run/required)
    scheduling       x                          --gpu-schedule=on, no --dist chosen (scheduling/scheduler)
    leases                       x       x      always (run/lifecycle: a test's leases, fixtures' leases)
    quarantine                   x       x      always (run/sticky: sticky CUDA errors)
    distributed                  x       x      always (distributed/runner: rank pools, isolate=True)
    catalog                      x              the controller's GPU scheduler hands out the tests (scheduling/catalog)
    node                         x              --gpu-nodes (nodes/worker)
    infrastructure               x       x      always (run/infra: failures from outside the test, --gpu-retry-infra)
    lost-workers     x                          always (run/infra: a crashed worker's test, its retry)

The role and the features it foresees from the command line are registered before the
initial conftests load (:func:`register_early`: hook order follows registration, and a
conftest's hooks must run before pytest-gpu's); at ``pytest_configure`` the role is
confirmed, starts or joins the run, and settles its features from it (:func:`install`);
each object is unregistered when the config is cleaned up, after ``pytest_unconfigure``.
"""

from __future__ import annotations

import os

import pytest

from ..launched.session import check_shard
from ..run import history, written
from ..run.keys import LAUNCH_KEY, Role
from ..run.record import RUN_KEY
from .base import RoleBase, foresee, register
from .owner import Controller
from .tester import Lone, Worker

__all__ = ["Role", "decide", "expected_role", "install", "register_early", "role_of"]


ROLE_KEY = pytest.StashKey[RoleBase]()


def decide(*, worker: bool, dist: str, collect_only: bool) -> Role:
    """This process's role: xdist starts workers for any ``--dist`` but ``no``, except
    with ``--collect-only`` (its ``pytest_configure`` reads the same two options)."""
    if worker:
        return Role.WORKER
    return Role.CONTROLLER if dist != "no" and not collect_only else Role.LONE


def role_of(config: pytest.Config) -> Role:
    """The role, from what xdist decided (``pytest_configure`` and later)."""
    return decide(
        worker=hasattr(config, "workerinput"),
        dist=str(getattr(config.option, "dist", "no")),  # "no" when xdist is not installed or -p no:xdist
        collect_only=bool(config.getoption("collectonly", False)),
    )


def expected_role(config: pytest.Config) -> Role:
    """The role, foreseen before the initial conftests load: xdist has set
    ``PYTEST_XDIST_WORKER`` in a worker, and turns ``-n N`` into ``--dist load`` only later."""
    ns = getattr(config, "known_args_namespace", config.option)
    dist = str(getattr(ns, "dist", "no"))
    if dist == "no" and (getattr(ns, "numprocesses", None) or getattr(ns, "distload", False)):
        dist = "load"
    return decide(
        worker="PYTEST_XDIST_WORKER" in os.environ,
        dist=dist,
        collect_only=bool(getattr(ns, "collectonly", False)),
    )


def register_early(config: pytest.Config) -> None:
    """Register the expected role's object, and the features it foresees, before the initial
    conftests load.

    Hook order follows registration: a conftest's plain hooks (a ``pytest_runtest_setup``
    that skips or waits for a condition) run before the features', as they ran before the
    plugin module's, so a test a conftest skips never waits for its lease.
    """
    _create(config, expected_role(config)).settle(foresee(config))


def install(config: pytest.Config) -> Role:
    """At ``pytest_configure``: confirm the role (replacing the early object where the
    foresight was wrong, e.g. a pytest started from inside an xdist worker), start or join
    the run, and settle the role's features from it."""
    role = role_of(config)
    plugin = config.stash.get(ROLE_KEY, None)
    if plugin is None or plugin.role is not role:
        if plugin is not None:
            plugin.withdraw()
        plugin = _create(config, role)
    check_shard(config, plugin.launch)
    run = plugin.start()
    if run.settings.learn:
        run.learned_peaks = history.load(config, history.PEAKS_KEY)
    if run.settings.requests_path and not run.settings.write_requests:  # the run that writes it measures
        run.written = written.load_if_any(run.settings.requests_path)
    run.frameworks = config.hook.pytest_gpu_confine
    config.stash[RUN_KEY] = run
    plugin.attach(run)
    return role


def _create(config: pytest.Config, role: Role) -> RoleBase:
    (kind,) = [k for k in (Controller, Worker, Lone) if k.role is role]
    plugin = kind(config, config.stash.get(LAUNCH_KEY, None))
    register(config, plugin, f"pytest-gpu-{role.value}")
    config.stash[ROLE_KEY] = plugin
    return plugin
