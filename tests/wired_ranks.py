"""Ranks that are threads at the other end of a pool's real socket (no process): the pool's
side of its protocol, over the wire it uses (tests/distributed/test_distributed_protocol.py,
tests/compat/test_compat_timeout.py)."""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable
from typing import Any

from pytest_gpu.distributed import protocol
from pytest_gpu.distributed.pool import RankPool
from pytest_gpu.wire.client import Client

# what a rank thread answers a message of the pool: a message to send back (or several), or None (it dies)
Answer = Callable[[int, str, dict[str, Any]], "protocol.Message | list[protocol.Message] | None"]


def rank_client(address: str, authkey: bytes) -> Client:
    return protocol.connect(address, authkey)


def connect(pool: RankPool, answer: Answer) -> None:
    """Start ``pool``'s server and one thread per rank that connects (control connection and
    lifeline, as a rank does) and answers as ``answer`` says; the pool has every rank then.
    The threads' pids are not the pool's to signal or kill: it knows none (``pids`` empty)."""
    address, authkey = pool._listen()
    for rank in range(pool.spec.world_size):
        conn, lifeline = rank_client(address, authkey), rank_client(address, authkey)
        conn.tell(protocol.HELLO, {"rank": rank, "pid": 1, "pgid": 1})
        lifeline.tell(protocol.LIFELINE, {"rank": rank})
        threading.Thread(target=_serve, args=(rank, conn, lifeline, answer), daemon=True).start()
    pool._gather()
    pool.pids.clear()


def _serve(rank: int, conn: Client, lifeline: Client, answer: Answer) -> None:
    try:
        while True:
            found = conn.receive()
            assert found is not None
            reply = answer(rank, *found)
            if reply is None:
                return  # the rank died: both its connections close
            for kind, fields in reply if isinstance(reply, list) else [reply]:
                conn.tell(kind, fields)
    except OSError:
        return
    finally:
        conn.close()
        lifeline.close()


def body(nodeid: str = "t") -> dict[str, Any]:
    """A test body as the runner sends it (``runner._payload``), of a test that is no function."""
    return {
        "module_file": "test_x.py",
        "module_name": "test_x",
        "cls": "",
        "func": "test",
        "kwargs": b"",
        "seed": zlib.crc32(nodeid.encode()),
        "nodeid": nodeid,
        "tbstyle": "auto",
    }
