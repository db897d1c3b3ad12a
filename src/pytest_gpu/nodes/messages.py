"""What the controller and a node's host say to each other, declared (pure).

The transport is execnet's channel (:mod:`.agent`, :mod:`.hosts`), which carries plain
values; each message is a ``(kind, body)`` tuple, checked on arrival against
:data:`AGENT` with :mod:`pytest_gpu.wire.schema`, as the sockets' messages are: the node
host checks what the controller asks (:func:`request`), the controller what the host
answers (:func:`answer`). Before these, the controller sends ``sys.path`` alone (a list:
:data:`~.hosts.BOOTSTRAP` imports pytest-gpu with it)::

    -> start   {settings, node, cwd, package}   <- ("started", {wire, node, hostname, pid, inventory, gpus, warnings})
                                                   | ("error", why)
    -> state   {worker?, faults?}               <- ("state", figures) | ("error", why)
    -> prefer  {worker, test, gpus, memory}     (no answer: Broker.prefer on the node)
    -> close   {}                               <- ("closed", figures)

A run's settings and inventory are checked by their own readers (``Settings.from_wire``,
``Inventory.from_wire``): here they are JSON values.
"""

from __future__ import annotations

from typing import Any

from ..leasing.protocol import CATALOG_ENTRY, CRASH, INDEX, INDICES, LIST_MAX
from ..machine.messages import BYTES, MAX_BYTES, TEXT
from ..wire.frames import WireError
from ..wire.schema import Bool, Call, Dict, Int, Json, List, Obj, Opt, Protocol, Row, Str, StrKey, Tagged

PATH = Str(4096)
NAME = Str(256)
FIGURES = Obj(
    {
        "room": List(BYTES, 4096),
        "order": INDICES,
        "placements": Dict(StrKey(NAME), List(Row(INDICES, Opt(Int(1, MAX_BYTES))), LIST_MAX), LIST_MAX),
        "contexts": Dict(StrKey(NAME), INDICES, LIST_MAX),
        "context_sizes": List(BYTES, 4096),
        "limits": List(Int(-MAX_BYTES, MAX_BYTES), 4096),
        "refused_plans": Int(),
        "grants": Int(),
        "crashes": Int(),
        "required": Opt(TEXT),
        "catalog": Dict(StrKey(Str(1 << 16)), CATALOG_ENTRY, LIST_MAX),
    },
    {
        "faults": Obj(
            {
                "crashes": List(CRASH, LIST_MAX),
                "quarantined": List(
                    Obj({"test": TEXT, "error": TEXT, "worker": NAME, "ends": Bool()}, name="a quarantine"), LIST_MAX
                ),
            },
            name="its faults",
        )
    },
    name="a node's figures",
)
RUN_WIRE = Obj(
    {
        "settings": Json(),
        "inventory": Json(),
        "address": PATH,
        "authkey": Str(256),
        "run_dir": PATH,
        "env": Dict(StrKey(NAME), Str(1 << 16), 1024),
    },
    name="the run's wire",
)
STARTED = Obj(
    {
        "wire": RUN_WIRE,
        "node": NAME,
        "hostname": NAME,
        "pid": Int(1, 1 << 31),
        "inventory": TEXT,
        "gpus": List(Row(INDEX, BYTES, names=("index", "bytes")), 4096),
        "warnings": List(TEXT, 1024),
    },
    name="a node host's start",
)

AGENT = Protocol(
    "a node host",
    calls={
        "start": Call(
            Obj({"settings": Json(), "node": NAME, "cwd": PATH, "package": PATH}),
            Tagged({"started": STARTED, "error": TEXT}),
        ),
        "state": Call(Obj({}, {"worker": NAME, "faults": Bool()}), Tagged({"state": FIGURES, "error": TEXT})),
        "prefer": Call(Obj({"worker": NAME, "test": TEXT, "gpus": INDICES, "memory": Opt(Int(1, MAX_BYTES))})),
        "close": Call(Obj(), Tagged({"closed": FIGURES, "error": TEXT})),
    },
)


def _pair(message: Any, what: str) -> tuple[Any, Any]:
    if not isinstance(message, (tuple, list)) or len(message) != 2:
        raise WireError(f"{what} must be (kind, body), got {message!r:.80}")
    return message[0], message[1]


def request(message: Any) -> tuple[str, dict[str, Any]]:
    """A message from the controller, checked: ``(kind, body)``; :class:`WireError` otherwise."""
    kind, body = _pair(message, "a message of the controller")
    call = AGENT.calls.get(kind) if isinstance(kind, str) else None
    if call is None:
        raise WireError(f"unknown message {str(kind)[:40]!r}")
    return kind, call.fields.check(body, repr(kind))


def answer(kind: str, message: Any) -> tuple[str, Any]:
    """A node host's answer to ``kind``, checked: ``(its kind, body)``; :class:`WireError` otherwise."""
    found: tuple[str, Any] = AGENT.answer(kind, list(_pair(message, f"its answer to {kind!r}")))
    return found
