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
    if attack in FILE_ATTACKS:  # issue 30: B owns a directory where A's files are, or A's is world-writable
        return FILE_ATTACKS[attack](*args)
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


# -- attacks on files (issue 30, items 3, 7, 9, 10) ------------------------------------------------


def swap_private(machines: str, victim_uid: str, machine: str) -> Any:
    """As the owner of the machine directory: put a directory of B's own where A's private root
    ``user-<uid>`` is (``trap-<uid>``; A's goes to ``aside-<uid>``), mid-run, mirroring A's
    run's machine ``machine`` (its path below the root):
    a ledger that says its GPUs are full, its lock held, a lock of the arbiter held, a sentinel.
    Prints ``ready`` and holds the locks until killed."""
    import fcntl

    import psutil

    trap = os.path.join(machines, f"trap-{victim_uid}")
    ledger = os.path.join(trap, machine, "sim-ledger")
    os.makedirs(ledger)
    for sentinel in (os.path.join(trap, "b-sentinel"), os.path.join(trap, machine, "b-sentinel")):
        with open(sentinel, "w") as stream:
            stream.write("B's\n")
    me = str(os.getpid())
    full = {"ctime": psutil.Process().create_time(), "ctx": {"0": None, "1": None}, "seq": 2}
    full["allocs"] = {f"{me}:1": [0, 15 * GiB, None], f"{me}:2": [1, 15 * GiB, None]}
    state = {"spec": "sim:2x16GiB", "overhead": 500 * 2**20, "procs": {me: full}, "tags": {}, "users": {}}
    with open(os.path.join(ledger, "ledger.json"), "w") as stream:
        json.dump(state, stream)
    held = []
    for lock in (os.path.join(ledger, "ledger.lock"), os.path.join(trap, machine, "arbiter.lock")):
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        held.append(fd)
    for path, _, files in os.walk(trap):
        os.chmod(path, 0o755)
        for name in files:
            os.chmod(os.path.join(path, name), 0o644)
    mine = os.path.join(machines, f"user-{victim_uid}")
    aside = os.path.join(machines, f"aside-{victim_uid}")
    os.rename(mine, aside)  # the owner of a sticky directory may rename anything in it
    os.symlink(trap, mine)
    print("ready", flush=True)
    time.sleep(3600)


def rename_entry(machines: str, old: str, new: str) -> Any:
    """As the owner of the machine directory: rename A's entry ``old`` to ``new``."""
    os.rename(os.path.join(machines, old), os.path.join(machines, new))
    return "renamed"


def plant_library(cache: str, marker: str) -> Any:
    """In A's world-writable cache: a fake NVML of B's, where A's runs look for theirs, that
    creates ``marker`` when it is loaded (as A, by A's process)."""
    import hashlib
    import subprocess
    import tempfile

    from pytest_gpu.sim import nvml

    fake = nvml._NVML
    source = b"".join(path.read_bytes() for path in fake.sources) + fake.generated.encode()
    key = hashlib.sha256(source + repr((fake.flags(), fake.defines)).encode()).hexdigest()[:16]
    where = os.path.join(cache, "pytest-gpu", fake.kind, key + fake.suffix)
    os.makedirs(where, exist_ok=True)
    path = where
    while path != cache:  # open to all, as a careless shared cache is
        os.chmod(path, 0o777)
        path = os.path.dirname(path)
    code = (
        "#include <fcntl.h>\n#include <unistd.h>\n"
        "__attribute__((constructor)) static void planted(void) {"
        f' int fd = open("{marker}", O_WRONLY | O_CREAT, 0644); if (fd >= 0) close(fd); }}\n'
    )
    with tempfile.TemporaryDirectory() as scratch:
        c = os.path.join(scratch, "planted.c")
        with open(c, "w") as stream:
            stream.write(code)
        library = os.path.join(where, fake.library)
        command = ["cc", "-shared", "-fPIC", f"-Wl,-soname,{fake.library}", "-o", library, c]
        subprocess.run(command, check=True, capture_output=True)
    os.chmod(library, 0o777)
    return library


def plant_link(where: str, target: str) -> Any:
    """A symbolic link of B's at ``where`` (a shared directory) to ``target`` (A's file)."""
    os.symlink(target, where)
    return "planted"


FILE_ATTACKS = {
    "swap_private": swap_private,
    "rename": rename_entry,
    "plant_library": plant_library,
    "plant_link": plant_link,
}


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:])), flush=True)
