"""Issue 28, items 4 and 5: a test's cap and verdict are its own, whatever else its process holds.

- A leak is charged to the test that leaked it: the next test in that process gets its own
  budget on top of what is left; the run's broker counts the leftover as its process's until it
  is given back (no other worker's lease is placed in it); an out-of-memory error beside it names
  the test that left it.
- One test, one verdict: a fixture's lease in the same process does not widen a test's cap, so
  the test fails (or passes) the same way with ``-n 2`` and without xdist.
"""

from __future__ import annotations

import os
import time

import pytest

from conftest import require
from helpers import patience, shared, whole
from pytest_gpu.gpu.isolation import GpuLease
from pytest_gpu.gpu.verification import judge
from pytest_gpu.leasing.client import describe_holders
from pytest_gpu.machine.arbiter import Arbiter
from pytest_gpu.machine.messages import attach, left
from pytest_gpu.machine.mirror import Mirror
from pytest_gpu.machine.placement import Allocator, Policy
from pytest_gpu.run.leftovers import Leftovers
from pytest_gpu.run.lifecycle import out_of_memory
from pytest_gpu.wire.frames import WireError

MiB, GiB = 2**20, 2**30

XDIST = [pytest.param((), id="single"), pytest.param(("-n", "2"), id="xdist")]


def _lease(indices=(0,), memory=GiB) -> GpuLease:
    return GpuLease("k", tuple(indices), (), memory, False, "cuda:0", "0", {}, 0.0)


# -- the process's book of leftovers ---------------------------------------------------------


def test_leftovers_are_added_per_holder_shrunk_oldest_first_and_told_once():
    book = Leftovers()
    book.add(0, "t.py::test_a", 600 * MiB)
    book.add(0, "t.py::test_b", 100 * MiB)
    book.add(1, "t.py::test_b", 0)  # nothing left: nothing kept
    assert book.on(0) == 700 * MiB and book.on(1) == 0
    assert book.wire() == {0: (700 * MiB, "t.py::test_a, t.py::test_b")}
    assert book.wire() is None  # the broker was told already
    book.shrink(0, 200 * MiB)  # measured: the process holds 200MiB there now
    assert [(x.holder, x.nbytes) for x in book.by_gpu[0]] == [("t.py::test_a", 100 * MiB), ("t.py::test_b", 100 * MiB)]
    book.shrink(0, 500 * MiB)  # more held than charged: nothing is added by a measure
    assert book.on(0) == 200 * MiB
    assert book.described([0, 1]) == [
        "this process still held 100MiB on GPU 0 left by t.py::test_a (reported there)",
        "this process still held 100MiB on GPU 0 left by t.py::test_b (reported there)",
    ]
    book.shrink(0, 0)
    assert book.by_gpu == {} and book.wire() == {}  # told that nothing is left


def test_a_verdict_says_what_its_lease_left_on_each_gpu():
    verdict = judge(_lease((0, 1)), {0: GiB}, {0: 600 * MiB, 1: 0}, {0, 1})
    assert verdict.left == {0: 600 * MiB}
    assert any("still holds 600MiB on GPU 0" in v for v in verdict.violations)
    shared_gpu = judge(_lease((0,)), {}, {2: GiB}, {0}, others={2})  # another lease's GPU: its own to judge
    assert shared_gpu.left == {}


def test_an_out_of_memory_error_is_told_by_its_class_or_its_text():
    class OutOfMemoryError(RuntimeError):
        pass

    assert out_of_memory(OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate"))
    try:
        try:
            raise OutOfMemoryError("x")
        except OutOfMemoryError as exc:
            raise AssertionError("a model failed to load") from exc
    except AssertionError as outer:
        assert out_of_memory(outer)
    assert not out_of_memory(MemoryError())  # the host's memory: not a GPU's
    assert not out_of_memory(ValueError("bad shape"))


# -- placement: a leftover counts like a lease's memory --------------------------------------


def test_a_leftover_counts_at_placement_until_its_process_says_it_went():
    pool = Allocator({0: 16 * GiB}, Policy(overhead=GiB))
    pool.submit("a/1", "a", shared(GiB))
    pool.release("a/1", left={0: (600 * MiB, "t.py::test_a")})
    assert pool.used(0) == GiB + 600 * MiB  # a's context, and what its process still holds
    assert pool.gpus[0].free_for("b", GiB) == 14 * GiB - 600 * MiB
    pool.submit("b/1", "b", whole())
    assert pool.leases["b/1"].placement.memory == 14 * GiB - 600 * MiB  # a whole GPU: what is left of it
    pool.release("b/1")
    assert pool.submit("b/2", "b", shared(14 * GiB)) == []  # waits: 600MiB of it is still held
    granted = pool.release("a/missing", left={0: (1, "?")})  # an unknown lease says nothing
    assert granted == [] and pool.gpus[0].left["a"] == (600 * MiB, "t.py::test_a")
    pool.submit("a/2", "a", shared(GiB))
    assert pool.leases.get("b/2") is None
    granted = pool.release("a/2", left={})  # it went
    assert [lease.key for lease in granted] == ["b/2"]
    assert pool.gpus[0].left == {}


def test_a_request_that_only_its_own_processes_leftovers_keep_out_is_refused_naming_them():
    pool = Allocator({0: 16 * GiB}, Policy(overhead=GiB))
    pool.submit("a/1", "a", shared(GiB))
    pool.release("a/1", left={0: (2 * GiB, "t.py::test_leaky")})
    pool.submit("a/2", "a", shared(14 * GiB))  # fits the GPU, not beside its own 2GiB
    reason = pool.blocked_forever(pool.queue[0])
    assert reason is not None
    assert "2GiB on GPU 0, left by t.py::test_leaky" in reason and "its own process" in reason
    pool.cancel("a/2")
    pool.submit("b/1", "b", shared(13 * GiB))  # another process's: it may give it back, or exit
    assert pool.queue and pool.blocked_forever(pool.queue[0]) is None


def test_a_client_that_is_gone_takes_its_leftovers_with_it():
    pool = Allocator({0: 16 * GiB}, Policy(overhead=0))
    pool.submit("a/1", "a", shared(GiB))
    pool.release("a/1", left={0: (8 * GiB, "t.py::test_a")})
    pool.submit("b/1", "b", shared(10 * GiB))
    _, granted = pool.forget_client("a")  # its process died: the driver freed its memory
    assert [lease.key for lease in granted] == ["b/1"] and pool.gpus[0].left == {}


# -- the machine: every run's arbiter, and a new one after a failover ---------------------------


def test_the_arbiter_counts_a_processes_leftovers_and_names_them_to_a_request_that_waits():
    arbiter = Arbiter(Policy(overhead=0))
    arbiter.attach("r1", pid=os.getpid(), user="u", label="r1", gpus={"U": 16 * GiB}, sink=lambda events: None)
    assert arbiter.submit("r1", "c0/k0", "c0", "gw0", "t::a", shared(GiB), ["U"])[0] == "granted"
    arbiter.release("r1", "c0/k0", None, {"U": (GiB, "t.py::test_a"), "NOT-MINE": (GiB, "?")})
    assert arbiter.status()["gpus"][0]["left"] == GiB
    assert arbiter.room(["U"]) == [15 * GiB]
    assert arbiter.submit("r1", "c1/k0", "c1", "gw1", "t::b", shared(16 * GiB), ["U"]) == ("queued", None)
    rows = arbiter.cancel("r1", "c1/k0")
    assert rows is not None
    assert describe_holders(rows) == "held by 1GiB on GPU U left by t.py::test_a (gw0)"


def test_leftovers_travel_on_the_wire_checked():
    assert left({"left": {"GPU-1": [GiB, "t.py::test_a"]}}) == {"GPU-1": (GiB, "t.py::test_a")}
    assert left({}) is None
    for bad in ({"GPU-1": [0, "x"]}, {"GPU-1": [GiB]}, {"GPU-1": "1GiB"}, [1]):
        with pytest.raises(WireError):
            left({"left": bad})
    body = attach({"run": "1000.1-x", "gpus": {"GPU-1": GiB}, "left": {"c0": {"GPU-1": [GiB, "t::a"]}}})
    assert body.left == {"c0": {"GPU-1": (GiB, "t::a")}}


def test_a_runs_mirror_keeps_what_its_processes_left_for_a_new_arbiter():
    from pytest_gpu.base.requests import GpuRequest
    from pytest_gpu.machine.messages import Asked

    mirror = Mirror()
    asked = Asked("c0/k0", "c0", "gw0", "t::a", GpuRequest(1, GiB, False), ("U",))
    mirror.answered(asked, "granted", {"gpus": ["U"], "memory": GiB, "exclusive": False})
    mirror.release("c0/k0", ["U"], {"U": (GiB, "t::a")})
    assert mirror.snapshot().left == {"c0": {"U": (GiB, "t::a")}}
    arbiter = Arbiter(Policy(overhead=0))
    snapshot = mirror.snapshot()
    arbiter.attach(
        "r1", pid=os.getpid(), user="u", label="r1", gpus={"U": 16 * GiB}, sink=lambda e: None, left=snapshot.left
    )
    assert arbiter.status()["gpus"][0]["left"] == GiB  # counted before anything is granted again
    mirror.forget_client("c0")
    assert mirror.snapshot().left == {}


@pytest.fixture
def broker(tmp_path):
    """A run's broker on one 16GiB GPU (no contexts assumed), and a way to make its clients."""
    from pytest_gpu.leasing.broker import Broker
    from pytest_gpu.leasing.client import BrokerClient
    from pytest_gpu.machine.link import MachineLink

    authkey = os.urandom(16)
    policy = Policy(overhead=0)
    made = Broker({0: 16 * GiB}, str(tmp_path / "b.sock"), authkey, policy, link=MachineLink(None, policy)).start()
    clients: list[BrokerClient] = []

    def client(worker: str) -> BrokerClient:
        clients.append(BrokerClient(made.address, authkey, worker))
        return clients[-1]

    made.client = client  # type: ignore[attr-defined]
    yield made
    for c in clients:
        c.close()
    made.close()


def test_the_broker_counts_what_a_process_left_until_a_release_says_it_went(broker):
    from pytest_gpu.leasing.client import WaitTimeout

    leaky, other = broker.client("gw0"), broker.client("gw1")
    grant = leaky.acquire(shared(GiB), "t::leaky", timeout=5)
    leaky.release(grant.key, None, {0: (8 * GiB, "t::leaky")})
    with pytest.raises(WaitTimeout, match=r"held by 8GiB on GPU 0 left by t::leaky \(gw0\)"):
        other.acquire(shared(10 * GiB), "t::big", timeout=0.3)
    again = leaky.acquire(shared(GiB), "t::next", timeout=5)
    leaky.release(again.key, None, None)  # None: as told last
    with pytest.raises(WaitTimeout):
        other.acquire(shared(10 * GiB), "t::big", timeout=0.3)
    last = leaky.acquire(shared(GiB), "t::last", timeout=5)
    leaky.release(last.key, None, {})  # given back
    assert other.acquire(shared(10 * GiB), "t::big", timeout=5).indices == (0,)


def test_the_broker_keeps_only_leftovers_that_can_be_on_its_gpus(broker):
    told = {0: (GiB, "t::a" * 300), 7: (GiB, "x"), -1: (GiB, "x"), True: (GiB, "x")}
    assert broker._leftovers(told) == {broker.uuids[0]: (GiB, ("t::a" * 300)[:400])}
    for bad in ({0: (0, "x")}, {0: (17 * GiB, "x")}, {0: (True, "x")}, {0: GiB}, {0: (GiB,)}):
        assert broker._leftovers(bad) == {}
    assert broker._leftovers(None) is None and broker._leftovers("x") is None


def test_what_a_follower_run_left_reaches_its_arbiter_and_survives_a_failover(tmp_path, monkeypatch):
    from pytest_gpu.machine.domain import ROOT_ENV, Domain
    from pytest_gpu.machine.link import MachineLink

    monkeypatch.setenv(ROOT_ENV, str(tmp_path / "machines"))
    domain = Domain.private(f"sim-{tmp_path.name}")
    links = []
    try:
        for _ in range(3):
            link = MachineLink(domain, Policy(overhead=0))
            link.attach({"U": 16 * GiB}, lambda events: None)
            links.append(link)
        a, b, c = links
        assert a.is_arbiter and not b.is_arbiter
        assert b.submit("c0/k0", "c0", "gw0", "t::b", shared(GiB), ["U"])[0] == "granted"
        b.release("c0/k0", None, {"U": (4 * GiB, "t::b")})
        deadline = time.monotonic() + patience(5)
        while a.status()["gpus"][0]["left"] != 4 * GiB:  # a one-way message: it arrives soon
            assert time.monotonic() < deadline, a.status()["gpus"]
            time.sleep(0.01)
        a.close()  # b and c elect a new arbiter; b brings what its process left with its leases
        while not (b.is_arbiter or c.is_arbiter) or len(b.status()["runs"]) < 2:
            assert time.monotonic() < deadline + patience(5), "no new arbiter"
            time.sleep(0.01)
        assert b.status()["gpus"][0]["left"] == 4 * GiB
        assert c.submit("c0/k0", "c0", "gw0", "t::c", shared(13 * GiB), ["U"]) == ("queued", None)
    finally:
        for link in links:
            link.close()


# -- end to end: inner runs on simulated GPUs, the simulated torch.cuda -------------------------

LEAK = """
import pytest
from pytest_gpu.sim import torch_cuda

MiB = 2**20
KEEP = []

pytestmark = pytest.mark.xdist_group("one_worker")  # one process, also under -n 2

@pytest.mark.gpu(memory="1GiB")
def test_a(gpu):
    KEEP.append(torch_cuda.empty(600 * MiB, device=gpu.device))  # kept in a global: a leak

@pytest.mark.gpu(memory="1GiB")
def test_b(gpu):
    torch_cuda.empty({b} * MiB, device=gpu.device).free()
"""


@pytest.mark.parametrize("xdist", XDIST)
def test_a_leak_is_charged_to_the_test_that_left_it(gpu_pytester, run_inner, xdist):
    """Item 4: test_b (1GiB, allocates 700MiB) passes after test_a kept 600MiB: its cap is its own
    1GiB on top of what test_a left, and only test_a is reported."""
    require("torch", module="torch")
    gpu_pytester.makepyfile(test_leak=LEAK.format(b=700))
    result = run_inner("--gpus", "sim:1x16GiB", *xdist, subprocess=True)  # torch: a process of its own
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_a*", "*still holds 600MiB on GPU 0 after the test*"])
    assert "test_b broke" not in result.stdout.str()
    assert "FAILED" not in result.stdout.str()


@pytest.mark.parametrize("xdist", XDIST)
def test_an_out_of_memory_error_beside_a_leftover_names_the_test_that_left_it(gpu_pytester, run_inner, xdist):
    """Item 4: test_b goes over its own budget while the process still holds test_a's leak: its
    report names test_a's memory, so the leftover is not taken for, nor hidden as, the cause."""
    require("torch", module="torch")
    gpu_pytester.makepyfile(test_leak=LEAK.format(b=1100))
    result = run_inner("--gpus", "sim:1x16GiB", *xdist, subprocess=True)  # torch: a process of its own
    result.assert_outcomes(passed=1, failed=1, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*pytest-gpu: memory left by earlier tests*",
            "this process still held 600MiB on GPU 0 left by test_leak.py::test_a (reported there)",
        ]
    )


ACROSS = """
import os, time
from pathlib import Path
import pytest
import torch  # at collection: test_c's allocation comes right after its grant, not seconds later
from pytest_gpu.sim import torch_cuda

MiB = 2**20
KEEP = []
HERE = Path(os.environ["MARKERS"])


def wait_for(name):
    deadline = time.monotonic() + 60
    while not (HERE / name).exists():
        assert time.monotonic() < deadline, f"{{name}} never came: did both tests run on one worker?"
        time.sleep(0.05)


@pytest.mark.xdist_group("leaky")
@pytest.mark.gpu(memory="1GiB")
def test_a(gpu):
    KEEP.append(torch_cuda.empty(600 * MiB, device=gpu.device))


@pytest.mark.xdist_group("leaky")
@pytest.mark.gpu(memory="256MiB")
def test_a_lets_go(gpu):
    (HERE / "a-done").touch()  # test_a's lease went back (with what it left) before this one began
    wait_for("c-asks")
    time.sleep({pause})  # test_c asks meanwhile
    KEEP.clear()  # given back: this lease's release says so


@pytest.mark.xdist_group("big")
def test_c(gpu_request):
    wait_for("a-done")
    (HERE / "c-asks").touch()
    with gpu_request(memory="2.5GiB") as lease:
        torch_cuda.empty(2520 * MiB, device=lease.device).free()  # 4096 - 2 contexts - 600 left < 2520
"""


def test_another_worker_is_not_placed_in_memory_a_test_left(gpu_pytester, run_inner, tmp_path, monkeypatch):
    """Item 4 under -n 2: the broker counts test_a's leftover as its worker's (its release says
    so), so test_c on the other worker is not given memory that is still held and does not run
    out of it: it waits until test_a_lets_go gives the leftover back, then gets it."""
    require("torch", module="torch")
    markers = tmp_path / "markers"
    markers.mkdir()
    monkeypatch.setenv("MARKERS", str(markers))
    gpu_pytester.makepyfile(test_across=ACROSS.format(pause=3))
    # 4GiB, two contexts (1GiB): 3GiB for leases; test_c's 2.5GiB fits only without the 600MiB left
    result = run_inner("--gpus", "sim:1x4GiB", "-n", "2", "--gpu-wait-timeout=60", subprocess=True)
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_a *", "*still holds 600MiB on GPU 0*"])
    assert "out of memory" not in result.stdout.str().lower()


FIXTURE = """
import pytest
from pytest_gpu.sim import torch_cuda

MiB = 2**20

pytestmark = pytest.mark.xdist_group("one_worker")  # one process, also under -n 2


@pytest.fixture(scope="module")
def model(gpu_lease_factory):
    lease = gpu_lease_factory(memory="3GiB")
    weights = torch_cuda.empty(2 * 1024 * MiB, device=lease.device)
    yield weights
    weights.free()


def test_uses_model(model):
    pass


@pytest.mark.gpu(memory="1GiB")
def test_over_budget(gpu):
    torch_cuda.empty(1536 * MiB, device=gpu.device).free()


@pytest.mark.gpu(memory="1GiB")
def test_within_budget(gpu):
    torch_cuda.empty(1000 * MiB, device=gpu.device).free()
"""


@pytest.mark.parametrize("xdist", XDIST)
def test_one_test_one_verdict_beside_a_fixtures_lease(gpu_pytester, run_inner, xdist):
    """Item 5: a module fixture's 3GiB lease (2GiB of it in use) in the same process does not
    widen a test's 1GiB cap: the over-budget test fails in its body, with or without -n 2, and
    the one within budget passes beside the fixture's memory."""
    require("torch", module="torch")
    gpu_pytester.makepyfile(test_fixture=FIXTURE)
    result = run_inner("--gpus", "sim:1x16GiB", *xdist, subprocess=True)  # torch: a process of its own
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["FAILED test_fixture.py::test_over_budget - torch.OutOfMemoryError: *"])
    assert "broke its GPU lease" not in result.stdout.str()


REAL_PATH = LEAK.replace('pytestmark = pytest.mark.xdist_group("one_worker")  # one process, also under -n 2\n', "")


def test_the_real_path_charges_neither_peak_nor_leak_to_the_next_test(gpu_pytester, fake_run):
    """Items 4 and 5 on the real code path (NVML's verifier and torch's counters, on fake GPUs):
    test_b's cap is its own budget on top of test_a's leftover, and its peak is its own, not
    test_a's 600MiB plus its own (torch's peak counts the whole process)."""
    require("torch", module="torch")
    gpu_pytester.makepyfile(test_leak=REAL_PATH.format(b=700))
    result = fake_run("sim:1x16GiB", "--gpus", "auto", "-p", "no:xdist")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_a*", "*still holds 600MiB on GPU 0 after the test*"])
    assert "test_b broke" not in result.stdout.str()


GIVEN_BACK = """
import pytest
from pytest_gpu.sim import torch_cuda

MiB = 2**20
KEEP = []

@pytest.mark.gpu(memory="1GiB")
def test_a(gpu):
    KEEP.append(torch_cuda.empty(600 * MiB, device=gpu.device))

@pytest.mark.gpu(memory="1GiB")
def test_b_over_budget(gpu):
    torch_cuda.empty(1100 * MiB, device=gpu.device)

@pytest.mark.gpu(memory="256MiB")
def test_c_gives_it_back(gpu):
    KEEP.clear()

@pytest.mark.gpu(memory="1GiB")
def test_d_over_budget(gpu):
    torch_cuda.empty(1100 * MiB, device=gpu.device)
"""


@pytest.mark.parametrize("path", ["simulated", "real"])
def test_what_was_given_back_is_no_longer_charged(gpu_pytester, run_inner, fake_run, path):
    """A leftover stays charged until a later release of its process, measured while no lease of
    it is on that GPU, finds it gone (here after test_c frees it): test_b's out-of-memory report
    names test_a's memory, test_d's no longer does. The simulated path measures the ledger, the
    real one NVML's per-process usage (the fake libnvidia-ml.so.1)."""
    require("torch", module="torch")
    gpu_pytester.makepyfile(test_back=GIVEN_BACK)
    if path == "simulated":
        result = run_inner("--gpus", "sim:1x16GiB", "-p", "no:xdist", subprocess=True)
    else:
        result = fake_run("sim:1x16GiB", "--gpus", "auto", "-p", "no:xdist")
    result.assert_outcomes(passed=2, failed=2, errors=1)
    text = result.stdout.str()
    named = "this process still held 600MiB on GPU 0 left by test_back.py::test_a (reported there)"
    assert text.count(named) == 1, text
    b_report = text[text.index("_ test_b_over_budget _") : text.index("_ test_d_over_budget _")]
    assert named in b_report
