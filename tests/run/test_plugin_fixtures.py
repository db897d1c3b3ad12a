"""End-to-end: the ``gpu``, ``gpu_request``, ``ports`` and ``port`` fixtures, and waiting."""

from __future__ import annotations

import json
import os
import re

import pytest

GiB = 2**30


def test_gpu_fixture_fields(gpu_pytester, run_inner):
    gpu_pytester.makepyfile(
        test_fields="""
        import os
        import pytest

        SIM_UUID = "GPU-51a00000-0000-4000-8000-{:012d}"

        @pytest.mark.gpu(count=2, memory="3GiB")
        def test_fields(gpu):
            assert len(gpu.indices) == 2 and len(set(gpu.indices)) == 2
            assert set(gpu.indices) <= {0, 1, 2, 3}
            assert gpu.uuids == tuple(SIM_UUID.format(i) for i in gpu.indices)
            assert gpu.memory == 3 * 2**30
            assert gpu.exclusive is False
            assert gpu.device == "cuda:0"
            visible = ",".join(map(str, gpu.indices))
            assert gpu.visible_devices == visible
            assert gpu.env["CUDA_VISIBLE_DEVICES"] == visible
            assert gpu.env["HIP_VISIBLE_DEVICES"] == visible
            assert gpu.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
            assert os.environ["CUDA_VISIBLE_DEVICES"] == visible
            assert os.environ["HIP_VISIBLE_DEVICES"] == visible
            # a subprocess given gpu.env sees exactly the lease (and its sim usage is the test's)
            assert os.environ["PYTEST_GPU_SIM_TAG"] == gpu.env["PYTEST_GPU_SIM_TAG"]
            print("LEASE", gpu.indices)

        @pytest.mark.gpu(exclusive=True)
        def test_exclusive(gpu):
            assert len(gpu.indices) == 1
            assert gpu.exclusive is True
            assert gpu.memory == 16 * 2**30 - 500 * 2**20  # the whole GPU but this process's context
        """
    )
    result = run_inner("--gpus", "sim:4x16GiB")
    result.assert_outcomes(passed=2)


def test_gpu_fixture_with_default_memory_size(gpu_pytester, run_inner):
    gpu_pytester.makepyfile(
        test_default="""
        def test_default(gpu):
            assert gpu.memory == 2 * 2**30
            assert gpu.exclusive is False
            assert len(gpu.indices) == 1
        """
    )
    run_inner("--gpus", "sim:2x16GiB", "--gpu-default-memory", "2GiB").assert_outcomes(passed=1)
    # the same from the ini key
    gpu_pytester.makeini("[pytest]\ngpu_default_memory = 2GiB\n")
    run_inner("--gpus", "sim:2x16GiB").assert_outcomes(passed=1)


def test_gpu_request_section(gpu_pytester, run_inner):
    gpu_pytester.makepyfile(
        test_section="""
        import os
        from pytest_gpu import sim

        def test_section(gpu_request):
            assert "CUDA_VISIBLE_DEVICES" not in os.environ  # host work: no GPU yet
            with gpu_request(count=2, memory="2GiB") as lease:
                assert len(lease.indices) == 2
                assert lease.memory == 2 * 2**30
                assert os.environ["CUDA_VISIBLE_DEVICES"] == lease.visible_devices
                sim.hold("1GiB", 0.01, device=1)
            assert "CUDA_VISIBLE_DEVICES" not in os.environ
            with gpu_request(exclusive=True) as whole:
                assert whole.exclusive and len(whole.indices) == 1

        def test_default_section(gpu_request):
            with gpu_request() as lease:
                assert lease.exclusive and len(lease.indices) == 1
        """
    )
    xml = gpu_pytester.path / "junit.xml"
    result = run_inner("--gpus", "sim:4x16GiB", f"--junitxml={xml}")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["pytest-gpu: * · 2 GPU tests · *"])
    text = xml.read_text()
    # the first section used two GPUs, the second one more or one of them: 2 or 3 indices
    indices = re.search(r'<property name="gpu_indices" value="([0-9,]+)"', text).group(1).split(",")
    assert len(indices) in (2, 3)


WAITING = """
import os
import time
import pytest

HELD = {held!r}
DONE = {done!r}

@pytest.mark.gpu(exclusive=True)
def test_holder(gpu):
    with open(HELD, "w") as f:
        f.write(str(gpu.indices))
    deadline = time.monotonic() + 30
    while not os.path.exists(DONE) and time.monotonic() < deadline:
        time.sleep(0.05)

@pytest.mark.gpu(exclusive=True)
def test_waiter(gpu):
    raise AssertionError("must not get the GPU")
"""

WAITING_CONFTEST = """
import os
import time
import pytest

HELD = {held!r}
DONE = {done!r}

@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # before pytest-gpu acquires: the waiter asks only once the holder has the GPU
    if item.name == "test_waiter":
        deadline = time.monotonic() + 30
        while not os.path.exists(HELD) and time.monotonic() < deadline:
            time.sleep(0.05)

def pytest_runtest_teardown(item):
    if item.name == "test_waiter":
        open(DONE, "w").close()
"""


def test_wait_timeout_names_request_and_holder(gpu_pytester, run_inner):
    held = str(gpu_pytester.path / "held")
    done = str(gpu_pytester.path / "done")
    gpu_pytester.makeconftest(WAITING_CONFTEST.format(held=held, done=done))
    gpu_pytester.makepyfile(test_wait=WAITING.format(held=held, done=done))
    # both at once, one per worker: xdist's load scheduling (pytest-gpu's would not hand the
    # waiter out while the holder has the GPU)
    args = ("--gpus", "sim:1x16GiB", "-n", "2", "--gpu-wait-timeout", "0.5", "--gpu-schedule=off")
    result = run_inner(*args, subprocess=True)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.re_match_lines(
        [
            r"pytest-gpu: test_wait\.py::test_waiter could not get 1 GPU \(whole GPU\): waited 0\.5s for 1 GPU "
            r"\(whole GPU\) \(--gpu-wait-timeout\); held by test_wait\.py::test_holder \(gw[01]: GPU 0, whole GPU\)"
        ]
    )
    assert "died while running" not in result.stdout.str()


def test_a_section_waiting_for_its_own_tests_lease_fails_at_once_naming_it(gpu_pytester, run_inner):
    gpu_pytester.makepyfile(
        test_self="""
        import pytest

        @pytest.mark.gpu(memory="10GiB")
        def test_greedy(gpu_request):
            with gpu_request(memory="10GiB"):
                pass
        """
    )
    # the test's own lease is in the way and stays while it waits: refused at once, not after 600 s
    result = run_inner("--gpus", "sim:1x16GiB", "--gpu-wait-timeout", "600")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "pytest-gpu: test_self.py::test_greedy could not get 1 GPU (10GiB): a deadlock (hold-and-wait): *",
            "  - main holds GPU-* (10GiB, test_self.py::test_greedy) and waits for 1 GPU (10GiB) "
            "for test_self.py::test_greedy",
        ]
    )


PORTS = """
import json
import os
import socket
import pytest

@pytest.mark.parametrize("i", range(24))
def test_ports(i, ports, port):
    got = ports(3) + [port]
    for p in got:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", p))  # handed out bindable
    name = os.path.join({out!r}, f"{{os.getpid()}}-{{i}}.json")
    with open(name, "w") as f:
        json.dump(got, f)

@pytest.mark.gpu(memory="1GiB")
def test_gpu_and_port(gpu, port):
    assert 30000 <= port <= 30999
"""

PORTS_CONTROLLER = """
import json
from pytest_gpu.run.lifecycle import RUN_KEY

def pytest_sessionfinish(session):
    run = session.config.stash[RUN_KEY]
    if run.broker is not None:  # the controller
        with open({status!r}, "w") as f:
            json.dump(run.broker.status()["ports"], f)
"""


def test_ports_unique_across_xdist_run(gpu_pytester, run_inner):
    out = gpu_pytester.path / "ports"
    out.mkdir()
    status = gpu_pytester.path / "status.json"
    gpu_pytester.makeconftest(PORTS_CONTROLLER.format(status=str(status)))
    gpu_pytester.makepyfile(test_ports=PORTS.format(out=str(out)))
    result = run_inner("-n", "4", "--gpus", "sim:2x16GiB", "--gpu-port-range", "30000-30999", subprocess=True)
    result.assert_outcomes(passed=25)
    files = list(out.iterdir())
    assert len(files) == 24
    assert len({f.name.split("-")[0] for f in files}) > 1, "all tests ran in one worker: not a cross-worker check"
    ports = [p for f in files for p in json.loads(f.read_text())]
    assert len(ports) == 96
    assert len(set(ports)) == 96, "a port was handed out twice in one run"
    assert all(30000 <= p <= 30999 for p in ports)
    assert json.loads(status.read_text()) == {}  # all given back
    assert "died while running" not in result.stdout.str()  # no worker left with ports at exit


def test_ports_reclaimed_after_each_test(gpu_pytester, run_inner):
    gpu_pytester.makepyfile(
        test_reclaim="""
        import pytest

        @pytest.mark.parametrize("i", range(3))
        def test_all_ports(i, ports):
            assert sorted(ports(2)) == [31810, 31811]  # the whole range, again and again

        def test_exhausted(ports):
            ports(2)
            message = r"only 0 of 1 ports free in 31810-31811 \\(2 leased\\); widen --gpu-port-range"
            with pytest.raises(Exception, match=message):
                ports(1)

        def test_port_and_ports_differ(port, ports):
            assert port not in ports(1)

        def test_bad_n(ports):
            with pytest.raises(ValueError, match="ports\\\\(n\\\\) expects a positive int, got 0"):
                ports(0)
        """
    )
    result = run_inner("--gpus", "none", "--gpu-port-range", "31810-31811")
    result.assert_outcomes(passed=6)


def test_port_range_from_ini(gpu_pytester, run_inner):
    gpu_pytester.makeini("[pytest]\ngpu_port_range = 31820-31829\n")
    gpu_pytester.makepyfile("def test_p(port):\n    assert 31820 <= port <= 31829\n")
    run_inner("--gpus", "none").assert_outcomes(passed=1)


def test_cpu_suite_never_connects(gpu_pytester, run_inner):
    """A suite that asks for no GPU and no port leaves the broker without clients."""
    gpu_pytester.makeconftest(
        """
        from pytest_gpu.run.lifecycle import RUN_KEY

        def pytest_sessionfinish(session):
            run = session.config.stash[RUN_KEY]
            print("CLIENTS", run.broker.status()["grants"], run._client is None)
        """
    )
    gpu_pytester.makepyfile("def test_a():\n    pass\n")
    result = run_inner("--gpus", "sim:1x16GiB", "-s")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*CLIENTS 0 True*"])
    assert os.environ.get("PYTEST_GPU_SIM_LEDGER") is None  # the run put the environment back


@pytest.mark.parametrize("verify", ["fail", "off"])
def test_lease_env_restored_after_test(gpu_pytester, run_inner, monkeypatch, verify):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    gpu_pytester.makepyfile(
        test_env="""
        import os
        import pytest

        @pytest.mark.gpu(memory="1GiB")
        def test_a(gpu):
            assert os.environ["CUDA_VISIBLE_DEVICES"] == gpu.visible_devices

        def test_b():
            assert os.environ["CUDA_VISIBLE_DEVICES"] == "1,0"
            assert "HIP_VISIBLE_DEVICES" not in os.environ
            assert "PYTEST_GPU_SIM_TAG" not in os.environ
        """
    )
    run_inner("--gpus", "sim:2x16GiB", f"--gpu-verify={verify}").assert_outcomes(passed=2)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1,0"
    assert "HIP_VISIBLE_DEVICES" not in os.environ
