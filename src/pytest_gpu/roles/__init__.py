"""One plugin object per role a pytest process plays in a run, registered once the role is known.

    controller   (Controller)  the xdist controller: owns the run (broker, summary, history,
                               trace), hands each worker the run, schedules tests by GPU need
    worker       (Worker)      an xdist worker: joins the controller's run and runs tests
    lone         (Lone)        pytest without xdist workers: owns the run and runs its tests
    launched rank (LaunchedRank, launched/session.py): beside the controller or lone object of
                               each rank's main process under srun, mpirun or torchrun

The role is foreseen before the initial conftests load (:func:`register_early`: hook order
follows registration, and a conftest's hooks must run before the role's), confirmed and
given the run in ``pytest_configure`` (:func:`install`); the objects are unregistered when
the config is cleaned up, after ``pytest_unconfigure``.
"""

from __future__ import annotations

import os

import pytest

from ..run.keys import LAUNCH_KEY, Role
from ..run.record import RUN_KEY
from ..run.session import GpuRun
from .base import RoleBase, register

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
    """Register the expected role's object before the initial conftests load.

    Hook order follows registration: a conftest's plain hooks (a ``pytest_runtest_setup``
    that skips or waits for a condition) run before the role's, as they ran before the
    plugin module's, so a test a conftest skips never waits for its lease.
    """
    _create(config, expected_role(config))


def install(config: pytest.Config, run: GpuRun) -> Role:
    """At ``pytest_configure``: attach ``run`` to the role's object (replacing the early one
    where the foresight was wrong, e.g. a pytest started from inside an xdist worker),
    and register the launched-rank role where it applies."""
    role = role_of(config)
    plugin = config.stash.get(ROLE_KEY, None)
    if plugin is None or plugin.role is not role:
        if plugin is not None and config.pluginmanager.is_registered(plugin):
            config.pluginmanager.unregister(plugin)
        plugin = _create(config, role)
    config.stash[RUN_KEY] = run
    plugin.attach(run)
    launch = plugin.launch
    if role is not Role.WORKER and launch is not None:
        from ..launched.session import LaunchedRank, log_dir

        if not launch.is_root and getattr(config.option, "xmlpath", None):
            # one junitxml at the path asked for, from rank 0; the others keep theirs by their log
            config.option.xmlpath = str(log_dir(config) / launch.launcher / f"rank{launch.rank}.xml")
        rank = LaunchedRank(config, launch, run.settings.rank_gather_timeout, config.getoption("shard"))
        register(config, rank, "pytest-gpu-launched-rank")
    elif config.getoption("shard") and launch is None:
        raise pytest.UsageError("--shard: not running under a launcher (srun, mpirun or torchrun), nothing to shard")
    return role


def _create(config: pytest.Config, role: Role) -> RoleBase:
    from .owner import Controller
    from .tester import Lone, Worker

    (kind,) = [k for k in (Controller, Worker, Lone) if k.role is role]
    plugin = kind(config, config.stash.get(LAUNCH_KEY, None))
    register(config, plugin, f"pytest-gpu-{role.value}")
    config.stash[ROLE_KEY] = plugin
    return plugin
