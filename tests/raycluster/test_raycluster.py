"""The ``ray_cluster`` fixture: a local head with the run's (simulated) GPUs, or an external cluster.

Ray starts slowly (a head takes 5-10 s here), so each inner run starts at most one
cluster and its tests share it; processes are checked with psutil after every run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from conftest import require
from helpers import patience
from pytest_gpu.base.procs import owner_alive
from pytest_gpu.base.requests import DefaultMemory
from pytest_gpu.raycluster.head import HeadSpec, driver_search_path, head_env, host_port, temp_dir_for
from pytest_gpu.raycluster.startonce import WATCHDOG_MODULE
from pytest_gpu.raycluster.stop import STOP_GRACE, kill_session, session_processes
from pytest_gpu.run.options import Settings
from pytest_gpu.sim.spec import parse
from pytest_gpu.vendors.nvidia import NVIDIA

# Inner suite. It lives in tests/ below the inner rootdir, so Ray workers can import the
# helper it calls only through the PYTHONPATH the plugin gives the head.
RAY_SUITE = """
import json
import os
import re
from pathlib import Path

import psutil
import pytest
import ray

from pytest_gpu.raycluster.head import STATE_FILE
from pytest_gpu.gpu.verification import claimed
from pytest_gpu.raycluster.stop import session_processes

OUT = Path({out!r})


def visible_devices():
    return os.environ.get("CUDA_VISIBLE_DEVICES")


@ray.remote(num_gpus=1)
def one_gpu():
    return visible_devices(), [str(i) for i in ray.get_gpu_ids()]


def record(ray_cluster, name):
    data = {{"address": ray_cluster.address, "started_by_plugin": ray_cluster.started_by_plugin}}
    data["claimed"] = {{str(pid): holder for pid, holder in claimed().items()}}
    if ray_cluster.log is not None:
        state = json.loads((ray_cluster.log.parent / STATE_FILE).read_text())
        procs = session_processes(state["watchdog"], state["ctime"])
        data["state"] = state
        data["procs"] = []
        for p in procs:
            try:
                data["procs"].append([p.pid, p.name(), p.create_time()])
            except psutil.NoSuchProcess:
                pass  # a short-lived Ray worker that ended meanwhile: nothing left to stop
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    (OUT / f"{{name}}-{{worker}}-{{os.getpid()}}.json").write_text(json.dumps(data))


def test_resources(ray_cluster):
    assert ray_cluster.started_by_plugin
    assert ray_cluster.gpus == (0, 1, 2, 3)
    assert ray_cluster.resources["GPU"] == 4
    assert ray.cluster_resources()["GPU"] == 4
    assert ray_cluster.resources["CPU"] >= 1
    record(ray_cluster, "resources")


def test_task_with_one_gpu_sees_one_index(ray_cluster):
    results = ray.get([one_gpu.remote() for _ in range(4)])
    for visible, ids in results:
        assert re.fullmatch(r"[0-3]", visible), visible
        assert ids == [visible]
    record(ray_cluster, "task")


@pytest.mark.parametrize("i", range({records}))
def test_record(ray_cluster, i):
    record(ray_cluster, "head")
"""


def _mentions(text: str) -> list[str]:
    """Live processes whose command line mentions ``text``."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if any(text in part for part in proc.info["cmdline"] or ()):
            found.append(f"{proc.pid} {' '.join(proc.info['cmdline'])[:150]}")
    return found


def _records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]


def _assert_head_gone(record: dict[str, Any]) -> None:
    state = record["state"]
    names = {name for _, name, _ in record["procs"]}
    assert {"raylet", "gcs_server"} <= names, names  # the check below looks at real Ray processes
    survivors = [(pid, name) for pid, name, ctime in record["procs"] if owner_alive(pid, ctime)]
    assert not survivors, survivors
    assert not owner_alive(state["watchdog"], state["ctime"])
    assert not session_processes(state["watchdog"], state["ctime"])
    assert not _mentions(state["temp_dir"])


def _suite(pytester: pytest.Pytester, records: int = 1) -> Path:
    out = pytester.path / "out"
    out.mkdir()
    tests = pytester.path / "tests"
    tests.mkdir()
    (tests / "test_ray_suite.py").write_text(RAY_SUITE.format(out=str(out), records=records))
    return out


# -- a head started by the plugin --------------------------------------------------------


def test_plugin_head_has_the_runs_gpus_and_is_gone_after_the_session(gpu_pytester, run_inner):
    require("Ray", module="ray")
    out = _suite(gpu_pytester)
    result = run_inner("--gpus", "sim:4x16GiB", "tests", subprocess=True, timeout=180)
    result.assert_outcomes(passed=3)
    record = _records(out)[0]
    assert len({r["address"] for r in _records(out)}) == 1
    assert record["started_by_plugin"]
    assert record["state"]["gpus"] == [0, 1, 2, 3]
    assert record["address"] == record["state"]["address"]
    # the head's processes are the head's: never charged to the test that runs beside them
    assert record["claimed"] == {str(record["state"]["watchdog"]): "the run's Ray head"}
    _assert_head_gone(record)


def test_xdist_workers_share_one_head_stopped_by_the_controller(gpu_pytester, run_inner):
    require("Ray", module="ray")
    out = _suite(gpu_pytester, records=4)
    result = run_inner("--gpus", "sim:4x16GiB", "-n", "2", "tests", subprocess=True, timeout=180)
    result.assert_outcomes(passed=6)
    records = _records(out)
    workers = {r["state"]["watchdog"] for r in records}
    assert len(workers) == 1, "one head for the whole run"
    assert len({r["address"] for r in records}) == 1
    pids = {p.name.rsplit("-", 1)[1] for p in out.glob("*.json")}
    assert len(pids) == 2, "both workers connected"
    _assert_head_gone(records[0])


# a traceback from logging's fork handler at the head's teardown appears now and then under load
# (seen three times under load since 2026-11-24): not pytest-gpu's; run again once
@pytest.mark.flaky(reruns=1)
def test_head_that_does_not_come_up_in_time_is_a_clear_error_in_every_worker(gpu_pytester, run_inner):
    require("Ray", module="ray")
    gpu_pytester.makepyfile(
        test_slow="""
        import pytest

        @pytest.mark.parametrize("i", range(4))
        def test_uses_ray(ray_cluster, i):
            pass
        """
    )
    started = time.monotonic()
    result = run_inner("--gpus", "sim:2x16GiB", "-n", "2", "--ray-start-timeout", "0.5", subprocess=True)
    elapsed = time.monotonic() - started
    result.assert_outcomes(errors=4)
    result.stdout.re_match_lines(
        [
            r".*pytest-gpu: the Ray head started by pytest-gpu at 127\.0\.0\.1:\d+ "
            r".*within 0\.5s \(--ray-start-timeout\).*"
        ]
    )
    out = result.stdout.str()
    log = re.search(r"(/\S+)/ray-head\.log", out)
    assert log is not None, out
    assert "Traceback" not in out
    assert elapsed < 60, "one start attempt for the run, the other worker fails fast"
    assert not _mentions(log.group(1)), "the failed head was stopped"


def test_sigkill_of_the_run_stops_its_head(gpu_pytester, run_inner):
    require("Ray", module="ray")
    out = gpu_pytester.path / "out"
    out.mkdir()
    gpu_pytester.makepyfile(
        test_crash=f"""
        import json
        import os
        import signal

        from pytest_gpu.raycluster.head import STATE_FILE
        from pytest_gpu.raycluster.stop import session_processes

        def test_crash(ray_cluster):
            state = json.loads((ray_cluster.log.parent / STATE_FILE).read_text())
            procs = session_processes(state["watchdog"], state["ctime"])
            data = {{"state": state, "procs": [[p.pid, p.name(), p.create_time()] for p in procs]}}
            with open({str(out / "crash.json")!r}, "w") as f:
                json.dump(data, f)
            os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    run_inner("--gpus", "sim:1x16GiB", subprocess=True, timeout=180)
    (record,) = _records(out)
    deadline = time.monotonic() + STOP_GRACE + patience(10)
    while time.monotonic() < deadline and session_processes(record["state"]["watchdog"], record["state"]["ctime"]):
        time.sleep(0.2)
    _assert_head_gone(record)


# -- an external cluster ---------------------------------------------------------------


@pytest.fixture
def external_head(ports) -> Iterator[str]:
    """A Ray head of the test's own (``ray start --head --block``, own session): its address."""
    require("Ray", module="ray")
    gcs, dashboard, agent = ports(3)
    temp = tempfile.mkdtemp(prefix="rayext-", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_GPU_") and k != "CUDA_VISIBLE_DEVICES"}
    env["RAY_AUTH_MODE"] = "disabled"
    cmd = [
        sys.executable,
        "-m",
        "ray.scripts.scripts",
        "start",
        "--head",
        "--block",
        f"--port={gcs}",
        f"--dashboard-port={dashboard}",
        f"--dashboard-agent-listen-port={agent}",
        "--include-dashboard=false",
        "--num-cpus=1",
        "--num-gpus=0",
        "--disable-usage-stats",
        f"--temp-dir={temp}",
    ]
    log = open(Path(temp) / "head.log", "wb")  # closed in the finalizer
    head = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    ctime = psutil.Process(head.pid).create_time()
    try:
        deadline = time.monotonic() + patience(60)
        while True:
            try:
                socket.create_connection(("127.0.0.1", gcs), timeout=0.5).close()
                break
            except OSError:
                assert head.poll() is None, (Path(temp) / "head.log").read_text()
                assert time.monotonic() < deadline, "external head did not open its port"
                time.sleep(0.1)
        yield f"127.0.0.1:{gcs}"
        # still alive after the inner run: the plugin never stops a cluster it did not start
        names = {p.name() for p in session_processes(head.pid, ctime)}
        assert head.poll() is None
        assert {"raylet", "gcs_server"} <= names, names
        socket.create_connection(("127.0.0.1", gcs), timeout=2).close()
    finally:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(patience(20))
        except subprocess.TimeoutExpired:
            pass
        kill_session(head.pid, ctime)
        head.wait()
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def test_external_address_is_used_and_not_stopped(gpu_pytester, run_inner, external_head):
    gpu_pytester.makepyfile(
        test_external=f"""
        import ray

        @ray.remote
        def square(x):
            return x * x

        def test_external(ray_cluster):
            assert not ray_cluster.started_by_plugin
            assert ray_cluster.gpus is None and ray_cluster.log is None
            assert ray_cluster.address.endswith(":{external_head.rsplit(":", 1)[1]}")
            assert ray_cluster.resources["CPU"] == 1
            assert ray.get(square.remote(7)) == 49

        def test_again(ray_cluster):
            assert ray.is_initialized()
        """
    )
    result = run_inner("--gpus", "sim:2x16GiB", "--ray-address", external_head, subprocess=True, timeout=120)
    result.assert_outcomes(passed=2)


def test_unreachable_address_is_a_clear_error(gpu_pytester, run_inner):
    require("Ray", module="ray")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens on it once closed
    gpu_pytester.makepyfile("def test_a(ray_cluster):\n    pass\n\ndef test_b(ray_cluster):\n    pass\n")
    started = time.monotonic()
    result = run_inner("--ray-address", f"127.0.0.1:{port}", "--ray-start-timeout", "1.5", subprocess=True)
    assert time.monotonic() - started < 30
    result.assert_outcomes(errors=2)
    result.stdout.fnmatch_lines(
        [
            f"*pytest-gpu: the Ray cluster at --ray-address 127.0.0.1:{port} is not reachable "
            "within 1.5s (--ray-start-timeout)*"
        ]
    )
    assert "Traceback" not in result.stdout.str()


# -- without starting anything ---------------------------------------------------------


def test_plugin_does_not_import_ray():
    code = "import sys, pytest_gpu.plugin; assert 'ray' not in sys.modules, 'ray imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_suite_without_ray_cluster_starts_nothing(gpu_pytester, run_inner):
    gpu_pytester.makepyfile("import sys\n\ndef test_cpu():\n    assert 'ray' not in sys.modules\n")
    result = run_inner("--gpus", "sim:1x16GiB", subprocess=True)
    result.assert_outcomes(passed=1)


def test_missing_ray_is_a_clear_error(gpu_pytester, run_inner):
    gpu_pytester.makeconftest("import sys\n\nsys.modules['ray'] = None  # import ray: ImportError\n")
    gpu_pytester.makepyfile("def test_a(ray_cluster):\n    pass\n")
    result = run_inner(subprocess=True)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*pytest-gpu: the ray_cluster fixture needs Ray: pip install 'pytest-gpu?ray?' *"])


def test_bad_start_timeout_is_a_usage_error(gpu_pytester, run_inner):
    gpu_pytester.makepyfile("def test_cpu():\n    pass\n")
    result = run_inner("--ray-start-timeout", "soon")
    result.stderr.fnmatch_lines(["*--ray-start-timeout: expected a positive number of seconds, got 'soon'*"])


def test_ray_settings_reach_xdist_workers():
    settings = Settings(
        gpus="sim:1x1GiB",
        default_memory=DefaultMemory(True, None),
        oversize="skip",
        verify="fail",
        wait_timeout=1.0,
        context_overhead=0,
        port_range=(20000, 20100),
        ray_address="10.0.0.1:6379",
        ray_start_timeout=7.5,
    )
    back = Settings.from_wire(json.loads(json.dumps(settings.to_wire())))
    assert (back.ray_address, back.ray_start_timeout) == ("10.0.0.1:6379", 7.5)


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("127.0.0.1:6379", ("127.0.0.1", 6379)),
        ("head-node.cluster:1234", ("head-node.cluster", 1234)),
        ("ray://10.1.2.3:10001", ("10.1.2.3", 10001)),
        ("[::1]:6379", ("::1", 6379)),
        ("auto", None),
        ("local", None),
    ],
)
def test_host_port(address, expected):
    assert host_port(address) == expected


def test_head_env_has_the_runs_gpus_not_a_tests_lease():
    environ = {
        "CUDA_VISIBLE_DEVICES": "2",  # the lease of the test that set the fixture up
        "HIP_VISIBLE_DEVICES": "2",
        "PYTEST_GPU_SIM_TAG": "gw0-3",
        "PYTEST_GPU_SIM_LEDGER": "/run/ledger",
        "PYTHONPATH": "/already",
        "RAY_AUTH_MODE": "token",
    }
    gpus = parse("sim:4x16GiB").devices()[0]
    env = head_env(environ, ["/repo/tests", "/repo/tests"], gpu_env=NVIDIA.ray_env(gpus))
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert "HIP_VISIBLE_DEVICES" not in env and "PYTEST_GPU_SIM_TAG" not in env
    assert env["PYTEST_GPU_SIM_LEDGER"] == "/run/ledger"  # simulated GPUs work in Ray tasks too
    assert env["RAY_AUTH_MODE"] == "disabled"
    assert env["PYTHONPATH"] == os.pathsep.join(["/repo/tests", "/already"])


def test_head_command_declares_gpus_and_avoids_default_ports(tmp_path):
    spec = HeadSpec(
        num_cpus=2,
        gpus=(0, 2),
        gcs_port=21000,
        dashboard_port=21001,
        agent_port=21002,
        client_port=None,
        temp_dir=tmp_path,
    )
    cmd = spec.command("python")
    assert cmd[:5] == ["python", "-m", "ray.scripts.scripts", "start", "--head"]
    for flag in ("--block", "--port=21000", "--num-gpus=2", "--num-cpus=2", "--dashboard-port=21001"):
        assert flag in cmd
    assert "--dashboard-agent-listen-port=21002" in cmd
    assert not any(c.startswith("--ray-client-server-port") for c in cmd)
    assert spec.expected() == {"CPU": 2.0, "GPU": 2.0}
    assert HeadSpec(1, (), 1, 2, 3, 4, tmp_path).expected() == {"CPU": 1.0}


def test_driver_search_path_keeps_test_dirs_not_the_interpreters(tmp_path):
    site = next(p for p in sys.path if p.endswith("site-packages"))
    assert driver_search_path([str(tmp_path), site, "", str(tmp_path / "missing")]) == [str(tmp_path)]


def test_long_run_dir_gets_a_short_ray_temp_dir(tmp_path):
    run_dir = Path(tempfile.mkdtemp(prefix="r-", dir="/tmp"))
    try:
        assert temp_dir_for(run_dir) == (run_dir / "ray", False)
    finally:
        shutil.rmtree(run_dir)
    long_dir = tmp_path / ("d" * 60)
    long_dir.mkdir()
    path, separate = temp_dir_for(long_dir)
    try:
        assert separate and len(str(path)) <= 40 and path.is_dir()
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_stopping_a_head_forgets_its_processes_claim():
    from pytest_gpu.gpu.verification import claim_processes, claimed
    from pytest_gpu.raycluster.stop import RAY_HEAD, stop

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    claim_processes([gone.pid], RAY_HEAD.name)
    stop({"watchdog": gone.pid, "ctime": 0.0})
    assert gone.pid not in claimed()


def test_watchdog_stops_its_command_when_the_owner_dies(tmp_path):
    """The watchdog alone, with ``sleep`` for a head: owner gone -> command and session gone.

    Run as the launcher runs it; ``-W error::RuntimeWarning`` catches runpy's warning about a
    module the package imported before ``-m`` ran it (it would run twice)."""
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    owner_ctime = psutil.Process(owner.pid).create_time()
    script = "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"
    watchdog = subprocess.Popen(
        [
            sys.executable,
            "-W",
            "error::RuntimeWarning",
            "-m",
            WATCHDOG_MODULE,
            "--owner",
            str(owner.pid),
            "--owner-ctime",
            repr(owner_ctime),
            "--",
            sys.executable,
            "-c",
            script,
        ],
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + patience(20)
        while len(session_processes(watchdog.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        members = session_processes(watchdog.pid)
        assert len(members) == 3, members  # watchdog, its command, the command's child
        owner.kill()
        owner.wait()
        assert watchdog.wait(STOP_GRACE + patience(5)) == 0
        psutil.wait_procs(members, timeout=patience(5))
        assert not session_processes(watchdog.pid)
    finally:
        owner.kill()
        kill_session(watchdog.pid)
        watchdog.wait()
