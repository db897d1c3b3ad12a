"""The bodies of the broker's messages (see :mod:`pytest_gpu.leasing.broker` for the protocol).

A message is a pickled ``(kind, body)`` tuple. The client builds each body as one of
these, the broker reads it as the same one, so mypy checks both ends against one
definition; the names are the wire form.
"""

from __future__ import annotations

from typing import Any, TypedDict

Message = tuple[str, Any]  # (kind, body): body one of the types below, or a bare value


# -- from the client ------------------------------------------------------------------


class Hello(TypedDict):
    worker: str
    pid: int


class Acquire(TypedDict):
    key: str  # the client's own name for the lease (the broker scopes it by client)
    request: tuple[Any, ...]  # pytest_gpu.machine.messages.request_to_wire
    test: str


class KeyBody(TypedDict):
    """``cancel`` and ``abandon``: an ``acquire``'s key."""

    key: str


class Release(TypedDict):
    key: str
    contexts: list[int] | None  # GPUs this process now has contexts on (None: unknown, unchanged)
    # GPU index -> (bytes, who left them): what this process still holds of leases that ended,
    # on every GPU where it holds some (None: as told last)
    left: dict[int, tuple[int, str]] | None


class PortsAsk(TypedDict):
    n: int
    owner: str  # str(PortOwner)


class PortsRelease(TypedDict):
    owner: str


class Contexts(TypedDict):
    indices: list[int]


class ContextSize(TypedDict):
    index: int  # the run's GPU index
    bytes: int  # one CUDA context there, as the process measured it (NVML) right after it opened


class CurrentTest(TypedDict):
    nodeid: str | None


class Catalog(TypedDict):
    tests: dict[str, Any]  # node id -> what the scheduler needs (pytest_gpu.scheduling.catalog)


# -- from the broker ------------------------------------------------------------------


class Welcome(TypedDict):
    """The reply to ``hello``."""

    client: str


class ForeignNote(TypedDict):
    """A grant that waited for, or avoided, GPUs used outside pytest-gpu."""

    waited: bool
    avoided: list[int]  # GPU indices
    bytes: dict[int, int]  # GPU index -> bytes used outside pytest-gpu


class _Lease(TypedDict):
    key: str  # the client's key
    indices: list[int]  # physical GPU indices
    memory: int  # bytes per GPU
    exclusive: bool
    waited: float  # seconds, as the broker measured them (the client measures its own)


class LeaseMessage(_Lease, total=False):  # (NotRequired needs Python 3.11)
    """A grant: ``granted`` (at once) or ``push-granted`` (after waiting)."""

    foreign: ForeignNote


class PushError(TypedDict):
    """A queued ``acquire`` that can never be granted after all."""

    key: str
    message: str


class Cancelled(TypedDict):
    holders: list[dict[str, Any]]  # the machine's holder rows, in this run's terms (describe_holders)
