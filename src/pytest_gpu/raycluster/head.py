"""What a Ray head is, before any process runs: the fixture's value, the head's command and environment.

Everything here is pure (files, environment and ``sys.path`` in, values out), so the
rest of the package, and the tests, can describe a head without starting one.

The head is started with ``RAY_AUTH_MODE=disabled`` (recent Ray turns token authentication
on for ``ray start`` when a token exists in ``~/.ray``): it is a throw-away local cluster, and
its fixed-default ports (GCS, dashboard, dashboard agent, Ray Client) are taken from the
run's port broker so that two runs, or a run and a cluster of the user, never clash.
Ray's own GPU scheduling is independent of the plugin's GPU leases: a test that must keep
other tests off the GPUs its Ray tasks use should ask for them with the ``gpu`` marker.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .. import sim
from ..gpu.isolation import TF_GROWTH, VISIBILITY, XLA_FRACTION, XLA_PREALLOCATE

# in the run directory, shared by the controller and its xdist workers
STATE_FILE = "ray-head.json"
LOCK_FILE = "ray-head.lock"
LOG_FILE = "ray-head.log"
AUTH_ENV = "RAY_AUTH_MODE"
# a test's lease, not the run's
_LEASE_VARS = (*VISIBILITY, sim.TAG_ENV, XLA_PREALLOCATE, XLA_FRACTION, TF_GROWTH)
_MAX_TEMP_DIR = 40  # Ray's AF_UNIX sockets live ~65 characters below its temp dir (limit: 107)


class RayClusterError(RuntimeError):
    """The Ray cluster could not be started or reached in time."""


@dataclass(frozen=True)
class RayCluster:
    """The value of the ``ray_cluster`` fixture.

    ``address`` is the GCS address (``host:port``) for ``ray.init`` in other processes,
    ``resources`` the cluster's resources once it was ready (``{"CPU": 2.0, "GPU": 4.0, ...}``),
    ``started_by_plugin`` whether pytest-gpu started (and will stop) the head, ``gpus`` the
    physical GPU indices behind Ray's GPUs (``None`` for an external cluster) and ``log``
    the head's log file while the run lasts (``None`` for an external cluster).
    """

    address: str
    resources: dict[str, float]
    started_by_plugin: bool
    gpus: tuple[int, ...] | None = None
    log: Path | None = None


@dataclass(frozen=True)
class HeadSpec:
    """How to start a local head: resources, ports, directories, environment."""

    num_cpus: int
    gpus: tuple[int, ...]
    gcs_port: int
    dashboard_port: int
    agent_port: int
    client_port: int | None
    temp_dir: Path
    env: dict[str, str] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    def command(self, python: str = sys.executable) -> list[str]:
        """``ray start --head --block ...`` through this interpreter's Ray."""
        cmd = [
            python,
            "-m",
            "ray.scripts.scripts",
            "start",
            "--head",
            "--block",
            f"--port={self.gcs_port}",
            f"--num-cpus={self.num_cpus}",
            f"--num-gpus={len(self.gpus)}",
            "--include-dashboard=false",
            f"--dashboard-port={self.dashboard_port}",
            f"--dashboard-agent-listen-port={self.agent_port}",
            "--disable-usage-stats",
            f"--temp-dir={self.temp_dir}",
            "--log-style=record",
            "--log-color=false",
        ]
        if self.client_port is not None:
            cmd.append(f"--ray-client-server-port={self.client_port}")
        return cmd

    def expected(self) -> dict[str, float]:
        """The resources the head reports once its raylet has registered."""
        wanted = {"CPU": float(self.num_cpus)}
        if self.gpus:
            wanted["GPU"] = float(len(self.gpus))
        return wanted


def cpu_count() -> int:
    """CPUs this process may run on (its affinity where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def head_env(
    environ: Mapping[str, str], search_path: Iterable[str] = (), *, gpu_env: Mapping[str, str]
) -> dict[str, str]:
    """The head's environment: the run's GPUs (not a test's lease), no auth, the driver's code.

    ``gpu_env``: the variables that give Ray the run's GPUs, as their vendor sets them
    (:meth:`pytest_gpu.vendors.vendor.Vendor.ray_env`: Ray takes a node's GPU ids from
    ``CUDA_VISIBLE_DEVICES``, or ``HIP_VISIBLE_DEVICES`` on AMD GPUs, and hands each task a
    subset, so the run's physical indices make a task's variable name real or simulated devices).
    Every lease variable of the environment is dropped first. ``search_path`` goes in front of
    ``PYTHONPATH`` so that Ray workers can import the test modules whose functions they run
    (pytest puts test directories on the driver's ``sys.path`` only).
    """
    env = {k: v for k, v in environ.items() if k not in _LEASE_VARS}
    env.update(gpu_env)
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    env[AUTH_ENV] = "disabled"
    paths = list(dict.fromkeys(p for p in search_path if p))
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def driver_search_path(path: Iterable[str] = sys.path) -> list[str]:
    """Directories on this process's ``sys.path`` that a fresh interpreter would not have.

    Leaves out the interpreter's own directories (standard library, site-packages), keeps
    what pytest inserted (rootdir / test directories) and source trees.
    """
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix) if p}
    kept = []
    for entry in path:
        if not entry or not os.path.isdir(entry):
            continue
        real = os.path.realpath(entry)
        if any(real == p or real.startswith(p + os.sep) for p in prefixes):
            continue
        kept.append(os.path.abspath(entry))
    return list(dict.fromkeys(kept))


def host_port(address: str) -> tuple[str, int] | None:
    """``host:port`` (also ``ray://host:port``, ``[v6]:port``) → its parts; else ``None``."""
    match = re.fullmatch(r"(?:ray://)?(\[[0-9A-Fa-f:.]+\]|[\w.-]+):(\d{1,5})/?", address.strip())
    if match is None:
        return None
    return match.group(1).strip("[]"), int(match.group(2))


def temp_dir_for(run_dir: Path) -> tuple[Path, bool]:
    """Ray's ``--temp-dir``: inside the run directory when short enough, else a short one of its own.

    Returns the directory and whether it lies outside the run directory (and must be
    removed on its own).
    """
    inside = run_dir / "ray"
    if len(str(inside)) <= _MAX_TEMP_DIR:
        inside.mkdir(mode=0o700, exist_ok=True)
        return inside, False
    return Path(tempfile.mkdtemp(prefix="pgray-", dir="/tmp" if os.path.isdir("/tmp") else None)), True


def log_tail(path: Path, lines: int = 25) -> str:
    """The end of the head's log for an error message (the run directory goes with the run)."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        text = []
    if not text:
        return f"its log {path} is empty so far"
    return f"last lines of its log {path}:\n" + "\n".join(f"    {line}" for line in text[-lines:])
