"""What the plugin keeps per process (``config.stash``), hands to xdist workers, and the roles."""

from __future__ import annotations

import enum

import pytest

from ..base.launch import LaunchContext

# The launcher this process is a rank of (None: none), read once, before conftests load.
LAUNCH_KEY = pytest.StashKey[LaunchContext | None]()
# Whether the user chose an xdist distribution mode (read before xdist turns -n N into --dist load).
DIST_CHOSEN_KEY = pytest.StashKey[bool]()
# --tx as the user gave it (read before xdist turns -n N into popen specs): --gpu-nodes refuses both
TX_GIVEN_KEY = pytest.StashKey[list[str]]()
# -n as the user gave it (read before xdist turns "auto" into a number): --gpu-nodes refuses -n auto
WORKERS_GIVEN_KEY = pytest.StashKey[object]()
# workerinput: True when the controller hands tests out with GpuScheduling.
SCHEDULE_KEY = "pytest_gpu_schedule"


class Role(enum.Enum):
    """What a pytest process is to its run (see :mod:`pytest_gpu.roles`)."""

    CONTROLLER = "controller"
    WORKER = "worker"
    LONE = "lone"
