"""The messages between a pool and its ranks: each side handles every kind it may get, and
names any other, or one whose fields are not what the protocol says, as a protocol error
(pools with ranks that are threads at the other end of the pool's socket, no process)."""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from helpers import patience
from pytest_gpu.base.distspec import DistSettings, DistSpec
from pytest_gpu.distributed import protocol
from pytest_gpu.distributed.pool import PoolError, RankPool
from pytest_gpu.distributed.rankmain import Rank
from wired_ranks import Answer, body, connect, rank_client

GLOO2 = DistSpec(world_size=2, backend="gloo", gpus_per_rank=0, launcher="spawn")


@pytest.fixture
def make_pool(tmp_path: Path) -> Iterator[Callable[[Answer], RankPool]]:
    """A pool whose ranks are threads answering each message as ``answer(rank, kind, body)`` says."""
    pools: list[RankPool] = []

    def make(answer: Answer) -> RankPool:
        run = SimpleNamespace(client=None)  # no port, no lease: nothing to give back
        pool = RankPool(GLOO2, run, DistSettings(grace=1.0, init_timeout=5.0), tmp_path, 10.0)  # type: ignore[arg-type]
        pool.dir.mkdir(parents=True, exist_ok=True)
        pools.append(pool)
        connect(pool, answer)
        return pool

    yield make
    for pool in pools:
        pool.close(graceful=False)


def test_a_failed_setup_is_the_start_s_failure_at_once(make_pool: Callable[[Answer], RankPool]) -> None:
    """Rank 0 cannot set up while rank 1 is still at it (it would wait for rank 0 at the
    rendezvous): the start fails with rank 0's error, without waiting for rank 1."""

    def answer(rank: int, kind: str, body: dict[str, Any]) -> protocol.Message | None:
        assert kind == protocol.SETUP and body["config_args"] == ["-x"]
        if rank == 0:
            return (protocol.SETUP_FAILED, {"rank": rank, "error": "Traceback: no NCCL"})
        time.sleep(3)  # still setting up, long after rank 0's failure
        return (protocol.READY, {"rank": rank})

    started = time.monotonic()
    with pytest.raises(PoolError) as failed:
        make_pool(answer)._set_up(["-x"])
    assert time.monotonic() - started < 2.5  # not the 3 s rank 1 takes (nor the 5 s init timeout)
    text = str(failed.value)
    head = "could not set up 2 ranks (gloo via spawn):\nrank 0:\nTraceback: no NCCL\n"
    assert text.startswith(head + "rank 1 had not finished setting up then\n"), text


def test_a_rank_that_dies_setting_up_is_named(make_pool: Callable[[Answer], RankPool]) -> None:
    def answer(rank: int, kind: str, body: dict[str, Any]) -> protocol.Message | None:
        return (protocol.READY, {"rank": rank}) if rank == 0 else None

    with pytest.raises(PoolError) as failed:
        make_pool(answer)._set_up([])
    text = str(failed.value)
    assert "rank 1:\nit died while setting up: pid None is gone (launched by spawn" in text
    assert "rank 0:" not in text


def test_every_rank_ready_is_a_started_pool(make_pool: Callable[[Answer], RankPool]) -> None:
    make_pool(lambda rank, kind, body: (protocol.READY, {"rank": rank}))._set_up([])


def test_an_unknown_setup_reply_is_a_protocol_error(make_pool: Callable[[Answer], RankPool]) -> None:
    def answer(rank: int, kind: str, body: dict[str, Any]) -> protocol.Message:
        return (protocol.READY, {"rank": 0}) if rank == 0 else ("readyish", {"rank": 1})

    with pytest.raises(PoolError) as failed:
        make_pool(answer)._set_up([])
    text = str(failed.value)
    assert "rank 1:\nprotocol error: rank 1 sent 'readyish' where only 'ready' or 'setup-failed' may come" in text
    assert "rank 0:" not in text


def test_an_unknown_reply_to_a_test_fails_it_and_breaks_the_pool(make_pool: Callable[[Answer], RankPool]) -> None:
    def answer(rank: int, kind: str, body: dict[str, Any]) -> protocol.Message:
        assert kind == protocol.RUN
        if rank == 1:
            return ("resolt", {"rank": 1})
        return (protocol.RESULT, {"rank": 0, "outcome": "passed", "message": "", "run_id": body["run_id"]})

    result = make_pool(answer).run_test(body(), 5.0)
    assert list(result.results) == [0]
    assert result.problems == [
        "protocol error: rank 1 sent 'resolt' where only 'result' may come "
        "(pool and rank out of step, or not the same pytest-gpu); the pool was killed"
    ]
    assert result.broken and result.outcome == "failed"


def test_a_rank_that_died_during_a_test_is_named(make_pool: Callable[[Answer], RankPool]) -> None:
    def answer(rank: int, kind: str, body: dict[str, Any]) -> protocol.Message | None:
        if rank == 1:
            return None
        return (protocol.RESULT, {"rank": 0, "outcome": "passed", "message": "", "run_id": body["run_id"]})

    result = make_pool(answer).run_test(body(), 5.0)
    assert result.problems == [
        "rank 1 died during the test: pid None is gone (launched by spawn; exit status not visible)"
    ]
    assert result.broken


def test_health_replies_each_have_their_meaning(make_pool: Callable[[Answer], RankPool]) -> None:
    def answer(rank: int, kind: str, body: dict[str, Any]) -> protocol.Message:
        assert kind == protocol.CHECK and body == {"timeout": 1.0}
        return (protocol.CHECKED, {"rank": rank, "ok": True, "detail": ""})

    assert make_pool(answer)._health() == (True, "")

    def unhealthy(rank: int, kind: str, body: dict[str, Any]) -> protocol.Message:
        if rank == 0:
            return (protocol.CHECKED, {"rank": 0, "ok": False, "detail": "barrier timed out"})
        return ("checkd", {"rank": 1})

    ok, detail = make_pool(unhealthy)._health()
    assert not ok
    assert sorted(detail.split("; ")) == [
        "rank 0: barrier timed out",
        "rank 1: protocol error: rank 1 sent 'checkd' where only 'checked' may come "
        "(pool and rank out of step, or not the same pytest-gpu)",
    ]


def _connecting(tmp_path: Path, *messages: tuple[str, dict[str, Any]]) -> tuple[RankPool, list[Any]]:
    """A pool whose ranks connect, each connection saying one of ``messages`` first, in order."""
    pool = RankPool(GLOO2, SimpleNamespace(client=None), DistSettings(init_timeout=5.0), tmp_path, 10.0)  # type: ignore[arg-type]
    pool.dir.mkdir(parents=True)
    address, authkey = pool._listen()
    assert pool.server is not None
    clients = []
    for sent, (kind, fields) in enumerate(messages, 1):
        clients.append(rank_client(address, authkey))
        clients[-1].tell(kind, fields)
        deadline = time.monotonic() + patience(5)
        while pool.server.arrivals.qsize() < sent and time.monotonic() < deadline:  # in this order
            time.sleep(0.005)
    return pool, clients


def test_an_unknown_first_message_of_a_connection_fails_the_start(tmp_path: Path) -> None:
    hello = (protocol.HELLO, {"rank": 0, "pid": 11, "pgid": 11})
    pool, clients = _connecting(tmp_path, hello, (protocol.LIFELINE, {"rank": 0}), ("helo", {"rank": 1}))
    try:
        with pytest.raises(PoolError) as failed:
            pool._gather()
        assert str(failed.value).startswith(
            "could not start 2 ranks (gloo via spawn): protocol error: a connecting rank sent 'helo' "
            "where only 'hello' or 'lifeline' may come"
        )
        assert list(pool.conns) == [0] and pool.pids == {0: 11} and len(pool.lifelines) == 1
    finally:
        pool.pids.clear()  # not a process of this test's to kill
        pool.close(graceful=False)
        for client in clients:
            client.close()


def test_a_first_message_that_is_not_what_the_protocol_says_fails_the_start(tmp_path: Path) -> None:
    pool, clients = _connecting(tmp_path, (protocol.HELLO, {"rank": "0", "pid": 11, "pgid": 11}))
    try:
        with pytest.raises(PoolError) as failed:
            pool._gather()
        assert str(failed.value).startswith(
            "could not start 2 ranks (gloo via spawn): protocol error: a connecting rank sent a 'hello' that is "
            "not what the protocol says (rank must be an integer, got str)"
        )
        assert pool.conns == {}
    finally:
        pool.close(graceful=False)
        for client in clients:
            client.close()


def test_a_reply_that_is_not_what_the_protocol_says_fails_the_test(make_pool: Callable[[Answer], RankPool]) -> None:
    def answer(rank: int, kind: str, body: dict[str, Any]) -> protocol.Message:
        outcome = "passed" if rank == 0 else "pased"
        return (protocol.RESULT, {"rank": rank, "outcome": outcome, "message": "", "run_id": body["run_id"]})

    result = make_pool(answer).run_test(body(), 5.0)
    assert list(result.results) == [0]
    (problem,) = result.problems
    assert problem.startswith("protocol error: rank 1 sent a 'result' that is not what the protocol says (outcome ")
    assert result.broken and result.outcome == "failed"


def test_a_test_bodys_arguments_travel_pickled_and_opaque(make_pool: Callable[[Answer], RankPool]) -> None:
    seen: list[Any] = []

    def answer(rank: int, kind: str, body: dict[str, Any]) -> protocol.Message:
        seen.append(body["kwargs"])
        return (protocol.RESULT, {"rank": rank, "outcome": "passed", "message": "", "run_id": body["run_id"]})

    sent = dict(body(), kwargs=pickle.dumps({"x": (1, 2)}))
    assert make_pool(answer).run_test(sent, 5.0).outcome == "passed"
    assert seen == [sent["kwargs"]] * 2  # bytes again at the rank, unpickled by it alone


# -- the rank's side -----------------------------------------------------------------------------


class Wire:
    """The rank's connection: what the pool sent, then nothing more (closed); what the rank answered."""

    def __init__(self, *sent: protocol.Message) -> None:
        self.sent, self.answered = list(sent), list[protocol.Message]()

    def receive(self) -> protocol.Message:
        if not self.sent:
            raise ConnectionResetError("the pool's end closed")
        return self.sent.pop(0)

    def tell(self, kind: str, body: dict[str, Any]) -> None:
        self.answered.append((kind, body))


def _rank(wire: Wire) -> Rank:
    """A Rank that set up nothing: only its side of the conversation."""
    rank = Rank.__new__(Rank)
    rank.rank, rank.conn = 1, wire  # type: ignore[assignment]
    rank.setup = lambda body: None  # type: ignore[method-assign]
    return rank


def test_the_rank_answers_setup_check_and_close_in_order() -> None:
    wire = Wire((protocol.SETUP, {}), (protocol.CHECK, {"timeout": 2.0}), (protocol.CLOSE, {}))
    rank = _rank(wire)
    rank.check = lambda timeout: (timeout == 2.0, "")  # type: ignore[method-assign]
    rank.close = lambda: None  # type: ignore[method-assign]
    rank.serve()  # returns after CLOSE
    assert wire.answered == [
        (protocol.READY, {"rank": 1}),
        (protocol.CHECKED, {"rank": 1, "ok": True, "detail": ""}),
        (protocol.CLOSED, {"rank": 1}),
    ]


def test_the_rank_refuses_an_unknown_message_instead_of_ignoring_it() -> None:
    wire = Wire((protocol.SETUP, {}), ("rn", {}))
    with pytest.raises(protocol.ProtocolError, match="the pool sent 'rn' where only 'run' or 'check' or 'close' may"):
        _rank(wire).serve()
    assert wire.answered == [(protocol.READY, {"rank": 1})]


def test_the_rank_expects_setup_first() -> None:
    with pytest.raises(protocol.ProtocolError, match="the pool sent 'run' where only 'setup' may come"):
        _rank(Wire((protocol.RUN, {}))).serve()


def test_the_kinds_on_the_wire_are_unchanged() -> None:
    # a pool and ranks of the same run always share this module, but the names are the wire format
    kinds = [protocol.HELLO, protocol.LIFELINE, protocol.SETUP, protocol.READY, protocol.SETUP_FAILED]
    kinds += [protocol.RUN, protocol.RESULT, protocol.CHECK, protocol.CHECKED, protocol.CLOSE, protocol.CLOSED]
    assert kinds == "hello lifeline setup ready setup-failed run result check checked close closed".split()
    assert protocol.DIED not in kinds


def test_the_rank_refuses_a_message_that_is_not_what_the_protocol_says(tmp_path: Path) -> None:
    pool, clients = _connecting(tmp_path, (protocol.HELLO, {"rank": 1, "pid": 1, "pgid": 1}))
    assert pool.server is not None
    try:
        peer, kind, _ = pool.server.arrivals.get(timeout=5)
        assert kind == protocol.HELLO
        rank = Rank.__new__(Rank)
        rank.rank, rank.conn = 1, clients[0]
        pool.server.tell(peer, protocol.RUN, {"nodeid": "t", "kwargs": "not base64!"})
        with pytest.raises(protocol.ProtocolError, match=r"^protocol error: the rank pool sent what its protocol"):
            rank._receive()  # nothing of it is unpickled
    finally:
        pool.close(graceful=False)
        for client in clients:
            client.close()
