"""A run's connection to the arbiter in another process: calls, one-way tells, its events.

The other end of :mod:`.server`, over :class:`pytest_gpu.wire.client.Client` with a reader
thread: each answer goes to the call that waits for it, each event (``ev``, ``roster``)
to the link. A call that gets no answer within its timeout fails with
:class:`MachineError`, one whose connection closes meanwhile raises :class:`Lost` (the
link then elects again, see :mod:`.link`).

The process that answers is who the kernel says it is (``SO_PEERCRED``, read at connect:
:attr:`Remote.peer_uid`); the link decides whether to trust it. What it sends is checked
against :data:`.messages.ARBITER` before use, as strictly as the arbiter checks a request:
an answer or event that is not what the protocol says (a ``room`` of ``null``, a grant
without its GPUs) fails the call with :class:`Garbled`, a :class:`MachineError`, and ends
the connection; :attr:`Remote.garbled` says why (the link stops using that arbiter).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ..wire.client import Client, Closed, NoAnswer
from ..wire.client import Garbled as WireGarbled
from ..wire.frames import MAX_REPLY, WireError
from ..wire.schema import Refused
from .arbiter import Event
from .messages import ARBITER, shown

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


class Garbled(MachineError):
    """The machine's arbiter sent what its protocol does not allow (the connection is closed)."""


class Lost(Exception):
    """The arbiter's connection closed while a call waited for its answer."""


class Remote:
    """A connection to the arbiter in another process."""

    def __init__(
        self,
        address: str,
        on_frame_events: Callable[[list[Event]], None],
        on_lost: Callable[[Remote], None],
        on_roster: Callable[[list[tuple[str, int]]], None] = lambda runs: None,
        timeout: float = CONNECT_TIMEOUT_S,
    ) -> None:
        self._on_events = on_frame_events
        self._on_lost = on_lost
        self._on_roster = on_roster
        self.closing = False
        self._client = Client(
            address,
            ARBITER,
            timeout=timeout,
            limit=MAX_REPLY,
            on_event=self._event,
            on_lost=lambda client: self._lost(),
            threaded=True,
        )
        self.peer_pid, self.peer_uid = self._client.peer_pid, self._client.peer_uid

    @property
    def sock(self) -> Any:
        return self._client.sock

    @property
    def lost(self) -> bool:
        return self._client.lost is not None

    @property
    def garbled(self) -> str | None:
        """What the arbiter sent that its protocol does not allow, once it did."""
        return self._client.garbled

    def _event(self, kind: str, body: Any) -> None:
        if kind == "ev":
            self._on_events(body["ev"])
        else:  # the arbiter's own run goes with its socket: it never comes back to a new one
            self._on_roster([(r, p) for r, p in body["roster"] if r != body["arbiter"]])

    def _lost(self) -> None:
        if not self.closing:
            self._on_lost(self)

    def call(
        self, op: str, timeout: float | None = None, expect: Callable[[Any], None] | None = None, **fields: Any
    ) -> Any:
        """``op``'s answer, checked (``expect``: see :meth:`Client.call`); :class:`MachineError`
        when refused, not answered within ``timeout`` (default ``CALL_TIMEOUT_S``) or garbled,
        :class:`Lost` when the connection closed."""
        limit = CALL_TIMEOUT_S if timeout is None else timeout
        try:
            return self._client.call(op, fields, limit, expect)
        except Refused as exc:
            said = shown(str(exc)[:500], keep_lines=True)
            raise MachineError(f"the machine's arbiter refused {op!r}: {said}") from None
        except NoAnswer:
            raise MachineError(
                f"pytest-gpu: the machine's arbiter did not answer {op!r} within {limit:g}s "
                "(its process is stopped or overloaded; `pytest-gpu status` names the runs)"
            ) from None
        except WireGarbled as exc:
            raise Garbled(f"pytest-gpu: {exc}") from None
        except Closed as exc:
            if self.garbled is not None:  # an event garbled while this call waited
                raise Garbled(f"pytest-gpu: {self.garbled}") from None
            raise Lost() from exc
        except (WireError, ValueError, TypeError) as exc:  # nothing was sent
            raise MachineError(f"pytest-gpu: {op!r} cannot be sent to the machine's arbiter: {exc}") from None

    def tell(self, op: str, **fields: Any) -> None:
        """One-way: no answer is awaited (a lost message is covered by the mirror)."""
        try:
            self._client.tell(op, fields)
        except (OSError, WireError, ValueError, TypeError):
            pass

    def close(self, wait: bool = True) -> None:
        """End the connection (``wait``: see :meth:`Client.close`)."""
        self.closing = True
        self._client.close(wait)
