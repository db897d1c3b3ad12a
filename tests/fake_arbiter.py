"""A stand-in for the machine's arbiter: a thread at a domain's address that speaks the
arbiter's frames by hand, answering each op well-formed unless told to answer something
else, and sending events after the ops it is told to (tests/machine/test_arbiter_hardening.py,
tests/machine/test_garbled_arbiter.py). It binds the address first, so a run that comes after it
attaches to it as its arbiter."""

from __future__ import annotations

import fcntl
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

from pytest_gpu.wire.frames import MAX_REPLY, FrameReader, WireError, encode
from pytest_gpu.wire.sockets import listen

GiB = 2**30
STATUS = {"runs": [], "gpus": [], "leases": [], "waiting": [], "grants": 0}
Answer = Callable[[dict[str, Any]], Any]

# a well-formed answer to each op
DEFAULTS: dict[str, Answer] = {
    "attach": lambda m: True,
    "status": lambda m: STATUS,
    "submit": lambda m: ["queued", None],
    "cancel": lambda m: None,
    "forget_client": lambda m: [],
    "measure_context": lambda m: False,
    "room": lambda m: [16 * GiB for _ in m.get("gpus", [])],
    "take_ports": lambda m: {"refused": "no ports here"},
    "give_back_ports": lambda m: [],
    "give_back_ports_prefix": lambda m: [],
}


class FakeArbiter:
    """``answers``: op -> the answer's value (a callable of the message); ``events``: op ->
    the frames sent after answering it. ``lock``: a private domain's lock file, held (the
    election's other half). :attr:`seen`: the ops, in order."""

    def __init__(
        self,
        address: str,
        answers: dict[str, Answer] | None = None,
        events: dict[str, list[dict[str, Any]]] | None = None,
        lock: str | None = None,
    ) -> None:
        self.answers = {**DEFAULTS, **(answers or {})}
        self.events = events or {}
        self.seen: list[str] = []
        self._lock_fd = -1
        if lock is not None:
            self._lock_fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.address = address
        self.listener = listen(address, 16)
        self.listener.setblocking(True)
        self.conns: list[socket.socket] = []
        self._closing = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closing:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        reader = FrameReader(MAX_REPLY)
        try:
            while True:
                data = conn.recv(65536)
                if not data:
                    return
                for message in reader.feed(data):
                    op = message.get("op", "?")
                    self.seen.append(op)
                    if "id" in message:
                        answer = self.answers.get(op, lambda m: None)(message)
                        conn.sendall(encode({"re": message["id"], "ok": answer}, MAX_REPLY))
                    for event in self.events.get(op, []):
                        conn.sendall(encode(event, MAX_REPLY))
        except (OSError, WireError):
            return

    def close(self) -> None:
        self._closing = True
        for sock in [self.listener, *self.conns]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        if not self.address.startswith("\0"):
            try:
                os.unlink(self.address)
            except OSError:
                pass
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
