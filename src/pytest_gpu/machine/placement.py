"""Which GPUs a request gets, and in which order waiting requests are served.

Pure policy: no sockets, no clocks, no files. The broker wraps a :class:`Allocator` with a
lock and a transport.

Capacity rule (never over-commit): on every GPU, the memory of its leases plus one
CUDA-context overhead per client that has (or is assumed to have) a context there
stays within the GPU's capacity. An exclusive lease has the GPU alone and gets
everything that is left after the contexts; one with a ``min_memory`` only goes where
that is at least ``min_memory``.

Spread compute, pack memory: a shared lease goes to an *idle* GPU (one no lease holds and
no foreign process uses) when one has room for it, so that tests do not share a GPU's
compute while another GPU does nothing (two compute-bound tests on one GPU each run
slower); among idle GPUs, and among busy ones once none is idle, a GPU the client already
has a context on first (it saves a context's memory), then one no foreign process uses,
then the least loaded (fewest leases, least leased). A
request is packed beside others only where memory or contexts leave no idle GPU for it:
an idle GPU qualifies only with room for the request *and* the new context it opens
there, within the context budget. (``Policy(spread=False)``, the rule before, put a
client on GPUs it has a context on first, busy or not; kept for the makespan bench.)

Affinity: a new context is opened on a GPU only while that GPU's contexts stay within the
*context budget* (``context_fraction`` of its capacity). The budget is soft: a request
that could never be placed within it is placed by capacity alone, so it bounds the
growth of contexts with workers x GPUs without ever deadlocking a request.

Host resources: a request's ``cpus`` and ``host_memory`` come from the machine's CPUs and
RAM (:class:`HostState`), granted together with its GPUs or not at all: a request is
placed only when both its GPU part and its host part fit, so the fairness rule below
covers host resources unchanged. A pool that was never told the machine's host capacity
(:meth:`Allocator.set_host`) does not limit them.

Fairness: waiting requests are served in arrival order; a later request may be granted
before an earlier one (backfill) only while that earlier one has been overtaken fewer
than ``max_bypass`` times. So **every request is overtaken by at most ``max_bypass``
later requests**, and once that many have overtaken it, nothing is granted past it until
it is served — it gets the next GPUs that free up enough.

Preference: a request may name the GPUs its run's scheduler planned for it (``prefer``).
It gets exactly those when it fits there now, within the context budget, else the GPUs the
rules above choose: a preference never makes a request wait, and never keeps a GPU for it.
(A plan on a busy GPU while another is idle is followed: the scheduler packs on purpose where
a pending test needs the idle GPU's memory, see :mod:`pytest_gpu.scheduling.planner`.)

Hold-and-wait: a client waits for one request at a time and gives nothing back while it
waits (a worker keeps its module-scoped fixture's lease while its next test waits for its
own). A request that would not be served even once every client that does not wait has
given everything back, and every client served meanwhile has too, waits for what only
other waiting clients (or its own) hold: :meth:`Allocator.deadlock` names such requests and
the leases their clients hold, so that one can be refused at once, not at the wait timeout.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from ..base.requests import GpuRequest, format_size


@dataclass
class GpuState:
    """The broker's book for one GPU."""

    index: int
    capacity: int
    leased: int = 0  # bytes promised to shared (non-exclusive) leases
    tenants: int = 0  # live leases on this GPU
    exclusive: bool = False  # held by an exclusive lease
    contexts: set[str] = field(default_factory=set)  # clients with a CUDA context here
    foreign: int = 0  # bytes that processes outside pytest-gpu use here (last sample)
    # client -> (bytes, who left them): what its process still holds here of leases that ended
    # (a test's leak), until a later release says it was given back or the process is gone
    left: dict[str, tuple[int, str]] = field(default_factory=dict)
    # a launched rank's part of a GPU (see Allocator.add_gpu): the index of that GPU, whose
    # memory the part's is; None: a GPU
    base: int | None = None

    @property
    def in_use(self) -> bool:
        """A part in use is carved out of its GPU: leased, or a process has a context there."""
        return bool(self.tenants or self.contexts or self.left)

    @property
    def left_bytes(self) -> int:
        return sum(nbytes for nbytes, _ in self.left.values())

    def free_for(self, client: str, overhead: int) -> int:
        """Memory a new shared lease of ``client`` could still get here."""
        if self.exclusive:
            return 0
        contexts = len(self.contexts | {client})
        return self.capacity - self.foreign - self.leased - self.left_bytes - contexts * overhead

    def room_for(self, client: str, policy: Policy) -> int:
        """:meth:`free_for`, each context counted at its client's size (:meth:`Policy.context`)."""
        if self.exclusive:
            return 0
        contexts = policy.contexts(self.index, self.contexts | {client})
        return self.capacity - self.foreign - self.leased - self.left_bytes - contexts


@dataclass
class HostState:
    """The broker's book for the machine's CPUs and RAM."""

    cpus: int
    memory: int
    leased_cpus: int = 0
    leased_memory: int = 0

    def fits(self, request: GpuRequest) -> bool:
        return self.leased_cpus + request.cpus <= self.cpus and self.leased_memory + request.host_memory <= self.memory

    def never_fits(self, request: GpuRequest) -> str | None:
        """Why the host part of ``request`` exceeds the machine itself, or ``None``."""
        over = []
        if request.cpus > self.cpus:
            over.append(f"{request.cpus} CPUs but the machine has {self.cpus} (expected cpus= at most {self.cpus})")
        if request.host_memory > self.memory:
            over.append(
                f"{format_size(request.host_memory)} of host memory but the machine can lease "
                f"{format_size(self.memory)} (expected host_memory= at most that)"
            )
        return ("needs " + "; and ".join(over)) if over else None


@dataclass(frozen=True)
class Placement:
    """GPUs granted to a request, and the memory each one gives it."""

    indices: tuple[int, ...]
    memory: int
    exclusive: bool


@dataclass(frozen=True)
class Policy:
    overhead: int = 500 * 2**20  # one CUDA context, as assumed (--gpu-context-overhead)
    context_fraction: float = 0.25
    max_bypass: int = 16
    # one CUDA context as measured on a GPU (index -> bytes, see Allocator.measure_context), for
    # every client's contexts; unused when fixed
    measured: dict[int, int] = field(default_factory=dict, compare=False, hash=False)
    fixed: bool = False  # the user gave --gpu-context-overhead: it wins over measurements
    # group (see group) -> index -> bytes: what one group's own processes measured, counted for
    # that group's contexts only (another group's word is not this one's)
    measured_by: dict[str, dict[int, int]] = field(default_factory=dict, compare=False, hash=False)
    # a client's group (a run, where runs share an allocator); None: one group, measured alone counts
    group: Callable[[str], str] | None = field(default=None, compare=False, hash=False)
    # spread compute (idle GPUs first, see the module docstring); False: a client's context
    # GPUs first, busy or not (the rule before; the makespan bench compares the two)
    spread: bool = True

    def context(self, index: int, client: str | None = None) -> int:
        """Bytes one CUDA context takes on GPU ``index``: measured there, else the assumption;
        of ``client``'s, the larger of that and what its own group measured there."""
        if self.fixed:
            return self.overhead
        found = self.measured.get(index, self.overhead)
        if client is None or self.group is None or not self.measured_by:
            return found
        own = self.measured_by.get(self.group(client), {}).get(index, 0)
        return max(found, own)

    def contexts(self, index: int, clients: Collection[str]) -> int:
        """Bytes the CUDA contexts of ``clients`` take on GPU ``index``."""
        if self.fixed or self.group is None or not self.measured_by:
            return len(clients) * self.context(index)
        return sum(self.context(index, client) for client in clients)

    def context_limit(self, capacity: int) -> int:
        if self.overhead <= 0:
            return 1 << 30
        return max(1, int(self.context_fraction * capacity) // self.overhead)


def place(
    gpus: Iterable[GpuState],
    request: GpuRequest,
    client: str,
    policy: Policy,
    *,
    within_budget: bool = True,
    allowed: frozenset[int] | None = None,
    host: HostState | None = None,
    prefer: tuple[int, ...] | None = None,
) -> Placement | None:
    """Choose GPUs for ``request`` from ``client``, or ``None`` if it does not fit now;
    ``allowed``: the GPUs the client's run can see (default: all); ``host``: the machine's
    CPUs and RAM, which must hold the request's host part too (``None``: not limited);
    ``prefer``: the GPUs to take when the request fits on all of them now (see the module
    docstring; the caller checked it names ``request.count`` distinct allowed GPUs)."""
    if host is not None and request.host and not host.fits(request):
        return None
    if request.count == 0:  # host resources only
        return Placement((), 0, False)
    gpus = list(gpus)
    carved = carved_parts(gpus)
    by_index = {gpu.index: gpu for gpu in gpus} if carved is not None else {}
    fits: list[tuple[tuple[int, ...], GpuState, int]] = []
    for gpu in gpus:
        if allowed is not None and gpu.index not in allowed:
            continue
        has_ctx = client in gpu.contexts
        if not has_ctx and within_budget and len(gpu.contexts) + 1 > policy.context_limit(gpu.capacity):
            continue
        if gpu.base is not None and not gpu.in_use:  # a part: its memory is carved out of its GPU first
            whole = by_index.get(gpu.base)
            if whole is not None and unpromised(whole, policy, carved) < gpu.capacity:
                continue
        taken = (carved or {}).get(gpu.index, 0)  # by its parts in use
        key: tuple[int, ...]
        if request.exclusive:
            if gpu.tenants:
                continue
            grant = gpu.capacity - gpu.foreign - gpu.left_bytes - policy.contexts(gpu.index, gpu.contexts | {client})
            grant -= taken
            if grant <= 0 or grant < (request.min_memory or 0):  # a minimum counts what the lease would get
                continue
            # affinity first, then a GPU no foreign process uses, then the one with the most to give
            key = (0 if has_ctx else 1, 1 if gpu.foreign else 0, 0, -grant, gpu.index)
        else:
            assert request.memory is not None
            room = gpu.room_for(client, policy) - taken
            if room < request.memory:
                continue
            grant = request.memory
            # affinity first; then a GPU no foreign process uses (its usage may grow); a new
            # context goes where there are fewest (spreads the workers' home GPUs); then the
            # tightest fit keeps large holes for large requests (spread: all that after idle
            # GPUs first and, among busy ones, after the context saving, the least loaded)
            spread = 0 if has_ctx else len(gpu.contexts)
            key = (0 if has_ctx else 1, 1 if gpu.foreign else 0, spread, room - request.memory, gpu.index)
            if policy.spread:  # an idle GPU first; then the context saving, the foreign-free, the least loaded
                busy = 1 if gpu.tenants or gpu.foreign else 0  # a foreign process may compute there too
                key = (busy, key[0], key[1], gpu.tenants, gpu.leased, *key[2:])
        fits.append((key, gpu, grant))
    if len(fits) < request.count:
        return None
    fits.sort(key=lambda f: f[0])
    chosen = fits[: request.count]
    if prefer:
        wanted = [f for f in fits if f[1].index in prefer]
        if len(wanted) == request.count == len(prefer):
            chosen = wanted
    indices = tuple(sorted(g.index for _, g, _ in chosen))
    memory = min(grant for _, _, grant in chosen) if request.exclusive else request.memory or 0
    return Placement(indices, memory, request.exclusive)


def carved_parts(gpus: Iterable[GpuState]) -> dict[int, int] | None:
    """GPU index -> bytes its parts in use take of it (``None``: no GPU has a part)."""
    carved: dict[int, int] | None = None
    for gpu in gpus:
        if gpu.base is not None:
            carved = carved if carved is not None else defaultdict(int)
            if gpu.in_use:
                carved[gpu.base] += gpu.capacity
    return carved


def unpromised(gpu: GpuState, policy: Policy, carved: dict[int, int] | None) -> int:
    """What no lease, leftover, context, part in use or foreign process takes of ``gpu``."""
    if gpu.exclusive:
        return 0
    taken = gpu.leased + gpu.left_bytes + gpu.foreign + policy.contexts(gpu.index, gpu.contexts)
    return gpu.capacity - taken - (carved or {}).get(gpu.index, 0)


def checked_preference(
    prefer: Iterable[int] | None, request: GpuRequest, allowed: frozenset[int] | None
) -> tuple[tuple[int, ...] | None, str | None]:
    """A preference as :func:`place` takes it, and why it was dropped (``None``: kept or none).

    It crossed a process boundary (a run's scheduler named it): kept only when it names
    ``request.count`` distinct GPUs, all among ``allowed``; a request for host resources
    only, or a preference that does not say where the whole request goes, has none."""
    if prefer is None:
        return None, None
    given = list(prefer)
    wanted = tuple(sorted(set(given)))
    if not request.count or len(wanted) != request.count or len(wanted) != len(given):
        return None, f"names GPUs {sorted(given)[:8]} for a request of {request.count} GPU(s)"
    if allowed is not None and not set(wanted) <= allowed:
        return None, f"names GPUs {sorted(set(wanted) - allowed)} the run cannot see"
    return wanted, None


@dataclass
class Waiting:
    """A request in the queue."""

    key: str
    client: str
    request: GpuRequest
    bypassed: int = 0
    allowed: frozenset[int] | None = None  # the GPUs its run can see (None: all)
    prefer: tuple[int, ...] | None = None  # the GPUs its run's scheduler planned for it (a hint)
    foreign_blocked: bool = False  # it once did not fit only because of foreign usage


@dataclass
class Lease:
    key: str
    client: str
    request: GpuRequest
    placement: Placement
    foreign_waited: bool = False  # it waited while only foreign usage kept it out
    avoided: tuple[int, ...] = ()  # GPUs it would have had if no foreign process used them


@dataclass(frozen=True)
class Deadlock:
    """Requests that wait for one another (see :meth:`Allocator.deadlock`).

    ``waiting``: every request that can never be served while the others wait, in queue
    order; ``held``: the leases their clients hold meanwhile (what the others wait for);
    ``victim``: the one to refuse, the latest arrival whose client holds a lease (refusing it
    ends its client's wait, and what that client holds goes back once its test gives up)."""

    waiting: tuple[Waiting, ...]
    held: tuple[Lease, ...]

    @property
    def victim(self) -> Waiting:
        holders = {lease.client for lease in self.held}
        return next((w for w in reversed(self.waiting) if w.client in holders), self.waiting[-1])


class Unsatisfiable(Exception):
    """A request that cannot be placed even if every lease were given back."""


class Allocator:
    """Leases, contexts and the wait queue over one inventory; all decisions, no I/O."""

    def __init__(self, capacities: dict[int, int], policy: Policy | None = None) -> None:
        self.policy = policy or Policy()
        self.gpus: dict[int, GpuState] = {i: GpuState(i, c) for i, c in sorted(capacities.items())}
        self.host: HostState | None = None  # the machine's CPUs and RAM, once told (set_host)
        self.leases: dict[str, Lease] = {}
        self.queue: list[Waiting] = []
        # clients whose contexts are going away (their process is exiting): they count
        # against capacity now, but cannot make a request wait forever
        self.exiting: set[str] = set()
        self.paused = False  # grant nothing (a new arbiter waits for the runs that held leases)
        self._foreign = False  # any GPU with foreign usage (see set_foreign)
        # clients of one group (one run of many sharing the allocator) : contexts of other groups
        # never make a request wait forever
        self.group: Callable[[str], str] | None = None
        # whether a waiting request may be granted at all now (a bound on its user, see
        # Arbiter.user_memory); one it keeps out is passed over, and keeps no one else out
        self.admit: Callable[[Waiting], bool] | None = None
        # answers about drained GPUs depend only on the contexts: kept until those change
        Signature = tuple[tuple[frozenset[str], ...], frozenset[str]]
        self._budget_cache: dict[str, tuple[Signature, bool]] = {}
        self._forever_cache: dict[str, tuple[Signature, str | None]] = {}
        self._never_fits_cache: dict[tuple[GpuRequest, frozenset[int] | None], str | None] = {}

    # -- questions -------------------------------------------------------------

    def never_fits(self, request: GpuRequest, allowed: frozenset[int] | None = None) -> str | None:
        """Why ``request`` cannot be placed on this inventory (or its ``allowed`` GPUs) at all, or ``None``."""
        shape = (request, allowed)
        if shape not in self._never_fits_cache:  # the inventory only grows: ask once per shape till it does
            self._never_fits_cache[shape] = self._never_fits(request, allowed)
        return self._never_fits_cache[shape]

    def _never_fits(self, request: GpuRequest, allowed: frozenset[int] | None) -> str | None:
        if self.host is not None and request.host:
            reason = self.host.never_fits(request)
            if reason:
                return reason
        empty = [GpuState(g.index, g.capacity) for g in self.gpus.values() if allowed is None or g.index in allowed]
        if place(empty, request, "?", self.policy, within_budget=False) is None:
            sizes = ", ".join(format_size(g.capacity) for g in empty) or "none"
            return (
                f"needs {request.describe()} but the inventory has {len(empty)} GPU(s) "
                f"[{sizes}] with {format_size(self.policy.overhead)} of context overhead each"
            )
        return None

    def add_gpu(self, index: int, capacity: int, base: int | None = None) -> None:
        """A GPU joins the allocator (a run that sees it attached); with ``base``, a part of
        GPU ``base`` (a launched rank's, see :mod:`pytest_gpu.gpu.share`): a GPU of its own to
        place on, whose whole ``capacity`` is taken from GPU ``base`` while it is in use
        (leased, or a process has a context there), and can be only while ``base`` has that
        much that nothing else takes: a part never promises its GPU's memory twice."""
        if index not in self.gpus:
            self.gpus[index] = GpuState(index, capacity, base=base)
            self.gpus = dict(sorted(self.gpus.items()))
            self._clear_caches()

    def remove_gpu(self, index: int) -> bool:
        """A part no run brings any more leaves; ``False`` (it stays) while it is in use or asked for."""
        gpu = self.gpus.get(index)
        if gpu is None or gpu.in_use or any(w.allowed is None or index in w.allowed for w in self.queue):
            return False
        del self.gpus[index]
        self._clear_caches()
        return True

    def _clear_caches(self) -> None:
        self._never_fits_cache.clear()
        self._forever_cache.clear()
        self._budget_cache.clear()

    def set_host(self, cpus: int, memory: int) -> None:
        """The machine's CPUs and bytes of RAM that leases may promise; what is leased stays."""
        leased = (self.host.leased_cpus, self.host.leased_memory) if self.host is not None else (0, 0)
        self.host = HostState(cpus, memory, *leased)
        self._never_fits_cache.clear()

    def measure_context(self, index: int, nbytes: int, group: str | None = None) -> bool:
        """A process measured one CUDA context on GPU ``index``: ``nbytes`` (contexts grow as
        libraries load: the largest measured counts), for every client's contexts there, or
        with ``group``, for that group's own only (see :attr:`Policy.measured_by`). Whether
        placement changes (never while the policy is ``fixed``)."""
        if self.policy.fixed or index not in self.gpus or not 0 < nbytes < self.gpus[index].capacity:
            return False
        measured = self.policy.measured if group is None else self.policy.measured_by.setdefault(group, {})
        if nbytes <= measured.get(index, 0):
            return False
        measured[index] = nbytes
        self._clear_caches()
        return True

    def forget_group(self, group: str) -> None:
        """What ``group`` measured goes with it."""
        if self.policy.measured_by.pop(group, None) is not None:
            self._clear_caches()

    def set_foreign(self, usage: dict[int, int]) -> None:
        """What processes outside pytest-gpu use on each GPU now (missing GPUs: nothing)."""
        for index, gpu in self.gpus.items():
            gpu.foreign = max(0, usage.get(index, 0))
        self._foreign = any(gpu.foreign for gpu in self.gpus.values())

    def adopt(self, key: str, client: str, request: GpuRequest, placement: Placement) -> Lease:
        """Take over a lease granted before (by an arbiter that is gone), as it was."""
        return self._grant(Waiting(key, client, request), placement)

    def blocked_forever(self, waiting: Waiting) -> str | None:
        """Why a waiting request could not be placed even with every lease returned."""
        signature = self._signature()
        cached = self._forever_cache.get(waiting.key)
        if cached is not None and cached[0] == signature:
            return cached[1]
        reason = self._blocked_forever(waiting)
        self._forever_cache[waiting.key] = (signature, reason)
        return reason

    def _blocked_forever(self, waiting: Waiting) -> str | None:
        drained = [
            GpuState(
                g.index,
                g.capacity,
                contexts={c for c in g.contexts - self.exiting if self._lasting(c, waiting)},
                # its own process's leftovers stay while it waits: no release of its can say they went
                left={c: n for c, n in g.left.items() if c == waiting.client},
                base=g.base,
            )
            for g in self.gpus.values()
        ]
        if (
            place(drained, waiting.request, waiting.client, self.policy, within_budget=False, allowed=waiting.allowed)
            is not None
        ):
            return None
        own = [(g.index, g.left[waiting.client]) for g in drained if waiting.client in g.left]
        if own:
            for gpu in drained:
                gpu.left.clear()
            if (
                place(
                    drained, waiting.request, waiting.client, self.policy, within_budget=False, allowed=waiting.allowed
                )
                is not None
            ):
                held = "; ".join(
                    f"{format_size(n)} on GPU {i}, left by {who or 'an earlier test'}" for i, (n, who) in own
                )
                return (
                    f"{waiting.request.describe()} cannot fit beside what its own process still holds of leases "
                    f"that ended ({held}: reported there), which no release of that process can give back "
                    "while it waits"
                )
        busy = ", ".join(f"GPU {g.index}: {len(g.contexts)}" for g in self.gpus.values() if g.contexts)
        return (
            f"{waiting.request.describe()} cannot fit beside the CUDA contexts that other processes "
            f"keep open ({busy}; {format_size(self.policy.overhead)} each). Use fewer workers, "
            "or lower --gpu-context-overhead if contexts are smaller on this machine"
        )

    def _lasting(self, context: str, waiting: Waiting) -> bool:
        """Whether a context can be counted on to stay while ``waiting`` waits: another
        group's (another run's, see ``group``) goes when that run ends."""
        return self.group is None or self.group(context) == self.group(waiting.client)

    def deadlock(self) -> Deadlock | None:
        """The requests that wait in a cycle of hold-and-wait, or ``None``.

        A client waits for one request at a time and holds what it holds until that wait
        ends; any other client may give everything back (its leases and its contexts: its
        process may exit), and foreign usage may go away. (A client with several requests
        waiting is not one that waits like that: it counts as one that may give back.) So
        the pool is played forward on a copy that keeps only what the waiting clients hold:
        a waiting request that :meth:`serve` would place there (its context budget included;
        its bypass bound left out: it never makes room) is served, and its client then gives
        everything back, until no more is served: what still waits then waits for what only
        the others that wait could give back."""
        if self.paused or not self.queue:
            return None
        asks = Counter(w.client for w in self.queue)
        stuck = {client for client, n in asks.items() if n == 1}
        holding = any(lease.client in stuck for lease in self.leases.values())
        if not holding and not any(c in stuck for g in self.gpus.values() for c in g.left):
            return None  # a cycle needs a lease (or a leftover) held through a wait (contexts alone: blocked_forever)
        pool = self._what_if(stuck)
        served = True
        while served:
            served = False
            for waiting in list(pool.queue):
                if pool._placement(waiting) is not None:
                    pool._give_back(waiting.client)
                    stuck.discard(waiting.client)
                    served = True
        if not pool.queue:
            return None
        held = tuple(lease for lease in self.leases.values() if lease.client in stuck)
        return Deadlock(tuple(w for w in self.queue if w.client in stuck), held)

    def _what_if(self, clients: set[str]) -> Allocator:
        """A copy with only what ``clients`` hold and ask for, and no foreign usage."""
        pool = Allocator({i: g.capacity for i, g in self.gpus.items()}, self.policy)
        for index, gpu in self.gpus.items():
            pool.gpus[index].contexts = gpu.contexts & clients
            pool.gpus[index].left = {c: n for c, n in gpu.left.items() if c in clients}
            pool.gpus[index].base = gpu.base
        if self.host is not None:
            pool.host = HostState(self.host.cpus, self.host.memory)
        for lease in self.leases.values():
            if lease.client in clients:
                pool.adopt(lease.key, lease.client, lease.request, lease.placement)
        pool.queue = [w for w in self.queue if w.client in clients]
        return pool

    def _give_back(self, client: str) -> None:
        """Everything ``client`` holds or asks for goes, and nothing is served meanwhile."""
        self.queue = [w for w in self.queue if w.client != client]
        for gpu in self.gpus.values():
            gpu.contexts.discard(client)
            gpu.left.pop(client, None)
        for key in [key for key, lease in self.leases.items() if lease.client == client]:
            self._unlease(key)

    def holders(self, indices: Iterable[int] | None = None) -> list[Lease]:
        wanted = None if indices is None else set(indices)
        return [lease for lease in self.leases.values() if wanted is None or wanted & set(lease.placement.indices)]

    # -- changes ---------------------------------------------------------------

    def submit(
        self,
        key: str,
        client: str,
        request: GpuRequest,
        allowed: frozenset[int] | None = None,
        prefer: tuple[int, ...] | None = None,
    ) -> list[Lease]:
        """Queue a request (for the ``allowed`` GPUs only, if given; preferring the GPUs of
        ``prefer``, see :func:`checked_preference`) and serve what can be served; returns
        the leases granted."""
        reason = self.never_fits(request, allowed)
        if reason:
            raise Unsatisfiable(reason)
        self.queue.append(Waiting(key, client, request, allowed=allowed, prefer=prefer))
        return self.serve()

    def cancel(self, key: str) -> bool:
        """Withdraw a waiting request; ``False`` if it was not waiting."""
        for i, waiting in enumerate(self.queue):
            if waiting.key == key:
                del self.queue[i]
                self._forget(key)
                return True
        return False

    def _forget(self, key: str) -> None:
        self._budget_cache.pop(key, None)
        self._forever_cache.pop(key, None)

    def release(
        self, key: str, contexts: set[int] | None = None, left: dict[int, tuple[int, str]] | None = None
    ) -> list[Lease]:
        """Return a lease; ``contexts`` is where its client really has contexts now, if known;
        ``left``, what its process still holds of leases that ended, if told (:meth:`set_left`)."""
        lease = self.leases.get(key)
        if lease is None:
            return []
        if left is not None:  # before the lease goes: no grant may take what is still held
            self.set_left(lease.client, left)
        self._unlease(key)
        if contexts is not None:
            self.set_contexts(lease.client, contexts)
        return self.serve()

    def set_left(self, client: str, left: dict[int, tuple[int, str]]) -> None:
        """What ``client``'s process still holds of leases that ended: GPU -> (bytes, who left
        them), on every GPU where it holds some (any other: none). Counted like a lease's
        memory until it is said again, or the client is forgotten (its process is gone)."""
        for gpu in self.gpus.values():
            nbytes, who = left.get(gpu.index, (0, ""))
            if nbytes > 0:
                gpu.left[client] = (nbytes, who)
            else:
                gpu.left.pop(client, None)

    def _unlease(self, key: str) -> Lease | None:
        lease = self.leases.pop(key, None)
        if lease is None:
            return None
        if self.host is not None:
            self.host.leased_cpus -= lease.request.cpus
            self.host.leased_memory -= lease.request.host_memory
        for index in lease.placement.indices:
            gpu = self.gpus[index]
            gpu.tenants -= 1
            if lease.placement.exclusive:
                gpu.exclusive = False
            else:
                gpu.leased -= lease.placement.memory
        return lease

    def set_contexts(self, client: str, contexts: set[int]) -> None:
        """Record where ``client`` has contexts; GPUs it holds a lease on keep theirs."""
        held = {i for lease in self.leases.values() if lease.client == client for i in lease.placement.indices}
        for gpu in self.gpus.values():
            if gpu.index in contexts or gpu.index in held:
                gpu.contexts.add(client)
            else:
                gpu.contexts.discard(client)

    def forget_client(self, client: str) -> tuple[list[Lease], list[Lease]]:
        """A client is gone (its process died or disconnected): drop everything it had.

        Returns (leases it held, leases granted to others as a result).
        """
        for waiting in [w for w in self.queue if w.client == client]:
            self.cancel(waiting.key)
        held = [lease for lease in self.leases.values() if lease.client == client]
        for gpu in self.gpus.values():
            gpu.contexts.discard(client)
            gpu.left.pop(client, None)
        granted: list[Lease] = []
        for lease in held:
            granted.extend(self.release(lease.key))  # release() serves the queue: keep its grants
        granted.extend(self.serve())
        return held, granted

    def serve(self) -> list[Lease]:
        """Grant waiting requests in order, with bounded backfill (see module doc)."""
        granted: list[Lease] = []
        if self.paused:
            return granted
        position = 0
        while position < len(self.queue):
            waiting = self.queue[position]
            if self.admit is not None and not self.admit(waiting):
                position += 1
                continue
            placement = self._placement(waiting)
            if placement is None:
                if not waiting.foreign_blocked and self._fits_without_foreign(waiting):
                    waiting.foreign_blocked = True
                if waiting.bypassed >= self.policy.max_bypass:
                    break  # overtaken often enough: nothing behind it may pass it now
                position += 1
                continue
            overtaken = self.queue[:position]
            for w in overtaken:
                w.bypassed += 1
            del self.queue[position]
            avoided = self._avoided(waiting, placement)
            lease = self._grant(waiting, placement)
            lease.foreign_waited, lease.avoided = waiting.foreign_blocked, avoided
            granted.append(lease)
            if any(w.bypassed >= self.policy.max_bypass for w in overtaken):
                break  # one ahead has been overtaken often enough: it is served next
        return granted

    def _placement(self, waiting: Waiting) -> Placement | None:
        """Where ``waiting`` goes now: within the context budget, or by capacity alone where
        the budget keeps it out even on drained GPUs; ``None``: it waits."""
        host = self.host
        placement = place(
            self.gpus.values(),
            waiting.request,
            waiting.client,
            self.policy,
            allowed=waiting.allowed,
            host=host,
            prefer=waiting.prefer,
        )
        host_fits = host is None or host.fits(waiting.request)
        if placement is None and host_fits and self.blocked_within_budget(waiting):
            placement = place(
                self.gpus.values(),
                waiting.request,
                waiting.client,
                self.policy,
                within_budget=False,
                allowed=waiting.allowed,
                host=host,
                prefer=waiting.prefer,
            )
        return placement

    def _without_foreign(self) -> list[GpuState] | None:
        """The GPUs as they are, but with no foreign usage; None when there is none anyway."""
        if not self._foreign:
            return None
        return [
            GpuState(
                g.index, g.capacity, g.leased, g.tenants, g.exclusive, set(g.contexts), left=dict(g.left), base=g.base
            )
            for g in self.gpus.values()
        ]

    def _fits_without_foreign(self, waiting: Waiting) -> bool:
        clean = self._without_foreign()
        return clean is not None and (
            place(
                clean,
                waiting.request,
                waiting.client,
                self.policy,
                within_budget=False,
                allowed=waiting.allowed,
                host=self.host,
            )
            is not None
        )

    def _avoided(self, waiting: Waiting, placement: Placement) -> tuple[int, ...]:
        clean = self._without_foreign()
        if clean is None:
            return ()
        alt = place(clean, waiting.request, waiting.client, self.policy, allowed=waiting.allowed)
        return tuple(sorted(set(alt.indices) - set(placement.indices))) if alt is not None else ()

    def _signature(self) -> tuple[tuple[frozenset[str], ...], frozenset[str]]:
        """What the drained-GPU questions depend on: who has contexts (and leftovers) where."""
        gpus = tuple(frozenset(g.contexts) | {f"{c}={n}" for c, (n, _) in g.left.items()} for g in self.gpus.values())
        return gpus, frozenset(self.exiting)

    def blocked_within_budget(self, waiting: Waiting) -> bool:
        """True if the context budget alone keeps ``waiting`` out, even on drained GPUs."""
        signature = self._signature()
        cached = self._budget_cache.get(waiting.key)
        if cached is not None and cached[0] == signature:
            return cached[1]
        drained = [GpuState(g.index, g.capacity, contexts=set(g.contexts), base=g.base) for g in self.gpus.values()]
        blocked = place(drained, waiting.request, waiting.client, self.policy, allowed=waiting.allowed) is None
        self._budget_cache[waiting.key] = (signature, blocked)
        return blocked

    def _grant(self, waiting: Waiting, placement: Placement) -> Lease:
        self._forget(waiting.key)
        if self.host is not None:
            self.host.leased_cpus += waiting.request.cpus
            self.host.leased_memory += waiting.request.host_memory
        for index in placement.indices:
            gpu = self.gpus[index]
            gpu.tenants += 1
            gpu.contexts.add(waiting.client)
            if placement.exclusive:
                gpu.exclusive = True
            else:
                gpu.leased += placement.memory
        lease = Lease(waiting.key, waiting.client, waiting.request, placement)
        self.leases[waiting.key] = lease
        return lease

    def used(self, index: int) -> int:
        """Bytes committed on a GPU: shared leases, exclusive grants, contexts."""
        gpu = self.gpus[index]
        committed = gpu.leased + gpu.left_bytes + self.policy.contexts(index, gpu.contexts)
        committed += sum(g.capacity for g in self.gpus.values() if g.base == index and g.in_use)
        for lease in self.leases.values():
            if lease.placement.exclusive and index in lease.placement.indices:
                committed += lease.placement.memory
        return committed
