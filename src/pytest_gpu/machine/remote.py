"""A run's connection to the arbiter in another process: calls, one-way tells, its events.

The other end of :mod:`.server`. One reader thread per connection files each answer with
the call that waits for it and hands events (``{"ev": ...}``) to the link; a call that gets
no answer within its timeout fails with :class:`MachineError`, one whose connection
closes meanwhile raises :class:`Lost` (the link then elects again, see :mod:`.link`).

The process that answers is who the kernel says it is (``SO_PEERCRED``, read at connect:
:attr:`Remote.peer_uid`); the link decides whether to trust it. What it sends is checked
before use: a frame that is not a well-formed answer or event ends the connection.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

from ..wire.frames import MAX_REPLY, FrameReader, WireError, encode
from ..wire.sockets import peer_credentials, reachable
from .arbiter import Event

TIMEOUT_ENV = "PYTEST_GPU_ARBITER_TIMEOUT"


def _seconds(value: str | None, default: float) -> float:
    try:
        seconds = float(value) if value else default
    except ValueError:
        return default
    return seconds if 0 < seconds < float("inf") else default


# an arbiter that holds the address but does not answer (SIGSTOP) fails the call, not the run
CALL_TIMEOUT_S = _seconds(os.environ.get(TIMEOUT_ENV), 60.0)
CONNECT_TIMEOUT_S = 5.0


class MachineError(RuntimeError):
    """The machine's arbiter cannot be reached or answered with an error."""


class Lost(Exception):
    """The arbiter's connection closed while a call waited for its answer."""


def _events(raw: Any) -> list[Event]:
    if not isinstance(raw, list):
        raise WireError("events must be a list")
    events = []
    for row in raw:
        if not (isinstance(row, list) and len(row) == 3 and isinstance(row[0], str) and isinstance(row[1], str)):
            raise WireError("an event must be [kind, key, body]")
        if not isinstance(row[2], dict):
            raise WireError("an event's body must be an object")
        events.append((row[0], row[1], row[2]))
    return events


def _roster(raw: Any) -> list[tuple[str, int]]:
    if not isinstance(raw, list):
        raise WireError("a roster must be a list")
    runs = []
    for row in raw:
        if not (isinstance(row, list) and len(row) == 2 and isinstance(row[0], str) and isinstance(row[1], int)):
            raise WireError("a roster's row must be [run, pid]")
        runs.append((row[0], row[1]))
    return runs


class Remote:
    """A connection to the arbiter in another process."""

    def __init__(
        self,
        address: str,
        on_frame_events: Callable[[list[Event]], None],
        on_lost: Callable[[Remote], None],
        on_roster: Callable[[list[tuple[str, int]]], None] = lambda runs: None,
    ) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.settimeout(CONNECT_TIMEOUT_S)
            with reachable(address) as where:
                self.sock.connect(where)
            self.sock.settimeout(None)
        except OSError:
            self.sock.close()
            raise
        self.peer_pid, self.peer_uid = peer_credentials(self.sock)
        self._on_events = on_frame_events
        self._on_lost = on_lost
        self._on_roster = on_roster
        self._ids = itertools.count(1)
        self._send_lock = threading.Lock()
        self._calls: dict[int, list[Any]] = {}  # id -> [threading.Event, reply]
        self._calls_lock = threading.Lock()
        self.lost = False
        self.closing = False
        self._thread = threading.Thread(target=self._read_loop, name="pytest-gpu-machine-link", daemon=True)
        self._thread.start()

    def _read_loop(self) -> None:
        reader = FrameReader(MAX_REPLY)
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    break
                for message in reader.feed(data):
                    if "ev" in message:
                        self._on_events(_events(message["ev"]))
                        continue
                    if "roster" in message:
                        # the arbiter's own run goes with its socket: it never comes back to a new one
                        arbiter = message.get("arbiter")
                        self._on_roster([(r, p) for r, p in _roster(message["roster"]) if r != arbiter])
                        continue
                    rid = message.get("re")
                    if not isinstance(rid, int) or isinstance(rid, bool):
                        raise WireError("an answer must name its call")
                    with self._calls_lock:
                        waiter = self._calls.pop(rid, None)
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

    def call(self, op: str, timeout: float | None = None, **fields: Any) -> Any:
        """``op``'s answer; :class:`MachineError` when refused or not answered within
        ``timeout`` (default ``CALL_TIMEOUT_S``), :class:`Lost` when the connection closed."""
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
        except WireError as exc:
            with self._calls_lock:
                self._calls.pop(rid, None)
            raise MachineError(f"pytest-gpu: {op!r} cannot be sent to the machine's arbiter: {exc}") from None
        limit = CALL_TIMEOUT_S if timeout is None else timeout
        if not waiter[0].wait(limit):
            with self._calls_lock:
                self._calls.pop(rid, None)
            raise MachineError(
                f"pytest-gpu: the machine's arbiter did not answer {op!r} within {limit:g}s "
                "(its process is stopped or overloaded; `pytest-gpu status` names the runs)"
            )
        reply = waiter[1]
        if reply is None:
            raise Lost()
        if "error" in reply:
            raise MachineError(f"the machine's arbiter refused {op!r}: {str(reply['error'])[:500]}")
        return reply.get("ok")

    def tell(self, op: str, **fields: Any) -> None:
        """One-way: no answer is awaited (a lost message is covered by the mirror)."""
        try:
            self._send({"op": op, **fields})
        except (OSError, WireError):
            pass

    def close(self) -> None:
        self.closing = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
