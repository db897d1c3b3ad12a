"""Who holds leases in a test process, and the one way each holds, checks and gives one back.

Every lease of the run is held by an :class:`Owner`: a test (its marker's lease and its
``gpu_request`` sections), a fixture of any scope (``gpu_lease_factory``), a rank pool
(its GPUs for every rank) or the run's Ray head (processes only: it leases no GPU).
:func:`hold` acquires a :class:`Holding` (through the run's
:meth:`GpuRun.hold <pytest_gpu.run.session.GpuRun.hold>`); :meth:`Holding.release` is the
only way it ends (confinement undone, verified, given
back, its span kept for the report); :meth:`Holding.check` verifies one that lives on
across tests (a warm pool, after each test it ran). :func:`broke` is the one wording of
a holding's violations, whoever the owner.

Other holders' holdings are reported with the test during which they were judged (a
fixture's at the teardown that ended it, a pool's after each test it ran) as
:class:`~pytest_gpu.base.spans.HeldRow` rows, so the summary counts their
violations and ``--gpu-trace`` draws their GPUs.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import pytest

from ..base.requests import GpuRequest
from ..base.spans import HeldRow, LeaseSpan
from ..gpu.isolation import GpuLease
from ..gpu.verification import SharedVerifier, Verdict
from .session import ActiveLease, GpuRun

OwnerKind = Literal["test", "fixture", "pool", "ray"]


@dataclass(frozen=True)
class Owner:
    """Who holds a lease: ``kind``, ``name`` (how the broker and the report name it: a test's
    node id, a fixture's label, a pool's description) and ``node``, the test during whose
    run it started (a fixture's or pool's first test; a test's own node id)."""

    kind: OwnerKind
    name: str
    node: str = ""


def hold(run: GpuRun, owner: Owner, request: GpuRequest, *, confine: bool = True) -> Holding:
    """Wait for ``request`` on behalf of ``owner``, confine this process to it (or, with
    ``confine=False``, leave this process as it is: a lease for the processes it starts) and
    start verifying (:meth:`GpuRun.hold <pytest_gpu.run.session.GpuRun.hold>`);
    :meth:`Holding.release` is the one way it ends."""
    return Holding(owner, run.hold(owner.name, request, confine=confine))


@dataclass(eq=False)
class Holding:
    """One lease an :class:`Owner` holds in this process, until :meth:`release`."""

    owner: Owner
    active: ActiveLease
    span: LeaseSpan | None = None  # once released
    checked_at: float = 0.0  # a long-lived holding: when its last check ended (its next span starts)

    @property
    def lease(self) -> GpuLease:
        return self.active.lease

    def release(self, run: GpuRun, others: Iterable[int] = ()) -> Verdict:
        """Undo the confinement, verify, give the lease back; ``others``: GPUs that other
        holdings of this process held meanwhile (their usage is theirs to judge)."""
        try:
            return run.finish(self.active, set(others), self.owner.name)
        finally:
            self.span = self.spans_since(self.active.granted, self.active.released or time.time())

    def check(self, run: GpuRun) -> tuple[Verdict, LeaseSpan]:
        """Verify a holding that lives on (a warm pool after a test): what was used since the
        last check, and the span of that window; the lease stays held."""
        verifier = self.active.verifier
        start = max(self.active.granted, self.checked_at)
        now = time.time()
        self.checked_at = now
        if run.settings.verify == "off" or verifier is None:  # None: host resources only, no GPU
            return Verdict(), self.spans_since(start, now)
        verdict = verifier.end(self.lease)
        verifier.begin(self.lease, self.active.owner_pid)
        return verdict, self.spans_since(start, now)

    def spans_since(self, start: float, stop: float) -> LeaseSpan:
        lease = self.lease
        asked = self.active.asked if start <= self.active.granted else start
        return LeaseSpan(tuple(lease.indices), lease.memory, lease.exclusive, asked, start, stop)


def broke(owner: Owner, violations: list[str], during: str = "") -> str:
    """The report's text for ``owner``'s violations (one wording for every kind of holder)."""
    if owner.kind == "fixture":
        violations = [v.replace("after the test", "after the fixture's teardown") for v in violations]
    lines = "\n".join(f"  - {v}" for v in violations)
    return f"pytest-gpu: {owner.name} broke its GPU lease{during}:\n{lines}"


def row(owner: Owner, spans: list[LeaseSpan], verdict: Verdict) -> HeldRow:
    """What the report carries of another holder's holding judged during a test."""
    return HeldRow(owner.kind, owner.name, tuple(spans), len(verdict.violations))


def separate(active: ActiveLease, gpus: set[int], whose: str, run: GpuRun) -> None:
    """On real GPUs, make ``active``'s verification leave the GPUs it shares with ``gpus`` unjudged."""
    if run.inventory.simulated:
        return
    shared = set(active.lease.indices) & gpus
    if shared and active.verifier is not None and not isinstance(active.verifier, SharedVerifier):
        active.verifier = SharedVerifier(active.verifier, shared, whose)


@dataclass
class TestState:
    """What pytest-gpu did for one test: its own holdings, and what it judged of others'."""

    main: Holding | None = None
    sections: list[Holding] = field(default_factory=list)
    verdict: Verdict = field(default_factory=Verdict)
    indices: set[int] = field(default_factory=set)
    waited: float = 0.0
    ports_owner: str | None = None
    request: GpuRequest | None = None
    leases: list[LeaseSpan] = field(default_factory=list)  # each lease held, for the report's timeline
    # leases of fixtures (any scope) this test used: their GPUs are theirs to judge (fixture_leases)
    fixture_gpus: set[int] = field(default_factory=set)
    view_saved: dict[str, str | None] | None = None  # the environment before the fixtures' GPUs were added
    violations: list[str] = field(default_factory=list)  # other holders' (fixtures, pools), named, judged now
    notes: list[str] = field(default_factory=list)  # theirs too: what could not be checked (the report's text)
    held_notes: list[str] = field(default_factory=list)  # the same, short, for the summary
    held: list[HeldRow] = field(default_factory=list)  # other holders' holdings judged during this test
    unseen_lag: float = 0.0  # theirs too: Verdict.unseen_lag of a holding judged during this test
    failures: list[BaseException] = field(default_factory=list)  # of setup and call: see lifecycle.release_failure

    def finish(self, run: GpuRun, holding: Holding) -> None:
        """Give ``holding`` (the test's own) back, keeping its verdict and its place on the timeline."""
        try:
            if self.fixture_gpus:
                separate(holding.active, self.fixture_gpus, "a fixture's lease", run)
            self.verdict.merge(holding.release(run, self.indices | self.fixture_gpus))
        finally:
            if holding.span is not None:
                self.leases.append(holding.span)

    def judged(self, owner: Owner, verdict: Verdict, spans: list[LeaseSpan], during: str = "") -> None:
        """Another holder's holding was judged during this test: its violations and notes, named."""
        self.unseen_lag = max(self.unseen_lag, verdict.unseen_lag)
        if verdict.violations:
            self.violations.append(broke(owner, verdict.violations, during))
        self.notes += [f"pytest-gpu: {owner.name}: not verified: {note}" for note in verdict.notes]
        for note in verdict.notes:
            if f"{owner.name}: {note}" not in self.held_notes:
                self.held_notes.append(f"{owner.name}: {note}")
        if spans or verdict.violations:
            self.held.append(row(owner, spans, verdict))

    __test__ = False  # not a test class, whatever pytest's collection thinks


STATE_KEY = pytest.StashKey[TestState]()
