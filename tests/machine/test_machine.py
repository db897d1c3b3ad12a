"""Machine-wide leasing: one arbiter for every run of a machine (pytest_gpu.machine)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import MISSING
from helpers import patience, shared, throwaway_user, wait_for, whole
from pytest_gpu.cli import format_status, gpu_labels, identify
from pytest_gpu.cli import main as cli_main
from pytest_gpu.machine.arbiter import Arbiter
from pytest_gpu.machine.domain import ROOT_ENV, Domain
from pytest_gpu.machine.link import MachineLink
from pytest_gpu.machine.messages import PART, Held
from pytest_gpu.machine.placement import Policy
from pytest_gpu.sim.spec import amd_uuid, mig_uuid, xpu_uuid
from pytest_gpu.sim.spec import gpu_uuid as sim_uuid
from pytest_gpu.vendors.devices import Device
from pytest_gpu.wire.sockets import reachable

GiB = 2**30
MiB = 2**20


class Events:
    """A run's sink: collects events, lets a test wait for one."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict]] = []
        self._cond = threading.Condition()

    def __call__(self, events) -> None:
        with self._cond:
            self.events.extend(events)
            self._cond.notify_all()

    def wait(self, key: str, timeout: float = 5.0) -> tuple[str, dict]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for kind, k, body in self.events:
                    if k == key:
                        return kind, body
                left = deadline - time.monotonic()
                assert left > 0, f"no event for {key} within {timeout}s: {self.events}"
                self._cond.wait(left)


def attach(arbiter: Arbiter, run: str, gpus: dict[str, int], pid: int = 0) -> Events:
    sink = Events()
    arbiter.attach(run, pid=pid or os.getpid(), user="u", label=run, gpus=gpus, sink=sink)
    return sink


# -- the arbiter: decisions for every run -------------------------------------------------


def test_two_runs_never_promise_the_same_memory():
    arbiter = Arbiter(Policy(overhead=0))
    attach(arbiter, "r1", {"U": 16 * GiB})
    r2 = attach(arbiter, "r2", {"U": 16 * GiB})
    assert arbiter.submit("r1", "c0/k0", "c0", "gw0", "t::a", shared(10 * GiB), ["U"])[0] == "granted"
    assert arbiter.submit("r2", "c0/k0", "c0", "gw0", "t::b", shared(10 * GiB), ["U"]) == ("queued", None)
    arbiter.release("r1", "c0/k0")
    kind, body = r2.wait("c0/k0")
    assert (kind, body["gpus"], body["memory"]) == ("granted", ["U"], 10 * GiB)


def test_exclusive_is_exclusive_across_runs():
    arbiter = Arbiter(Policy(overhead=0))
    attach(arbiter, "r1", {"U": 16 * GiB})
    attach(arbiter, "r2", {"U": 16 * GiB})
    assert arbiter.submit("r1", "c0/k0", "c0", "gw0", "t::a", whole(), ["U"])[0] == "granted"
    assert arbiter.submit("r2", "c0/k0", "c0", "gw0", "t::b", shared(GiB), ["U"]) == ("queued", None)
    assert arbiter.submit("r2", "c1/k0", "c1", "gw1", "t::c", whole(), ["U"]) == ("queued", None)


def test_runs_that_number_gpus_differently_share_them_by_uuid():
    arbiter = Arbiter(Policy(overhead=0))
    attach(arbiter, "r1", {"A": 16 * GiB, "B": 16 * GiB})  # --gpus 0,1
    attach(arbiter, "r2", {"B": 16 * GiB, "C": 16 * GiB})  # --gpus 1,2
    assert arbiter.submit("r1", "c0/k0", "c0", "gw0", "t", shared(12 * GiB, count=2), ["A", "B"])[1]["gpus"] == [
        "A",
        "B",
    ]
    # r2 never gets a GPU it cannot see, and not B, which r1 filled
    kind, body = arbiter.submit("r2", "c0/k0", "c0", "gw0", "t", shared(12 * GiB), ["B", "C"])
    assert (kind, body["gpus"]) == ("granted", ["C"])
    assert arbiter.submit("r2", "c0/k1", "c0", "gw0", "t", shared(12 * GiB), ["B", "C"]) == ("queued", None)


def test_a_run_that_goes_away_gives_everything_back_to_the_others():
    arbiter = Arbiter(Policy(overhead=GiB // 2))
    attach(arbiter, "r1", {"U": 16 * GiB})
    r2 = attach(arbiter, "r2", {"U": 16 * GiB})
    arbiter.submit("r1", "c0/k0", "c0", "gw0", "t::a", whole(), ["U"])
    arbiter.set_contexts("r1", "c1", ["U"])
    assert arbiter.submit("r2", "c0/k0", "c0", "gw0", "t::b", shared(15 * GiB), ["U"]) == ("queued", None)
    held = arbiter.detach("r1")
    assert held == [("c0/k0", ("U",))]
    assert r2.wait("c0/k0")[0] == "granted"  # r1's lease and both its contexts are gone
    assert [r["run"] for r in arbiter.status()["runs"]] == ["r2"]


def test_waiting_is_fair_across_runs():
    """A whole-GPU request of one run is overtaken at most max_bypass times by another run's small ones."""
    arbiter = Arbiter(Policy(overhead=0, max_bypass=3))
    attach(arbiter, "busy", {"U": 16 * GiB})
    big = attach(arbiter, "big", {"U": 16 * GiB})
    arbiter.submit("busy", "c0/k0", "c0", "gw0", "t", shared(GiB), ["U"])
    assert arbiter.submit("big", "c0/k0", "c0", "gw0", "t::whole", whole(), ["U"]) == ("queued", None)
    outcomes = [arbiter.submit("busy", f"c1/k{i}", "c1", "gw1", "t", shared(GiB), ["U"])[0] for i in range(6)]
    assert outcomes == ["granted"] * 3 + ["queued"] * 3  # overtaken 3 times, then nothing passes it
    for key in ["c0/k0", "c1/k0", "c1/k1", "c1/k2"]:
        arbiter.release("busy", key)
    assert big.wait("c0/k0")[0] == "granted"


def test_a_new_arbiter_grants_nothing_until_the_runs_that_held_leases_are_back():
    arbiter = Arbiter(Policy(overhead=0))
    arbiter.expect({"r1"}, within=5.0)
    attach(arbiter, "r2", {"U": 16 * GiB})
    assert arbiter.submit("r2", "c0/k0", "c0", "gw0", "t", shared(10 * GiB), ["U"]) == ("queued", None)
    held = Held("c0/k0", "c0", "gw0", "t::r1", shared(10 * GiB), ("U",), 10 * GiB, False)
    arbiter.attach("r1", pid=os.getpid(), user="u", label="r1", gpus={"U": 16 * GiB}, sink=Events(), held=[held])
    assert arbiter.status()["pending"] == []
    # r1's lease was taken over as it was: r2's request still waits
    assert [w["run"] for w in arbiter.status()["waiting"]] == ["r2"]


def test_a_new_arbiter_counts_the_contexts_a_run_brings_before_it_grants_anything():
    """The last run a new arbiter waits for resumes its grants: the contexts its processes
    have (an exiting one's too) must be counted by then, not declared after."""
    arbiter = Arbiter(Policy(overhead=GiB))
    arbiter.expect({"r1", "r2"}, within=5.0)
    r1 = attach(arbiter, "r1", {"U": 16 * GiB})
    assert arbiter.submit("r1", "c0/k0", "c0", "gw0", "t", shared(int(13.5 * GiB)), ["U"]) == ("queued", None)
    arbiter.attach(
        "r2",
        pid=os.getpid(),
        user="u",
        label="r2",
        gpus={"U": 16 * GiB},
        sink=Events(),
        contexts={"c0": ["U"]},
        exiting={"c1": ["U"]},
    )
    # 16 GiB less three contexts (r2's two and its own) leaves 13 GiB: it waits for the exiting one
    state = arbiter.status()
    assert state["pending"] == [] and [w["run"] for w in state["waiting"]] == ["r1"], r1.events
    assert state["gpus"][0]["clients"] == ["r2|c0", "r2|c1~exiting"]
    arbiter.exited("r2", "c1")
    assert r1.wait("c0/k0")[0] == "granted"


def test_a_new_arbiter_stops_waiting_for_a_run_that_never_comes_back():
    arbiter = Arbiter(Policy(overhead=0))
    arbiter.expect({"gone"}, within=0.2)
    r2 = attach(arbiter, "r2", {"U": 16 * GiB})
    assert arbiter.submit("r2", "c0/k0", "c0", "gw0", "t", shared(GiB), ["U"]) == ("queued", None)
    assert r2.wait("c0/k0", timeout=3)[0] == "granted"


class Foreign:
    """A foreign-usage source the test steers (NVML's role)."""

    def __init__(self, usage: dict[str, int]) -> None:
        self.usage = dict(usage)
        self.roots: list[set[int]] = []

    def __call__(self, uuids: list[str], roots: set[int], accounted: dict[str, int]) -> dict[str, int]:
        self.roots.append(set(roots))
        self.accounted = dict(accounted)
        return {u: self.usage.get(u, 0) for u in uuids}


def test_foreign_usage_is_avoided_and_said():
    foreign = Foreign({"A": 10 * GiB})
    arbiter = Arbiter(Policy(overhead=0), foreign=foreign, foreign_ttl=0.05)
    attach(arbiter, "r1", {"A": 16 * GiB, "B": 16 * GiB}, pid=4242)
    arbiter.submit("r1", "c1/k0", "c1", "gw1", "t", shared(1 * GiB), ["B"])  # B busy too: no idle GPU
    arbiter.submit("r1", "c0/k0", "c0", "gw0", "t", shared(4 * GiB), ["A"])
    # without the foreign process the worker would stay on A (its context, 12 GiB left); it has only 2
    kind, body = arbiter.submit("r1", "c0/k1", "c0", "gw0", "t", shared(10 * GiB), ["A", "B"])
    assert (kind, body["gpus"]) == ("granted", ["B"])
    assert body["foreign"]["avoided"] == ["A"] and body["foreign"]["bytes"] == {"A": 10 * GiB}
    assert foreign.roots[-1] == {4242}  # the runs' processes are never foreign
    assert set(foreign.accounted) == {"A", "B"}  # what the pool promised there, for NVML without pids
    assert arbiter.room(["A", "B"]) == [6 * GiB, 16 * GiB]


class Exiting(Foreign):
    """NVML's view of a run's process that is exiting: what it holds on each GPU is foreign
    once its pid is no run's (a root) any more."""

    def __init__(self, pid: int, held: dict[str, int]) -> None:
        super().__init__({})
        self.pid, self.held = pid, held

    def __call__(self, uuids: list[str], roots: set[int], accounted: dict[str, int]) -> dict[str, int]:
        self.roots.append(set(roots))
        return {u: 0 if self.pid in roots else self.held.get(u, 0) for u in uuids}


def test_what_a_leaving_run_held_is_granted_only_once_its_process_counts_as_foreign():
    """The arbiter's own run leaves while its process (and its CUDA context) is still exiting:
    nothing it held may be granted before that context counts as foreign usage. Forgetting
    its clients granted a waiting request at once, from the room its open context still
    filled (test_concurrent_runs' simulated OOM, 1 trial in 8)."""
    context = 500 * MiB
    arbiter = Arbiter(Policy(overhead=context), foreign=Exiting(1111, {"A": context}), foreign_ttl=60)
    attach(arbiter, "r1", {"A": 16 * GiB}, pid=1111)  # the arbiter's own run, leaving
    r2 = attach(arbiter, "r2", {"A": 16 * GiB}, pid=2222)
    big = shared(int(7.3 * GiB))
    assert arbiter.submit("r1", "c0/k0", "c0", "gw0", "t::first", big, ["A"])[0] == "granted"
    arbiter.release("r1", "c0/k0", ["A"])  # its process keeps its context
    arbiter.exiting("r1", "c0", ["A"])
    assert arbiter.submit("r2", "c0/k0", "c0", "gw0", "t::a", big, ["A"])[0] == "granted"
    # 16GiB - 7.3GiB - three contexts (r1's, and r2's two) = 7.2GiB: too little
    assert arbiter.submit("r2", "c1/k0", "c1", "gw1", "t::b", big, ["A"]) == ("queued", None)
    arbiter.detach("r1")  # its context is no run's now: foreign, and still 500 MiB
    assert [w["key"] for w in arbiter.status()["waiting"]] == ["c1/k0"]
    assert r2.events == []


def test_a_gpu_a_foreign_process_uses_comes_last_even_where_it_has_room():
    arbiter = Arbiter(Policy(overhead=0), foreign=Foreign({"A": GiB}))
    attach(arbiter, "r1", {"A": 16 * GiB, "B": 16 * GiB})
    arbiter.submit("r1", "c0/k0", "c0", "gw0", "t", shared(4 * GiB), ["B"])
    assert arbiter.submit("r1", "c1/k0", "c1", "gw1", "t", shared(10 * GiB), ["A", "B"])[1]["gpus"] == ["B"]


def test_a_request_waits_for_foreign_usage_to_go_without_any_other_event():
    foreign = Foreign({"A": 14 * GiB})
    arbiter = Arbiter(Policy(overhead=0), foreign=foreign, foreign_ttl=0.05)
    sink = attach(arbiter, "r1", {"A": 16 * GiB})
    assert arbiter.submit("r1", "c0/k0", "c0", "gw0", "t", shared(4 * GiB), ["A"]) == ("queued", None)
    assert arbiter.status()["waiting"][0]["foreign"] is True
    foreign.usage["A"] = 0  # the foreign process exits; no run does anything
    kind, body = sink.wait("c0/k0", timeout=2)
    assert kind == "granted" and body["foreign"]["waited"] is True


def test_a_cycle_of_hold_and_wait_is_refused_at_once_naming_who_holds_what():
    """The migration guide's deadlock: each worker's module-scoped model holds a GPU while a
    test of its module waits for a whole one. The request that closes the cycle is refused
    at once (not at --gpu-wait-timeout); the other is served once that worker's model goes."""
    arbiter = Arbiter(Policy(overhead=0))
    sink = attach(arbiter, "r1", {"A": 16 * GiB, "B": 16 * GiB})
    model = "fixture 'model' (module scope, test_{}.py)"
    assert arbiter.submit("r1", "c0/k0", "c0", "gw0", model.format("a"), shared(6 * GiB), ["A", "B"])[0] == "granted"
    assert arbiter.submit("r1", "c1/k0", "c1", "gw1", model.format("b"), shared(6 * GiB), ["A", "B"])[0] == "granted"
    assert arbiter.submit("r1", "c0/k1", "c0", "gw0", "test_a.py::test_full", whole(), ["A", "B"]) == ("queued", None)
    kind, message = arbiter.submit("r1", "c1/k1", "c1", "gw1", "test_b.py::test_full", whole(), ["A", "B"])
    assert kind == "rejected"
    assert message == (
        "a deadlock (hold-and-wait): only what waiting workers hold could serve it, and a worker gives nothing "
        "back while it waits:\n"
        "  - gw1 holds B (6GiB, fixture 'model' (module scope, test_b.py)) and waits for 1 GPU (whole GPU) "
        "for test_b.py::test_full\n"
        "  - gw0 holds A (6GiB, fixture 'model' (module scope, test_a.py)) and waits for 1 GPU (whole GPU) "
        "for test_a.py::test_full\n"
        "refused now, not at --gpu-wait-timeout. While a test waits, its worker keeps its other leases: the "
        "test's own, its fixtures' (until the worker leaves their scope, also through that scope's tests that do "
        "not use them) and its warm rank pools'"
    )
    assert [w["key"] for w in arbiter.status()["waiting"]] == ["c0/k1"]  # the other one still waits
    arbiter.release("r1", "c1/k0")  # gw1's test failed, its module ended: its model goes back
    assert sink.wait("c0/k1")[0] == "granted"


def test_a_deadlock_across_runs_names_another_users_tests_as_status_does():
    arbiter = Arbiter(Policy(overhead=0))
    gpus = {"A": 16 * GiB, "B": 16 * GiB}
    attach(arbiter, "1000.1-a", gpus)
    arbiter.attach("1001.2-b", pid=os.getpid(), user="bob", label="b", gpus=gpus, sink=Events())
    ask = ["A", "B"]
    assert arbiter.submit("1000.1-a", "c0/k0", "c0", "gw0", "fixture 'secret'", shared(4 * GiB), ask)[0] == "granted"
    assert arbiter.submit("1001.2-b", "c0/k0", "c0", "gw3", "fixture 'engine'", shared(4 * GiB), ask)[0] == "granted"
    assert arbiter.submit("1000.1-a", "c0/k1", "c0", "gw0", "test_x.py::test_x", whole(), ask)[0] == "queued"
    kind, message = arbiter.submit("1001.2-b", "c0/k1", "c0", "gw3", "test_y.py::test_y", whole(), ask)
    assert kind == "rejected"
    assert "  - gw3 holds B (4GiB, fixture 'engine') and waits for 1 GPU (whole GPU) for test_y.py::test_y" in message
    assert (
        "  - a worker of user u holds A (4GiB, a test of user u) and waits for 1 GPU (whole GPU) for a test of user u"
        in message
    )
    assert "secret" not in message and "test_x" not in message


# -- links: runs in different processes, electing an arbiter ---------------------------------


@pytest.fixture(params=["private", "machine_wide"])
def domain(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Domain:
    """This user's own domain (a lock file and a socket in a 0700 directory), or one where
    every user's runs meet (an abstract socket: binding it is the election)."""
    monkeypatch.setenv(ROOT_ENV, str(tmp_path / "machines"))
    return getattr(Domain, request.param)(f"sim-{tmp_path.name}")


@pytest.fixture
def links(domain: Domain) -> Iterator[list[MachineLink]]:
    made: list[MachineLink] = []
    yield made
    for link in made:
        link.close()


def new_link(links: list[MachineLink], domain: Domain, gpus: dict[str, int], policy=None) -> tuple[MachineLink, Events]:
    link = MachineLink(domain, policy or Policy(overhead=0))
    sink = Events()
    link.attach(gpus, sink)
    links.append(link)
    return link, sink


def test_the_first_run_is_the_arbiter_and_the_next_attach_to_it(domain, links):
    a, _ = new_link(links, domain, {"U": 16 * GiB})
    b, b_events = new_link(links, domain, {"U": 16 * GiB})
    assert a.is_arbiter and not b.is_arbiter
    assert a.submit("c0/k0", "c0", "gw0", "t::a", whole(), ["U"])[0] == "granted"
    assert b.submit("c0/k0", "c0", "gw0", "t::b", shared(GiB), ["U"]) == ("queued", None)
    a.release("c0/k0")
    assert b_events.wait("c0/k0")[0] == "granted"
    assert {r["run"] for r in b.status()["runs"]} == {a.run, b.run}


def test_when_the_arbiter_leaves_another_run_takes_over_with_what_everyone_holds(domain, links):
    a, _ = new_link(links, domain, {"U": 16 * GiB})
    b, _ = new_link(links, domain, {"U": 16 * GiB})
    c, c_events = new_link(links, domain, {"U": 16 * GiB})
    assert b.submit("c0/k0", "c0", "gw0", "t::b", shared(10 * GiB), ["U"])[0] == "granted"
    assert c.submit("c0/k0", "c0", "gw0", "t::c", shared(10 * GiB), ["U"]) == ("queued", None)
    a.close()
    # the next call of either elects again; both re-declare: b's lease stays, c still waits
    deadline = time.monotonic() + patience(5)
    while not (b.is_arbiter or c.is_arbiter):
        assert time.monotonic() < deadline, "no new arbiter"
        time.sleep(0.01)
    # both have re-attached (the one that did not lead may still be on its way)
    while len((state := b.status())["runs"]) < 2:
        assert time.monotonic() < deadline, f"not both re-attached: {state['runs']}"
        time.sleep(0.01)
    assert [(r["run"], r["test"]) for r in state["leases"]] == [(b.run, "t::b")]
    assert [(w["run"], w["test"]) for w in state["waiting"]] == [(c.run, "t::c")]
    b.release("c0/k0")
    assert c_events.wait("c0/k0")[0] == "granted"


def test_runs_bring_their_contexts_and_exiting_processes_to_a_new_arbiter(domain, links):
    a, _ = new_link(links, domain, {"U": 16 * GiB})
    b, _ = new_link(links, domain, {"U": 16 * GiB})
    c, _ = new_link(links, domain, {"U": 16 * GiB})
    for link in (b, c):
        link.set_contexts("c0", ["U"])
        link.exiting("c1", ["U"])  # c1 closed its connection; its process has not exited yet
    a.close()
    # one of them leads (declares in-process), the other re-attaches over the socket
    wait_for(lambda: len((b.status())["runs"]) == 2, 5, "both re-attached")
    clients = sorted(f"{link.run}|{client}" for link in (b, c) for client in ("c0", "c1~exiting"))
    assert b.status()["gpus"][0]["clients"] == clients
    b.exited("c1")
    c.exited("c1")
    assert b.status()["gpus"][0]["clients"] == sorted([f"{b.run}|c0", f"{c.run}|c0"])


LEADER = """
import os, sys, time
sys.path[:0] = {paths!r}
os.environ[{env!r}] = {root!r}
from pytest_gpu.machine.domain import Domain
from pytest_gpu.machine.link import MachineLink
from pytest_gpu.machine.placement import Policy
from pytest_gpu.base.requests import GpuRequest
{become}
link = MachineLink(Domain.{kind}({name!r}), Policy(overhead=0))
link.attach({{"U": 16 * 2**30}}, lambda events: None)
print(link.is_arbiter, link.submit("c0/k0", "c0", "gw0", "t::killed", GpuRequest(1, None, True), ["U"])[0], flush=True)
time.sleep(60)
"""


# Another user, from here on: imports are done first (this interpreter may live where only
# root can read, e.g. /root/.pyenv), then the process gives up root for good.
BECOME = """
import pwd, pytest_gpu.machine.placement, pytest_gpu.machine.server
entry = pwd.getpwnam({user!r})
os.setgroups([]); os.setgid(entry.pw_gid); os.setuid(entry.pw_uid)
assert os.getuid() == entry.pw_uid
"""


def _connect(sock: socket.socket, address: str) -> None:
    with reachable(address) as where:  # a socket file's path may be longer than sun_path allows
        sock.connect(where)


def _root() -> str:
    return os.environ[ROOT_ENV]


def _kind(domain: Domain) -> str:
    return "machine_wide" if domain.wide else "private"


def start_leader(domain: Domain, user: str | None = None) -> subprocess.Popen[str]:
    become = BECOME.format(user=user) if user else ""
    code = LEADER.format(
        paths=sys.path, env=ROOT_ENV, root=_root(), name=domain.name, kind=_kind(domain), become=become
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().split() == ["True", "granted"]
    return proc


def test_sigkill_of_the_arbiter_run_frees_its_leases_within_a_second(domain, links):
    leader = start_leader(domain)
    try:
        b, b_events = new_link(links, domain, {"U": 16 * GiB})
        assert not b.is_arbiter
        assert b.submit("c0/k0", "c0", "gw0", "t::b", whole(), ["U"]) == ("queued", None)
        killed = time.monotonic()
        leader.send_signal(signal.SIGKILL)
        assert b_events.wait("c0/k0", timeout=1.0)[0] == "granted"
        assert time.monotonic() - killed < 1.0
        assert b.is_arbiter
    finally:
        leader.kill()
        leader.wait()


def test_sigkill_of_a_follower_run_frees_its_leases_within_a_second(domain, links):
    a, a_events = new_link(links, domain, {"U": 16 * GiB})
    code = LEADER.format(paths=sys.path, env=ROOT_ENV, root=_root(), name=domain.name, kind=_kind(domain), become="")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().split() == ["False", "granted"]
        assert a.submit("c0/k0", "c0", "gw0", "t::a", whole(), ["U"]) == ("queued", None)
        killed = time.monotonic()
        proc.send_signal(signal.SIGKILL)
        assert a_events.wait("c0/k0", timeout=1.0)[0] == "granted"
        assert time.monotonic() - killed < 1.0
    finally:
        proc.kill()
        proc.wait()


def test_a_silent_or_half_frame_peer_does_not_hold_up_the_arbiter(domain, links):
    new_link(links, domain, {"U": 16 * GiB})
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    half = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    _connect(silent, domain.address())
    _connect(half, domain.address())
    half.sendall(b"\x00\x00\x01")  # a third of a length prefix, then nothing
    try:
        b, _ = new_link(links, domain, {"U": 16 * GiB})
        started = time.monotonic()
        for i in range(20):
            assert b.submit(f"c0/k{i}", "c0", "gw0", "t", shared(GiB // 2), ["U"])[0] == "granted"
            b.release(f"c0/k{i}")
        assert time.monotonic() - started < 2.0
    finally:
        silent.close()
        half.close()


def test_a_peer_sending_garbage_is_dropped_and_others_go_on(domain, links):
    new_link(links, domain, {"U": 16 * GiB})
    bad = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    _connect(bad, domain.address())
    bad.sendall(b"\xff\xff\xff\xff")  # a 4 GiB frame: over the limit
    assert bad.recv(10) == b""  # dropped
    bad.close()
    b, _ = new_link(links, domain, {"U": 16 * GiB})
    assert b.submit("c0/k0", "c0", "gw0", "t", shared(GiB), ["U"])[0] == "granted"


# -- pytest-gpu status ---------------------------------------------------------------------


def test_status_says_who_holds_what_and_who_waits(domain, links, capsys):
    a, _ = new_link(links, domain, {"GPU-A": 16 * GiB}, Policy(overhead=GiB // 2))
    b, _ = new_link(links, domain, {"GPU-A": 16 * GiB}, Policy(overhead=GiB // 2))
    a.submit("c0/k0", "c0", "gw0", "tests/t.py::test_holds", shared(10 * GiB), ["GPU-A"])
    b.submit("c3/k0", "c3", "gw3", "tests/t.py::test_waits", whole(), ["GPU-A"])
    # this user's own domains are listed by their directories; a machine-wide one (but the real GPUs') by name
    asked = ["status", "--machine", domain.name] if domain.wide else ["status"]
    assert cli_main(asked) == 0
    out = capsys.readouterr().out
    assert f"{domain.name}: 2 runs attached" in out
    assert f"run {a.run} gw0  tests/t.py::test_holds  GPU-A  10GiB  for " in out
    assert f"run {b.run} gw3  tests/t.py::test_waits  1 GPU (whole GPU)  for " in out
    assert "GPU-A: 16GiB, 10.5GiB promised (1 CUDA context)" in out
    assert cli_main([*asked, "--json"]) == 0
    state = json.loads(capsys.readouterr().out)
    assert [r["test"] for r in state[domain.name]["leases"]] == ["tests/t.py::test_holds"]


def test_status_names_each_gpu_by_its_index_beside_its_uuid(domain, links, capsys):
    gpu1, mig = sim_uuid(1), mig_uuid(0, 2)
    a, _ = new_link(links, domain, {gpu1: 16 * GiB, mig: 4 * GiB, f"{gpu1}{PART}1": 8 * GiB})
    a.submit("c0/k0", "c0", "gw0", "tests/t.py::test_holds", shared(2 * GiB), [gpu1])
    asked = ["status", "--machine", domain.name] if domain.wide else ["status"]
    assert cli_main(asked) == 0
    out = capsys.readouterr().out
    assert f"  GPU 1 ({gpu1}): 16GiB, 2GiB promised" in out
    assert f"  GPU 0 MIG 2 ({mig}): 4GiB" in out
    assert f"  GPU 1 ({gpu1}{PART}1): 8GiB" in out  # a launched rank's part of GPU 1
    assert f"tests/t.py::test_holds  GPU 1 ({gpu1})  2GiB  for " in out
    assert cli_main([*asked, "--json"]) == 0
    state = json.loads(capsys.readouterr().out)
    assert {g["uuid"]: g["name"] for g in state[domain.name]["gpus"]}[gpu1] == "GPU 1"


@pytest.mark.parametrize(
    ("vendor", "found", "labels"),
    [
        (
            "nvidia",
            (Device(3, "GPU-real-3", 80 * GiB, "H100"), Device(9, "MIG-real", 10 * GiB, "H100 MIG", parent=3)),
            {"GPU-real-3": "GPU 3", "MIG-real": "GPU 3 MIG unit 9"},
        ),
        ("amd", (Device(3, "GPU-real-3", 192 * GiB, "MI300X"),), {"GPU-real-3": "AMD GPU 3"}),
        ("xpu", (Device(3, "GPU-real-3", 64 * GiB, "Max 1550"),), {"GPU-real-3": "Intel GPU 3"}),
    ],
)
def test_gpu_labels_ask_the_drivers_for_real_gpus_only_where_told(monkeypatch, vendor, found, labels):
    """Real GPUs are named by whichever vendor's driver reports them (the others have none here)."""
    from pytest_gpu.vendors import amd, intel, nvidia
    from pytest_gpu.vendors.sampling import Unavailable

    def none(*args: object) -> None:
        raise Unavailable("no driver")

    patched = {"nvidia": (nvidia, "nvml_devices"), "amd": (amd, "amdsmi_devices"), "xpu": (intel, "sysman_devices")}
    for name, (module, function) in patched.items():
        answer = (lambda *args: (found, "")) if name == vendor else none
        monkeypatch.setattr(module, function, answer)
    assert gpu_labels([*labels, "GPU-gone"], ask_nvml=True) == labels
    assert gpu_labels(["GPU-real-3"], ask_nvml=False) == {}


@pytest.mark.parametrize(
    ("uuid", "label", "runtime"),
    [
        (sim_uuid(1), "GPU 1", "CUDA"),
        (amd_uuid(1), "AMD GPU 1", "HIP"),
        (xpu_uuid(1), "Intel GPU 1", "Level Zero"),
    ],
    ids=["nvidia", "amd", "xpu"],
)
def test_status_names_a_simulated_gpu_of_every_vendor(uuid, label, runtime):
    """A simulated machine's GPUs are named as their vendor's (issue 29: ``AMD GPU 1``, not a bare
    UUID), without asking any driver, and so are the contexts on them."""
    assert gpu_labels([uuid, f"{uuid}{PART}2"], ask_nvml=False) == {uuid: label, f"{uuid}{PART}2": label}
    state = {
        "runs": [],
        "grants": 0,
        "gpus": [{"uuid": uuid, "capacity": 16 * GiB, "leased": 0, "foreign": 0, "contexts": 2, "exclusive": False}],
        "leases": [],
        "waiting": [],
    }
    known = identify([uuid], ask_drivers=False)
    labels, runtimes = {u: n for u, (n, _) in known.items()}, {u: k.runtime for u, (_, k) in known.items()}
    assert f"  {label} ({uuid}): 16GiB, 0B promised (2 {runtime} contexts)" in format_status(
        "sim-x", state, 1.0, labels, runtimes
    )


def test_status_without_any_run(domain, capsys):
    assert cli_main(["status"]) == 0
    assert "no pytest-gpu run holds or waits for GPUs on this machine" in capsys.readouterr().out


def test_format_status_names_foreign_usage_and_overtaking():
    state = {
        "runs": [{"run": "1-a", "user": "bob", "pid": 1, "label": "pytest -n 4"}],
        "pending": [],
        "grants": 3,
        "gpus": [
            {"uuid": "GPU-1", "capacity": 16 * GiB, "leased": 0, "foreign": 6 * GiB, "contexts": 1, "exclusive": False}
        ],
        "leases": [],
        "waiting": [
            {
                "run": "1-a",
                "worker": "gw0",
                "test": "t::x",
                "request": "1 GPU x 12GiB",
                "since": 10.0,
                "bypassed": 2,
                "foreign": True,
            }
        ],
    }
    lines = format_status("gpus", state, now=12.5)
    assert lines[0] == "gpus: 1 run attached, 3 grants so far"
    assert "6GiB used outside pytest-gpu" in lines[2]
    assert lines[-1].endswith("for 2.5s, overtaken 2x  (held back by usage outside pytest-gpu)")


# -- two Unix users ----------------------------------------------------------------------------


@pytest.fixture
def other_user() -> Iterator[str]:
    if os.geteuid() != 0:
        pytest.skip(f"{MISSING}: root (the two-user tests make a throwaway user; CI runs as root)")
    if shutil.which("useradd") is None:
        pytest.skip(f"{MISSING}: useradd (two-user tests; apt-get install passwd)")
    with throwaway_user("pgtm") as entry:
        yield entry.pw_name


def test_two_users_runs_share_the_machine(other_user, monkeypatch):
    # a machine directory both users reach (pytest's tmp_path is private to root)
    base = Path(tempfile.mkdtemp(prefix="pytest-gpu-2users-"))
    os.chmod(base, 0o755)
    root = base / "machines"
    monkeypatch.setenv(ROOT_ENV, str(root))
    domain = Domain.real()
    leader = start_leader(domain, user=other_user)  # the other user's run is the arbiter
    made: list[MachineLink] = []
    try:
        mine, events = new_link(made, domain, {"U": 16 * GiB})
        assert not mine.is_arbiter
        state = mine.status()
        assert {r["user"] for r in state["runs"]} == {other_user, "root"}
        assert mine.submit("c0/k0", "c0", "gw0", "t::mine", whole(), ["U"]) == ("queued", None)
        leader.send_signal(signal.SIGKILL)
        assert events.wait("c0/k0", timeout=1.0)[0] == "granted"
        assert mine.is_arbiter  # the other user's arbiter's address was free again
    finally:
        leader.kill()
        leader.wait()
        for link in made:
            link.close()
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.slow
def test_machine_dir_of_another_user_that_is_not_shared_falls_back(other_user, tmp_path, monkeypatch, capsys):
    root = tmp_path / "theirs"
    root.mkdir(mode=0o755)
    os.chown(root, int(subprocess.run(["id", "-u", other_user], capture_output=True, text=True).stdout), -1)
    monkeypatch.setenv(ROOT_ENV, str(root))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # where the fallback goes: not the real home
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    from pytest_gpu.machine import domain as domains

    domains._warned.clear()
    found = domains.private_root()
    assert found == tmp_path / "home" / ".cache" / "pytest-gpu" / f"machines-{socket.gethostname()}"
    assert root not in found.parents
    err = capsys.readouterr().err
    assert f"{root} belongs to {other_user}" in err and "is not sticky and world-writable" in err
    assert f"this user's runs meet in {found} instead" in err


def test_summary_lines_for_foreign_usage():
    from pytest_gpu.report.summary import foreign_lines

    entries = [
        {"test": "t::a", "seconds": 0.0, "waited": False, "avoided": [0], "bytes": {0: 12 * GiB}},
        {"test": "t::b", "seconds": 1.5, "waited": True, "avoided": [], "bytes": {1: 6 * GiB}},
        {"test": "t::c", "seconds": 0.5, "waited": True, "avoided": [0], "bytes": {0: 10 * GiB, 1: 4 * GiB}},
    ]
    assert foreign_lines(entries) == [
        "pytest-gpu: GPU 0 was avoided by 2 tests: processes outside pytest-gpu used 12GiB there",
        "pytest-gpu: 2 tests were held back 2.0s in total by processes outside pytest-gpu "
        "(10GiB on GPU 0, 6GiB on GPU 1)",
    ]
    assert foreign_lines(entries[1:2]) == [
        "pytest-gpu: 1 test was held back 1.5s in total by processes outside pytest-gpu (6GiB on GPU 1)"
    ]
    assert foreign_lines([]) == []


@pytest.mark.slow
def test_an_arbiter_that_stops_answering_fails_the_call_with_a_clear_error(domain, links, monkeypatch):
    from pytest_gpu.machine import remote as links_module
    from pytest_gpu.machine.remote import MachineError

    leader = start_leader(domain)
    try:
        b, _ = new_link(links, domain, {"U": 16 * GiB})
        monkeypatch.setattr(links_module, "CALL_TIMEOUT_S", 0.5)
        leader.send_signal(signal.SIGSTOP)
        import psutil

        deadline = time.monotonic() + patience(10)
        while psutil.Process(leader.pid).status() != psutil.STATUS_STOPPED:  # the stop lands asynchronously
            assert time.monotonic() < deadline, "the arbiter's process did not stop"
            time.sleep(0.01)
        with pytest.raises(MachineError, match=r"did not answer 'submit' within 0.5s"):
            b.submit("c0/k0", "c0", "gw0", "t::b", shared(GiB), ["U"])
    finally:
        leader.send_signal(signal.SIGCONT)
        leader.kill()
        leader.wait()


def test_a_run_without_gpus_never_joins_the_machine(tmp_path, monkeypatch):
    from pytest_gpu.leasing.broker import Broker

    monkeypatch.setenv(ROOT_ENV, str(tmp_path / "machines"))
    joined = []
    link = MachineLink(lambda: joined.append(1) or Domain.real(), Policy())
    broker = Broker({}, str(tmp_path / "b.sock"), b"k" * 32, Policy(), link=link).start()
    try:
        assert broker.room() == []
    finally:
        broker.close()
    assert joined == [] and not (tmp_path / "machines").exists()


def test_a_forked_child_keeps_neither_the_arbiters_lock_nor_its_address(domain, links):
    """A test's forked child that outlives its run must not keep the machine's lock or socket."""
    code = LEADER.format(paths=sys.path, env=ROOT_ENV, root=_root(), name=domain.name, kind=_kind(domain), become="")
    fork = (
        "child = os.fork()\nif child == 0:\n    time.sleep(30)\n    os._exit(0)\nprint(child, flush=True)\nos._exit(0)"
    )
    code = code.replace("time.sleep(60)", "import os\n" + fork)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().split() == ["True", "granted"]
    child = int(proc.stdout.readline())
    proc.wait(timeout=patience(30))  # the run is gone; its forked child sleeps on
    try:
        b, _ = new_link(links, domain, {"U": 16 * GiB})
        assert b.is_arbiter  # it could take the lock and bind the address
        assert b.submit("c0/k0", "c0", "gw0", "t", whole(), ["U"])[0] == "granted"
    finally:
        os.kill(child, signal.SIGKILL)


@pytest.mark.slow
def test_an_arbiter_that_stops_fails_the_waiting_request_never_the_run(gpu_pytester, monkeypatch):
    """Another run is the arbiter and is stopped (SIGSTOP) while this run goes on: the test
    that asks for a GPU then fails with a clear error after PYTEST_GPU_ARBITER_TIMEOUT; the
    run's other tests pass and the run ends normally."""
    monkeypatch.setenv("PYTEST_GPU_SIM_MACHINE", "stall")  # shared with the leader: named
    leader = start_leader(Domain.private("sim-stall"))
    gpu_pytester.makepyfile(
        test_stall="""
        import pathlib, time, pytest

        HERE = pathlib.Path(__file__).parent

        @pytest.mark.gpu(memory="1GiB")
        def test_a_attached():
            (HERE / "attached").write_text("")
            while not (HERE / "stopped").exists():
                time.sleep(0.02)

        @pytest.mark.gpu(memory="1GiB")
        def test_b_asks_a_stopped_arbiter():
            pass

        def test_c_needs_no_gpu():
            pass
        """
    )
    monkeypatch.setenv("PYTEST_GPU_ARBITER_TIMEOUT", "2")
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--gpus",
        "sim:2x16GiB",
        "-p",
        "no:randomly",
    ]
    proc = subprocess.Popen(command, cwd=gpu_pytester.path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + patience(60)
        while not (gpu_pytester.path / "attached").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.02)
        leader.send_signal(signal.SIGSTOP)
        (gpu_pytester.path / "stopped").write_text("")
        out, _ = proc.communicate(timeout=patience(120))
    finally:
        leader.send_signal(signal.SIGCONT)
        leader.kill()
        leader.wait()
        proc.kill()
    assert "INTERNALERROR" not in out, out
    assert "1 failed, 2 passed" in out or "2 passed, 1 error" in out, out
    assert "did not answer 'submit' within 2s" in out, out
