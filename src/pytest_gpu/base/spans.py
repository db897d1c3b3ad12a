"""A test's leases as its report carries them: the ``user_properties`` pytest-gpu adds.

The test process writes them at teardown (:mod:`pytest_gpu.run.lifecycle`); the xdist
controller reads them from the reports (:mod:`pytest_gpu.report.timeline`,
:mod:`pytest_gpu.report.summary`). They also end up in ``--junitxml`` as they are, so
values stay plain strings and numbers.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import astuple, dataclass, fields
from typing import Any, TypedDict, cast


@dataclass(frozen=True)
class LeaseSpan:
    """One lease a test held: GPUs, bytes per GPU, and when it was asked for, granted, released
    (wall-clock seconds since the epoch)."""

    gpus: tuple[int, ...]
    memory: int
    exclusive: bool
    asked: float
    granted: float
    released: float

    def to_wire(self) -> list[Any]:
        """The fields in order, ``[gpus, memory, exclusive, asked, granted, released]``: a
        row, not an object, since a report carries one per lease of every test."""
        return [list(value) if isinstance(value, tuple) else value for value in astuple(self)]

    @classmethod
    def from_wire(cls, row: Sequence[Any]) -> LeaseSpan:
        """The inverse of :meth:`to_wire`; raises ValueError for a row of another length."""
        names = [f.name for f in fields(cls)]
        if len(row) != len(names):
            raise ValueError(f"a lease span has {len(names)} fields ({', '.join(names)}), got {len(row)}")
        values = dict(zip(names, row, strict=True))
        values["gpus"] = tuple(int(g) for g in values["gpus"])  # a JSON list
        return cls(**values)


@dataclass(frozen=True)
class HeldRow:
    """Another holder's holding (a fixture's, a rank pool's) as the report of the test during
    which it was judged carries it: who, its lease spans, and its violations then."""

    kind: str  # fixture, pool
    name: str
    spans: tuple[LeaseSpan, ...]
    violations: int

    def to_wire(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "name": self.name,
            "spans": [span.to_wire() for span in self.spans],
            "violations": self.violations,
        }

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> HeldRow:
        """The inverse of :meth:`to_wire`; raises ValueError for missing or unknown keys."""
        names = {"kind", "name", "spans", "violations"}
        if set(data) != names:
            raise ValueError(f"a held row has the keys {sorted(names)}, got {sorted(data)}")
        spans = tuple(LeaseSpan.from_wire(row) for row in data["spans"])
        return cls(str(data["kind"]), str(data["name"]), spans, int(data["violations"]))


class GpuProperties(TypedDict, total=False):
    """The ``user_properties`` of a test that held a lease (or whose fixtures' leases it
    judged), as ``(key, value)`` pairs of its teardown report; the keys are the wire form.

    ``gpu_notes`` is there only when something could not be checked, ``gpu_held`` only when
    other holders' leases (fixtures', rank pools') were judged during the test,
    ``gpu_unseen_lag`` only when amdsmi's list may not have shown the test; the others always.
    """

    gpu_indices: str  # "0,1": the GPUs it used
    gpu_wait_seconds: float  # seconds it waited for its leases
    gpu_peak_bytes: str  # "0=1024,1=0" (see format_peaks); "" when nothing was measured
    gpu_violations: int
    gpu_request: str  # its request, described ("" without one of its own)
    gpu_request_bytes: int  # bytes per GPU it asked for (0: none to suggest from)
    gpu_leases: str  # JSON: one LeaseSpan.to_wire() row per lease (see format_spans)
    gpu_notes: str  # what could not be verified, one line each
    gpu_held: str  # JSON: one HeldRow.to_wire() per other holder judged during the test (see format_held)
    # AMD: the process list's lag (seconds), when the test was verified from a list that may not
    # show it yet (it was shorter than the lag and nothing waited; Verdict.unseen_lag)
    gpu_unseen_lag: float


def gpu_properties(user_properties: Iterable[tuple[str, object]]) -> GpuProperties:
    """A report's ``user_properties`` read as :class:`GpuProperties` (other plugins' keys
    pass through unchecked; values keep the types the writer gave them)."""
    return cast(GpuProperties, dict(user_properties))


def format_spans(spans: Iterable[LeaseSpan]) -> str:
    return json.dumps([span.to_wire() for span in spans])


def parse_spans(text: str) -> list[LeaseSpan]:
    return [LeaseSpan.from_wire(row) for row in json.loads(text)]


def format_held(rows: Iterable[HeldRow]) -> str:
    return json.dumps([row.to_wire() for row in rows])


def parse_held(text: str) -> list[HeldRow]:
    return [HeldRow.from_wire(row) for row in json.loads(text)]


def format_peaks(peaks: Mapping[int, int]) -> str:
    """``{0: 1024, 1: 0}`` -> ``"0=1024,1=0"`` (GPU index = highest bytes measured)."""
    return ",".join(f"{index}={peak}" for index, peak in peaks.items())


def parse_peaks(text: str) -> dict[int, int]:
    """The inverse of :func:`format_peaks`; ``""`` (nothing measured) is ``{}``."""
    pairs = (part.split("=", 1) for part in text.split(",") if "=" in part)
    return {int(index): int(peak) for index, peak in pairs}
