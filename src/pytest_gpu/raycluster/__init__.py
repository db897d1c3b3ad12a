"""Ray clusters for tests: the session-scoped ``ray_cluster`` fixture.

``ray_cluster`` connects this test process to a Ray cluster and disconnects it when the
session ends. With ``--ray-address`` it joins that cluster and never stops it; without,
it starts a local head with the run's resources: one Ray GPU per GPU of the run
(simulated ones included, so ``--gpus sim:4x16GiB`` gives ``num_gpus=4`` and Ray sets
``CUDA_VISIBLE_DEVICES`` to one index in a task that asks for one GPU) and one Ray CPU
per CPU this process may run on. Readiness is awaited by polling the cluster's
resources against ``--ray-start-timeout``, never by a fixed sleep; a cluster that does
not come up is an error naming its address and the head's log.

Who starts the head, who stops it
---------------------------------
Under pytest-xdist every worker is its own process with its own Ray driver. A head per
worker would cost each worker a head's start-up (seconds) and a GCS, raylet and agents
of its own, so there is one head per run: the first process whose test asks for
``ray_cluster`` takes a file lock in the run directory (shared by the controller and its
workers), starts the head, waits until it is ready and records its address in
``ray-head.json``; the others wait on the lock, read the record and connect. A failed
start is recorded as well, so the other workers fail at once with the same message
instead of each waiting out the timeout again.

The head is stopped by the process that owns the run directory, the xdist controller or
the single pytest process, in its ``pytest_unconfigure`` (:func:`stop_head`). That
process outlives every worker (the worker that started the head may finish while others
still use it) and runs no Ray driver of its own under xdist. Each test process only
disconnects (``ray.shutdown()``) when its session ends.

``ray stop`` is not used: it stops *every* Ray process of the user on the machine, an
external cluster included. Instead the head runs as ``ray start --head --block`` under a
small watchdog (this module run as a script) that leads a process session of its own:
every Ray process of our head is in that session, so the sweep at the end kills exactly
those, and nothing else. The watchdog also stops the head when the run's owner process
is gone, even after a SIGKILL, so a crashed run leaves no cluster behind.

The head is started with ``RAY_AUTH_MODE=disabled`` (recent Ray turns token authentication
on for ``ray start`` when a token exists in ``~/.ray``): it is a throw-away local cluster, and
its fixed-default ports (GCS, dashboard, dashboard agent, Ray Client) are taken from the
run's port broker so that two runs, or a run and a cluster of the user, never clash.
Ray's own GPU scheduling is independent of the plugin's GPU leases: a test that must keep
other tests off the GPUs its Ray tasks use should ask for them with the ``gpu`` marker.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import sim
from ..gpu.isolation import TF_GROWTH, VISIBLE_VARS, XLA_FRACTION, XLA_PREALLOCATE
from ..procs import kill_and_wait
from ..run import rundir

if TYPE_CHECKING:  # psutil, like Ray, is imported where it is used: the plugin loads this module
    import psutil
    import pytest

    from ..run.session import GpuRun

STATE_FILE = "ray-head.json"
LOCK_FILE = "ray-head.lock"
LOG_FILE = "ray-head.log"
AUTH_ENV = "RAY_AUTH_MODE"
STOP_GRACE = 15.0  # seconds the head may take to drain after SIGTERM before it is killed
# a test's lease, not the run's
_LEASE_VARS = (*VISIBLE_VARS, "ROCR_VISIBLE_DEVICES", sim.TAG_ENV, XLA_PREALLOCATE, XLA_FRACTION, TF_GROWTH)
_MAX_TEMP_DIR = 40  # Ray's AF_UNIX sockets live ~65 characters below its temp dir (limit: 107)
_WATCHDOGS: dict[int, subprocess.Popen[bytes]] = {}  # started here: kept to be reaped, not warned about


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


# -- pure helpers ----------------------------------------------------------------------


def cpu_count() -> int:
    """CPUs this process may run on (its affinity where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def head_env(environ: Mapping[str, str], gpus: Sequence[int], search_path: Iterable[str] = ()) -> dict[str, str]:
    """The head's environment: the run's GPUs (not a test's lease), no auth, the driver's code.

    Ray takes a node's GPU ids from ``CUDA_VISIBLE_DEVICES`` and hands each task a subset
    of them, so listing the run's physical indices (in PCI bus order, as everywhere in the
    plugin) makes a task's ``CUDA_VISIBLE_DEVICES`` name real (or simulated) devices.
    ``search_path`` goes in front of ``PYTHONPATH`` so that Ray workers can import the test
    modules whose functions they run (pytest puts test directories on the driver's
    ``sys.path`` only).
    """
    env = {k: v for k, v in environ.items() if k not in _LEASE_VARS}
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in gpus)
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


def _tail(path: Path, lines: int = 25) -> str:
    """The end of the head's log for an error message (the run directory goes with the run)."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        text = []
    if not text:
        return f"its log {path} is empty so far"
    return f"last lines of its log {path}:\n" + "\n".join(f"    {line}" for line in text[-lines:])


# -- the fixture -----------------------------------------------------------------------


def fixture(request: pytest.FixtureRequest, run: GpuRun) -> Generator[RayCluster, None, None]:
    """``ray_cluster``: connect (starting the run's head if needed), disconnect at session end."""
    import pytest

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
        _disconnect()


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
        parts = host_port(external)
        if parts is not None:
            _wait_tcp(parts, deadline, lambda: None, f"the Ray cluster at --ray-address {external}", timeout)
        resources = _init_and_wait(external, {}, deadline, f"the Ray cluster at --ray-address {external}", timeout)
        return RayCluster(_gcs_address(external), resources, started_by_plugin=False)
    head = ensure_head(run)
    what = f"the Ray head started by pytest-gpu at {head['address']} (log: {head['log']})"
    expected = {k: float(v) for k, v in head["expected"].items()}
    if ray.is_initialized():  # this process started the head and is connected already
        resources = {str(k): float(v) for k, v in ray.cluster_resources().items()}
    else:
        resources = _init_and_wait(head["address"], expected, time.monotonic() + timeout, what, timeout)
    return RayCluster(head["address"], resources, True, tuple(head["gpus"]), Path(head["log"]))


def _disconnect() -> None:
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def _gcs_address(fallback: str) -> str:
    import ray

    try:
        return str(ray.get_runtime_context().gcs_address)
    except Exception:
        return fallback


def _init_and_wait(
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
            resources = {str(k): float(v) for k, v in ray.cluster_resources().items()}
        except Exception:
            resources = {}
        if resources and all(resources.get(k, 0.0) >= v for k, v in expected.items()):
            return resources
        if time.monotonic() >= deadline:
            _disconnect()
            want = ", ".join(f"{k}={v:g}" for k, v in expected.items()) or "any resources"
            raise RayClusterError(
                f"{what} did not report {want} within {timeout:g}s (--ray-start-timeout); it has {resources or 'none'}"
            )
        time.sleep(0.1)


def _wait_tcp(
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


def _wait_raylet(sid: int, deadline: float, dead: Callable[[], str | None], what: str, timeout: float) -> None:
    """Poll until the head's raylet runs: ``ray.init`` looks for a local raylet in 1 s steps
    and for up to a minute of its own, so it is called only once there is one."""
    while not any(_name(p) == "raylet" for p in session_processes(sid)):
        reason = dead()
        if reason is not None:
            raise RayClusterError(f"{what} did not come up: {reason}")
        if time.monotonic() >= deadline:
            raise RayClusterError(f"{what} started no raylet within {timeout:g}s (--ray-start-timeout)")
        time.sleep(0.1)


def _name(proc: psutil.Process) -> str:
    import psutil

    try:
        return str(proc.name())
    except psutil.Error:
        return ""


# -- the run's own head ----------------------------------------------------------------


def ensure_head(run: GpuRun) -> dict[str, Any]:
    """The run's head record, starting the head if no process of this run has yet.

    Start-once across xdist workers through a file lock in the shared run directory; a
    failed start is recorded too and raised again in every process that asks.
    """
    from filelock import FileLock, Timeout

    state_path = run.run_dir / STATE_FILE
    lock = FileLock(str(run.run_dir / LOCK_FILE))
    try:
        with lock.acquire(timeout=run.settings.ray_start_timeout + 2 * STOP_GRACE):
            if not state_path.exists():
                _write_json(state_path, _start_head(run))
            state = json.loads(state_path.read_text())
    except Timeout:
        raise RayClusterError(
            f"another process of this run held {lock.lock_file} for longer than "
            f"{run.settings.ray_start_timeout:g}s (--ray-start-timeout) while starting the Ray head"
        ) from None
    if "error" in state:
        raise RayClusterError(str(state["error"]))
    return dict(state)


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _start_head(run: GpuRun) -> dict[str, Any]:
    """Start the head under its watchdog and wait for it; the record (or an error record)."""
    from ..leasing.client import BrokerError

    owner = f"ray-head@{os.getpid()}"
    try:
        ports = run.client.ports(4, owner)
    except BrokerError as exc:
        return {"error": f"no ports for the Ray head: {exc}"}
    try:
        return _launch(run, ports)
    finally:
        # Ray binds them now (or is gone); the broker checks a port is free before handing it out
        run.client.release_ports(owner)


def _launch(run: GpuRun, ports: list[int]) -> dict[str, Any]:
    import psutil

    temp_dir, separate = temp_dir_for(run.run_dir)
    gpus = tuple(d.index for d in run.inventory.devices)
    spec = HeadSpec(
        num_cpus=cpu_count(),
        gpus=gpus,
        gcs_port=ports[0],
        dashboard_port=ports[1],
        agent_port=ports[2],
        client_port=ports[3] if importlib.util.find_spec("grpc") is not None else None,
        temp_dir=temp_dir,
        env=head_env(os.environ, gpus, driver_search_path()),
    )
    log = run.run_dir / LOG_FILE
    owner = json.loads((run.run_dir / rundir.OWNER_FILE).read_text())
    watchdog = [
        sys.executable,
        "-m",
        "pytest_gpu.raycluster",
        "--owner",
        str(owner["pid"]),
        "--owner-ctime",
        repr(owner["ctime"]),
        "--",
        *spec.command(),
    ]
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            watchdog,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=spec.env,
            start_new_session=True,  # its own session: found and stopped by session id
        )
    _WATCHDOGS[proc.pid] = proc
    record: dict[str, Any] = {
        "address": spec.address,
        "log": str(log),
        "gpus": list(gpus),
        "expected": spec.expected(),
        "watchdog": proc.pid,
        "ctime": psutil.Process(proc.pid).create_time(),
        "temp_dir": str(temp_dir),
        "separate_temp_dir": separate,
        "command": spec.command(),
    }
    _write_json(run.run_dir / STATE_FILE, record)  # stop_head() finds it even if we fail below
    timeout = run.settings.ray_start_timeout
    deadline = time.monotonic() + timeout
    what = f"the Ray head started by pytest-gpu at {spec.address}"

    def dead() -> str | None:
        code = proc.poll()
        return None if code is None else f"`ray start` exited with status {code}; {_tail(log)}"

    try:
        _wait_tcp(("127.0.0.1", spec.gcs_port), deadline, dead, what, timeout)
        _wait_raylet(proc.pid, deadline, dead, what, timeout)
        _init_and_wait(spec.address, spec.expected(), deadline, f"{what} (log: {log})", timeout)
    except RayClusterError as exc:
        _disconnect()
        _stop(record)
        message = str(exc)
        if "its log" not in message:
            message += f"\n{_tail(log)}"
        return {"error": message}
    record["address"] = _gcs_address(spec.address)  # and stay connected: connect() goes on from here
    return record


def stop_head(run: GpuRun) -> None:
    """At the end of the run, in the process that owns the run directory: stop our head.

    A no-op in xdist workers, when no test asked for ``ray_cluster``, and for an external
    cluster (no record is written for one). Does not import Ray.
    """
    if run.broker is None:
        return
    state_path = run.run_dir / STATE_FILE
    try:
        record = json.loads(state_path.read_text())
    except (OSError, ValueError):
        return
    _disconnect()
    _stop(record)
    state_path.unlink(missing_ok=True)


def _stop(record: Mapping[str, Any]) -> None:
    import psutil

    pid = record.get("watchdog")
    if not isinstance(pid, int):
        return
    ctime = float(record.get("ctime", 0.0))
    try:
        watchdog = psutil.Process(pid)
        if abs(watchdog.create_time() - ctime) > 0.01:
            watchdog = None
    except psutil.Error:
        watchdog = None
    if watchdog is not None:
        try:
            watchdog.terminate()  # it drains the head, then kills what is left of its session
            watchdog.wait(STOP_GRACE + 5)
        except psutil.TimeoutExpired:
            pass
        except psutil.Error:
            pass
    kill_session(pid, ctime)
    child = _WATCHDOGS.pop(pid, None)
    if child is not None:
        child.poll()  # reaped; no "still running" ResourceWarning later
    if record.get("separate_temp_dir"):
        import shutil

        shutil.rmtree(str(record["temp_dir"]), ignore_errors=True)


def session_processes(sid: int, since: float = 0.0, exclude: Iterable[int] = ()) -> list[psutil.Process]:
    """Live processes of session ``sid`` started at or after ``since`` (not zombies)."""
    import psutil

    skip = set(exclude)
    found = []
    for proc in psutil.process_iter(["create_time", "status"]):
        if proc.pid in skip:
            continue
        try:
            if os.getsid(proc.pid) != sid:
                continue
        except OSError:
            continue
        if proc.info["status"] == psutil.STATUS_ZOMBIE or (proc.info["create_time"] or 0.0) < since - 0.01:
            continue
        found.append(proc)
    return found


def kill_session(sid: int, since: float = 0.0, exclude: Iterable[int] = ()) -> None:
    """SIGKILL every live process of session ``sid`` (started since ``since``), and wait for them."""
    kill_and_wait(session_processes(sid, since, exclude))


# -- the watchdog: python -m pytest_gpu.raycluster --owner PID --owner-ctime T -- ray start ...


def _owner_alive(pid: int, ctime: float) -> bool:
    import psutil

    try:
        proc = psutil.Process(pid)
        return abs(proc.create_time() - ctime) < 0.01 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _die_with_parent() -> None:  # pragma: no cover - runs in the forked child
    """Linux: SIGTERM this child when the watchdog dies, however it dies."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def watch(owner_pid: int, owner_ctime: float, command: Sequence[str], poll: float = 0.5) -> int:
    """Run ``command`` (the head) until it exits, the owner dies or this process is told to stop.

    Then give the head ``STOP_GRACE`` seconds to drain after SIGTERM and SIGKILL what is
    left of this process's session. Returns 0 when it stopped the head, else the head's
    own exit status.
    """
    stopping: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        stopping.append(signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, on_signal)
    preexec = _die_with_parent if sys.platform.startswith("linux") else None
    child = subprocess.Popen(list(command), preexec_fn=preexec)  # the watchdog has one thread
    while not stopping and child.poll() is None and _owner_alive(owner_pid, owner_ctime):
        time.sleep(poll)
    exited = child.poll()  # None: stopped by us (owner gone or told to), not on its own
    if exited is None:
        child.terminate()
        try:
            child.wait(STOP_GRACE)
        except subprocess.TimeoutExpired:
            pass
    kill_session(os.getsid(0), exclude=(os.getpid(),))
    if exited is None:
        return 0
    return exited if exited >= 0 else 128 - exited


def main(argv: Sequence[str] | None = None) -> int:
    """The watchdog's command line (see :func:`watch`)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m pytest_gpu.raycluster", description=watch.__doc__)
    parser.add_argument("--owner", type=int, required=True, help="pid of the run's owner process")
    parser.add_argument("--owner-ctime", type=float, required=True, help="its create time (psutil)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- ray start --head --block ...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    return watch(args.owner, args.owner_ctime, command)


if __name__ == "__main__":
    sys.exit(main())
