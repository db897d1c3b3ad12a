"""The one wire (pytest_gpu.wire): schemas, the server loop and the client, on a toy protocol.

Each protocol's own tests (the broker's, the arbiter's, a pool's, a node host's) are with
them; here is what every protocol gets from the wire: a message checked on arrival both
ways, JSON's lossy spots undone, a peer that says what its protocol does not allow told so
or shut out, and a socket reachable whatever the length of its path.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from multiprocessing import AuthenticationError
from pathlib import Path
from typing import Any

import pytest

from helpers import wait_for
from pytest_gpu.wire import handshake
from pytest_gpu.wire.client import Client, Closed, Garbled, NoAnswer
from pytest_gpu.wire.frames import WireError, decode, encode
from pytest_gpu.wire.schema import (
    Blob,
    Bool,
    Call,
    Dict,
    Float,
    Int,
    IntKey,
    List,
    Obj,
    Opt,
    Protocol,
    Refused,
    Row,
    Str,
    StrKey,
    Tagged,
    blob,
)
from pytest_gpu.wire.server import Bounds, KeyAuth, Peer, PeerAuth, Server
from pytest_gpu.wire.sockets import connect, listen

# -- schemas -----------------------------------------------------------------------------------

LEASE = Obj(
    {"indices": List(Int(0, 64)), "bytes": Dict(IntKey(0, 64), Int())},
    {"row": Row(Int(), Str(10), names=("n", "who")), "note": Opt(Str(20))},
    {"note": None},
    name="a lease",
)


def test_a_message_comes_back_as_the_program_uses_it() -> None:
    sent = {"indices": (3, 1), "bytes": {3: 5, 1: 7}, "row": (1, "t")}
    arrived = decode(encode(sent)[4:])  # tuples became lists, integer keys strings
    assert arrived == {"indices": [3, 1], "bytes": {"3": 5, "1": 7}, "row": [1, "t"]}
    assert LEASE.check(arrived, "") == {"indices": [3, 1], "bytes": {3: 5, 1: 7}, "row": (1, "t"), "note": None}
    assert LEASE.check(sent, "") == LEASE.check(arrived, "")  # execnet's plain values read the same


@pytest.mark.parametrize(
    "value, why",
    [
        ({"indices": [1], "bytes": {}, "extra": 1}, "a lease has no field 'extra'"),
        ({"indices": [1]}, "a lease lacks 'bytes'"),
        ({"indices": [True], "bytes": {}}, "an item of a lease's indices must be an integer, got bool"),
        ({"indices": [65], "bytes": {}}, r"must be in \[0, 64\], got 65"),
        ({"indices": [1], "bytes": {"x": 1}}, "a key of a lease's bytes must be an integer, got str"),
        ({"indices": [1], "bytes": {"-1": 1}}, "a key of a lease's bytes must be an integer"),
        ({"indices": [1], "bytes": {}, "row": [1]}, r"a lease's row must be \[n, who\]"),
        ({"indices": [1], "bytes": {}, "row": [1, "x" * 11]}, "a lease's row is longer than 10 characters"),
        ({"indices": "1", "bytes": {}}, "a lease's indices must be a list"),
        ([], "a lease must be an object"),
    ],
)
def test_a_message_that_is_not_what_its_schema_says_is_named(value: Any, why: str) -> None:
    with pytest.raises(WireError, match=why):
        LEASE.check(value, "")


def test_numbers_flags_tags_and_bytes() -> None:
    with pytest.raises(WireError, match="must be a number"):
        Float().check("1", "t")
    with pytest.raises(WireError, match="must be in"):
        Float(0, 10).check(float("nan"), "t")
    assert Float().check(3, "t") == 3.0
    with pytest.raises(WireError, match="true or false"):
        Bool().check(1, "b")
    tagged = Tagged({"granted": Obj({"n": Int()}), "queued": Opt(Int())})
    assert tagged.check(["granted", {"n": 1}], "a") == ("granted", {"n": 1})
    with pytest.raises(WireError, match="must be one of granted, queued"):
        tagged.check(["gramted", {}], "a")
    data = bytes(range(256))
    assert Blob().check(blob(data), "b") == data
    with pytest.raises(WireError, match="not base64"):
        Blob().check("not base64!", "b")
    with pytest.raises(WireError, match="at most 4 bytes"):
        Blob(4).check(blob(b"12345678"), "b")
    assert Dict(StrKey(Str(3)), Int()).check({"abc": 1}, "d") == {"abc": 1}


# -- a toy service over the one wire --------------------------------------------------------

TOY = Protocol(
    "the toy service",
    calls={
        "hello": Call(Obj({"name": Str(20)}), Obj({"id": Int()})),
        "lease": Call(Obj({"n": Int(0, 8)}), LEASE),
        "room": Call(Obj(), List(Int(), 8)),
        "note": Call(Obj({"text": Str(100)})),
        "say": Call(Obj({"what": Str(100)}), Opt(Str(100))),
    },
    events={"granted": Obj({"key": Str(10)}), "roster": Obj({"runs": List(Str(10))})},
)


class Toy(Server):
    protocol = TOY
    thread_prefix = "pytest-gpu-toy"

    def __init__(self, address: str, auth: Any, bounds: Bounds | None = None) -> None:
        super().__init__(address, auth, bounds)
        self.notes: list[str] = []
        self.room: Any = [1, 2]  # what "room" answers: a test makes it garbage
        self.gone: list[str] = []

    def on_hello(self, peer: Peer, m: dict[str, Any]) -> dict[str, int]:
        peer.data = m["name"]
        return {"id": 7}

    def on_lease(self, peer: Peer, m: dict[str, Any]) -> dict[str, Any]:
        if m["n"] == 0:
            raise Refused("none at all")
        if m["n"] == 1:
            raise KeyError("a bug")
        return {"indices": list(range(m["n"])), "bytes": {i: 1 << 30 for i in range(m["n"])}}

    def on_room(self, peer: Peer, m: dict[str, Any]) -> Any:
        return self.room

    def on_note(self, peer: Peer, m: dict[str, Any]) -> None:
        self.notes.append(m["text"])

    def on_say(self, peer: Peer, m: dict[str, Any]) -> Any:
        if m["what"].startswith("event:"):
            self.send(peer, {"op": m["what"][6:], "key": "k"})
        elif m["what"] == "late":
            time.sleep(0.3)
        return m["what"]

    def disconnected(self, peer: Peer, why: str) -> None:
        self.gone.append(why)


@pytest.fixture
def short(tmp_path: Path) -> Path:
    return tmp_path


@pytest.fixture
def made() -> Iterator[list[Any]]:
    things: list[Any] = []
    yield things
    for thing in reversed(things):
        thing.close()


def _toy(made: list[Any], address: str, auth: Any | None = None, **bounds: Any) -> Toy:
    server = Toy(address, auth or PeerAuth(), Bounds(**bounds) if bounds else None).start()
    made.append(server)
    return server


def _client(made: list[Any], address: str, **kwargs: Any) -> Client:
    client = Client(address, TOY, **kwargs)
    made.append(client)
    return client


def test_calls_answers_errors_and_one_way_messages(made: list[Any], short: Path) -> None:
    server = _toy(made, str(short / "t.sock"))
    client = _client(made, server.address)
    assert client.call("hello", {"name": "c"}) == {"id": 7}
    assert client.call("lease", {"n": 2}) == {"indices": [0, 1], "bytes": {0: 1 << 30, 1: 1 << 30}, "note": None}
    with pytest.raises(Refused, match=r"^none at all$"):
        client.call("lease", {"n": 0})
    with pytest.raises(Refused, match=r"^KeyError: 'a bug'$"):
        client.call("lease", {"n": 1})
    with pytest.raises(Refused, match=r"^WireError: n must be in"):
        client.call("lease", {"n": 9})  # checked at the server
    with pytest.raises(Refused, match="'lease' has no field 'm'"):
        client.call("lease", {"n": 2, "m": 3})
    client.tell("note", {"text": "one-way"})
    assert client.call("say", {"what": "after"}) == "after"  # in order: the note came first
    assert server.notes == ["one-way"]
    assert client.peer_pid == os.getpid() and client.peer_uid == os.getuid()


@pytest.mark.parametrize(
    "answer, why",
    [
        (None, "its answer to 'room' must be a list of at most 8 items"),
        ([1, "2"], "an item of its answer to 'room' must be an integer, got str"),
        (list(range(9)), "must be a list of at most 8 items"),
    ],
)
def test_an_answer_that_is_not_what_the_protocol_says_ends_the_connection(
    made: list[Any], short: Path, answer: Any, why: str
) -> None:
    server = _toy(made, str(short / "t.sock"))
    client = _client(made, server.address)
    server.room = answer
    with pytest.raises(Garbled, match=f"^the toy service sent what its protocol does not allow: .*{why}"):
        client.call("room")
    assert client.garbled is not None and why in client.garbled
    with pytest.raises(Garbled):  # out of step: nothing more is read from it
        client.call("say", {"what": "x"})
    wait_for(lambda: server.gone == ["closed"], what="the server to see the connection end")


def test_an_event_is_checked_too_and_a_bad_one_ends_the_connection(made: list[Any], short: Path) -> None:
    server = _toy(made, str(short / "t.sock"))
    events: list[tuple[str, Any]] = []
    client = _client(made, server.address, on_event=lambda kind, body: events.append((kind, body)))
    assert client.call("say", {"what": "event:granted"}) == "event:granted"
    assert events == [("granted", {"key": "k"})]
    with pytest.raises(Garbled, match="an event 'nonsense', which is none of granted, roster"):
        client.call("say", {"what": "event:nonsense"})
    assert events == [("granted", {"key": "k"})]


def test_a_threaded_client_hands_events_over_and_fails_waiting_calls(made: list[Any], short: Path) -> None:
    server = _toy(made, str(short / "t.sock"))
    events: list[str] = []
    lost: list[str] = []
    client = _client(
        made,
        server.address,
        on_event=lambda kind, body: events.append(kind),
        on_lost=lambda c: lost.append(str(c.garbled)),
        threaded=True,
    )
    assert client.call("say", {"what": "event:granted"}, timeout=5) == "event:granted"
    assert events == ["granted"]
    with pytest.raises(NoAnswer):
        client.call("say", {"what": "late"}, timeout=0.05)
    assert client.call("say", {"what": "next"}, timeout=5) == "next"  # the late answer was skipped
    with pytest.raises(Garbled):
        client.call("say", {"what": "event:bad"}, timeout=5)
    wait_for(lambda: bool(lost), what="the reader thread to end")
    assert "an event 'bad'" in lost[0]


def test_a_peer_that_sends_what_is_no_frame_of_json_is_shut_out(made: list[Any], short: Path) -> None:
    server = _toy(made, str(short / "t.sock"), max_request=1024)
    for raw in (b"\xff\xfe not json", b"[" * 100, b'{"op":"note","text":NaN}', b"[1]", b"x" * 2000):
        sock = connect(server.address, 5)
        sock.sendall(struct.pack(">I", len(raw)) + raw)
        sock.settimeout(5)
        assert sock.recv(100) == b"", raw[:20]  # closed, unanswered
        sock.close()
    assert server.dropped["bad frame"] == 5
    assert _client(made, server.address).call("say", {"what": "still here"}) == "still here"


def test_a_message_before_the_key_is_never_read(made: list[Any], short: Path) -> None:
    key = os.urandom(16)
    server = _toy(made, str(short / "t.sock"), KeyAuth(key, timeout=0.5))
    sock = connect(server.address, 5)
    sock.sendall(encode({"op": "note", "text": "no key"}))  # where the answer to the challenge belongs
    sock.settimeout(5)
    while sock.recv(4096):  # the challenge, then the refusal: closed
        pass
    sock.close()
    with pytest.raises(Exception, match="digest"):
        Client(server.address, TOY, key=b"another key")
    good = _client(made, server.address, key=key)
    good.tell("note", {"text": "with the key"})
    assert good.call("say", {"what": "x"}) == "x"
    assert server.notes == ["with the key"]


def test_a_client_never_reads_a_server_that_cannot_prove_the_key(short: Path) -> None:
    """The key's challenge goes both ways: a server without the key (a squatter at the
    address) that takes the client's answer is still refused, before the client reads a
    message from it."""
    listener = listen(str(short / "fake.sock"), 4)

    def impostor() -> None:
        listener.setblocking(True)
        conn, _ = listener.accept()
        with conn:
            blocking = handshake._Blocking(conn)
            blocking.send_bytes(handshake.new_challenge(b"its own key"))
            blocking.recv_bytes()  # the client's answer, taken whatever it is
            blocking.send_bytes(handshake.WELCOME)
            challenge = blocking.recv_bytes()  # the client's own challenge
            blocking.send_bytes(handshake.answer(b"its own key", challenge))
            with contextlib.suppress(OSError):  # the client refused it: gone
                blocking.send_bytes(encode({"op": "granted", "key": "k"})[4:])  # never read
                conn.recv(4096)

    thread = threading.Thread(target=impostor, daemon=True)
    thread.start()
    with pytest.raises(AuthenticationError, match="digest received was wrong"):
        Client(str(short / "fake.sock"), TOY, key=b"the run's key", timeout=5)
    thread.join(5)
    listener.close()


def test_the_answer_to_a_call_given_up_on_is_skipped(made: list[Any], short: Path) -> None:
    server = _toy(made, str(short / "t.sock"))
    client = _client(made, server.address)
    with pytest.raises(NoAnswer):
        client.call("say", {"what": "late"}, timeout=0.05)
    assert client.call("say", {"what": "next"}) == "next"


def test_a_closed_connection_is_closed_for_every_caller(made: list[Any], short: Path) -> None:
    server = _toy(made, str(short / "t.sock"))
    client = _client(made, server.address)
    client.call("say", {"what": "x"})
    server.close()
    with pytest.raises(Closed):
        client.call("say", {"what": "y"})
    assert client.lost is not None


# -- sockets of any length ----------------------------------------------------------------------


def test_a_socket_is_reachable_however_deep_its_directory(made: list[Any], tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60) / ("f" * 60)
    deep.mkdir(parents=True)
    address = str(deep / "toy.sock")
    assert len(address) > 200
    with pytest.raises(OSError, match="AF_UNIX path too long"):
        socket.socket(socket.AF_UNIX).bind(address)  # as it is, it cannot be
    server = _toy(made, address, KeyAuth(b"k" * 16))
    assert os.path.exists(address) and oct(os.stat(address).st_mode & 0o777) == "0o600"
    assert _client(made, address, key=b"k" * 16).call("say", {"what": "deep"}) == "deep"
    server.close()
    assert not os.path.exists(address)
