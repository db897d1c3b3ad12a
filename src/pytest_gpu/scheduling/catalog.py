"""What the scheduler knows about each test, from a worker's collection to the controller.

xdist gives the controller node ids only. Each worker, once it has collected, sends the
broker (in the controller process) one entry per test that is not plain CPU work: its
GPU need, its rank-pool key, its group. The call returns before xdist's own
``collectionfinish`` event is sent, so the scheduler finds every entry in place.

Each entry is an :class:`Entry` on the wire (:meth:`Entry.to_wire`: execnet and the
broker carry plain values, with full-word keys, checked when read back). Later, when a
module- or class-scoped fixture of a group leases GPUs, the worker adds ``held:<group>``
(``{"held": [[GPUs, bytes per GPU or None], ...]}``): what the group's tests hold besides
their own needs while they run (:class:`HeldNeeds`).

A GPU test of that module (or class) that is in no group, because it uses none of its
leasing fixtures, is still under the fixture's scope: run on the group's worker after the
group's tests, it would run (and wait for its own GPUs) while the fixture holds its
lease, which pytest ends only when the worker leaves the module. Its entry names the
groups it must be handed out before (``before``, :func:`firsts`; the planner's rule 1).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import pytest

from ..base import privates
from ..run import fixture_leases
from ..run.feature import Feature
from ..run.fixture_leases import FACTORY, GROUP_PREFIX, GROUPED, HELD_PREFIX
from ..run.lifecycle import NeverRuns
from ..run.record import effective, needs
from . import dependencies
from .planner import Job, Need

if TYPE_CHECKING:
    from ..run.session import GpuRun

# Default for a test with no recorded duration when nothing at all is known.
UNKNOWN_DURATION = 1.0


class Catalog(Feature):
    """The feature's hook object in an xdist worker the controller's GPU scheduler hands tests
    to: what each collected test needs goes to the broker before xdist sends the node ids.
    ``never_runs``: the lease feature's (:meth:`pytest_gpu.run.lifecycle.Leases.never_runs`),
    a test this run can never run is no GPU work to the scheduler."""

    def __init__(self, config: pytest.Config, never_runs: NeverRuns) -> None:
        super().__init__(config)
        self.never_runs = never_runs

    @pytest.hookimpl(tryfirst=True)  # before xdist's own: it sends the node ids
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if not session.items:
            return
        tests = entries(session.items, self.run, self.never_runs)
        if tests:  # a CPU-only suite needs no entry, and so no connection to the broker
            self.run.client.catalog(tests)


@dataclass(frozen=True)
class Entry:
    """What the scheduler knows of one test: ``gpus`` and ``memory`` (bytes per GPU, ``None``:
    exclusive) of its lease or its rank pool's, ``pool`` (the pool's key), ``group`` (run on one
    worker, back to back), ``serial`` (run alone: ``gpu_serial``), ``before`` (groups it is handed
    out before). A test with none of these (plain CPU work) has no entry."""

    gpus: int = 0
    memory: int | None = None
    pool: str | None = None
    group: str | None = None
    serial: bool = False
    before: tuple[str, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        """The fields that differ from the default, by name; ``before`` as a list."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value != f.default:
                out[f.name] = list(value) if isinstance(value, tuple) else value
        if self.gpus:
            out["memory"] = self.memory  # None is a value here: an exclusive lease
        return out

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Entry:
        """The inverse of :meth:`to_wire`; raises ValueError naming an unknown key or a bad value."""
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"a catalog entry has no field {', '.join(map(repr, unknown))}: {dict(data)!r}")
        entry = cls(
            gpus=data.get("gpus", 0),
            memory=data.get("memory"),
            pool=data.get("pool"),
            group=data.get("group"),
            serial=data.get("serial", False),
            before=tuple(data.get("before", ())),
        )
        if (
            not isinstance(entry.gpus, int)
            or isinstance(entry.gpus, bool)
            or entry.gpus < 0
            or not (entry.memory is None or (isinstance(entry.memory, int) and entry.memory > 0))
            or not all(v is None or isinstance(v, str) for v in (entry.pool, entry.group))
            or not isinstance(entry.serial, bool)
            or not all(isinstance(g, str) for g in entry.before)
        ):
            raise ValueError(f"a catalog entry with a bad value: {dict(data)!r}")
        return entry

    @property
    def need(self) -> Need | None:
        return Need(self.gpus, self.memory) if self.gpus else None


def entries(items: Sequence[pytest.Item], run: GpuRun, never_runs: NeverRuns) -> dict[str, dict[str, Any]]:
    """The wire entries (:meth:`Entry.to_wire`) of the tests of ``items`` that are not plain CPU
    work (``never_runs``: why ``run`` can never run a test, :meth:`~pytest_gpu.run.lifecycle.Leases.never_runs`)."""
    groups = _groups(items, dependencies.dependency_groups(items, dependencies.automark_enabled(items[0].config)))
    fixture_leases.remember_groups(items[0].config, groups)
    before = firsts(items, groups)
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        record = needs(item)
        request = record.request
        pool = None
        if record.dist is not None:
            pool = repr(record.dist.pool_key)
            request = record.scheduled_request(run.settings.default_memory)  # the pool's GPUs, if any
        gpus, memory = 0, None
        # one this run can never run is skipped (a pool too large, nccl where it cannot run); one of
        # host resources only is CPU work to the scheduler
        if request is not None and request.count and never_runs(item, run) is None:
            gpus, memory = request.count, request.memory
        entry = Entry(
            gpus=gpus,
            memory=memory,
            pool=pool,
            group=groups.get(item.nodeid),
            serial=record.serial,
            # a GPU test waits at the broker; one that runs alone goes first
            before=tuple(before.get(item.nodeid, ())) if gpus and not record.serial else (),
        )
        if entry != Entry():
            out[item.nodeid] = entry.to_wire()
    return out


def _groups(items: Sequence[pytest.Item], dependency: Mapping[str, str]) -> dict[str, str]:
    """Node id -> group: ``xdist_group`` names, dependency chains and instances of module- or
    class-scoped fixtures that lease GPUs, merged where they share a test."""
    parent: dict[str, str] = {}

    def find(tag: str) -> str:
        while parent.setdefault(tag, tag) != tag:
            parent[tag] = parent[parent[tag]]
            tag = parent[tag]
        return tag

    tags: dict[str, list[str]] = {}
    for item in items:
        mine = []
        mark = item.get_closest_marker("xdist_group")
        if mark is not None:  # xdist's own reading of the mark
            mine.append(f"xdist_group:{mark.args[0] if mark.args else mark.kwargs.get('name', 'default')}")
        if item.nodeid in dependency:
            mine.append(dependency[item.nodeid])
        mine += group_tags(item)
        if mine:
            tags[item.nodeid] = mine
            for other in mine[1:]:
                parent[find(other)] = find(mine[0])
    return {nodeid: find(mine[0]) for nodeid, mine in tags.items()}


def firsts(items: Sequence[pytest.Item], groups: Mapping[str, str]) -> dict[str, list[str]]:
    """Node id -> the groups a test in none goes before: those of the leasing fixtures of the
    modules and classes it is in (their instances live until the worker leaves that module
    or class, also while its tests that do not use them run).

    A package's are left out: handing out a whole package's other tests before its fixture's
    tests would hold those back for most of the run."""
    scoped: dict[str, str] = {}  # fixture instance tag -> its group
    for item in items:
        if item.nodeid in groups:
            for tag in group_tags(item):
                scoped.setdefault(tag, groups[item.nodeid])
    if not scoped:
        return {}
    out: dict[str, list[str]] = {}
    for item in items:
        if item.nodeid in groups:
            continue
        mine = [
            scoped[tag]
            for node in item.listchain()
            if isinstance(node, (pytest.Module, pytest.Class)) and (tag := f"{GROUP_PREFIX}{node.nodeid}") in scoped
        ]
        if mine:
            out[item.nodeid] = list(dict.fromkeys(mine))
    return out


def jobs(
    collection: Sequence[str], catalog: Mapping[str, Mapping[str, Any]], durations: Mapping[str, float]
) -> list[Job]:
    """Planner jobs for xdist's ``collection``: needs from the catalog, durations from history.

    A test never run before is expected to take the median of the known durations."""
    known = [float(durations[n]) for n in collection if n in durations]
    default = statistics.median(known) if known else UNKNOWN_DURATION
    out = []
    for index, nodeid in enumerate(collection):
        entry = Entry.from_wire(catalog.get(nodeid, {}))
        duration = float(durations.get(nodeid, default))
        out.append(Job(index, duration, entry.need, entry.group, entry.pool, entry.serial, entry.before))
    return out


class HeldNeeds(Mapping[str, tuple[Need, ...]]):
    """Group -> what its fixtures hold while its tests run, read live from the broker's
    catalog (the planner's :attr:`~pytest_gpu.scheduling.planner.Planner.held`)."""

    def __init__(self, catalog: Mapping[str, Any]) -> None:
        self._catalog = catalog
        self._prefix = HELD_PREFIX

    def __getitem__(self, group: str) -> tuple[Need, ...]:
        entry = self._catalog[self._prefix + group]
        return tuple(Need(int(n), None if m is None else int(m)) for n, m in entry["held"])

    def get(self, group: str, default: Any = None) -> Any:  # the planner's hot path: no KeyError
        return self[group] if self._prefix + group in self._catalog else default

    def __iter__(self) -> Iterator[str]:
        return (k[len(self._prefix) :] for k in list(self._catalog) if k.startswith(self._prefix))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def group_tags(item: pytest.Item) -> list[str]:
    """Group tags of ``item``: one per module-, class- or package-scoped fixture instance it
    uses that requests ``gpu_lease_factory`` (known at collection: the factory is an argument)."""
    info = privates.fixture_info(item)
    if info is None:
        return []
    tags: list[str] = []
    for name in info.names_closure:
        for fixturedef in effective(info.name2fixturedefs.get(name), name):
            kind = GROUPED.get(fixturedef.scope)
            if kind is None or FACTORY not in fixturedef.argnames:
                continue
            node = item.getparent(kind) or (item.getparent(pytest.Module) if kind is pytest.Class else None)
            if node is not None and f"{GROUP_PREFIX}{node.nodeid}" not in tags:
                tags.append(f"{GROUP_PREFIX}{node.nodeid}")
    return tags
