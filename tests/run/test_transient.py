"""Infrastructure failures told apart, and retried on fresh resources (issue 32, item 2).

The decision first (pytest_gpu.run.transient: evidence in, class and reason out), then the
plugin end to end in inner runs on simulated GPUs: a foreign process's growth on a test's
GPU causing its OOM, under ``-n 2``, classed and (with ``--gpu-retry-infra``) passed on
retry on the other GPU; an assertion never classed nor rerun; a quarantine's refusal; an
``EADDRINUSE`` on a leased port; a lost worker; the junit properties.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest

from conftest import INNER_ARGS, require
from helpers import patience, wait_for
from pytest_gpu.distributed.runner import init_timeout
from pytest_gpu.run.transient import GROWTH_MIN, Evidence, address_in_use, classify, growth

GiB = 2**30
SPEC = "sim:2x16GiB"


# -- the decision ----------------------------------------------------------------------------


def test_nothing_seen_outside_is_the_test_s_own_failure() -> None:
    assert classify(Evidence()) is None  # an assertion, any error: its own
    assert classify(Evidence(out_of_memory=True)) is None  # its request is too small, or it leaks
    assert classify(Evidence(out_of_memory=True, foreign_growth={0: GROWTH_MIN - 1})) is None  # noise
    assert classify(Evidence(foreign_growth={0: 4 * GiB})) is None  # grew, but the test failed otherwise
    assert classify(Evidence(address_in_use=True)) is None  # a port it chose itself


def test_an_oom_while_memory_outside_the_run_grew_is_infrastructure() -> None:
    found = classify(Evidence(out_of_memory=True, foreign_growth={1: 12 * GiB, 0: 1}, gpus=(0, 1)))
    assert found is not None
    assert found.reason == "out of memory while memory outside the run grew on GPU 1 (+12GiB)"
    assert found.gpus == (1,) and found.retryable  # the retry avoids the GPU that grew


def test_each_kind_of_evidence_and_its_reason() -> None:
    lost = classify(Evidence(lost="worker gw0 crashed while running it"))
    assert lost is not None and lost.reason == "lost: worker gw0 crashed while running it"
    refused = classify(Evidence(quarantined_by="t.py::test_a"))
    assert refused is not None and refused.reason.startswith("quarantine: t.py::test_a left this process's CUDA")
    assert not refused.retryable  # the process stays broken: nothing fresh here
    clash = classify(Evidence(address_in_use=True, leased_ports=(35100, 35101)))
    assert clash is not None and "EADDRINUSE on a leased port (35100, 35101)" in clash.reason
    init = classify(Evidence(init_timeout="could not start its pool: not every rank connected within 2s"))
    assert init is not None and init.reason.startswith("collective initialisation timed out: could not start")


def test_eaddrinuse_is_found_in_the_exception_s_chain() -> None:
    try:
        try:
            raise OSError(errno.EADDRINUSE, "Address already in use")
        except OSError as exc:
            raise RuntimeError("the server could not start") from exc
    except RuntimeError as exc:
        assert address_in_use(exc)
    assert address_in_use(RuntimeError("DistNetworkError: ... EADDRINUSE: address already in use"))
    assert not address_in_use(OSError(errno.ECONNREFUSED, "Connection refused"))
    assert not address_in_use(AssertionError("assert 1 == 2"))


def test_growth_between_two_samples() -> None:
    assert growth({0: 0, 1: 5}, {0: 3 * GiB, 1: 5, 2: GiB}) == {0: 3 * GiB}  # GPU 2 unsampled at the start


def test_a_pool_start_that_timed_out_and_one_that_failed_otherwise() -> None:
    started = "could not start its pool of 2 ranks (gloo via spawn): not every rank connected within 2s\nlogs"
    assert init_timeout(started) == started.splitlines()[0]
    set_up = "could not set up its pool of 2 ranks (gloo via spawn):\nrank 1:\nDistStoreError: Timed out after 30s"
    assert init_timeout(set_up) == (
        "could not set up its pool of 2 ranks (gloo via spawn): DistStoreError: Timed out after 30s"
    )
    assert init_timeout("could not set up its pool:\nrank 0:\nImportError: no module named x") is None
    assert init_timeout("a rank failed: timed out") is None  # no pool start


def test_the_retry_option_is_a_flag_and_a_true_false_ini_key(gpu_pytester, run_inner, monkeypatch):
    gpu_pytester.makepyfile(
        test_flag="""
        import os
        from pytest_gpu.run.record import RUN_KEY

        def test_flag(request):
            assert request.config.stash[RUN_KEY].settings.retry_infra is (os.environ["EXPECT"] == "1")
        """
    )
    for ini, args, expect in (("", (), "0"), ("", ("--gpu-retry-infra",), "1"), ("gpu_retry_infra = yes", (), "1")):
        gpu_pytester.makeini(f"[pytest]\n{ini}\n")
        monkeypatch.setenv("EXPECT", expect)
        run_inner("--gpus", "sim:1x16GiB", *args).assert_outcomes(passed=1)
    gpu_pytester.makeini("[pytest]\ngpu_retry_infra = twice\n")
    result = run_inner("--gpus", "sim:1x16GiB")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "ERROR: ini key 'gpu_retry_infra': expected true or false, got 'twice'" in result.errlines


# -- end to end ------------------------------------------------------------------------------

GROWS = """
import os, pathlib, time, pytest
import pytest_gpu.sim as sim

SIGNALS = pathlib.Path(os.environ["SIGNALS"])

@pytest.mark.gpu(memory="4GiB")
def test_grows(gpu):
    with open(SIGNALS / "runs", "a") as out:
        out.write(f"{gpu.indices[0]}\\n")
    if not (SIGNALS / "asked").exists():  # the first run: a process outside the run fills its GPU now
        (SIGNALS / "asked").write_text(str(gpu.indices[0]))
        deadline = time.time() + 120
        while not (SIGNALS / "held").exists():
            assert time.time() < deadline, "no holder came"
            time.sleep(0.02)
    sim.allocate(3 * 2**30, gpu.device).free()

@pytest.mark.gpu(memory="1GiB")
@pytest.mark.parametrize("i", range(3))
def test_small(gpu, i):
    time.sleep(0.1)

def test_fails():
    with open(SIGNALS / "fails", "a") as out:
        out.write("ran\\n")
    assert 1 == 2
"""


def _grows_run(gpu_pytester, hold, name: str, *args: str) -> tuple[str, int, Path]:
    """The GROWS suite under -n 2: a holder fills the GPU test_grows runs on, while it waits."""
    require("C compiler", executable="cc")  # NVML's per-process lists: the fake libnvidia-ml.so.1
    signals = gpu_pytester.path / "signals"
    signals.mkdir()
    gpu_pytester.makepyfile(test_grows=GROWS)
    env = {**os.environ, "PYTEST_GPU_SIM_MACHINE": name, "SIGNALS": str(signals)}
    junit = gpu_pytester.path / "junit.xml"
    command = [sys.executable, "-m", "pytest", *INNER_ARGS, "-rA", "-n", "2", "--gpus", SPEC]
    command += [f"--junitxml={junit}", *args, "test_grows.py"]
    proc = subprocess.Popen(
        command, cwd=gpu_pytester.path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        gpu = wait_for(lambda: (signals / "asked").exists() and (signals / "asked").read_text(), patience(120), "asked")
        hold("--machine", name, "--spec", SPEC, "--gpu", gpu, "--memory", "13GiB")
        (signals / "held").write_text("")
        out, _ = proc.communicate(timeout=patience(240))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return out, int(gpu), junit


def _properties(junit: Path, name: str) -> dict[str, str]:
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        if case.get("name") == name:
            return {p.get("name", ""): p.get("value", "") for p in case.iter("property")}
    raise AssertionError(f"no testcase {name} in {junit.read_text()}")


def test_an_oom_from_a_foreign_process_s_growth_is_infrastructure(gpu_pytester, hold):
    out, gpu, junit = _grows_run(gpu_pytester, hold, "grows")
    assert "2 failed, 3 passed" in out, out
    reason = f"out of memory while memory outside the run grew on GPU {gpu} (+13.5GiB)"  # and the holder's context
    assert "pytest-gpu: 1 infrastructure failure (the cause was outside the test; --gpu-retry-infra" in out, out
    assert f"pytest-gpu:   test_grows.py::test_grows: {reason}" in out, out
    assert "- pytest-gpu: infrastructure failure -" in out and reason in out  # the report's section (-rA)
    props = _properties(junit, "test_grows")
    assert props["gpu_failure_class"] == "infrastructure" and props["gpu_failure_reason"] == reason
    assert "gpu_failure_class" not in _properties(junit, "test_fails")  # an assertion: its own


def test_with_the_retry_it_passes_on_the_other_gpu_and_keeps_the_first_failure(gpu_pytester, hold):
    out, gpu, junit = _grows_run(gpu_pytester, hold, "retried", "--gpu-retry-infra")
    assert "1 failed, 4 passed" in out, out  # test_fails: never retried
    runs = (gpu_pytester.path / "signals" / "runs").read_text().split()
    assert runs == [str(gpu), str(1 - gpu)], runs  # the retry on the other GPU
    assert (gpu_pytester.path / "signals" / "fails").read_text() == "ran\n"  # an assertion runs once
    assert "pytest-gpu: passed on retry: 1 (test_grows.py::test_grows)" in out, out
    assert "infrastructure failure (" not in out  # no test's final outcome is one
    # -rA: the passed test's report keeps the first failure, its reason and its traceback
    assert "- pytest-gpu: first failure (infrastructure), retried -" in out, out
    assert "OutOfMemoryError" in out or "out of memory" in out
    props = _properties(junit, "test_grows")
    assert props["gpu_retry"] == "passed on retry"
    assert props["gpu_first_failure"].startswith(f"out of memory while memory outside the run grew on GPU {gpu}")
    assert props["gpu_indices"] == str(1 - gpu)  # the retry's lease, not the first run's besides
    assert "gpu_retry" not in _properties(junit, "test_fails")


QUARANTINE = """
import pytest
from pytest_gpu import sim

kept = []

@pytest.mark.gpu(memory="4GiB")
def test_a_breaks_cuda():
    kept.append(sim.allocate("3GiB"))
    sim.poison()
    sim.synchronize()

@pytest.mark.gpu(memory="2GiB")
def test_b_needs_the_gpu():
    sim.allocate("1GiB").free()
"""


def test_a_lease_refused_by_an_earlier_test_s_quarantine_is_infrastructure_not_retried_here(gpu_pytester, run_inner):
    gpu_pytester.makepyfile(test_sticky=QUARANTINE)
    result = run_inner("--gpus", "sim:1x16GiB", "-rA", "--gpu-retry-infra", subprocess=True)
    result.assert_outcomes(failed=1, errors=1)  # test_b: its setup refused, once (the process stays broken)
    out = result.stdout.str()
    assert "pytest-gpu: 1 infrastructure failure" in out, out
    assert (
        "pytest-gpu:   test_sticky.py::test_b_needs_the_gpu: quarantine: test_sticky.py::test_a_breaks_cuda "
        "left this process's CUDA unusable"
    ) in out, out
    assert "test_sticky.py::test_a_breaks_cuda: quarantine" not in out  # its own kernels raised the error
    assert "passed on retry" not in out and "failed on retry" not in out


PORTS = """
import os, pathlib, socket, pytest

SIGNALS = pathlib.Path(os.environ["SIGNALS"])

def test_binds(ports):
    (port,) = ports(1)
    with open(SIGNALS / "runs", "a") as out:
        out.write(f"{port}\\n")
    with socket.socket() as squatter, socket.socket() as server:
        if not (SIGNALS / "squatted").exists():  # another program took the leased port first
            (SIGNALS / "squatted").write_text("")
            squatter.bind(("127.0.0.1", port))
            squatter.listen()
        server.bind(("127.0.0.1", port))

def test_own_port():
    with socket.socket() as one, socket.socket() as two:
        one.bind(("127.0.0.1", 0))
        one.listen()
        two.bind(("127.0.0.1", one.getsockname()[1]))  # not leased: its own clash
"""


@pytest.mark.parametrize("retry", [False, True], ids=["classed", "retried"])
def test_eaddrinuse_on_a_leased_port_is_infrastructure(gpu_pytester, run_inner, monkeypatch, retry):
    signals = gpu_pytester.path / "signals"
    signals.mkdir()
    monkeypatch.setenv("SIGNALS", str(signals))
    gpu_pytester.makepyfile(test_ports=PORTS)
    args = ("--gpu-retry-infra",) if retry else ()
    result = run_inner("--gpus", "sim:1x16GiB", "-rA", "-n", "2", *args, subprocess=True)
    out = result.stdout.str()
    assert "test_ports.py::test_own_port: port clash" not in out, out
    runs = (signals / "runs").read_text().split()
    if retry:
        result.assert_outcomes(passed=1, failed=1)
        assert len(runs) == 2 and "pytest-gpu: passed on retry: 1 (test_ports.py::test_binds)" in out, out
    else:
        result.assert_outcomes(failed=2)
        assert len(runs) == 1, runs
        assert f"test_ports.py::test_binds: port clash: EADDRINUSE on a leased port ({runs[0]})" in out, out


CRASH = """
import os, pathlib, time

SIGNALS = pathlib.Path(os.environ["SIGNALS"])

def test_crashes():
    if not (SIGNALS / "crashed").exists():
        (SIGNALS / "crashed").write_text("")
        os._exit(1)  # the worker is lost under it

def test_other():
    time.sleep(0.5)
"""


@pytest.mark.parametrize("retry", [False, True], ids=["classed", "retried"])
def test_a_lost_worker_s_test_is_infrastructure(gpu_pytester, run_inner, monkeypatch, retry):
    signals = gpu_pytester.path / "signals"
    signals.mkdir()
    monkeypatch.setenv("SIGNALS", str(signals))
    gpu_pytester.makepyfile(test_crash=CRASH)
    args = ("--gpu-retry-infra",) if retry else ()
    junit = gpu_pytester.path / "junit.xml"
    result = run_inner("--gpus", "sim:1x16GiB", "-n", "2", f"--junitxml={junit}", *args, subprocess=True)
    out = result.stdout.str()
    if retry:
        outcomes = result.parseoutcomes()
        assert (outcomes.get("passed"), outcomes.get("rerun"), outcomes.get("failed")) == (2, 1, None), out
        assert "pytest-gpu: passed on retry: 1 (test_crash.py::test_crashes)" in out, out
    else:
        result.assert_outcomes(passed=1, failed=1)
        assert "pytest-gpu:   test_crash.py::test_crashes: lost: worker gw" in out, out
        assert _properties(junit, "test_crashes")["gpu_failure_class"] == "infrastructure"


def test_beside_pytest_rerunfailures_a_test_it_reruns_is_its_own(gpu_pytester, run_inner, monkeypatch):
    """One owner per test: a test pytest-rerunfailures would rerun (``--reruns``) runs under its
    protocol, which reruns it once (its "rerun"), and --gpu-retry-infra does not run it again."""
    require("pytest-rerunfailures", module="pytest_rerunfailures")
    signals = gpu_pytester.path / "signals"
    signals.mkdir()
    monkeypatch.setenv("SIGNALS", str(signals))
    gpu_pytester.makepyfile(test_rerun_ports=PORTS)  # in this process: no basename of this suite's (test_ports)
    result = run_inner("--gpus", "sim:1x16GiB", "-rA", "--reruns", "1", "--gpu-retry-infra", "-k", "test_binds")
    out = result.stdout.str()
    assert result.parseoutcomes() == {"passed": 1, "rerun": 1, "deselected": 1}, out
    assert len((signals / "runs").read_text().split()) == 2  # run twice in all, not three times
    assert "passed on retry" not in out and "infrastructure failure (" not in out, out


RENDEZVOUS_CONFTEST = """
import os, pathlib, time

SIGNALS = pathlib.Path(os.environ["SIGNALS"])
POOL = os.environ.get("PYTEST_GPU_RANK_LOG_DIR")  # set in a rank process only: its pool's directory


def fail_the_first_pools_rendezvous():
    first = SIGNALS / "first-pool"
    try:
        fd = os.open(first, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        while not first.read_text():
            time.sleep(0.01)
    else:
        os.write(fd, POOL.encode())
        os.close(fd)
    if first.read_text() != POOL:
        return  # a later pool's ranks: their rendezvous works
    import torch.distributed as dist

    def init_process_group(*args, **kwargs):  # what torch raises when the rendezvous store times out
        raise dist.DistStoreError("Timed out after 31 seconds waiting for clients. 1/2 clients joined.")

    dist.init_process_group = init_process_group


if POOL is not None:  # a rank loads this conftest with its pytest configuration, before its process group
    fail_the_first_pools_rendezvous()
"""

POOL = """
import pytest

@pytest.mark.distributed(world_size=2, backend="gloo")
def test_pool(rank):
    assert rank.world_size == 2
"""


@pytest.mark.parametrize("retry", [False, True], ids=["classed", "retried"])
def test_a_collective_s_initialisation_timing_out_is_infrastructure(gpu_pytester, run_inner, monkeypatch, retry):
    """The first pool's ranks fail torch's rendezvous (its DistStoreError timeout): the test's
    failure is classed; with the retry it passes on fresh ranks (a new pool)."""
    require("torch", module="torch")
    signals = gpu_pytester.path / "signals"
    signals.mkdir()
    monkeypatch.setenv("SIGNALS", str(signals))
    gpu_pytester.makeconftest(RENDEZVOUS_CONFTEST)
    gpu_pytester.makepyfile(test_pool=POOL)
    args = ("--gpu-retry-infra",) if retry else ()
    result = run_inner("--gpus", "sim:1x16GiB", "-rA", *args, subprocess=True, timeout=180)
    out = result.stdout.str()
    if retry:
        result.assert_outcomes(passed=1)
        assert "pytest-gpu: passed on retry: 1 (test_pool.py::test_pool)" in out, out
        assert "collective initialisation timed out: could not set up" in out, out  # the first failure, kept
    else:
        result.assert_outcomes(failed=1)
        assert "pytest-gpu:   test_pool.py::test_pool: collective initialisation timed out: could not set up" in out
        assert "DistStoreError: Timed out after 31 seconds" in out, out
