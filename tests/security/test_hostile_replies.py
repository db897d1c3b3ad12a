"""An arbiter that lies: every reply is hostile input (issue 30, item 2; docs/sharing.md).

Whoever answers at the machine's arbiter address (another user's process that bound it
first, a run of another version), a run checks what it answers against the protocol and
against what the run itself knows: a grant names distinct GPUs the run asked on, as many
as it asked for, of the size asked, and never more of a GPU than the GPU has together with
the run's own leases; ports are distinct and not the run's already; a room is one size per
GPU. An arbiter that says otherwise is left (one warning line) and the call is asked again
of the run's own arbiter: the run never fails for it, never INTERNALERROR.

The unit tests drive a :class:`~pytest_gpu.machine.link.MachineLink` against a stand-in
(tests/fake_arbiter.py) on a real socket; the two-user test runs A's pytest session beside
B's stand-in on A's group machine (the users and helpers of test_hostile_neighbours.py).
"""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import test_hostile_neighbours as two_users
from test_hostile_neighbours import Machine, _passed

import fake_arbiter as fake_module
from fake_arbiter import FakeArbiter
from helpers import patience, shared, wait_for, whole
from pytest_gpu import cli
from pytest_gpu.machine.domain import ROOT_ENV, Domain
from pytest_gpu.machine.link import OWN_RUNS_ONLY, MachineLink, distrusted
from pytest_gpu.machine.placement import Policy
from pytest_gpu.machine.ports import PortAllocator

users, machine = two_users.users, two_users.machine  # its fixtures, here too
GiB = 2**30
GARBLED = "is no usable arbiter: the machine's arbiter sent what its protocol does not allow"
GPUS = {"U": 16 * GiB, "V": 16 * GiB}


@pytest.fixture
def domain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Domain:
    monkeypatch.setenv(ROOT_ENV, str(tmp_path / "machines"))
    return Domain.machine_wide(f"gpus-{tmp_path.name}")


@pytest.fixture
def made() -> Iterator[list[Any]]:
    things: list[Any] = []
    yield things
    for thing in reversed(things):
        thing.close()


def _follower(made: list[Any], domain: Domain, events: list[Any] | None = None, **answers: Any) -> MachineLink:
    """A run attached to a stand-in that answers ``answers`` (op -> callable of the message)."""
    made.append(FakeArbiter(domain.address(), answers=answers))
    link = MachineLink(domain, Policy(overhead=0), ports=PortAllocator((31000, 31009), check=lambda p: True, seed=0))
    link.attach(GPUS, events.append if events is not None else lambda events: None)
    made.append(link)
    assert not link.is_arbiter and link.fell_back is None  # the stand-in is its arbiter
    return link


def _left(link: MachineLink, why: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The run left the stand-in for its own user's domain, and said so in one line naming ``why``."""
    assert link.fell_back is not None and GARBLED in link.fell_back and why in link.fell_back, link.fell_back
    assert link.domain is not None and not link.domain.wide
    lines = [line for line in capsys.readouterr().err.splitlines() if GARBLED in line]
    assert len(lines) == 1 and why in lines[0] and OWN_RUNS_ONLY in lines[0], lines


def _first_named(memory: int | None = None) -> Any:
    """A stand-in's submit: granted on the first GPU the run named, whatever it asked for."""

    def answer(m: dict[str, Any]) -> Any:
        _, asked, exclusive = m["request"][:3]
        return ["granted", {"gpus": m["gpus"][:1], "memory": memory or asked or 15 * GiB, "exclusive": exclusive}]

    return answer


def test_a_room_of_null_is_asked_again_of_the_runs_own_arbiter(
    domain: Domain, made: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    link = _follower(made, domain, room=lambda m: None)
    assert link.room(["U", "V"]) == [16 * GiB, 16 * GiB]
    _left(link, "its answer to 'room' must be a list", capsys)


@pytest.mark.parametrize(
    "room, why",
    [
        ([16 * GiB], "has 1 sizes for 2 GPUs"),
        ([16 * GiB, 1 << 45], "more than it has"),
        (["16GiB", 0], "must be an integer"),
    ],
)
def test_a_room_that_is_not_one_true_size_per_gpu_is_not_believed(
    domain: Domain, made: list[Any], capsys: pytest.CaptureFixture[str], room: Any, why: str
) -> None:
    link = _follower(made, domain, room=lambda m: room)
    assert link.room(["U", "V"]) == [16 * GiB, 16 * GiB]
    _left(link, why, capsys)


@pytest.mark.parametrize(
    "asked, gpus, grant, why",
    [
        (shared(GiB), ["U"], {"gpus": ["V"], "memory": GiB, "exclusive": False}, "which the run did not ask for"),
        (shared(GiB), ["U"], {"gpus": ["GPU-X"], "memory": GiB, "exclusive": False}, "which the run did not ask for"),
        (shared(GiB, 2), ["U", "V"], {"gpus": ["U"], "memory": GiB, "exclusive": False}, "1 GPUs for a request of 2"),
        (shared(GiB, 2), ["U", "V"], {"gpus": ["U", "U"], "memory": GiB, "exclusive": False}, "names a GPU twice"),
        (shared(GiB), ["U"], {"gpus": ["U"], "memory": 2 * GiB, "exclusive": False}, "for a request of 1073741824"),
        (shared(GiB), ["U"], {"gpus": ["U"], "memory": GiB, "exclusive": True}, "is exclusive for"),
        (whole(), ["U"], {"gpus": ["U"], "memory": 20 * GiB, "exclusive": True}, "which has 17179869184"),
        (whole(at_least=8 * GiB), ["U"], {"gpus": ["U"], "memory": GiB, "exclusive": True}, "of whole GPUs gives"),
        (shared(GiB), ["U"], {"gpus": "U", "memory": GiB, "exclusive": False}, "a grant's gpus must be a list"),
    ],
)
def test_a_grant_the_run_did_not_ask_for_is_not_believed(
    domain: Domain,
    made: list[Any],
    capsys: pytest.CaptureFixture[str],
    asked: Any,
    gpus: list[str],
    grant: dict[str, Any],
    why: str,
) -> None:
    link = _follower(made, domain, submit=lambda m: ["granted", grant])
    kind, body = link.submit("c0/k0", "c0", "gw0", "t::a", asked, gpus)
    assert kind == "granted" and sorted(body["gpus"]) == sorted(gpus)  # by the run's own arbiter
    assert body["exclusive"] == asked.exclusive and len(body["gpus"]) == asked.count
    _left(link, why, capsys)


@pytest.mark.parametrize("request_", [shared(11 * GiB), whole()], ids=["11GiB each", "whole GPUs"])
def test_the_first_gpu_granted_to_every_request_is_not_believed_twice(
    domain: Domain, made: list[Any], capsys: pytest.CaptureFixture[str], request_: Any
) -> None:
    """Two workers' requests, each granted on the first GPU named: the first grant is
    possible, the second would put more on GPU U than it has (or share a whole GPU)."""
    link = _follower(made, domain, submit=_first_named())
    first = link.submit("c0/k0", "c0", "gw0", "t::a", request_, ["U", "V"])
    second = link.submit("c1/k0", "c1", "gw1", "t::b", request_, ["U", "V"])
    assert first[0] == second[0] == "granted"
    assert first[1]["gpus"] == ["U"] and second[1]["gpus"] == ["V"]  # the run's own arbiter knew U was held
    _left(link, "a grant of 'c1/k0'", capsys)


def test_a_grant_event_of_a_gpu_not_asked_on_is_not_believed(domain: Domain, made: list[Any]) -> None:
    events: list[Any] = []
    made.append(
        FakeArbiter(
            domain.address(),
            events={"submit": [{"ev": [["granted", "c0/k0", {"gpus": ["V"], "memory": GiB, "exclusive": False}]]}]},
        )
    )
    link = MachineLink(domain, Policy(overhead=0))
    link.attach(GPUS, events.append)
    made.append(link)
    assert link.submit("c0/k0", "c0", "gw0", "t::a", shared(GiB), ["U"]) == ("queued", None)
    wait_for(lambda: events, what="the request granted by the run's own arbiter")
    [[(kind, key, body)]] = events
    assert (kind, key, body["gpus"]) == ("granted", "c0/k0", ["U"])
    assert link.fell_back is not None and "which the run did not ask for" in link.fell_back


def test_a_grant_event_of_a_request_never_made_is_not_believed(domain: Domain, made: list[Any]) -> None:
    """A grant pushed for a key the run never asked (a worker's next key, say) would wait
    there for that worker's next request, a lease no arbiter counts."""
    events: list[Any] = []
    forged = {"ev": [["granted", "c0/k9", {"gpus": ["V"], "memory": GiB, "exclusive": False}]]}
    made.append(FakeArbiter(domain.address(), events={"submit": [forged]}))
    link = MachineLink(domain, Policy(overhead=0))
    link.attach(GPUS, events.append)
    made.append(link)
    assert link.submit("c0/k0", "c0", "gw0", "t::a", whole(), ["U"]) == ("queued", None)
    wait_for(lambda: link.fell_back, what="the run to leave its arbiter")
    assert "a grant of 'c0/k9', which the run did not ask for" in link.fell_back
    wait_for(lambda: events, what="the request granted by the run's own arbiter")
    assert [(kind, key) for kind, key, _ in events[0]] == [("granted", "c0/k0")]


def test_a_grant_of_a_request_withdrawn_meanwhile_is_believed(domain: Domain, made: list[Any]) -> None:
    """An arbiter may grant a request as the run cancels it: that grant is no lie."""
    events: list[Any] = []
    late = {"ev": [["granted", "c0/k0", {"gpus": ["U"], "memory": GiB, "exclusive": False}]]}
    made.append(FakeArbiter(domain.address(), answers={"cancel": lambda m: None}, events={"cancel": [late]}))
    link = MachineLink(domain, Policy(overhead=0))
    link.attach(GPUS, events.append)
    made.append(link)
    assert link.submit("c0/k0", "c0", "gw0", "t::a", shared(GiB), ["U"]) == ("queued", None)
    assert link.cancel("c0/k0") is None  # not waiting: granted meanwhile
    wait_for(lambda: events, what="the late grant")
    assert link.fell_back is None and events[0][0][:2] == ("granted", "c0/k0")


@pytest.mark.parametrize(
    "answers, why",
    [
        ([[31000, 31000]], "for 2 distinct ports"),
        ([[31000]], "for 2 distinct ports"),
        ([[41000, 41001]], "not in 31000-31009"),
    ],
)
def test_ports_that_are_not_as_many_distinct_as_asked_are_not_believed(
    domain: Domain, made: list[Any], capsys: pytest.CaptureFixture[str], answers: list[Any], why: str
) -> None:
    link = _follower(made, domain, take_ports=lambda m: {"ports": answers[0]})
    ports = link.take_ports(2, "c0/t::a@1", (31000, 31009))
    assert len(set(ports)) == 2 and all(31000 <= p <= 31009 for p in ports)
    _left(link, why, capsys)


def test_one_port_handed_to_two_workers_is_not_believed(
    domain: Domain, made: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    link = _follower(made, domain, take_ports=lambda m: {"ports": [31000]})
    first = link.take_ports(1, "c0/t::a@1", (31000, 31009))
    second = link.take_ports(1, "c1/t::b@2", (31000, 31009))
    assert first == [31000] and second != first  # the run's own arbiter knew 31000 was taken
    _left(link, "the run's already", capsys)


def test_a_reply_larger_than_any_arbiter_sends_is_not_read(
    domain: Domain, made: list[Any], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fake_module, "MAX_REPLY", 64 << 20)  # the stand-in may send what no arbiter does
    huge = {**fake_module.STATUS, "error": "x" * (17 << 20)}
    link = _follower(made, domain, status=lambda m: huge)
    assert link.status()["runs"][0]["run"] == link.run  # the run's own arbiter's
    _left(link, "is over the 16777216-byte limit", capsys)


@pytest.mark.parametrize(
    "op, answer, call, why",
    [
        ("measure_context", "yes", lambda link: link.measure_context("U", GiB), "must be true or false"),
        ("forget_client", {"c0/k0": ["U"]}, lambda link: link.forget_client("c0"), "must be a list"),
        ("cancel", 7, lambda link: link.cancel("c0/k0"), "must be a list"),
        ("status", {"runs": None}, lambda link: link.status(), "must be a list"),
        ("submit", ["granted", None], lambda link: link.submit("c0/k0", "c0", "gw0", "t", whole(), ["U"]), "object"),
        ("take_ports", {"ports": "31000"}, lambda link: link.take_ports(1, "c0/t@1", (31000, 31009)), "must be"),
    ],
)
def test_an_answer_of_the_wrong_type_is_asked_again_of_the_runs_own_arbiter(
    domain: Domain, made: list[Any], capsys: pytest.CaptureFixture[str], op: str, answer: Any, call: Any, why: str
) -> None:
    link = _follower(made, domain, **{op: lambda m: answer})
    call(link)  # answered, by the run's own arbiter: no MachineError, no TypeError
    _left(link, why, capsys)


def test_a_refusal_with_terminal_escapes_is_shown_escaped(domain: Domain, made: list[Any]) -> None:
    link = _follower(made, domain, submit=lambda m: ["rejected", "no\x1b]0;owned\x07\x1b[2J room\nat all"])
    kind, message = link.submit("c0/k0", "c0", "gw0", "t", whole(), ["U"])
    assert kind == "rejected" and message == "no\\x1b]0;owned\\x07\\x1b[2J room\nat all"


# -- whom a run trusts on a group's simulated machine -----------------------------------------------


def _a_pid_that_is_gone() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_group_machines_arbiter_must_be_a_member_of_the_group(tmp_path: Path) -> None:
    """By the kernel's word: the peer's uid, that user's groups (its primary one too)."""
    import pwd

    member = next(e for e in pwd.getpwall() if e.pw_uid not in (0, os.getuid()))
    path = tmp_path / "sim-shared"
    path.mkdir()
    domain = Domain.machine_wide("sim-shared", path)
    if os.geteuid() == 0:
        os.chown(path, -1, member.pw_gid)
    else:
        pytest.skip("needs root to give a directory another group")
    gone = _a_pid_that_is_gone()  # no process to read groups from: the group database answers
    assert distrusted(domain, member.pw_uid, gone, "B") is None
    assert distrusted(domain, 0, gone, "root") is None and distrusted(domain, os.getuid(), os.getpid(), "me") is None
    why = distrusted(domain, 40002, gone, "the process at the address (pid 9, user 40002)")
    assert why is not None and "is not in group" in why and "'sim-shared'" in why
    # by the process's own groups where they can be read: this process is not the member's
    assert distrusted(domain, member.pw_uid, os.getpid(), "B") is not None
    path.rmdir()
    path.symlink_to(tmp_path)  # no directory of a group: no one's but this user's and root's
    assert distrusted(domain, member.pw_uid, gone, "B") is not None
    assert distrusted(Domain.machine_wide("gpus"), 40002, gone, "B") is None  # the real GPUs: anyone's
    assert stat.S_ISLNK(path.lstat().st_mode)


# -- two users: B's stand-in on A's group machine -----------------------------------------------------

BIG_SUITE = """
import pytest
from pytest_gpu import sim

@pytest.mark.parametrize("i", range(2))
@pytest.mark.gpu(memory="11GiB")
def test_big(i):
    sim.hold("10GiB", 2.0)

@pytest.mark.parametrize("i", range(2))
def test_port(i, port):
    import socket, time
    with socket.socket() as sock:
        sock.bind(("", port))
        time.sleep(1.0)
"""


@pytest.mark.slow
def test_a_stand_in_of_a_user_outside_the_group_is_not_trusted(machine: Machine) -> None:
    """B (not in A's group) binds the group machine's address first and answers the
    protocol: every submit granted on the first GPU named, every take_ports one port. A's
    run with two workers distrusts it (B is no member), coordinates alone, and passes."""
    suite = machine.a.home / "test_big.py"
    suite.write_text(BIG_SUITE)
    os.chown(suite, machine.a.uid, machine.a.gid)
    fake = machine.hold("fake")
    try:
        result = machine.run_a("-n", "2", "test_big.py", "--timeout", "90")
    finally:
        fake.send_signal(signal.SIGKILL)
        fake.wait()
    _passed(result, 4)
    lines = [line for line in result.stdout.splitlines() if "pytest-gpu: warning" in line]
    assert len(lines) == 1, result.stdout
    assert f"user {machine.b.name}) is not in group {machine.a.name}" in lines[0] and OWN_RUNS_ONLY in lines[0]


# -- `pytest-gpu status` against what answers -----------------------------------------------------


def test_status_shows_what_an_arbiter_sent_with_its_escapes_escaped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, made: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """A stand-in's run label that would set the terminal's title, clear the screen and
    print a forged line; a user name ringing the bell; a C1 escape in a test's name."""
    monkeypatch.setenv(ROOT_ENV, str(tmp_path / "machines"))
    run = {"run": "0.x", "user": "ev\x07il", "leases": 1, "gpus": [], "pid": 1, "attached": 0.0}
    run["label"] = "\x1b]0;owned\x07\x1b[2J\x1b[Hgpus: 0 runs attached, all free\r"
    lease = {
        **{"run": "0.x", "run_label": "", "user": "u", "worker": "gw\x1b[8m", "test": "t\x9b2J", "gpus": []},
        **{"memory": GiB, "exclusive": False, "cpus": 0, "host_memory": 0, "since": None},
    }
    state = {**fake_module.STATUS, "runs": [run], "leases": [lease]}
    made.append(FakeArbiter(Domain.real().address(), answers={"status": lambda m: state}))
    assert cli.main(["status", "--machine", "gpus"]) == 0
    out = capsys.readouterr().out
    assert not any(c in out for c in "\x1b\x07\x9b\r"), repr(out)
    assert "\\x1b]0;owned\\x07\\x1b[2J\\x1b[Hgpus: 0 runs attached, all free\\r" in out
    assert "user ev\\x07il" in out and "gw\\x1b[8m" in out and "t\\x9b2J" in out


def test_status_shows_a_machine_directorys_name_escaped() -> None:
    """Anyone may make a ``sim-*`` directory in the machine directory, and answer at its address."""
    lines = cli.format_status("sim-\x1b[2Jall free", {**fake_module.STATUS}, 0.0)
    assert lines[0].startswith("sim-\\x1b[2Jall free: 0 runs attached")


def test_status_takes_a_few_seconds_whatever_listens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, made: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """Four simulated machines whose addresses a process holds and never answers at: each
    took its own 5 s, one after another (20 s); now they are asked at once, for 3 s at most."""
    machines = tmp_path / "machines"
    monkeypatch.setenv(ROOT_ENV, str(machines))
    for n in range(4):
        path = machines / f"sim-silent{n}"
        path.mkdir(parents=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(Domain.machine_wide(path.name, path).address())
        listener.listen(16)
        made.append(listener)
    started = time.monotonic()
    assert cli.main(["status"]) == 0
    took = time.monotonic() - started
    assert took < cli.STATUS_DEADLINE_S + patience(1.0), f"status took {took:.1f}s"  # its own deadline, and a margin
    assert "no pytest-gpu run holds or waits for GPUs" in capsys.readouterr().out
