"""Written requests (``--gpu-requests``): each test's measured memory per GPU, in a file kept
with the suite, reviewed in a diff and read by later runs.

The format (:func:`parse`, :func:`render`: pure), one line per test, sorted by node id::

    # comment lines and blank lines are kept out of the way
    margin = 25%, floor 256MiB
    tests/test_model.py::test_forward = 1344MiB (peak 1050MiB)
    tests/test_model.py::test_train[fp16] = 4GiB (passes at 3200MiB)
    tests/test_model.py::test_by_hand = 2GiB

``margin``: the line every file has once, before its tests: a request is its test's peak
(or, bisected, the smallest cap it passed under) times ``1 + margin``, at least ``floor``,
rounded up to :data:`STEP`. A test's line: its node id, `` = ``, its request per GPU, and
what it was sized from; a line without the parenthesis is a request set by hand (kept as
written until a run measures the test again). :func:`load` and :func:`save` are the file's I/O.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from collections.abc import Iterable, Mapping
from contextlib import suppress
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..base.requests import SizeError, parse_size

MIB, GIB = 2**20, 2**30
STEP = 64 * MIB  # requests are rounded up to this: a peak's small wobble does not rewrite the line
MARGIN_FORM = "a percentage and an optional floor, such as '25%' or '25%,256MiB'"
LINE_FORM = (
    "'NODEID = SIZE', 'NODEID = SIZE (peak SIZE)' or 'NODEID = SIZE (passes at SIZE)', "
    "after one 'margin = PCT%, floor SIZE' line"
)
HEADER = (
    "# pytest-gpu written requests: memory per GPU for each test, sized from what it measured.\n"
    "# Written by `pytest --gpu-write-requests`, checked by `pytest --gpu-check-requests`.\n"
    "# A test's gpu marker that names its memory wins over its line here.\n"
)
_MARGIN_LINE = re.compile(r"margin\s*=\s*(?P<pct>\d+(?:\.\d+)?)\s*%\s*,\s*floor\s+(?P<floor>\S+)")
_ENTRY = re.compile(r"(?P<node>\S.*?\S|\S) = (?P<size>\S+)(?: \((?P<kind>peak|passes at) (?P<measured>\S+)\))?")


class WrittenError(ValueError):
    """A file or option of written requests that cannot be read; the message names where and what was expected."""


@dataclass(frozen=True)
class Margin:
    """What a request adds to a measured figure: ``fraction`` of it, at least ``floor`` in all."""

    fraction: float = 0.25
    floor: int = 256 * MIB

    @classmethod
    def parse(cls, text: str) -> Margin:
        """``'25%'`` or ``'25%,256MiB'`` (the floor is 256MiB unless given); raises :class:`WrittenError`."""
        pct, comma, floor_text = text.strip().partition(",")
        match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*%", pct.strip())
        if match is None:
            raise WrittenError(f"expected {MARGIN_FORM}, got {text!r}")
        floor = cls.floor
        if comma:
            try:
                floor = parse_size(floor_text.strip())
            except SizeError as exc:
                raise WrittenError(f"expected {MARGIN_FORM}, got {text!r}: {exc}") from None
        return cls(float(match.group(1)) / 100, floor)

    def words(self) -> str:
        return f"{_percent(self.fraction)}, floor {size_text(self.floor)}"

    def request(self, measured: int) -> int:
        """The request for a test that measured ``measured`` bytes per GPU."""
        wanted = max(math.ceil(measured * (1 + self.fraction)), self.floor, 1)
        return -(-wanted // STEP) * STEP


@dataclass(frozen=True)
class Entry:
    """One test's line: its ``request`` per GPU, and the ``peak`` or bisected cap (``passes``)
    it was sized from (both ``None``: set by hand)."""

    request: int
    peak: int | None = None
    passes: int | None = None


@dataclass
class Written:
    """A file of written requests: its margin and a line per test."""

    margin: Margin = field(default_factory=Margin)
    entries: dict[str, Entry] = field(default_factory=dict)


@dataclass(frozen=True)
class Stale:
    """A test whose measured peak no longer fits its written request with the margin."""

    nodeid: str
    written: int
    peak: int | None  # None: it ran out of memory under its written request (its peak is not known)
    needed: int  # the request this run would write (the written one, at least, after an out-of-memory)

    def words(self) -> str:
        if self.peak is None:
            return f"{self.nodeid}: ran out of memory under its written request of {size_text(self.written)}"
        return (
            f"{self.nodeid}: written {size_text(self.written)}, peaked at {size_text(self.peak)}: "
            f"now needs {size_text(self.needed)}"
        )


def size_text(nbytes: int) -> str:
    """A size as the file writes it: whole GiB, else MiB (rounded up): parse_size reads it back."""
    if nbytes and nbytes % GIB == 0:
        return f"{nbytes // GIB}GiB"
    return f"{-(-nbytes // MIB)}MiB"


def _percent(fraction: float) -> str:
    return f"{fraction * 100:g}%"


def parse(text: str, path: str) -> Written:
    """The file's ``text`` (``path`` names it in errors); raises :class:`WrittenError` naming the
    file, the line and what was expected."""
    margin: Margin | None = None
    entries: dict[str, Entry] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{path}:{number}"
        if re.match(r"margin\s*=", line):
            found = _MARGIN_LINE.fullmatch(line)
            if found is None:
                raise WrittenError(f"{where}: cannot read {line!r}; expected 'margin = PCT%, floor SIZE'")
            if margin is not None:
                raise WrittenError(f"{where}: a second margin line; expected one, before the tests")
            if entries:
                raise WrittenError(f"{where}: the margin line comes after tests; expected it before them")
            floor = _size(found.group("floor"), where, "the floor")
            margin = Margin(float(found.group("pct")) / 100, floor)
            continue
        match = _ENTRY.fullmatch(line)
        if match is None:
            raise WrittenError(f"{where}: cannot read {line!r}; expected {LINE_FORM}")
        if margin is None:
            raise WrittenError(f"{where}: a test before the margin line; expected 'margin = PCT%, floor SIZE' first")
        node = match.group("node")
        if node in entries:
            raise WrittenError(f"{where}: {node} is written twice; expected one line per test")
        request = _size(match.group("size"), where, f"{node}'s request")
        if request <= 0:
            raise WrittenError(f"{where}: {node}'s request is {match.group('size')!r}; expected a positive size")
        measured = match.group("measured")
        entry = Entry(request)
        if measured is not None:
            figure = _size(measured, where, f"{node}'s {match.group('kind')}")
            entry = replace(entry, peak=figure) if match.group("kind") == "peak" else replace(entry, passes=figure)
        entries[node] = entry
    if margin is None:
        if entries:  # unreachable: a test line before the margin is an error above
            raise WrittenError(f"{path}: no margin line")
        margin = Margin()
    return Written(margin, entries)


def _size(text: str, where: str, what: str) -> int:
    try:
        return parse_size(text)
    except SizeError as exc:
        raise WrittenError(f"{where}: {what}: {exc}") from None


def render(written: Written) -> str:
    """The file's text: the header, the margin, one line per test sorted by node id."""
    lines = [HEADER.rstrip("\n"), f"margin = {written.margin.words()}"]
    for node in sorted(written.entries):
        entry = written.entries[node]
        line = f"{node} = {size_text(entry.request)}"
        if entry.passes is not None:
            line += f" (passes at {size_text(entry.passes)})"
        elif entry.peak is not None:
            line += f" (peak {size_text(entry.peak)})"
        lines.append(line)
    return "\n".join(lines) + "\n"


def updated(
    old: Written | None, margin: Margin, peaks: Mapping[str, int], passes: Mapping[str, int] | None = None
) -> Written:
    """``old`` with this run's measurements: a test measured now gets a line sized from its
    ``peaks`` (or bisected cap, ``passes``, which wins); a test not measured keeps its line,
    sized again under ``margin`` when it says what it was sized from (a hand-set line stays)."""
    entries: dict[str, Entry] = {}
    for node, entry in (old.entries if old is not None else {}).items():
        figure = entry.passes if entry.passes is not None else entry.peak
        entries[node] = entry if figure is None else replace(entry, request=margin.request(figure))
    for node, peak in peaks.items():
        entries[node] = Entry(margin.request(peak), peak=-(-peak // MIB) * MIB)
    for node, cap in (passes or {}).items():
        entries[node] = Entry(margin.request(cap), passes=cap)
    return Written(margin, entries)


def stale(written: Written, peaks: Mapping[str, int], out_of_memory: Iterable[str] = ()) -> list[Stale]:
    """Tests whose peak this run, with the file's margin, is above their written request (the
    margin is eaten: the next growth is an out-of-memory), and tests that ran out of memory
    under it; sorted by node id."""
    found: dict[str, Stale] = {}
    for node, peak in peaks.items():
        entry = written.entries.get(node)
        if entry is not None and written.margin.request(peak) > entry.request:
            found[node] = Stale(node, entry.request, peak, written.margin.request(peak))
    for node in out_of_memory:
        entry = written.entries.get(node)
        if entry is not None and node not in found:
            found[node] = Stale(node, entry.request, None, entry.request)
    return [found[node] for node in sorted(found)]


# -- the file's I/O ------------------------------------------------------------------


def load(path: str) -> Written:
    """The file at ``path``; raises :class:`WrittenError` (unreadable, or a bad line)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise WrittenError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    return parse(text, path)


def load_if_any(path: str) -> Written | None:
    """:func:`load`, or ``None`` when there is no file yet (a first ``--gpu-write-requests``)."""
    return load(path) if os.path.exists(path) else None


def save(path: str, written: Written) -> None:
    """Write ``written`` to ``path`` whole or not at all (a reader never sees half a file)."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=str(target.parent) or ".")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(render(written))
        os.replace(tmp, target)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise
