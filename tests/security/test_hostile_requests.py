"""What another run reports, or brings, cannot take the machine from the others (issue 30).

The machine's arbiter hears from every run of the machine, any user's: a context size it
measured, the parts of GPUs it brought, leases it held under an earlier arbiter, contexts its
processes have. Each is taken only where the arbiter can vouch for it, and bounded
(pytest_gpu.machine.arbiter, .placement, .server; pytest_gpu.gpu.foreign):

- a context size one run measured counts for that run's contexts only (the arbiter's own
  run's, for every run's), and no larger than the GPU's context budget;
- a launched rank's part of a GPU (``<uuid>#part-of-rank-N``) is carved out of that GPU, one
  per GPU and run, and leaves the table with its run;
- leases held under an earlier arbiter are taken over only while runs re-attach after a
  failover, and overtake waiting requests within their bound;
- a user outside the group a simulated machine is shared with is refused; contexts count
  only where their process was granted a lease;
- another user's processes use GPU memory beyond what its leases account for as usage
  outside pytest-gpu.

The fast tests drive the arbiter in this process (and over its socket as another uid); the
two-user tests at the end run real sessions as a throwaway user A and attacks as B
(tests/neighbour.py), as tests/security/test_hostile_neighbours.py does.
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from conftest import MISSING
from helpers import TESTS, as_other_user, patience, shared, throwaway_user, wait_for, whole
from pytest_gpu.gpu.foreign import ForeignSampler
from pytest_gpu.machine import arbiter as arbiter_module
from pytest_gpu.machine.arbiter import Arbiter, Roots
from pytest_gpu.machine.domain import ROOT_ENV, SIM_GROUP_ENV, USER_MEMORY_ENV, Domain
from pytest_gpu.machine.messages import PART, Held
from pytest_gpu.machine.placement import Policy
from pytest_gpu.machine.server import ArbiterServer, group_members, is_member
from pytest_gpu.wire.frames import MAX_REPLY, FrameReader, encode
from pytest_gpu.wire.sockets import reachable

GiB = 2**30
MiB = 2**20
U = "GPU-u"
OTHER = 40003  # a uid no one uses: "another user"


def _sink(events: list[Any]) -> None:
    pass


def _arbiter(policy: Policy | None = None, gpus: dict[str, int] | None = None) -> Arbiter:
    machine = gpus or {U: 16 * GiB}
    return Arbiter(policy or Policy(), truth=lambda uuids: {u: machine[u] for u in uuids if u in machine})


def _attach(arbiter: Arbiter, run: str, gpus: dict[str, int] | None = None, **fields: Any) -> None:
    pid = int(run.rpartition(".")[2]) if run.rpartition(".")[2].isdigit() else 99
    arbiter.attach(run, pid=pid, user=run, label=run, gpus=gpus or {U: 16 * GiB}, sink=_sink, **fields)


# -- item 1: a context size measured by one run ---------------------------------------------------


def test_a_context_size_another_run_reports_makes_no_gpu_unusable() -> None:
    arbiter = _arbiter()
    _attach(arbiter, "1000.a")
    _attach(arbiter, "2000.b")
    arbiter.measure_context("2000.b", U, 16 * GiB - 1)  # B "measured" a context as large as the GPU
    assert arbiter.submit("1000.a", "c0/k0", "c0", "gw0", "t::a", shared(11 * GiB), [U])[0] == "granted"
    assert arbiter.submit("1000.a", "c1/k0", "c1", "gw1", "t::a2", shared(3 * GiB), [U])[0] == "granted"
    policy = arbiter.allocator.policy
    assert policy.context(0, "1000.a|c0") == 500 * MiB  # A's contexts: as assumed
    assert policy.context(0, "2000.b|c0") == 4 * GiB  # B's own: no larger than the GPU's context budget
    arbiter.detach("2000.b")
    _attach(arbiter, "2000.b2")  # a later attach sweeps what a run that left measured
    assert "2000.b" not in policy.measured_by
    # what a run measures of its own contexts still protects it: A's two count 2GiB each now
    assert arbiter.measure_context("1000.a", U, 2 * GiB)
    assert arbiter.status()["gpus"][0]["leased"] == 14 * GiB + 2 * 2 * GiB  # over 16GiB: they are open
    arbiter.release("1000.a", "c1/k0")
    arbiter.release("1000.a", "c0/k0")
    kind, why = arbiter.submit("1000.a", "c0/k1", "c0", "gw0", "t::a", shared(12 * GiB + MiB), [U])
    assert kind == "rejected" and "cannot fit beside the CUDA contexts" in why  # 16 - 2*2 < 12GiB + 1MiB
    assert arbiter.submit("2000.b2", "c0/k0", "c0", "gw0", "t::b", shared(11 * GiB), [U])[0] == "granted"


def test_the_arbiters_own_runs_measurement_counts_for_every_run() -> None:
    arbiter = _arbiter()
    arbiter.attach("0.own", pid=os.getpid(), user="root", label="own", gpus={U: 16 * GiB}, sink=_sink)
    _attach(arbiter, "1000.a")
    assert arbiter.measure_context("0.own", U, 700 * MiB)
    assert arbiter.allocator.policy.context(0, "1000.a|c0") == 700 * MiB


# -- item 4: parts of GPUs -------------------------------------------------------------------------


def test_a_part_of_a_gpu_is_carved_out_of_it_never_promised_twice() -> None:
    arbiter = _arbiter(Policy(overhead=0))
    _attach(arbiter, "1000.a")
    assert arbiter.submit("1000.a", "c0/k0", "c0", "gw0", "t::a", shared(11 * GiB), [U])[0] == "granted"
    part = f"{U}{PART}0"
    _attach(arbiter, "2000.b", {part: 15 * GiB})
    # the part would take 15GiB of the GPU A holds 11GiB of: it waits until the GPU has that much
    assert arbiter.submit("2000.b", "c0/k0", "c0", "gw0", "t::b", shared(3 * GiB), [part])[0] == "queued"
    assert arbiter.room([part], "2000.b") == [15 * GiB]
    assert arbiter.room([U], "1000.a") == [16 * GiB]
    arbiter.release("1000.a", "c0/k0")
    assert arbiter.status()["grants"] == 2  # B's, once the GPU could give its part
    assert arbiter.submit("1000.a", "c0/k1", "c0", "gw0", "t::a", shared(GiB), [U])[0] == "granted"
    assert arbiter.submit("1000.a", "c0/k2", "c0", "gw0", "t::a", shared(GiB), [U])[0] == "queued"  # 15 + 1 = 16
    assert arbiter.submit("1000.a", "c1/k0", "c1", "gw1", "t::a", whole(), [U])[0] == "queued"


def test_launched_ranks_parts_share_their_gpu_and_each_run_brings_one_part_of_a_gpu() -> None:
    arbiter = _arbiter(Policy(overhead=0))
    parts = [f"{U}{PART}{rank}" for rank in range(2)]
    for rank, part in enumerate(parts):  # two ranks of a launch: half the GPU each
        _attach(arbiter, f"1000.rank{rank}", {part: 8 * GiB})
        granted = arbiter.submit(f"1000.rank{rank}", "c0/k0", "c0", "gw0", "t", whole(), [part])
        assert granted[0] == "granted" and granted[1]["memory"] == 8 * GiB
    _attach(arbiter, "1000.other")
    assert arbiter.submit("1000.other", "c0/k0", "c0", "gw0", "t", shared(GiB), [U])[0] == "queued"
    for many in ({f"{U}{PART}5": GiB, f"{U}{PART}6": GiB}, {f"{U}{PART}{1 << 40}": GiB}, {f"{U}{PART}x": GiB}):
        with pytest.raises(ValueError, match=r"one part of GPU|not a rank's part"):
            _attach(arbiter, "2000.b", many)
    assert "2000.b" not in arbiter.runs


def test_parts_leave_with_their_runs_and_grants_stay_as_fast() -> None:
    arbiter = _arbiter(Policy(overhead=0))
    _attach(arbiter, "1000.a")

    def grant_time() -> float:
        started = time.perf_counter()
        for n in range(50):
            assert arbiter.submit("1000.a", f"c0/t{n}", "c0", "gw0", "t", shared(MiB), [U])[0] == "granted"
            arbiter.release("1000.a", f"c0/t{n}")
        return (time.perf_counter() - started) / 50

    before = grant_time()
    for n in range(300):  # attach, bring a part, lease on it, leave: again and again
        run = f"2000.b{n}"
        _attach(arbiter, run, {f"{U}{PART}{n}": GiB})
        arbiter.submit(run, "c0/k0", "c0", "gw0", "t", shared(MiB), [f"{U}{PART}{n}"])
        arbiter.detach(run)
    _attach(arbiter, "2000.last")
    assert len(arbiter.allocator.gpus) <= 3 and len(arbiter._mids) <= 3
    assert grant_time() < 5 * before + 0.002


# -- item 5: leases held under an earlier arbiter ----------------------------------------------------


def _held(n: int, memory: int = 100 * MiB) -> Held:
    return Held(f"c0/h{n}", "c0", "gw0", f"t::held{n}", shared(memory), (U,), memory, False)


def test_leases_held_before_are_taken_over_only_after_a_failover() -> None:
    arbiter = _arbiter(Policy(overhead=0))
    _attach(arbiter, "1000.a")
    assert arbiter.submit("1000.a", "c0/k0", "c0", "gw0", "t", shared(GiB), [U])[0] == "granted"
    assert arbiter.submit("1000.a", "c1/k0", "c1", "gw1", "t::whole", whole(), [U])[0] == "queued"
    arbiter.took_over -= arbiter_module.ADOPT_WINDOW_S + 1  # long after this arbiter took over
    with pytest.raises(ValueError, match="taken over only within"):
        _attach(arbiter, "2000.b", held=[_held(0)])
    with pytest.raises(ValueError, match="taken over only within"):
        _attach(arbiter, "2000.b", contexts={"c0": [U]})
    assert arbiter.allocator.gpus[0].leased == GiB and "2000.b" not in arbiter.runs


def test_leases_taken_over_overtake_a_waiting_request_within_its_bound() -> None:
    arbiter = _arbiter(Policy(overhead=0))
    _attach(arbiter, "1000.a")
    assert arbiter.submit("1000.a", "c0/k0", "c0", "gw0", "t", shared(GiB), [U])[0] == "granted"
    assert arbiter.submit("1000.a", "c1/k0", "c1", "gw1", "t::whole", whole(), [U])[0] == "queued"
    taken, refused = 0, 0
    for n in range(40):
        try:
            _attach(arbiter, f"2000.b{n}", held=[_held(n)])
            taken += 1
        except ValueError as exc:
            assert "more than 16 times" in str(exc)
            refused += 1
    (waiting,) = arbiter.status()["waiting"]
    assert (taken, refused, waiting["bypassed"]) == (16, 24, 16)


# -- item 6: who may attach, and contexts without leases ---------------------------------------------


def test_a_user_outside_the_group_gets_a_clear_error_not_leases() -> None:
    arbiter = _arbiter()
    arbiter.members = ("team", lambda uid, pid: uid == 1000)
    _attach(arbiter, "1000.a")
    with pytest.raises(ValueError, match=r"user 2000.b \(uid 2000\) is not a member of group team"):
        _attach(arbiter, "2000.b")
    assert "2000.b" not in arbiter.runs
    _attach(arbiter, "0.root")  # an administrator is let in


def test_a_groups_members_are_told_by_the_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gid = os.getegid()
    assert is_member(gid, os.getuid(), os.getpid())
    assert not is_member(gid, os.getuid() + 1, os.getpid())  # not that user's process
    outside = next(g.gr_gid for g in grp.getgrall() if g.gr_gid not in os.getgroups() and g.gr_gid != gid)
    assert not is_member(outside, os.getuid(), os.getpid())
    monkeypatch.setenv(ROOT_ENV, str(tmp_path))
    monkeypatch.setenv(SIM_GROUP_ENV, str(gid))
    assert group_members(Domain.real().address()) is None  # the real GPUs: every user's
    assert group_members(str(tmp_path / "arbiter.sock")) is None  # a private domain
    found = group_members(Domain.machine_wide("sim-shared").address())
    assert found is not None and found[0] == grp.getgrgid(gid).gr_name


def test_contexts_count_only_of_processes_that_were_granted_a_lease() -> None:
    arbiter = _arbiter()
    _attach(arbiter, "1000.a")
    _attach(arbiter, "2000.b")
    for n in range(40):  # forty "processes" of B with contexts on the GPU, no lease among them
        arbiter.set_contexts("2000.b", f"c{n}", [U])
        arbiter.exiting("2000.b", f"d{n}", [U])
    assert arbiter.room([U], "1000.a") == [16 * GiB]
    assert arbiter.submit("1000.a", "c0/k0", "c0", "gw0", "t", shared(11 * GiB), [U])[0] == "granted"
    # a context of a process that was granted a lease counts, after the lease as before
    assert arbiter.submit("2000.b", "c0/k0", "c0", "gw0", "t", shared(GiB), [U])[0] == "granted"
    arbiter.release("2000.b", "c0/k0", contexts=[U])
    assert arbiter.status()["gpus"][0]["contexts"] == 2
    arbiter.forget_client("2000.b", "c0")
    arbiter.exiting("2000.b", "c0", [U])  # its process is exiting: counted until it has
    assert arbiter.status()["gpus"][0]["contexts"] == 2


# -- over the socket, as another uid ---------------------------------------------------------------


class _Peer:
    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5)
        with reachable(address) as where:
            self.sock.connect(where)
        self.reader = FrameReader(MAX_REPLY)
        self.heard: list[dict[str, Any]] = []
        self.rid = 0

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        self.rid += 1
        self.sock.sendall(encode({"op": op, "id": self.rid, **fields}, MAX_REPLY))
        while True:
            for message in self.heard:
                if message.get("re") == self.rid:
                    return message
            data = self.sock.recv(65536)
            assert data, f"closed instead of answering {op!r}"
            self.heard += self.reader.feed(data)


def test_a_group_machines_arbiter_refuses_a_user_outside_the_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ROOT_ENV, str(tmp_path / "machines"))
    monkeypatch.setenv(SIM_GROUP_ENV, str(os.getegid()))
    domain = Domain.machine_wide(f"sim-{tmp_path.name}")
    arbiter = _arbiter()
    server = ArbiterServer(arbiter, domain.address(), "").start()
    try:

        def attack() -> Any:
            peer = _Peer(domain.address())
            gpus = {U: 16 * GiB}
            return [
                peer.call("attach", run=f"{OTHER}.b", label="b", gpus=gpus),
                peer.call("submit", key="c0/k0", client="c0", request=[1, None, True, None], gpus=[U]),
                peer.call("status"),
            ]

        attached, submitted, status = as_other_user(OTHER, attack)
        assert f"(uid {OTHER}) is not a member of group" in attached["error"], attached
        assert "before 'attach'" in submitted["error"]
        assert status["ok"]["runs"] == []
        assert not arbiter.runs
    finally:
        server.close()


# -- item 11: another user's processes and their GPU memory ---------------------------------------------


class _Driver:
    """A driver that lists what it is told (the sampler's seam to NVML)."""

    name = "NVML"

    def __init__(self, used: int, processes: dict[int, int | None]) -> None:
        self.used, self.listed = used, processes

    def memory(self, uuid: str) -> tuple[int, int | None]:
        return self.used, 0

    def processes(self, uuid: str) -> dict[int, int | None]:
        return dict(self.listed)

    def compute(self, uuid: str) -> list[tuple[int, int | None]]:
        return list(self.listed.items())

    def problem(self) -> str:
        return ""

    def forget(self, uuid: str) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.fixture
def stranger() -> Iterator[subprocess.Popen[bytes]]:
    """A process with a child: another run's tree."""
    proc = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.run(['sleep', '60'])"])
    yield proc
    proc.kill()
    proc.wait()


def test_another_users_gpu_memory_beyond_its_leases_is_usage_outside_pytest_gpu(
    stranger: subprocess.Popen[bytes],
) -> None:
    import psutil

    child = wait_for(lambda: psutil.Process(stranger.pid).children(), what="the stranger's child")[0].pid
    me = os.getuid()
    sampler = ForeignSampler()
    sampler._driver = _Driver(10 * GiB, {stranger.pid: GiB, child: 5 * GiB})
    # the stranger's run accounts for 2GiB on U: its processes' 6GiB are 4GiB beyond that
    limits = Roots(set(), {stranger.pid: (me, {U: 2 * GiB})})
    assert sampler.sample(limits, uuids=[U])[U].bytes == 4 * GiB
    assert sampler.sample(Roots({stranger.pid}), uuids=[U])[U].bytes == 0  # a run it answers for
    assert sampler.sample(Roots(set(), {stranger.pid: (me + 1, {U: 8 * GiB})}), uuids=[U])[U].bytes == 6 * GiB


def test_the_arbiter_answers_for_its_own_users_runs_only() -> None:
    seen: list[set[int]] = []

    def foreign(uuids: list[str], roots: set[int], accounted: dict[str, int]) -> dict[str, int]:
        seen.append(roots)
        return {}

    arbiter = Arbiter(Policy(overhead=0), foreign, foreign_ttl=0)
    me = os.getuid()
    arbiter.attach(f"{me}.a", pid=11, uid=me, user="a", label="a", gpus={U: 16 * GiB}, sink=_sink)
    arbiter.attach(f"{me + 7}.b", pid=22, uid=me + 7, user="b", label="b", gpus={U: 16 * GiB}, sink=_sink)
    assert arbiter.submit(f"{me + 7}.b", "c0/k0", "c0", "gw0", "t", shared(3 * GiB), [U])[0] == "granted"
    assert arbiter.submit(f"{me}.a", "c0/k0", "c0", "gw0", "t", shared(GiB), [U])[0] == "granted"
    roots = seen[-1]
    assert isinstance(roots, Roots) and roots == {11, 22}
    assert roots.limits == {22: (me + 7, {U: 3 * GiB})}


# -- two users: B attacks A's group machine (end to end) ------------------------------------------------

SPEC = "sim:2x16GiB"
MACHINE = "shared"

VICTIM_SUITE = """
import pytest
from pytest_gpu import sim

@pytest.mark.gpu(memory="11GiB")
def test_big_a():
    sim.hold("10GiB", 0.05)

@pytest.mark.gpu(memory="11GiB")
def test_big_b():
    sim.hold("10GiB", 0.05)
"""

WHOLE_SUITE = """
import pytest
from pytest_gpu import sim

@pytest.mark.gpu(exclusive=True)
def test_whole():
    sim.hold("1GiB", 0.05)
"""

HOLDER = """
import pathlib, time, pytest
HERE = pathlib.Path(__file__).parent

@pytest.mark.gpu(MARKER)
def test_hold():
    (HERE / "ready").write_text("1")
    deadline = time.monotonic() + 120
    while not (HERE / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
"""


class _Entry:
    """A throwaway user as these tests use it (its home is one made here)."""

    def __init__(self, name: str, uid: int, gid: int, home: Path) -> None:
        self.name, self.uid, self.gid, self.home = name, uid, gid, home


class _Users:
    """A (the victim, whose group the simulated machine is shared with) and B (the attacker)."""

    def __init__(self, a: _Entry, b: _Entry, base: Path) -> None:
        self.a, self.b = a, b
        self.machines = base / f"machines-{secrets.token_hex(3)}"
        self.machines.mkdir()
        self.machines.chmod(0o1777)  # as an administrator makes /tmp/pytest-gpu-machines
        self.write_a("test_victim_big.py", VICTIM_SUITE)
        self.write_a("whole/test_whole.py", WHOLE_SUITE)

    def write_a(self, name: str, text: str) -> Path:
        path = self.a.home / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        for made in (path.parent, path):
            os.chown(made, self.a.uid, self.a.gid)
        return path

    def env(self, user: _Entry, **extra: str) -> dict[str, str]:
        keep = {k: v for k, v in os.environ.items() if k in ("PATH", "PYTHONPATH", "LANG", "LC_ALL")}
        return {
            **keep,
            "HOME": str(user.home),
            "USER": user.name,
            "XDG_CACHE_HOME": str(user.home / ".cache"),
            "PYTEST_GPU_MACHINE_DIR": str(self.machines),
            "PYTHONDONTWRITEBYTECODE": "1",
            **extra,
        }

    def popen_a(self, *args: str) -> subprocess.Popen[str]:
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--gpus", SPEC, *args]
        env = self.env(self.a, PYTEST_GPU_SIM_MACHINE=MACHINE, PYTEST_GPU_SIM_GROUP=self.a.name)
        return subprocess.Popen(
            command,
            user=self.a.uid,
            group=self.a.gid,
            extra_groups=[],
            env=env,
            cwd=self.a.home,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )

    def run_a(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.finish(self.popen_a(*args))

    @staticmethod
    def finish(proc: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
        out, _ = proc.communicate(timeout=patience(120))
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")

    def start_holder(self, marker: str = "memory='1GiB'") -> subprocess.Popen[str]:
        """A run of A that stays attached (the group machine's arbiter) until :meth:`release`."""
        holder = self.write_a("hold/test_hold.py", HOLDER.replace("MARKER", marker))
        proc = self.popen_a(str(holder))

        def ready() -> bool:
            assert proc.poll() is None, proc.communicate()
            return (holder.parent / "ready").exists()

        wait_for(ready, timeout=patience(90), what="A's holding run")
        return proc

    def release(self, holder: subprocess.Popen[str]) -> None:
        self.write_a("hold/go", "go")
        _passed(self.finish(holder), 1)

    def _neighbour(self, attack: str, member: bool) -> list[str]:
        return [sys.executable, str(TESTS / "neighbour.py"), attack, f"sim-{MACHINE}"]

    def _b(self, attack: str, member: bool) -> dict[str, Any]:
        from pytest_gpu.sim.spec import gpu_uuid

        return {
            "user": self.b.uid,
            "group": self.b.gid,
            "extra_groups": [self.a.gid] if member else [],  # a hostile member of A's group, or not one
            "env": self.env(self.b, NEIGHBOUR_GPU=gpu_uuid(0), NEIGHBOUR_GPU2=gpu_uuid(1)),
            "cwd": self.b.home,
            "text": True,
        }

    def attack(self, attack: str, *, member: bool) -> Any:
        """B's attack on A's group machine, run to its end."""
        proc = subprocess.run(
            self._neighbour(attack, member), capture_output=True, timeout=patience(60), **self._b(attack, member)
        )
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    def hold(self, attack: str, *, member: bool) -> tuple[subprocess.Popen[str], Any]:
        """B's attack that stays attached: the process (to kill) and what it said."""
        proc = subprocess.Popen(
            self._neighbour(attack, member),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            **self._b(attack, member),
        )
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, proc.communicate()
        return proc, json.loads(line)

    def arbiter(self) -> dict[str, Any]:
        """The group machine's arbiter's state, as root (who sees everything) reads it."""
        from pytest_gpu.machine.link import status

        old = os.environ.get(ROOT_ENV)
        os.environ[ROOT_ENV] = str(self.machines)
        try:
            state = status(Domain.machine_wide(f"sim-{MACHINE}"))
        finally:
            if old is None:
                del os.environ[ROOT_ENV]
            else:
                os.environ[ROOT_ENV] = old
        assert state is not None, "no arbiter answers"
        return state


@pytest.fixture(scope="module")
def two_users() -> Iterator[tuple[_Entry, _Entry, Path]]:
    if os.geteuid() != 0:
        pytest.skip(f"{MISSING}: root (the two-user tests make throwaway users; CI runs as root)")
    for tool in ("useradd", "userdel", "setfacl"):
        if shutil.which(tool) is None:
            pytest.skip(f"{MISSING}: {tool} (two-user tests)")
    import pytest_gpu

    base = Path(f"/tmp/pytest-gpu-2r-{secrets.token_hex(3)}")
    base.mkdir(mode=0o755)
    closed: set[Path] = set()
    for start in (Path(sys.executable).resolve(), Path(pytest_gpu.__file__).resolve(), Path(pytest.__file__).resolve()):
        closed |= {parent for parent in start.parents if not parent.stat().st_mode & 0o001}
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, base, True)
        made = []
        for letter in "ab":
            entry = stack.enter_context(throwaway_user(f"pgr{letter}"))
            home = base / f"home-{letter}"
            home.mkdir(mode=0o700)
            os.chown(home, entry.pw_uid, entry.pw_gid)
            made.append(_Entry(entry.pw_name, entry.pw_uid, entry.pw_gid, home))
            for path in sorted(closed):  # traverse only: the interpreter and the package, nothing else
                subprocess.run(["setfacl", "-m", f"u:{entry.pw_name}:x", str(path)], check=True, capture_output=True)
                stack.callback(subprocess.run, ["setfacl", "-x", f"u:{entry.pw_name}", str(path)], capture_output=True)
        yield made[0], made[1], base


@pytest.fixture
def users(two_users: tuple[_Entry, _Entry, Path]) -> Iterator[_Users]:
    a, b, base = two_users
    for user in (a, b):
        for entry in user.home.iterdir():
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    yield _Users(a, b, base)
    for user in (a, b):
        subprocess.run(["pkill", "-KILL", "-u", user.name], capture_output=True)


def _passed(result: subprocess.CompletedProcess[str], count: int) -> None:
    text = result.stdout + result.stderr
    assert result.returncode == 0, text
    assert f"{count} passed" in result.stdout, text
    assert "INTERNALERROR" not in text, text


@pytest.mark.slow
def test_a_group_member_reporting_huge_contexts_fails_no_test_of_another(users: _Users) -> None:
    holder = users.start_holder()  # A's run: the group machine's arbiter
    attacker, said = users.hold("contexts", member=True)
    try:
        assert said["attach"].get("ok") is True, said
        assert all("error" not in answer for answer in said["measured"]), said
        _passed(users.run_a("-n", "2", "--timeout", "90", "test_victim_big.py"), 2)
    finally:
        attacker.kill()
        attacker.wait()
    users.release(holder)
    _passed(users.run_a("-n", "2", "--timeout", "90", "test_victim_big.py"), 2)  # and after B left


@pytest.mark.slow
def test_a_user_outside_the_group_gets_an_error_and_no_lease_shrinks_the_room(users: _Users) -> None:
    holder = users.start_holder()
    said = users.attack("outsider", member=False)
    assert "is not a member of group" in said["attach"]["error"], said
    assert all("before 'attach'" in answer["error"] for answer in said["submits"]), said
    attacker, said = users.hold("contexts-without-leases", member=True)
    try:
        assert said["attach"].get("ok") is True, said
        gpus = users.arbiter()["gpus"]
        assert all(g["contexts"] <= 1 for g in gpus), gpus  # the holder's own; none of B's forty
        _passed(users.run_a("-n", "2", "--timeout", "90", "test_victim_big.py"), 2)
    finally:
        attacker.kill()
        attacker.wait()
    users.release(holder)


@pytest.mark.slow
def test_parts_of_a_gpu_and_leases_held_before_promise_nothing_twice(users: _Users) -> None:
    holder = users.start_holder("2, memory='1GiB'")  # 1GiB on each GPU
    said = users.attack("parts", member=True)
    assert "one part of GPU" in said["three parts"]["error"], said
    # the part is carved out of GPU 0, which A's holder uses: it cannot be 15GiB of it now
    assert said["part lease"]["ok"] == ["queued", None], said
    whole = users.popen_a("-p", "no:randomly", "--timeout", "90", "whole/test_whole.py")
    wait_for(lambda: users.arbiter()["waiting"], timeout=patience(60), what="A's run waiting for a whole GPU")
    said = users.attack("held", member=True)
    refused = [answer["error"] for answer in said["held"] if "error" in answer]
    assert len(refused) >= 40 - 16 and all("more than 16 times" in why for why in refused), said
    assert all(w["bypassed"] <= 16 for w in users.arbiter()["waiting"])
    users.release(holder)
    _passed(users.finish(whole), 1)


def test_a_port_owner_told_to_another_users_arbiter_cannot_be_recomputed() -> None:
    import hashlib

    from pytest_gpu.machine.ports import owner_digest

    holder = "tests/t.py::test_secret@4242"
    assert owner_digest(holder) == owner_digest(holder)  # stable: ports are given back by it
    assert owner_digest(holder) != "#" + hashlib.sha256(holder.encode()).hexdigest()[:16]
    other = subprocess.run(
        [sys.executable, "-c", f"from pytest_gpu.machine.ports import owner_digest; print(owner_digest({holder!r}))"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert other.stdout.strip() != owner_digest(holder)  # keyed per process: no one else can make it
    # and the run's link tells another user's arbiter exactly that, never the name or a plain hash
    from pytest_gpu.machine.link import MachineLink

    link = MachineLink.__new__(MachineLink)
    link._remote = None
    theirs = SimpleNamespace(peer_uid=os.getuid() + 1)
    assert link._said(f"gw0/{holder}", theirs) == f"gw0/{owner_digest(holder)}"  # type: ignore[arg-type]
    assert link._said(f"gw0/{holder}", SimpleNamespace(peer_uid=os.getuid())) == f"gw0/{holder}"  # type: ignore[arg-type]


# -- what an administrator can bound: one user's leases ----------------------------------------------


def test_an_administrator_bounds_what_one_users_leases_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(USER_MEMORY_ENV, "12GiB")
    arbiter = _arbiter(Policy(overhead=0), {U: 80 * GiB})
    _attach(arbiter, "2000.b1", {U: 80 * GiB})
    _attach(arbiter, "2000.b2", {U: 80 * GiB})
    _attach(arbiter, "1000.a", {U: 80 * GiB})
    assert arbiter.submit("2000.b1", "c0/k0", "c0", "gw0", "t", shared(8 * GiB), [U])[0] == "granted"
    assert arbiter.submit("2000.b2", "c0/k0", "c0", "gw0", "t", shared(6 * GiB), [U])[0] == "queued"  # 14 > 12
    kind, why = arbiter.submit("2000.b1", "c1/k1", "c1", "gw1", "t", shared(13 * GiB), [U])
    assert kind == "error" and "more than the 12GiB one user's leases may hold" in why
    for n in range(20):  # B's waiting requests keep no one else out, whatever their bound on overtaking
        assert arbiter.submit("1000.a", f"c0/k{n}", "c0", "gw0", "t", shared(512 * MiB), [U])[0] == "granted"
    arbiter.release("2000.b1", "c0/k0")
    assert [lease["memory"] for lease in arbiter.status()["leases"] if lease["user"] == "2000.b2"] == [6 * GiB]
    monkeypatch.setenv(USER_MEMORY_ENV, "lots")
    with pytest.raises(ValueError, match="PYTEST_GPU_USER_MEMORY=lots"):
        Arbiter()
