"""pytest_gpu.leasing.broker + pytest_gpu.leasing.client over a real authenticated Unix socket."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Client
from pathlib import Path
from typing import Any

import pytest

from helpers import patience
from pytest_gpu.base.requests import GpuRequest
from pytest_gpu.leasing.broker import Broker
from pytest_gpu.leasing.client import BrokerClient, BrokerError, Grant, WaitTimeout, describe_holders
from pytest_gpu.leasing.protocol import CrashRecord
from pytest_gpu.machine.link import MachineLink
from pytest_gpu.machine.placement import Policy
from pytest_gpu.machine.ports import PortAllocator

MiB, GiB = 2**20, 2**30
OVERHEAD = 500 * MiB
POLICY = Policy(overhead=OVERHEAD)


def whole(count: int = 1) -> GpuRequest:
    return GpuRequest(count=count, memory=None, exclusive=True)


def shared(memory: int, count: int = 1) -> GpuRequest:
    return GpuRequest(count=count, memory=memory, exclusive=False)


def always_free(port: int) -> bool:
    return True


class Run:
    """Brokers and clients of one test, all closed at its end."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.authkey = os.urandom(16)
        self.brokers: list[Broker] = []
        self.clients: list[BrokerClient] = []

    def broker(
        self,
        capacities: dict[int, int] | None = None,
        policy: Policy = POLICY,
        ports: PortAllocator | None = None,
    ) -> Broker:
        address = str(self.tmp_path / f"b{len(self.brokers)}.sock")
        assert len(address) < 100, "Unix socket paths are limited to 108 bytes"
        # ports are the machine's arbiter's: here one in this process (a private link)
        ports = ports or PortAllocator((30000, 30999), check=always_free, seed=0)
        link = MachineLink(None, policy, ports=ports)
        capacities = capacities or {0: 16 * GiB, 1: 16 * GiB}
        broker = Broker(capacities, address, self.authkey, policy, (ports.lo, ports.hi), link=link)
        self.brokers.append(broker.start())
        return broker

    def client(self, worker: str, broker: Broker | None = None, authkey: bytes | None = None) -> BrokerClient:
        broker = broker or self.brokers[-1]
        client = BrokerClient(broker.address, authkey or self.authkey, worker)
        self.clients.append(client)
        return client

    def close(self) -> None:
        for client in self.clients:
            client.close()
        for broker in self.brokers:
            broker.close()


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Run]:
    made = Run(tmp_path)
    yield made
    made.close()


def wait_for(condition: Callable[[], Any], timeout: float = 5.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


class Acquirer(threading.Thread):
    """``client.acquire`` in a thread; ``result`` is the Grant or the exception."""

    def __init__(self, client: BrokerClient, request: GpuRequest, test: str, timeout: float | None) -> None:
        super().__init__(daemon=True)
        self.args_ = (client, request, test, timeout)
        self.result: Grant | BaseException | None = None
        self.done = threading.Event()
        self.start()

    def run(self) -> None:
        client, request, test, timeout = self.args_
        try:
            self.result = client.acquire(request, test, timeout)
        except BaseException as exc:
            self.result = exc
        finally:
            self.done.set()


# -- grants ----------------------------------------------------------------------------


def test_shared_grant(run: Run) -> None:
    broker = run.broker()
    client = run.client("gw0")
    grant = client.acquire(shared(4 * GiB), "tests/t.py::test_a", timeout=5)
    assert grant == Grant(key="k0", indices=(0,), memory=4 * GiB, exclusive=False, waited=0.0)
    status = broker.status()
    assert status["leases"] == [
        {"test": "tests/t.py::test_a", "worker": "gw0", "gpus": [0], "memory": 4 * GiB, "exclusive": False}
    ]
    assert status["clients"] == {client.client_id: {"worker": "gw0", "pid": os.getpid()}}
    assert status["used"] == {0: 4 * GiB + OVERHEAD, 1: 0}
    assert status["grants"] == 1
    assert broker.grants == 1


def test_placements_name_each_workers_granted_leases_until_released(run: Run) -> None:
    """What the scheduler plans with: where every lease held now is, by worker (a waiting one is not)."""
    broker = run.broker()
    a, b = run.client("gw0"), run.client("gw1")
    first = a.acquire(shared(10 * GiB), "t::a", timeout=5)
    second = b.acquire(whole(), "t::b", timeout=5)
    waiting = Acquirer(a, whole(), "t::c", None)  # no empty GPU left: it waits
    wait_for(lambda: broker.status()["waiting"], what="t::c queued")
    assert broker.placements() == {"gw0": [(first.indices, 10 * GiB)], "gw1": [(second.indices, None)]}
    b.release(second.key)
    wait_for(waiting.done.is_set, what="t::c granted")
    assert isinstance(waiting.result, Grant)
    assert broker.placements() == {"gw0": [(first.indices, 10 * GiB), (waiting.result.indices, None)]}
    a.close()  # a worker that goes away takes its leases with it
    wait_for(lambda: not broker.placements(), what="gw0's leases forgotten")


def test_the_broker_serves_its_node_s_view_in_its_gpu_indices(run: Run) -> None:
    """A run on one machine is a run of one node: its broker's view is what the scheduler
    reads (``--gpus 0,2``: the planner's positions 0 and 1 are the broker's GPUs 0 and 2)."""
    broker = run.broker({0: 16 * GiB, 2: 8 * GiB})
    a = run.client("gw0")
    grant = a.acquire(shared(4 * GiB), "t::a", timeout=5)
    broker.catalog["t::a"] = {"gpus": 1, "memory": 4 * GiB}
    view = broker.view()
    assert view.order == (0, 2)
    assert view.room == tuple(broker.room())
    assert view.placements == {"gw0": [(grant.indices, 4 * GiB)]}
    assert view.contexts == {"gw0": frozenset(grant.indices)}
    assert view.context_sizes == (OVERHEAD, OVERHEAD)
    assert view.limits == (16 * GiB - OVERHEAD, 8 * GiB - OVERHEAD)
    assert view.catalog is broker.catalog  # live: what workers send later is read there
    assert view.placed == {"gw0": [(view.positions(grant.indices), 4 * GiB)]}
    assert view.indices((1,)) == (2,) and view.positions((2,)) == (1,)


def test_the_schedulers_plan_is_where_the_lease_goes_when_it_fits(run: Run) -> None:
    """The controller tells the broker where the planner planned a test (``prefer``): that test's
    acquire of the planned shape goes there; a lease of another shape places by the broker's rule."""
    broker = run.broker({0: 16 * GiB, 1: 16 * GiB, 2: 16 * GiB})
    a = run.client("gw0")
    broker.prefer("gw0", "t::a", (2,), GiB)
    assert a.acquire(shared(GiB), "t::a", timeout=5).indices == (2,)  # its own rule: GPU 0
    broker.prefer("gw0", "t::c", (0,), None)
    assert a.acquire(whole(), "t::c", timeout=5).indices == (0,)
    broker.prefer("gw0", "t::b", (2,), 2 * GiB)
    assert a.acquire(shared(GiB), "t::b", timeout=5).indices == (1,)  # another shape: its rule (an idle GPU)
    assert a.acquire(shared(2 * GiB), "t::b", timeout=5).indices == (2,)  # its own rule: GPU 1, as busy
    a.acquire(shared(2 * GiB), "t::b", timeout=5)  # the plan was taken once: this one has none
    assert broker.status()["preferences"] == {"given": 3, "honoured": 3}
    assert broker.contexts() == {"gw0": frozenset({0, 1, 2})}
    assert broker.context_sizes() == [OVERHEAD] * 3
    for bad in [(3,), (0, 0), ()]:
        with pytest.raises(ValueError, match="prefer: t::d: expected distinct GPUs of"):
            broker.prefer("gw0", "t::d", bad, GiB)


def test_a_plan_that_no_longer_fits_is_placed_by_the_brokers_rule(run: Run) -> None:
    broker = run.broker()
    a, b = run.client("gw0"), run.client("gw1")
    held = a.acquire(shared(12 * GiB), "t::a", timeout=5)
    broker.prefer("gw1", "t::b", held.indices, 8 * GiB)  # planned beside a test that is still running
    assert b.acquire(shared(8 * GiB), "t::b", timeout=5).indices != held.indices  # not kept waiting for it
    assert broker.status()["preferences"] == {"given": 1, "honoured": 0}


def test_exclusive_grant_on_two_gpus(run: Run) -> None:
    run.broker()
    client = run.client("gw0")
    grant = client.acquire(whole(2), "t::two", timeout=5)
    assert (grant.indices, grant.memory, grant.exclusive) == ((0, 1), 16 * GiB - OVERHEAD, True)


def test_exclusive_grant_with_a_minimum_reaches_the_broker(run: Run) -> None:
    run.broker({0: 24 * GiB, 1: 80 * GiB, 2: 24 * GiB})
    client = run.client("gw0")
    at_least = GpuRequest(count=1, memory=None, exclusive=True, min_memory=40 * GiB)
    grant = client.acquire(at_least, "t::big", timeout=5)
    assert (grant.indices, grant.memory, grant.exclusive) == ((1,), 80 * GiB - OVERHEAD, True)
    with pytest.raises(BrokerError, match="whole GPU of at least 40GiB"):
        client.acquire(GpuRequest(count=2, memory=None, exclusive=True, min_memory=40 * GiB), "t::two", timeout=5)


def test_keys_are_per_client_and_release_frees(run: Run) -> None:
    broker = run.broker()
    a, b = run.client("gw0"), run.client("gw1")
    ga = a.acquire(whole(), "t::a", timeout=5)
    gb = b.acquire(whole(), "t::b", timeout=5)
    assert ga.key == gb.key == "k0"  # each client numbers its own keys
    assert {ga.indices, gb.indices} == {(0,), (1,)}
    a.release(ga.key)
    a.status()  # release is one-way: a round trip on the same connection orders after it
    assert [row["test"] for row in broker.status()["leases"]] == ["t::b"]
    b.release(gb.key)
    b.status()
    assert broker.status()["leases"] == []


def test_queued_then_granted_when_another_client_releases(run: Run) -> None:
    broker = run.broker()
    holder, waiter = run.client("gw0"), run.client("gw1")
    held = holder.acquire(whole(2), "t::holder", timeout=5)
    thread = Acquirer(waiter, whole(), "t::waiter", timeout=30)
    waiting = wait_for(lambda: broker.status()["waiting"], what="the request to queue")
    assert waiting == [{"key": f"{waiter.client_id}/k0", "request": "1 GPU (whole GPU)", "bypassed": 0}]
    assert not thread.done.is_set()
    time.sleep(0.05)
    holder.release(held.key)
    assert thread.done.wait(5)
    grant = thread.result
    assert isinstance(grant, Grant)
    assert grant.exclusive and len(grant.indices) == 1
    assert grant.waited > 0
    assert broker.status()["waiting"] == []
    assert [row["test"] for row in broker.status()["leases"]] == ["t::waiter"]


def test_several_waiters_are_served_in_order(run: Run) -> None:
    run.broker({0: 16 * GiB})
    holder = run.client("gw0")
    held = holder.acquire(whole(), "t::holder", timeout=5)
    waiters = [run.client(f"gw{i}") for i in (1, 2, 3)]
    threads = []
    for i, client in enumerate(waiters):
        threads.append(Acquirer(client, whole(), f"t::w{i}", timeout=30))
        wait_for(lambda n=i + 1: len(run.brokers[0].status()["waiting"]) == n, what="queueing")
    order = []
    release_key, release_client = held.key, holder
    for _ in threads:
        release_client.release(release_key)
        done = wait_for(lambda: [t for t in threads if t.done.is_set() and t not in order], what="a grant")
        assert len(done) == 1
        order.append(done[0])
        assert isinstance(done[0].result, Grant)
        release_key, release_client = done[0].result.key, done[0].args_[0]
    assert order == threads


# -- refusals --------------------------------------------------------------------------


def test_wait_timeout_names_the_request_and_the_holder(run: Run) -> None:
    broker = run.broker({0: 16 * GiB})
    holder, waiter = run.client("gw0"), run.client("gw1")
    holder.acquire(whole(), "tests/test_a.py::test_holder", timeout=5)
    with pytest.raises(WaitTimeout) as info:
        waiter.acquire(whole(), "tests/test_b.py::test_waiter", timeout=0.3)
    assert str(info.value) == (
        "waited 0.3s for 1 GPU (whole GPU) (--gpu-wait-timeout); "
        "held by tests/test_a.py::test_holder (gw0: GPU 0, whole GPU)"
    )
    assert isinstance(info.value, BrokerError)
    assert broker.status()["waiting"] == []  # the request was withdrawn


def test_wait_timeout_for_shared_memory_names_every_holder(run: Run) -> None:
    run.broker({0: 16 * GiB})
    a, b, waiter = run.client("gw0"), run.client("gw1"), run.client("gw2")
    a.acquire(shared(8 * GiB), "t::a", timeout=5)
    b.acquire(shared(6 * GiB), "t::b", timeout=5)
    with pytest.raises(WaitTimeout) as info:
        waiter.acquire(shared(2 * GiB, count=1), "t::c", timeout=0.2)
    assert str(info.value) == (
        "waited 0.2s for 1 GPU (2GiB) (--gpu-wait-timeout); held by t::a (gw0: GPU 0, 8GiB); t::b (gw1: GPU 0, 6GiB)"
    )


def test_a_timed_out_request_is_not_granted_later(run: Run) -> None:
    broker = run.broker({0: 16 * GiB})
    holder, waiter = run.client("gw0"), run.client("gw1")
    held = holder.acquire(whole(), "t::holder", timeout=5)
    with pytest.raises(WaitTimeout):
        waiter.acquire(whole(), "t::waiter", timeout=0.1)
    holder.release(held.key)
    holder.status()  # release is one-way: a round trip on the same connection orders after it
    assert broker.status()["leases"] == []
    assert waiter.acquire(whole(), "t::again", timeout=5).indices == (0,)  # the client still works


def test_unsatisfiable_request_is_a_broker_error(run: Run) -> None:
    broker = run.broker()
    client = run.client("gw0")
    with pytest.raises(BrokerError) as info:
        client.acquire(whole(3), "t::three", timeout=5)
    assert str(info.value) == (
        "needs 3 GPUs (whole GPU each) but the inventory has 2 GPU(s) [16GiB, 16GiB] "
        "with 500MiB of context overhead each"
    )
    assert not isinstance(info.value, WaitTimeout)
    with pytest.raises(BrokerError, match=r"^needs 1 GPU \(16GiB\) but the inventory has 2 GPU\(s\)"):
        client.acquire(shared(16 * GiB), "t::too_big", timeout=5)
    assert broker.status()["waiting"] == []
    assert client.acquire(whole(), "t::fine", timeout=5).indices == (0,)


def test_request_blocked_by_contexts_is_refused(run: Run) -> None:
    run.broker({0: 4 * GiB}, Policy(overhead=GiB, context_fraction=1.0))
    for worker in ("gw0", "gw1", "gw2"):
        client = run.client(worker)
        client.release(client.acquire(shared(256 * MiB), f"t::{worker}", timeout=5).key)  # contexts stay
    with pytest.raises(BrokerError) as info:
        run.client("gw3").acquire(shared(2 * GiB), "t::blocked", timeout=5)
    assert str(info.value).startswith("1 GPU (2GiB) cannot fit beside the CUDA contexts that other processes keep open")


def test_wrong_authkey_is_refused_and_the_broker_keeps_serving(run: Run) -> None:
    broker = run.broker()
    with pytest.raises(BrokerError) as info:
        BrokerClient(broker.address, b"not the key", "intruder")
    assert str(info.value).startswith(f"cannot reach the pytest-gpu broker at {broker.address}: ")
    with pytest.raises(Exception):  # noqa: B017 - whatever multiprocessing raises, it is refused
        Client(broker.address, family="AF_UNIX", authkey=os.urandom(16))
    client = run.client("gw0")
    assert client.acquire(whole(), "t::after", timeout=5).indices == (0,)
    assert list(broker.status()["clients"].values()) == [{"worker": "gw0", "pid": os.getpid()}]


def test_no_broker_at_the_address(tmp_path: Path) -> None:
    address = str(tmp_path / "none.sock")
    with pytest.raises(BrokerError, match=r"^cannot reach the pytest-gpu broker at .*none\.sock: "):
        BrokerClient(address, b"key", "gw0")


def test_socket_is_private(run: Run) -> None:
    broker = run.broker()
    assert os.stat(broker.address).st_mode & 0o777 == 0o600


def test_lost_broker_is_a_broker_error(run: Run) -> None:
    broker = run.broker()
    client = run.client("gw0")
    broker.close()
    with pytest.raises(BrokerError, match=r"^lost the connection to the pytest-gpu broker"):
        client.acquire(whole(), "t::x", timeout=5)


# -- ports -----------------------------------------------------------------------------


def test_ports_unique_across_clients_and_reclaimed(run: Run) -> None:
    broker = run.broker(ports=PortAllocator((30000, 30005), check=always_free, seed=0))
    a, b, c = run.client("gw0"), run.client("gw1"), run.client("gw2")
    pa = a.ports(3, "t::a")
    pb = b.ports(3, "t::b")
    assert sorted(pa + pb) == list(range(30000, 30006))
    with pytest.raises(BrokerError) as info:
        c.ports(1, "t::c")
    assert str(info.value) == "only 0 of 1 ports free in 30000-30005 (6 leased); widen --gpu-port-range"
    a.release_ports("t::a")
    assert sorted(broker.status()["ports"]) == sorted(pb)
    assert sorted(c.ports(3, "t::c")) == sorted(pa)
    owners = broker.status()["ports"]
    assert {owners[p] for p in pb} == {f"{b.client_id}/t::b"}


def test_release_ports_only_returns_that_owners(run: Run) -> None:
    broker = run.broker()
    client = run.client("gw0")
    first = client.ports(2, "t::one")
    second = client.ports(1, "t::two")
    client.release_ports("t::one")
    assert sorted(broker.status()["ports"]) == second
    assert not set(first) & set(second)


def test_real_ports_are_bindable(run: Run) -> None:
    import socket

    broker = run.broker(ports=PortAllocator(seed=11))  # the real bind check, the default range
    for port in run.client("gw0").ports(4, "t::real"):
        assert 20000 <= port <= 32767
        with socket.socket() as sock:
            sock.bind(("", port))
    assert len(broker.status()["ports"]) == 4


# -- contexts and affinity ---------------------------------------------------------------


def test_reported_contexts_steer_placement(run: Run) -> None:
    broker = run.broker({0: 16 * GiB, 1: 16 * GiB, 2: 16 * GiB})
    client = run.client("gw0")
    grant = client.acquire(shared(GiB, count=3), "t::all", timeout=5)
    client.release(grant.key, contexts={2})  # its process keeps a context on GPU 2 alone
    client.status()  # release is one-way: a round trip on the same connection orders after it
    assert broker.status()["contexts"] == {0: [], 1: [], 2: [client.client_id]}
    assert client.acquire(shared(GiB), "t::home", timeout=5).indices == (2,)


def test_release_with_contexts(run: Run) -> None:
    broker = run.broker()
    client = run.client("gw0")
    grant = client.acquire(shared(GiB, count=2), "t::two", timeout=5)
    client.release(grant.key, contexts={1})
    client.status()  # release is one-way: a round trip on the same connection orders after it
    assert broker.status()["contexts"] == {0: [], 1: [client.client_id]}
    assert broker.status()["used"] == {0: 0, 1: OVERHEAD}


# -- clients that go away --------------------------------------------------------------


def test_closed_client_loses_everything_and_is_recorded(run: Run) -> None:
    broker = run.broker()
    client = run.client("gw4")
    client.acquire(whole(), "t::held", timeout=5)
    ports = client.ports(2, "t::held")
    client.close()
    wait_for(lambda: not broker.status()["clients"], what="the disconnect")
    status = broker.status()
    assert (status["leases"], status["ports"], status["waiting"]) == ([], {}, [])
    (crash,) = broker.crashes
    assert (crash.worker, crash.pid, crash.test, crash.gpus, crash.ports) == (
        "gw4",
        os.getpid(),
        "t::held",
        (0,),
        tuple(sorted(ports)),
    )


def test_client_that_held_nothing_is_no_crash(run: Run) -> None:
    broker = run.broker()
    client = run.client("gw0")
    client.release(client.acquire(whole(), "t::x", timeout=5).key)
    client.close()
    wait_for(lambda: not broker.status()["clients"], what="the disconnect")
    assert broker.crashes == []


def test_this_process_keeps_its_contexts_counted_until_the_run_leaves_the_machine(
    run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run without xdist workers tests in its own process, which keeps its contexts until it
    exits, after the run: counted also when its client is still connected as the run ends."""
    broker = run.broker()
    client = run.client("gw0")
    client.release(client.acquire(shared(GiB), "t::x", timeout=5).key, contexts={1})
    client.status()  # release is one-way: a round trip on the same connection orders after it
    at_leave: list[list[str]] = []
    leave = broker.link.close
    monkeypatch.setattr(broker.link, "close", lambda: at_leave.append(broker.link.status()["gpus"][1]["clients"]))
    broker.close()
    assert at_leave == [[f"{broker.link.run}|{client.client_id}~exiting"]]
    monkeypatch.undo()
    leave()


CHILD = """
import sys, time
from pytest_gpu.leasing.client import BrokerClient
from pytest_gpu.base.requests import GpuRequest

address, key, worker, test, count = sys.argv[1], bytes.fromhex(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
client = BrokerClient(address, key, worker)
indices = ()
if count:
    indices = client.acquire(GpuRequest(count=count, memory=None, exclusive=True), test, 30).indices
ports = client.ports(2, test)
print("ready", ",".join(map(str, indices)), ",".join(map(str, ports)), flush=True)
time.sleep(120)
"""


@pytest.fixture
def spawn(run: Run) -> Iterator[Callable[..., tuple[subprocess.Popen[str], list[int], list[int]]]]:
    procs: list[subprocess.Popen[str]] = []

    def start(worker: str, test: str, count: int) -> tuple[subprocess.Popen[str], list[int], list[int]]:
        broker = run.brokers[-1]
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, broker.address, run.authkey.hex(), worker, test, str(count)],
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        assert line and line[0] == "ready", f"client process failed (exit code {proc.poll()})"
        indices = [int(i) for i in line[1].split(",")] if count else []
        ports = [int(p) for p in line[-1].split(",")]
        return proc, indices, ports

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=patience(30))
        assert proc.stdout is not None
        proc.stdout.close()


def test_sigkilled_client_process_frees_gpus_and_ports_within_a_second(run: Run, spawn: Any) -> None:
    broker = run.broker()
    test = "tests/test_crash.py::test_holds_two[param]"
    proc, indices, ports = spawn("gw3", test, 2)
    assert indices == [0, 1]
    status = broker.status()
    assert [row["gpus"] for row in status["leases"]] == [[0, 1]]
    assert sorted(status["ports"]) == sorted(ports)

    waiter = run.client("gw0")
    thread = Acquirer(waiter, whole(2), "t::next", timeout=30)
    wait_for(lambda: broker.status()["waiting"], what="the waiter to queue")

    os.kill(proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    deadline = killed + 1.0

    def freed() -> bool:
        status = broker.status()
        return status["ports"] == {} and all(row["test"] != test for row in status["leases"])

    while not freed():
        assert time.monotonic() < deadline, f"not freed within 1 s: {broker.status()}"
        time.sleep(0.005)
    # the waiting client gets the GPUs the dead one held, just as fast
    assert thread.done.wait(max(deadline - time.monotonic(), 0) + 0.001), "waiter not granted within 1 s"
    assert isinstance(thread.result, Grant)
    assert thread.result.indices == (0, 1)

    (crash,) = broker.crashes
    assert isinstance(crash, CrashRecord)
    assert (crash.worker, crash.pid, crash.test, crash.gpus, crash.ports) == (
        "gw3",
        proc.pid,
        test,
        (0, 1),
        tuple(sorted(ports)),
    )
    assert broker.status()["crashes"][0]["worker"] == "gw3"


def test_crash_holding_only_ports_names_the_running_test(run: Run, spawn: Any) -> None:
    broker = run.broker()
    proc, _, ports = spawn("gw5", "tests/test_p.py::test_ports_only", 0)
    proc.kill()
    wait_for(lambda: broker.crashes, what="the crash record")
    (crash,) = broker.crashes
    assert (crash.worker, crash.test, crash.gpus, crash.ports) == (
        "gw5",
        "tests/test_p.py::test_ports_only",
        (),
        tuple(sorted(ports)),
    )
    assert broker.status()["ports"] == {}


def test_replacement_worker_works_after_a_crash(run: Run, spawn: Any) -> None:
    broker = run.broker()
    proc, _, _ = spawn("gw1", "t::crashes", 2)
    proc.kill()
    wait_for(lambda: broker.crashes, what="the crash record")
    replacement = run.client("gw8")
    grant = replacement.acquire(whole(2), "t::next", timeout=5)
    assert grant.indices == (0, 1)
    assert replacement.ports(2, "t::next")
    assert [c["worker"] for c in broker.status()["clients"].values()] == ["gw8"]


# -- holders text ----------------------------------------------------------------------


def test_describe_holders() -> None:
    assert describe_holders([]) == "no test held a GPU at that moment"
    rows = [
        {"test": "t::a", "worker": "gw0", "gpus": [0, 1], "memory": 15 * GiB, "exclusive": True},
        {"test": "t::b", "worker": "gw2", "gpus": [3], "memory": 512 * MiB, "exclusive": False},
    ]
    assert describe_holders(rows) == "held by t::a (gw0: GPU 0,1, whole GPU); t::b (gw2: GPU 3, 512MiB)"


def test_a_request_that_gives_up_lets_the_one_behind_it_through(run: Run) -> None:
    # One 16 GiB GPU; max_bypass=0 means nothing may overtake a waiting request.
    broker = run.broker({0: 16 * GiB}, policy=Policy(overhead=OVERHEAD, max_bypass=0))
    holder, big, small = run.client("gw0"), run.client("gw1"), run.client("gw2")
    held = holder.acquire(shared(8 * GiB), "t_hold", 5)
    got: list[Grant] = []
    waiter = threading.Thread(target=lambda: got.append(small.acquire(shared(2 * GiB), "t_small", 10)))
    with pytest.raises(WaitTimeout):
        # the big request waits (it does not fit beside the 8 GiB lease); the small one
        # queues behind it and may not overtake it...
        threading.Timer(0.2, waiter.start).start()
        big.acquire(shared(12 * GiB), "t_big", 1.0)
    # ...until the big one gives up: then the small one is served at once, not at the
    # next release.
    waiter.join(timeout=2)
    assert got and got[0].indices == (0,)
    assert broker.status()["waiting"] == []
    holder.release(held.key)


def test_release_is_one_way_and_ordered(run: Run) -> None:
    broker = run.broker()
    client = run.client("gw0")
    grant = client.acquire(whole(), "t::a", 5)
    client.release(grant.key)  # returns without waiting for the broker
    # the next request on the same connection is handled after the release
    again = client.acquire(whole(2), "t::b", 5)
    assert again.indices == (0, 1) and again.waited == 0.0
    assert [row["test"] for row in broker.status()["leases"]] == ["t::b"]


def test_a_retry_s_lease_avoids_the_gpus_of_its_failure(run: Run) -> None:
    """--gpu-retry-infra: a lease asked with ``avoid`` goes to the run's other GPUs (not the
    worker's own by affinity, nor where the scheduler planned it), unless too few are left."""
    broker = run.broker()
    a = run.client("gw0")
    assert a.acquire(shared(GiB), "t::a", timeout=5).indices == (0,)  # GPU 0 from now on: affinity
    assert a.acquire(shared(GiB), "t::a", timeout=5, avoid=(0,)).indices == (1,)
    broker.prefer("gw0", "t::b", (0,), GiB)  # planned where the retry must not go
    assert a.acquire(shared(GiB), "t::b", timeout=5, avoid=(0,)).indices == (1,)
    assert a.acquire(shared(GiB, count=2), "t::c", timeout=5, avoid=(0,)).indices == (0, 1)  # no others enough
