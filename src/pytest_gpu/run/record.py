"""A test's own record, built once at collection: what it asks for and how it must run.

The lifecycle (setup, teardown, report), the scheduler's catalog, the rank-pool runner
and fixture leases all read it from here (:func:`needs`), instead of each keeping a
stash key of its own. The run of the process is under :data:`RUN_KEY` of the config.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import pytest

from ..base.distspec import DistSpec
from ..base.requests import GpuRequest

if TYPE_CHECKING:
    from ..vendors.devices import Inventory
    from .session import GpuRun

RUN_KEY: pytest.StashKey[GpuRun] = pytest.StashKey()
# the user property of a test skipped at collection because this run cannot run it: why, in a
# few words ("no GPUs — NVML unavailable: ..."); the run's summary counts its skips by it
SKIP_PROPERTY = "gpu_skipped"
# ... when it is the machine's CPUs or RAM, not its GPUs, that the test asks too much of
HOST_SKIP_WORDS = "more CPUs or RAM than the machine has"


def gpu_skip_words(inventory: Inventory, node: str | None = None) -> str:
    """Why a GPU request can never run here, in the few words the summary groups skips by;
    ``node``: ``--gpu-nodes``, the node whose ``inventory`` it is (the run's own has none)."""
    if inventory.devices:
        whose = f"node {node}'s" if node else "this run's"
        return f"larger than {whose} {inventory.describe()}"
    return f"no GPUs — {inventory.note or inventory.source}"


def skip_why(request: GpuRequest, run: GpuRun) -> str:
    """A never-fitting request's reason in the few words the summary groups skips by."""
    if request.count and (
        not run.inventory.devices or run.never_fits(replace(request, cpus=0, host_memory=0)) is not None
    ):
        return gpu_skip_words(run.inventory, run.node)
    return HOST_SKIP_WORDS


def skip_at_run_time(item: pytest.Item | None, request: GpuRequest, run: GpuRun) -> None:
    """Before a test skips itself while it runs (a ``gpu_request`` block, a fixture's lease too
    large): record why for the summary, as collection does (:data:`SKIP_PROPERTY`). Said here,
    where the inventory the request was checked against is: under ``--gpu-nodes`` that is the
    worker's node's, which the controller (leasing no GPU itself) cannot word."""
    if item is not None:
        item.user_properties.append((SKIP_PROPERTY, skip_why(request, run)))


@dataclass
class TestNeeds:
    """What a collected test needs, set once by the collection checks.

    ``request``: its own lease (its ``gpu`` marker, conventions, ``host_resources``), or
    ``None``; ``dist``: its ``distributed`` marker (the rank pool's GPUs are the pool's);
    ``serial``: a ``gpu_serial`` test, run alone; ``oversize``: why it can never run here,
    when ``--gpu-oversize=fail`` makes that a failure at setup; ``isolated``: ``gpu(...,
    isolate=True)``, its body runs in a one-rank pool holding ``request`` (``dist`` is that
    pool's spec), so the test process itself holds no lease for it; ``source``: where its
    memory came from (:func:`pytest_gpu.run.lifecycle.item_needs`).
    """

    request: GpuRequest | None = None
    dist: DistSpec | None = None
    serial: bool = False
    oversize: str | None = None
    isolated: bool = False
    # where its memory came from: "marker", "file" (--gpu-requests), "learned" (--gpu-learn), "default";
    # None: no request for GPUs (or a gpu_serial test's, every GPU)
    source: str | None = None

    __test__ = False  # not a test class, whatever pytest's collection thinks

    def scheduled_request(self, default_memory: Any) -> GpuRequest | None:
        """What the scheduler plans the test with: its pool's GPUs when it runs on one, else its own."""
        if self.dist is not None:
            return self.dist.gpu_request(default_memory) or self.request
        return self.request


_NEEDS_KEY = pytest.StashKey[TestNeeds]()
_NONE = TestNeeds()  # what a test nobody recorded needs (collected by another plugin's hook, say)


def needs(item: pytest.Item) -> TestNeeds:
    """The record of ``item`` (read-only for a test collected before the checks ran)."""
    return item.stash.get(_NEEDS_KEY, _NONE)


def record(item: pytest.Item) -> TestNeeds:
    """The record of ``item``, made on first use: for the collection checks to fill in."""
    found = item.stash.get(_NEEDS_KEY, None)
    if found is None:
        found = item.stash[_NEEDS_KEY] = TestNeeds()
    return found


def effective(defs: Any, name: str) -> list[Any]:
    """The definitions of fixture ``name`` a test runs: the closest, and those it overrides by
    requesting its own name."""
    out: list[Any] = []
    for fixturedef in reversed(list(defs or ())):
        out.append(fixturedef)
        if name not in getattr(fixturedef, "argnames", ()):
            break
    return out
