"""A hostile neighbour: another local user's process attacking a run's machine-wide coordination.

Run as the attacking user by tests/security/test_hostile_neighbours.py:
``python neighbour.py ATTACK DOMAIN [ARG ...]``; prints one JSON object (what it saw) and exits,
or, for the attacks that hold something (``squat``, ``flood``), prints ``ready`` and holds it
until killed.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import time
from typing import Any

GiB = 2**30
GPU = os.environ.get("NEIGHBOUR_GPU", "GPU-0")  # a GPU of the machine, as its runs name it


def address(name: str) -> str:
    from pytest_gpu.machine.domain import Domain

    if hasattr(Domain, "machine_wide"):
        return Domain.machine_wide(name).address()
    return Domain.named(name).address()  # type: ignore[attr-defined]  # before machine-wide domains


class Peer:
    def __init__(self, where: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(where)
        self.buffer = b""
        self.rid = 0

    def frame(self, raw: bytes) -> None:
        self.sock.sendall(struct.pack(">I", len(raw)) + raw)

    def send(self, message: dict[str, Any]) -> None:
        self.frame(json.dumps(message).encode())

    def call(self, op: str, **fields: Any) -> Any:
        self.rid += 1
        self.send({"op": op, "id": self.rid, **fields})
        while True:
            while len(self.buffer) >= 4:
                (size,) = struct.unpack(">I", self.buffer[:4])
                if len(self.buffer) < 4 + size:
                    break
                message = json.loads(self.buffer[4 : 4 + size])
                self.buffer = self.buffer[4 + size :]
                if message.get("re") == self.rid:
                    return message
            data = self.sock.recv(65536)
            if not data:
                return {"closed": True}
            self.buffer += data


def attach(peer: Peer, run: str | None = None, **fields: Any) -> Any:
    body = {"run": run or f"{os.getuid()}.neighbour-{os.getpid()}", "label": "n"}
    body["gpus"] = {GPU: 16 * GiB}
    return peer.call("attach", **{**body, **fields})


def main(attack: str, name: str, *args: str) -> Any:
    where = address(name)
    if attack == "status":
        return Peer(where).call("status")
    if attack == "hijack":  # attach as the victim's run, then hang up (the old arbiter detached the victim)
        peer = Peer(where)
        answers = [attach(peer, run=run) for run in args]
        peer.sock.close()
        return answers
    if attack == "impersonate":  # as a run of its own, release and forget what the victim's run holds
        peer = Peer(where)
        answers = [attach(peer)]
        for worker in range(4):
            for n in range(4):
                key = f"c{worker}/gw{worker}-{n}"
                peer.send({"op": "release", "key": key})
                peer.send({"op": "abandon", "key": key})
            answers.append(peer.call("forget_client", client=f"c{worker}"))
        peer.sock.close()
        return answers
    if attack == "overcommit":
        peer = Peer(where)
        answers = [attach(peer)]
        gpu = [GPU]
        for memory in (-16 * GiB, 1 << 60):
            ask = {"key": f"k{memory}", "client": "c", "worker": "w", "test": "t", "gpus": gpu}
            answers.append(peer.call("submit", request=[1, memory, False, None], **ask))
        peer.rid += 1
        peer.frame(b'{"op":"submit","id":%d,"key":"nan","client":"c","worker":"w","test":"t",' % peer.rid)
        return answers
    if attack == "crash":
        for sender in (
            lambda p: p.frame(b"[" * 200_000),
            lambda p: [attach(p, label="x" * 700_000), attach(p, label="y" * 700_000), p.call("status")],
            lambda p: [
                attach(p),
                p.send({"op": "submit", "key": "k", "client": "c", "request": [1, GiB, False, None], "gpus": ["X"]}),
            ],
        ):
            try:
                peer = Peer(where)
                sender(peer)
                peer.sock.close()
            except OSError:
                pass
        return "sent"
    if attack == "plant":  # links where the victim's next run writes (the names the old ledger used)
        directory, target = args
        planted, refused = 0, ""
        start = max(int(p) for p in os.listdir("/proc") if p.isdigit())
        for pid in range(start, start + 3000):
            for name in (f"ledger.json.{pid}.tmp", f"nvml.state.{pid}.tmp"):
                try:
                    os.symlink(target, os.path.join(directory, name))
                    planted += 1
                except OSError as exc:
                    refused = f"{type(exc).__name__}: {exc.strerror}"
        return {"planted": planted, "refused": refused}
    if attack == "squat":  # bind the address before any run does, and never answer
        squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        squatter.bind(where)
        squatter.listen(64)
        print("ready", flush=True)
        time.sleep(3600)
    if attack == "flood":  # unfinished 1 MiB frames and as many connections as it can open
        held = []
        for i in range(int(args[0])):
            try:
                peer = Peer(where)
                if i < 300:
                    peer.sock.sendall(struct.pack(">I", 1 << 20) + b"x" * ((1 << 20) - 1))
                held.append(peer)
            except OSError:
                pass
        print("ready", flush=True)
        time.sleep(3600)
    if attack == "fake":  # bind the address first and answer the protocol, with lies (issue 30, item 2)
        from fake_arbiter import FakeArbiter

        def first_named(m: dict[str, Any]) -> Any:
            _, memory, exclusive = m["request"][:3]
            return ["granted", {"gpus": m["gpus"][:1], "memory": memory or 15 * GiB, "exclusive": exclusive}]

        FakeArbiter(where, answers={"submit": first_named, "take_ports": lambda m: {"ports": [m["range"][0]]}})
        print("ready", flush=True)
        time.sleep(3600)
    found = requests_attack(attack, where, *args)  # issue 30's attacks on what the arbiter accepts
    if found is not None:
        return found
    raise SystemExit(f"unknown attack {attack!r}")


def _hold(said: Any) -> None:
    """Say what was seen, then stay attached until killed."""
    print(json.dumps(said), flush=True)
    time.sleep(3600)


def requests_attack(attack: str, where: str, *args: str) -> Any:
    """Attacks on what the arbiter takes from runs (tests/security/test_hostile_requests.py);
    ``None`` for an attack that is not one of these."""
    gpus = [GPU, os.environ.get("NEIGHBOUR_GPU2", GPU)]
    if attack == "contexts":  # a context as large as each GPU, "measured", and stays attached
        peer = Peer(where)
        answer = attach(peer, gpus={g: 16 * GiB for g in gpus})
        _hold({"attach": answer, "measured": [peer.call("measure_context", uuid=g, bytes=16 * GiB - 1) for g in gpus]})
    if attack == "outsider":  # a user outside the group: attach and take both GPUs whole
        peer = Peer(where)
        answer = attach(peer, gpus={g: 16 * GiB for g in gpus})
        ask = {"client": "c", "worker": "w", "test": "t", "request": [1, None, True, None]}
        return {"attach": answer, "submits": [peer.call("submit", key=f"k{g}", gpus=[g], **ask) for g in gpus]}
    if attack == "contexts-without-leases":  # forty processes with contexts everywhere, no lease
        peer = Peer(where)
        answer = attach(peer, gpus={g: 16 * GiB for g in gpus})
        set_ = [peer.call("set_contexts", client=f"c{n}", contexts=gpus) for n in range(40)]
        _hold({"attach": answer, "set_contexts": set_[-1]})
    if attack == "parts":  # three parts of one GPU as large as it; then one, leased
        parts = {f"{GPU}#part-of-rank-{n}": 15 * GiB for n in range(3)}
        three = attach(Peer(where), run=f"{os.getuid()}.parts-{os.getpid()}", gpus=parts)
        peer = Peer(where)
        one = attach(peer, run=f"{os.getuid()}.part-{os.getpid()}", gpus={f"{GPU}#part-of-rank-0": 15 * GiB})
        ask = {"client": "c", "worker": "w", "test": "t", "request": [1, 3 * GiB, False, None]}
        lease = peer.call("submit", key="k", gpus=[f"{GPU}#part-of-rank-0"], **ask)
        return {"three parts": three, "one part": one, "part lease": lease}
    if attack == "held":  # forty runs that "held" a lease under an earlier arbiter
        peers, answers = [], []
        for n in range(40):
            peer = Peer(where)
            held = {"key": "c/k", "client": "c", "request": [1, 100 << 20, False, None], "gpus": [GPU]}
            run = f"{os.getuid()}.held-{os.getpid()}-{n}"
            answers.append(attach(peer, run=run, held=[{**held, "memory": 100 << 20, "exclusive": False}]))
            peers.append(peer)
        return {"held": answers}
    return None


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:])), flush=True)
