"""A run's connection to the arbiter in another process: calls, one-way tells, its events.

The other end of :mod:`.server`. One reader thread per connection files each answer with
the call that waits for it and hands events (``{"ev": ...}``) to the link; a call that gets
no answer within ``CALL_TIMEOUT_S`` fails with :class:`MachineError`, one whose connection
closes meanwhile raises :class:`Lost` (the link then elects again, see :mod:`.link`).
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
from collections.abc import Callable
from typing import Any

from .arbiter import Event
from .wire import FrameReader, WireError, encode

CALL_TIMEOUT_S = 60.0  # an arbiter that holds its lock but does not answer (SIGSTOP) fails the call


class MachineError(RuntimeError):
    """The machine's arbiter cannot be reached or answered with an error."""


class Lost(Exception):
    """The arbiter's connection closed while a call waited for its answer."""


class Remote:
    """A connection to the arbiter in another process."""

    def __init__(
        self, address: str, on_frame_events: Callable[[list[Event]], None], on_lost: Callable[[Remote], None]
    ) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.connect(address)
        except OSError:
            self.sock.close()
            raise
        self._on_events = on_frame_events
        self._on_lost = on_lost
        self._ids = itertools.count(1)
        self._send_lock = threading.Lock()
        self._calls: dict[int, list[Any]] = {}  # id -> [threading.Event, reply]
        self._calls_lock = threading.Lock()
        self.lost = False
        self.closing = False
        self._thread = threading.Thread(target=self._read_loop, name="pytest-gpu-machine-link", daemon=True)
        self._thread.start()

    def _read_loop(self) -> None:
        reader = FrameReader()
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    break
                for message in reader.feed(data):
                    if "ev" in message:
                        self._on_events([(str(k), str(key), body) for k, key, body in message["ev"]])
                        continue
                    with self._calls_lock:
                        waiter = self._calls.pop(int(message.get("re", -1)), None)
                    if waiter is not None:
                        waiter[1] = message
                        waiter[0].set()
        except (OSError, WireError, ValueError, TypeError):
            pass
        self.lost = True
        with self._calls_lock:
            waiters, self._calls = list(self._calls.values()), {}
        for waiter in waiters:
            waiter[0].set()  # reply stays None: lost
        if not self.closing:
            self._on_lost(self)

    def _send(self, message: dict[str, Any]) -> None:
        data = encode(message)
        with self._send_lock:
            self.sock.sendall(data)

    def call(self, op: str, **fields: Any) -> Any:
        if self.lost:
            raise Lost()
        rid = next(self._ids)
        waiter: list[Any] = [threading.Event(), None]
        with self._calls_lock:
            self._calls[rid] = waiter
        try:
            self._send({"op": op, "id": rid, **fields})
        except OSError as exc:
            with self._calls_lock:
                self._calls.pop(rid, None)
            raise Lost() from exc
        if not waiter[0].wait(CALL_TIMEOUT_S):
            with self._calls_lock:
                self._calls.pop(rid, None)
            raise MachineError(
                f"pytest-gpu: the machine's arbiter did not answer {op!r} within {CALL_TIMEOUT_S:g}s "
                "(its process is stopped or overloaded; `pytest-gpu status` names the runs)"
            )
        reply = waiter[1]
        if reply is None:
            raise Lost()
        if "error" in reply:
            raise MachineError(f"the machine's arbiter refused {op!r}: {reply['error']}")
        return reply.get("ok")

    def tell(self, op: str, **fields: Any) -> None:
        """One-way: no answer is awaited (a lost message is covered by the mirror)."""
        try:
            self._send({"op": op, **fields})
        except OSError:
            pass

    def close(self) -> None:
        self.closing = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
