"""The machine's arbiter against a hostile peer: every message checked, identity from the
kernel, bounded resources, squatters detected (pytest_gpu.machine.server, .messages, .link).

Everything here runs in this process against a real server on a real socket; "another
user" is a forked child that gave up root (the two-user runs end to end are in
test_hostile_neighbours.py).
"""

from __future__ import annotations

import json
import os
import re
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fake_arbiter import FakeArbiter
from helpers import as_other_user, patience, shared, wait_for, whole
from pytest_gpu.machine import link as links_module
from pytest_gpu.machine import messages
from pytest_gpu.machine import server as server_module
from pytest_gpu.machine.arbiter import Arbiter
from pytest_gpu.machine.domain import ROOT_ENV, Domain
from pytest_gpu.machine.link import MachineLink
from pytest_gpu.machine.messages import Held, request_from_wire
from pytest_gpu.machine.placement import Policy
from pytest_gpu.machine.ports import PortAllocator
from pytest_gpu.machine.server import ArbiterServer
from pytest_gpu.wire.frames import MAX_REPLY, FrameReader, WireError, decode, encode
from pytest_gpu.wire.sockets import reachable

GiB = 2**30
OTHER = 40002  # a uid no one uses: "another user"


# -- frames: what the parser is given ------------------------------------------------------


@pytest.mark.parametrize(
    "raw, why",
    [
        (b"[" * 200_000, "nests deeper"),
        (b'{"a":' * 50 + b"1" + b"}" * 50, "nests deeper"),
        (b'{"op":"submit","memory":NaN}', "not JSON"),
        (b'{"op":"submit","memory":-Infinity}', "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b'"\\"' * 300_000, "not JSON"),  # every quote escaped: no pass may go quadratic
        (b"\xff\xfe", "not JSON"),
    ],
)
def test_a_frame_that_is_not_a_plain_shallow_object_is_refused(raw: bytes, why: str) -> None:
    started = time.monotonic()
    with pytest.raises(WireError, match=why):
        decode(raw)
    assert time.monotonic() - started < 1.0


def test_brackets_inside_strings_are_not_nesting() -> None:
    node = "tests/t.py::test_x[[[[[[[[[[[[a]]]]]]]]]]]]"
    assert decode(json.dumps({"test": node, "l": [[[[1]]]]}).encode())["test"] == node


@pytest.mark.parametrize(
    "shape, why",
    [
        ([1, -16 * GiB, False, None], r"memory must be in \[0"),
        ([1, 2.5, False, None], "memory must be an integer"),
        ([True, GiB, False, None], "count must be an integer"),
        ([1, GiB, "no", None], "exclusive must be true or false"),
        ([1, 1 << 60, False, None], r"memory must be in \[0"),
        ([10**6, GiB, False, None], r"count must be in \[0, 256\]"),
        ([1, None, False, None], "memory exactly when it is not exclusive"),
        ([1, GiB, False, None, -1, 0], r"cpus must be in \[0"),
        ([1, GiB, False], "4 or 6 fields"),
        ("1,1,1,1", "4 or 6 fields"),
    ],
)
def test_a_request_off_the_wire_is_checked_field_by_field(shape: Any, why: str) -> None:
    with pytest.raises(WireError, match=why):
        request_from_wire(shape)


# -- a live arbiter and raw peers -----------------------------------------------------------


class Raw:
    """A peer that speaks the arbiter's frames by hand (and can say anything)."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5)
        with reachable(address) as where:
            self.sock.connect(where)
        self.reader = FrameReader(MAX_REPLY)
        self.ids = iter(range(1, 1 << 30))
        self.heard: list[dict[str, Any]] = []

    def send(self, message: dict[str, Any] | bytes) -> None:
        if isinstance(message, bytes):
            self.sock.sendall(struct.pack(">I", len(message)) + message)
        else:
            self.sock.sendall(encode(message, MAX_REPLY))

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        rid = next(self.ids)
        self.send({"op": op, "id": rid, **fields})
        while True:
            for message in self.heard:
                if message.get("re") == rid:
                    self.heard.remove(message)
                    return message
            data = self.sock.recv(65536)
            assert data, f"the arbiter closed the connection instead of answering {op!r}"
            self.heard += self.reader.feed(data)

    def dropped(self, timeout: float = 5.0) -> bool:
        """Whether the arbiter closes this connection within ``timeout``."""
        self.sock.settimeout(timeout)
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    return True
        except TimeoutError:
            return False
        except OSError:
            return True

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def domain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Domain:
    monkeypatch.setenv(ROOT_ENV, str(tmp_path / "machines"))
    return Domain.machine_wide(f"gpus-{tmp_path.name}")


@pytest.fixture
def made(domain: Domain) -> Iterator[list[Any]]:
    """Links and raw peers of a test, closed at its end."""
    things: list[Any] = []
    yield things
    for thing in reversed(things):
        thing.close()


def _link(made: list[Any], domain: Domain | None, gpus: dict[str, int] | None = None) -> MachineLink:
    link = MachineLink(domain, Policy(overhead=0), ports=PortAllocator((31000, 31009), check=lambda p: True, seed=0))
    link.attach(gpus or {"U": 16 * GiB}, lambda events: None)
    made.append(link)
    return link


def _raw(made: list[Any], domain: Domain) -> Raw:
    peer = Raw(domain.address())
    made.append(peer)
    return peer


def _server(link: MachineLink) -> ArbiterServer:
    assert link._server is not None
    return link._server


def _still_serves(made: list[Any], domain: Domain, arbiter: MachineLink) -> None:
    """The arbiter's loop lives, and a new run attaches and is granted what is free."""
    assert _server(arbiter).alive()
    second = _link(made, domain)
    assert not second.is_arbiter and second.fell_back is None
    assert second.submit("c9/k9", "c9", "gw9", "t::after", shared(GiB), ["U"])[0] == "granted"
    second.release("c9/k9")


def _attach(peer: Raw, run: str | None = None, **fields: Any) -> dict[str, Any]:
    body = {"run": run or f"{os.getuid()}.raw-{os.urandom(3).hex()}", "label": "raw", "gpus": {"U": 16 * GiB}}
    return peer.call("attach", **{**body, **fields})


def _frame_of(message: dict[str, Any]) -> bytes:
    return json.dumps(message).encode()


CRASHES: dict[str, Callable[[Raw], None]] = {
    "deep nesting": lambda p: p.send(b"[" * 200_000),
    "two 700 KB labels, then status": lambda p: (
        _attach(p, label="x" * 700_000),
        _attach(p, label="y" * 700_000),
        p.call("status"),
    ),
    "a submit naming an unknown GPU, then hang-up": lambda p: (
        _attach(p),
        p.send({"op": "submit", "key": "k", "client": "c", "request": [1, GiB, False, None], "gpus": ["GPU-X"]}),
    ),
    "ops before attach": lambda p: [p.call(op) for op in ("submit", "release", "room", "take_ports", "exited")],
    "fields of every wrong type": lambda p: (
        _attach(p),
        [
            p.call(op, key=[1], client={"a": 1}, contexts="U", gpus=7, n=True, range="x", owner=None, prefix="")
            for op in ("submit", "cancel", "abandon", "release", "set_contexts", "forget_client", "room")
        ],
        [p.call(op, n=10**9, range=[1, 2], owner="o") for op in ("take_ports", "give_back_ports")],
    ),
    "an id that is no number": lambda p: p.send({"op": "status", "id": "x"}),
    "a frame announced larger than the limit": lambda p: p.sock.sendall(b"\xff\xff\xff\xff"),
    "NaN and Infinity": lambda p: p.send(b'{"op":"submit","id":1,"request":[1,NaN,false,null]}'),
}


@pytest.mark.parametrize("attack", list(CRASHES))
def test_no_message_stops_the_arbiter_serving(domain: Domain, made: list[Any], attack: str) -> None:
    arbiter = _link(made, domain)
    assert arbiter.is_arbiter
    held = arbiter.submit("c0/k0", "c0", "gw0", "t::held", shared(4 * GiB), ["U"])
    assert held[0] == "granted"
    peer = _raw(made, domain)
    try:
        CRASHES[attack](peer)
    except (AssertionError, OSError):
        pass  # dropped on the spot: fine, as long as the arbiter goes on
    peer.close()
    wait_for(lambda: len(arbiter.status()["runs"]) == 1, what="the attacker's run detached")
    state = arbiter.status()
    assert [lease["test"] for lease in state["leases"]] == ["t::held"]
    assert [g["leased"] for g in state["gpus"]] == [4 * GiB]
    _still_serves(made, domain, arbiter)


@pytest.mark.parametrize(
    "request_, why",
    [
        ([1, -16 * GiB, False, None], "memory must be in"),
        ([1, 17 * GiB, False, None], "needs 1 GPU"),
        ([0, 0, False, None, 0, -5], "host_memory must be in"),
        ([2, GiB, False, None], "needs 2 GPUs"),
    ],
)
def test_no_request_can_make_the_arbiter_promise_memory_twice(
    domain: Domain, made: list[Any], request_: list[Any], why: str
) -> None:
    arbiter = _link(made, domain)
    peer = _raw(made, domain)
    assert _attach(peer) == {"re": 1, "ok": True}
    answer = peer.call("submit", key="k", client="c", worker="w", test="t", request=request_, gpus=["U"])
    text = answer.get("error") or answer["ok"][1]
    assert why in text
    assert all(g["leased"] == 0 for g in arbiter.status()["gpus"])
    assert arbiter.submit("c0/k0", "c0", "gw0", "t::whole", whole(), ["U"])[0] == "granted"


def test_a_key_granted_or_waiting_cannot_be_asked_again(domain: Domain, made: list[Any]) -> None:
    _link(made, domain)
    peer = _raw(made, domain)
    _attach(peer)
    ask = {"key": "k", "client": "c", "worker": "w", "test": "t", "request": [1, GiB, False, None], "gpus": ["U"]}
    assert peer.call("submit", **ask)["ok"][0] == "granted"
    again = peer.call("submit", **ask)["ok"]
    assert again == ["error", "the key 'k' is held or waited on already"]


def test_a_run_may_name_only_the_gpus_it_brought(domain: Domain, made: list[Any]) -> None:
    arbiter = _link(made, domain, {"U": 16 * GiB, "V": 16 * GiB})
    peer = _raw(made, domain)
    _attach(peer, gpus={"U": 16 * GiB})
    ask = {"key": "k", "client": "c", "worker": "w", "test": "t", "request": [1, GiB, False, None], "gpus": ["V"]}
    assert peer.call("submit", **ask)["ok"] == ["error", "GPUs the run did not bring: V"]
    peer.call("set_contexts", client="c", contexts=["V"])  # a context it has no GPU for counts nowhere
    assert [g["contexts"] for g in arbiter.status()["gpus"]] == [0, 0]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.one_of(
            st.binary(max_size=64),
            st.dictionaries(
                st.sampled_from(["op", "id", "run", "key", "client", "gpus", "request", "contexts", "n", "range"]),
                st.recursive(
                    st.none() | st.booleans() | st.integers() | st.text(max_size=12),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                    max_leaves=8,
                ),
            ).map(lambda m: {**m, "op": m.get("op", "submit")}),
            st.sampled_from(["attach", "status", "submit", "release", "take_ports", "room"]).map(
                lambda op: {"op": op, "id": 1, "run": f"{os.getuid()}.h", "gpus": {"U": 1}}
            ),
        ),
        max_size=6,
    )
)
def test_a_stream_of_anything_never_stops_the_arbiter(domain: Domain, made: list[Any], stream: list[Any]) -> None:
    if not made:
        _link(made, domain)
    arbiter: MachineLink = made[0]
    peer = Raw(domain.address())
    try:
        for item in stream:
            peer.send(item if isinstance(item, bytes) else _frame_of(item))
    except OSError:
        pass  # dropped: the arbiter closed on it
    peer.close()
    assert _server(arbiter).alive()
    probe = Raw(domain.address())
    try:
        assert "runs" in probe.call("status")["ok"]
    finally:
        probe.close()


# -- bounded resources -------------------------------------------------------------------


def test_a_user_holds_at_most_so_many_connections(domain: Domain, made: list[Any]) -> None:
    arbiter = _link(made, domain)
    peers = [_raw(made, domain) for _ in range(server_module.MAX_PEERS_PER_UID + 8)]
    wait_for(lambda: _server(arbiter).dropped["too many"] >= 8, what="connections over the cap refused")
    assert all(p.dropped(2) for p in peers[-8:])  # the last ones, refused as they came
    for peer in peers:
        peer.close()
    wait_for(lambda: len(_server(arbiter)._peers) <= 1, what="the others let go")
    _still_serves(made, domain, arbiter)


def test_unfinished_frames_are_bounded_per_user(domain: Domain, made: list[Any]) -> None:
    arbiter = _link(made, domain)
    chunk = b"x" * (900 << 10)
    peers = []
    for _ in range(12):  # 12 x 900 KiB begun: over the 8 MiB a user may hold unfinished
        peer = _raw(made, domain)
        try:
            peer.sock.sendall(struct.pack(">I", 1 << 20) + chunk)
        except OSError:
            pass  # this one was dropped while it sent
        peers.append(peer)
    wait_for(lambda: _server(arbiter).dropped["too much unfinished"] >= 1, what="a peer over the cap dropped")
    held = sum(p.reader.pending for p in _server(arbiter)._peers)
    assert held <= server_module.MAX_PENDING_PER_UID + (1 << 20)
    _still_serves(made, domain, arbiter)


def test_silent_and_half_frame_peers_are_shut_out_in_time(
    domain: Domain, made: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server_module, "HELLO_TIMEOUT_S", 0.2)
    monkeypatch.setattr(server_module, "FRAME_TIMEOUT_S", 0.3)
    arbiter = _link(made, domain)
    silent = _raw(made, domain)
    half = _raw(made, domain)
    _attach(half)
    half.sock.sendall(struct.pack(">I", 100) + b"{")
    assert silent.dropped(3) and half.dropped(3)
    assert _server(arbiter).dropped["silent"] >= 1 and _server(arbiter).dropped["half frame"] >= 1
    _still_serves(made, domain, arbiter)


def test_a_peer_that_never_reads_its_answers_is_dropped(
    domain: Domain, made: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server_module, "MAX_OUTBOX", 64 << 10)
    arbiter = _link(made, domain)
    peer = _raw(made, domain)
    peer.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    _attach(peer)
    try:
        for i in range(4000):
            peer.send({"op": "status", "id": i + 10})
    except OSError:
        pass
    wait_for(lambda: _server(arbiter).dropped["not reading"] >= 1, what="the peer that does not read dropped")
    _still_serves(made, domain, arbiter)


# -- squatters -------------------------------------------------------------------------------


def test_a_squatter_that_never_answers_leaves_runs_coordinating_among_themselves(
    domain: Domain, made: list[Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(links_module, "HELLO_TIMEOUT_S", 0.3)
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squatter.bind(domain.address())
    squatter.listen(16)
    made.append(squatter)
    first = _link(made, domain)
    second = _link(made, domain)
    assert first.fell_back and "is no usable arbiter" in first.fell_back
    assert first.domain is not None and not first.domain.wide  # its user's own domain
    assert first.is_arbiter and not second.is_arbiter  # and there the two runs coordinate
    assert first.submit("c0/k0", "c0", "gw0", "t::a", whole(), ["U"])[0] == "granted"
    assert second.submit("c0/k0", "c0", "gw0", "t::b", whole(), ["U"]) == ("queued", None)
    err = capsys.readouterr().err
    assert err.count("coordinates its GPUs with its own user's runs only") == 1  # one line, once


def test_a_squatter_that_binds_without_listening_is_found_out_too(
    domain: Domain, made: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(links_module, "ELECT_TIMEOUT_S", 0.3)
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squatter.bind(domain.address())  # bound, never listening: every connect is refused
    made.append(squatter)
    link = _link(made, domain)
    assert link.fell_back and "nothing answers" in link.fell_back
    assert link.submit("c0/k0", "c0", "gw0", "t::a", whole(), ["U"])[0] == "granted"


# -- the arbiter's own checks ---------------------------------------------------------------


def _sink(events: list[Any]) -> None:
    pass


def test_a_gpu_is_no_larger_than_the_arbiter_measures_and_an_unknown_one_is_refused() -> None:
    arbiter = Arbiter(Policy(overhead=0), truth=lambda uuids: {u: 16 * GiB for u in uuids if u == "U"})
    arbiter.attach("0.a", pid=1, user="u", label="a", gpus={"U": 1 << 45}, sink=_sink)
    assert arbiter.status()["gpus"][0]["capacity"] == 16 * GiB
    with pytest.raises(ValueError, match="GPU V is not on this machine"):
        arbiter.attach("0.b", pid=2, user="u", label="b", gpus={"V": GiB}, sink=_sink)
    assert "0.b" not in arbiter.runs


def test_leases_brought_back_after_a_failover_must_fit() -> None:
    arbiter = Arbiter(Policy(overhead=0))
    arbiter.attach("0.a", pid=1, user="u", label="a", gpus={"U": 16 * GiB}, sink=_sink)
    assert arbiter.submit("0.a", "k", "c", "w", "t", shared(12 * GiB), ["U"])[0] == "granted"
    claim = Held("k", "c", "w", "t::claims", shared(12 * GiB), ("U",), 12 * GiB, False)
    with pytest.raises(ValueError, match="does not fit on GPU U"):
        arbiter.attach("0.b", pid=2, user="u", label="b", gpus={"U": 16 * GiB}, sink=_sink, held=[claim])
    assert arbiter.allocator.gpus[0].leased == 12 * GiB
    with pytest.raises(ValueError, match="attached already"):
        arbiter.attach("0.a", pid=3, user="u", label="again", gpus={"U": 16 * GiB}, sink=_sink)


# -- ports: one machine, one set of ports --------------------------------------------------


def test_no_two_runs_hold_a_port_at_once(domain: Domain, made: list[Any]) -> None:
    a = _link(made, domain)
    b = _link(made, domain)
    got_a = a.take_ports(6, "c0/t::a@1", (31000, 31009))
    got_b = b.take_ports(4, "c0/t::b@2", (31000, 31009))
    assert not set(got_a) & set(got_b) and len(set(got_a + got_b)) == 10
    with pytest.raises(links_module.MachineError, match="only 0 of 1 ports free in 31000-31009"):
        b.take_ports(1, "c0/t::c@2", (31000, 31009))
    a.close()  # its ports go back with its run
    made.remove(a)
    assert sorted(b.take_ports(6, "c1/t::d@2", (31000, 31009))) == sorted(got_a)


# -- another user (a forked child that gave up root) -------------------------------------------


def test_another_user_sees_only_that_a_run_exists(domain: Domain, made: list[Any]) -> None:
    arbiter = _link(made, domain)
    arbiter.submit("c0/k0", "c0", "gw0", "tests/secret.py::test_secret", shared(4 * GiB), ["U"])
    arbiter.submit("c0/k1", "c0", "gw0", "tests/secret.py::test_waits", whole(), ["U"])

    def look() -> Any:
        peer = Raw(domain.address())
        return peer.call("status")["ok"]

    state = as_other_user(OTHER, look)
    assert state["runs"] == [{"user": "root", "leases": 1, "gpus": ["U"]}]
    assert state["leases"] == [] and state["waiting"] == [] and state["gpus"][0]["clients"] == []
    text = json.dumps(state)
    for private in ("secret", arbiter.run, arbiter.label):
        assert private not in text
    assert not re.search(rf"\b{os.getpid()}\b", text)  # a number of its own (pid 986 is in 17179869184)
    mine = arbiter.status()  # this user sees its own runs whole
    assert mine["runs"][0]["run"] == arbiter.run and len(mine["leases"]) == 1


def test_another_user_can_neither_be_nor_touch_a_run_of_this_user(domain: Domain, made: list[Any]) -> None:
    arbiter = _link(made, domain)
    assert arbiter.submit("c0/k0", "c0", "gw0", "t::mine", shared(4 * GiB), ["U"])[0] == "granted"
    follower = _link(made, domain)
    assert follower.submit("c1/k0", "c1", "gw1", "t::follower", shared(4 * GiB), ["U"])[0] == "granted"

    def attack() -> Any:
        peer = Raw(domain.address())
        as_them = [_attach(peer, run=run)["error"] for run in (arbiter.run, follower.run)]
        mine = _attach(peer, run=f"{OTHER}.attacker")
        for key, client in (("c0/k0", "c0"), ("c1/k0", "c1")):  # the victims' own names
            peer.send({"op": "release", "key": key})
            peer.send({"op": "abandon", "key": key})
            peer.call("forget_client", client=client)
            peer.call("exiting", client=client, contexts=["U"])
        peer.call("status")
        peer.sock.close()  # and hangs up: only its own run detaches
        return [as_them, mine]

    refused, accepted = as_other_user(OTHER, attack)
    assert all("is not of this connection's user" in why for why in refused), refused
    assert accepted["ok"] is True
    wait_for(lambda: len(arbiter.status()["runs"]) == 2, what="the attacker's run detached")
    state = arbiter.status()
    assert sorted(lease["test"] for lease in state["leases"]) == ["t::follower", "t::mine"]
    assert state["gpus"][0]["leased"] == 8 * GiB
    assert {r["run"] for r in state["runs"]} == {arbiter.run, follower.run}


def test_another_users_arbiter_is_told_no_names(domain: Domain, made: list[Any]) -> None:
    """Another user's process holds the address and speaks the protocol: it is used, but
    learns no command, directory, test or worker of this user's run."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as another user")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child: a minimal arbiter of another user
        try:
            os.setgroups([])
            os.setgid(OTHER)
            os.setuid(OTHER)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(domain.address())
            listener.listen(4)
            os.write(write, b"ready")
            conn, _ = listener.accept()
            reader, seen = FrameReader(MAX_REPLY), []
            while len(seen) < 3:
                data = conn.recv(65536)
                if not data:
                    break
                for message in reader.feed(data):
                    seen.append(message)
                    if "id" in message:
                        ok: Any = True if message["op"] == "attach" else ["queued", None]
                        if message["op"] == "take_ports":
                            ok = {"ports": [31001]}
                        conn.sendall(encode({"re": message["id"], "ok": ok}))
            os.write(write, json.dumps(seen).encode())
        finally:
            os._exit(0)
    os.close(write)
    assert os.read(read, 5) == b"ready"
    link = MachineLink(domain, Policy(overhead=0), label="pytest -k secret in /home/me/secret-project")
    link.attach({"U": 16 * GiB}, lambda events: None)
    made.append(link)
    assert not link.is_arbiter and link.fell_back is None
    assert link.submit("c0/k0", "c0", "gw0", "tests/secret.py::test_secret", whole(), ["U"]) == ("queued", None)
    assert link.take_ports(1, "c0/tests/secret.py::test_secret@12", (31000, 31009)) == [31001]
    with os.fdopen(read, "rb") as pipe:
        seen = json.loads(pipe.read())
    os.waitpid(pid, 0)
    text = json.dumps(seen)
    assert "secret" not in text and "gw0" not in text and "/home/me" not in text, text
    assert [m["op"] for m in seen] == ["attach", "submit", "take_ports"]
    assert seen[1]["test"] == "" and seen[2]["owner"].startswith("c0/#")


def test_users_take_turns_so_a_flood_delays_only_its_sender(
    domain: Domain, made: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server_module, "TURN_BYTES_PER_UID", 4 << 10)
    arbiter = _link(made, domain)
    server = _server(arbiter)
    turns: list[Counter[int]] = []
    read, turn = server._read, server._turn

    def counted_turn() -> None:
        turns.append(Counter())
        turn()

    def counted_read(peer: Any) -> int:
        got = read(peer)
        turns[-1][peer.uid] += got
        return got

    monkeypatch.setattr(server, "_read", counted_read)
    monkeypatch.setattr(server, "_turn", counted_turn)
    server._wake()  # the loop takes the counted turn from now on
    flooders = [_raw(made, domain) for _ in range(8)]
    burst = b"".join(struct.pack(">I", 40) + b'{"op":"x","id":1,"pad":"' + b"y" * 14 + b'"}' for _ in range(2000))
    for flooder in flooders:
        flooder.sock.sendall(burst)  # 8 x 88 KiB of requests, queued at once

    def ask() -> Any:
        return Raw(domain.address()).call("status")["ok"] is not None

    assert as_other_user(OTHER, ask)  # another user is answered meanwhile
    wait_for(lambda: sum(t[os.getuid()] for t in turns) >= 8 * len(burst), what="the flood read")
    # no turn read more of one user than its share and one last read
    assert max(t[os.getuid()] for t in turns) <= (4 << 10) + 65536
    _still_serves(made, domain, arbiter)


def test_an_arbiter_that_cannot_measure_the_gpus_takes_the_first_word_and_never_a_larger_one() -> None:
    arbiter = Arbiter(Policy(overhead=0), truth=lambda uuids: None)  # no NVML in the arbiter's process
    arbiter.attach("0.a", pid=1, user="u", label="a", gpus={"U": 16 * GiB, "V": 8 * GiB}, sink=_sink)
    arbiter.attach("0.b", pid=2, user="u", label="b", gpus={"U": 1 << 45}, sink=_sink)
    assert [g["capacity"] for g in arbiter.status()["gpus"]] == [16 * GiB, 8 * GiB]


def test_a_user_whose_messages_took_its_share_of_the_arbiter_waits_for_the_next_second(
    domain: Domain, made: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server_module, "SECONDS_PER_UID_S", 1e-9)  # any message uses it up
    arbiter = _link(made, domain)
    server = _server(arbiter)
    server._window = 3600.0  # this "second" lasts until the test ends it
    flooder = _raw(made, domain)
    assert "ok" in flooder.call("status")  # its share of this second, used up (any message takes more)
    # the server counts a message's time once it has answered it: the answer may come first
    deadline = time.monotonic() + patience(5)
    while not server._throttled(os.getuid()) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert server._throttled(os.getuid())

    def ask() -> Any:
        started = time.monotonic()
        answer = Raw(domain.address()).call("status")
        return [answer.get("ok") is not None, time.monotonic() - started]

    answered, took = as_other_user(OTHER, ask)
    assert answered and took < 0.5  # another user is read at once
    flooder.send({"op": "status", "id": 99})
    flooder.sock.settimeout(0.3)
    with pytest.raises(socket.timeout):  # not read, not answered: it waits for its next second
        flooder.sock.recv(1)
    flooder.sock.settimeout(5)
    server._window = 0.0
    server._wake()
    assert "ok" in flooder.call("status")  # once its next second came


def test_a_preference_crosses_the_wire_and_is_checked_there(domain: Domain, made: list[Any]) -> None:
    """The GPUs a run's scheduler planned reach the arbiter of another run, which honours them
    where the request fits and ignores (and counts) a preference that does not suit it."""
    gpus = {"A": 16 * GiB, "B": 16 * GiB}
    first = _link(made, domain, gpus)
    second = _link(made, domain, gpus)
    assert first.is_arbiter and not second.is_arbiter
    assert first._arbiter is not None
    kind, body = second.submit("c0/k0", "c0", "gw0", "t::a", shared(GiB), ["A", "B"], ["B"])
    assert (kind, body["gpus"]) == ("granted", ["B"])  # its own rule: A (as many contexts, the lower index)
    kind, body = second.submit("c1/k0", "c1", "gw1", "t::b", shared(GiB), ["A", "B"], ["A", "B"])
    assert (kind, body["gpus"]) == ("granted", ["A"])  # two GPUs for a one-GPU request: ignored
    assert first._arbiter.preferences_ignored == 1
    assert "t::b" in str(first._arbiter.preference_ignored) and "request of 1" in str(first._arbiter.preference_ignored)
    kind, body = second.submit("c2/k0", "c2", "gw2", "t::c", shared(GiB), ["A", "B"], ["GPU-X"])
    assert kind == "granted" and first._arbiter.preferences_ignored == 2  # a GPU the run did not bring
    for bad in ("B", [7], ["B"] * 1000):
        with pytest.raises(WireError, match="prefer"):
            messages.preference({"prefer": bad})


# -- an arbiter whose answers and events are not what the protocol says ------------------------


def _fake(made: list[Any], domain: Domain, **kwargs: Any) -> FakeArbiter:
    fake = FakeArbiter(domain.address(), **kwargs)
    made.append(fake)
    return fake


def _follower(made: list[Any], domain: Domain, events: list[Any] | None = None) -> MachineLink:
    link = MachineLink(domain, Policy(overhead=0))
    link.attach({"U": 16 * GiB}, (events.append if events is not None else lambda events: None))
    made.append(link)
    assert not link.is_arbiter and link.fell_back is None  # the fake is its arbiter
    return link


GARBLED = "is no usable arbiter: the machine's arbiter sent what its protocol does not allow"


def test_an_answer_that_is_not_what_the_protocol_says_is_a_machine_error_and_the_arbiter_is_left(
    domain: Domain, made: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """A peer answering ``room`` with ``null`` (a run once took it in, and crashed with a
    TypeError): the run says so once, coordinates with its own user's runs from then on,
    and the call is answered there."""
    fake = _fake(made, domain, answers={"room": lambda m: None})
    link = _follower(made, domain)
    assert link.room(["U"]) == [16 * GiB]  # answered by the run's own arbiter
    assert link.fell_back is not None and GARBLED in link.fell_back
    assert "its answer to 'room' must be a list of at most 256" in link.fell_back
    assert link.domain is not None and not link.domain.wide  # its user's own domain now
    assert fake.seen == ["attach", "room"]
    err = capsys.readouterr().err
    assert err.count(GARBLED) == 1 and "coordinates its GPUs with its own user's runs only" in err


def test_a_grant_missing_a_field_is_asked_again_of_the_runs_own_arbiter(domain: Domain, made: list[Any]) -> None:
    _fake(made, domain, answers={"submit": lambda m: ["granted", {"memory": GiB, "exclusive": False}]})
    link = _follower(made, domain)
    kind, body = link.submit("c0/k0", "c0", "gw0", "t::a", shared(GiB), ["U"])  # at its own arbiter
    assert (kind, body["gpus"]) == ("granted", ["U"])
    assert link.fell_back is not None and "a grant lacks 'gpus'" in link.fell_back


def test_an_event_that_is_not_what_the_protocol_says_leaves_the_arbiter_and_the_request_is_served(
    domain: Domain, made: list[Any]
) -> None:
    bad = {"ev": [["granted", "c0/k0", {"gpus": "U", "memory": GiB, "exclusive": False}]]}
    _fake(made, domain, events={"submit": [bad]})
    events: list[Any] = []
    link = _follower(made, domain, events)
    assert link.submit("c0/k0", "c0", "gw0", "t::a", shared(GiB), ["U"]) == ("queued", None)
    # the run leaves that arbiter and brings its request to its own, which grants it
    wait_for(lambda: events, what="the request granted by the run's own arbiter")
    [[(kind, key, body)]] = events
    assert (kind, key, body["gpus"]) == ("granted", "c0/k0", ["U"])
    assert link.fell_back is not None and "a grant's gpus must be a list" in link.fell_back


def test_a_roster_that_is_not_what_the_protocol_says_leaves_the_arbiter(domain: Domain, made: list[Any]) -> None:
    _fake(made, domain, events={"attach": [{"roster": [["1.x", "pid"]], "arbiter": ""}]})
    link = MachineLink(domain, Policy(overhead=0))
    link.attach({"U": 16 * GiB}, lambda events: None)
    made.append(link)
    wait_for(lambda: link.fell_back is not None, what="the run to leave the arbiter")
    assert "an item of roster must be an integer, got str" in link.fell_back
    assert link.domain is not None and not link.domain.wide
    assert link.submit("c0/k0", "c0", "gw0", "t::a", whole(), ["U"])[0] == "granted"
