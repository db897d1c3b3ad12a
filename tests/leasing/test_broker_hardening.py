"""The broker's handshake cannot be held up by a local process that connects and stalls.

A connection authenticates (multiprocessing.connection's key challenge) without blocking
the accept thread and off the serving one, within ``handshake_timeout``; one that sends
nothing, half a frame or a wrong answer is dropped on its own, and however many of them
there are, a client with the key does not wait behind them. Every wait here is bounded: a
regression fails, it never hangs the suite.
"""

from __future__ import annotations

import json
import os
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from pathlib import Path
from typing import Any

import pytest

import pytest_gpu.wire.server as broker_module
from pytest_gpu.base.requests import GpuRequest
from pytest_gpu.leasing.broker import Broker
from pytest_gpu.leasing.client import BrokerClient, BrokerError, Grant
from pytest_gpu.leasing.protocol import MAX_FRAME
from pytest_gpu.machine.placement import Policy
from pytest_gpu.wire.frames import decode, encode
from pytest_gpu.wire.handshake import FAILURE, authenticate

GiB = 2**30
SERVED_WITHIN = 1.0  # seconds: far below the default handshake timeout (5 s)
WHOLE = GpuRequest(count=1, memory=None, exclusive=True)
Stall = Callable[[socket.socket, bytes], None]


class Stalled:
    """Broker, raw sockets and clients of one test, all closed at its end (raw sockets first,
    so that even a broker that blocks on them lets go)."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.authkey = os.urandom(16)
        self.raw: list[socket.socket] = []
        self.clients: list[BrokerClient] = []
        self.broker: Broker | None = None

    def start(self, **kwargs: float) -> Broker:
        address = str(self.tmp_path / "b.sock")
        assert len(address) < 100, "Unix socket paths are limited to 108 bytes"
        self.broker = Broker({0: 16 * GiB, 1: 16 * GiB}, address, self.authkey, Policy(overhead=0), **kwargs).start()
        return self.broker

    def connect_raw(self) -> socket.socket:
        assert self.broker is not None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(2)  # connect() waits while the listen backlog is full
        self.raw.append(sock)
        sock.connect(self.broker.address)
        sock.settimeout(10)
        return sock

    def client(self, worker: str, authkey: bytes | None = None) -> BrokerClient:
        assert self.broker is not None
        client = BrokerClient(self.broker.address, authkey or self.authkey, worker)
        self.clients.append(client)
        return client

    def close(self) -> None:
        for sock in self.raw:
            sock.close()
        for client in self.clients:
            client.close()
        if self.broker is not None:
            self.broker.close()


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Stalled]:
    made = Stalled(tmp_path)
    yield made
    made.close()


def in_time(run: Stalled, worker: str, seconds: float = SERVED_WITHIN, authkey: bytes | None = None) -> object:
    """Connect a real client and have it acquire and release a GPU, in a thread; return what
    it got (a Grant or the exception) if that took at most ``seconds``, else fail."""
    result: list[object] = []
    done = threading.Event()

    def work() -> None:
        try:
            client = run.client(worker, authkey)
            grant = client.acquire(WHOLE, f"t::{worker}", timeout=5)
            client.release(grant.key)
            result.append(grant)
        except BaseException as exc:
            result.append(exc)
        finally:
            done.set()

    started = time.monotonic()
    threading.Thread(target=work, daemon=True).start()
    assert done.wait(seconds), f"{worker} was not served within {seconds:g}s (the handshake is blocked)"
    assert time.monotonic() - started <= seconds + 0.1
    return result[0]


def read_frame(sock: socket.socket) -> bytes:
    """One multiprocessing.connection frame (4-byte big-endian length, then the bytes)."""
    header = recv_exactly(sock, 4)
    (size,) = struct.unpack("!i", header)
    return recv_exactly(sock, size)


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "the broker closed the connection"
        data += chunk
    return data


def eof_within(sock: socket.socket, seconds: float) -> float:
    """Read until the broker closes ``sock``; return how long that took (fail after ``seconds``)."""
    started = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        pytest.fail(f"the broker did not close the stalled connection within {seconds:g}s")
    except ConnectionResetError:
        pass
    return time.monotonic() - started


# -- (1) a silent connection ---------------------------------------------------------------


def test_a_silent_connection_does_not_block_the_next_client(run: Stalled) -> None:
    broker = run.start()
    run.connect_raw()  # connects, sends nothing, stays
    assert isinstance(in_time(run, "gw0"), Grant)
    assert isinstance(in_time(run, "gw1"), Grant)  # and the one after it too
    assert len(broker._handshakes) == 1  # the silent one is still pending: nobody waited for its timeout
    assert [c["worker"] for c in broker.status()["clients"].values()] == ["gw0", "gw1"]


def test_many_silent_connections_do_not_block_a_client(run: Stalled) -> None:
    run.start()
    for _ in range(20):
        run.connect_raw()
    assert isinstance(in_time(run, "gw0"), Grant)


# -- (2) half a frame, then a stall ------------------------------------------------------


def half_header(sock: socket.socket, authkey: bytes) -> None:
    sock.sendall(b"\x00\x00")  # two bytes of the four-byte length of the challenge's answer


def half_answer(sock: socket.socket, authkey: bytes) -> None:
    read_frame(sock)  # the broker's challenge
    sock.sendall(struct.pack("!i", 16) + b"\x01\x02\x03")  # an answer of 16 bytes, 3 sent


def blocking_conn(sock: socket.socket) -> Connection:
    """``sock`` as a multiprocessing Connection (blocking reads, each bounded by 10 s)."""
    sock.setblocking(True)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 10, 0))
    return Connection(os.dup(sock.fileno()))


def answer_then_nothing(sock: socket.socket, authkey: bytes) -> None:
    """Answers the broker's challenge rightly, then never sends its own (the second half)."""
    conn = blocking_conn(sock)
    try:
        answer_challenge(conn, authkey)
    finally:
        conn.close()


@pytest.mark.parametrize("stall", [half_header, half_answer, answer_then_nothing])
def test_half_a_handshake_does_not_block_the_next_client(run: Stalled, stall: Stall) -> None:
    broker = run.start()
    sock = run.connect_raw()
    stall(sock, run.authkey)
    assert isinstance(in_time(run, "gw0"), Grant)
    assert [c["worker"] for c in broker.status()["clients"].values()] == ["gw0"]


# -- (3) the stalled connection is closed at the deadline ----------------------------------


@pytest.mark.parametrize("stall", [None, half_header, half_answer, answer_then_nothing])
def test_a_stalled_handshake_is_closed_after_the_timeout(run: Stalled, stall: Stall | None) -> None:
    broker = run.start(handshake_timeout=0.5)
    sock = run.connect_raw()
    connected = time.monotonic()
    if stall is not None:
        stall(sock, run.authkey)
    eof_within(sock, 5.0)
    assert time.monotonic() - connected >= 0.4, "closed before its deadline"
    assert not broker._handshakes
    assert broker.status()["clients"] == {}  # never became a client
    assert isinstance(in_time(run, "gw0"), Grant)  # and the broker still works


def test_a_client_that_takes_a_little_time_is_still_accepted(run: Stalled) -> None:
    broker = run.start(handshake_timeout=2.0)
    sock = run.connect_raw()
    time.sleep(0.3)  # within its deadline
    conn = blocking_conn(sock)
    try:
        answer_challenge(conn, run.authkey)  # what multiprocessing.connection.Client does
        deliver_challenge(conn, run.authkey)
        conn.send_bytes(json.dumps({"op": "hello", "id": 1, "worker": "slow", "pid": 0}).encode())
        assert conn.poll(5), "no reply to hello"
        assert json.loads(conn.recv_bytes()) == {"re": 1, "ok": {"client": "c0"}}
        assert [c["worker"] for c in broker.status()["clients"].values()] == ["slow"]
    finally:
        conn.close()


# -- (4) strangers holding every handshake they can ----------------------------------------

KEYLESS = """
import os, selectors, socket, sys
address, n = sys.argv[1], int(sys.argv[2])
parent = os.getppid()
selector = selectors.DefaultSelector()
owed, told = n, False
while os.getppid() == parent:  # gone with the test
    while owed:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(address)
        except OSError:  # the backlog is full: again in a moment
            sock.close()
            break
        selector.register(sock, selectors.EVENT_READ)
        owed -= 1
    if not owed and not told:
        print("ready", flush=True)
        told = True
    for key, _ in selector.select(0.001 if owed else 0.1):
        try:
            data = key.fileobj.recv(4096)  # the challenge: read, never answered
        except OSError:
            data = b""
        if not data:  # dropped: straight back in
            selector.unregister(key.fileobj)
            key.fileobj.close()
            owed += 1
"""
STRANGERS_TIMEOUT = 60.0  # the handshake timeout in these tests: a slot held by a stranger frees only then
SERVED_BESIDE_STRANGERS = 10.0  # seconds: generous for a loaded machine, and far below that timeout


@pytest.fixture
def keyless(run: Stalled) -> Iterator[Callable[[int], subprocess.Popen[str]]]:
    """Start a process (not this one) that holds ``n`` connections to the broker, each
    stalled in its handshake and made again as soon as the broker drops it."""
    procs: list[subprocess.Popen[str]] = []

    def start(n: int) -> subprocess.Popen[str]:
        assert run.broker is not None
        proc = subprocess.Popen(
            [sys.executable, "-c", KEYLESS, run.broker.address, str(n)], stdout=subprocess.PIPE, text=True
        )
        procs.append(proc)
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready and proc.stdout.readline() == "ready\n", "the keyless process did not connect"
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def wait_for(condition: Callable[[], bool], seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_keyless_connections_holding_handshakes_do_not_delay_a_client(
    run: Stalled, keyless: Callable[[int], subprocess.Popen[str]]
) -> None:
    """96 connections stalled in their handshake (more than the 64 the broker once had
    slots for), made again whenever dropped: a client with the key connects and gets a
    lease at once, not when a stranger's handshake times out."""
    broker = run.start(handshake_timeout=STRANGERS_TIMEOUT)
    keyless(96)
    assert wait_for(lambda: len(broker._handshakes) >= 64), "the stalled handshakes did not start"
    for worker in ("gw0", "gw1", "gw2"):
        assert isinstance(in_time(run, worker, seconds=SERVED_BESIDE_STRANGERS), Grant)
    assert sorted(c["worker"] for c in broker.status()["clients"].values()) == ["gw0", "gw1", "gw2"]


def test_beyond_the_bound_a_stranger_is_shut_out_not_the_client(
    run: Stalled, keyless: Callable[[int], subprocess.Popen[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stalled connections filling the bound and the backlog behind it (no longer than the
    bound, as by default), each made again as soon as it is dropped, so that the broker
    shuts one out for every one it accepts: the handshakes stay within the bound, and a
    client with the key still connects and gets a lease, long before any timeout."""
    monkeypatch.setattr(broker_module, "MAX_HANDSHAKES", 8)
    monkeypatch.setattr(broker_module, "BACKLOG", 8)
    broker = run.start(handshake_timeout=STRANGERS_TIMEOUT)
    keyless(16)
    assert wait_for(lambda: len(broker._handshakes) >= 8), "the stalled handshakes did not start"
    for worker in ("gw0", "gw1"):
        assert isinstance(in_time(run, worker, seconds=SERVED_BESIDE_STRANGERS), Grant)
        assert len(broker._handshakes) <= 8
    assert sorted(c["worker"] for c in broker.status()["clients"].values()) == ["gw0", "gw1"]


def test_room_is_made_from_handshakes_that_have_not_answered(run: Stalled, monkeypatch: pytest.MonkeyPatch) -> None:
    """At the bound, the oldest connection that has owed the answer to the broker's
    challenge for a while is shut out for a new one; one that answered (it has the key) is
    not."""
    monkeypatch.setattr(broker_module, "MAX_HANDSHAKES", 3)
    broker = run.start(handshake_timeout=STRANGERS_TIMEOUT)
    answered = run.connect_raw()
    answer_then_nothing(answered, run.authkey)
    silent = [run.connect_raw(), run.connect_raw()]
    assert wait_for(lambda: len(broker._handshakes) == 3)
    assert isinstance(in_time(run, "gw0", seconds=SERVED_BESIDE_STRANGERS), Grant)
    eof_within(silent[0], 5.0)  # the oldest that had not answered made room
    assert len(broker._handshakes) == 2  # the one that answered and the younger silent one wait on
    read_frame(silent[1])  # its challenge, and then
    for sock in (answered, silent[1]):
        sock.settimeout(0.2)
        with pytest.raises(TimeoutError):
            sock.recv(4096)  # no EOF: still under way


def test_clients_beyond_the_bound_wait_their_turn_and_none_is_shut_out(
    run: Stalled, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Clients with the key, more at once than the bound: each answers within a round trip,
    long before it could be shut out, and all of them are served."""
    monkeypatch.setattr(broker_module, "MAX_HANDSHAKES", 2)
    broker = run.start(handshake_timeout=STRANGERS_TIMEOUT)
    got: list[object] = []
    threads = [
        threading.Thread(target=lambda i=i: got.append(in_time(run, f"gw{i}", seconds=SERVED_BESIDE_STRANGERS)))
        for i in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(SERVED_BESIDE_STRANGERS + 5)
    assert len(got) == 8 and all(isinstance(g, Grant) for g in got), got
    assert len(broker.status()["clients"]) == 8


def test_close_ends_pending_handshakes_and_removes_the_socket(run: Stalled) -> None:
    broker = run.start()
    sock = run.connect_raw()
    started = time.monotonic()
    broker.close()
    assert time.monotonic() - started < 2.0
    eof_within(sock, 2.0)
    assert not os.path.exists(broker.address)
    assert wait_no_auth_threads(), "a handshake thread outlived the broker"


def wait_no_auth_threads(timeout: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(t.name == "pytest-gpu-auth" for t in threading.enumerate()):
            return True
        time.sleep(0.01)
    return False


# -- (5) a wrong key ---------------------------------------------------------------------


def test_wrong_key_is_refused_promptly_and_disturbs_no_one(run: Stalled) -> None:
    broker = run.start()
    holder = run.client("gw0")
    held = holder.acquire(WHOLE, "t::held", timeout=5)
    run.connect_raw()  # a silent connection is pending meanwhile
    for i in range(3):
        refused = in_time(run, f"intruder{i}", authkey=b"not the key")
        assert isinstance(refused, BrokerError)
        assert str(refused).startswith(f"cannot reach the pytest-gpu broker at {broker.address}: ")
    # the client that was there keeps its lease and its connection
    assert [row["test"] for row in broker.status()["leases"]] == ["t::held"]
    second = holder.acquire(WHOLE, "t::second", timeout=5)
    assert second.indices != held.indices
    holder.release(second.key)
    assert isinstance(in_time(run, "gw1"), Grant)
    assert sorted(c["worker"] for c in broker.status()["clients"].values()) == ["gw0", "gw1"]
    assert broker.crashes == []


# -- (6) what a client with the key sends is checked too --------------------------------------


def keyed_raw(run: Stalled) -> socket.socket:
    """A raw connection that proved the key (as a client does), then says what a test tells it."""
    sock = run.connect_raw()
    sock.setblocking(True)
    authenticate(sock, run.authkey)
    return sock


@pytest.mark.parametrize(
    "frame",
    [
        struct.pack(">I", 9) + b"not json!",
        struct.pack(">I", 12) + b'{"op":NaN}  ',
        struct.pack(">I", 2) + b"[]",
        struct.pack(">I", MAX_FRAME + 1),  # announced larger than a broker takes
    ],
    ids=["not json", "NaN", "not an object", "oversized"],
)
def test_a_frame_that_is_no_message_shuts_its_sender_out(run: Stalled, frame: bytes) -> None:
    broker = run.start()
    holder = run.client("gw0")
    held = holder.acquire(WHOLE, "t::held", timeout=5)
    sock = keyed_raw(run)
    sock.sendall(frame)
    eof_within(sock, 5.0)
    assert broker.dropped["bad frame"] == 1
    assert [row["test"] for row in broker.status()["leases"]] == ["t::held"]  # the others go on
    holder.release(held.key)
    assert isinstance(in_time(run, "gw1"), Grant)


def test_a_message_that_is_not_what_the_protocol_says_is_refused(run: Stalled) -> None:
    run.start()
    sock = keyed_raw(run)

    def said(message: dict[str, Any]) -> dict[str, Any]:
        sock.sendall(encode(message))
        return decode(read_frame(sock))

    assert said({"op": "hello", "id": 1, "worker": "raw", "pid": 0}) == {"re": 1, "ok": {"client": "c0"}}
    for bad, why in [
        ({"op": "acquire", "id": 2, "key": "k", "request": [1, -1, False, None], "test": "t"}, "memory must be in"),
        ({"op": "acquire", "id": 3, "key": "k", "request": [1, None, True, None]}, "'acquire' lacks 'test'"),
        ({"op": "ports", "id": 4, "n": "2", "owner": "o"}, "n must be an integer, got str"),
        ({"op": "status", "id": 5, "verbose": True}, "'status' has no field 'verbose'"),
        ({"op": "contexts", "id": 6, "indices": [0]}, "unknown op 'contexts'"),  # report_contexts: gone
        ({"op": "test", "id": 7, "nodeid": "t"}, "unknown op 'test'"),  # set_test: gone
    ]:
        answer = said(bad)
        assert answer["re"] == bad["id"] and why in answer["error"], (bad, answer)
    assert said({"op": "status", "id": 8})["ok"]["leases"] == []  # the connection is still in step


def test_a_client_that_says_anything_before_hello_is_shut_out(run: Stalled) -> None:
    broker = run.start()
    sock = keyed_raw(run)
    sock.sendall(encode({"op": "status", "id": 1}))
    eof_within(sock, 5.0)
    assert broker.status()["clients"] == {}


def test_a_message_without_the_key_is_never_read(run: Stalled) -> None:
    broker = run.start()
    sock = run.connect_raw()
    read_frame(sock)  # the broker's challenge; the message comes where its answer belongs
    sock.sendall(encode({"op": "hello", "id": 1, "worker": "intruder", "pid": 0}))
    assert read_frame(sock) == FAILURE
    eof_within(sock, 5.0)
    assert broker.status()["clients"] == {} and not broker._handshakes
