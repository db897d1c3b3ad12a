"""Crash safety: a SIGKILLed worker, a SIGKILLed controller, and run directories."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from helpers import patience

INNER_ARGS = ("-p", "no:cacheprovider", "-p", "no:benchmark", "-p", "no:hypothesispytest")  # as run_inner's

CRASH = """
import os
import signal
import time

import pytest
from pytest_gpu.run.lifecycle import RUN_KEY

@pytest.mark.gpu(2, exclusive=True)
def test_crash(request, gpu, ports):
    ports(2)
    open({holding!r}, "w").close()
    # die only once test_waiter is queued behind this test's two GPUs
    client = request.config.stash[RUN_KEY].client
    deadline = time.monotonic() + 30
    while not client.status()["waiting"] and time.monotonic() < deadline:
        time.sleep(0.02)
    with open({killed!r}, "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)

@pytest.mark.gpu(2, exclusive=True)
def test_waiter(gpu):
    with open({granted!r}, "w") as f:
        f.write(repr(time.time()))
    assert gpu.indices == (0, 1)

@pytest.mark.gpu(2, exclusive=True)
def test_after(gpu, ports):
    assert gpu.indices == (0, 1)
    assert len(ports(2)) == 2
"""


CRASH_CONFTEST = """
import os
import time
import pytest

@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # before pytest-gpu acquires: the waiter asks only once test_crash holds both GPUs
    if item.name == "test_waiter":
        deadline = time.monotonic() + 30
        while not os.path.exists({holding!r}) and time.monotonic() < deadline:
            time.sleep(0.02)
"""


def test_sigkill_of_worker_holding_two_gpus(gpu_pytester, run_inner):
    killed = gpu_pytester.path / "killed"
    granted = gpu_pytester.path / "granted"
    holding = str(gpu_pytester.path / "holding")
    gpu_pytester.makeconftest(CRASH_CONFTEST.format(holding=holding))
    gpu_pytester.makepyfile(test_crash=CRASH.format(killed=str(killed), granted=str(granted), holding=holding))
    # three tests on two workers go round-robin: crash -> gw0, waiter -> gw1, after -> gw0
    # (re-queued when gw0 dies); the waiter's timeout is far beyond the bound checked below.
    # xdist's scheduling: the GPU scheduler would hold the waiter back instead of sending it
    # to wait at the broker, and test_crash would wait its whole 30 s for a waiter.
    args = ("--gpus", "sim:2x16GiB", "-n", "2", "--gpu-schedule=off", "--gpu-wait-timeout", "20")
    result = run_inner(*args, subprocess=True)
    result.assert_outcomes(passed=2, failed=1)
    out = result.stdout.str()
    crashed = re.search(r"worker '(gw\d+)' crashed while running 'test_crash\.py::test_crash'", out)
    assert crashed is not None, out
    worker = crashed.group(1)
    result.stdout.re_match_lines(
        [
            rf"pytest-gpu: worker {worker} \(pid \d+\) died while running test_crash\.py::test_crash; "
            r"its GPUs 0 and 1 and its 2 ports were reclaimed$"
        ]
    )
    assert out.count("died while running") == 1
    # the queued test got the GPUs as soon as the worker died, not at its wait timeout
    delay = float(granted.read_text()) - float(killed.read_text())
    assert 0 <= delay < 3.0, delay
    result.stdout.fnmatch_lines(["pytest-gpu: * · 2 GPU tests · * · 0 violations"])


def test_sigkill_of_worker_holding_only_ports_names_the_test(gpu_pytester, run_inner):
    gpu_pytester.makepyfile(
        test_ports_crash="""
        import os
        import signal

        def test_dies(ports):
            ports(3)
            os.kill(os.getpid(), signal.SIGKILL)

        def test_next(ports):
            assert len(ports(3)) == 3
        """
    )
    result = run_inner("--gpus", "none", "-n", "2", subprocess=True)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.re_match_lines(
        [
            r"pytest-gpu: worker gw\d+ \(pid \d+\) died while running test_ports_crash\.py::test_dies; "
            r"its 3 ports were reclaimed$"
        ]
    )


SLEEPERS = """
import os
import time

import pytest

from pytest_gpu.run.lifecycle import RUN_KEY

@pytest.mark.parametrize("i", range(2))
@pytest.mark.gpu(memory="1GiB")
def test_sleep(i, gpu, port, request):
    run_dir = str(request.config.stash[RUN_KEY].run_dir)
    with open(os.path.join({marks!r}, f"running-{{i}}"), "w") as f:
        f.write(json.dumps({{"pid": os.getpid(), "run_dir": run_dir}}))
    time.sleep(120)

import json
"""


def _run_dirs() -> set[Path]:
    return set((Path(tempfile.gettempdir()) / f"pytest-gpu-{os.getuid()}").glob("run-*"))


def test_sigkill_of_controller(gpu_pytester, run_inner):
    marks = gpu_pytester.path / "marks"
    marks.mkdir()
    gpu_pytester.makepyfile(test_sleepers=SLEEPERS.format(marks=str(marks)))
    cmd = [sys.executable, "-m", "pytest", *INNER_ARGS, "-n", "2", "--gpus", "sim:2x16GiB", "test_sleepers.py"]
    proc = subprocess.Popen(
        cmd, cwd=gpu_pytester.path, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + patience(60)
        while len(list(marks.iterdir())) < 2:
            assert proc.poll() is None, "the run ended before its tests were running"
            assert time.monotonic() < deadline, "tests never started"
            time.sleep(0.05)
        workers = psutil.Process(proc.pid).children(recursive=True)
        assert len(workers) >= 2
        running = [json.loads(p.read_text()) for p in marks.iterdir()]
        assert {r["pid"] for r in running} <= {w.pid for w in workers}
        run_dir = Path(running[0]["run_dir"])
        assert run_dir.name.startswith(f"run-{proc.pid}-")
        assert run_dir.is_dir()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=patience(10))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    # the workers notice their controller is gone and exit (xdist/execnet: within ~15s)
    _, alive = psutil.wait_procs(workers, timeout=patience(30))
    leftover = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    if leftover:
        for p in leftover:
            p.kill()
    assert not leftover, f"workers still running after their controller died: {leftover}"

    # the killed controller could not clean up; the next run removes its directory
    gpu_pytester.makepyfile(test_next="def test_next():\n    pass\n")
    run_inner("--gpus", "sim:1x16GiB", "test_next.py").assert_outcomes(passed=1)
    assert not run_dir.exists()


def test_normal_runs_leave_no_run_directory(gpu_pytester, run_inner):
    seen = gpu_pytester.path / "seen"
    seen.mkdir()
    gpu_pytester.makepyfile(
        test_dirs=f"""
        import os
        import pytest
        from pytest_gpu.run.lifecycle import RUN_KEY

        @pytest.mark.parametrize("i", range(4))
        @pytest.mark.gpu(memory="1GiB")
        def test_dir(i, gpu, request):
            run_dir = str(request.config.stash[RUN_KEY].run_dir)
            assert os.path.isdir(run_dir)
            assert oct(os.stat(run_dir).st_mode & 0o777) == "0o700"
            with open(os.path.join({str(seen)!r}, f"{{i}}-{{os.getpid()}}"), "w") as f:
                f.write(run_dir)
        """
    )
    run_inner("--gpus", "sim:2x16GiB", "-n", "2", subprocess=True).assert_outcomes(passed=4)
    run_inner("--gpus", "sim:2x16GiB").assert_outcomes(passed=4)
    dirs = {Path(p.read_text()) for p in seen.iterdir()}
    assert len(dirs) == 2  # one per run: every worker of a run shares its controller's
    for run_dir in dirs:
        assert run_dir.parent == Path(tempfile.gettempdir()) / f"pytest-gpu-{os.getuid()}"
        assert not run_dir.exists()


def test_broker_socket_is_private(gpu_pytester, run_inner):
    gpu_pytester.makepyfile(
        test_sock="""
        import os
        import stat
        from pytest_gpu.run.lifecycle import RUN_KEY

        def test_sock(gpu, request):
            run_dir = str(request.config.stash[RUN_KEY].run_dir)
            sock = os.path.join(run_dir, "broker.sock")
            assert stat.S_ISSOCK(os.stat(sock).st_mode)
            assert os.stat(sock).st_mode & 0o077 == 0
            assert os.stat(os.path.dirname(run_dir)).st_mode & 0o077 == 0
        """
    )
    run_inner("--gpus", "sim:1x16GiB").assert_outcomes(passed=1)


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfds (Linux)")
def test_exiting_worker_keeps_its_contexts_counted_until_it_exits():
    """A worker that closed its connection still has CUDA contexts until its process exits."""
    from pytest_gpu.base.requests import GpuRequest
    from pytest_gpu.leasing.broker import Broker
    from pytest_gpu.leasing.client import BrokerClient
    from pytest_gpu.machine.placement import Policy

    gib = 2**30
    run_dir = Path(tempfile.mkdtemp(prefix="pytest-gpu-broker-test-"))
    broker = Broker({0: 16 * gib}, str(run_dir / "b.sock"), b"k" * 32, Policy(overhead=gib)).start()
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys\n"
            "from pytest_gpu.leasing.client import BrokerClient\n"
            "from pytest_gpu.base.requests import GpuRequest\n"
            f"c = BrokerClient({str(run_dir / 'b.sock')!r}, b'k' * 32, 'gw-exiting')\n"
            "g = c.acquire(GpuRequest(1, 2 * 2**30, False), 't', 10)\n"
            "c.release(g.key, {0})\n"
            "c.close()\n"
            "print('closed', flush=True)\n"
            "sys.stdin.readline()\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "closed"
        me = BrokerClient(str(run_dir / "b.sock"), b"k" * 32, "gw-main")
        # 16GiB - 2 contexts (the exiting worker's and mine) = 14GiB: 14.5GiB must wait
        deadline = time.monotonic() + patience(5)
        while len(broker.status()["clients"]) != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert broker.status()["contexts"][0] == ["c0~exiting"]
        with pytest.raises(Exception, match=r"waited 0\.2s"):
            me.acquire(GpuRequest(1, int(14.5 * gib), False), "big", 0.2)
        child.stdin.write("\n")
        child.stdin.close()
        child.wait(timeout=patience(10))
        grant = me.acquire(GpuRequest(1, int(14.5 * gib), False), "big", 5)
        assert grant.indices == (0,)
        me.close()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        broker.close()
        shutil.rmtree(run_dir, ignore_errors=True)
