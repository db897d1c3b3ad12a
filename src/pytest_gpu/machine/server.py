"""The arbiter's socket: other runs (and ``pytest-gpu status``) reach the arbiter here.

One thread, non-blocking sockets, one epoll: a peer that sends half a frame, or nothing,
or never reads its replies, only ever delays itself. A peer whose unread replies pile up
beyond ``MAX_OUTBOX`` bytes is dropped. A run's connection closing (it finished, or it
died and the kernel closed its socket) detaches the run: its leases go back at once.

Requests (``{"op": ..., "id": n, ...}``) are answered ``{"re": n, "ok": value}`` or
``{"re": n, "error": message}`` (a request without an ``id`` gets no answer); events
for a run arrive as ``{"ev": [[kind, key, body], ...]}``.
"""

from __future__ import annotations

import functools
import os
import selectors
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

from .arbiter import Arbiter, Asked, Event, Held
from .domain import user_name
from .wire import FrameReader, WireError, encode, peer_credentials, request_from_wire

MAX_OUTBOX = 16 << 20


@dataclass(eq=False)
class Peer:
    sock: socket.socket
    pid: int
    uid: int
    reader: FrameReader = field(default_factory=FrameReader)
    outbox: bytearray = field(default_factory=bytearray)
    run: str | None = None
    closed: bool = False


def _host(value: Any) -> tuple[int, int] | None:
    """A run's view of the machine's CPUs and RAM (absent from an older run's attach)."""
    if value is None:
        return None
    cpus, memory = value
    return int(cpus), int(memory)


class ArbiterServer:
    """Serves ``arbiter`` on the abstract Unix socket ``address`` until :meth:`close`."""

    def __init__(self, arbiter: Arbiter, address: str) -> None:
        self.arbiter = arbiter
        self.address = address
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._listener.bind(address)
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
        self._closing = False
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

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    # -- the loop -------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._closing:
                for key, events in self._selector.select():
                    if key.data is None:
                        self._accept()
                    elif key.data == "wake":
                        os.read(self._wake_r, 4096)
                    else:
                        peer: Peer = key.data
                        if events & selectors.EVENT_READ:
                            self._read(peer)
                        if events & selectors.EVENT_WRITE and not peer.closed:
                            self._flush(peer)
                self._update_interest()
        finally:
            for peer in list(self._peers):
                self._drop(peer, detach=False)
            self._selector.close()
            self._listener.close()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except OSError:
            return
        sock.setblocking(False)
        pid, uid = peer_credentials(sock)
        peer = Peer(sock, pid, uid)
        self._peers.add(peer)
        self._selector.register(sock, selectors.EVENT_READ, peer)

    def _read(self, peer: Peer) -> None:
        try:
            data = peer.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop(peer)
            return
        try:
            messages = peer.reader.feed(data)
        except WireError:
            self._drop(peer)
            return
        for message in messages:
            reply = self._handle(peer, message)
            if reply is not None:
                self._send(peer, reply)

    def _send(self, peer: Peer, message: dict[str, Any]) -> None:
        with self._lock:
            if peer.closed:
                return
            peer.outbox += encode(message)
            too_much = len(peer.outbox) > MAX_OUTBOX
        if too_much:
            self._drop(peer)
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
        self._drop(peer)

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
            wanted = selectors.EVENT_READ | (selectors.EVENT_WRITE if pending else 0)
            try:
                if self._selector.get_key(peer.sock).events != wanted:
                    self._selector.modify(peer.sock, wanted, peer)
            except (KeyError, ValueError):
                pass

    def _drop(self, peer: Peer, detach: bool = True) -> None:
        with self._lock:
            if peer.closed:
                return
            peer.closed = True
        self._peers.discard(peer)
        try:
            self._selector.unregister(peer.sock)
        except (KeyError, ValueError):
            pass
        peer.sock.close()
        if detach and peer.run is not None:
            self.arbiter.detach(peer.run)

    # -- requests -----------------------------------------------------------------------

    def _handle(self, peer: Peer, message: dict[str, Any]) -> dict[str, Any] | None:
        rid = message.get("id")  # none: one-way (release, abandon), no reply
        try:
            value = self._dispatch(peer, str(message.get("op")), message)
        except Exception as exc:  # a bad request is answered, never fatal to the arbiter
            return None if rid is None else {"re": rid, "error": f"{type(exc).__name__}: {exc}"}
        return None if rid is None else {"re": rid, "ok": value}

    def _dispatch(self, peer: Peer, op: str, m: dict[str, Any]) -> Any:
        arbiter = self.arbiter
        if op == "status":
            return arbiter.status()
        if op == "attach":
            if peer.run is not None:
                raise ValueError("this connection has attached a run already")
            attaching = str(m["run"])
            peer.run = attaching
            arbiter.attach(
                attaching,
                pid=peer.pid or int(m.get("pid", 0)),  # the kernel's word, not the message's
                user=user_name(peer.uid) if peer.uid >= 0 else str(m.get("user", "?")),
                label=str(m.get("label", "?")),
                gpus={str(u): int(c) for u, c in m["gpus"].items()},
                sink=functools.partial(self._events, peer),
                held=[
                    Held(
                        h["key"],
                        h["client"],
                        h["worker"],
                        h["test"],
                        request_from_wire(h["request"]),
                        tuple(h["gpus"]),
                        int(h["memory"]),
                        bool(h["exclusive"]),
                    )
                    for h in m.get("held", [])
                ],
                asked=[
                    Asked(
                        a["key"], a["client"], a["worker"], a["test"], request_from_wire(a["request"]), tuple(a["gpus"])
                    )
                    for a in m.get("asked", [])
                ],
                host=_host(m.get("host")),
            )
            return True
        run = peer.run
        if run is None:
            raise ValueError(f"{op!r} before 'attach'")
        if op == "submit":
            return list(
                arbiter.submit(
                    run, m["key"], m["client"], m["worker"], m["test"], request_from_wire(m["request"]), m["gpus"]
                )
            )
        if op == "cancel":
            return arbiter.cancel(run, m["key"])
        if op == "abandon":
            return arbiter.abandon(run, m["key"])
        if op == "release":
            return arbiter.release(run, m["key"], m.get("contexts"))
        if op == "set_contexts":
            return arbiter.set_contexts(run, m["client"], m["contexts"])
        if op == "forget_client":
            return [[k, list(g)] for k, g in arbiter.forget_client(run, m["client"])]
        if op == "exiting":
            return arbiter.exiting(run, m["client"], m["contexts"])
        if op == "exited":
            return arbiter.exited(run, m["client"])
        if op == "room":
            return arbiter.room(m["gpus"])
        raise ValueError(f"unknown op {op!r}")

    def _events(self, peer: Peer, events: list[Event]) -> None:
        self._send(peer, {"ev": [list(e) for e in events]})
