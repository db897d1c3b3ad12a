"""What a message must be: declared once per message, checked on arrival, both ways (pure).

A protocol (:class:`Protocol`) names each message a client may send (:class:`Call`: its
fields, and what the answer must be; a call without an answer is one-way) and each
message a server may send unasked (its *events*). The declaration is the documentation:
each protocol's module holds its own (the arbiter's in ``machine/messages.py``, the
broker's in ``leasing/protocol.py``, the rank pools' in ``distributed/protocol.py``, the
node agents' in ``nodes/messages.py``).

A checker (:class:`Schema`) returns the value as the program uses it, or raises
:class:`~.frames.WireError` naming the field: types (a JSON bool is no integer), bounds,
lengths, known keys only. JSON's lossy spots are undone here: a row declared as a
:class:`Row` comes back a tuple, a dictionary with integer keys (:class:`IntKey`) gets its
keys back as integers (JSON makes them strings), bytes travel as base64 (:class:`Blob`).
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .frames import WireError

MAX_INT = 1 << 63


class Refused(Exception):
    """An error answer: raised by a server's handler to answer exactly this, and by a client's
    call that was answered so."""


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class Schema:
    """What one value must be."""

    def check(self, value: Any, what: str) -> Any:
        """``value`` as the program uses it; :class:`WireError` naming ``what`` otherwise."""
        raise NotImplementedError


def integer(value: Any, what: str, lo: int = 0, hi: int = MAX_INT) -> int:
    """``value`` as an int in ``[lo, hi]`` (a JSON bool is not one); :class:`WireError` naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise WireError(f"{what} must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise WireError(f"{what} must be in [{lo}, {hi}], got {value}")
    return value


def text(value: Any, what: str, limit: int) -> str:
    """A string of at most ``limit`` characters, without control characters."""
    if not isinstance(value, str):
        raise WireError(f"{what} must be a string, got {type(value).__name__}")
    if len(value) > limit:
        raise WireError(f"{what} is longer than {limit} characters")
    if _CONTROL.search(value):
        raise WireError(f"{what} holds control characters")
    return value


@dataclass(frozen=True)
class Int(Schema):
    lo: int = 0
    hi: int = MAX_INT

    def check(self, value: Any, what: str) -> int:
        if value.__class__ is int and self.lo <= value <= self.hi:  # the common case, at once
            return int(value)
        return integer(value, what, self.lo, self.hi)


@dataclass(frozen=True)
class Float(Schema):
    """A finite number (an integer too) in ``[lo, hi]``, as a float."""

    lo: float = 0.0
    hi: float = float(MAX_INT)

    def check(self, value: Any, what: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise WireError(f"{what} must be a number, got {type(value).__name__}")
        if not (math.isfinite(value) and self.lo <= value <= self.hi):
            raise WireError(f"{what} must be in [{self.lo:g}, {self.hi:g}], got {value!r:.40}")
        return float(value)


@dataclass(frozen=True)
class Bool(Schema):
    def check(self, value: Any, what: str) -> bool:
        if not isinstance(value, bool):
            raise WireError(f"{what} must be true or false")
        return value


@dataclass(frozen=True)
class Str(Schema):
    """A string of at most ``limit`` characters; ``plain``: without control characters (a
    name, a label); ``empty``: may be ""; ``choices``: one of these."""

    limit: int = 1 << 20
    plain: bool = False
    empty: bool = True
    choices: frozenset[str] | None = None

    def check(self, value: Any, what: str) -> str:
        if self.plain:
            text(value, what, self.limit)
        elif not isinstance(value, str):
            raise WireError(f"{what} must be a string, got {type(value).__name__}")
        elif len(value) > self.limit:
            raise WireError(f"{what} is longer than {self.limit} characters")
        if not (value or self.empty):
            raise WireError(f"{what} must not be empty")
        if self.choices is not None and value not in self.choices:
            raise WireError(f"{what} must be one of {', '.join(sorted(self.choices))}, got {value!r:.40}")
        return str(value)


def Choice(*values: str) -> Str:
    """One of these words."""
    return Str(max(map(len, values)), choices=frozenset(values))


@dataclass(frozen=True)
class Null(Schema):
    def check(self, value: Any, what: str) -> None:
        if value is not None:
            raise WireError(f"{what} must be null")


@dataclass(frozen=True)
class Opt(Schema):
    """``None`` or what ``schema`` says."""

    schema: Schema

    def check(self, value: Any, what: str) -> Any:
        return None if value is None else self.schema.check(value, what)


@dataclass(frozen=True)
class Check(Schema):
    """A function of the protocol's own, ``fn(value, what)`` (cross-field rules, shared wording)."""

    fn: Callable[[Any, str], Any]

    def check(self, value: Any, what: str) -> Any:
        return self.fn(value, what)


@dataclass(frozen=True)
class List(Schema):
    """A list of at most ``limit`` items (a tuple from execnet too), each ``item``; ``each``:
    how an item is named in an error (``{what}``: the list's name)."""

    item: Schema
    limit: int = 4096
    each: str = "an item of {what}"

    def check(self, value: Any, what: str) -> list[Any]:
        if not isinstance(value, (list, tuple)) or len(value) > self.limit:
            raise WireError(f"{what} must be a list of at most {self.limit} items")
        if not value:
            return []
        label = self.each.format(what=what)
        check = self.item.check
        return [check(item, label) for item in value]


class Row(Schema):
    """A list of a fixed length whose fields are each their own: back as a tuple."""

    def __init__(self, *fields: Schema, names: Iterable[str] = ()) -> None:
        self.fields = fields
        self.names = tuple(names)

    def check(self, value: Any, what: str) -> tuple[Any, ...]:
        if not isinstance(value, (list, tuple)) or len(value) != len(self.fields):
            shape = f"[{', '.join(self.names)}]" if self.names else f"{len(self.fields)} fields"
            raise WireError(f"{what} must be {shape}, got {value!r:.80}")
        return tuple(f.check(v, what) for f, v in zip(self.fields, value, strict=True))


class Either(Schema):
    """The first of ``schemas`` that takes the value."""

    def __init__(self, *schemas: Schema) -> None:
        self.schemas = schemas

    def check(self, value: Any, what: str) -> Any:
        error: WireError | None = None
        for schema in self.schemas:
            try:
                return schema.check(value, what)
            except WireError as exc:
                error = error or exc
        assert error is not None
        raise error


class Tagged(Schema):
    """``[tag, body]``, the body as its tag says: back as a ``(tag, body)`` tuple."""

    def __init__(self, bodies: Mapping[str, Schema]) -> None:
        self.bodies = dict(bodies)

    def check(self, value: Any, what: str) -> tuple[str, Any]:
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise WireError(f"{what} must be [kind, body], got {value!r:.80}")
        tag, body = value
        schema = self.bodies.get(tag) if isinstance(tag, str) else None
        if schema is None:
            raise WireError(f"{what} must be one of {', '.join(self.bodies)}, got {tag!r:.40}")
        return tag, schema.check(body, f"{what} ({tag})")


@dataclass(frozen=True)
class StrKey(Schema):
    """A dictionary key that is a string (as the ``key`` schema says)."""

    key: Schema = Str(1024)

    def check(self, value: Any, what: str) -> Any:
        return self.key.check(value, what)


@dataclass(frozen=True)
class IntKey(Schema):
    """A dictionary key that is an integer in ``[lo, hi]``: JSON made it a string, execnet did not."""

    lo: int = 0
    hi: int = MAX_INT

    def check(self, value: Any, what: str) -> int:
        if isinstance(value, str) and value.isdigit() and len(value) <= 20 and value.isascii():
            value = int(value)
        return integer(value, what, self.lo, self.hi)


@dataclass(frozen=True)
class Dict(Schema):
    """A dictionary of at most ``limit`` entries, each key as ``key`` says, each value as ``value``."""

    key: Schema
    value: Schema
    limit: int = 4096
    each: str = "an entry of {what}"

    def check(self, value: Any, what: str) -> dict[Any, Any]:
        if not isinstance(value, dict) or len(value) > self.limit:
            raise WireError(f"{what} must be an object of at most {self.limit} entries")
        if not value:
            return {}
        label = self.each.format(what=what)
        key, item = self.key.check, self.value.check
        return {key(k, f"a key of {what}"): item(v, label) for k, v in value.items()}


_MISSING = object()


class Obj(Schema):
    """An object with these fields and no other: ``fields`` are required; ``optional`` may be
    absent (then ``defaults`` says what they are, else they stay absent). ``name``: how the
    object is named in its fields' errors (``"a held lease"``: "a held lease's memory ...";
    "": the field's bare name). ``into``: a class the checked fields are passed to, by name."""

    def __init__(
        self,
        fields: Mapping[str, Schema] | None = None,
        optional: Mapping[str, Schema] | None = None,
        defaults: Mapping[str, Any] | None = None,
        name: str = "",
        into: Callable[..., Any] | None = None,
    ) -> None:
        self.required = dict(fields or {})
        self.optional = dict(optional or {})
        self.defaults = dict(defaults or {})
        self.name = name
        self.into = into
        self.labels = {k: f"{name}'s {k}" if name else k for k in [*self.required, *self.optional]}
        self._all = {**self.required, **self.optional}
        self._required_keys = frozenset(self.required)
        self._defaults = tuple(self.defaults.items())

    @property
    def keys(self) -> list[str]:
        return list(self._all)

    def check(self, value: Any, what: str) -> Any:
        if not isinstance(value, dict):
            raise WireError(f"{self.name or what or 'a message'} must be an object, got {type(value).__name__}")
        out: dict[str, Any] = {}
        known, labels = self._all, self.labels
        try:
            for key, item in value.items():
                out[key] = known[key].check(item, labels[key])
        except KeyError:
            unknown = next((k for k in value if k not in known), _MISSING)
            if unknown is _MISSING:
                raise  # a checker's own
            raise WireError(f"{self.name or what or 'a message'} has no field {str(unknown)!r:.40}") from None
        if not self._required_keys <= out.keys():
            missing = [k for k in self.required if k not in out]
            raise WireError(f"{self.name or what or 'a message'} lacks {', '.join(map(repr, missing))}")
        for key, default in self._defaults:
            if key not in out:
                out[key] = default
        return out if self.into is None else self.into(**out)


@dataclass(frozen=True)
class Json(Schema):
    """Any JSON value (within the frame's bounds): for a part that its own reader checks
    field by field (a run's settings, ``Settings.from_wire``), or that is only shown."""

    def check(self, value: Any, what: str) -> Any:
        return value


@dataclass(frozen=True)
class Blob(Schema):
    """Bytes, as base64 text (:func:`blob`) of at most ``limit`` bytes."""

    limit: int = 1 << 30

    def check(self, value: Any, what: str) -> bytes:
        if not isinstance(value, str) or len(value) > (self.limit + 2) // 3 * 4:
            raise WireError(f"{what} must be base64 text of at most {self.limit} bytes")
        try:
            return base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise WireError(f"{what} is not base64") from None


def blob(data: bytes) -> str:
    """``data`` as :class:`Blob` reads it."""
    return base64.b64encode(data).decode("ascii")


# -- protocols ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """A message a client sends: its fields (an :class:`Obj`, without ``op`` and ``id``) and
    its answer's value (``None``: one-way, never answered)."""

    fields: Obj
    answer: Schema | None = None


@dataclass(frozen=True)
class Protocol:
    """What crosses one kind of connection: ``calls`` from a client (by kind), ``events``
    from the server unasked (by kind). The wire form of each (:mod:`.server`):

    - a call ``{"op": kind, "id": n, ...fields}`` (one-way: no ``id``), answered
      ``{"re": n, "ok": answer}`` or ``{"re": n, "error": "why"}``;
    - an event ``{"op": kind, ...fields}``; or, in a protocol whose events predate ``op``
      (``keyed``: the arbiter's), an object whose first key is its kind, checked whole.
    """

    name: str  # as errors name the peer: "the machine's arbiter", "the pytest-gpu broker"
    calls: Mapping[str, Call] = field(default_factory=dict)
    events: Mapping[str, Obj] = field(default_factory=dict)
    keyed: bool = False

    def event(self, kind: str, body: Any) -> Any:
        """``body`` of event ``kind`` checked; :class:`WireError` for a kind this protocol lacks."""
        schema = self.events.get(kind)
        if schema is None:
            raise WireError(f"{self.name} sent an event {kind!r:.40}, which is none of {', '.join(self.events)}")
        return schema.check(body, f"its {kind!r} event")

    def answer(self, kind: str, value: Any) -> Any:
        """The answer to call ``kind`` checked."""
        schema = self.calls[kind].answer
        return None if schema is None else schema.check(value, f"its answer to {kind!r}")
