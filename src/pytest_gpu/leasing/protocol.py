"""The broker's protocol: every message between a run's test processes and its broker, declared.

:data:`BROKER` is the whole of it (the wire: :mod:`pytest_gpu.wire`; what each message
means: :mod:`pytest_gpu.leasing.broker`). A client proves the run's key before anything
else (:class:`~pytest_gpu.wire.server.KeyAuth`), then says ``hello``; every call is
answered in order, ``release`` and ``abandon`` are one-way, and a queued ``acquire`` is
later followed by a ``granted`` or ``refused`` event for its key::

    hello         {worker, pid}                -> {client}
    acquire       {key, request, test, avoid?} -> ["granted", lease] | ["queued", null] | ["refused", why]
    cancel        {key}                        -> ["cancelled", holders] | ["not-waiting", null]
    abandon       {key}                        (one-way)
    release       {key, contexts, left}        (one-way)
    ports         {n, owner}                   -> [port, ...]   (an error answer: too few free)
    release_ports {owner}                      -> null
    context_size  {index, bytes}               -> null          (a context measured; an error answer: refused)
    status        {}                           -> status
    catalog       {tests}                      -> null          (an xdist worker's collection, for the scheduler)
    event granted {key, indices, memory, exclusive, waited, foreign?}
    event refused {key, message}

JSON's lossy spots are undone by the schemas: GPU indices that key a dictionary (a grant's
foreign bytes, a release's leftovers, the status's ``used`` and ``contexts``) come back
integers, rows come back tuples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypedDict

from ..base.requests import GpuRequest
from ..machine.messages import BYTES, HOLDER, MAX_BYTES, NAME, STATUS, TEST, TEXT, WORKER, request_from_wire
from ..wire.schema import (
    Bool,
    Call,
    Check,
    Dict,
    Either,
    Float,
    Int,
    IntKey,
    List,
    Null,
    Obj,
    Opt,
    Protocol,
    Row,
    Str,
    StrKey,
    Tagged,
)

MAX_INDEX = 4096  # a GPU index of a run
MAX_FRAME = 64 << 20  # a worker's catalog of a large suite is the largest message
LIST_MAX = 1 << 20  # tests of a catalog, rows of a status

_shapes: dict[tuple[Any, ...], GpuRequest] = {}  # a suite asks for a handful of shapes: each checked once


def _request(value: Any, what: str) -> GpuRequest:
    """An acquire's request (:func:`~pytest_gpu.machine.messages.request_from_wire`)."""
    shape = tuple((v.__class__, v) for v in value) if isinstance(value, list) else None  # True is no 1
    try:
        if shape is not None and shape in _shapes:
            return _shapes[shape]
    except TypeError:  # a list in it: no request, request_from_wire says why
        shape = None
    request = request_from_wire(value, what)
    if shape is not None and len(_shapes) < 4096:
        _shapes[shape] = request
    return request


REQUEST = Check(_request)
INDEX = Int(0, MAX_INDEX)
INDICES = List(INDEX, MAX_INDEX)
PORT = Int(1, 65535)
OWNER = Str(1 << 16)  # a test's node id (the arbiter is told a shortened one), a port owner


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
    """A grant: the answer to ``acquire`` (at once), or its ``granted`` event (after waiting)."""

    foreign: ForeignNote


FOREIGN = Obj(
    {"waited": Bool(), "avoided": INDICES, "bytes": Dict(IntKey(0, MAX_INDEX), BYTES, MAX_INDEX)},
    name="a grant's foreign usage",
)
LEASE = Obj(
    {"key": NAME, "indices": INDICES, "memory": BYTES, "exclusive": Bool(), "waited": Float()},
    {"foreign": FOREIGN},
    name="a grant",
)
# the machine's holder rows in the run's terms: its GPU indices (a GPU of no run's: its name)
LOCAL_HOLDER = Obj(
    {**HOLDER.required, "gpus": List(Either(INDEX, Str(160)), MAX_INDEX)}, HOLDER.optional, name="a holder"
)
# a catalog entry (pytest_gpu.scheduling.catalog.Entry.to_wire), or what a group's fixtures hold ("held:<group>")
CATALOG_ENTRY = Obj(
    {},
    {
        "gpus": Int(0, MAX_INDEX),
        "memory": Opt(Int(1, MAX_BYTES)),
        "pool": Opt(Str(1 << 16)),
        "group": Opt(Str(1 << 16)),
        "serial": Bool(),
        "before": List(Str(1 << 16), LIST_MAX),
        "held": List(Row(Int(0, MAX_INDEX), Opt(Int(1, MAX_BYTES)), names=("gpus", "bytes each")), LIST_MAX),
    },
    name="a catalog entry",
)


@dataclass(frozen=True)
class CrashRecord:
    """A client that went away while holding something: the broker's record, a :data:`CRASH` on the wire."""

    worker: str
    pid: int
    test: str | None
    gpus: tuple[int, ...]
    ports: tuple[int, ...]
    at: float


CRASH = Obj(
    {
        "worker": WORKER,
        "pid": Int(0, 1 << 31),
        "test": Opt(Str(1 << 16)),
        "gpus": INDICES,
        "ports": List(PORT, LIST_MAX),
        "at": Float(),
    },
    name="a crash",
)
BROKER_STATUS = Obj(
    {
        "clients": Dict(StrKey(Str(64)), Obj({"worker": WORKER, "pid": Int(0, 1 << 31)}), LIST_MAX),
        "leases": List(
            Obj(
                {
                    "test": TEST,
                    "worker": Str(1024),
                    "gpus": List(Either(INDEX, Str(160)), MAX_INDEX),
                    "memory": BYTES,
                    "exclusive": Bool(),
                },
                name="a lease",
            ),
            LIST_MAX,
        ),
        "waiting": List(
            Obj({"key": Str(1024), "request": Str(1024), "bypassed": Int()}, name="a waiting request"), LIST_MAX
        ),
        "ports": Dict(IntKey(1, 65535), Str(1 << 17), LIST_MAX),
        "used": Dict(IntKey(0, MAX_INDEX), BYTES, MAX_INDEX),
        "contexts": Dict(IntKey(0, MAX_INDEX), List(Str(1024), LIST_MAX), MAX_INDEX),
        "grants": Int(),
        "preferences": Obj({"given": Int(), "honoured": Int()}),
        "crashes": List(CRASH, LIST_MAX),
        "machine": STATUS,
    },
    name="the broker's status",
)

BROKER = Protocol(
    "the pytest-gpu broker",
    calls={
        "hello": Call(Obj({"worker": WORKER, "pid": Int(0, 1 << 31)}), Obj({"client": Str(64)})),
        "acquire": Call(
            # avoid: GPUs the lease should not be on (a retry after an infrastructure failure there)
            Obj({"key": NAME, "request": REQUEST, "test": OWNER}, {"avoid": INDICES}),
            Tagged({"granted": LEASE, "queued": Null(), "refused": TEXT}),
        ),
        "cancel": Call(Obj({"key": NAME}), Tagged({"cancelled": List(LOCAL_HOLDER, LIST_MAX), "not-waiting": Null()})),
        "abandon": Call(Obj({"key": NAME})),
        "release": Call(
            Obj(
                {"key": NAME},
                {
                    "contexts": Opt(INDICES),  # GPUs the process now has contexts on (null: unknown, unchanged)
                    # GPU index -> [bytes, who left them]: what the process still holds of leases that
                    # ended, on every GPU where it holds some (null: as told last)
                    "left": Opt(Dict(IntKey(0, MAX_INDEX), Row(BYTES, Str(1 << 16), names=("bytes", "who")))),
                },
                {"contexts": None, "left": None},
            )
        ),
        "ports": Call(Obj({"n": Int(1, 1024), "owner": OWNER}), List(PORT, 1024)),
        "release_ports": Call(Obj({"owner": OWNER}), Null()),
        "context_size": Call(Obj({"index": INDEX, "bytes": BYTES}), Null()),
        "status": Call(Obj(), BROKER_STATUS),
        "catalog": Call(Obj({"tests": Dict(StrKey(Str(1 << 16)), CATALOG_ENTRY, LIST_MAX)}), Null()),
    },
    events={"granted": LEASE, "refused": Obj({"key": NAME, "message": TEXT}, name="a refusal")},
)
