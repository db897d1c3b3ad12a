"""The ``ray_cluster`` fixture: which cluster this test process's Ray driver joins.

With ``--ray-address`` it is that external cluster, which is never started or stopped
here; without, the run's own head (:mod:`.startonce`), started by whichever process of
the run asks first. Either way the process disconnects when its session ends.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from pathlib import Path
from typing import TYPE_CHECKING

from .head import RayCluster, RayClusterError, host_port
from .readiness import cluster_resources, disconnect, gcs_address, init_and_wait, wait_tcp
from .startonce import ensure_head

if TYPE_CHECKING:
    import pytest

    from ..run.session import GpuRun


def fixture(request: pytest.FixtureRequest, run: GpuRun) -> Generator[RayCluster, None, None]:
    """``ray_cluster``: connect (starting the run's head if needed), disconnect at session end."""
    import pytest

    problem: str | None
    try:
        cluster = connect(run)
    except RayClusterError as exc:
        problem = str(exc)
    else:
        problem = None
    if problem is not None:  # outside the except block: no "during handling" chain in the report
        pytest.fail(f"pytest-gpu: {problem}", pytrace=False)
    try:
        yield cluster
    finally:
        disconnect()


def connect(run: GpuRun) -> RayCluster:
    """Connect this process's Ray driver: to ``--ray-address``, else to the run's own head."""
    try:
        import ray
    except ImportError as exc:
        raise RayClusterError(f"the ray_cluster fixture needs Ray: pip install 'pytest-gpu[ray]' ({exc})") from None
    if ray.is_initialized():
        raise RayClusterError(
            "ray is already initialised in this process before the ray_cluster fixture; "
            "use ray_cluster instead of calling ray.init() (or call ray.shutdown() first)"
        )
    timeout = run.settings.ray_start_timeout
    external = run.settings.ray_address.strip()
    if external:
        deadline = time.monotonic() + timeout
        what = f"the Ray cluster at --ray-address {external}"
        parts = host_port(external)
        if parts is not None:
            wait_tcp(parts, deadline, lambda: None, what, timeout)
        resources = init_and_wait(external, {}, deadline, what, timeout)
        return RayCluster(gcs_address(external), resources, started_by_plugin=False)
    head = ensure_head(run)
    what = f"the Ray head started by pytest-gpu at {head['address']} (log: {head['log']})"
    expected = {k: float(v) for k, v in head["expected"].items()}
    if ray.is_initialized():  # this process started the head and is connected already
        resources = cluster_resources()
    else:
        resources = init_and_wait(head["address"], expected, time.monotonic() + timeout, what, timeout)
    return RayCluster(head["address"], resources, True, tuple(head["gpus"]), Path(head["log"]))
