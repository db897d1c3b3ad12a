"""This process's Ray driver: connecting it, waiting until the cluster is ready, disconnecting.

Readiness is awaited by polling (a TCP port, then the cluster's resources) against
``--ray-start-timeout``, never by a fixed sleep; what does not come up in time is a
:class:`RayClusterError` that names it. Used for an external cluster and for the run's
own head alike. Ray is imported on use: the plugin loads this package in every process.
"""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Callable, Mapping

from .head import RayClusterError


def disconnect() -> None:
    """``ray.shutdown()`` if this process is connected; never imports Ray."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def gcs_address(fallback: str) -> str:
    """The connected cluster's GCS address (``host:port``), else ``fallback``."""
    import ray

    try:
        return str(ray.get_runtime_context().gcs_address)
    except Exception:
        return fallback


def cluster_resources() -> dict[str, float]:
    """``ray.cluster_resources()`` of the connected cluster, keys and values as their types say."""
    import ray

    found = ray.cluster_resources()  # type: ignore[no-untyped-call]  # Ray leaves it unannotated
    return {str(k): float(v) for k, v in found.items()}


def init_and_wait(
    address: str, expected: Mapping[str, float], deadline: float, what: str, timeout: float
) -> dict[str, float]:
    """``ray.init(address)``, then poll the cluster's resources until ``expected`` is there."""
    import ray

    try:
        ray.init(address=address)
    except Exception as exc:
        raise RayClusterError(f"could not connect to {what}: {type(exc).__name__}: {exc}") from None
    resources: dict[str, float] = {}
    while True:
        try:
            resources = cluster_resources()
        except Exception:
            resources = {}
        if resources and all(resources.get(k, 0.0) >= v for k, v in expected.items()):
            return resources
        if time.monotonic() >= deadline:
            disconnect()
            want = ", ".join(f"{k}={v:g}" for k, v in expected.items()) or "any resources"
            raise RayClusterError(
                f"{what} did not report {want} within {timeout:g}s (--ray-start-timeout); it has {resources or 'none'}"
            )
        time.sleep(0.1)


def wait_tcp(
    parts: tuple[str, int], deadline: float, dead: Callable[[], str | None], what: str, timeout: float
) -> None:
    """Poll until something accepts TCP connections at ``parts``; ``dead()`` says why it never will."""
    while True:
        try:
            socket.create_connection(parts, timeout=0.5).close()
            return
        except OSError as exc:
            error = exc
        reason = dead()
        if reason is not None:
            raise RayClusterError(f"{what} did not come up: {reason}")
        if time.monotonic() >= deadline:
            raise RayClusterError(
                f"{what} is not reachable within {timeout:g}s (--ray-start-timeout): {error.strerror or error}"
            )
        time.sleep(0.1)
