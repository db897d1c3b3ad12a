"""The arbiter's socket: other runs (and ``pytest-gpu status``) reach the arbiter here.

A :class:`pytest_gpu.wire.server.Server` (one serving thread, connections authenticated
apart) with a handler per message of :data:`.messages.ARBITER`. A run's connection
closing (it finished, or it died and the kernel closed its socket) detaches the run: its
leases go back at once.

Every peer is a stranger (a machine-wide arbiter is reachable by every local user):

- **identity** is the kernel's: uid and pid from ``SO_PEERCRED`` at connect
  (:class:`~pytest_gpu.wire.server.PeerAuth`). A run's id must begin with that uid, a run
  is bound to the connection that attached it, and every operation acts on that run alone
  (:mod:`.arbiter`);
- **every field** of every request is checked (:mod:`.messages`) and a bad request is
  answered with an error to its sender only; nothing a peer sends can raise out of the loop;
- **resources are bounded**: a peer must send its first whole request within
  ``HELLO_TIMEOUT_S`` and finish any frame it started within ``FRAME_TIMEOUT_S``; a uid may
  hold ``MAX_PEERS_PER_UID`` connections and ``MAX_PENDING_PER_UID`` bytes of unfinished
  frames; a peer whose unread replies pile up beyond ``MAX_OUTBOX`` bytes is dropped; and in
  each turn of the loop a uid's connections are read for ``TURN_BYTES_PER_UID`` bytes, the
  rest waiting for the next turn (users take turns: another user's message waits at most a
  turn), and a uid whose messages took ``SECONDS_PER_UID_S`` of the thread's time in the
  current second is not read until the next (a flood costs the arbiter's run, in whose
  process the arbiter lives, at most that share).
"""

from __future__ import annotations

import functools
import grp
import pwd
from typing import Any

from ..wire.frames import MAX_FRAME, MAX_REPLY
from ..wire.server import Bounds, Peer, PeerAuth, Server
from .arbiter import Arbiter, Event, Members, roster_digest, run_uid
from .domain import Domain, sim_group, user_name
from .messages import ARBITER, Attach, integer

MAX_OUTBOX = 4 << 20
MAX_PEERS = 512  # connections in all (the process's descriptors are the run's too)
MAX_PEERS_PER_UID = 64  # a user's runs hold one each, `pytest-gpu status` one for a moment
MAX_PENDING_PER_UID = 8 << 20  # bytes of unfinished frames a user's connections may hold
TURN_BYTES_PER_UID = 64 << 10  # what one user's connections are read for in one turn of the loop
SECONDS_PER_UID_S = 0.1  # of each second, what one user's messages may take of the arbiter's thread
HELLO_TIMEOUT_S = 5.0  # a new connection's first whole request
FRAME_TIMEOUT_S = 10.0  # a frame begun must be whole by then


class ArbiterServer(Server):
    """Serves ``arbiter`` on the Unix socket ``address`` until :meth:`close`.

    Binding an abstract ``address`` is a machine-wide domain's election: ``OSError``
    (``EADDRINUSE``) means another process serves (or squats) it. A peer's ``data`` is the
    run it attached (``None`` before)."""

    protocol = ARBITER
    thread_prefix = "pytest-gpu-arbiter"

    def __init__(self, arbiter: Arbiter, address: str, run: str = "") -> None:
        self.arbiter = arbiter
        self.run = run  # the run in this process (rosters name it: its followers know its pid)
        bounds = Bounds(  # read now: a test changes the module's figures before the server is made
            max_request=MAX_FRAME,
            max_answer=MAX_REPLY,
            max_outbox=MAX_OUTBOX,
            max_peers=MAX_PEERS,
            max_peers_per_uid=MAX_PEERS_PER_UID,
            max_pending_per_uid=MAX_PENDING_PER_UID,
            turn_bytes_per_uid=TURN_BYTES_PER_UID,
            seconds_per_uid=SECONDS_PER_UID_S,
            hello_timeout=HELLO_TIMEOUT_S,
            frame_timeout=FRAME_TIMEOUT_S,
        )
        super().__init__(address, PeerAuth(), bounds)
        arbiter.members = group_members(address)

    def leave(self, run: str) -> None:
        """The arbiter's own run leaves: the others hear it before the socket closes, so the
        next arbiter does not wait for it to come back."""
        self.arbiter.detach(run)
        self._tell_rosters()

    def disconnected(self, peer: Peer, why: str) -> None:
        if why != "closing" and peer.data is not None:
            self.arbiter.detach(peer.data)
            self._tell_rosters()

    def _tell_rosters(self) -> None:
        """Every attached run learns which runs are attached (see :meth:`Arbiter.roster`)."""
        for peer in list(self._peers):
            if peer.data is not None and not peer.closed:
                ours = self.run if run_uid(self.run) == peer.uid else roster_digest(self.run)
                self.send(peer, {"roster": self.arbiter.roster(peer.uid), "arbiter": ours})

    def _events(self, peer: Peer, events: list[Event]) -> None:
        self.send(peer, {"ev": [list(e) for e in events]})

    # -- requests -----------------------------------------------------------------------

    def admit(self, peer: Peer, kind: str) -> None:
        if peer.data is None and kind not in ("status", "attach"):
            raise ValueError(f"{kind[:40]!r} before 'attach'")

    def on_status(self, peer: Peer, m: dict[str, Any]) -> Any:
        return self.arbiter.status(viewer=peer.uid)

    def on_attach(self, peer: Peer, body: Attach) -> bool:
        if peer.data is not None:
            raise ValueError("this connection has attached a run already")
        if run_uid(body.run) != peer.uid:
            raise ValueError(f"run {body.run} is not of this connection's user (uid {peer.uid})")
        integer(peer.pid, "pid", 1, 1 << 31)
        self.arbiter.attach(
            body.run,
            pid=peer.pid,  # the kernel's word, not the message's
            uid=peer.uid,
            user=user_name(peer.uid),
            label=body.label,
            gpus=body.gpus,
            sink=functools.partial(self._events, peer),
            held=body.held,
            asked=body.asked,
            host=None,  # the machine's CPUs and RAM are what the arbiter's own run sees
            ports=body.ports,
            contexts=body.contexts,
            exiting=body.exiting,
            left=body.left,
        )
        peer.data = body.run
        self._tell_rosters()
        return True

    def on_submit(self, peer: Peer, m: dict[str, Any]) -> Any:
        asked = (m["key"], m["client"], m["worker"], m["test"], m["request"], list(m["gpus"]))
        return list(self.arbiter.submit(peer.data, *asked, m.get("prefer")))

    def on_cancel(self, peer: Peer, m: dict[str, Any]) -> Any:
        return self.arbiter.cancel(peer.data, m["key"])

    def on_abandon(self, peer: Peer, m: dict[str, Any]) -> None:
        self.arbiter.abandon(peer.data, m["key"])

    def on_release(self, peer: Peer, m: dict[str, Any]) -> None:
        self.arbiter.release(peer.data, m["key"], m.get("contexts"), m.get("left"))

    def on_set_contexts(self, peer: Peer, m: dict[str, Any]) -> None:
        self.arbiter.set_contexts(peer.data, m["client"], m.get("contexts") or [])

    def on_forget_client(self, peer: Peer, m: dict[str, Any]) -> Any:
        return [[k, list(g)] for k, g in self.arbiter.forget_client(peer.data, m["client"])]

    def on_exiting(self, peer: Peer, m: dict[str, Any]) -> None:
        self.arbiter.exiting(peer.data, m["client"], m.get("contexts") or [])

    def on_exited(self, peer: Peer, m: dict[str, Any]) -> None:
        self.arbiter.exited(peer.data, m["client"])

    def on_measure_context(self, peer: Peer, m: dict[str, Any]) -> bool:
        return self.arbiter.measure_context(peer.data, m["uuid"], m["bytes"])

    def on_room(self, peer: Peer, m: dict[str, Any]) -> list[int]:
        return self.arbiter.room(m["gpus"], peer.data)

    def on_take_ports(self, peer: Peer, m: dict[str, Any]) -> Any:
        return self.arbiter.take_ports(peer.data, m["n"], m["owner"], m["range"])

    def on_give_back_ports(self, peer: Peer, m: dict[str, Any]) -> list[int]:
        return self.arbiter.give_back_ports(peer.data, m["owner"])

    def on_give_back_ports_prefix(self, peer: Peer, m: dict[str, Any]) -> list[int]:
        return self.arbiter.give_back_ports_prefix(peer.data, m["prefix"])


def group_members(address: str) -> Members | None:
    """Who may attach at ``address``: on a simulated machine shared with a group (a
    machine-wide domain other than the real GPUs', see :meth:`Domain.sim`), that group's
    members only (``$PYTEST_GPU_SIM_GROUP`` of the arbiter's run, which its runs share);
    ``None``: anyone (the real GPUs; a private domain, which no other user can reach)."""
    if not address.startswith("\0") or address == Domain.real().address():
        return None
    try:
        gid = sim_group()
    except ValueError:  # the arbiter's own run was refused it: it serves no group
        return None
    if gid is None:
        return None
    try:
        name = grp.getgrgid(gid).gr_name
    except KeyError:
        name = str(gid)
    return name, functools.partial(is_member, gid)


def is_member(gid: int, uid: int, pid: int) -> bool:
    """Whether process ``pid`` of user ``uid`` (a peer's credentials, ``SO_PEERCRED``) is in
    group ``gid``: by its groups as the kernel holds them (``/proc/<pid>/status``), else, where
    those cannot be read (``hidepid``), by the group database."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as status:
            fields = dict(line.split(":", 1) for line in status if ":" in line)
        uids = fields["Uid"].split()
        if int(uids[0]) != uid:  # not the peer's process any more (its pid reused)
            return False
        return gid == int(fields["Gid"].split()[1]) or str(gid) in fields.get("Groups", "").split()
    except (OSError, KeyError, IndexError, ValueError):
        pass
    try:
        entry = pwd.getpwuid(uid)
        return entry.pw_gid == gid or entry.pw_name in grp.getgrgid(gid).gr_mem
    except KeyError:
        return False
