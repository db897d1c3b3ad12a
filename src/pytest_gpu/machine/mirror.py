"""What a run holds and waits for, kept by the run itself so that it survives its arbiter.

A run that is not the arbiter (a follower) keeps this mirror of its own leases, requests
and contexts, in step with the arbiter's answers and events. When the arbiter goes away
(:mod:`.link` fails over), the run brings the mirror to the new arbiter's ``attach``:
the leases are taken over as they were and the requests queued again, in their order.

An event for a request whose ``submit`` is still on its way (``inflight``) is held back
(``early``) until the answer came, so the mirror never sees a grant before its request.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from .arbiter import Event
from .messages import Asked, Held, request_to_wire


@dataclass(frozen=True)
class Snapshot:
    """What a run brings to a new arbiter's ``attach``."""

    held: list[Held]
    asked: list[Asked]
    contexts: dict[str, list[str]]  # client -> GPUs where its process has contexts
    exiting: dict[str, list[str]]  # the same, of clients gone whose processes have not exited yet
    ports: dict[int, str]  # port -> owner
    left: dict[str, dict[str, tuple[int, str]]]  # client -> GPU -> what its process holds of leases that ended


class Mirror:
    """This run's leases (``held``), requests (``asked``) and contexts per client; thread-safe.

    Its lock is never held across I/O: the link's reader thread takes it to file events."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.held: dict[str, Held] = {}
        self.asked: dict[str, Asked] = {}
        self.contexts: dict[str, list[str]] = {}
        # clients gone whose processes still have contexts (the arbiter's stand-ins): only
        # their run knows when they exit, so only their run can tell a new arbiter of them
        self.exiting_contexts: dict[str, list[str]] = {}
        self.ports: dict[int, str] = {}  # port -> owner
        self.left: dict[str, dict[str, tuple[int, str]]] = {}  # client -> GPU -> (bytes, who left them)
        self.inflight: set[str] = set()  # keys whose submit awaits its answer
        self.early: dict[str, Event] = {}  # their events, held back till then

    def snapshot(self) -> Snapshot:
        """What to bring to a new arbiter."""
        with self._lock:
            return Snapshot(
                list(self.held.values()),
                list(self.asked.values()),
                dict(self.contexts),
                dict(self.exiting_contexts),
                dict(self.ports),
                {client: dict(gpus) for client, gpus in self.left.items()},
            )

    def took_ports(self, ports: list[int], owner: str) -> None:
        with self._lock:
            self.ports.update(dict.fromkeys(ports, owner))

    def gave_back_ports(self, owner: str, prefix: bool = False) -> None:
        with self._lock:
            for port in [p for p, o in self.ports.items() if (o.startswith(owner) if prefix else o == owner)]:
                del self.ports[port]

    def file(self, events: list[Event]) -> list[Event]:
        """Keep the mirror in step with events; hold back those of calls still in flight."""
        with self._lock:
            passed = []
            for event in events:
                kind, key, body = event
                if key in self.inflight:
                    self.early[key] = event
                    continue
                asked = self.asked.pop(key, None)
                if kind == "granted" and asked is not None:
                    self.held[key] = held_from(asked, body)
                passed.append(event)
            return passed

    def begin(self, key: str) -> None:
        """``key``'s submit is on its way."""
        with self._lock:
            self.inflight.add(key)

    def end(self, key: str) -> Event | None:
        """``key``'s submit was answered (or failed): the event that came before the answer, if any."""
        with self._lock:
            self.inflight.discard(key)
            return self.early.pop(key, None)

    def answered(self, asked: Asked, kind: str, value: Any) -> None:
        """The arbiter's answer to ``asked``: ``granted`` (``value``: the grant's body) or ``queued``."""
        with self._lock:
            if kind == "granted":
                self.held[asked.key] = held_from(asked, value)
            elif kind == "queued":
                self.asked[asked.key] = asked

    def withdraw(self, key: str) -> None:
        """A waiting request was cancelled."""
        with self._lock:
            self.asked.pop(key, None)

    def drop(self, key: str) -> None:
        """A request was abandoned, waiting or granted."""
        with self._lock:
            self.asked.pop(key, None)
            self.held.pop(key, None)

    def release(self, key: str, contexts: list[str] | None, left: dict[str, tuple[int, str]] | None = None) -> None:
        """A lease went back; ``contexts``: the GPUs its client has contexts on now, if known;
        ``left``: what its client's process still holds of leases that ended, if told."""
        with self._lock:
            held = self.held.pop(key, None)
            if contexts is not None and held is not None:
                self.contexts[held.client] = list(contexts)
            if left is not None and held is not None:
                if left:
                    self.left[held.client] = dict(left)
                else:
                    self.left.pop(held.client, None)

    def set_contexts(self, client: str, contexts: list[str]) -> None:
        with self._lock:
            self.contexts[client] = list(contexts)

    def exiting(self, client: str, contexts: list[str]) -> None:
        with self._lock:
            self.exiting_contexts[client] = list(contexts)

    def exited(self, client: str) -> None:
        with self._lock:
            self.exiting_contexts.pop(client, None)

    def forget_client(self, client: str) -> None:
        with self._lock:
            for mirror in (self.held, self.asked):
                for key in [k for k, v in mirror.items() if v.client == client]:
                    del mirror[key]
            self.contexts.pop(client, None)
            self.left.pop(client, None)


def held_from(asked: Asked, body: dict[str, Any]) -> Held:
    """The lease ``asked`` became, from the arbiter's grant ``body``."""
    return Held(
        asked.key,
        asked.client,
        asked.worker,
        asked.test,
        asked.request,
        tuple(body["gpus"]),
        int(body["memory"]),
        bool(body["exclusive"]),
    )


def to_wire(record: Held | Asked, private: bool = False) -> dict[str, Any]:
    """A lease held or a request waited on, as JSON for a new arbiter's ``attach``;
    ``private``: without its test and worker (for another user's arbiter)."""
    body = {**record.__dict__, "request": request_to_wire(record.request), "gpus": list(record.gpus)}
    if private:
        body.update(test="", worker="")
    return body
