"""Whether a failed test's cause was outside it (*infrastructure*) or its own (pure).

pytest-gpu sees things a test does not: memory that processes outside the run take on its
GPUs, a process whose CUDA an earlier test broke, the ports it leased, its rank pool's
start, the worker that ran it. A failure is classed *infrastructure* only when one of these
was seen, with the failure of the kind it explains:

- an out-of-memory error while memory outside the run (other processes: a notebook, a
  training job, another user's program) grew on one of the test's GPUs during the test, by
  at least :data:`GROWTH_MIN` (below that, a driver's or allocator's noise);
- its lease refused because this process is quarantined: an *earlier* test's sticky CUDA
  error broke the process's CUDA (the test that raised the sticky error is its own failure:
  its kernels raised it);
- ``EADDRINUSE`` while the test held ports leased from the run (another program took one
  between the lease and the bind);
- its rank pool's collective could not be initialised in time (ranks not connected or not
  through the process group's set-up within ``--dist-init-timeout``'s bound);
- the xdist worker (or ``--gpu-nodes`` node) running it was lost.

Everything else is the test's own failure: an assertion, an out-of-memory with nothing
outside growing (its request is too small, or it leaks), any other error. The evidence is
gathered where it is (:mod:`pytest_gpu.run.infra`); this module only decides.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from ..base.requests import format_size

INFRASTRUCTURE = "infrastructure"
CLASS_PROPERTY = "gpu_failure_class"  # junit property: "infrastructure"
REASON_PROPERTY = "gpu_failure_reason"  # junit property: the one-line reason
RETRY_PROPERTY = "gpu_retry"  # junit property: "passed on retry" or "failed on retry"
FIRST_PROPERTY = "gpu_first_failure"  # junit property: the first failure's reason and line
SECTION = "pytest-gpu: infrastructure failure"  # the report section of a classed failure
FIRST_SECTION = "pytest-gpu: first failure (infrastructure), retried"  # the retry's report keeps it
GROWTH_MIN = 64 * 2**20  # growth outside the run smaller than this is noise, not a cause


@dataclass(frozen=True)
class Evidence:
    """What pytest-gpu saw around one failed phase of a test."""

    out_of_memory: bool = False  # the failure is a GPU out-of-memory error
    # GPU index -> bytes memory outside the run grew by there while the test ran (its GPUs only)
    foreign_growth: Mapping[int, int] = field(default_factory=dict)
    quarantined_by: str | None = None  # the earlier test whose sticky CUDA error refused this one's lease
    address_in_use: bool = False  # the failure is an EADDRINUSE
    leased_ports: tuple[int, ...] = ()  # the ports the test held from the run then
    init_timeout: str | None = None  # its rank pool's collective did not initialise in time: the pool's words
    lost: str | None = None  # the worker or node running it was lost: how
    gpus: tuple[int, ...] = ()  # the GPUs the test held (a retry avoids the failure's)


@dataclass(frozen=True)
class Classified:
    """An infrastructure failure: why (one line), and the GPUs it happened on."""

    reason: str
    gpus: tuple[int, ...] = ()
    kind: str = INFRASTRUCTURE
    retryable: bool = True  # False: no fresh resources can be had here (this process is broken)


def classify(evidence: Evidence) -> Classified | None:
    """The failure's class: :class:`Classified` when its cause was outside the test, ``None``
    when it is the test's own (see the module docstring)."""
    if evidence.lost is not None:
        return Classified(f"lost: {evidence.lost}", evidence.gpus)
    if evidence.quarantined_by is not None:
        return Classified(
            f"quarantine: {evidence.quarantined_by} left this process's CUDA unusable (a sticky CUDA error) "
            "before this test's lease",
            evidence.gpus,
            retryable=False,  # the process stays broken until it exits: a fresh worker takes the next tests
        )
    if evidence.init_timeout is not None:
        return Classified(f"collective initialisation timed out: {evidence.init_timeout}", evidence.gpus)
    if evidence.address_in_use and evidence.leased_ports:
        ports = ", ".join(map(str, evidence.leased_ports))
        return Classified(
            f"port clash: EADDRINUSE on a leased port ({ports}): a process outside the run bound it",
            evidence.gpus,
        )
    grown = {i: n for i, n in sorted(evidence.foreign_growth.items()) if n >= GROWTH_MIN}
    if evidence.out_of_memory and grown:
        where = ", ".join(f"GPU {i} (+{format_size(n)})" for i, n in grown.items())
        return Classified(f"out of memory while memory outside the run grew on {where}", tuple(grown))
    return None


def address_in_use(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is an ``EADDRINUSE``: an ``OSError`` with that
    errno, or a framework's error saying so (torch's ``DistNetworkError``: "address already in use")."""
    for found in chain(exc):
        if isinstance(found, OSError) and found.errno == errno.EADDRINUSE:
            return True
        text = str(found)[:2000].lower()
        if "address already in use" in text or "eaddrinuse" in text:
            return True
    return False


def chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and what caused it (``__cause__``, ``__context__``), each once, however they loop."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        found = pending.pop()
        if found is None or id(found) in seen:
            continue
        seen.add(id(found))
        yield found
        pending += [found.__cause__, found.__context__]


def growth(before: Mapping[int, int], after: Mapping[int, int]) -> dict[int, int]:
    """GPU index -> how much memory outside the run grew by between two samples (GPUs in both)."""
    return {i: after[i] - before[i] for i in after if i in before and after[i] > before[i]}


def first_failure(reason: str, line: str) -> str:
    """The first failure as a retried test's report keeps it: its class's reason, then its line."""
    return f"{reason}\n{line}" if line else reason
