"""A run's way to the machine's arbiter: be it, or attach to it; and take over when it goes.

The first run to need a GPU wins the domain's election and is the arbiter: it decides
in-process, at no extra cost, and serves the other runs on a Unix socket (:mod:`.server`).
The others connect there. The election is one the kernel settles and undoes when its
winner's process exits, SIGKILL included (see :mod:`.domain`): binding the abstract
socket of a machine-wide domain, or ``flock`` on the lock file of a private one. So
there is never a second arbiter nor a lock left behind.

Whom a run trusts (:func:`distrusted`): in a private domain only a peer of its own user (no
one else can even reach it); on a simulated machine shared with a group only a member of
the group (or root), by the kernel's word (``SO_PEERCRED``'s uid and that user's groups); on
the real GPUs the process that holds the address, whoever's it is (any user who may use the
GPUs can take their memory anyway), as long as it speaks the protocol in time. Another
user's arbiter is told nothing private (no command, directory, test or worker names). A
peer that does not answer, refuses this run or is not trusted is a squatter: the run
coordinates with its own user's runs only, in its private domain (one warning line), and
never fails for it.

Trusted or not, what an arbiter answers is checked: its shape (:mod:`.messages`), and what
this run knows better than any arbiter (:func:`~.messages.check_grant`: a grant of GPUs it
did not ask on, of another size, or that would promise it more of a GPU than the GPU has;
a port twice; more room than a GPU has).

When the arbiter's run ends (or dies), its socket closes and every other run elects
again: one wins, the rest connect to it, and each brings what it holds and waits for
(the mirror of its own run it keeps, :mod:`.mirror`). The new arbiter grants nothing
until every run of the last roster it heard of (the arbiter tells every run who is
attached) has re-attached, or ``RESUME_AFTER_S`` has passed, so nothing held is
promised twice. A run may also win that election just as it arrives, having heard no
roster: every attached run holds a presence name in its domain
(:meth:`.Domain.be_present`, undone by the kernel when it exits), and a run that wins an
election waits for the runs present as for those of its roster. A run that is not the
arbiter reaches it over :mod:`.remote`; an arbiter that answers or tells what the protocol
does not allow (:mod:`.messages`), or what this run can tell is false, is used no more: the
run coordinates with its own user's runs only (one warning line), as it does beside a
squatter, and asks its call again there.
"""

from __future__ import annotations

import contextlib
import fcntl
import grp
import os
import queue
import secrets
import socket
import stat
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from ..base.procs import owner_alive
from ..base.requests import GpuRequest
from ..base.safefiles import open_or_create
from .arbiter import Arbiter, Event, ForeignSource, Sink, Truth, roster_digest
from .domain import Domain, user_name, warn_once
from .messages import (
    LABEL_MAX,
    TEST_MAX,
    Asked,
    Held,
    WireError,
    check_grant,
    check_ports,
    check_room,
    request_to_wire,
)
from .mirror import Mirror, to_wire
from .placement import Policy
from .ports import PortAllocator, owner_digest
from .remote import Garbled, Lost, MachineError, Remote
from .server import ArbiterServer, is_member

STATUS_TIMEOUT_S = 2.0  # `pytest-gpu status`: how long one domain's arbiter may take to connect and answer
ELECT_TIMEOUT_S = 2.0  # how long a refused connection may mean "the arbiter is coming or going"
HELLO_TIMEOUT_S = 5.0  # how long an arbiter may take to answer an attach before it counts as a squatter
LATE_MAX = 4096  # withdrawn requests whose late grant is still believed (the oldest are forgotten)
MAX_FAILOVERS = 50  # a run's failovers in a machine-wide domain before it stops coming back there
OWN_RUNS_ONLY = (
    "this run coordinates its GPUs with its own user's runs only, and sees the others as usage outside pytest-gpu"
)

_links: weakref.WeakSet[MachineLink] = weakref.WeakSet()


def _forget_in_child() -> None:
    """After ``fork()``: a child (a test's ``multiprocessing`` worker, say) must hold none of
    the run's locks or sockets, or it would keep the arbiter's lock and address taken after
    the run is gone. Only the child's copies are closed."""
    for link in list(_links):
        link._forget_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


class Squatter(MachineError):
    """A machine-wide domain's address is held by a process this run cannot use."""


def _group_of(domain: Domain) -> int | None:
    """The group whose members may be ``domain``'s arbiter: a group's simulated machine's
    (its directory's group), -1 where that cannot be told (no one but this user and root);
    ``None`` for the real GPUs (anyone)."""
    if not domain.name.startswith("sim-"):
        return None
    try:
        found = os.lstat(domain.path)
    except OSError:
        return -1
    return found.st_gid if stat.S_ISDIR(found.st_mode) else -1


def distrusted(domain: Domain, uid: int, pid: int, who: str) -> str | None:
    """Why the process ``who`` (``pid`` of user ``uid``, the kernel's word) that answers at
    ``domain``'s address is not an arbiter to trust, or ``None``: this user's own process;
    in a machine-wide domain root's, or, on a group's simulated machine, a member's of the
    group (:func:`~.server.is_member`, as the arbiter checks its runs); on the real GPUs
    anyone's (see the module doc)."""
    if uid == os.getuid():
        return None
    if not domain.wide:  # only this user can bind there; never trust anyone else
        return f"the arbiter of {domain.name!r} is not this user's (uid {uid})"
    group = _group_of(domain)
    if group is None or uid == 0 or (group >= 0 and is_member(group, uid, pid)):
        return None
    try:
        named = grp.getgrgid(group).gr_name if group >= 0 else "?"
    except KeyError:
        named = str(group)
    return f"{who} is not in group {named}, whose simulated machine {domain.name!r} it serves: not trusted"


class MachineLink:
    """This run's side of machine-wide leasing (see the module doc).

    Its methods are the :class:`~.arbiter.Arbiter`'s for this run; :meth:`attach` must
    come first. Thread-safe.
    """

    def __init__(
        self,
        domain: Domain | Callable[[], Domain] | None,
        policy: Policy | None = None,
        *,
        label: str = "",
        foreign: ForeignSource | None = None,
        truth: Truth | None = None,
        run: str | None = None,
        ports: PortAllocator | None = None,
    ) -> None:
        # a callable is asked on attach: a run that never needs a GPU never touches the machine dir
        self._domain = domain
        self.domain: Domain | None = domain if isinstance(domain, Domain) else None
        self.policy = policy or Policy()
        self.label = (label or f"pytest in {os.getcwd()}")[:LABEL_MAX]
        self.foreign = foreign
        self.truth = truth
        self.ports = ports  # the port allocator of an arbiter this run makes (None: the default)
        # the uid first: the arbiter checks it against the kernel's word
        self.run = run or f"{os.getuid()}.{os.getpid()}-{secrets.token_hex(3)}"
        self.failovers = 0
        self.fell_back: str | None = None  # why this run left its machine-wide domain, if it did
        # _lock: calls and failovers, one at a time (held across I/O); the mirror has its
        # own, never held across I/O (the reader thread takes it to file events)
        self._lock = threading.RLock()
        self._gpus: dict[str, int] = {}
        self._host: tuple[int, int] | None = None  # this run's view of the machine's CPUs and RAM
        self._sink: Sink | None = None
        self._arbiter: Arbiter | None = None  # when this run is the arbiter
        self._server: ArbiterServer | None = None
        self._remote: Remote | None = None
        self._lock_fd = -1
        self._presence: tuple[Domain, socket.socket] | None = None  # says this run is attached there
        self._attached = False
        self._closed = False
        self._mirror = Mirror()  # what this run holds and waits for, to bring to a new arbiter
        self._asking: dict[str, Asked] = {}  # a submit on its way to another process's arbiter
        # requests withdrawn (cancelled, abandoned, their client gone) that an arbiter may have
        # granted as they went: their grants may still come, and are judged as the others
        self._late: dict[str, Asked] = {}
        self._roster: list[tuple[str, int]] = []  # the runs attached, as the arbiter last said
        self._events: queue.SimpleQueue[list[Event] | None] = queue.SimpleQueue()
        self._dispatcher: threading.Thread | None = None
        _links.add(self)

    def _forget_in_child(self) -> None:
        if self._lock_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
        self._lock_fd = -1
        if self._server is not None:
            self._server.forget_in_child()
        if self._remote is not None:
            with contextlib.suppress(OSError):
                os.close(self._remote.sock.detach())
        if self._presence is not None:  # the child is not the run: a new arbiter must not wait for it
            with contextlib.suppress(OSError):
                os.close(self._presence[1].detach())
            self._presence = None
        self._server = self._remote = self._arbiter = None
        self._closed = True  # the child is no run: close() does nothing there

    @property
    def is_arbiter(self) -> bool:
        return self._arbiter is not None

    # -- joining ------------------------------------------------------------------------

    def attach(self, gpus: dict[str, int], sink: Sink, host: tuple[int, int] | None = None) -> None:
        """Join the machine with these GPUs (UUID -> capacity) and this run's view of its
        CPUs and RAM (``host``, see :mod:`pytest_gpu.leasing.host`); ``sink`` gets this run's events."""
        with self._lock:
            if self._attached:
                return
            self._gpus, self._sink, self._host = dict(gpus), sink, host
            self._dispatcher = threading.Thread(
                target=self._dispatch_loop, name="pytest-gpu-machine-events", daemon=True
            )
            self._dispatcher.start()
            if callable(self._domain) and self.domain is None:
                self.domain = self._domain()
            if self.domain is None:  # a private pool: this run shares its GPUs with no one
                self._alone()
            else:
                self._elect_and_attach(expect=False)
            self._attached = True

    def _elect_and_attach(self, expect: bool) -> None:
        assert self.domain is not None
        try:
            self._elect_in(self.domain, expect)
            return
        except (OSError, MachineError) as exc:
            why = str(exc)
        if self.domain.wide:
            self.fell_back = why
            warn_once(f"squat:{self.domain.name}", f"{why}; {OWN_RUNS_ONLY}")
            try:
                self.domain = self.domain.fallback()
                self._elect_in(self.domain, expect)
                return
            except (OSError, MachineError) as exc:
                why = str(exc)
        # not even a private domain: this run alone
        warn_once(f"alone:{self.domain.name}", f"{why}; this run shares its GPUs with no other run")
        self._alone()

    def _alone(self) -> None:
        """This run is its own arbiter, in its own process, sharing its GPUs with no other run."""
        self._be_present(None)
        self.domain = None
        self._arbiter = Arbiter(self.policy, self.foreign, truth=self.truth, ports=self.ports)
        self._attach_here(self._arbiter)

    def _be_present(self, domain: Domain | None) -> None:
        """Hold this run's presence name in ``domain`` (in none: ``None``), before it can win
        an election or attach there: an arbiter elected from then on waits for it."""
        if self._presence is not None and self._presence[0] == domain:
            return
        if self._presence is not None:
            self._presence[1].close()
            self._presence = None
        held = domain.be_present(roster_digest(self.run)[1:]) if domain is not None else None
        if domain is not None and held is not None:
            self._presence = (domain, held)

    def _elect_in(self, domain: Domain, expect: bool) -> None:
        self._be_present(domain)
        deadline = time.monotonic() + ELECT_TIMEOUT_S
        while True:
            if self._try_lead(domain, expect):
                return
            try:
                remote = Remote(domain.address(), self._remote_events, self._remote_lost, self._heard_roster)
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise Squatter(
                        f"nothing answers at the machine's arbiter address of {domain.name!r} "
                        f"though it is taken ({exc.strerror or exc})"
                    ) from None
                time.sleep(0.005)  # the arbiter has won but is not listening yet, or is leaving
                continue
            why = distrusted(domain, remote.peer_uid, remote.peer_pid, self._who(remote))
            if why is not None:
                remote.close()
                raise Squatter(why)
            try:
                self._attach_remote(remote)
            except Lost:  # the arbiter left meanwhile, or shut this run out (too many of its user's)
                remote.close()
                if time.monotonic() > deadline:
                    raise Squatter(f"the machine's arbiter of {domain.name!r} keeps closing on this run") from None
                time.sleep(0.005)
                continue
            except MachineError as exc:  # silent, refused this run or garbled: not an arbiter to use
                remote.close()
                raise Squatter(f"{self._who(remote)} is no usable arbiter: {exc}") from None
            self._remote = remote
            if remote.lost:  # it ended just as it answered: its reader thread found no arbiter to leave
                self._remote = None
                remote.close(wait=False)
                if remote.garbled is not None:
                    raise Squatter(f"{self._who(remote)} is no usable arbiter: {remote.garbled}")
                if time.monotonic() > deadline:
                    raise Squatter(f"the machine's arbiter of {domain.name!r} keeps closing on this run")
                time.sleep(0.005)
                continue
            return

    @staticmethod
    def _who(remote: Remote) -> str:
        who = f"pid {remote.peer_pid}, user {user_name(remote.peer_uid)}"
        return f"the process at the machine's arbiter address ({who})"

    def _try_lead(self, domain: Domain, expect: bool) -> bool:
        fd = -1
        if not domain.wide:  # the lock file decides; the socket file is then ours to replace
            fd = open_or_create(domain.lock_path, 0o600, owner=os.getuid())
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                return False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(domain.address())  # a dead arbiter's
        arbiter = Arbiter(self.policy, self.foreign, truth=self.truth, ports=self.ports)
        try:
            server = ArbiterServer(arbiter, domain.address(), self.run)
        except OSError:  # machine-wide: another process holds the address
            if fd >= 0:
                os.close(fd)
            arbiter.close()
            return False
        # this run's leases are in the allocator before any other run can reach it (the server
        # starts last): nothing it holds can be promised to another run meanwhile. The runs to
        # wait for: those of the last roster it heard (after a failover), and those present,
        # which a run that just arrived knows of only so (the arbiter's run left as it came)
        coming = {"#" + tag for tag in domain.present()} - {roster_digest(self.run)}
        if expect:
            coming |= {run for run, pid in self._roster if run != self.run and self._maybe_alive(pid)}
        if coming:
            arbiter.expect(coming)
        self._lock_fd, self._arbiter = fd, arbiter
        self._attach_here(arbiter)
        self._server = server.start()
        return True

    @staticmethod
    def _maybe_alive(pid: int) -> bool:
        return pid <= 0 or owner_alive(pid, None)  # another user's run: its pid is not told

    def _attach_here(self, arbiter: Arbiter) -> None:
        """This run joins the arbiter in its own process, with what it holds and waits for."""
        mine = self._mirror.snapshot()
        arbiter.attach(
            self.run,
            pid=os.getpid(),
            uid=os.getuid(),
            user=user_name(),
            label=self.label,
            gpus=self._gpus,
            sink=self._file_events,
            held=mine.held,
            asked=mine.asked,
            host=self._host,
            ports=mine.ports,
            contexts=mine.contexts,
            exiting=mine.exiting,
            left=mine.left,
        )

    def _private(self, remote: Remote | None = None) -> bool:
        """Whether the arbiter is another user's: it is told no names."""
        remote = remote or self._remote
        return remote is not None and remote.peer_uid != os.getuid()

    def _said(self, owner: str, remote: Remote | None = None) -> str:
        """A port owner (``<client>/<test or fixture>@<tag>``) as the arbiter is told it: as it
        is, or for another user's arbiter the client and a digest of the rest."""
        if not self._private(remote):
            return owner
        client, _, rest = owner.partition("/")
        return f"{client}/{owner_digest(rest)}"

    def _attach_remote(self, remote: Remote) -> None:
        mine = self._mirror.snapshot()
        private = self._private(remote)
        # contexts in the attach itself: counted before the new arbiter can grant again
        remote.call(
            "attach",
            timeout=HELLO_TIMEOUT_S,
            run=self.run,
            label="" if private else self.label,
            gpus=self._gpus,
            held=[to_wire(h, private) for h in mine.held],
            asked=[to_wire(a, private) for a in mine.asked],
            ports=[[port, self._said(owner, remote)] for port, owner in mine.ports.items()],
            contexts=mine.contexts,
            exiting=mine.exiting,
            left={c: {u: [n, "" if private else who] for u, (n, who) in g.items()} for c, g in mine.left.items()},
        )

    def _remote_lost(self, remote: Remote) -> None:
        """The arbiter went away (its run ended or died): elect again, from the reader thread."""
        if remote is not self._remote:
            return  # a connection that never served (lost while attaching): its caller tries again
        with self._lock:
            if self._closed or remote is not self._remote:
                return  # closed, or another thread failed over already
            self._failover()

    def _failover(self) -> None:
        old, self._remote = self._remote, None
        if old is not None:
            old.close(wait=False)  # its reader thread may wait for this link's lock, held here
        self.failovers += 1
        if old is not None and old.garbled is not None and self.domain is not None:
            # it said what its protocol does not allow: not an arbiter to come back to
            why = f"{self._who(old)} is no usable arbiter: {old.garbled}"
            if self.domain.wide:
                self.fell_back = why
                warn_once(f"garbled:{self.domain.name}", f"{why}; {OWN_RUNS_ONLY}")
                self.domain = self.domain.fallback()
            else:
                warn_once(f"garbled:{self.domain.name}", f"{why}; this run shares its GPUs with no other run")
                self._alone()
                return
        elif self.domain is not None and self.domain.wide and self.failovers > MAX_FAILOVERS:
            # an arbiter that keeps breaking off (closing): not one to keep coming back to
            self.domain = self.domain.fallback()
            warn_once("failovers", f"the machine's arbiter went away {self.failovers} times; {OWN_RUNS_ONLY}")
        self._elect_and_attach(expect=True)

    # -- events -------------------------------------------------------------------------

    def _file_events(self, events: list[Event]) -> None:
        """Events, from the arbiter in this process or the reader thread: the sink gets them
        on a thread of its own, which holds none of this link's locks (a sink may wait for
        its broker's lock, held by a thread that waits for this link)."""
        if self._arbiter is not None and not self._mirror.inflight:
            self._events.put(events)  # the arbiter's own run keeps no mirror
            return
        passed = self._mirror.file(events)
        if passed:
            self._events.put(passed)

    def _remote_events(self, events: list[Event]) -> None:
        """Events from an arbiter in another process (its reader thread): a grant this run
        can tell is false is a :class:`WireError`, and the connection is garbled for it."""
        self._judge([(key, body) for kind, key, body in events if kind == "granted"])
        for _, key, _ in events:
            self._late.pop(key, None)  # decided: no second event comes for it
        self._file_events(events)

    def _withdrawn(self, requests: list[Asked]) -> None:
        for asked in requests:
            self._late[asked.key] = asked
        while len(self._late) > LATE_MAX:
            self._late.pop(next(iter(self._late)), None)

    def _judge(self, grants: list[tuple[str, Any]]) -> None:
        """Each grant against what this run asked for and holds (the arbiter may be a
        stranger: see the module doc); one after another, as if each were held already."""
        if not grants:
            return
        mine = self._mirror.snapshot()
        held = list(mine.held)
        asked = {a.key: a for a in mine.asked}
        for key, body in grants:
            if any(h.key == key for h in held):
                raise WireError(f"a grant of {key!r:.80}, which the run holds already")
            request = self._asking.get(key) or asked.get(key) or self._late.get(key)
            if request is None:
                raise WireError(f"a grant of {key!r:.80}, which the run did not ask for")
            check_grant(body, request.request, request.gpus, self._gpus, held, f"a grant of {key!r:.80}")
            held.append(Held(key, "", "", "", request.request, tuple(body["gpus"]), body["memory"], body["exclusive"]))

    def _heard_roster(self, runs: list[tuple[str, int]]) -> None:
        self._roster = runs

    def _dispatch_loop(self) -> None:
        while True:
            events = self._events.get()
            if events is None:
                return
            if self._sink is not None:
                try:
                    self._sink(events)
                except Exception:
                    pass

    # -- calls --------------------------------------------------------------------------

    def _call(
        self, op: str, local: Callable[[Arbiter], Any], expect: Callable[[Any], None] | None = None, **fields: Any
    ) -> Any:
        """``local(arbiter)`` when this run is the arbiter, else ``op`` over the socket,
        its answer checked (``expect``: see :meth:`Remote.call`); the arbiter lost on the
        way, or garbled (then the run leaves it: see :meth:`_failover`): ask the next one."""
        with self._lock:
            if self._closed:  # a late call of a run that left: it must not join the machine again
                raise MachineError(f"pytest-gpu: {op!r} after this run left the machine")
            for _ in range(3):
                if self._arbiter is not None:
                    return local(self._arbiter)
                assert self._remote is not None, "attach() first"
                try:
                    return self._remote.call(op, expect=expect, **fields)
                except (Lost, Garbled):
                    self._failover()  # garbled: to an arbiter of this user's own, which is asked next
            raise MachineError(f"pytest-gpu: the machine's arbiter kept going away during {op!r}")

    def _tell(self, op: str, local: Callable[[Arbiter], Any], **fields: Any) -> None:
        with self._lock:
            if self._arbiter is not None:
                local(self._arbiter)
            elif self._remote is not None:
                self._remote.tell(op, **fields)

    def submit(
        self,
        key: str,
        client: str,
        worker: str,
        test: str,
        request: GpuRequest,
        gpus: list[str],
        prefer: list[str] | None = None,
    ) -> tuple[str, Any]:
        """Ask the arbiter for ``request`` on ``gpus``, preferring those of ``prefer`` (a hint,
        see :meth:`Arbiter.submit`; a re-declared request after a failover has none)."""
        test = test if len(test) <= TEST_MAX else test[: TEST_MAX - 3] + "..."
        with self._lock:
            arbiter = self._arbiter
            if arbiter is not None:
                # the fast path of a run that is the arbiter: no mirror (it never re-declares)
                return arbiter.submit(self.run, key, client, worker, test, request, gpus, prefer)
            asked = Asked(key, client, worker, test, request, tuple(gpus))
            self._asking[key] = asked
            self._mirror.begin(key)
            private = self._private()
            extra: dict[str, Any] = {} if prefer is None else {"prefer": prefer}

            def judged(answer: tuple[str, Any]) -> None:
                if answer[0] == "granted":
                    self._judge([(key, answer[1])])

            try:
                kind, value = self._call(
                    "submit",
                    lambda a: a.submit(self.run, key, client, worker, test, request, gpus, prefer),
                    judged,
                    key=key,
                    client=client,
                    worker="" if private else worker,
                    test="" if private else test,
                    request=request_to_wire(request),
                    gpus=gpus,
                    **extra,
                )
            except BaseException:
                self._mirror.end(key)
                self._asking.pop(key, None)
                raise
            early = self._mirror.end(key)
            if kind == "queued" and early is not None:  # decided before the answer came
                kind, value = early[0], early[2] if early[0] == "granted" else early[2]["message"]
            if self._arbiter is None:  # still a follower: keep the mirror
                self._mirror.answered(asked, kind, value)
            self._asking.pop(key, None)  # only now: its grant may come before the mirror has it waiting
            return str(kind), value

    def cancel(self, key: str) -> list[dict[str, Any]] | None:
        with self._lock:
            self._withdrawn([a for a in self._mirror.snapshot().asked if a.key == key])
            self._mirror.withdraw(key)
            holders: list[dict[str, Any]] | None = self._call("cancel", lambda a: a.cancel(self.run, key), key=key)
            if holders is not None:  # it waited, and waits no more: no grant comes
                self._late.pop(key, None)
            return holders

    def abandon(self, key: str) -> None:
        with self._lock:
            self._withdrawn([a for a in self._mirror.snapshot().asked if a.key == key])
            self._mirror.drop(key)
            self._tell("abandon", lambda a: a.abandon(self.run, key), key=key)

    def release(
        self, key: str, contexts: list[str] | None = None, left: dict[str, tuple[int, str]] | None = None
    ) -> None:
        """Give a lease back; ``left``: GPU -> (bytes, who left them), what its client's process
        still holds of leases that ended (see :meth:`Arbiter.release`)."""
        with self._lock:
            arbiter = self._arbiter
            if arbiter is not None:
                arbiter.release(self.run, key, contexts, left)
                return
            self._mirror.release(key, contexts, left)
            extra: dict[str, Any] = {}
            if left is not None:  # another user's arbiter is not told who left it
                extra["left"] = {u: [n, "" if self._private() else who] for u, (n, who) in left.items()}
            self._tell(
                "release", lambda a: a.release(self.run, key, contexts, left), key=key, contexts=contexts, **extra
            )

    def set_contexts(self, client: str, contexts: list[str]) -> None:
        with self._lock:
            self._mirror.set_contexts(client, contexts)
            self._call(
                "set_contexts",
                lambda a: a.set_contexts(self.run, client, contexts),
                client=client,
                contexts=contexts,
            )

    def forget_client(self, client: str) -> list[tuple[str, tuple[str, ...]]]:
        with self._lock:
            self._withdrawn([a for a in self._mirror.snapshot().asked if a.client == client])
            self._mirror.forget_client(client)
            rows = self._call("forget_client", lambda a: a.forget_client(self.run, client), client=client)
            return [(str(k), tuple(g)) for k, g in rows]

    def exiting(self, client: str, contexts: list[str]) -> None:
        """``client`` is gone but its process (and its contexts) still exist."""
        with self._lock:
            self._mirror.exiting(client, contexts)
            self._call("exiting", lambda a: a.exiting(self.run, client, contexts), client=client, contexts=contexts)

    def exited(self, client: str) -> None:
        with self._lock:
            self._mirror.exited(client)
            self._call("exited", lambda a: a.exited(self.run, client), client=client)

    def measure_context(self, uuid: str, nbytes: int) -> bool:
        """One CUDA context measured on GPU ``uuid`` (a new arbiter does not learn it: it
        goes by the assumed size until a process measures again)."""
        with self._lock:
            return bool(
                self._call(
                    "measure_context", lambda a: a.measure_context(self.run, uuid, nbytes), uuid=uuid, bytes=nbytes
                )
            )

    def room(self, gpus: list[str]) -> list[int]:
        def judged(room: list[int]) -> None:
            check_room(room, gpus, self._gpus)

        return [int(n) for n in self._call("room", lambda a: a.room(gpus), judged, gpus=gpus)]

    def take_ports(self, n: int, owner: str, port_range: tuple[int, int]) -> list[int]:
        """``n`` ports no run of the machine holds, for ``owner``; MachineError when too few are free."""

        def judged(answer: dict[str, Any]) -> None:
            if "ports" in answer:
                check_ports(answer["ports"], n, port_range, self._mirror.snapshot().ports)

        with self._lock:
            answer = self._call(
                "take_ports",
                lambda a: a.take_ports(self.run, n, owner, port_range),
                judged,
                n=n,
                owner=self._said(owner),
                range=list(port_range),
            )
            if "refused" in answer:
                raise MachineError(str(answer["refused"]))
            ports = list(answer["ports"])
            self._mirror.took_ports(ports, owner)
            return ports

    def give_back_ports(self, owner: str) -> None:
        with self._lock:
            self._mirror.gave_back_ports(owner)
            self._tell("give_back_ports", lambda a: a.give_back_ports(self.run, owner), owner=self._said(owner))

    def give_back_ports_prefix(self, prefix: str) -> None:
        """Give back every port of an owner that starts with ``prefix`` (a client's)."""
        with self._lock:
            self._mirror.gave_back_ports(prefix, prefix=True)
            self._tell(
                "give_back_ports_prefix",
                lambda a: a.give_back_ports_prefix(self.run, prefix),
                prefix=prefix,
            )

    def status(self) -> dict[str, Any]:
        return dict(self._call("status", lambda a: a.status(viewer=os.getuid())))

    # -- leaving ------------------------------------------------------------------------

    def close(self) -> None:
        """Leave the machine: what this run holds goes back; if it was the arbiter, the
        other runs elect a new one."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._be_present(None)  # first: an arbiter elected from now on must not wait for it
            if self._server is not None:
                self._server.leave(self.run)
                self._server.close()
            if self._arbiter is not None:
                self._arbiter.close()
            if self._lock_fd >= 0:
                os.close(self._lock_fd)  # the lock goes with it
                self._lock_fd = -1
            if self._remote is not None:
                self._remote.close()
            self._events.put(None)


def status(domain: Domain, timeout: float = STATUS_TIMEOUT_S) -> dict[str, Any] | None:
    """The machine's state from its arbiter (as this user may see it), or ``None`` when no
    run is attached (no arbiter), what answers is not an arbiter this user's runs would
    trust (:func:`distrusted`), or it does not connect and answer within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    try:
        remote = Remote(domain.address(), lambda events: None, lambda lost: None, timeout=timeout)
    except OSError:
        return None
    try:
        if distrusted(domain, remote.peer_uid, remote.peer_pid, MachineLink._who(remote)) is not None:
            return None
        found = remote.call("status", timeout=max(deadline - time.monotonic(), 0.001))
        return dict(found) if isinstance(found, dict) else None
    except (Lost, MachineError):
        return None
    finally:
        remote.close()
