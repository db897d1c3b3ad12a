"""What a run may send the arbiter: every field of every request, checked (pure).

The arbiter may serve other users' runs, so a request is a stranger's claim until each of
its fields is what it must be: a string of bounded length (names without ``|``, which the
arbiter uses to join a run's id and its keys), an integer in its range (a JSON bool or
float is not one), a list of bounded length. Anything else is a :class:`WireError` that
names the field; the server answers it to its sender alone.

What depends on the arbiter's state (a GPU the run did not bring, a key in use, a size
larger than the GPU) is checked by :class:`~.arbiter.Arbiter` itself.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..base.requests import GpuRequest
from ..wire.frames import WireError

MAX_BYTES = 1 << 50  # a size that no GPU or host has (1 PiB): beyond it a size is a lie
MAX_GPUS = 256  # GPUs (and parts of GPUs) one run may name
NAME_MAX = 256  # a key, a client: "<client>/<name>"
TEST_MAX = 1024  # a test's node id as the arbiter keeps it (runs shorten longer ones)
WORKER_MAX = 128
LABEL_MAX = 512
UUID_MAX = 160  # a UUID, or a rank's part of one ("<uuid>#part-of-rank-<n>")
LIST_MAX = 4096  # leases or requests one run re-declares
PORTS_MAX = 1024  # ports one request asks for
_RUN = re.compile(r"\d{1,10}\.[A-Za-z0-9_-]{1,64}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def integer(value: Any, what: str, lo: int = 0, hi: int = MAX_BYTES) -> int:
    """``value`` as an int in ``[lo, hi]`` (a JSON bool is not one); :class:`WireError` naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise WireError(f"{what} must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise WireError(f"{what} must be in [{lo}, {hi}], got {value}")
    return value


def context_size(value: Any) -> int:
    """A measured CUDA context's size: an integer above 0 within what any GPU has (the
    arbiter checks it against the GPU's own capacity)."""
    return integer(value, "a context's size", 1, MAX_BYTES)


def request_to_wire(request: GpuRequest) -> list[Any]:
    """``[count, memory, exclusive, min_memory]``, then ``cpus, host_memory`` only when the
    request leases host resources (what an older peer reads is unchanged otherwise)."""
    shape = [request.count, request.memory, request.exclusive, request.min_memory]
    if request.host:
        shape += [request.cpus, request.host_memory]
    return shape


def request_from_wire(data: Any) -> GpuRequest:
    """The inverse of :func:`request_to_wire`: 4 fields (no host part) or 6, each checked
    (counts and sizes non-negative integers within what any machine has)."""
    if not isinstance(data, (list, tuple)) or len(data) not in (4, 6):
        raise WireError(f"a request has 4 or 6 fields, got {data!r:.80}")
    count_, memory_, exclusive, min_memory_ = data[:4]
    count = integer(count_, "a request's count", 0, MAX_GPUS)
    memory = None if memory_ is None else integer(memory_, "a request's memory")
    if not isinstance(exclusive, bool):
        raise WireError("a request's exclusive must be true or false")
    min_memory = None if min_memory_ is None else integer(min_memory_, "a request's min_memory")
    cpus, host_memory = 0, 0
    if len(data) == 6:
        cpus = integer(data[4], "a request's cpus", 0, 1 << 20)
        host_memory = integer(data[5], "a request's host_memory")
    if (memory is None) != exclusive:
        raise WireError("a request has memory exactly when it is not exclusive")
    try:
        return GpuRequest(count, memory, exclusive, min_memory, cpus, host_memory)
    except ValueError as exc:
        raise WireError(str(exc)) from None


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


def text(value: Any, what: str, limit: int) -> str:
    """A string of at most ``limit`` characters, without control characters."""
    if not isinstance(value, str):
        raise WireError(f"{what} must be a string, got {type(value).__name__}")
    if len(value) > limit:
        raise WireError(f"{what} is longer than {limit} characters")
    if _CONTROL.search(value):
        raise WireError(f"{what} holds control characters")
    return value


def name(value: Any, what: str) -> str:
    """A key or client name: a non-empty string, at most ``NAME_MAX`` characters, no ``|``."""
    found = text(value, what, NAME_MAX)
    if not found or "|" in found:
        raise WireError(f"{what} must be a non-empty name without '|'")
    return found


def run_id(value: Any) -> str:
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


def uuids(value: Any, what: str) -> list[str]:
    if not isinstance(value, list) or len(value) > MAX_GPUS:
        raise WireError(f"{what} must be a list of at most {MAX_GPUS} GPU names")
    return [gpu(u, f"a GPU of {what}") for u in value]


def _dict(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise WireError(f"{what} must be an object")
    return value


def _list(value: Any, what: str, limit: int = LIST_MAX) -> list[Any]:
    if not isinstance(value, list) or len(value) > limit:
        raise WireError(f"{what} must be a list of at most {limit} entries")
    return value


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


def attach(m: dict[str, Any]) -> Attach:
    gpus_ = _dict(m.get("gpus"), "gpus")
    if len(gpus_) > MAX_GPUS:
        raise WireError(f"gpus names more than {MAX_GPUS} GPUs")
    gpus = {}
    for uuid, capacity in gpus_.items():
        gpus[gpu(uuid, "a GPU of gpus")] = integer(capacity, f"the capacity of GPU {uuid[:40]}", 1, MAX_BYTES)
    host = None
    if m.get("host") is not None:
        pair = _list(m["host"], "host", 2)
        if len(pair) != 2:
            raise WireError("host must be [cpus, bytes]")
        host = (integer(pair[0], "host cpus", 1, 1 << 20), integer(pair[1], "host memory", 1, MAX_BYTES))
    ports = {}
    for row in _list(m.get("ports", []), "ports"):
        pair = _list(row, "a port", 2)
        if len(pair) != 2:
            raise WireError("a port must be [port, owner]")
        ports[integer(pair[0], "a port", 1, 65535)] = text(pair[1], "a port's owner", TEST_MAX)
    return Attach(
        run=run_id(m.get("run")),
        label=text(m.get("label", ""), "label", LABEL_MAX),
        gpus=gpus,
        held=[held(h) for h in _list(m.get("held", []), "held")],
        asked=[asked(a) for a in _list(m.get("asked", []), "asked")],
        host=host,
        ports=ports,
        contexts=client_gpus(m.get("contexts", {}), "contexts"),
        exiting=client_gpus(m.get("exiting", {}), "exiting"),
        left=client_left(m.get("left", {})),
    )


def client_left(value: Any) -> dict[str, dict[str, tuple[int, str]]]:
    """Client -> what its process still holds of leases that ended (:func:`left`)."""
    found = _dict(value, "left")
    if len(found) > LIST_MAX:
        raise WireError(f"left names more than {LIST_MAX} clients")
    return {name(client, "a client of left"): left({"left": held}) or {} for client, held in found.items()}


def left(m: dict[str, Any]) -> dict[str, tuple[int, str]] | None:
    """A release's ``left``: GPU -> [bytes, who left them] (absent: not told)."""
    value = m.get("left")
    if value is None:
        return None
    found = _dict(value, "left")
    if len(found) > MAX_GPUS:
        raise WireError(f"left names more than {MAX_GPUS} GPUs")
    out = {}
    for uuid, row in found.items():
        pair = _list(row, "a GPU's leftover", 2)
        if len(pair) != 2:
            raise WireError("a GPU's leftover must be [bytes, who left them]")
        out[gpu(uuid, "a GPU of left")] = (
            integer(pair[0], "a leftover's bytes", 1, MAX_BYTES),
            text(pair[1], "who left it", TEST_MAX),
        )
    return out


def client_gpus(value: Any, what: str) -> dict[str, list[str]]:
    """Client -> GPU names (where its process has CUDA contexts)."""
    found = _dict(value, what)
    if len(found) > LIST_MAX:
        raise WireError(f"{what} names more than {LIST_MAX} clients")
    return {name(client, f"a client of {what}"): uuids(gpus, f"{what} of a client") for client, gpus in found.items()}


def held(h: Any) -> Held:
    h = _dict(h, "a held lease")
    request = request_from_wire(h.get("request"))
    memory = integer(h.get("memory"), "a held lease's memory")
    exclusive = h.get("exclusive")
    if not isinstance(exclusive, bool):
        raise WireError("a held lease's exclusive must be true or false")
    return Held(
        name(h.get("key"), "a held lease's key"),
        name(h.get("client"), "a held lease's client"),
        text(h.get("worker", ""), "a held lease's worker", WORKER_MAX),
        text(h.get("test", ""), "a held lease's test", TEST_MAX),
        request,
        tuple(uuids(h.get("gpus"), "a held lease's gpus")),
        memory,
        exclusive,
    )


def asked(a: Any) -> Asked:
    a = _dict(a, "a waiting request")
    return Asked(
        name(a.get("key"), "a waiting request's key"),
        name(a.get("client"), "a waiting request's client"),
        text(a.get("worker", ""), "a waiting request's worker", WORKER_MAX),
        text(a.get("test", ""), "a waiting request's test", TEST_MAX),
        request_from_wire(a.get("request")),
        tuple(uuids(a.get("gpus"), "a waiting request's gpus")),
    )


def submit(m: dict[str, Any]) -> Asked:
    """A request to place (the fields of :class:`~.arbiter.Asked`)."""
    return asked(m)


def preference(m: dict[str, Any]) -> list[str] | None:
    """A submit's ``prefer``: the GPUs its run's scheduler planned for it (absent: none);
    whether they suit the request is the arbiter's to check."""
    value = m.get("prefer")
    return None if value is None else uuids(value, "prefer")


def contexts(m: dict[str, Any]) -> list[str] | None:
    value = m.get("contexts")
    return None if value is None else uuids(value, "contexts")


def port_range(value: Any) -> tuple[int, int]:
    pair = _list(value, "range", 2)
    if len(pair) != 2:
        raise WireError("range must be [low, high]")
    lo = integer(pair[0], "range low", 1024, 65535)
    hi = integer(pair[1], "range high", lo, 65535)
    return lo, hi


def port_count(value: Any) -> int:
    return integer(value, "n", 1, PORTS_MAX)
