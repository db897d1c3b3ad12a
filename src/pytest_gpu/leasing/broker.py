"""The lease service: one per run, hands out GPUs and ports to the test processes.

Transport: :class:`pytest_gpu.wire.server.Server` (a Unix socket in the run's private
0700 directory, the run's key proven both ways, one thread serving every client,
handshakes apart); the messages are :data:`pytest_gpu.leasing.protocol.BROKER`, each
checked on arrival; this module is what they mean (a handler per kind). GPU decisions are
made by the machine's arbiter (:mod:`pytest_gpu.machine`): in this process when this run
is the arbiter or has the GPUs to itself, else in the arbiter's run, over its socket.

Crash safety comes from the kernel: when a client process dies, for any reason, its end
of the socket is closed, ``recv`` returns nothing, and everything it held (leases, queued
requests, ports, assumed contexts) is returned at once and recorded for the report.
There are no polling loops: a waiting request is answered the moment a release makes
room for it.

``abandon`` withdraws an ``acquire`` its test gave up on while waiting (pytest-timeout
raising in the wait, a KeyboardInterrupt): still queued, it is dropped; granted meanwhile
(its ``granted`` event possibly on its way), the lease is released at once, as if by
``release``; already gone, nothing happens. It is idempotent and never waits, so it can
be sent from an exception handler; the client discards an event that still arrives for an
abandoned key (the broker handles it in order, after any event it sent for that key).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import select
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..base.requests import GpuRequest
from ..machine.arbiter import Event
from ..machine.link import MachineLink
from ..machine.placement import Policy
from ..machine.ports import DEFAULT_RANGE, PortOwner
from ..machine.remote import MachineError
from ..wire.schema import Refused
from ..wire.server import HANDSHAKE_TIMEOUT, Bounds, Drop, KeyAuth, Peer, Server
from .protocol import BROKER, MAX_FRAME, CrashRecord, ForeignNote, LeaseMessage
from .view import NodeView

# at the run's end: how long it waits for processes of its clients that are still exiting,
# whose contexts the machine forgets once the run has left it (xdist's workers are gone by then)
EXIT_WAIT_S = 3.0
# the scheduler's plans a worker may have that its tests did not ask for yet (it holds two tests)
_HINTS_PER_WORKER = 4
LEFT_BY_MAX = 400  # characters of "who left it" the broker keeps (node ids, joined)


@dataclass
class ClientInfo:
    client: str
    worker: str
    pid: int
    peer: Peer
    tests: dict[str, str] = field(default_factory=dict)  # lease key -> test node id
    contexts: set[int] = field(default_factory=set)  # GPUs its process has (or is assumed to have) contexts on


def scoped(client: str, name: str) -> str:
    """A client's own name for a lease or a port owner, made unique in the run: the
    arbiter's lease key, the port pool's owner. Client ids never contain "/"."""
    return f"{client}/{name}"


def unscoped(key: str) -> tuple[str, str]:
    """The inverse of :func:`scoped`: ``(client, name)``."""
    client, _, name = key.partition("/")
    return client, name


class Broker(Server):
    """Owns the listener and this run's side of the machine's leases; start with
    :meth:`start`, stop with :meth:`close`. A peer's ``data`` is its :class:`ClientInfo`
    (from its ``hello`` on).

    GPU decisions are the machine's arbiter's (``link``, see :mod:`pytest_gpu.machine`):
    shared with every run of the machine when ``link`` has a domain; without a ``link``
    the run's GPUs are its own. ``uuids`` names each GPU index (default: private names).
    """

    protocol = BROKER
    thread_prefix = "pytest-gpu-broker"

    def __init__(
        self,
        capacities: dict[int, int],
        address: str,
        authkey: bytes,
        policy: Policy | None = None,
        port_range: tuple[int, int] = DEFAULT_RANGE,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        link: MachineLink | None = None,
        uuids: dict[int, str] | None = None,
        host: tuple[int, int] | None = None,
    ) -> None:
        # its clients are the run's own processes, past the key: no per-user share, no hello deadline
        bounds = Bounds(max_request=MAX_FRAME, max_brackets=None, max_answer=MAX_FRAME, max_outbox=4 * MAX_FRAME)
        super().__init__(address, KeyAuth(authkey, handshake_timeout), bounds)
        self.authkey = authkey
        self._lock = threading.RLock()  # all of the state below
        self.policy = policy or Policy()
        self.link = link if link is not None else MachineLink(None, self.policy)
        self.capacities = dict(sorted(capacities.items()))
        self.uuids = {i: (uuids or {}).get(i) or f"private-{i}" for i in self.capacities}
        self._index = {uuid: i for i, uuid in self.uuids.items()}
        self._gpu_list = list(self.uuids.values())
        self.host = host  # this run's view of the machine's CPUs and RAM (see pytest_gpu.leasing.host)
        self._attached = False
        self.foreign: list[dict[str, Any]] = []  # grants that waited for or avoided foreign usage
        # ports are the machine's arbiter's to hand out (no two runs hold one at once); these are this run's
        self.port_range = port_range
        self.ports: dict[int, str] = {}  # port -> owner (scoped)
        self.crashes: list[CrashRecord] = []
        self.grants = 0
        self.catalog: dict[str, Any] = {}  # node id -> what the scheduler needs (see catalog.py)
        self.measured: dict[int, int] = {}  # GPU index -> one CUDA context as the run's processes measured it
        self._clients: dict[str, ClientInfo] = {}  # under self._lock, as all of this state
        self._queued_at: dict[str, float] = {}
        # lease key -> (worker, GPU indices, bytes each or None: exclusive) of every grant still held,
        # for the scheduler (:meth:`placements`)
        self._placed: dict[str, tuple[str, tuple[int, ...], int | None]] = {}
        # worker -> test node id -> (GPU indices, bytes each or None: exclusive) its scheduler planned
        # for the test (see prefer); lease key -> the GPUs its acquire preferred, till granted
        self._hints: dict[str, dict[str, tuple[tuple[int, ...], int | None]]] = {}
        self._preferred: dict[str, tuple[int, ...]] = {}
        self.preferences = {"given": 0, "honoured": 0}  # acquires that carried one; granted there
        self._ids = itertools.count()
        self._exit_waits: list[threading.Thread] = []  # see _hold_contexts_until_exit
        self._left = False  # the run has left the machine

    def close(self) -> None:
        super().close()  # clients still connected are disconnected: their contexts are held too
        deadline = time.monotonic() + EXIT_WAIT_S
        with self._lock:
            waits = list(self._exit_waits)
        for wait in waits:
            wait.join(max(deadline - time.monotonic(), 0.0))
        with self._lock:
            self._left = True
        self.link.close()

    # -- the machine ------------------------------------------------------------------

    def _machine(self) -> MachineLink:
        """The link, attached on first use: a CPU-only run that leases nothing never joins the machine."""
        if not self._attached:
            with self._lock:
                if not self._attached:
                    self.link.attach(
                        {self.uuids[i]: c for i, c in self.capacities.items()}, self._on_events, host=self.host
                    )
                    self._attached = True
        return self.link

    def _indices(self, gpus: list[str]) -> list[int]:
        return sorted(self._index[u] for u in gpus if u in self._index)

    def _granted(self, info: ClientInfo, key: str, body: dict[str, Any], waited: float) -> LeaseMessage:
        """Record a grant to ``info`` (the arbiter's ``body``); the lease message for its client."""
        self.grants += 1
        indices = self._indices(body["gpus"])
        preferred = self._preferred.pop(key, None)
        if preferred is not None and preferred == tuple(indices):
            self.preferences["honoured"] += 1
        info.contexts.update(indices)
        self._placed[key] = (info.worker, tuple(indices), None if body["exclusive"] else int(body["memory"]))
        message = LeaseMessage(
            key=unscoped(key)[1],
            indices=indices,
            memory=body["memory"],
            exclusive=body["exclusive"],
            waited=waited,
        )
        foreign = body.get("foreign")
        if foreign:
            note = message["foreign"] = ForeignNote(
                waited=bool(foreign.get("waited")),
                avoided=self._indices(foreign.get("avoided", [])),
                bytes={self._index[u]: n for u, n in foreign.get("bytes", {}).items() if u in self._index},
            )
            self.foreign.append({"test": info.tests.get(key, "?"), "seconds": waited, **note})
        return message

    def _on_events(self, events: list[Event]) -> None:
        """Grants and refusals of requests that waited (from the link's own thread)."""
        now = time.monotonic()
        with self._lock:
            for kind, key, body in events:
                client, name = unscoped(key)
                info = self._clients.get(client)
                queued = self._queued_at.pop(key, None)
                if kind == "granted":
                    if info is None:
                        self.grants += 1
                        continue  # gone meanwhile: forget_client gave it back
                    waited = now - (queued if queued is not None else now)
                    self.tell(info.peer, "granted", dict(self._granted(info, key, body, waited)))
                elif info is not None:
                    info.tests.pop(key, None)
                    self.tell(info.peer, "refused", {"key": name, "message": body["message"]})

    # -- messages ------------------------------------------------------------------------

    def admit(self, peer: Peer, kind: str) -> None:
        if peer.data is None and kind != "hello":
            raise Drop  # a client says hello first

    def error_text(self, kind: Any, exc: Exception) -> str:
        if isinstance(exc, (Refused, MachineError)):  # the machine's arbiter's own words
            return str(exc)
        return f"pytest-gpu broker failed on {kind!r}: {exc!r}"  # a bug here must not stop the service

    def disconnected(self, peer: Peer, why: str) -> None:
        # the process closed its end or died (the kernel closed it), or the run ends: take everything back
        if peer.data is not None:
            self._disconnect(peer.data)

    def on_hello(self, peer: Peer, m: dict[str, Any]) -> dict[str, str]:
        if peer.data is not None:
            raise Refused("hello: said already")
        info = ClientInfo(f"c{next(self._ids)}", m["worker"] or "?", m["pid"], peer)
        with self._lock:
            self._clients[info.client] = info
        peer.data = info
        return {"client": info.client}

    def on_acquire(self, peer: Peer, m: dict[str, Any]) -> tuple[str, Any]:
        return self._acquire(peer.data, m["key"], m["request"], m["test"], m.get("avoid") or ())

    def on_cancel(self, peer: Peer, m: dict[str, Any]) -> tuple[str, Any]:
        info: ClientInfo = peer.data
        key = scoped(info.client, m["key"])
        with self._lock:
            holders = self._machine().cancel(key)
            if holders is not None:
                self._queued_at.pop(key, None)
                self._preferred.pop(key, None)
                info.tests.pop(key, None)
                return ("cancelled", self._local_rows(holders))
        return ("not-waiting", None)

    def on_abandon(self, peer: Peer, m: dict[str, Any]) -> None:
        info: ClientInfo = peer.data
        key = scoped(info.client, m["key"])
        with self._lock:
            info.tests.pop(key, None)
            self._queued_at.pop(key, None)
            self._placed.pop(key, None)
            self._preferred.pop(key, None)
            self._machine().abandon(key)

    def on_release(self, peer: Peer, m: dict[str, Any]) -> None:
        info: ClientInfo = peer.data
        key = scoped(info.client, m["key"])
        contexts = m["contexts"]
        left = self._leftovers(m["left"])
        with self._lock:
            info.tests.pop(key, None)
            self._placed.pop(key, None)
            if contexts is not None:
                info.contexts = set(contexts)
            gpus = None if contexts is None else [self.uuids[i] for i in contexts if i in self.uuids]
            self._machine().release(key, gpus, left)

    def on_ports(self, peer: Peer, m: dict[str, Any]) -> list[int]:
        owner = scoped(peer.data.client, m["owner"])
        with self._lock:
            try:
                got = self._machine().take_ports(m["n"], owner, self.port_range)
            except MachineError as exc:
                raise Refused(str(exc)) from None
            self.ports.update(dict.fromkeys(got, owner))
        return got

    def on_release_ports(self, peer: Peer, m: dict[str, Any]) -> None:
        owner = scoped(peer.data.client, m["owner"])
        with self._lock:
            if owner in self.ports.values():
                self.link.give_back_ports(owner)
                self.ports = {p: o for p, o in self.ports.items() if o != owner}

    def on_context_size(self, peer: Peer, m: dict[str, Any]) -> None:
        self._context_size(m["index"], m["bytes"])

    def on_status(self, peer: Peer, m: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            return self.status_locked()

    def on_catalog(self, peer: Peer, m: dict[str, Any]) -> None:
        with self._lock:
            self.catalog.update(m["tests"])

    def _leftovers(self, body: Any) -> dict[str, tuple[int, str]] | None:
        """A release's ``left`` (GPU index -> (bytes, who left them)) by GPU name; entries that
        are not a GPU of this run and a size it can hold are dropped (``None``: not told)."""
        if not isinstance(body, dict):
            return None
        found: dict[str, tuple[int, str]] = {}
        for index, value in body.items():
            if isinstance(index, bool) or not isinstance(index, int) or index not in self.capacities:
                continue
            if not isinstance(value, (tuple, list)) or len(value) != 2:
                continue
            nbytes, who = value
            if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 < nbytes <= self.capacities[index]:
                continue
            found[self.uuids[index]] = (nbytes, str(who)[:LEFT_BY_MAX])
        return found

    def _context_size(self, index: int, nbytes: int) -> None:
        """A process measured one CUDA context on a GPU of the run: checked against the GPU
        (a client is a stranger's claim until then), kept for the summary, and used by the
        arbiter for that GPU's placement. The largest measured on a GPU counts (contexts grow)."""
        if index not in self.capacities:
            raise Refused(f"context_size: {index!r:.40} is not a GPU of this run")
        capacity = self.capacities[index]
        if not 0 < nbytes < capacity:
            raise Refused(f"context_size: expected bytes in (0, {capacity}) for GPU {index}, got {nbytes!r:.40}")
        with self._lock:
            if nbytes <= self.measured.get(index, 0):
                return
            self.measured[index] = nbytes
            try:
                self._machine().measure_context(self.uuids[index], nbytes)
            except (MachineError, ValueError) as exc:
                raise Refused(f"context_size: {exc}") from None

    def _acquire(
        self, info: ClientInfo, name: str, request: GpuRequest, test: str, avoid: Sequence[int] = ()
    ) -> tuple[str, Any]:
        key = scoped(info.client, name)
        test = test or "?"
        with self._lock:
            info.tests[key] = test
            self._queued_at[key] = time.monotonic()
            hint = self._hint(info.worker, test, request)
            gpus = self.allowed(request, avoid)
            if hint is not None and not {self.uuids[i] for i in hint} <= set(gpus):
                hint = None  # planned on a GPU the retry avoids
            prefer = None
            if hint is not None:
                self._preferred[key] = hint
                self.preferences["given"] += 1
                prefer = [self.uuids[i] for i in hint]
            kind, value = self._machine().submit(key, info.client, info.worker, test, request, gpus, prefer)
            if kind == "queued":
                return ("queued", None)
            self._queued_at.pop(key, None)
            if kind != "granted":  # "error" or "rejected": it can never be placed
                info.tests.pop(key, None)
                self._preferred.pop(key, None)
                return ("refused", str(value))
            return ("granted", self._granted(info, key, value, 0.0))

    def allowed(self, request: GpuRequest, avoid: Sequence[int]) -> list[str]:
        """The run's GPUs a request may be placed on: all, less those of ``avoid`` (a retry of
        a test whose failure came from outside it there) where the others are enough for it."""
        if not avoid:
            return self._gpu_list
        others = [u for i, u in self.uuids.items() if i not in avoid]
        return others if len(others) >= request.count else self._gpu_list

    def _hint(self, worker: str, test: str, request: GpuRequest) -> tuple[int, ...] | None:
        """The GPUs the scheduler planned for ``test`` of ``worker``, taken once by the test's
        first acquire of the planned shape (a fixture's lease of another shape has none)."""
        planned = self._hints.get(worker, {}).get(test)
        if planned is None:
            return None
        gpus, memory = planned
        if request.count != len(gpus) or request.exclusive != (memory is None) or request.memory != memory:
            return None
        del self._hints[worker][test]
        return gpus

    def prefer(self, worker: str, test: str, gpus: tuple[int, ...], memory: int | None) -> None:
        """The scheduler planned GPUs ``gpus`` (``memory`` bytes each, ``None``: whole GPUs)
        for ``test``, handed to ``worker``: its acquire of that shape prefers them (the
        arbiter grants them when the request fits there now, else places it by its own rule).
        Raises ValueError for GPUs that are not this run's, or named twice."""
        if not gpus or len(set(gpus)) != len(gpus) or not set(gpus) <= set(self.capacities):
            raise ValueError(f"prefer: {test}: expected distinct GPUs of {sorted(self.capacities)}, got {gpus!r:.80}")
        with self._lock:
            tests = self._hints.setdefault(worker, {})
            tests[test] = (tuple(sorted(gpus)), memory)
            while len(tests) > _HINTS_PER_WORKER:  # tests that never asked (skipped, failed first): oldest go
                del tests[next(iter(tests))]

    def contexts(self) -> dict[str, frozenset[int]]:
        """Worker -> the GPUs its processes have (or are assumed to have) CUDA contexts on."""
        out: dict[str, set[int]] = {}
        with self._lock:
            for info in self._clients.values():
                out.setdefault(info.worker, set()).update(info.contexts)
        return {worker: frozenset(gpus) for worker, gpus in out.items()}

    def context_sizes(self) -> list[int]:
        """What one new CUDA context takes on each GPU, as leases are placed: the assumed size,
        or the one measured there unless the user fixed it (``--gpu-context-overhead``)."""
        policy = self.policy
        return [policy.overhead if policy.fixed else self.measured.get(i, policy.context(i)) for i in self.capacities]

    def _local_rows(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The arbiter's holder rows in this run's terms: its GPU numbers, other runs named."""
        mine = self.link.run
        local = []
        for row in rows:
            gpus = [self._index.get(u, u) for u in row["gpus"]]
            worker = row["worker"]
            if row["run"] and row["run"] != mine:  # another run of this user ('' for another user's)
                worker = f"{worker} of run {row['run']} ({row['user']})"
            local.append({**row, "gpus": gpus, "worker": worker})
        return local

    def _disconnect(self, info: ClientInfo) -> None:
        with self._lock:
            self._clients.pop(info.client, None)
            attached = self._attached
            # The process keeps its CUDA contexts until it exits, which may be a while after
            # it closed its connection (a worker shutting down, or this run ending while it is
            # still connected): keep counting them till then.
            held: list[tuple[str, tuple[str, ...]]] = []
            with contextlib.suppress(MachineError):  # an arbiter that stopped answering must not stop this service
                if attached and info.contexts:
                    self._hold_contexts_until_exit(info, set(info.contexts))
                held = self.link.forget_client(info.client) if attached else []
            prefix = scoped(info.client, "")
            mine = [unscoped(o)[1] for o in self.ports.values() if o.startswith(prefix)]
            port_tests = sorted({PortOwner.parse(o).holder for o in mine})  # a test's node id, a fixture, ...
            ports = [p for p, o in self.ports.items() if o.startswith(prefix)]
            if ports:
                self.ports = {p: o for p, o in self.ports.items() if not o.startswith(prefix)}
                self.link.give_back_ports_prefix(prefix)
            for key in [k for k in self._queued_at if k.startswith(prefix)]:
                del self._queued_at[key]
            for key in [k for k in self._placed if k.startswith(prefix)]:
                del self._placed[key]
            for key in [k for k in self._preferred if k.startswith(prefix)]:
                del self._preferred[key]
            if (held or ports) and not self._closing:
                tests = sorted({info.tests.get(key, "?") for key, _ in held})
                test = ", ".join(tests) if tests else ", ".join(port_tests) or None
                gpus = tuple(sorted({i for _, uuids in held for i in self._indices(list(uuids))}))
                self.crashes.append(CrashRecord(info.worker, info.pid, test, gpus, tuple(sorted(ports)), time.time()))

    def _hold_contexts_until_exit(self, info: ClientInfo, contexts: set[int]) -> None:
        """Count ``info``'s contexts under a stand-in client until its process has exited
        (this process's own: until the run leaves the machine).

        Waits on a pidfd (readable once the process has terminated; it does not reap it),
        so no polling. Without pidfds (not Linux) another process's contexts are dropped at once.
        """
        link = self.link
        uuids = [self.uuids[i] for i in contexts if i in self.uuids]
        if info.pid == os.getpid():
            # this process (a run without xdist workers) outlives its run: counted until the run
            # leaves the machine, and from then on as usage outside every run (foreign)
            link.exiting(info.client, uuids)
            return
        if info.pid <= 0 or not hasattr(os, "pidfd_open"):
            return
        try:
            fd = os.pidfd_open(info.pid)
        except OSError:
            return  # already gone
        link.exiting(info.client, uuids)

        def wait() -> None:
            try:
                select.select([fd], [], [])
            finally:
                os.close(fd)
            with self._lock:
                if self._left:
                    return  # the machine forgot them with the run
                with contextlib.suppress(Exception):  # the arbiter is unreachable: it forgets them with the run
                    link.exited(info.client)

        thread = threading.Thread(target=wait, name=f"pytest-gpu-exit-{info.pid}", daemon=True)
        thread.start()
        self._exit_waits = [t for t in self._exit_waits if t.is_alive()] + [thread]

    def status_locked(self) -> dict[str, Any]:
        try:
            machine = self._machine().status()
        except MachineError as exc:  # the arbiter stopped answering: this run's own part still says something
            machine = {"runs": [], "gpus": [], "leases": [], "waiting": [], "grants": 0, "error": str(exc)}
        mine = self.link.run
        used = dict.fromkeys(self.capacities, 0)
        contexts: dict[int, list[str]] = {i: [] for i in self.capacities}
        for gpu in machine["gpus"]:
            if gpu["uuid"] in self._index:
                used[self._index[gpu["uuid"]]] = gpu["leased"]
                prefix = f"{mine}|"
                contexts[self._index[gpu["uuid"]]] = [c[len(prefix) :] for c in gpu["clients"] if c.startswith(prefix)]
        return {
            "clients": {c.client: {"worker": c.worker, "pid": c.pid} for c in self._clients.values()},
            "leases": [
                {k: r[k] for k in ("test", "worker", "gpus", "memory", "exclusive")}
                for r in self._local_rows(machine["leases"])
                if r["run"] == mine
            ],
            "waiting": [
                {k: w[k] for k in ("key", "request", "bypassed")} for w in machine["waiting"] if w["run"] == mine
            ],
            "ports": dict(self.ports),
            "used": used,
            "contexts": contexts,
            "grants": self.grants,
            "preferences": dict(self.preferences),
            "crashes": [c.__dict__ for c in self.crashes],
            "machine": machine,
        }

    def status(self) -> dict[str, Any]:
        with self._lock:
            return self.status_locked()

    def placements(self) -> dict[str, list[tuple[tuple[int, ...], int | None]]]:
        """Worker -> the leases its processes hold now: (GPU indices, bytes each; ``None``: exclusive)."""
        out: dict[str, list[tuple[tuple[int, ...], int | None]]] = {}
        with self._lock:
            for worker, indices, memory in self._placed.values():
                out.setdefault(worker, []).append((indices, memory))
        return out

    def view(self) -> NodeView:
        """This run's GPUs as the scheduler reads them: the one node of a run on one machine
        (a node host sends its broker's under ``--gpu-nodes``). The catalog is this broker's own,
        live."""
        sizes = self.context_sizes()
        return NodeView(
            room=tuple(self.room()),
            order=tuple(self.capacities),
            placements=self.placements(),
            contexts=self.contexts(),
            context_sizes=tuple(sizes),
            limits=tuple(capacity - size for capacity, size in zip(self.capacities.values(), sizes, strict=True)),
            catalog=self.catalog,
            spread=self.policy.spread,
        )

    def room(self) -> list[int]:
        """What each GPU can give leases now beside the CUDA contexts open there and foreign
        usage (a lease whose process has no context there yet opens one: :meth:`context_sizes`)."""
        if not self.capacities:
            return []  # a run without GPUs never joins the machine
        try:
            return self._machine().room([self.uuids[i] for i in self.capacities])
        except MachineError:  # the arbiter stopped answering: plan with what the GPUs have (workers still wait)
            return list(self.capacities.values())
