"""One plugin object per role a pytest process plays in a run, registered once the role is known.

    controller   (Controller)  the xdist controller: owns the run (broker, summary, history,
                               trace), hands each worker the run, schedules tests by GPU need
    worker       (Worker)      an xdist worker: joins the controller's run and runs tests
    lone         (Lone)        pytest without xdist workers: owns the run and runs its tests
    launched rank (LaunchedRank, launched/session.py): beside the controller or lone object of
                               each rank's main process under srun, mpirun or torchrun

The role is decided once, in ``pytest_configure``, by :func:`decide`; the objects are
unregistered when the config is cleaned up, after ``pytest_unconfigure``.
"""

from __future__ import annotations

import enum

import pytest

from ..launched.detect import LaunchContext
from ..run.lifecycle import RUN_KEY
from ..run.session import GpuRun
from .base import register
from .keys import LAUNCH_KEY


class Role(enum.Enum):
    CONTROLLER = "controller"
    WORKER = "worker"
    LONE = "lone"


def decide(*, worker: bool, dist: str, collect_only: bool) -> Role:
    """This process's role: xdist starts workers for any ``--dist`` but ``no``, except
    with ``--collect-only`` (its ``pytest_configure`` reads the same two options)."""
    if worker:
        return Role.WORKER
    return Role.CONTROLLER if dist != "no" and not collect_only else Role.LONE


def role_of(config: pytest.Config) -> Role:
    return decide(
        worker=hasattr(config, "workerinput"),
        dist=str(getattr(config.option, "dist", "no")),  # "no" when xdist is not installed or -p no:xdist
        collect_only=bool(config.getoption("collectonly", False)),
    )


def install(config: pytest.Config, run: GpuRun) -> Role:
    """Register this process's plugin objects (and unregister them at config cleanup)."""
    from .owner import Controller
    from .tester import Lone, Worker

    role = role_of(config)
    config.stash[RUN_KEY] = run
    launch: LaunchContext | None = config.stash.get(LAUNCH_KEY, None)
    plugin = {Role.CONTROLLER: Controller, Role.WORKER: Worker, Role.LONE: Lone}[role](config, run, launch)
    register(config, plugin, f"pytest-gpu-{role.value}")
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

