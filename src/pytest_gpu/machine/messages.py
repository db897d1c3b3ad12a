"""The arbiter's protocol: every message between a run and the arbiter, declared (pure).

:data:`ARBITER` is the whole of it: each call a run may send (its fields, its answer) and
each event the arbiter sends unasked. Both ends check what arrives against it
(:mod:`pytest_gpu.wire`): the arbiter may serve other users' runs, so a request is a
stranger's claim until each of its fields is what it must be: a string of bounded length
(names without ``|``, which the arbiter uses to join a run's id and its keys), an integer
in its range (a JSON bool or float is not one), a list of bounded length, no field the
message does not have. An arbiter may be another user's process, so its answers and
events are checked as strictly. Anything else is a :class:`WireError` that names the
field; the server answers it to its sender alone, a run takes it for an arbiter it cannot
use (:mod:`.link`).

What depends on the arbiter's state (a GPU the run did not bring, a key in use, a size
larger than the GPU) is checked by :class:`~.arbiter.Arbiter` itself.

The wire form (older than the other protocols' events, and kept): a call is
``{"op": kind, "id": n, ...fields}`` (``release``, ``abandon``, ``give_back_ports*`` are
sent one-way, without ``id``), answered ``{"re": n, "ok": answer}`` or ``{"re": n, "error":
why}``; events are ``{"ev": [[kind, key, body], ...]}`` (a waiting request granted or
rejected) and, after a run attaches or detaches, ``{"roster": [[run, pid], ...], "arbiter": run}``.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from ..base.requests import GpuRequest
from ..wire.frames import WireError
from ..wire.schema import (
    Bool,
    Call,
    Check,
    Dict,
    Either,
    Float,
    Int,
    List,
    Null,
    Obj,
    Opt,
    Protocol,
    Row,
    Str,
    StrKey,
    Tagged,
    integer,
    text,
)

__all__ = ["ARBITER", "WireError", "integer", "text"]

MAX_BYTES = 1 << 50  # a size that no GPU or host has (1 PiB): beyond it a size is a lie
MAX_GPUS = 256  # GPUs (and parts of GPUs) one run may name
NAME_MAX = 256  # a key, a client: "<client>/<name>"
TEST_MAX = 1024  # a test's node id as the arbiter keeps it (runs shorten longer ones)
WORKER_MAX = 128
LABEL_MAX = 512
UUID_MAX = 160  # a UUID, or a rank's part of one ("<uuid>#part-of-rank-<n>")
PART = "#part-of-rank-"  # a launched rank's part of a GPU: the GPU's UUID, this, the rank
LIST_MAX = 4096  # leases or requests one run re-declares
PORTS_MAX = 1024  # ports one request asks for
RUN_MAX = 80  # a run's id, or another user's run as a digest ("#...")
TEXT_MAX = 1 << 16  # an error, a deadlock's explanation
_RUN = re.compile(r"\d{1,10}\.[A-Za-z0-9_-]{1,64}")


def context_size(value: Any, what: str = "a context's size") -> int:
    """A measured CUDA context's size: an integer above 0 within what any GPU has (the
    arbiter checks it against the GPU's own capacity)."""
    return integer(value, what, 1, MAX_BYTES)


def request_to_wire(request: GpuRequest) -> list[Any]:
    """``[count, memory, exclusive, min_memory]``, then ``cpus, host_memory`` only when the
    request leases host resources (what an older peer reads is unchanged otherwise)."""
    shape = [request.count, request.memory, request.exclusive, request.min_memory]
    if request.host:
        shape += [request.cpus, request.host_memory]
    return shape


def request_from_wire(data: Any, what: str = "a request") -> GpuRequest:
    """The inverse of :func:`request_to_wire`: 4 fields (no host part) or 6, each checked
    (counts and sizes non-negative integers within what any machine has)."""
    if not isinstance(data, (list, tuple)) or len(data) not in (4, 6):
        raise WireError(f"a request has 4 or 6 fields, got {data!r:.80}")
    count_, memory_, exclusive, min_memory_ = data[:4]
    count = integer(count_, "a request's count", 0, MAX_GPUS)
    memory = None if memory_ is None else integer(memory_, "a request's memory", 0, MAX_BYTES)
    if not isinstance(exclusive, bool):
        raise WireError("a request's exclusive must be true or false")
    min_memory = None if min_memory_ is None else integer(min_memory_, "a request's min_memory", 0, MAX_BYTES)
    cpus, host_memory = 0, 0
    if len(data) == 6:
        cpus = integer(data[4], "a request's cpus", 0, 1 << 20)
        host_memory = integer(data[5], "a request's host_memory", 0, MAX_BYTES)
    if (memory is None) != exclusive:
        raise WireError("a request has memory exactly when it is not exclusive")
    try:
        return GpuRequest(count, memory, exclusive, min_memory, cpus, host_memory)
    except ValueError as exc:
        raise WireError(str(exc)) from None


def name(value: Any, what: str) -> str:
    """A key or client name: a non-empty string, at most ``NAME_MAX`` characters, no ``|``."""
    found = text(value, what, NAME_MAX)
    if not found or "|" in found:
        raise WireError(f"{what} must be a non-empty name without '|'")
    return found


def run_id(value: Any, what: str = "run") -> str:
    """A run's id: ``<uid>.<letters, digits, - or _>``."""
    if not isinstance(value, str) or not _RUN.fullmatch(value):
        raise WireError("run must be '<uid>.<id>' (letters, digits, '-', '_')")
    return value


def gpu(value: Any, what: str) -> str:
    """A GPU's name: its UUID, or a rank's part of it."""
    found = name(value, what)
    if len(found) > UUID_MAX:
        raise WireError(f"{what} is longer than {UUID_MAX} characters")
    return found


NAME = Check(name)
GPU = Check(gpu)
GPUS = List(GPU, MAX_GPUS, each="a GPU of {what}")
GPU_TUPLE = Check(lambda value, what: tuple(GPUS.check(value, what)))
REQUEST = Check(request_from_wire)
BYTES = Int(0, MAX_BYTES)
TEST = Str(TEST_MAX, plain=True)
WORKER = Str(WORKER_MAX, plain=True)
TEXT = Str(TEXT_MAX)
_UNSHOWN = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def shown(value: str, keep_lines: bool = False) -> str:
    """``value`` safe to print on a terminal: control characters (escape sequences, carriage
    returns, C1 controls, bidirectional overrides) written as escapes, ``\\x1b``; a newline and
    a tab kept only with ``keep_lines``. What a peer sent is shown so, never raw."""
    if keep_lines:
        return _UNSHOWN.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), value)
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in value)


def _said(value: Any, what: str) -> str:
    return shown(TEXT.check(value, what), keep_lines=True)


SAID = Check(_said)  # an error or a refusal an arbiter wrote (a deadlock's explanation has lines)


@dataclass(frozen=True)
class Held:
    """A lease a run holds, as it re-declares it to a new arbiter."""

    key: str
    client: str
    worker: str
    test: str
    request: GpuRequest
    gpus: tuple[str, ...]
    memory: int
    exclusive: bool


@dataclass(frozen=True)
class Asked:
    """A request a run is waiting on, as it re-declares it to a new arbiter."""

    key: str
    client: str
    worker: str
    test: str
    request: GpuRequest
    gpus: tuple[str, ...]  # the GPUs the run can see


_ASKED = {"key": NAME, "client": NAME, "request": REQUEST, "gpus": GPU_TUPLE}
_NAMES = {"worker": WORKER, "test": TEST}
_UNNAMED = {"worker": "", "test": ""}
HELD = Obj({**_ASKED, "memory": BYTES, "exclusive": Bool()}, _NAMES, _UNNAMED, name="a held lease", into=Held)
ASKED = Obj(_ASKED, _NAMES, _UNNAMED, name="a waiting request", into=Asked)

# GPU -> [bytes, who left them] (see Arbiter.release)
LEFT = Dict(
    StrKey(Check(lambda v, w: gpu(v, "a GPU of left"))),
    Row(Int(1, MAX_BYTES), TEST, names=("bytes", "who left them")),
    MAX_GPUS,
    each="a GPU's leftover",
)
CLIENT_GPUS = Dict(StrKey(NAME), GPUS, LIST_MAX, each="the GPUs of a client of {what}")
CLIENT_LEFT = Dict(StrKey(NAME), LEFT, LIST_MAX, each="left")


@dataclass(frozen=True)
class Attach:
    """A run joining: what :meth:`~.arbiter.Arbiter.attach` takes besides the kernel's word."""

    run: str
    label: str
    gpus: dict[str, int]
    held: list[Held]
    asked: list[Asked]
    host: tuple[int, int] | None
    ports: dict[int, str]
    contexts: dict[str, list[str]]  # client -> GPUs where its process has contexts
    exiting: dict[str, list[str]]  # the same, of clients gone whose processes have not exited yet
    left: dict[str, dict[str, tuple[int, str]]]  # client -> what its process holds of leases that ended


def _attach(ports: list[tuple[int, str]], **fields: Any) -> Attach:
    return Attach(ports=dict(ports), **fields)


ATTACH = Obj(
    {
        "run": Check(run_id),
        "gpus": Dict(StrKey(Check(lambda v, w: gpu(v, "a GPU of gpus"))), Int(1, MAX_BYTES), MAX_GPUS),
    },
    {
        "label": Str(LABEL_MAX, plain=True),
        "held": List(HELD, LIST_MAX),
        "asked": List(ASKED, LIST_MAX),
        "host": Opt(Row(Int(1, 1 << 20), Int(1, MAX_BYTES), names=("cpus", "bytes"))),
        "ports": List(Row(Int(1, 65535), TEST, names=("port", "owner")), LIST_MAX),
        "contexts": CLIENT_GPUS,
        "exiting": CLIENT_GPUS,
        "left": CLIENT_LEFT,
    },
    {"label": "", "held": [], "asked": [], "host": None, "ports": [], "contexts": {}, "exiting": {}, "left": {}},
    into=_attach,
)


def attach(m: dict[str, Any]) -> Attach:
    """An ``attach``'s fields (without ``op`` and ``id``), checked."""
    found: Attach = ATTACH.check(m, "'attach'")
    return found


def left(m: dict[str, Any]) -> dict[str, tuple[int, str]] | None:
    """A release's ``left``: GPU -> (bytes, who left them) (absent: not told)."""
    value = m.get("left")
    return None if value is None else LEFT.check(value, "left")


def _port_range(value: Any, what: str) -> tuple[int, int]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise WireError("range must be [low, high]")
    lo = integer(value[0], "range low", 1024, 65535)
    hi = integer(value[1], "range high", lo, 65535)
    return lo, hi


PREFER = Opt(GPUS)  # the GPUs a submit's scheduler planned (absent: none); whether they suit is the arbiter's to check


def preference(m: dict[str, Any]) -> list[str] | None:
    """A submit's ``prefer``, checked."""
    found: list[str] | None = PREFER.check(m.get("prefer"), "prefer")
    return found


# -- what the arbiter answers and tells --------------------------------------------------------

GRANT = Obj(
    {"gpus": GPUS, "memory": BYTES, "exclusive": Bool()},
    {
        "foreign": Obj(
            {"waited": Bool(), "avoided": GPUS, "bytes": Dict(StrKey(GPU), BYTES, MAX_GPUS)},
            name="a grant's foreign usage",
        )
    },
    name="a grant",
)
REJECTED = Obj({"message": SAID}, name="a rejection")
HOLDER = Obj(
    {
        "run": Str(RUN_MAX),
        "run_label": Str(LABEL_MAX),
        "user": Str(NAME_MAX),
        "test": TEST,
        "worker": Str(NAME_MAX + WORKER_MAX),
        "gpus": GPUS,
        "memory": BYTES,
        "exclusive": Bool(),
        "cpus": Int(0, 1 << 20),
        "host_memory": BYTES,
        "since": Opt(Float()),
    },
    {"left": Bool()},
    name="a holder",
)
HOLDERS = List(HOLDER, 4 * LIST_MAX)


def _event(value: Any, what: str) -> tuple[str, str, Any]:
    if not isinstance(value, (list, tuple)) or len(value) != 3:
        raise WireError(f"{what} must be [kind, key, body]")
    kind, key, body = value
    if kind not in ("granted", "rejected"):
        raise WireError(f"{what}'s kind must be granted or rejected, got {kind!r:.40}")
    return kind, name(key, f"{what}'s key"), (GRANT if kind == "granted" else REJECTED).check(body, f"{what}'s body")


# -- what a run can judge of an answer beyond its shape (the arbiter may be a stranger) ------------


def check_grant(
    body: Mapping[str, Any],
    request: GpuRequest | None,
    asked: Collection[str] | None,
    capacities: Mapping[str, int],
    held: Collection[Held],
    what: str = "a grant",
) -> None:
    """A grant (of :data:`GRANT`'s shape) judged by what its run knows: distinct GPUs among
    those it asked on (``asked``; ``None``: a request no longer known, any GPU the run brought),
    as many as ``request`` counts, exclusive as asked, the memory asked (an exclusive one: at
    least its minimum), and with the run's own leases (``held``) no GPU held whole twice nor
    more memory promised than the GPU has. :class:`WireError` for a grant no honest arbiter makes."""
    gpus: list[str] = list(body["gpus"])
    memory, exclusive = body["memory"], body["exclusive"]
    if len(set(gpus)) != len(gpus):
        raise WireError(f"{what} names a GPU twice: {gpus[:8]}")
    for uuid in gpus:
        if uuid not in (capacities if asked is None else asked) or uuid not in capacities:
            raise WireError(f"{what} names GPU {uuid!r:.80}, which the run did not ask for")
    if request is not None:
        if len(gpus) != request.count:
            raise WireError(f"{what} has {len(gpus)} GPUs for a request of {request.count}")
        if exclusive != request.exclusive:
            raise WireError(f"{what} is {'' if exclusive else 'not '}exclusive for {request.describe()}")
        if not exclusive and memory != request.memory:
            raise WireError(f"{what} gives {memory} bytes for a request of {request.memory}")
        if exclusive and gpus and (memory <= 0 or memory < (request.min_memory or 0)):
            raise WireError(f"{what} of whole GPUs gives {memory} bytes for {request.describe()}")
    for uuid in gpus:
        others = [h for h in held if uuid in h.gpus]
        if others and (exclusive or any(h.exclusive for h in others)):
            raise WireError(f"{what} of GPU {uuid!r:.80} would share a GPU the run holds whole, or give one it shares")
        promised = memory + sum(h.memory for h in others)
        if promised > capacities[uuid]:
            raise WireError(
                f"{what} would promise {promised} bytes of GPU {uuid!r:.80} to the run, which has {capacities[uuid]}"
            )


def check_ports(ports: list[int], n: int, port_range: tuple[int, int], held: Collection[int]) -> None:
    """Ports taken (:data:`ARBITER`'s ``take_ports``) judged by what the run asked: ``n``
    distinct ports in ``port_range``, none that the run holds already (``held``)."""
    if len(ports) != n or len(set(ports)) != n:
        raise WireError(f"its answer to 'take_ports' gives {sorted(ports)[:8]} for {n} distinct ports")
    lo, hi = port_range
    twice = [p for p in ports if p in held or not lo <= p <= hi]
    if twice:
        raise WireError(f"its answer to 'take_ports' gives port {twice[0]}: the run's already, or not in {lo}-{hi}")


def check_room(room: list[int], gpus: list[str], capacities: Mapping[str, int]) -> None:
    """A ``room`` answer: one size per GPU asked about, none larger than the GPU."""
    if len(room) != len(gpus):
        raise WireError(f"its answer to 'room' has {len(room)} sizes for {len(gpus)} GPUs")
    for uuid, n in zip(gpus, room, strict=True):
        if n > capacities.get(uuid, 0):
            raise WireError(f"its answer to 'room' gives GPU {uuid!r:.80} {n} bytes, more than it has")


STATUS = Obj(
    {
        "runs": List(
            Obj(
                {"user": Str(NAME_MAX), "leases": Int(), "gpus": GPUS},
                {"run": Str(RUN_MAX), "pid": Int(0, 1 << 31), "label": Str(LABEL_MAX), "attached": Float()},
                name="a run",
            ),
            LIST_MAX,
        ),
        "gpus": List(
            Obj(
                {
                    "uuid": GPU,
                    "capacity": BYTES,
                    "leased": BYTES,
                    "foreign": BYTES,
                    "contexts": Int(),
                    "left": BYTES,
                    "clients": List(Str(RUN_MAX + NAME_MAX + 16), 4 * LIST_MAX),
                    "exclusive": Bool(),
                },
                name="a GPU",
            ),
            LIST_MAX,
        ),
        "leases": HOLDERS,
        "waiting": List(
            Obj(
                {
                    "run": Str(RUN_MAX),
                    "key": Str(NAME_MAX),
                    "test": TEST,
                    "worker": Str(NAME_MAX + WORKER_MAX),
                    "request": Str(LABEL_MAX),
                    "since": Opt(Float()),
                    "bypassed": Int(),
                    "foreign": Bool(),
                },
                name="a waiting request",
            ),
            4 * LIST_MAX,
        ),
        "grants": Int(),
    },
    {
        "pending": List(Str(RUN_MAX), LIST_MAX),
        "host": Opt(
            Obj({"cpus": Int(), "memory": BYTES, "leased_cpus": Int(), "leased_memory": BYTES}, name="the host")
        ),
        "error": SAID,  # a run's own status when the arbiter did not answer (Broker.status_locked)
    },
    name="a status",
)

_KEY = {"key": NAME}
_CLIENT = {"client": NAME}
_CONTEXTS = {"contexts": Opt(GPUS)}

ARBITER = Protocol(
    "the machine's arbiter",
    calls={
        "status": Call(Obj(), STATUS),
        "attach": Call(ATTACH, Bool()),
        "submit": Call(
            Obj({**_ASKED}, {**_NAMES, "prefer": PREFER}, _UNNAMED),
            Tagged({"granted": GRANT, "queued": Null(), "error": SAID, "rejected": SAID}),
        ),
        "cancel": Call(Obj(_KEY), Opt(HOLDERS)),
        "abandon": Call(Obj(_KEY), Null()),
        "release": Call(Obj(_KEY, {**_CONTEXTS, "left": Opt(LEFT)}), Null()),
        "set_contexts": Call(Obj(_CLIENT, _CONTEXTS), Null()),
        "forget_client": Call(Obj(_CLIENT), List(Row(NAME, GPU_TUPLE, names=("key", "gpus")), LIST_MAX)),
        "exiting": Call(Obj(_CLIENT, _CONTEXTS), Null()),
        "exited": Call(Obj(_CLIENT), Null()),
        "measure_context": Call(Obj({"uuid": GPU, "bytes": Check(context_size)}), Bool()),
        "room": Call(Obj({"gpus": GPUS}), List(BYTES, MAX_GPUS)),
        "take_ports": Call(
            Obj({"n": Int(1, PORTS_MAX), "owner": TEST, "range": Check(_port_range)}),
            Either(
                Obj({"ports": List(Int(1, 65535), PORTS_MAX)}, name="ports taken"),
                Obj({"refused": SAID}, name="ports refused"),
            ),
        ),
        "give_back_ports": Call(Obj({"owner": TEST}), List(Int(1, 65535), LIST_MAX)),
        "give_back_ports_prefix": Call(Obj({"prefix": NAME}), List(Int(1, 65535), LIST_MAX)),
    },
    events={
        "ev": Obj({"ev": List(Check(_event), 4 * LIST_MAX, each="an event")}),
        "roster": Obj(
            {
                "roster": List(Row(Str(RUN_MAX), Int(0, 1 << 31), names=("run", "pid")), LIST_MAX),
                "arbiter": Str(RUN_MAX),
            }
        ),
    },
    keyed=True,
)
