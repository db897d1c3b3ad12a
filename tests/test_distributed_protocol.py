"""The messages between a pool and its ranks: each side handles every kind it may get, and
names any other as a protocol error (pools with ranks at the other end of pipes, no process)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, Pipe
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pytest_gpu.base.distspec import DistSettings, DistSpec
from pytest_gpu.distributed import protocol
from pytest_gpu.distributed.pool import PoolError, RankPool
from pytest_gpu.distributed.rankmain import Rank

GLOO2 = DistSpec(world_size=2, backend="gloo", gpus_per_rank=0, launcher="spawn")
Answer = Callable[[int, str, dict[str, Any]], "protocol.Message | None"]


@pytest.fixture
def make_pool(tmp_path: Path) -> Iterator[Callable[[Answer], RankPool]]:
    """A pool whose ranks are threads answering each message as ``answer(rank, kind, body)`` says."""
    pools: list[RankPool] = []

    def make(answer: Answer) -> RankPool:
        run = SimpleNamespace(client=None)  # no port, no lease: nothing to give back
        pool = RankPool(GLOO2, run, DistSettings(grace=1.0, init_timeout=5.0), tmp_path, 10.0)  # type: ignore[arg-type]
        for rank in range(GLOO2.world_size):
            ours, theirs = Pipe()
            pool.conns[rank] = ours
            threading.Thread(target=_serve, args=(rank, theirs, answer), daemon=True).start()
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close(graceful=False)


def _serve(rank: int, conn: Connection, answer: Answer) -> None:
    try:
        while True:
            kind, body = conn.recv()
            reply = answer(rank, kind, body)
            if reply is None:
                conn.close()  # the rank died
                return
            conn.send(reply)
    except (EOFError, OSError):
        return


def test_setup_replies_each_have_their_meaning(make_pool: Callable[[Answer], RankPool]) -> None:
    def answer(rank: int, kind: str, body: dict[str, Any]) -> protocol.Message | None:
        assert kind == protocol.SETUP and body["config_args"] == ["-x"]
        if rank == 0:
            return (protocol.SETUP_FAILED, {"rank": rank, "error": "Traceback: no NCCL"})
        return None

    with pytest.raises(PoolError) as failed:
        make_pool(answer)._set_up(["-x"])
    text = str(failed.value)
    assert text.startswith("could not set up 2 ranks (gloo via spawn):\nrank 0:\nTraceback: no NCCL\nrank 1:\n")
    assert "rank 1:\nit died while setting up: pid None is gone (launched by spawn" in text


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

    result = make_pool(answer).run_test({"nodeid": "t"}, 5.0)
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

    result = make_pool(answer).run_test({"nodeid": "t"}, 5.0)
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


def test_an_unknown_first_message_of_a_connection_fails_the_start(make_pool: Callable[[Answer], RankPool]) -> None:
    pool = make_pool(lambda rank, kind, body: None)
    pool.conns.clear()
    arrivals: queue.Queue[tuple[protocol.Message, Connection]] = queue.Queue()
    ours, _theirs = Pipe()
    arrivals.put(((protocol.HELLO, {"rank": 0, "pid": 11, "pgid": 11}), ours))
    arrivals.put(((protocol.LIFELINE, {"rank": 0}), Pipe()[0]))
    arrivals.put((("helo", {"rank": 1}), Pipe()[0]))
    with pytest.raises(PoolError) as failed:
        pool._gather(arrivals)
    assert str(failed.value).startswith(
        "could not start 2 ranks (gloo via spawn): protocol error: a connecting rank sent 'helo' "
        "where only 'hello' or 'lifeline' may come"
    )
    assert pool.conns == {0: ours} and pool.pids == {0: 11} and len(pool.lifelines) == 1


# -- the rank's side -----------------------------------------------------------------------------


class Wire:
    """The rank's connection: what the pool sent, then nothing more (EOF); what the rank answered."""

    def __init__(self, *sent: protocol.Message) -> None:
        self.sent, self.answered = list(sent), list[protocol.Message]()

    def recv(self) -> protocol.Message:
        if not self.sent:
            raise EOFError  # the pool's end closed
        return self.sent.pop(0)

    def send(self, message: protocol.Message) -> None:
        self.answered.append(message)


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
