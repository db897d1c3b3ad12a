"""The machine's arbiter: one :class:`~pytest_gpu.machine.placement.Allocator` for every run on these GPUs.

Each run's broker still serves its own workers, but every decision about GPU memory is
made here, for all runs at once: the capacity rule, the context budget and the bounded
bypass of :mod:`pytest_gpu.machine.placement` therefore hold machine-wide, so no byte is promised
twice, an exclusive lease is exclusive across runs, and a waiting request is overtaken by
at most ``max_bypass`` later ones, whichever run they come from.

GPUs are known by UUID (runs number them differently: ``--gpus 1,2`` in one run is
``0,2`` in another); inside the allocator each UUID gets a small integer in order of arrival.
Keys and clients are prefixed with the run's id.

Events (a grant or refusal of a request that waited) go to the run's ``sink``, called
after the arbiter's lock is released, never under it: a sink may take its broker's lock.

Host resources: the machine's CPUs and RAM (see :mod:`pytest_gpu.leasing.host`) are in the same
pool, told by the run that attaches first (``host=(cpus, bytes)``: the arbiter's own run; the
server never passes another run's view on), so every run leases from one account of them.

Identity: a run's id begins with its user's uid (``<uid>.<pid>-<random>``), which the
server checks against the kernel's word (``SO_PEERCRED``); every operation names no run,
only keys and clients of the connection's own run. :meth:`Arbiter.status` shows a viewer
the details of its own user's runs only: of another user's, that they exist, how many
leases they hold and on which GPUs.

What a run says of the machine is checked against what the arbiter's process measures
(``truth``: capacities by UUID, see :mod:`pytest_gpu.run.session`): a GPU it does not know
is refused, and no run can declare a GPU larger than it is.

Ports: the arbiter also hands out TCP ports, so no two runs of the machine hold one at once.

Foreign usage: ``foreign(uuids, roots, accounted)`` (see :mod:`pytest_gpu.gpu.foreign`)
says per GPU how many bytes processes outside every attached run use; it is asked before grants,
at most every ``foreign_ttl`` seconds (NVML has no event for it), and again every
``foreign_ttl`` seconds while a request waits only because of it.

Hold-and-wait: requests that wait for one another (each client holds leases while it
waits, and what each waits for only the others could give back: two workers whose
module-scoped fixtures hold a GPU each while their tests wait for a whole GPU) would wait
until ``--gpu-wait-timeout``. The latest of them whose client holds a lease is refused at
once instead, naming who holds what and waits for what
(:meth:`~pytest_gpu.machine.placement.Allocator.deadlock`).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from ..base.requests import GpuRequest, format_size
from .domain import USER_MEMORY_ENV, user_memory_cap
from .messages import PART, Asked, Held
from .placement import (
    Allocator,
    Deadlock,
    Lease,
    Placement,
    Policy,
    Unsatisfiable,
    Waiting,
    carved_parts,
    checked_preference,
)
from .ports import PortAllocator

Event = tuple[str, str, dict[str, Any]]  # ("granted" | "rejected", run-local key, body)
Sink = Callable[[list[Event]], None]


class Roots(set[int]):
    """The pids whose descendants are the runs' processes (as a set: every run's), and of the
    runs whose processes' GPU memory outside their leases the arbiter cannot answer for
    (another user's than the arbiter's: its confinement is that user's), each one's
    ``limits``: root pid -> (the run's uid, GPU UUID -> bytes its leases, contexts and
    leftovers account for there). A process counts as such a run's only if it is that user's
    and descends from its root (the kernel's pid, ``SO_PEERCRED``); what the run's processes
    use on a GPU beyond what it accounts for there is usage outside pytest-gpu
    (:meth:`pytest_gpu.gpu.foreign.ForeignSampler.sample`)."""

    limits: dict[int, tuple[int, dict[str, int]]]

    def __init__(self, trusted: set[int], limits: dict[int, tuple[int, dict[str, int]]] | None = None) -> None:
        super().__init__(trusted | set(limits or {}))
        self.limits = dict(limits or {})


# (GPU UUIDs, pids whose descendants are the runs' processes (Roots), bytes the allocator accounts
# for per UUID) -> bytes that processes outside every run use, per UUID
ForeignSource = Callable[[list[str], set[int], dict[str, int]], dict[str, int]]

# UUIDs -> the capacity the arbiter's own process measures of those it knows (others: absent);
# None where it cannot measure at all (no NVML in its process)
Truth = Callable[[list[str]], "dict[str, int] | None"]
# who may attach to a machine shared with a group: (the group's name, (uid, pid) -> whether
# that peer is a member, by the kernel's word); see ArbiterServer
Members = tuple[str, Callable[[int, int], bool]]

MAX_KEYS_PER_RUN = 4096  # requests one run has waiting or granted at once
MAX_CLIENTS_PER_RUN = 1024  # processes one run leases for
RESUME_AFTER_S = 2.0  # after a failover: how long grants wait for the runs that were attached to re-attach
UUID_SHOWN = 80  # characters of a GPU name an error repeats
# after this arbiter took over: how long runs may bring what they held under the one before
# (leases, contexts, leftovers); a run that attaches later brings nothing of the kind
ADOPT_WINDOW_S = 30.0
MAX_RANK = 1 << 16  # a launched rank's number in a part's name (local ranks of one node)


def roster_digest(run: str) -> str:
    """How a roster names another user's run: enough to recognise it when it re-attaches."""
    return "#" + hashlib.sha256(run.encode()).hexdigest()[:20]


def run_of(client: str) -> str:
    """The run of a key or client as the allocator knows it (``<run>|<name>``)."""
    return client.partition("|")[0]


def run_uid(run: str) -> int | None:
    """The uid a run id begins with (``<uid>.<rest>``), or ``None``."""
    head, dot, _ = run.partition(".")
    return int(head) if dot and head.isdigit() else None


@dataclass
class RunEntry:
    """An attached run."""

    run: str
    pid: int
    uid: int
    user: str
    label: str  # what `pytest-gpu status` calls it: where it runs from
    sink: Sink
    attached: float = field(default_factory=time.time)
    tests: dict[str, str] = field(default_factory=dict)  # pool key -> test node id
    workers: dict[str, str] = field(default_factory=dict)  # pool client -> worker name
    since: dict[str, float] = field(default_factory=dict)  # pool key -> wall time asked, then granted
    gpus: frozenset[str] = frozenset()  # the GPUs it brought: the only ones it may name
    # pool client -> the GPUs (allocator numbers) it was granted leases on: a client's contexts
    # count only once it was granted one (made-up clients' would take room without any lease)
    leased_on: dict[str, set[int]] = field(default_factory=dict)


class Arbiter:
    """All of a machine's GPU decisions; thread-safe; no I/O except the foreign source."""

    def __init__(
        self,
        policy: Policy | None = None,
        foreign: ForeignSource | None = None,
        foreign_ttl: float = 0.25,
        truth: Truth | None = None,
        ports: PortAllocator | None = None,
        user_memory: int | None = None,
    ) -> None:
        # a run's measured context size counts for its own contexts only (see measure_context)
        self.allocator = Allocator({}, replace(policy or Policy(), group=run_of))
        self.truth = truth
        self.ports = ports or PortAllocator()  # every run's ports: port -> "<run>|<owner>"
        self.allocator.group = run_of
        self.members: Members | None = None  # None: every user's runs may attach
        # GPU memory one user's leases may hold at once (None: no bound; root is not bound):
        # a request beyond it waits, passed over, until that user's leases give enough back
        self.user_memory = user_memory_cap() if user_memory is None else user_memory
        if self.user_memory is not None:
            self.allocator.admit = self._within_user_memory
        self.took_over = time.monotonic()  # runs bring what they held for ADOPT_WINDOW_S from here
        self._next_mid = 0
        self.foreign = foreign
        self.foreign_ttl = foreign_ttl
        self.foreign_bytes: dict[str, int] = {}
        self.grants = 0
        self.runs: dict[str, RunEntry] = {}
        self.pending: set[str] = set()  # runs expected back after a failover
        self._mids: dict[str, int] = {}
        self._uuids: dict[int, str] = {}
        self._allowed: dict[tuple[str, ...], frozenset[int]] = {}  # a run's GPU list, as pool indices
        self.preferences_ignored = 0  # hints of GPUs from runs that did not fit their request (see submit)
        self.preference_ignored: str | None = None  # why the last one was ignored
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

    def _mid(self, uuid: str, run: str | None = None) -> int:
        """The allocator's number of GPU ``uuid`` (of ``run``'s, for a part: see :meth:`_key`)."""
        key = uuid if run is None else self._key(run, uuid)
        if key not in self._mids:
            mid = self._next_mid
            self._next_mid += 1
            self._mids[key] = mid
            self._uuids[mid] = uuid
        return self._mids[key]

    @staticmethod
    def _key(run: str, uuid: str) -> str:
        """How the arbiter keys a GPU a run names: its UUID; a rank's part of one, per run
        (``<run>|<part>``): one run's part is not another's to size, fill or squat."""
        return f"{run}|{uuid}" if PART in uuid else uuid

    def _known_mid(self, run: str, uuid: str) -> int:
        return self._mids.get(self._key(run, uuid), -1)

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
                    self._leased_on(entry, lease)
                out[run].append(("granted", key, self._grant_body(lease)))
            refused = {}
            for waiting in self.allocator.queue:
                reason = self.allocator.blocked_forever(waiting)
                if reason:
                    refused[waiting.key] = reason
            if not refused:
                deadlock = self.allocator.deadlock()
                if deadlock is not None:
                    refused[deadlock.victim.key] = self._deadlock_text(deadlock)
            for pool_key, reason in refused.items():
                self.allocator.cancel(pool_key)
                run, key = self._split(pool_key)
                self._forget_key_locked(pool_key)
                out[run].append(("rejected", key, {"message": reason}))
            if not refused:
                break
            granted = self.allocator.serve()
        self._schedule_retry_locked()

    def _deadlock_text(self, deadlock: Deadlock) -> str:
        """Why ``deadlock.victim`` is refused: each client of the cycle, what it holds and what
        it waits for (another user's tests unnamed, as in :meth:`status`)."""
        victim = deadlock.victim
        viewer = self.runs.get(self._split(victim.key)[0])
        uid = viewer.uid if viewer is not None else None

        def test(key: str) -> str:
            entry = self.runs.get(self._split(key)[0])
            if entry is None:
                return "?"
            return entry.tests.get(key, "?") if self._sees(uid, entry) else f"a test of user {entry.user}"

        def worker(client: str) -> str:
            entry = self.runs.get(self._split(client)[0])
            if entry is None:
                return "?"
            if not self._sees(uid, entry):
                return f"a worker of user {entry.user}"
            name = entry.workers.get(client, "?")
            return name if entry is viewer else f"{name} of run {entry.run}"

        lines = []
        holders = {lease.client for lease in deadlock.held}
        for waiting in sorted(deadlock.waiting, key=lambda w: w is not victim):
            if waiting is not victim and waiting.client not in holders:
                continue  # it waits behind the cycle, it is not part of it
            held = [
                f"{', '.join(self._uuids[i] for i in lease.placement.indices)} "
                f"({'whole GPU' if lease.placement.exclusive else format_size(lease.placement.memory)}, "
                f"{test(lease.key)})"
                for lease in deadlock.held
                if lease.client == waiting.client and lease.placement.indices
            ]
            holds = f"holds {'; '.join(held)}" if held else "holds no GPU"
            lines.append(
                f"  - {worker(waiting.client)} {holds} and waits for {waiting.request.describe()} "
                f"for {test(waiting.key)}"
            )
        return (
            "a deadlock (hold-and-wait): only what waiting workers hold could serve it, and a worker gives "
            "nothing back while it waits:\n"
            + "\n".join(lines)
            + "\nrefused now, not at --gpu-wait-timeout. While a test waits, its worker keeps its other leases: "
            "the test's own, its fixtures' (until the worker leaves their scope, also through that scope's tests "
            "that do not use them) and its warm rank pools'"
        )

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

    @staticmethod
    def _leased_on(entry: RunEntry, lease: Lease) -> None:
        if len(entry.leased_on) > 2 * MAX_CLIENTS_PER_RUN:  # clients come and go in a long run
            entry.leased_on = {c: g for c, g in entry.leased_on.items() if c in entry.workers}
        entry.leased_on.setdefault(lease.client, set()).update(lease.placement.indices)

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
        me = os.getuid()
        limits = {e.pid: (e.uid, self._accounted_locked(e.run)) for e in self.runs.values() if e.uid not in (me, 0)}
        roots = Roots({e.pid for e in self.runs.values() if e.pid not in limits}, limits)
        accounted = {uuid: self.allocator.used(mid) for uuid, mid in self._mids.items()}
        try:
            usage = self.foreign(list(self._mids), roots, accounted)
        except Exception:  # NVML went away: decide on the last sample rather than fail every request
            return
        self.foreign_bytes = {uuid: n for uuid, n in usage.items() if n > 0}
        self.allocator.set_foreign({self._mids[u]: n for u, n in usage.items() if u in self._mids})

    def _accounted_locked(self, run: str) -> dict[str, int]:
        """GPU UUID -> bytes ``run``'s leases, contexts and leftovers account for there."""
        found: dict[str, int] = defaultdict(int)
        prefix = f"{run}|"
        for lease in self.allocator.leases.values():
            if lease.key.startswith(prefix):
                for i in lease.placement.indices:
                    found[self._uuids[i].partition(PART)[0]] += lease.placement.memory
        policy = self.allocator.policy
        for i, gpu in self.allocator.gpus.items():
            mine = [c for c in gpu.contexts if c.startswith(prefix)]
            held = sum(n for c, (n, _) in gpu.left.items() if c.startswith(prefix))
            if mine or held:
                found[self._uuids[i].partition(PART)[0]] += policy.contexts(i, mine) + held
        return dict(found)

    def _within_user_memory(self, waiting: Waiting) -> bool:
        """Whether ``waiting`` fits in its user's bound (:attr:`user_memory`) beside the leases
        that user holds; an exclusive request, while that user holds less than the bound."""
        entry = self.runs.get(run_of(waiting.client))
        if entry is None or entry.uid == 0 or self.user_memory is None:
            return True
        held = 0
        for lease in self.allocator.leases.values():
            holder = self.runs.get(run_of(lease.key))
            if holder is not None and holder.uid == entry.uid:
                held += lease.placement.memory * len(lease.placement.indices)
        if waiting.request.exclusive:
            return held < self.user_memory
        return held + (waiting.request.memory or 0) * waiting.request.count <= self.user_memory

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
        uid: int | None = None,
        held: list[Held] = (),  # type: ignore[assignment]
        asked: list[Asked] = (),  # type: ignore[assignment]
        host: tuple[int, int] | None = None,
        ports: dict[int, str] | None = None,
        contexts: dict[str, list[str]] | None = None,
        exiting: dict[str, list[str]] | None = None,
        left: dict[str, dict[str, tuple[int, str]]] | None = None,
    ) -> None:
        """A run joins with its GPUs (UUID -> capacity) and its view of the machine's CPUs
        and RAM (``host``: the first run's view is kept); after a failover it brings the
        leases it holds (taken over as they were), the requests it waits on (queued again,
        in their order), the ports it holds, and where its clients' processes have CUDA
        contexts (``contexts``; ``exiting``: of clients gone whose processes have not exited
        yet, see :meth:`exiting`) and what they still hold of leases that ended (``left``:
        client -> GPU -> (bytes, who left them)), all counted before any grant can resume.

        What a run held under an arbiter before this one (``held``, ``contexts``, ``exiting``,
        ``left``) is taken only within ``ADOPT_WINDOW_S`` of this arbiter taking over (runs
        re-attach after a failover then), and each lease taken over counts as overtaking every
        request that waits (their bound, ``max_bypass``, holds for it too).

        Raises :class:`ValueError` (nothing changed) for a run attached already, a user who
        is not a member of the group the machine is shared with, a GPU that is not on this
        machine, a part of a GPU beyond one per GPU and run, something held before brought
        outside the window or past a waiting request's bound, or a lease that names a GPU
        the run did not bring or does not fit where it says it is."""
        with self._locked() as out:
            if run in self.runs:
                raise ValueError(f"run {run} is attached already")
            if uid is None:  # in this process: the run's id says it, else it is this process's user's
                uid = run_uid(run)
                uid = os.getuid() if uid is None else uid
            if self.members is not None and uid != 0 and not self.members[1](uid, pid):
                raise ValueError(
                    f"user {user} (uid {uid}) is not a member of group {self.members[0]}, "
                    "the only users whose runs this simulated machine serves"
                )
            self._sweep_locked()
            capacities = self._checked_gpus(run, gpus)
            self._check_brought(run, held, contexts, exiting, left)
            self._check_held(run, held, capacities)
            if len((contexts or {}).keys() | (exiting or {}).keys() | (left or {}).keys()) > MAX_CLIENTS_PER_RUN:
                raise ValueError(f"a run may lease for {MAX_CLIENTS_PER_RUN} processes at once")
            entry = self.runs[run] = RunEntry(run, pid, uid, user, label, sink, gpus=frozenset(capacities))
            if host is not None and self.allocator.host is None:
                self.allocator.set_host(*host)
            for uuid, capacity in capacities.items():
                whole, part, _ = uuid.partition(PART)
                base = None
                if part:  # its GPU joins too (no run may name it for this): the part is carved out of it
                    base = self._mid(whole)
                    self.allocator.add_gpu(base, self._whole_capacity(whole, capacity))
                self.allocator.add_gpu(self._mid(uuid, run), capacity, base)
            for lease in held:
                pool_key, client = f"{run}|{lease.key}", f"{run}|{lease.client}"
                placement = Placement(tuple(self._mid(u, run) for u in lease.gpus), lease.memory, lease.exclusive)
                for waiting in self.allocator.queue:  # taken over now: it overtakes every request waiting
                    waiting.bypassed += 1
                self._leased_on(entry, self.allocator.adopt(pool_key, client, lease.request, placement))
                entry.tests[pool_key] = lease.test
                entry.workers[client] = lease.worker
                entry.since[pool_key] = time.time()
            for ask in asked:
                pool_key, client = f"{run}|{ask.key}", f"{run}|{ask.client}"
                entry.tests[pool_key] = ask.test
                entry.workers[client] = ask.worker
                entry.since[pool_key] = time.time()
                allowed = frozenset(self._mid(u, run) for u in ask.gpus if u in capacities)
                try:
                    self.allocator.queue.append(self._waiting(pool_key, client, ask.request, allowed))
                except Unsatisfiable as exc:
                    out[run].append(("rejected", ask.key, {"message": str(exc)}))
            for port, owner in (ports or {}).items():
                self.ports.adopt(port, f"{run}|{owner}")
            # before the grants below: the last run a new arbiter waits for resumes granting
            # here, and a context declared after it would be one a grant overlooks
            for client, uuids in (contexts or {}).items():
                entry.workers.setdefault(f"{run}|{client}", "?")
                mids = self._own_mids(run, uuids)
                entry.leased_on.setdefault(f"{run}|{client}", set()).update(mids)  # leased there before
                self.allocator.set_contexts(f"{run}|{client}", mids)
            for client, uuids in (exiting or {}).items():
                entry.leased_on.setdefault(f"{run}|{client}", set()).update(self._own_mids(run, uuids))
                self._exiting_locked(run, client, uuids)
            for client, kept in (left or {}).items():
                entry.workers.setdefault(f"{run}|{client}", "?")
                self.allocator.set_left(f"{run}|{client}", self._own_left(run, kept) or {})
            self.pending -= {run, roster_digest(run)}
            if not self.pending:
                self.allocator.paused = False
                self._sample_locked()
                self._deliver_locked(self.allocator.serve(), out)

    def _checked_gpus(self, run: str, gpus: dict[str, int]) -> dict[str, int]:
        """A run's GPUs, each no larger than the arbiter measures it (or than the first run
        that brought it said, where nothing is measured); ValueError for one not on this
        machine, or a part of a GPU (``<uuid>#part-of-rank-<n>``, see
        :func:`pytest_gpu.run.session.machine_names`) that is not one part of a GPU of this
        machine per GPU (a launched rank brings one part of one GPU)."""
        measured = self.truth([u.partition(PART)[0] for u in gpus]) if self.truth is not None else None
        checked = {}
        parts: set[str] = set()
        for uuid, capacity in gpus.items():
            whole, part, rank = uuid.partition(PART)
            if measured is not None and whole not in measured:
                raise ValueError(f"GPU {whole[:UUID_SHOWN]} is not on this machine")
            if part:
                if not rank.isdigit() or int(rank) >= MAX_RANK:
                    raise ValueError(f"{uuid[:UUID_SHOWN]!r} is not a rank's part of a GPU (rank below {MAX_RANK})")
                if whole in parts:
                    raise ValueError(f"a run brings one part of GPU {whole[:UUID_SHOWN]} at most")
                parts.add(whole)
            known = self.allocator.gpus.get(self._known_mid(run, uuid))
            if part and whole in self._mids:  # no larger than its GPU
                known = self.allocator.gpus.get(self._mids[whole]) if known is None else known
            bound = (measured or {}).get(whole, capacity) if known is None else known.capacity
            checked[uuid] = min(capacity, bound)
        return checked

    def _whole_capacity(self, whole: str, part: int) -> int:
        """A GPU that joins as a part's: as the arbiter measures it, else as large as the part."""
        measured = self.truth([whole]) if self.truth is not None else None
        return (measured or {}).get(whole, part)

    def _sweep_locked(self) -> None:
        """Parts of GPUs of runs that are gone leave once nothing uses them, and what those runs
        measured goes with them: re-attaches cannot grow the table (or slow every grant)."""
        gone = [key for key in self._mids if "|" in key and key.partition("|")[0] not in self.runs]
        for key in gone:
            if self.allocator.remove_gpu(self._mids[key]):
                self._allowed = {k: v for k, v in self._allowed.items() if self._mids[key] not in v}
                del self._uuids[self._mids.pop(key)]
        for group in [g for g in self.allocator.policy.measured_by if g not in self.runs]:
            self.allocator.forget_group(group)

    def _check_brought(
        self,
        run: str,
        held: list[Held],
        contexts: dict[str, list[str]] | None,
        exiting: dict[str, list[str]] | None,
        left: dict[str, dict[str, tuple[int, str]]] | None,
    ) -> None:
        """What a run held under the arbiter before this one comes only while runs re-attach
        after a failover, and a lease taken over may overtake no request beyond its bound."""
        if not (held or contexts or exiting or left):
            return
        expected = run in self.pending or roster_digest(run) in self.pending
        if not expected and time.monotonic() - self.took_over > ADOPT_WINDOW_S:
            raise ValueError(
                f"leases, contexts and leftovers held under an earlier arbiter are taken over only within "
                f"{ADOPT_WINDOW_S:.0f}s of a failover, not {time.monotonic() - self.took_over:.0f}s after it"
            )
        if held and not expected:
            bound = self.allocator.policy.max_bypass
            full = [w for w in self.allocator.queue if w.bypassed + len(held) > bound]
            if full:
                raise ValueError(
                    f"{len(held)} lease(s) taken over would overtake a request that waits "
                    f"({full[0].request.describe()}) more than {bound} times"
                )

    def _check_held(self, run: str, held: list[Held], capacities: dict[str, int]) -> None:
        """Leases a run re-declares must name its GPUs and fit beside what is promised
        there (and beside each other): no byte is promised twice through a re-declaration."""
        leased: dict[str, int] = {}
        tenants: dict[str, int] = {}
        whole: set[str] = set()
        for lease in held:
            where = f"the lease {lease.key!r} of test {lease.test!r}"
            unknown = [u for u in lease.gpus if u not in capacities]
            if unknown:
                raise ValueError(f"{where} names GPUs the run did not bring: {', '.join(unknown)}")
            if len(lease.gpus) != lease.request.count or len(set(lease.gpus)) != len(lease.gpus):
                raise ValueError(f"{where} holds {len(lease.gpus)} GPUs for a request of {lease.request.count}")
            for uuid in lease.gpus:
                gpu = self.allocator.gpus.get(self._known_mid(run, uuid))
                if uuid not in leased:
                    leased[uuid] = gpu.leased if gpu is not None else 0
                    tenants[uuid] = gpu.tenants if gpu is not None else 0
                    if gpu is not None and gpu.exclusive:
                        whole.add(uuid)
                capacity = capacities[uuid] if gpu is None else gpu.capacity
                taken = uuid in whole or (lease.exclusive and tenants[uuid] > 0)
                if taken or leased[uuid] + lease.memory > capacity:
                    raise ValueError(f"{where} does not fit on GPU {uuid} beside what is promised there")
                tenants[uuid] += 1
                if lease.exclusive:
                    whole.add(uuid)
                else:
                    leased[uuid] += lease.memory

    def roster(self, viewer: int) -> list[list[Any]]:
        """The runs attached, for a run of user ``viewer`` to keep: after a failover the new
        arbiter waits for them. Its own user's runs by id and pid, other users' by a digest."""
        with self._lock:
            return [[e.run, e.pid] if e.uid == viewer else [roster_digest(e.run), 0] for e in self.runs.values()]

    def _waiting(self, pool_key: str, client: str, request: GpuRequest, allowed: frozenset[int]) -> Any:
        reason = self.allocator.never_fits(request, allowed)
        if reason:
            raise Unsatisfiable(reason)
        return Waiting(pool_key, client, request, allowed=allowed)

    def expect(self, runs: set[str], within: float | None = None) -> None:
        """After a failover: grant nothing until ``runs`` (ids, or roster digests) have
        re-attached (or ``within`` seconds have passed, default ``RESUME_AFTER_S``), so that
        no lease they hold is promised again meanwhile."""
        within = RESUME_AFTER_S if within is None else within
        with self._lock:
            self.pending = set(runs) - set(self.runs) - {roster_digest(r) for r in self.runs}
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
            # nothing is granted from what it held until its processes (orphans, an exiting one:
            # the arbiter's own run's, leaving) count as foreign usage: its contexts are still open
            paused, self.allocator.paused = self.allocator.paused, True
            try:
                for client in sorted(clients):
                    self.allocator.exiting.discard(client)
                    leases, more = self.allocator.forget_client(client)
                    held.extend(self._named(lease) for lease in leases)
                    granted.extend(more)
            finally:
                self.allocator.paused = paused
            self.ports.give_back_prefix(f"{run}|")
            if entry is not None:
                self._sample_locked(force=True)  # its orphans, if any, are foreign from now on
            self._deliver_locked(granted + self.allocator.serve(), out)
            return held

    # -- requests -----------------------------------------------------------------------

    def submit(
        self,
        run: str,
        key: str,
        client: str,
        worker: str,
        test: str,
        request: GpuRequest,
        gpus: list[str],
        prefer: list[str] | None = None,
    ) -> tuple[str, Any]:
        """``("granted", body)``, ``("queued", None)`` or ``("error", message)``; for
        ``key`` only: grants of other requests this one made possible go out as events.

        ``prefer``: the GPUs the run's scheduler planned for the request, a hint
        (:func:`~pytest_gpu.machine.placement.checked_preference`): one that does not name
        ``request.count`` distinct GPUs of the run is ignored, and counted in
        :attr:`preferences_ignored` with why."""
        out: dict[str, list[Event]] = defaultdict(list)
        with self._lock:  # by hand, not _locked(): this is the path every grant takes
            entry = self.runs[run]
            pool_key, pool_client = f"{run}|{key}", f"{run}|{client}"
            if pool_key in self.allocator.leases or any(w.key == pool_key for w in self.allocator.queue):
                return ("error", f"the key {key!r} is held or waited on already")
            if len(entry.tests) >= MAX_KEYS_PER_RUN:
                return ("error", f"a run may have {MAX_KEYS_PER_RUN} requests waiting or granted at once")
            if pool_client not in entry.workers and len(entry.workers) >= MAX_CLIENTS_PER_RUN:
                return ("error", f"a run may lease for {MAX_CLIENTS_PER_RUN} processes at once")
            shape = tuple(gpus)
            allowed = self._allowed.get(shape)
            if allowed is None:
                unknown = sorted(set(gpus) - entry.gpus)
                if unknown:
                    return ("error", f"GPUs the run did not bring: {', '.join(unknown[:4])}")
                allowed = frozenset(self._mid(u, run) for u in gpus)
                # a run asks with one list: a few lists in all (a part is its run's own: not kept)
                if len(self._allowed) < 1024 and not any(PART in u for u in gpus):
                    self._allowed[shape] = allowed
            cap = self.user_memory
            if cap is not None and entry.uid != 0 and (request.memory or 0) * request.count > cap:
                return (
                    "error",
                    f"needs {request.describe()}, more than the {format_size(cap)} one user's leases may hold "
                    f"on this machine at once ({USER_MEMORY_ENV} of the machine's arbiter)",
                )
            entry.tests[pool_key] = test
            entry.workers[pool_client] = worker
            entry.since[pool_key] = time.time()
            self._sample_locked()
            hint: tuple[int, ...] | None = None
            if prefer is not None:
                if set(prefer) <= entry.gpus:
                    hint, why = checked_preference([self._mid(u, run) for u in prefer], request, allowed)
                else:
                    why = "include GPUs the run did not bring"
                if why is not None:
                    self.preferences_ignored += 1
                    self.preference_ignored = f"{test}: the preferred GPUs {prefer[:8]} {why}"
            try:
                granted = self.allocator.submit(pool_key, pool_client, request, allowed, hint)
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
            entry = self.runs.get(run)
            viewer = entry.uid if entry is not None else None
            holders = self._holders_locked(viewer) + self._left_rows_locked(viewer)
            self._deliver_locked(self.allocator.serve(), out)
            return holders

    def abandon(self, run: str, key: str) -> None:
        """Withdraw a request whether it waits or was granted meanwhile (idempotent)."""
        with self._locked() as out:
            pool_key = f"{run}|{key}"
            self._forget_key_locked(pool_key)
            granted = self.allocator.serve() if self.allocator.cancel(pool_key) else self.allocator.release(pool_key)
            self._deliver_locked(granted, out)

    def release(
        self, run: str, key: str, contexts: list[str] | None = None, left: dict[str, tuple[int, str]] | None = None
    ) -> None:
        """Give a lease back; ``contexts``: the GPUs its process really has contexts on now, if
        known; ``left``: GPU -> (bytes, who left them), what its process still holds of leases
        that ended, on every GPU where it holds some, if told (counted like leases, see
        :meth:`~pytest_gpu.machine.placement.Allocator.set_left`)."""
        out: dict[str, list[Event]] = defaultdict(list)
        with self._lock:
            pool_key = f"{run}|{key}"
            self._forget_key_locked(pool_key)
            known = None if contexts is None else self._own_mids(run, contexts)
            self._deliver_locked(self.allocator.release(pool_key, known, self._own_left(run, left)), out)
            sinks = self._sinks_locked(out)
        self._dispatch(out, sinks)

    def _own_left(self, run: str, left: dict[str, tuple[int, str]] | None) -> dict[int, tuple[int, str]] | None:
        """``left`` in the allocator's numbers, on the GPUs ``run`` brought only."""
        if left is None:
            return None
        entry = self.runs.get(run)
        brought = entry.gpus if entry is not None else frozenset()
        return {self._known_mid(run, u): n for u, n in left.items() if u in brought and self._known_mid(run, u) >= 0}

    def _own_mids(self, run: str, uuids: list[str]) -> set[int]:
        """The allocator's numbers of ``uuids``, those ``run`` brought only."""
        entry = self.runs.get(run)
        brought = entry.gpus if entry is not None else frozenset()
        return {self._known_mid(run, u) for u in uuids if u in brought and self._known_mid(run, u) >= 0}

    def _leased_mids(self, run: str, client: str, uuids: list[str]) -> set[int]:
        """:meth:`_own_mids` of a ``client`` that was granted a lease (a process that tests; its
        contexts may outlast its leases, or stray beyond them); none of one that never was:
        contexts of made-up clients would take room no lease accounts for."""
        entry = self.runs.get(run)
        if entry is None or f"{run}|{client}" not in entry.leased_on:
            return set()
        return self._own_mids(run, uuids)

    def _check_client(self, run: str, client: str) -> None:
        entry = self.runs.get(run)
        if entry is not None and f"{run}|{client}" not in entry.workers:
            if len(entry.workers) >= MAX_CLIENTS_PER_RUN:
                raise ValueError(f"a run may lease for {MAX_CLIENTS_PER_RUN} processes at once")
            entry.workers[f"{run}|{client}"] = "?"

    def set_contexts(self, run: str, client: str, contexts: list[str]) -> None:
        with self._locked() as out:
            self._check_client(run, client)
            self.allocator.set_contexts(f"{run}|{client}", self._leased_mids(run, client, contexts))
            self._deliver_locked(self.allocator.serve(), out)

    def measure_context(self, run: str, uuid: str, nbytes: int) -> bool:
        """A process of ``run`` measured one CUDA context on GPU ``uuid``: ``nbytes``, used for
        that GPU's placement from now on (see :meth:`Allocator.measure_context`): for ``run``'s
        own contexts only, unless ``run`` is the arbiter's own (its process's word is the
        arbiter's: then for every run's). Either way no more than the GPU's context budget
        (``context_fraction`` of it): another run's word cannot make a GPU unusable, and a
        run's own only makes its own contexts count larger. A GPU the run did not bring, or a
        size not within (0, the GPU's capacity), is refused (ValueError)."""
        with self._locked() as out:
            mids = self._own_mids(run, [uuid])
            if not mids:
                raise ValueError(f"GPU {uuid[:UUID_SHOWN]!r} is not one this run brought")
            mid = mids.pop()
            capacity = self.allocator.gpus[mid].capacity
            if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 < nbytes < capacity:
                raise ValueError(f"a context's size must be an integer in (0, {capacity}), got {nbytes!r:.40}")
            policy = self.allocator.policy
            nbytes = min(nbytes, max(policy.overhead, int(policy.context_fraction * capacity)))
            entry = self.runs.get(run)
            vouched = entry is not None and entry.pid == os.getpid()
            changed = self.allocator.measure_context(mid, nbytes, None if vouched else run)
            if changed:
                self._deliver_locked(self.allocator.serve(), out)
            return changed

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
            self._check_client(run, client)
            self._exiting_locked(run, client, contexts)

    def _exiting_locked(self, run: str, client: str, contexts: list[str]) -> None:
        stand_in = f"{run}|{client}~exiting"
        self.allocator.set_contexts(stand_in, self._leased_mids(run, client, contexts))
        self.allocator.exiting.add(stand_in)

    def exited(self, run: str, client: str) -> None:
        with self._locked() as out:
            stand_in = f"{run}|{client}~exiting"
            self.allocator.set_contexts(stand_in, set())
            self.allocator.exiting.discard(stand_in)
            entry = self.runs.get(run)
            if entry is not None and entry.workers.get(f"{run}|{client}") == "?":
                del entry.workers[f"{run}|{client}"]
            self._deliver_locked(self.allocator.serve(), out)

    # -- questions ----------------------------------------------------------------------

    def room(self, gpus: list[str], run: str | None = None) -> list[int]:
        """What each of ``gpus`` (as ``run`` names them; default: the arbiter's own run) can
        give leases now beside the CUDA contexts open there, what processes still hold of
        leases that ended, parts of it in use, and foreign usage (a lease of a process without
        a context there also opens one: the scheduler counts that per worker)."""
        policy = self.allocator.policy
        with self._lock:
            if run is None:
                run = next((e.run for e in self.runs.values() if e.pid == os.getpid()), "")
            carved = carved_parts(self.allocator.gpus.values()) or {}
            rows = []
            for uuid in gpus:
                gpu = self.allocator.gpus.get(self._known_mid(run, uuid))
                if gpu is None:
                    rows.append(0)
                    continue
                taken = gpu.foreign + gpu.left_bytes + policy.contexts(gpu.index, gpu.contexts)
                rows.append(max(gpu.capacity - taken - carved.get(gpu.index, 0), 0))
            return rows

    def _sees(self, viewer: int | None, entry: RunEntry | None) -> bool:
        """Whether ``viewer`` (a uid; ``None``: no one in particular) may see a run's details:
        its own user's runs, or every run for root."""
        return viewer is None or viewer == 0 or (entry is not None and entry.uid == viewer)

    def _holders_locked(self, viewer: int | None = None) -> list[dict[str, Any]]:
        rows = []
        for lease in self.allocator.leases.values():
            run, _ = self._split(lease.key)
            entry = self.runs.get(run)
            row = {
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
            if not self._sees(viewer, entry):
                user = row["user"]
                row.update(run="", run_label="", test=f"a test of user {user}", worker="another run", since=None)
            rows.append(row)
        return rows

    def _left_rows_locked(self, viewer: int | None = None) -> list[dict[str, Any]]:
        """What processes still hold of leases that ended, as holder rows (``left``: True, the
        holder named in ``test``)."""
        rows = []
        for index, gpu in self.allocator.gpus.items():
            for client, (nbytes, who) in gpu.left.items():
                run, _ = self._split(client)
                entry = self.runs.get(run)
                seen = self._sees(viewer, entry)
                rows.append(
                    {
                        "run": run if seen else "",
                        "run_label": (entry.label if entry else "?") if seen else "",
                        "user": entry.user if entry else "?",
                        "test": (who or "?") if seen else f"a test of user {entry.user if entry else '?'}",
                        "worker": (entry.workers.get(client, "?") if entry else "?") if seen else "another run",
                        "gpus": [self._uuids[index]],
                        "memory": nbytes,
                        "exclusive": False,
                        "cpus": 0,
                        "host_memory": 0,
                        "since": None,
                        "left": True,
                    }
                )
        return rows

    def holders(self, viewer: int | None = None) -> list[dict[str, Any]]:
        with self._lock:
            return self._holders_locked(viewer)

    def status(self, viewer: int | None = None) -> dict[str, Any]:
        """The machine now: runs, GPUs, leases and who waits for what (``pytest-gpu status``).

        ``viewer``: the uid asking (``None``: everything). Of another user's runs a viewer
        sees that they exist, their user, how many leases they hold and on which GPUs: no
        run id, pid, command, directory, test, worker or request (root sees everything)."""
        with self._lock:
            waiting = []
            for w in self.allocator.queue:
                run, key = self._split(w.key)
                entry = self.runs.get(run)
                if not self._sees(viewer, entry):
                    continue
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
            held: dict[str, list[Lease]] = defaultdict(list)
            for lease in self.allocator.leases.values():
                held[self._split(lease.key)[0]].append(lease)
            runs = []
            for e in self.runs.values():
                gpus = sorted({self._uuids[i] for lease in held[e.run] for i in lease.placement.indices})
                row: dict[str, Any] = {"user": e.user, "leases": len(held[e.run]), "gpus": gpus}
                if self._sees(viewer, e):
                    row.update(run=e.run, pid=e.pid, label=e.label, attached=e.attached)
                runs.append(row)
            return {
                "runs": runs,
                "pending": sorted(r for r in self.pending if viewer in (None, 0) or run_uid(r) == viewer),
                "gpus": [
                    {
                        "uuid": self._uuids[i],
                        "capacity": g.capacity,
                        "leased": self.allocator.used(i),
                        "foreign": g.foreign,
                        "contexts": len(g.contexts),
                        "left": g.left_bytes,
                        "clients": sorted(
                            c for c in g.contexts if self._sees(viewer, self.runs.get(self._split(c)[0]))
                        ),
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
                "leases": [r for r in self._holders_locked(viewer) if r["run"]],
                "waiting": waiting,
                "grants": self.grants,
            }

    # -- ports --------------------------------------------------------------------------

    def take_ports(self, run: str, n: int, owner: str, port_range: tuple[int, int]) -> dict[str, Any]:
        """``{"ports": [...]}``: ``n`` ports in ``port_range`` that no run of the machine
        holds, now ``run``'s ``owner``'s; or ``{"refused": why}`` when too few are free."""
        with self._lock:
            if sum(o.startswith(f"{run}|") for o in self.ports.owners.values()) + n > MAX_KEYS_PER_RUN:
                return {"refused": f"a run may hold {MAX_KEYS_PER_RUN} ports at once"}
            try:
                return {"ports": self.ports.take(n, f"{run}|{owner}", port_range)}
            except RuntimeError as exc:
                return {"refused": str(exc)}

    def give_back_ports(self, run: str, owner: str) -> list[int]:
        with self._lock:
            return self.ports.give_back(f"{run}|{owner}")

    def give_back_ports_prefix(self, run: str, prefix: str) -> list[int]:
        """Every port of ``run`` whose owner starts with ``prefix`` (a client's)."""
        with self._lock:
            return self.ports.give_back_prefix(f"{run}|{prefix}")
