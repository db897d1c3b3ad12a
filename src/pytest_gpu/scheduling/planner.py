"""Which test an xdist worker runs next (pure policy: no pytest, no I/O, no clock).

The scheduler feeds this with what the workers collected (each test's GPU need, pool
key, group) and past durations, and asks :meth:`Planner.pick` whenever a worker needs
its next test. xdist runs a worker's test only once the worker holds the test after
it, so a worker's queue is kept at two: the running test and the next one. The next
one is chosen when the running one starts, for the moment it is predicted to start.
Where a worker's held tests are short, it holds a third (:meth:`Planner.fill`), so that
it starts each test without waiting for the controller to answer the last completion.

Rules, in order:

0. Tests that run *alone* (``gpu_serial``; a group with such a test runs alone as a
   whole) go before everything else. While one is held by a worker, no other worker is
   given anything; the worker holding it gets its successor (the next test to run alone,
   else what rule 1-4 give, which starts only once it finished). A pending one is handed
   out only once no worker runs a test (each holds at most one, not started: xdist starts
   a test only once its worker holds the next). First in the run, that drain is free, and
   no idle worker holds a warm rank pool or a fixture's lease that it would wait for.
1. Tests of a *group* (an ``xdist_group`` mark, or a chain of pytest-dependency
   tests) go to one worker, in collection order; a group is bound to the worker that
   took its first test until that worker goes away. That worker runs the group's
   tests back to back while they fit, so module- and class-scoped fixtures are set
   up once and not torn down in between by other modules' tests. What a group's
   fixtures hold besides its tests' own needs (:attr:`Planner.held`, e.g. a
   module-scoped model's lease) is counted with each of its tests. Such a fixture lives
   until its worker leaves the module (or class), also through the module's tests in no
   group: a GPU test among those (``Job.before``) is handed out before the group's first
   test, ranked as that test would be (or by its own rank, if ahead), never after the
   group on its worker, where it would wait for GPUs while the fixture holds a lease
   (two such workers, each waiting for what the other's fixture holds, would deadlock).
2. A worker that last ran a distributed test of pool key K takes the first pending
   test of K (by the priority of rule 3) that fits, so its warm rank pool is reused;
   other workers leave K's tests to it unless they have nothing else that fits.
3. Otherwise by priority among the tests whose GPUs are predicted to be free when the
   worker starts them (a CPU-only test always fits): tests the :class:`Order` moves
   ahead first (last run's failures under ``--ff`` or ``-x``, new tests under ``--nf``),
   then longest first, or shortest first when the run stops at its first failures
   (``-x``/``--maxfail``: the time to the first failure counts, not the makespan). A
   group weighs its remaining duration and the most advanced of its pending tests. A
   worker's warm pool (rule 2) waits while a test moved further ahead is pending.
4. When nothing fits and the worker's running test needs a successor (or no worker
   is busy at all), the test predicted to fit soonest; the worker's blocking acquire
   at the broker remains the safety net for every misprediction.

Predictions: every test a worker holds is laid out back to back from when its running
test started, each for its expected duration (a test running over its estimate is
assumed to end now). A candidate fits when, at its start and at every later start of
a predicted test it overlaps, all predicted needs then active plus its own can be
packed onto the room of its node's GPUs. What a worker's running test holds already
(:attr:`NodeView.placements`, the broker's grants) stays on the GPUs it was granted until the
test is predicted to end: only what is not granted yet is packed freely. (Repacking a
granted lease would let a test through that no GPU has room for at the moment: it would
then wait at the broker, its worker idle.)

Plans: a GPU test that is picked is also given GPUs (:meth:`Planner.planned`), for when it
is predicted to start (rule 4: once it is predicted to fit), where it fits through its whole
predicted span beside what is held or planned there, by the broker's rule
(:func:`pytest_gpu.machine.placement.place`): a GPU no lease holds over that span first, then
GPUs its worker has a CUDA context on, then the least loaded, then the tightest fit (with a
view's ``spread`` off, the rule before: its worker's context GPUs first, busy or not). Until
the broker grants its lease, every later pick counts it there, as if granted; the scheduler
passes the plan to the broker as a preference, which it honours when the request fits there
(so the tests of one round do not land where the planner counted another one). A worker's
first lease on a GPU also opens its CUDA context there (:attr:`NodeView.context_sizes`): a test
fits a GPU its worker has no context on only with room for that context too.

Nodes: the planner reads each node's GPUs from its view (:attr:`Planner.nodes`, node ->
:class:`~pytest_gpu.leasing.view.NodeView`, refreshed by the scheduler before its picks); a
run on one machine is a run with one node. A worker packs onto its node's GPUs beside its
node's workers only, and a plan names its node's GPUs (by position: the view translates). A
test whose need its worker's node can never hold (:meth:`NodeView.can_ever`) is left to the
workers of a node that can; one that no node can hold goes to any worker, whose broker says why.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from ..leasing.view import NodeView

# A test predicted to be running past its estimate is assumed to end this much later.
_OVERDUE = 0.05
# When nothing fits, how many candidates (by priority) are compared for the soonest fit.
_FALLBACK_SCAN = 64
# How many pending tests of one GPU need a pick looks at (by priority).
_SCAN = 256
# How many tests a worker holds at most: the running one, the next (xdist starts a test only
# once its worker holds the one after), and one more, so that it never waits for the controller.
HELD = 3
# ... where the tests it holds are predicted to end within this many seconds (see Planner.fill).
AHEAD_WINDOW = 0.5


@dataclass(frozen=True)
class Need:
    """GPUs one test holds while it runs: ``count`` GPUs, ``memory`` bytes each (``None``: whole GPUs)."""

    count: int
    memory: int | None


@dataclass(frozen=True)
class Job:
    """One test as the planner sees it (``index`` in the collection order)."""

    index: int
    duration: float
    need: Need | None = None
    group: str | None = None
    pool: str | None = None
    alone: bool = False  # gpu_serial: no other test of the run runs meanwhile (rule 0)
    before: tuple[str, ...] = ()  # groups not started while this (ungrouped) test is pending (rule 1)


@dataclass(frozen=True)
class Order:
    """What goes first among pending tests (the scheduler derives it from ``--ff``/``--nf``/``-x``).

    ``ahead``: collection index -> how far that test is moved ahead (higher first;
    absent: 0). ``shortest_first``: ties go to the shorter test, not the longer one.
    The default, ``Order()``, is plain longest first."""

    ahead: Mapping[int, int] = field(default_factory=dict)
    shortest_first: bool = False


@dataclass
class _Worker:
    queue: list[int] = field(default_factory=list)  # held tests; queue[0] runs once a successor is held
    head_since: float | None = None  # when queue[0] started (None: it waits for a successor)
    last_pool: str | None = None


@dataclass(frozen=True)
class Grant:
    """A lease the broker granted (or the planner planned): on GPUs ``gpus``, ``memory`` bytes
    each (``None``: whole GPUs); ``contexts``: what a planned lease's new CUDA context takes on
    each of ``gpus`` besides (0 where its worker has one; a granted lease's is in the room)."""

    gpus: tuple[int, ...]
    memory: int | None
    contexts: tuple[int, ...] = ()


@dataclass(frozen=True)
class _Span:
    start: float
    end: float
    need: Need
    grant: Grant | None = None  # where it is already held (then ``need`` is not packed)


class Planner:
    """Online list scheduling of ``jobs`` onto workers over the GPUs of their nodes (:attr:`nodes`)."""

    def __init__(self, jobs: Iterable[Job], order: Order | None = None) -> None:
        jobs = list(jobs)
        self.jobs: dict[int, Job] = {}
        self.order = order if order is not None else Order()
        self._sign = 1.0 if self.order.shortest_first else -1.0
        # pending ungrouped tests, by priority (rule 3): CPU-only and GPU ones apart (a CPU test
        # always fits, so a pick never scans past the first one), and by pool key
        self._cpu: list[int] = []
        self._by_need: dict[Need, list[int]] = {}
        self._by_pool: dict[str, list[int]] = {}
        self._groups: dict[str, deque[int]] = {}  # pending group members, collection order
        # rule 0: tests that run alone, and groups with such a test (pending, as above)
        self._alone: list[int] = []
        self._alone_groups: dict[str, deque[int]] = {}
        self._alone_group_names = frozenset(j.group for j in jobs if j.alone and j.group is not None)
        self._bound: dict[str, str] = {}  # group -> worker
        self._pool_owner: dict[str, str] = {}  # pool key -> worker that last ran it
        self._workers: dict[str, _Worker] = {}
        # group -> needs its fixtures hold while its tests run, besides their own (a live
        # mapping: the scheduler learns them as workers set those fixtures up)
        self.held: Mapping[str, Sequence[Need]] = {}
        self._plans: dict[int, Grant] = {}  # held test -> the GPUs planned for its own need (see planned)
        self._node_of: dict[str, str] = {}  # worker -> its node
        self._views: Mapping[str, NodeView] = {}
        # from the views, at the planner's positions: worker -> the leases its processes hold
        # now (its running test is predicted to hold these, where they are, until it ends), and
        # the GPUs its processes have a CUDA context on
        self._placed: dict[str, list[Grant]] = {}
        self._opened: dict[str, frozenset[int]] = {}
        self._ever_memo: dict[tuple[str, Need], bool] = {}
        for job in sorted(jobs, key=lambda j: j.index):
            self.jobs[job.index] = job
            if job.group is not None:
                self._group_lists(job.group).setdefault(job.group, deque()).append(job.index)
        # every test of the alone phase, to know whether a worker holds one
        self.alone = frozenset(i for i, j in self.jobs.items() if j.alone or j.group in self._alone_group_names)
        # rule 1: pending tests that hold groups back (by group), those groups, and the tests'
        # ranks: as the group's first test's (if ahead), so they go before an open group as heavy
        firsts = [j for j in self.jobs.values() if j.before and j.group is None and not j.alone]
        self._gated = {j.index: [g for g in j.before if g in self._groups] for j in firsts}
        self._gates: Counter[str] = Counter(g for groups in self._gated.values() for g in groups)
        self._lead: dict[int, tuple[int, float, int]] = {}
        for index, gated in self._gated.items():
            own, weight = self._rank(index), self._sign * self.jobs[index].duration
            ranks = [self._group_rank(self._groups[g]) for g in gated]
            self._lead[index] = min([own, *((min(own[0], a), w + weight, index) for a, w, _ in ranks)])
        for index in sorted((j.index for j in self.jobs.values() if j.group is None), key=self._rank):
            self._add_single(index)
        # how many pending tests are moved ahead, by how far: a warm pool waits for them
        self._ahead_pending: Counter[int] = Counter(self.order.ahead.get(i, 0) for i in self.jobs)

    def _lists(self, index: int) -> list[list[int]]:
        """The pending lists an ungrouped test belongs to."""
        job = self.jobs[index]
        if job.alone:
            return [self._alone]
        lists = [self._cpu if job.need is None else self._by_need.setdefault(job.need, [])]
        if job.pool is not None:
            lists.append(self._by_pool.setdefault(job.pool, []))
        return lists

    def _add_single(self, index: int) -> None:
        for target in self._lists(index):
            bisect.insort(target, index, key=self._rank)

    def _rank(self, index: int) -> tuple[int, float, int]:
        if index in self._lead:
            return self._lead[index]
        return (-self.order.ahead.get(index, 0), self._sign * self.jobs[index].duration, index)

    def _group_rank(self, members: deque[int]) -> tuple[int, float, int]:
        ahead = max(self.order.ahead.get(i, 0) for i in members)
        return (-ahead, self._sign * sum(self.jobs[i].duration for i in members), members[0])

    # -- workers --------------------------------------------------------------------

    @property
    def nodes(self) -> Mapping[str, NodeView]:
        """Node -> its GPUs now (room, grants, contexts and their sizes, limits); the scheduler
        sets it before its picks. A node without a view (lost) has no GPUs to pack onto."""
        return self._views

    @nodes.setter
    def nodes(self, views: Mapping[str, NodeView]) -> None:
        self._views = views
        self._placed = {
            w: [Grant(gpus, memory) for gpus, memory in rows]
            for view in views.values()
            for w, rows in view.placed.items()
        }
        self._opened = {w: gpus for view in views.values() for w, gpus in view.opened.items()}
        self._ever_memo = {}

    def add_worker(self, worker: str, node: str) -> None:
        """A new worker, on ``node`` (a run on one machine has one)."""
        self._workers.setdefault(worker, _Worker())
        self._node_of[worker] = node

    def node_of(self, worker: str) -> str | None:
        """The node ``worker`` was added with (``None``: no such worker)."""
        return self._node_of.get(worker)

    def _ever(self, worker: str, need: Need) -> bool:
        """Whether ``worker`` may ever be given a test of ``need``: its node can hold it some
        day, or no node can (its broker says why); not when only other nodes can."""
        if len(self._views) < 2:
            return True  # no other node to leave it to (a pick asks this for every need)
        node = self._node_of.get(worker, "")
        key = (node, need)
        if key not in self._ever_memo:
            view = self._views.get(node)
            self._ever_memo[key] = (
                view is None
                or view.can_ever(need.count, need.memory)
                or not any(v.can_ever(need.count, need.memory) for n, v in self._views.items() if n != node)
            )
        return self._ever_memo[key]

    def _capacities(self, worker: str) -> Sequence[int]:
        """The GPUs ``worker``'s tests are packed onto: its node's room."""
        view = self._views.get(self._node_of.get(worker, ""))
        return view.room if view is not None else ()

    def remove_worker(self, worker: str) -> list[int]:
        """Forget ``worker``; its held tests except the running one go back to pending.

        Returns every test it held, running one first (the caller reports that one)."""
        state = self._workers.pop(worker, None)
        self._node_of.pop(worker, None)
        if state is None:
            return []
        for group in [g for g, w in self._bound.items() if w == worker]:
            del self._bound[group]
        for key in [k for k, w in self._pool_owner.items() if w == worker]:
            del self._pool_owner[key]
        for index in reversed(state.queue[1:]):
            self.requeue(index)
        for index in state.queue[:1]:
            self._plans.pop(index, None)
        return list(state.queue)

    def queue(self, worker: str) -> list[int]:
        return list(self._workers[worker].queue)

    @property
    def workers(self) -> list[str]:
        return list(self._workers)

    @property
    def pending(self) -> int:
        singles = len(self._cpu) + sum(len(m) for m in self._by_need.values()) + len(self._alone)
        grouped = sum(len(m) for m in self._groups.values()) + sum(len(m) for m in self._alone_groups.values())
        return singles + grouped

    def requeue(self, index: int) -> None:
        """Put a test back into pending (a crashed worker's queue, or a rerun)."""
        job = self.jobs[index]
        self._plans.pop(index, None)
        self._ahead_pending[self.order.ahead.get(index, 0)] += 1
        self._gates.update(self._gated.get(index, ()))
        if job.group is not None:
            members = self._group_lists(job.group).setdefault(job.group, deque())
            members.appendleft(index)  # callers give a worker's queue back in reverse
        else:
            self._add_single(index)

    def complete(self, worker: str, index: int, now: float) -> None:
        """``worker`` finished ``index``; the test it held next starts now."""
        state = self._workers[worker]
        if index in state.queue:
            state.queue.remove(index)
        self._plans.pop(index, None)
        state.head_since = now if state.queue else None

    def planned(self, index: int) -> Grant | None:
        """The GPUs planned for held test ``index``'s own need (see the module docstring), or ``None``."""
        return self._plans.get(index)

    def eligible(self, worker: str) -> bool:
        """Whether some pending test may go to ``worker`` (not all bound to others)."""
        if self._cpu or self._alone or any(m and self._ever(worker, n) for n, m in self._by_need.items()):
            return True
        groups = itertools.chain(self._groups.items(), self._alone_groups.items())
        return any(members and self._bound.get(g, worker) == worker for g, members in groups)

    # -- choosing -------------------------------------------------------------------

    def fill(self, workers: Sequence[str], now: float) -> list[tuple[str, int]]:
        """Top ``workers`` up (the live ones, in xdist's order): the (worker, test) handed out, in order.

        In rounds: every worker to one held test before any gets a second (a handful of tests
        spreads over the workers instead of queueing on the first), then to two (xdist starts
        a test only once its worker holds the next), then to :data:`HELD` where the tests it
        holds are predicted to end within :data:`AHEAD_WINDOW`: the test after the next, so
        that a worker that ends a short test starts its next one at once instead of waiting
        for the controller's answer (a round trip that weighs on short tests, not long ones).
        That one is handed out only where it fits when it is predicted to start (never to
        wait: rule 4 stays for a worker's next test), only while more tests are pending than
        there are workers (the end of the run stays balanced), and it starts at most
        :data:`AHEAD_WINDOW` later than on a worker that asks next."""
        given: list[tuple[str, int]] = []
        for target in range(1, HELD + 1):
            for worker in workers:
                while len(self._workers[worker].queue) < target:
                    ahead = target > 2
                    if ahead and (self.pending <= len(workers) or self._forecast(worker, now)[1] > now + AHEAD_WINDOW):
                        break
                    index = self.pick(worker, now, wait=not ahead)
                    if index is None:
                        break
                    given.append((worker, index))
        return given

    def pick(self, worker: str, now: float, *, wait: bool = True) -> int | None:
        """The test ``worker`` should hold next (already assigned to it), or ``None``.

        ``None`` when nothing is eligible, or when nothing fits yet, the worker holds
        nothing and another worker is busy (its completion will ask again), or while a
        test that runs alone waits for the run to drain or runs on another worker (rule 0).
        ``wait=False``: only a test predicted to fit at its start, never rule 4's."""
        state = self._workers[worker]
        if self.alone:  # rule 0 (a suite without gpu_serial tests pays one check)
            alone = self._pick_alone(worker)
            if alone is not None:
                if alone >= 0:
                    self._assign(worker, alone, now)
                    return alone
                return None
        spans, start = self._forecast(worker, now)
        caps = self._capacities(worker)
        extra = self._new_contexts(worker)
        at_start: dict[Need, bool] = {}  # few distinct needs: a quick "no" for most candidates
        memo: dict[tuple[tuple[Need, ...], float], bool] = {}

        def viable(need: Need) -> bool:
            if need not in at_start:
                at_start[need] = self._fits_at((need,), start, 0.0, spans, caps, extra)
            return at_start[need]

        def fits(index: int) -> bool:
            job = self.jobs[index]
            needs = self._needs(job)
            if not needs:
                return True
            if not all(viable(need) for need in needs):
                return False
            key = (needs, job.duration)
            if key not in memo:
                memo[key] = self._fits_at(needs, start, job.duration, spans, caps, extra)
            return memo[key]

        own_groups = [m[0] for g, m in self._groups.items() if m and self._bound.get(g) == worker]
        pool_tests: Iterable[int] = self._by_pool.get(state.last_pool, []) if state.last_pool is not None else []
        if self.order.ahead:  # the warm pool waits while a test moved further ahead is pending
            top = max((ahead for ahead, count in self._ahead_pending.items() if count), default=0)
            pool_tests = (i for i in pool_tests if self.order.ahead.get(i, 0) >= top)
        passes: tuple[Iterable[int], ...] = (
            own_groups,  # finish a group it started
            pool_tests,  # keep its warm pool busy
            (i for i in self._candidates(worker, viable) if not self._owned_elsewhere(i, worker)),
            self._candidates(worker, viable),  # steal another worker's pool tests rather than idle
        )
        choice: int | None = None
        for candidates in passes:
            choice = next((i for i in candidates if fits(i)), None)
            if choice is not None:
                self._plan(choice, start, spans, caps, extra)
                break
        if choice is None and wait and (state.queue or not self._anyone_busy(worker)):
            # nothing fits: among the first few by priority, the one predicted to fit soonest
            first = list(itertools.islice(self._candidates(worker), _FALLBACK_SCAN))
            if first:  # ties go by priority order (a group weighs its remaining time)
                when = [self._fit_time(self.jobs[i], start, spans, caps, extra) for i in first]
                soonest = min(range(len(first)), key=lambda k: (when[k], k))
                choice = first[soonest]
                if when[soonest] < float("inf"):  # where it will fit once what it waits for ended
                    self._plan(choice, when[soonest], spans, caps, extra)
        if choice is not None:
            self._assign(worker, choice, now)
        return choice

    def _pick_alone(self, worker: str) -> int | None:
        """Rule 0: the test that runs alone ``worker`` gets; ``-1``: it gets nothing now;
        ``None``: rules 1-4 decide (nothing of the kind is pending, or ``worker`` holds the
        last one and gets its successor, which starts once it finished)."""
        holders = [w for w, s in self._workers.items() if any(i in self.alone for i in s.queue)]
        if holders and holders != [worker]:
            return -1  # the run is another worker's test's alone
        if not self._alone and not self._alone_groups:
            return None
        if not holders and any(len(s.queue) > 1 for s in self._workers.values()):
            return -1  # draining: nothing else starts; handed out once no worker runs a test
        own = [m[0] for g, m in self._alone_groups.items() if self._bound.get(g) == worker]
        if own:
            return own[0]  # a group that runs alone, back to back, in collection order
        first = [(self._rank(i), i) for i in self._alone[:1]]
        first += [(self._group_rank(m), m[0]) for g, m in self._alone_groups.items() if g not in self._bound]
        if first:
            return min(first)[1]
        return None if holders else -1  # what is left is a group bound to another worker

    def _group_lists(self, group: str) -> dict[str, deque[int]]:
        """The pending groups ``group`` is among (rule 0's, or the others)."""
        return self._alone_groups if group in self._alone_group_names else self._groups

    def _candidates(self, worker: str, viable: Callable[[Need], bool] | None = None) -> Iterator[int]:
        """Eligible pending tests in priority order (see rule 3), a group by its remaining tests.

        GPU tests whose need cannot fit at all (``viable``) are left out, and of each need
        only the first few are looked at: a pick costs the same for 100 tests or 100,000."""
        # a worker with a group of its own still pending starts no other group: it would
        # bind that one too and interleave the two, while other workers idle
        busy_with_group = any(members and self._bound.get(g) == worker for g, members in self._groups.items())
        groups = sorted(
            (self._group_rank(members), members[0])
            for g, members in self._groups.items()
            if members
            and (self._bound.get(g) == worker or (g not in self._bound and not busy_with_group and not self._gates[g]))
        )
        streams: list[Iterator[tuple[tuple[int, float, int], int]]] = [
            iter(groups),
            ((self._rank(i), i) for i in self._cpu),
        ]
        for need, members in self._by_need.items():
            # a need its node can never give is left to other nodes' workers (viable() or not)
            if members and self._ever(worker, need) and (viable is None or viable(need)):
                streams.append((self._rank(i), i) for i in itertools.islice(members, _SCAN))
        for _, index in heapq.merge(*streams):
            yield index

    def _owned_elsewhere(self, index: int, worker: str) -> bool:
        pool = self.jobs[index].pool
        return pool is not None and self._pool_owner.get(pool, worker) != worker

    def _anyone_busy(self, worker: str) -> bool:
        return any(s.queue for w, s in self._workers.items() if w != worker)

    def _assign(self, worker: str, index: int, now: float) -> None:
        job = self.jobs[index]
        self._ahead_pending[self.order.ahead.get(index, 0)] -= 1
        self._gates.subtract(self._gated.get(index, ()))
        if job.group is not None:
            groups = self._group_lists(job.group)
            groups[job.group].popleft()
            if not groups[job.group]:
                del groups[job.group]
            self._bound[job.group] = worker
        else:
            for target in self._lists(index):
                target.remove(index)
        state = self._workers[worker]
        state.queue.append(index)
        if len(state.queue) == 2 and state.head_since is None:
            state.head_since = now  # the held test starts now that it has a successor
        if job.pool is not None:
            state.last_pool = job.pool
            self._pool_owner[job.pool] = worker

    # -- prediction -----------------------------------------------------------------

    def _forecast(self, worker: str, now: float) -> tuple[list[_Span], float]:
        """Predicted GPU spans of every held test on ``worker``'s node, and when ``worker`` is free."""
        spans: list[_Span] = []
        free_at = now
        node = self._node_of.get(worker)
        for name, state in self._workers.items():
            if self._node_of.get(name) != node:
                continue  # another node's GPUs
            t = state.head_since if state.head_since is not None else now
            for position, index in enumerate(state.queue):
                job = self.jobs[index]
                end = t + job.duration
                if position == 0:
                    end = max(end, now + _OVERDUE)
                grants = self._placed.get(name, ()) if position == 0 and state.head_since is not None else ()
                plan = self._plans.get(index)
                if grants:  # running and granted: what it holds stays where it is
                    spans += [_Span(t, end, Need(len(g.gpus), g.memory), g) for g in grants]
                elif plan is not None and job.need is not None:  # held where it was planned, till granted
                    spans.append(_Span(t, end, job.need, self._unopened(plan, name)))
                    spans += [_Span(t, end, need) for need in self._needs(job)[1:]]
                else:
                    spans += [_Span(t, end, need) for need in self._needs(job)]
                t = end
            if name == worker:
                free_at = t
        return spans, free_at

    def _needs(self, job: Job) -> tuple[Need, ...]:
        """What ``job`` holds while it runs: its own need and what its group's fixtures hold."""
        held = tuple(self.held.get(job.group, ())) if job.group is not None else ()
        return held if job.need is None else (job.need, *held)

    def _new_contexts(self, worker: str) -> list[int] | None:
        """Per GPU: what a lease of ``worker`` adds there besides its memory, a new CUDA
        context (0 where it has one, or will once a test it holds got its planned GPUs);
        ``None`` when contexts are not counted."""
        view = self._views.get(self._node_of.get(worker, ""))
        sizes = view.context_sizes if view is not None else ()
        if not sizes:
            return None
        have = set(self._opened.get(worker, ()))
        for index in self._workers[worker].queue:
            plan = self._plans.get(index)
            if plan is not None:
                have.update(plan.gpus)
        return [0 if i in have else size for i, size in enumerate(sizes)]

    def _unopened(self, plan: Grant, worker: str) -> Grant:
        """``plan`` less the contexts ``worker`` opened since it was made (the room counts those now)."""
        have = self._opened.get(worker, frozenset())
        if not plan.contexts or not any(i in have for i in plan.gpus):
            return plan
        return Grant(
            plan.gpus, plan.memory, tuple(0 if i in have else c for i, c in zip(plan.gpus, plan.contexts, strict=True))
        )

    @staticmethod
    def _active(spans: Sequence[_Span], start: float, duration: float) -> tuple[list[_Span], list[float]]:
        """The spans that overlap ``duration`` from ``start``, and the moments to check: the
        start and every later start of one of them."""
        end = start + max(duration, 1e-6)
        overlapping = [s for s in spans if s.start < end and s.end > start]
        return overlapping, sorted({start} | {s.start for s in overlapping if s.start > start})

    def _fits_at(
        self,
        needs: Sequence[Need],
        start: float,
        duration: float,
        spans: list[_Span],
        caps: Sequence[int],
        extra: Sequence[int] | None = None,
    ) -> bool:
        """Whether a candidate's ``needs`` (``extra`` more on each GPU: its new contexts)
        fit on GPUs of ``caps`` beside ``spans`` for ``duration`` from ``start``."""
        overlapping, points = self._active(spans, start, duration)
        for point in points:
            active = [s for s in overlapping if s.start <= point < s.end]
            free = [s.need for s in active if s.grant is None]
            if not self._packs(free, [s.grant for s in active if s.grant is not None], caps, needs, extra):
                return False
        return True

    def _fit_time(
        self, job: Job, start: float, spans: list[_Span], caps: Sequence[int], extra: Sequence[int] | None = None
    ) -> float:
        """The earliest moment from ``start`` at which ``job`` is predicted to fit."""
        needs = self._needs(job)
        if not needs:
            return start
        for moment in sorted({start} | {s.end for s in spans if s.end > start}):
            if self._fits_at(needs, moment, job.duration, spans, caps, extra):
                return moment
        return float("inf")

    def _plan(
        self, index: int, start: float, spans: list[_Span], caps: Sequence[int], extra: Sequence[int] | None
    ) -> None:
        """Plan GPUs for ``index``'s own need, picked to start at ``start`` (see the module
        docstring): GPUs where it fits at every moment of its predicted span beside what is
        held or planned there, its worker's contexts first, then the tightest; kept only if
        what is not placed yet still packs beside it at each of those moments."""
        job = self.jobs[index]
        need, count = job.need, len(caps)
        if need is None or not count:
            return
        add = list(extra) if extra is not None else [0] * count
        overlapping, points = self._active(spans, start, job.duration)
        low, taken = list(caps), [False] * count  # least room over the span; any lease there
        load = [0] * count  # the most leases at once over the span
        for point in points:
            granted = [s.grant for s in overlapping if s.grant is not None and s.start <= point < s.end]
            free, held = self._free(granted, caps)
            low = [min(a, b) for a, b in zip(low, free, strict=True)]
            taken = [a or b for a, b in zip(taken, held, strict=True)]
            load = [max(n, sum(i in g.gpus for g in granted)) for i, n in enumerate(load)]
        ranked: list[tuple[int, ...]]
        if need.memory is None:
            ranked = sorted((add[i] > 0, i) for i in range(count) if not taken[i])
        else:
            left = [low[i] - add[i] - need.memory for i in range(count)]
            ranked = sorted((add[i] > 0, left[i], i) for i in range(count) if left[i] >= 0)
        if len(ranked) < need.count:
            return
        gpus = tuple(sorted(row[-1] for row in ranked[: need.count]))
        plan = Grant(gpus, need.memory, () if need.memory is None else tuple(add[i] for i in gpus))
        if need.memory is not None and all(view.spread for view in self._views.values()):
            at_start = [s for s in overlapping if s.start <= start < s.end]
            plan = self._spread(index, plan, ranked, load, add, caps, at_start)
        others = self._needs(job)[1:]  # what its group's fixtures hold: packed freely, as before
        for point in points:
            active = [s for s in overlapping if s.start <= point < s.end]
            granted = [s.grant for s in active if s.grant is not None]
            if not self._packs([s.need for s in active if s.grant is None], [*granted, plan], caps, others):
                return
        self._plans[index] = plan

    def _spread(
        self,
        index: int,
        packed: Grant,
        ranked: Sequence[tuple[int, ...]],
        load: Sequence[int],
        add: Sequence[int],
        caps: Sequence[int],
        active: Sequence[_Span],
    ) -> Grant:
        """The broker's rule for a plan (:func:`pytest_gpu.machine.placement.place`): GPUs no
        lease holds over the span first, then its worker's context GPUs, then the least loaded,
        among the GPUs of ``ranked`` (where it fits; ``packed``: the tightest); ``packed`` where
        spreading leaves a need pending besides ``index``'s own (``active``: the spans at its
        start) no room that packing leaves it: memory makes packing pay."""
        order = sorted((load[i] > 0, has, load[i], left, i) for has, left, i in ranked)
        gpus = tuple(sorted(row[-1] for row in order[: len(packed.gpus)]))
        if gpus == packed.gpus:
            return packed
        spread = Grant(gpus, packed.memory, tuple(add[i] for i in gpus))
        granted = [s.grant for s in active if s.grant is not None]
        free = [s.need for s in active if s.grant is None]
        for need, members in self._by_need.items():
            if members and members != [index] and need.memory is not None:
                if self._packs(free, [*granted, packed], caps, (need,)) and not self._packs(
                    free, [*granted, spread], caps, (need,)
                ):
                    return packed
        return spread

    def _free(self, granted: Sequence[Grant], caps: Sequence[int]) -> tuple[list[int], list[bool]]:
        """Room left on each GPU of ``caps`` beside ``granted`` (held where they are), and which GPUs hold one."""
        free = list(caps)
        taken = [False] * len(free)
        for grant in granted:
            for k, i in enumerate(grant.gpus):
                if 0 <= i < len(free):
                    taken[i] = True
                    if grant.memory is None:
                        free[i] = 0
                    else:  # below 0 if the room shrank since (more contexts): full
                        free[i] -= grant.memory + (grant.contexts[k] if k < len(grant.contexts) else 0)
        return free, taken

    def _packs(
        self,
        needs: Sequence[Need],
        granted: Sequence[Grant],
        caps: Sequence[int],
        own: Sequence[Need] = (),
        extra: Sequence[int] | None = None,
    ) -> bool:
        """Whether ``needs`` and a candidate's ``own`` (which take ``extra`` more on each GPU:
        the contexts its worker would open) can hold GPUs at once beside ``granted`` (held
        where they are): whole GPUs first (on GPUs no lease holds), then largest first, best fit."""
        free, taken = self._free(granted, caps)
        add = list(extra) if extra is not None else [0] * len(free)
        items = [(need, False) for need in needs] + [(need, True) for need in own]
        for need, mine in sorted(items, key=lambda it: (it[0].memory is not None, -it[0].count, -(it[0].memory or 0))):
            if need.memory is None:
                empty = [i for i in range(len(free)) if not taken[i]]
                if len(empty) < need.count:
                    return False
                for i in empty[: need.count]:
                    taken[i] = True
                    free[i] = 0
                continue
            cost = [need.memory + (add[i] if mine else 0) for i in range(len(free))]
            usable = sorted((free[i] - cost[i], i) for i in range(len(free)) if free[i] >= cost[i])
            if len(usable) < need.count:
                return False
            for _, i in usable[: need.count]:
                taken[i] = True
                free[i] -= cost[i]
        return True
