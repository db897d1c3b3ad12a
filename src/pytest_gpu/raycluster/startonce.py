"""Starting the run's own Ray head once, for all processes of the run.

Under pytest-xdist every worker is its own process with its own Ray driver. A head per
worker would cost each worker a head's start-up (seconds) and a GCS, raylet and agents
of its own, so there is one head per run: the first process whose test asks for
``ray_cluster`` takes a file lock in the run directory (shared by the controller and its
workers), starts the head, waits until it is ready and records its address in
``ray-head.json``; the others wait on the lock, read the record and connect. A failed
start is recorded as well, so the other workers fail at once with the same message
instead of each waiting out the timeout again.

The head runs as ``ray start --head --block`` under its watchdog (:mod:`.watchdog`),
which leads a process session of its own and stops the head when the run's owner dies.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..gpu.verification import claim_processes
from ..leasing.client import BrokerError
from ..run import rundir
from ..vendors import registry as vendors
from .head import (
    LOCK_FILE,
    LOG_FILE,
    STATE_FILE,
    HeadSpec,
    RayClusterError,
    cpu_count,
    driver_search_path,
    head_env,
    log_tail,
    temp_dir_for,
)
from .readiness import disconnect, gcs_address, init_and_wait, wait_tcp
from .stop import RAY_HEAD, STOP_GRACE, WATCHDOGS, process_name, session_processes, stop

if TYPE_CHECKING:
    from ..run.session import GpuRun

# by name, not imported: the package must not hold the module that `python -m` is about to run
WATCHDOG_MODULE = f"{__package__}.watchdog"


def ensure_head(run: GpuRun) -> dict[str, Any]:
    """The run's head record, starting the head if no process of this run has yet.

    Start-once across xdist workers through a file lock in the shared run directory; a
    failed start is recorded too and raised again in every process that asks.
    """
    from filelock import FileLock, Timeout

    state_path = run.run_dir / STATE_FILE
    lock = FileLock(str(run.run_dir / LOCK_FILE))
    try:
        # the holder may take the start timeout, then stopping a failed head (STOP_GRACE + 5 s)
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
    owner = f"{RAY_HEAD.name}@{os.getpid()}"  # port owners read "<who>@<unique>"
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
        env=head_env(
            os.environ, driver_search_path(), gpu_env=vendors.of(run.inventory.vendor).ray_env(run.inventory.devices)
        ),
    )
    log = run.run_dir / LOG_FILE
    owner = json.loads((run.run_dir / rundir.OWNER_FILE).read_text())
    cmd = [
        sys.executable,
        "-m",
        WATCHDOG_MODULE,
        "--owner",
        str(owner["pid"]),
        "--owner-ctime",
        repr(owner["ctime"]),
        "--",
        *spec.command(),
    ]
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=spec.env,
            start_new_session=True,  # its own session: found and stopped by session id
        )
    WATCHDOGS[proc.pid] = proc
    # the head (its watchdog's session) outlives the test that asked for it: its GPU use is the head's
    claim_processes([proc.pid], RAY_HEAD.name)
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
        return None if code is None else f"`ray start` exited with status {code}; {log_tail(log)}"

    try:
        wait_tcp(("127.0.0.1", spec.gcs_port), deadline, dead, what, timeout)
        _wait_raylet(proc.pid, deadline, dead, what, timeout)
        init_and_wait(spec.address, spec.expected(), deadline, f"{what} (log: {log})", timeout)
    except RayClusterError as exc:
        disconnect()
        stop(record)
        message = str(exc)
        if "its log" not in message:
            message += f"\n{log_tail(log)}"
        return {"error": message}
    record["address"] = gcs_address(spec.address)  # and stay connected: connect() goes on from here
    return record


def _wait_raylet(sid: int, deadline: float, dead: Callable[[], str | None], what: str, timeout: float) -> None:
    """Poll until the head's raylet runs: ``ray.init`` looks for a local raylet in 1 s steps
    and for up to a minute of its own, so it is called only once there is one."""
    while not any(process_name(p) == "raylet" for p in session_processes(sid)):
        reason = dead()
        if reason is not None:
            raise RayClusterError(f"{what} did not come up: {reason}")
        if time.monotonic() >= deadline:
            raise RayClusterError(f"{what} started no raylet within {timeout:g}s (--ray-start-timeout)")
        time.sleep(0.1)
