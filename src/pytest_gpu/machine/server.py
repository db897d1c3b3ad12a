"""The arbiter's socket: other runs (and ``pytest-gpu status``) reach the arbiter here.

One thread, non-blocking sockets, one epoll: a peer that sends half a frame, or nothing,
or never reads its replies, only ever delays itself. A run's connection closing (it
finished, or it died and the kernel closed its socket) detaches the run: its leases go
back at once.

Every peer is a stranger (a machine-wide arbiter is reachable by every local user):

- **identity** is the kernel's: uid and pid from ``SO_PEERCRED`` at connect. A run's id
  must begin with that uid, a run is bound to the connection that attached it, and every
  operation acts on that run alone (:mod:`.arbiter`);
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

Requests (``{"op": ..., "id": n, ...}``) are answered ``{"re": n, "ok": value}`` or
``{"re": n, "error": message}`` (a request without an ``id`` gets no answer); events
for a run arrive as ``{"ev": [[kind, key, body], ...]}``, and the runs attached (after a
run attaches or detaches) as ``{"roster": [[run, pid], ...], "arbiter": run}``.
"""

from __future__ import annotations

import functools
import os
import selectors
import socket
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from ..wire.frames import MAX_REPLY, FrameReader, WireError, encode
from ..wire.sockets import peer_credentials, reachable
from . import messages
from .arbiter import Arbiter, Event, roster_digest, run_uid
from .domain import user_name
from .messages import integer

MAX_OUTBOX = 4 << 20
MAX_PEERS = 512  # connections in all (the process's descriptors are the run's too)
MAX_PEERS_PER_UID = 64  # a user's runs hold one each, `pytest-gpu status` one for a moment
MAX_PENDING_PER_UID = 8 << 20  # bytes of unfinished frames a user's connections may hold
TURN_BYTES_PER_UID = 64 << 10  # what one user's connections are read for in one turn of the loop
SECONDS_PER_UID_S = 0.1  # of each second, what one user's messages may take of the arbiter's thread
HELLO_TIMEOUT_S = 5.0  # a new connection's first whole request
FRAME_TIMEOUT_S = 10.0  # a frame begun must be whole by then


@dataclass(eq=False)
class Peer:
    sock: socket.socket
    pid: int
    uid: int
    reader: FrameReader = field(default_factory=FrameReader)
    outbox: bytearray = field(default_factory=bytearray)
    run: str | None = None
    closed: bool = False
    hello_by: float | None = None  # monotonic deadline of its first request; None once it came
    frame_by: float | None = None  # monotonic deadline of the frame under way


class ArbiterServer:
    """Serves ``arbiter`` on the Unix socket ``address`` until :meth:`close`.

    Binding an abstract ``address`` is a machine-wide domain's election: ``OSError``
    (``EADDRINUSE``) means another process serves (or squats) it."""

    def __init__(self, arbiter: Arbiter, address: str, run: str = "") -> None:
        self.arbiter = arbiter
        self.address = address
        self.run = run  # the run in this process (rosters name it: its followers know its pid)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with reachable(address) as where:
                self._listener.bind(where)
            self._listener.listen(128)
            self._listener.setblocking(False)
        except OSError:
            self._listener.close()
            raise
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._lock = threading.Lock()  # peers' outboxes (sinks run on other threads)
        self._peers: set[Peer] = set()
        self._used: dict[int, float] = defaultdict(float)  # seconds of this thread per uid in this second
        self._second = time.monotonic()
        self._window = 1.0  # seconds of one share (a test stretches it)
        self._closing = False
        self.dropped: Counter[str] = Counter()  # why peers were shut out, for tests and the curious
        self._thread = threading.Thread(target=self._loop, name="pytest-gpu-arbiter", daemon=True)

    def forget_in_child(self) -> None:
        """In a forked child: drop this process's copies of the sockets (never shut them
        down: they are the parent's too), so the child cannot keep the arbiter's address
        bound after the parent is gone."""
        for sock in [self._listener, *(peer.sock for peer in self._peers)]:
            try:
                os.close(sock.detach())
            except OSError:
                pass

    def start(self) -> ArbiterServer:
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving: every peer sees its connection close (and elects a new arbiter)."""
        self._closing = True
        self._wake()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def leave(self, run: str) -> None:
        """The arbiter's own run leaves: the others hear it before the socket closes, so the
        next arbiter does not wait for it to come back."""
        self.arbiter.detach(run)
        self._tell_rosters()

    def alive(self) -> bool:
        """Whether the serving thread still runs."""
        return self._thread.is_alive()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    # -- the loop -------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._closing:
                try:
                    self._turn()
                except Exception as exc:  # a bug of ours: say it, and go on serving every other run
                    print(f"pytest-gpu: arbiter: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                    time.sleep(0.01)
        finally:
            for peer in list(self._peers):
                self._flush(peer)  # what is said last (a roster without the leaving run) is small: it fits
                self._drop(peer, "closing", detach=False)
            self._selector.close()
            self._listener.close()
            if not self.address.startswith("\0"):
                try:
                    os.unlink(self.address)
                except OSError:
                    pass
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _turn(self) -> None:
        spent: Counter[int] = Counter()  # bytes read per uid in this turn
        for key, events in self._selector.select(self._timeout()):
            if key.data is None:
                self._accept()
            elif key.data == "wake":
                os.read(self._wake_r, 4096)
            else:
                peer: Peer = key.data
                try:
                    if events & selectors.EVENT_READ and spent[peer.uid] < TURN_BYTES_PER_UID:
                        if not self._throttled(peer.uid):  # a user over its share: its turn comes again
                            started = time.perf_counter()
                            spent[peer.uid] += self._read(peer)
                            self._used[peer.uid] += time.perf_counter() - started
                    if events & selectors.EVENT_WRITE and not peer.closed:
                        self._flush(peer)
                except Exception as exc:  # whatever a peer made happen ends that peer alone
                    self._drop(peer, f"error: {type(exc).__name__}")
        self._expire()
        self._update_interest()

    def _timeout(self) -> float | None:
        deadlines = [d for p in self._peers for d in (p.hello_by, p.frame_by) if d is not None]
        if any(self._throttled(uid) for uid in self._used):
            deadlines.append(self._second + self._window)  # a user waiting for its next second
        return None if not deadlines else max(min(deadlines) - time.monotonic(), 0.0) + 0.001

    def _throttled(self, uid: int) -> bool:
        return self._used[uid] >= SECONDS_PER_UID_S

    def _expire(self) -> None:
        now = time.monotonic()
        if now >= self._second + self._window:
            self._second, self._used = now, defaultdict(float)
        for peer in list(self._peers):
            if peer.hello_by is not None and now >= peer.hello_by:
                self._drop(peer, "silent")
            elif peer.frame_by is not None and now >= peer.frame_by:
                self._drop(peer, "half frame")

    def _accept(self) -> None:
        for _ in range(64):  # a burst, then the others' turn
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            pid, uid = peer_credentials(sock)
            mine = sum(p.uid == uid for p in self._peers)
            if uid < 0 or len(self._peers) >= MAX_PEERS or mine >= MAX_PEERS_PER_UID:
                self.dropped["too many"] += 1
                sock.close()
                continue
            sock.setblocking(False)
            peer = Peer(sock, pid, uid, hello_by=time.monotonic() + HELLO_TIMEOUT_S)
            self._peers.add(peer)
            self._selector.register(sock, selectors.EVENT_READ, peer)

    def _read(self, peer: Peer) -> int:
        """Read and handle what ``peer`` sent; the bytes read."""
        try:
            data = peer.sock.recv(65536)
        except BlockingIOError:
            return 0
        except OSError:
            data = b""
        if not data:
            self._drop(peer, "closed")
            return 0
        try:
            found = peer.reader.feed(data)
        except WireError:
            self._drop(peer, "bad frame")
            return len(data)
        if peer.reader.pending:
            if peer.frame_by is None:
                peer.frame_by = time.monotonic() + FRAME_TIMEOUT_S
            held = sum(p.reader.pending for p in self._peers if p.uid == peer.uid)
            if held > MAX_PENDING_PER_UID:
                self._drop(peer, "too much unfinished")
                return len(data)
        else:
            peer.frame_by = None
        if found:
            peer.hello_by = None
        for message in found:
            if peer.closed:
                break
            reply = self._handle(peer, message)
            if reply is not None:
                self._send(peer, reply)
        return len(data)

    def _send(self, peer: Peer, message: dict[str, Any]) -> None:
        try:
            data = encode(message, MAX_REPLY)
        except (WireError, ValueError, TypeError) as exc:
            if "re" not in message:
                return  # an event that cannot be said: the run notices nothing, as if it were lost
            data = encode({"re": message["re"], "error": f"the answer cannot be sent: {exc}"})
        with self._lock:
            if peer.closed:
                return
            peer.outbox += data
            too_much = len(peer.outbox) > MAX_OUTBOX
        if too_much:
            self._drop(peer, "not reading")
            return
        if threading.current_thread() is self._thread:
            self._flush(peer)
        else:
            self._wake()  # the loop flushes it (and watches for writability if need be)

    def _flush(self, peer: Peer) -> None:
        with self._lock:
            while peer.outbox and not peer.closed:
                try:
                    sent = peer.sock.send(peer.outbox)
                except BlockingIOError:
                    return
                except OSError:
                    break
                del peer.outbox[:sent]
            else:
                return
        self._drop(peer, "closed")

    def _update_interest(self) -> None:
        with self._lock:
            peers = [(p, bool(p.outbox)) for p in self._peers if not p.closed]
        for peer, pending in peers:
            if pending:
                self._flush(peer)
            with self._lock:
                pending = bool(peer.outbox) and not peer.closed
            if peer.closed:
                continue
            reading = 0 if self._throttled(peer.uid) else selectors.EVENT_READ
            wanted = reading | (selectors.EVENT_WRITE if pending else 0)
            try:
                key = self._selector.get_key(peer.sock)
            except (KeyError, ValueError):
                key = None
            try:
                if not wanted:  # a user over its share with nothing to be sent: not listened to meanwhile
                    if key is not None:
                        self._selector.unregister(peer.sock)
                elif key is None:
                    self._selector.register(peer.sock, wanted, peer)
                elif key.events != wanted:
                    self._selector.modify(peer.sock, wanted, peer)
            except (KeyError, ValueError, OSError):
                pass

    def _drop(self, peer: Peer, why: str, detach: bool = True) -> None:
        with self._lock:
            if peer.closed:
                return
            peer.closed = True
        self.dropped[why] += 1
        self._peers.discard(peer)
        try:
            self._selector.unregister(peer.sock)
        except (KeyError, ValueError):
            pass
        peer.sock.close()
        if detach and peer.run is not None:
            self.arbiter.detach(peer.run)
            self._tell_rosters()

    def _tell_rosters(self) -> None:
        """Every attached run learns which runs are attached (see :meth:`Arbiter.roster`)."""
        for peer in list(self._peers):
            if peer.run is not None and not peer.closed:
                ours = self.run if run_uid(self.run) == peer.uid else roster_digest(self.run)
                self._send(peer, {"roster": self.arbiter.roster(peer.uid), "arbiter": ours})

    # -- requests -----------------------------------------------------------------------

    def _handle(self, peer: Peer, message: dict[str, Any]) -> dict[str, Any] | None:
        rid = message.get("id")  # none: one-way (release, abandon), no reply
        if rid is not None and (isinstance(rid, bool) or not isinstance(rid, int) or not 0 <= rid < 1 << 53):
            return {"re": None, "error": "id must be a non-negative integer"}
        try:
            value = self._dispatch(peer, message.get("op"), message)
        except Exception as exc:  # a bad request is answered, never fatal to the arbiter
            return None if rid is None else {"re": rid, "error": f"{type(exc).__name__}: {exc}"}
        return None if rid is None else {"re": rid, "ok": value}

    def _dispatch(self, peer: Peer, op: Any, m: dict[str, Any]) -> Any:
        arbiter = self.arbiter
        if op == "status":
            return arbiter.status(viewer=peer.uid)
        if op == "attach":
            return self._attach(peer, m)
        run = peer.run
        if run is None:
            raise ValueError(f"{str(op)[:40]!r} before 'attach'")
        if op == "submit":
            ask = messages.submit(m)
            prefer = messages.preference(m)
            return list(
                arbiter.submit(run, ask.key, ask.client, ask.worker, ask.test, ask.request, list(ask.gpus), prefer)
            )
        if op == "cancel":
            return arbiter.cancel(run, messages.name(m.get("key"), "key"))
        if op == "abandon":
            return arbiter.abandon(run, messages.name(m.get("key"), "key"))
        if op == "release":
            return arbiter.release(run, messages.name(m.get("key"), "key"), messages.contexts(m), messages.left(m))
        if op == "set_contexts":
            return arbiter.set_contexts(run, messages.name(m.get("client"), "client"), messages.contexts(m) or [])
        if op == "forget_client":
            rows = arbiter.forget_client(run, messages.name(m.get("client"), "client"))
            return [[k, list(g)] for k, g in rows]
        if op == "exiting":
            return arbiter.exiting(run, messages.name(m.get("client"), "client"), messages.contexts(m) or [])
        if op == "exited":
            return arbiter.exited(run, messages.name(m.get("client"), "client"))
        if op == "measure_context":
            size = messages.context_size(m.get("bytes"))
            return arbiter.measure_context(run, messages.gpu(m.get("uuid"), "uuid"), size)
        if op == "room":
            return arbiter.room(messages.uuids(m.get("gpus"), "gpus"))
        if op == "take_ports":
            owner = messages.text(m.get("owner"), "owner", messages.TEST_MAX)
            return arbiter.take_ports(run, messages.port_count(m.get("n")), owner, messages.port_range(m.get("range")))
        if op == "give_back_ports":
            return arbiter.give_back_ports(run, messages.text(m.get("owner"), "owner", messages.TEST_MAX))
        if op == "give_back_ports_prefix":
            return arbiter.give_back_ports_prefix(run, messages.name(m.get("prefix"), "prefix"))
        raise ValueError(f"unknown op {str(op)[:40]!r}")

    def _attach(self, peer: Peer, m: dict[str, Any]) -> bool:
        if peer.run is not None:
            raise ValueError("this connection has attached a run already")
        body = messages.attach(m)
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
        peer.run = body.run
        self._tell_rosters()
        return True

    def _events(self, peer: Peer, events: list[Event]) -> None:
        self._send(peer, {"ev": [list(e) for e in events]})
