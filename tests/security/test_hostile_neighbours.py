"""Two users on one machine: B attacks A's runs; A's runs pass and A's files stay A's.

The promise (docs/sharing.md, "Sharing a machine"): a local user without root who shares the
machine sees of another user's runs only that they exist (user, number of leases, GPUs
held); can never write or change the mode of another user's files; never release, change,
receive or impersonate another run's leases; never make the arbiter promise memory
twice; never stop the arbiter serving other runs, nor make another user's run end in
INTERNALERROR. Where safe coordination cannot be established, a run coordinates with its
own user's runs only and says so in one warning line.

Two throwaway users (made here, removed after) run real pytest sessions (A, the victim)
and tests/neighbour.py (B, the attacker). Needs root (CI runs as root), useradd and setfacl
(the users need to reach this interpreter, which may live under /root).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from conftest import MISSING
from helpers import TESTS, patience, throwaway_user, wait_for
from pytest_gpu.sim.spec import gpu_uuid

pytestmark = pytest.mark.slow

SPEC = "sim:2x16GiB"
MACHINE = "shared"  # the simulated machine A's runs share with A's group: coordinated machine-wide


@dataclass
class User:
    name: str
    uid: int
    gid: int
    home: Path

    def env(self, machines: Path, **extra: str) -> dict[str, str]:
        keep = {k: v for k, v in os.environ.items() if k in ("PATH", "PYTHONPATH", "LANG", "LC_ALL", "TERM")}
        return {
            **keep,
            "HOME": str(self.home),
            "USER": self.name,
            "XDG_CACHE_HOME": str(self.home / ".cache"),
            "PYTEST_GPU_MACHINE_DIR": str(machines),
            "PYTHONDONTWRITEBYTECODE": "1",
            **extra,
        }

    def popen(self, args: list[str], env: dict[str, str], **kwargs: Any) -> subprocess.Popen[str]:
        return subprocess.Popen(
            args,
            user=self.uid,
            group=self.gid,
            extra_groups=[],
            env=env,
            cwd=self.home,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            **kwargs,
        )


@dataclass
class Machine:
    """Two users, a machine directory an administrator made (root's, 1777), A's victim files."""

    a: User
    b: User
    machines: Path

    def victims(self) -> dict[Path, tuple[str, int]]:
        return {p: (p.read_text(), stat.S_IMODE(p.stat().st_mode)) for p in sorted(self.a.home.glob("victim*.txt"))}

    def a_env(self, **extra: str) -> dict[str, str]:
        return self.a.env(self.machines, PYTEST_GPU_SIM_MACHINE=MACHINE, PYTEST_GPU_SIM_GROUP=self.a.name, **extra)

    def run_a(self, *args: str, timeout: float = 120, **extra: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--gpus", SPEC, *args]
        proc = self.a.popen(command, self.a_env(**extra))
        out, err = proc.communicate(timeout=patience(timeout))
        return subprocess.CompletedProcess(command, proc.returncode, out, err)

    def start_a(self, *args: str) -> subprocess.Popen[str]:
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--gpus", SPEC, *args]
        return self.a.popen(command, self.a_env())

    def attack(self, attack: str, *args: str) -> Any:
        env = self.b.env(self.machines, NEIGHBOUR_GPU=gpu_uuid(0))
        proc = self.b.popen([sys.executable, str(TESTS / "neighbour.py"), attack, f"sim-{MACHINE}", *args], env)
        out, err = proc.communicate(timeout=patience(60))
        assert proc.returncode == 0, err
        return json.loads(out)

    def hold(self, attack: str, *args: str) -> subprocess.Popen[str]:
        env = self.b.env(self.machines, NEIGHBOUR_GPU=gpu_uuid(0))
        proc = self.b.popen([sys.executable, str(TESTS / "neighbour.py"), attack, f"sim-{MACHINE}", *args], env)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read() if proc.stderr else ""
        return proc


def _need(tool: str) -> None:
    if shutil.which(tool) is None:
        pytest.skip(f"{MISSING}: {tool} (two-user tests; apt-get install {'acl' if 'facl' in tool else 'passwd'})")


def _reachable_dirs() -> list[Path]:
    """Directories on the way to this interpreter and to pytest-gpu that other users cannot enter."""
    import pytest_gpu

    found: set[Path] = set()
    for start in (Path(sys.executable).resolve(), Path(pytest_gpu.__file__).resolve(), Path(pytest.__file__).resolve()):
        for parent in start.parents:
            if not parent.stat().st_mode & stat.S_IXOTH:
                found.add(parent)
    return sorted(found)


@pytest.fixture(scope="module")
def users() -> Iterator[tuple[User, User, Path]]:
    if os.geteuid() != 0:
        pytest.skip(f"{MISSING}: root (the two-user tests make throwaway users; CI runs as root)")
    for tool in ("useradd", "userdel", "setfacl"):
        _need(tool)
    base = Path(f"/tmp/pytest-gpu-2u-{secrets.token_hex(3)}")
    base.mkdir(mode=0o755)
    closed = _reachable_dirs()
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, base, True)
        made = []
        for letter in "ab":
            entry = stack.enter_context(throwaway_user(f"pgt{letter}"))
            home = base / f"home-{letter}"
            home.mkdir(mode=0o700)
            os.chown(home, entry.pw_uid, entry.pw_gid)
            made.append(User(entry.pw_name, entry.pw_uid, entry.pw_gid, home))
            for path in closed:  # traverse only: the interpreter and the package, nothing else
                subprocess.run(["setfacl", "-m", f"u:{entry.pw_name}:x", str(path)], check=True, capture_output=True)
                stack.callback(subprocess.run, ["setfacl", "-x", f"u:{entry.pw_name}", str(path)], capture_output=True)
        yield made[0], made[1], base


VICTIM_SUITE = """
import os, time, pathlib, pytest
from pytest_gpu import sim

HERE = pathlib.Path(__file__).parent

@pytest.mark.gpu(memory="7GiB")
def test_holds_until_told():
    with sim.allocate("6GiB"):
        (HERE / "ready").write_text(str(os.getpid()))
        deadline = time.monotonic() + 90
        while not (HERE / "go").exists():
            assert time.monotonic() < deadline, "never told to go on"
            time.sleep(0.02)

@pytest.mark.gpu(memory="7GiB")
def test_more_memory():
    sim.hold("6GiB", 0.05)

def test_port(port):
    import socket
    with socket.socket() as sock:
        sock.bind(("", port))
"""


@pytest.fixture
def machine(users: tuple[User, User, Path]) -> Iterator[Machine]:
    a, b, base = users
    machines = base / f"machines-{secrets.token_hex(3)}"
    machines.mkdir()
    machines.chmod(0o1777)  # as an administrator makes /tmp/pytest-gpu-machines
    for user in (a, b):
        for entry in user.home.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    for name in ("victim.txt", "victim2.txt"):
        victim = a.home / name
        victim.write_text(f"A's own {name}\n")
        os.chown(victim, a.uid, a.gid)
        victim.chmod(0o600)
    suite = a.home / "test_victim.py"
    suite.write_text(VICTIM_SUITE)
    os.chown(suite, a.uid, a.gid)
    yield Machine(a, b, machines)
    for user in (a, b):
        subprocess.run(["pkill", "-KILL", "-u", user.name], capture_output=True)


def _passed(result: subprocess.CompletedProcess[str], count: int = 3) -> None:
    text = result.stdout + result.stderr
    assert result.returncode == 0, text
    assert f"{count} passed" in result.stdout, text
    assert "INTERNALERROR" not in text, text


def _go(machine: Machine, run: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    (machine.a.home / "go").write_text("go")
    out, err = run.communicate(timeout=patience(120))
    return subprocess.CompletedProcess(run.args, run.returncode, out, err)


def _wait_ready(machine: Machine, run: subprocess.Popen[str]) -> None:
    def ready() -> bool:
        assert run.poll() is None, run.communicate()
        return (machine.a.home / "ready").exists()

    wait_for(ready, timeout=90, what="A's test holding its lease")


def _arbiter_of(machine: Machine) -> dict[str, Any]:
    """The machine-wide arbiter's state, as root (who may see everything) reads it."""
    from pytest_gpu.machine.domain import Domain
    from pytest_gpu.machine.link import status

    old = os.environ.get("PYTEST_GPU_MACHINE_DIR")
    os.environ["PYTEST_GPU_MACHINE_DIR"] = str(machine.machines)
    try:
        state = status(Domain.machine_wide(f"sim-{MACHINE}"))
    finally:
        if old is None:
            del os.environ["PYTEST_GPU_MACHINE_DIR"]
        else:
            os.environ["PYTEST_GPU_MACHINE_DIR"] = old
    assert state is not None, "no arbiter answers"
    return state


# -- 1: files nobody else can redirect -----------------------------------------------------------


def test_links_and_directories_planted_by_another_user_redirect_nothing(machine: Machine) -> None:
    a, b = machine.a, machine.b
    before = machine.victims()
    # where A's runs would put their own directory and their group's machine, B was first
    mine = machine.machines / f"user-{a.uid}"
    os.symlink(a.home, mine)
    os.lchown(mine, b.uid, b.gid)
    shared = machine.machines / f"sim-{MACHINE}"
    shared.mkdir()
    shared.chmod(0o777)
    ledger = shared / "sim-ledger"
    ledger.mkdir()
    ledger.chmod(0o777)
    for name in ("ledger.json", "nvml.state", "ledger.lock", "arbiter.lock"):  # the old names and temp names
        os.symlink(a.home / "victim.txt", ledger / name)
    for pid in range(os.getpid(), os.getpid() + 2000, 7):
        os.symlink(a.home / "victim2.txt", ledger / f"ledger.json.{pid}.tmp")
    for path in [shared, ledger, *ledger.iterdir()]:
        os.lchown(path, b.uid, b.gid)
    go = machine.a.home / "go"  # the holding test need not wait here
    go.write_text("go")
    os.chown(go, a.uid, a.gid)
    result = machine.run_a("-n", "2", "--timeout", "90")
    assert machine.victims() == before  # not written, not made world-writable
    _passed(result)
    said = result.stdout + result.stderr
    warnings = [line for line in said.splitlines() if "pytest-gpu: warning" in line]
    assert warnings and all(str(machine.machines) in line for line in warnings), said
    assert len(warnings) == len(set(warnings))  # each said once, in the summary, not by every worker
    assert not [p for p in (shared, ledger, *ledger.iterdir()) if p.lstat().st_uid == a.uid]  # A wrote nothing there


def test_another_user_cannot_plant_links_where_a_users_run_writes(machine: Machine) -> None:
    go = machine.a.home / "go"
    go.write_text("go")
    os.chown(go, machine.a.uid, machine.a.gid)
    _passed(machine.run_a("--timeout", "60"))  # A's machine exists now, as after any run
    ledger = machine.machines / f"sim-{MACHINE}" / "sim-ledger"
    before = machine.victims()
    planted = machine.attack("plant", str(ledger), str(machine.a.home / "victim.txt"))
    assert planted == {"planted": 0, "refused": "PermissionError: Permission denied"}
    _passed(machine.run_a("--timeout", "60"))
    assert machine.victims() == before


# -- 2 to 4: the arbiter against another user ------------------------------------------------------


def test_another_user_can_neither_see_nor_hijack_nor_crash_a_run(machine: Machine) -> None:
    run = machine.start_a("-n", "2", "--timeout", "90")
    _wait_ready(machine, run)
    state = _arbiter_of(machine)
    victim_run = next(r["run"] for r in state["runs"] if r["user"] == machine.a.name)
    seen = machine.attack("status")["ok"]
    (row,) = seen["runs"]  # that A's run exists, its user, how many leases it holds where: no more
    assert set(row) == {"user", "leases", "gpus"} and row["user"] == machine.a.name and row["leases"] >= 1
    assert seen["leases"] == [] and seen["waiting"] == []
    text = json.dumps(seen)
    assert "test_holds_until_told" not in text and str(machine.a.home) not in text and victim_run not in text
    hijacked = machine.attack("hijack", victim_run)
    assert "is not of this connection's user" in hijacked[0]["error"]
    machine.attack("impersonate")
    over = machine.attack("overcommit")  # B is outside A's group: refused before any field is read
    assert "is not a member of group" in over[0]["error"], over  # (fields as another user: test_arbiter_hardening)
    assert all("before 'attach'" in answer["error"] for answer in over[1:]), over
    machine.attack("crash")
    state = _arbiter_of(machine)
    assert [r["user"] for r in state["runs"]] == [machine.a.name]  # B's runs are gone, A's stays
    assert [lease["test"] for lease in state["leases"]] == ["test_victim.py::test_holds_until_told"]
    assert all(0 <= g["leased"] <= g["capacity"] for g in state["gpus"])
    second = machine.run_a("-k", "more_memory or port", "--timeout", "60")  # a second run attaches and passes
    _passed(second, 2)
    _passed(_go(machine, run))


def test_floods_and_squatters_never_stop_a_run(machine: Machine) -> None:
    run = machine.start_a("--timeout", "90")
    _wait_ready(machine, run)
    arbiter = psutil.Process(run.pid)
    rss = arbiter.memory_info().rss
    flood = machine.hold("flood", "1000")
    try:
        grown = arbiter.memory_info().rss - rss
        assert grown < 64 << 20, f"the arbiter's process grew by {grown >> 20} MiB under the flood"
        second = machine.run_a("-k", "more_memory or port", "--timeout", "60")
        _passed(second, 2)
    finally:
        flood.send_signal(signal.SIGKILL)
        flood.wait()
    _passed(_go(machine, run))
    # a squatter on the address while no arbiter runs: A's runs coordinate among themselves
    (machine.a.home / "go").unlink()
    (machine.a.home / "ready").unlink()
    squatter = machine.hold("squat")
    try:
        started = time.monotonic()
        result = machine.run_a("-k", "more_memory or port", "--timeout", "60")
        _passed(result, 2)
        assert time.monotonic() - started < 60
        lines = [line for line in result.stdout.splitlines() if "own user's runs only" in line]
        assert len(lines) == 1, result.stdout  # once, in the run's summary
    finally:
        squatter.send_signal(signal.SIGKILL)
        squatter.wait()
