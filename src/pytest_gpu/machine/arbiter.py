"""The machine's arbiter: one :class:`~pytest_gpu.leasing.placement.Allocator` for every run on these GPUs.

Each run's broker still serves its own workers, but every decision about GPU memory is
made here, for all runs at once: the capacity rule, the context budget and the bounded
bypass of :mod:`pytest_gpu.leasing.placement` therefore hold machine-wide, so no byte is promised
twice, an exclusive lease is exclusive across runs, and a waiting request is overtaken by
at most ``max_bypass`` later ones, whichever run they come from.

GPUs are known by UUID (runs number them differently: ``--gpus 1,2`` in one run is
``0,2`` in another); inside the allocator each UUID gets a small integer in order of arrival.
Keys and clients are prefixed with the run's id.

Events (a grant or refusal of a request that waited) go to the run's ``sink``, called
after the arbiter's lock is released, never under it: a sink may take its broker's lock.

Host resources: the machine's CPUs and RAM (see :mod:`pytest_gpu.leasing.host`) are in the same
pool, told by the first run that attaches (``host=(cpus, bytes)``); later runs' views are
ignored, so every run leases from one account of them.

Foreign usage: ``foreign(uuids, roots, accounted)`` (see :mod:`pytest_gpu.gpu.foreign`)
says per GPU how many bytes processes outside every attached run use; it is asked before grants,
at most every ``foreign_ttl`` seconds (NVML has no event for it), and again every
``foreign_ttl`` seconds while a request waits only because of it.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..leasing.placement import Allocator, Lease, Placement, Policy, Unsatisfiable
from ..leasing.requests import GpuRequest

Event = tuple[str, str, dict[str, Any]]  # ("granted" | "rejected", run-local key, body)
Sink = Callable[[list[Event]], None]
# (GPU UUIDs, pids whose descendants are the runs' processes, bytes the allocator accounts for
# per UUID) -> bytes that processes outside every run use, per UUID
ForeignSource = Callable[[list[str], set[int], dict[str, int]], dict[str, int]]

RESUME_AFTER_S = 2.0  # after a failover: how long grants wait for the runs that were attached to re-attach


@dataclass
class RunEntry:
    """An attached run."""

    run: str
    pid: int
    user: str
    label: str  # what `pytest-gpu status` calls it: where it runs from
    sink: Sink
    attached: float = field(default_factory=time.time)
    tests: dict[str, str] = field(default_factory=dict)  # pool key -> test node id
    workers: dict[str, str] = field(default_factory=dict)  # pool client -> worker name
    since: dict[str, float] = field(default_factory=dict)  # pool key -> wall time asked, then granted


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


class Arbiter:
    """All of a machine's GPU decisions; thread-safe; no I/O except the foreign source."""

    def __init__(
        self,
        policy: Policy | None = None,
        foreign: ForeignSource | None = None,
        foreign_ttl: float = 0.25,
    ) -> None:
        self.allocator = Allocator({}, policy)
        self.allocator.group = lambda client: client.partition("|")[0]  # the run
        self.foreign = foreign
        self.foreign_ttl = foreign_ttl
        self.foreign_bytes: dict[str, int] = {}
        self.grants = 0
        self.runs: dict[str, RunEntry] = {}
        self.pending: set[str] = set()  # runs expected back after a failover
        self._mids: dict[str, int] = {}
        self._uuids: dict[int, str] = {}
        self._allowed: dict[tuple[str, ...], frozenset[int]] = {}  # a run's GPU list, as pool indices
        self._lock = threading.Lock()
        self._sampled = float("-inf")
        self._retry: threading.Timer | None = None
        self._resume: threading.Timer | None = None
        self._closed = False

    # -- plumbing ---------------------------------------------------------------------

    @contextmanager
    def _locked(self) -> Iterator[dict[str, list[Event]]]:
        """The lock, and events to hand out once it is released (in order, per run)."""
        out: dict[str, list[Event]] = defaultdict(list)
        with self._lock:
            yield out
            sinks = self._sinks_locked(out)
        self._dispatch(out, sinks)

    def _sinks_locked(self, out: dict[str, list[Event]]) -> dict[str, Sink]:
        return {run: self.runs[run].sink for run, events in out.items() if events and run in self.runs}

    @staticmethod
    def _dispatch(out: dict[str, list[Event]], sinks: dict[str, Sink]) -> None:
        for run, sink in sinks.items():
            try:
                sink(out[run])
            except Exception:  # a run's broken sink must not break the arbiter
                pass

    def _mid(self, uuid: str) -> int:
        if uuid not in self._mids:
            mid = len(self._mids)
            self._mids[uuid] = mid
            self._uuids[mid] = uuid
        return self._mids[uuid]

    @staticmethod
    def _split(pool_key: str) -> tuple[str, str]:
        run, _, key = pool_key.partition("|")
        return run, key

    def _deliver_locked(self, granted: list[Lease], out: dict[str, list[Event]]) -> None:
        """Turn grants into events, refuse what can never be placed, serve again while refusing frees the queue."""
        if not granted and not self.allocator.queue:
            return  # nothing granted, nothing waits: nothing to say
        while True:
            now = time.time()
            for lease in granted:
                run, key = self._split(lease.key)
                self.grants += 1
                entry = self.runs.get(run)
                if entry is not None:
                    entry.since[lease.key] = now
                out[run].append(("granted", key, self._grant_body(lease)))
            refused = {}
            for waiting in self.allocator.queue:
                reason = self.allocator.blocked_forever(waiting)
                if reason:
                    refused[waiting.key] = reason
            for pool_key, reason in refused.items():
                self.allocator.cancel(pool_key)
                run, key = self._split(pool_key)
                self._forget_key_locked(pool_key)
                out[run].append(("rejected", key, {"message": reason}))
            if not refused:
                break
            granted = self.allocator.serve()
        self._schedule_retry_locked()

    def _grant_body(self, lease: Lease) -> dict[str, Any]:
        placement = lease.placement
        body: dict[str, Any] = {
            "gpus": [self._uuids[i] for i in placement.indices],
            "memory": placement.memory,
            "exclusive": placement.exclusive,
        }
        if lease.foreign_waited or lease.avoided:
            gpus = set(placement.indices) | set(lease.avoided)
            body["foreign"] = {
                "waited": lease.foreign_waited,
                "avoided": [self._uuids[i] for i in lease.avoided],
                "bytes": {
                    self._uuids[i]: self.allocator.gpus[i].foreign
                    for i in sorted(gpus)
                    if self.allocator.gpus[i].foreign
                },
            }
        return body

    def _named(self, lease: Lease) -> tuple[str, tuple[str, ...]]:
        """(run-local key, GPU UUIDs) of a lease."""
        return self._split(lease.key)[1], tuple(self._uuids[i] for i in lease.placement.indices)

    def _forget_key_locked(self, pool_key: str) -> None:
        run, _ = self._split(pool_key)
        entry = self.runs.get(run)
        if entry is not None:
            entry.tests.pop(pool_key, None)
            entry.since.pop(pool_key, None)

    def _sample_locked(self, force: bool = False) -> None:
        if self.foreign is None or not self.allocator.gpus:
            return
        now = time.monotonic()
        if not force and now - self._sampled < self.foreign_ttl:
            return
        self._sampled = now
        roots = {entry.pid for entry in self.runs.values()}
        accounted = {uuid: self.allocator.used(mid) for uuid, mid in self._mids.items()}
        try:
            usage = self.foreign(list(self._mids), roots, accounted)
        except Exception:  # NVML went away: decide on the last sample rather than fail every request
            return
        self.foreign_bytes = {uuid: n for uuid, n in usage.items() if n > 0}
        self.allocator.set_foreign({self._mids[u]: n for u, n in usage.items() if u in self._mids})

    def _schedule_retry_locked(self) -> None:
        """While a request waits only because of foreign usage, look again every ``foreign_ttl``."""
        if self._closed or self._retry is not None or self.foreign is None:
            return
        if not any(w.foreign_blocked for w in self.allocator.queue):
            return
        self._retry = threading.Timer(self.foreign_ttl, self._retry_now)
        self._retry.daemon = True
        self._retry.start()

    def _retry_now(self) -> None:
        with self._locked() as out:
            self._retry = None
            self._sample_locked(force=True)
            self._deliver_locked(self.allocator.serve(), out)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for timer in (self._retry, self._resume):
                if timer is not None:
                    timer.cancel()
            close = getattr(self.foreign, "close", None)
            if close is not None:
                close()

    # -- runs ---------------------------------------------------------------------------

    def attach(
        self,
        run: str,
        *,
        pid: int,
        user: str,
        label: str,
        gpus: dict[str, int],
        sink: Sink,
        held: list[Held] = (),  # type: ignore[assignment]
        asked: list[Asked] = (),  # type: ignore[assignment]
        host: tuple[int, int] | None = None,
    ) -> None:
        """A run joins with its GPUs (UUID -> capacity) and its view of the machine's CPUs
        and RAM (``host``: the first run's view is kept); after a failover it brings the
        leases it holds (taken over as they were) and the requests it waits on (queued
        again, in their order)."""
        with self._locked() as out:
            self.runs[run] = RunEntry(run, pid, user, label, sink)
            entry = self.runs[run]
            if host is not None and self.allocator.host is None:
                self.allocator.set_host(int(host[0]), int(host[1]))
            for uuid, capacity in gpus.items():
                self.allocator.add_gpu(self._mid(uuid), capacity)
            for lease in held:
                pool_key, client = f"{run}|{lease.key}", f"{run}|{lease.client}"
                placement = Placement(tuple(self._mid(u) for u in lease.gpus), lease.memory, lease.exclusive)
                self.allocator.adopt(pool_key, client, lease.request, placement)
                entry.tests[pool_key] = lease.test
                entry.workers[client] = lease.worker
                entry.since[pool_key] = time.time()
            for ask in asked:
                pool_key, client = f"{run}|{ask.key}", f"{run}|{ask.client}"
                entry.tests[pool_key] = ask.test
                entry.workers[client] = ask.worker
                entry.since[pool_key] = time.time()
                allowed = frozenset(self._mid(u) for u in ask.gpus)
                try:
                    self.allocator.queue.append(self._waiting(pool_key, client, ask.request, allowed))
                except Unsatisfiable as exc:
                    out[run].append(("rejected", ask.key, {"message": str(exc)}))
            self.pending.discard(run)
            if not self.pending:
                self.allocator.paused = False
                self._sample_locked()
                self._deliver_locked(self.allocator.serve(), out)

    def _waiting(self, pool_key: str, client: str, request: GpuRequest, allowed: frozenset[int]) -> Any:
        from ..leasing.placement import Waiting

        reason = self.allocator.never_fits(request, allowed)
        if reason:
            raise Unsatisfiable(reason)
        return Waiting(pool_key, client, request, allowed=allowed)

    def expect(self, runs: set[str], within: float = RESUME_AFTER_S) -> None:
        """After a failover: grant nothing until ``runs`` have re-attached (or ``within``
        seconds have passed), so that no lease they hold is promised again meanwhile."""
        with self._lock:
            self.pending = set(runs) - set(self.runs)
            if not self.pending:
                return
            self.allocator.paused = True
            self._resume = threading.Timer(within, self._give_up_waiting)
            self._resume.daemon = True
            self._resume.start()

    def _give_up_waiting(self) -> None:
        with self._locked() as out:
            self.pending.clear()
            self.allocator.paused = False
            self._sample_locked()
            self._deliver_locked(self.allocator.serve(), out)

    def detach(self, run: str) -> list[tuple[str, tuple[str, ...]]]:
        """A run is gone (finished, or its connection closed because it died): everything
        it held goes back at once. Returns (key, GPU UUIDs) of the leases it held."""
        with self._locked() as out:
            entry = self.runs.pop(run, None)
            held: list[tuple[str, tuple[str, ...]]] = []
            clients = {w.client for w in self.allocator.queue if w.key.startswith(f"{run}|")}
            clients |= {lease.client for lease in self.allocator.leases.values() if lease.key.startswith(f"{run}|")}
            clients |= {c for g in self.allocator.gpus.values() for c in g.contexts if c.startswith(f"{run}|")}
            granted: list[Lease] = []
            for client in sorted(clients):
                self.allocator.exiting.discard(client)
                leases, more = self.allocator.forget_client(client)
                held.extend(self._named(lease) for lease in leases)
                granted.extend(more)
            if entry is not None:
                self._sample_locked(force=True)  # its orphans, if any, are foreign from now on
                self._deliver_locked(granted + self.allocator.serve(), out)
            return held

    # -- requests -----------------------------------------------------------------------

    def submit(
        self, run: str, key: str, client: str, worker: str, test: str, request: GpuRequest, gpus: list[str]
    ) -> tuple[str, Any]:
        """``("granted", body)``, ``("queued", None)`` or ``("error", message)``; for
        ``key`` only: grants of other requests this one made possible go out as events."""
        out: dict[str, list[Event]] = defaultdict(list)
        with self._lock:  # by hand, not _locked(): this is the path every grant takes
            entry = self.runs[run]
            pool_key, pool_client = f"{run}|{key}", f"{run}|{client}"
            entry.tests[pool_key] = test
            entry.workers[pool_client] = worker
            entry.since[pool_key] = time.time()
            allowed = self._allowed.get(tuple(gpus))
            if allowed is None:
                allowed = self._allowed[tuple(gpus)] = frozenset(self._mid(u) for u in gpus)
            self._sample_locked()
            try:
                granted = self.allocator.submit(pool_key, pool_client, request, allowed)
            except Unsatisfiable as exc:
                self._forget_key_locked(pool_key)
                return ("error", str(exc))
            self._deliver_locked(granted, out)
            mine = [e for e in out[run] if e[1] == key]
            if mine:
                out[run] = [e for e in out[run] if e[1] != key]
            sinks = self._sinks_locked(out)
        self._dispatch(out, sinks)
        if not mine:
            return ("queued", None)
        kind, _, body = mine[0]
        return (kind, body if kind == "granted" else body["message"])

    def cancel(self, run: str, key: str) -> list[dict[str, Any]] | None:
        """Withdraw a waiting request: the holders of its GPUs then, or ``None`` if it was not waiting."""
        with self._locked() as out:
            pool_key = f"{run}|{key}"
            if not self.allocator.cancel(pool_key):
                return None
            self._forget_key_locked(pool_key)
            holders = self._holders_locked()
            self._deliver_locked(self.allocator.serve(), out)
            return holders

    def abandon(self, run: str, key: str) -> None:
        """Withdraw a request whether it waits or was granted meanwhile (idempotent)."""
        with self._locked() as out:
            pool_key = f"{run}|{key}"
            self._forget_key_locked(pool_key)
            granted = self.allocator.serve() if self.allocator.cancel(pool_key) else self.allocator.release(pool_key)
            self._deliver_locked(granted, out)

    def release(self, run: str, key: str, contexts: list[str] | None = None) -> None:
        """Give a lease back; ``contexts``: the GPUs its process really has contexts on now, if known."""
        out: dict[str, list[Event]] = defaultdict(list)
        with self._lock:
            pool_key = f"{run}|{key}"
            self._forget_key_locked(pool_key)
            known = None if contexts is None else {self._mids[u] for u in contexts if u in self._mids}
            self._deliver_locked(self.allocator.release(pool_key, known), out)
            sinks = self._sinks_locked(out)
        self._dispatch(out, sinks)

    def set_contexts(self, run: str, client: str, contexts: list[str]) -> None:
        with self._locked() as out:
            self.allocator.set_contexts(f"{run}|{client}", {self._mids[u] for u in contexts if u in self._mids})
            self._deliver_locked(self.allocator.serve(), out)

    def forget_client(self, run: str, client: str) -> list[tuple[str, tuple[str, ...]]]:
        """A worker of ``run`` is gone: what it held goes back; returns (key, GPU UUIDs) of its leases."""
        with self._locked() as out:
            pool_client = f"{run}|{client}"
            leases, granted = self.allocator.forget_client(pool_client)
            for lease in leases:
                self._forget_key_locked(lease.key)
            entry = self.runs.get(run)
            if entry is not None:
                entry.workers.pop(pool_client, None)
            self._deliver_locked(granted, out)
            return [self._named(lease) for lease in leases]

    def exiting(self, run: str, client: str, contexts: list[str]) -> None:
        """A worker closed its connection but its process (and its contexts) still exist."""
        with self._lock:
            stand_in = f"{run}|{client}~exiting"
            self.allocator.set_contexts(stand_in, {self._mids[u] for u in contexts if u in self._mids})
            self.allocator.exiting.add(stand_in)

    def exited(self, run: str, client: str) -> None:
        with self._locked() as out:
            stand_in = f"{run}|{client}~exiting"
            self.allocator.set_contexts(stand_in, set())
            self.allocator.exiting.discard(stand_in)
            self._deliver_locked(self.allocator.serve(), out)

    # -- questions ----------------------------------------------------------------------

    def room(self, gpus: list[str]) -> list[int]:
        """What each of ``gpus`` can give leases now, contexts and foreign usage counted."""
        overhead = self.allocator.policy.overhead
        with self._lock:
            rows = []
            for uuid in gpus:
                gpu = self.allocator.gpus.get(self._mids.get(uuid, -1))
                if gpu is None:
                    rows.append(0)
                    continue
                rows.append(max(gpu.capacity - gpu.foreign - overhead * max(1, len(gpu.contexts)), 0))
            return rows

    def _holders_locked(self) -> list[dict[str, Any]]:
        rows = []
        for lease in self.allocator.leases.values():
            run, _ = self._split(lease.key)
            entry = self.runs.get(run)
            rows.append(
                {
                    "run": run,
                    "run_label": entry.label if entry else "?",
                    "user": entry.user if entry else "?",
                    "test": entry.tests.get(lease.key, "?") if entry else "?",
                    "worker": entry.workers.get(lease.client, "?") if entry else "?",
                    "gpus": [self._uuids[i] for i in lease.placement.indices],
                    "memory": lease.placement.memory,
                    "exclusive": lease.placement.exclusive,
                    "cpus": lease.request.cpus,
                    "host_memory": lease.request.host_memory,
                    "since": entry.since.get(lease.key) if entry else None,
                }
            )
        return rows

    def holders(self) -> list[dict[str, Any]]:
        with self._lock:
            return self._holders_locked()

    def status(self) -> dict[str, Any]:
        """The machine now: runs, GPUs, leases and who waits for what (``pytest-gpu status``)."""
        with self._lock:
            waiting = []
            for w in self.allocator.queue:
                run, key = self._split(w.key)
                entry = self.runs.get(run)
                waiting.append(
                    {
                        "run": run,
                        "key": key,
                        "test": entry.tests.get(w.key, "?") if entry else "?",
                        "worker": entry.workers.get(w.client, "?") if entry else "?",
                        "request": w.request.describe(),
                        "since": entry.since.get(w.key) if entry else None,
                        "bypassed": w.bypassed,
                        "foreign": w.foreign_blocked,
                    }
                )
            return {
                "runs": [
                    {"run": e.run, "pid": e.pid, "user": e.user, "label": e.label, "attached": e.attached}
                    for e in self.runs.values()
                ],
                "pending": sorted(self.pending),
                "gpus": [
                    {
                        "uuid": self._uuids[i],
                        "capacity": g.capacity,
                        "leased": self.allocator.used(i),
                        "foreign": g.foreign,
                        "contexts": len(g.contexts),
                        "clients": sorted(g.contexts),  # "<run>|<client>"
                        "exclusive": g.exclusive,
                    }
                    for i, g in self.allocator.gpus.items()
                ],
                "host": None
                if self.allocator.host is None
                else {
                    "cpus": self.allocator.host.cpus,
                    "memory": self.allocator.host.memory,
                    "leased_cpus": self.allocator.host.leased_cpus,
                    "leased_memory": self.allocator.host.leased_memory,
                },
                "leases": self._holders_locked(),
                "waiting": waiting,
                "grants": self.grants,
            }
