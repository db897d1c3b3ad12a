"""Host resources: ``cpus=`` and ``host_memory=`` leased from the machine's CPUs and RAM."""

from __future__ import annotations

import dataclasses
import json
import os
from collections import defaultdict

import pytest

from pytest_gpu.base.requests import (
    DefaultMemory,
    GpuRequest,
    GpuRequestError,
    build_host_request,
    build_request,
    with_host,
)
from pytest_gpu.gpu.isolation import Confinement
from pytest_gpu.leasing import host
from pytest_gpu.machine.arbiter import Arbiter
from pytest_gpu.machine.messages import request_from_wire, request_to_wire
from pytest_gpu.machine.placement import Allocator, Policy, Unsatisfiable
from pytest_gpu.wire.frames import WireError

GiB = 2**30
SHARED = DefaultMemory(exclusive=False, memory=GiB)


def cpus(n: int, memory: int = 0) -> GpuRequest:
    return GpuRequest(count=0, memory=0, exclusive=False, cpus=n, host_memory=memory)


def gpu(memory: int, n_cpus: int = 0, host_memory: int = 0) -> GpuRequest:
    return GpuRequest(count=1, memory=memory, exclusive=False, cpus=n_cpus, host_memory=host_memory)


def pool(host_cpus: int = 2, host_memory: int = 8 * GiB, max_bypass: int = 16) -> Allocator:
    p = Allocator({0: 16 * GiB}, Policy(overhead=0, max_bypass=max_bypass))
    p.set_host(host_cpus, host_memory)
    return p


# -- requests ------------------------------------------------------------------------------


def test_marker_keywords_build_the_host_part():
    assert build_request((), {"cpus": 4, "host_memory": "16GiB"}, SHARED) == gpu(GiB, 4, 16 * GiB)
    assert build_host_request((), {"cpus": 2}) == cpus(2)
    assert build_host_request((), {"host_memory": "1GiB"}) == cpus(0, GiB)
    assert with_host(gpu(GiB), cpus(2, GiB), "m") == gpu(GiB, 2, GiB)
    assert with_host(None, cpus(2), "m") == cpus(2)
    assert cpus(2, 8 * GiB).describe() == "2 CPUs and 8GiB of host memory"
    assert gpu(GiB, 1).describe() == "1 GPU (1GiB) with 1 CPU"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"cpus": 0}, r"cpus must be a positive int .*got 0"),
        ({"cpus": -2}, r"cpus must be a positive int .*got -2"),
        ({"cpus": "2"}, r"cpus must be a positive int .*got '2'"),
        ({"cpus": 1.5}, r"cpus must be a positive int .*got 1.5"),
        ({"cpus": True}, r"cpus must be a positive int .*got True"),
        ({"host_memory": "lots"}, r"host_memory='lots' is not a size"),
        ({"host_memory": 0}, r"host_memory must be positive"),
        ({}, r"asks for nothing"),
        ({"cores": 2}, r"unknown keyword 'cores'"),
    ],
)
def test_bad_host_values_say_what_was_expected(kwargs, match):
    with pytest.raises(GpuRequestError, match=match) as info:
        build_host_request((), kwargs)
    assert "expected @pytest.mark.host_resources(" in str(info.value)


def test_a_resource_named_twice_is_refused():
    with pytest.raises(GpuRequestError, match="cpus given both"):
        with_host(gpu(GiB, 2), cpus(2), "host marker")


def test_wire_keeps_four_fields_without_a_host_part():
    assert request_to_wire(gpu(GiB)) == [1, GiB, False, None]
    assert request_from_wire([1, GiB, False, None]) == gpu(GiB)  # an older peer's 4-tuple
    shaped = request_to_wire(gpu(GiB, 2, GiB))
    assert shaped == [1, GiB, False, None, 2, GiB]
    assert request_from_wire(tuple(shaped)) == gpu(GiB, 2, GiB)
    assert request_from_wire(request_to_wire(cpus(3))) == cpus(3)
    with pytest.raises(WireError):
        request_from_wire([1, 2, 3])


def test_capacity_is_measured_or_declared():
    measured = host.capacity()
    assert measured.cpus == len(os.sched_getaffinity(0))
    assert 0 < measured.memory < __import__("psutil").virtual_memory().total
    assert host.capacity(2, GiB) == host.HostCapacity(2, GiB)
    assert host.reserve(100 * GiB) == 10 * GiB and host.reserve(4 * GiB) == GiB


def test_threads_follow_cpus_and_are_restored(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)

    class FakeTorch:
        threads = 16

        def get_num_threads(self):
            return self.threads

        def set_num_threads(self, n):
            self.threads = n

    torch = FakeTorch()
    monkeypatch.setitem(__import__("sys").modules, "torch", torch)
    done = Confinement()
    host.confine_threads(3, done)
    assert os.environ["OMP_NUM_THREADS"] == os.environ["MKL_NUM_THREADS"] == "3" and torch.threads == 3
    done.undo()
    assert os.environ["OMP_NUM_THREADS"] == "7" and "MKL_NUM_THREADS" not in os.environ and torch.threads == 16


# -- the pool: pure policy -----------------------------------------------------------------


def test_host_only_requests_wait_for_cpus():
    p = pool()
    assert [lease.key for lease in p.submit("a", "c0", cpus(2))] == ["a"]
    assert p.submit("b", "c1", cpus(1)) == []  # both CPUs are leased
    assert p.host.leased_cpus == 2
    assert [lease.key for lease in p.release("a")] == ["b"]
    assert p.host.leased_cpus == 1
    p.release("b")
    assert (p.host.leased_cpus, p.host.leased_memory) == (0, 0)


def test_host_memory_is_leased_like_gpu_memory():
    p = pool(host_cpus=64, host_memory=8 * GiB)
    assert p.submit("a", "c0", cpus(0, 6 * GiB))
    assert p.submit("b", "c1", cpus(0, 3 * GiB)) == []
    assert p.submit("c", "c2", cpus(0, 2 * GiB))  # backfill: it fits beside a
    assert [lease.key for lease in p.release("a")] == ["b"]


def test_gpu_and_host_parts_are_granted_together_or_not_at_all():
    p = pool()
    p.submit("cpus", "c0", cpus(2))
    # its GPU part fits, its host part does not: nothing of it is leased
    assert p.submit("both", "c1", gpu(4 * GiB, 1)) == []
    assert p.gpus[0].leased == 0 and p.gpus[0].tenants == 0
    # the other way round: the GPU is full, the host has room
    p.release("cpus")  # "both" is granted now
    assert p.gpus[0].leased == 4 * GiB and p.host.leased_cpus == 1
    assert p.submit("big", "c2", gpu(13 * GiB, 1)) == []
    assert p.host.leased_cpus == 1  # the waiting one holds no CPU
    assert [lease.key for lease in p.release("both")] == ["big"]
    assert (p.gpus[0].leased, p.host.leased_cpus) == (13 * GiB, 1)


def test_fairness_bounds_the_bypass_of_a_request_waiting_for_cpus():
    p = pool(max_bypass=1)
    p.submit("a", "c0", gpu(GiB, 2))
    assert p.submit("b", "c1", cpus(2)) == []  # waits for a's CPUs
    assert [lease.key for lease in p.submit("c", "c2", gpu(GiB))] == ["c"]  # overtakes b once
    assert p.submit("d", "c3", gpu(GiB)) == []  # b has been overtaken enough: d waits behind it
    assert [lease.key for lease in p.release("a")] == ["b", "d"]


def test_a_request_larger_than_the_machine_never_queues():
    p = pool()
    with pytest.raises(Unsatisfiable, match=r"needs 3 CPUs but the machine has 2 \(expected cpus= at most 2\)"):
        p.submit("a", "c0", cpus(3))
    with pytest.raises(Unsatisfiable, match="of host memory but the machine can lease 8GiB"):
        p.submit("b", "c0", gpu(GiB, 1, 9 * GiB))
    assert p.queue == []


def test_a_pool_not_told_the_host_does_not_limit_it():
    p = Allocator({0: 16 * GiB}, Policy(overhead=0))
    assert p.submit("a", "c0", cpus(1000))
    assert p.submit("b", "c0", gpu(GiB, 1000))


def test_forgetting_a_client_returns_its_cpus():
    p = pool()
    p.submit("a", "c0", gpu(GiB, 2))
    assert p.submit("b", "c1", cpus(2)) == []
    _, granted = p.forget_client("c0")
    assert [lease.key for lease in granted] == ["b"] and p.host.leased_cpus == 2


# -- the arbiter: machine-wide, across runs ---------------------------------------------------


def test_two_runs_share_the_machines_cpus_and_the_first_view_wins():
    events: dict[str, list] = defaultdict(list)
    arbiter = Arbiter(Policy(overhead=0))
    arbiter.attach("r1", pid=1, user="u", label="one", gpus={}, sink=events["r1"].extend, host=(2, 8 * GiB))
    arbiter.attach("r2", pid=2, user="u", label="two", gpus={"U": 16 * GiB}, sink=events["r2"].extend, host=(64, GiB))
    assert (arbiter.allocator.host.cpus, arbiter.allocator.host.memory) == (2, 8 * GiB)
    kind, _ = arbiter.submit("r1", "c0/k0", "c0", "gw0", "t::a", cpus(2), [])
    assert kind == "granted"
    kind, _ = arbiter.submit("r2", "c0/k0", "c0", "gw0", "t::b", gpu(GiB, 1), ["U"])
    assert kind == "queued"  # the other run holds both CPUs
    assert arbiter.status()["host"] == {"cpus": 2, "memory": 8 * GiB, "leased_cpus": 2, "leased_memory": 0}
    assert arbiter.holders()[0]["cpus"] == 2
    arbiter.release("r1", "c0/k0")
    assert [(kind, key) for kind, key, _ in events["r2"]] == [("granted", "c0/k0")]
    kind, message = arbiter.submit("r2", "c0/k1", "c0", "gw0", "t::c", cpus(3), ["U"])
    assert kind == "error" and "needs 3 CPUs but the machine has 2" in message
    assert [key for key, _ in arbiter.detach("r2")] == ["c0/k0"]
    assert arbiter.allocator.host.leased_cpus == 0


# -- end to end ----------------------------------------------------------------------------

STAMPS = """
import json, os, sys, time
import pytest

OUT = {out!r}

def _stamp(name, body):
    start = time.time()
    body()
    with open(os.path.join(OUT, name + ".json"), "w") as f:
        json.dump([start, time.time(), os.environ.get("OMP_NUM_THREADS"), os.environ.get("MKL_NUM_THREADS")], f)

@pytest.mark.host_resources(cpus=2)
def test_one():
    _stamp("one", lambda: time.sleep(0.6))

@pytest.mark.host_resources(cpus=2, host_memory="64MiB")
def test_two():
    _stamp("two", lambda: time.sleep(0.6))

@pytest.mark.host_resources(cpus=1)
def test_three():
    _stamp("three", lambda: time.sleep(0.6))

def test_plain():
    _stamp("plain", lambda: None)
"""


def _stamps(out):
    return {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}


def test_two_tests_asking_for_all_cpus_never_overlap_under_xdist(gpu_pytester, run_inner, monkeypatch):
    """A 2-CPU machine (declared with --gpu-host-cpus=2): CPU-only tests with host resources
    under -n 2; those asking cpus=2 run one at a time, each with OMP_NUM_THREADS=2."""
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    out = gpu_pytester.path / "stamps"
    out.mkdir()
    gpu_pytester.makepyfile(test_stamps=STAMPS.format(out=str(out)))
    result = run_inner("-n", "2", "--gpu-host-cpus=2", "--strict-markers", subprocess=True)
    result.assert_outcomes(passed=4)
    stamps = _stamps(out)
    intervals = [stamps[name][:2] for name in ("one", "two", "three")]
    for i, (a0, a1) in enumerate(intervals):
        for b0, b1 in intervals[i + 1 :]:
            assert a1 <= b0 or b1 <= a0, f"overlap: {intervals}"  # 2 + 2, 2 + 1: never both at once
    assert [stamps[n][2:] for n in ("one", "two", "three")] == [["2", "2"], ["2", "2"], ["1", "1"]]
    assert stamps["plain"][2] == "5"  # a test without cpus= keeps the environment's


OMP_RESTORED = """
import os, sys
import pytest

@pytest.mark.host_resources(cpus=3)
def test_during():
    assert os.environ["OMP_NUM_THREADS"] == "3" and os.environ["MKL_NUM_THREADS"] == "3"
    assert "torch" not in sys.modules  # never imported for this

@pytest.mark.gpu(memory="1GiB", cpus=2)
def test_with_a_gpu(gpu):
    assert gpu.indices == (0,) and os.environ["OMP_NUM_THREADS"] == "2"

def test_after():
    assert os.environ["OMP_NUM_THREADS"] == "7" and "MKL_NUM_THREADS" not in os.environ
"""


def test_omp_threads_follow_cpus_and_are_restored(gpu_pytester, run_inner, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    gpu_pytester.makepyfile(test_omp=OMP_RESTORED)
    # a process of its own: whether the plugin imports torch is not told in one where an
    # earlier test of this suite already did (the residue tests do)
    result = run_inner("--gpus", "sim:1x16GiB", "--gpu-host-cpus=4", "-p", "no:xdist", subprocess=True)
    result.assert_outcomes(passed=3)
    assert os.environ["OMP_NUM_THREADS"] == "7"


TORCH_CONFTEST = """
import sys, types

torch = types.ModuleType("torch")
torch.threads = 16
torch.get_num_threads = lambda: torch.threads
def _set(n):
    torch.threads = n
torch.set_num_threads = _set
sys.modules["torch"] = torch
"""

TORCH_TESTS = """
import sys
import pytest

@pytest.mark.host_resources(cpus=2)
def test_during():
    assert sys.modules["torch"].threads == 2

def test_after():
    assert sys.modules["torch"].threads == 16
"""


def test_torch_threads_follow_cpus_when_torch_is_loaded(gpu_pytester, run_inner):
    gpu_pytester.makeconftest(TORCH_CONFTEST)
    gpu_pytester.makepyfile(test_torch=TORCH_TESTS)
    result = run_inner("--gpu-host-cpus=2", "-p", "no:xdist", subprocess=True)
    result.assert_outcomes(passed=2)


BAD = """
import pytest

@pytest.mark.host_resources(cpus=0)
def test_zero():
    pass

@pytest.mark.host_resources(cpus=-1)
def test_negative():
    pass

@pytest.mark.gpu(cpus="4")
def test_text():
    pass

@pytest.mark.host_resources(cpus=2)
@pytest.mark.gpu(cpus=2)
def test_twice():
    pass
"""


def test_bad_values_fail_collection_naming_the_test(gpu_pytester, run_inner):
    gpu_pytester.makepyfile(test_bad=BAD)
    result = run_inner("--gpus", "sim:1x16GiB")
    assert result.ret != 0
    result.stdout.fnmatch_lines(
        [
            "*pytest-gpu: invalid GPU request*",
            "*test_bad.py::test_zero: host_resources marker: cpus must be a positive int (CPUs to lease), got 0; "
            "expected @pytest.mark.host_resources(*",
            "*test_bad.py::test_negative: host_resources marker: cpus must be a positive int*got -1*",
            "*test_bad.py::test_text: gpu marker: cpus must be a positive int*got '4'; expected @pytest.mark.gpu*",
            "*test_bad.py::test_twice: host_resources marker: cpus given both in the GPU request and in the "
            "host_resources marker*",
        ]
    )


LARGE = """
import pytest

@pytest.mark.host_resources(cpus=3)
def test_large():
    pass

@pytest.mark.host_resources(cpus=2)
def test_fits():
    pass
"""


def test_a_request_larger_than_the_machine_is_refused_at_collection(gpu_pytester, run_inner):
    gpu_pytester.makepyfile(test_large=LARGE)
    result = run_inner("--gpu-host-cpus=2", "-rs")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*needs 3 CPUs but the machine has 2 (expected cpus= at most 2)*"])
    result = run_inner("--gpu-host-cpus=2", "--gpu-oversize=fail")
    result.assert_outcomes(passed=1, errors=1)  # failed in setup, as an oversized GPU request
    result.stdout.fnmatch_lines(["*needs 3 CPUs but the machine has 2*(--gpu-oversize=fail)*"])


PROBE = """
import dataclasses, json
from pytest_gpu.run.record import needs

def pytest_collection_finish(session):
    rows = {{}}
    for item in session.items:
        request = needs(item).request
        rows[item.name] = None if request is None else dataclasses.asdict(request)
    with open({out!r}, "w") as f:
        json.dump(rows, f)

def pytest_gpu_item_request(item):
    if item.name.startswith("test_hook"):
        return {{"cpus": 2, "host_memory": "1GiB"}}
"""

CONVENTIONS_TOML = """
[tool.pytest.ini_options]
markers = ["loader: data loading", "trainer: one GPU, 4 CPUs"]
gpu_marker_map = ["loader: cpus=2 host_memory=1GiB", "trainer: count=1 memory=1GiB cpus=4"]
"""

CONVENTIONS = """
import pytest

@pytest.mark.loader
def test_map_host_only():
    pass

@pytest.mark.host_resources(cpus=2, host_memory="1GiB")
def test_marker_host_only():
    pass

def test_hook_host_only():
    pass

@pytest.mark.trainer
def test_map_with_gpu():
    pass

@pytest.mark.gpu(memory="1GiB", cpus=4)
def test_marker_with_gpu():
    pass

@pytest.mark.host_resources(cpus=4)
@pytest.mark.gpu(memory="1GiB")
def test_both_markers():
    pass
"""


def test_the_map_and_the_hook_give_the_markers_requests(gpu_pytester, run_inner):
    out = gpu_pytester.path / "requests.json"
    gpu_pytester.makeconftest(PROBE.format(out=str(out)))
    gpu_pytester.makepyprojecttoml(CONVENTIONS_TOML)
    gpu_pytester.makepyfile(test_conv=CONVENTIONS)
    result = run_inner("--gpus", "sim:1x16GiB", "--collect-only", "--strict-markers")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    rows = json.loads(out.read_text())
    host_only = dataclasses.asdict(cpus(2, GiB))
    with_gpu = dataclasses.asdict(gpu(GiB, 4))
    assert rows["test_map_host_only"] == rows["test_marker_host_only"] == rows["test_hook_host_only"] == host_only
    assert rows["test_map_with_gpu"] == rows["test_marker_with_gpu"] == rows["test_both_markers"] == with_gpu
