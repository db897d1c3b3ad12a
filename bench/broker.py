"""Benchmark the lease broker: grants per second and grant latency.

One :class:`pytest_gpu.leasing.broker.Broker` runs in this process, listening on a Unix socket
in a private temporary directory, exactly as in a pytest run. Each client is a separate
process (``multiprocessing`` spawn) holding one :class:`pytest_gpu.leasing.client.BrokerClient`
connection, as an xdist worker does. A client loops over

    acquire(request)  ->  granted      (timed: the grant latency)
    release(key)

for a fixed window; the clients start together and stop together. Throughput is the
number of grants completed in the window over its length.

Scenarios:

- ``immediate``: 256 MiB on one of 8 GPUs of 16 GiB — there is always room, so every
  grant is answered by the ``acquire`` reply itself (broker cost only);
- ``contended``: whole GPUs (``exclusive=True``) on 4 GPUs of 16 GiB — up to 4 leases at
  once, so most requests queue and are granted by a push when another client releases
  (latency then includes the wait for a free GPU).

Machine-wide leasing (``--link``): ``private`` is a broker whose GPUs are its own (the
arbiter in-process, no machine directory); ``machine`` is a run alone on its machine: it
takes the machine's lock and is the arbiter in-process, as every run now is when alone;
``follower`` is a run that shares the machine with another run, which is the arbiter: each
decision is a round trip to that other process. ``--link all`` measures the three in
turn, row by row.

``--attack`` measures each row also beside stalled connections on the sockets, and beside
32 keyless clients (processes of this user without the key) that each hold handshakes on
the broker's socket and reconnect as soon as they are dropped; it prints each attacked row
against the row alone: a run (start-up, then the row's work), grants/s, start-up ("start
s": from the clients' start to every one connected and warmed up; "conn ms": the slowest
client's connection).

Run from the repository root::

    python bench/broker.py            # 3 s per scenario and client count
    python bench/broker.py --link all --scenario immediate --clients 1,8,32
    python bench/broker.py --quick    # smoke run (a fraction of a second each)
    python bench/broker.py --profile  # also print where the broker's threads spend time
    python bench/broker.py --attack --scenario immediate --clients 1,8,32 --duration 2 --repeat 3
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import itertools
import json
import multiprocessing as mp
import os
import platform
import pstats
import secrets
import selectors
import socket
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from pytest_gpu.base.requests import GpuRequest, format_size
from pytest_gpu.leasing.broker import Broker
from pytest_gpu.leasing.client import BrokerClient
from pytest_gpu.leasing.protocol import BROKER, MAX_FRAME
from pytest_gpu.machine.domain import ROOT_ENV, Domain
from pytest_gpu.machine.link import MachineLink
from pytest_gpu.machine.placement import Policy
from pytest_gpu.wire.server import Bounds, KeyAuth, Peer, Server

GIB = 2**30
WARMUP_CYCLES = 20
TARGET_GRANTS_PER_S = 5000
TARGET_P99_MS = 5.0
KEYLESS_CLIENTS = 32  # --attack: keyless same-user processes on the broker's socket
KEYLESS_EACH = 4  # handshakes each of them holds open


@dataclass(frozen=True)
class Scenario:
    name: str
    gpus: int
    capacity: int
    request: GpuRequest

    def describe(self) -> str:
        return f"{self.request.describe()} on {self.gpus}x{format_size(self.capacity)}"


SCENARIOS = {
    "immediate": Scenario("immediate", 8, 16 * GIB, GpuRequest(count=1, memory=256 * 2**20, exclusive=False)),
    "contended": Scenario("contended", 4, 16 * GIB, GpuRequest(count=1, memory=None, exclusive=True)),
}


@dataclass
class Result:
    scenario: str
    clients: int
    duration: float
    grants: int
    queued: int
    latencies: list[float]  # seconds, acquire -> granted
    startup: float = 0.0  # seconds from the clients' start to the last one connected and warmed up
    connects: list[float] = field(default_factory=list)  # seconds each client took to connect

    @property
    def rate(self) -> float:
        return self.grants / self.duration if self.duration else 0.0

    def percentile(self, q: float) -> float:
        if not self.latencies:
            return float("nan")
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- the client processes ------------------------------------------------------------------


def client_main(
    address: str,
    authkey: bytes,
    name: str,
    request: GpuRequest,
    ready: Any,
    go: Any,
    window: Any,
    results: Any,
    interval: float = 0.0,
    phase: float = 0.0,
    connect: Any = None,
) -> None:
    """One client process: connect and warm up, wait for the start, cycle acquire/release
    until the end.

    It connects once ``connect`` is set (all clients spawned, so the time from there to the
    last client warmed up is the row's start-up: every client's connection and first leases,
    as at the start of a pytest run) and reports how long its own connection took.

    ``interval`` > 0 paces the client (open loop): cycle ``k`` starts at
    ``start + (k + phase) * interval`` (at once if it is late), so the offered load does not
    depend on the broker's speed; the clients' phases are spread so they do not fire together.
    """
    ready.put(name)  # spawned and imported
    if connect is not None:
        connect.wait()
    t0 = time.perf_counter()
    client = BrokerClient(address, authkey, name)
    connected = time.perf_counter() - t0
    try:
        for _ in range(WARMUP_CYCLES):
            grant = client.acquire(request, f"{name}::warmup", None)
            client.release(grant.key)
        ready.put(name)
        go.wait()
        start, end = window[0], window[1]
        while time.monotonic() < start:
            time.sleep(0.0005)
        latencies: list[float] = []
        queued = 0
        clock = time.perf_counter
        cycle = 0
        while time.monotonic() < end:
            if interval:
                due = start + (cycle + phase) * interval
                cycle += 1
                now = time.monotonic()
                if due > now:
                    time.sleep(due - now)
                if time.monotonic() >= end:
                    break
            t0 = clock()
            grant = client.acquire(request, f"{name}::bench", None)
            t1 = clock()
            client.release(grant.key)
            latencies.append(t1 - t0)
            if grant.waited > 0:  # granted by a push after queueing, not by the reply
                queued += 1
        results.put((name, latencies, queued, connected))
    finally:
        client.close()


# -- the broker side -------------------------------------------------------------------------


class ThreadProfiles:
    """cProfile for the broker's per-client threads (cProfile only sees its own thread)."""

    def __init__(self) -> None:
        self.profiles: list[cProfile.Profile] = []

    def wrap(self, serve: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(serve)
        def profiled(*args: Any, **kwargs: Any) -> None:
            profile = cProfile.Profile()
            self.profiles.append(profile)
            profile.enable()
            try:
                serve(*args, **kwargs)
            finally:
                profile.disable()

        return profiled

    def print(self, limit: int = 25) -> None:
        if not self.profiles:
            return
        stats = pstats.Stats(self.profiles[0])
        for profile in self.profiles[1:]:
            stats.add(profile)
        stats.strip_dirs().sort_stats("tottime").print_stats(limit)


class EchoServer(Server):
    """Baseline: the broker's transport (the one wire: its server loop, the key, the
    schemas) with a trivial handler: every acquire granted at once. The gap between this
    and the real broker is the broker's own logic."""

    protocol = BROKER
    thread_prefix = "pytest-gpu-echo"

    def __init__(self, address: str, authkey: bytes) -> None:
        super().__init__(address, KeyAuth(authkey), Bounds(max_request=MAX_FRAME, max_brackets=None))
        self.ids = itertools.count()

    def on_hello(self, peer: Peer, m: dict[str, Any]) -> dict[str, str]:
        return {"client": f"e{next(self.ids)}"}

    def on_acquire(self, peer: Peer, m: dict[str, Any]) -> tuple[str, Any]:
        return ("granted", {"key": m["key"], "indices": [0], "memory": 1, "exclusive": False, "waited": 0.0})

    def on_message(self, kind: str, peer: Peer, body: Any) -> None:
        return None  # release is one-way, as in the broker


SERVERS = ("broker", "echo")
LINKS = ("private", "machine", "follower")


def run_scenario(
    scenario: Scenario,
    clients: int,
    duration: float,
    profiles: ThreadProfiles | None = None,
    server: str = "broker",
    offered: float = 0.0,
    link: str = "private",
    attack: str = "",
    keyless_each: int = KEYLESS_EACH,
) -> Result:
    """One measurement: a fresh server, ``clients`` client processes, a ``duration`` window.

    ``offered`` > 0 paces the clients to that many grants per second in total. ``attack``:
    ``"stalled"``, connections that stall on the sockets (:func:`_attack`); ``"keyless"``,
    :data:`KEYLESS_CLIENTS` keyless processes holding ``keyless_each`` handshakes each on the
    broker's socket, reconnecting whenever they are dropped (:func:`_keyless_main`);
    ``"hostile"``, a process sending the arbiter bad messages as fast as it can (:func:`_hostile_main`);
    ``"busy"``, a process that burns as much CPU without sending anything (:func:`_busy_main`).
    """
    ctx = mp.get_context("spawn")
    interval = clients / offered if offered else 0.0
    ready, results = ctx.Queue(), ctx.Queue()
    go, connect = ctx.Event(), ctx.Event()
    with tempfile.TemporaryDirectory(prefix="pytest-gpu-bench-") as tmp:
        os.chmod(tmp, 0o700)
        address = str(Path(tmp) / "broker.sock")
        authkey = secrets.token_bytes(32)
        service: Broker | EchoServer
        other: MachineLink | None = None
        if server == "broker":
            capacities = {i: scenario.capacity for i in range(scenario.gpus)}
            uuids = {i: f"GPU-bench-{i}" for i in capacities}
            machine = None
            if link != "private":
                os.environ[ROOT_ENV] = str(Path(tmp) / "machines")
                domain = Domain.machine_wide("bench")
                if link == "follower":  # another run is the arbiter, in another process
                    other = ctx.Process(target=_arbiter_main, args=(str(Path(tmp) / "machines"), ready), daemon=True)
                    other.start()
                    ready.get(timeout=120)
                machine = MachineLink(domain, Policy())
            broker = Broker(capacities, address, authkey, Policy(), link=machine, uuids=uuids)
            if profiles is not None:
                broker._serve_loop = profiles.wrap(broker._serve_loop)  # type: ignore[method-assign]
            service = broker.start()
        else:
            service = EchoServer(address, authkey).start()
        attackers: list[socket.socket] = []
        keyless: mp.process.BaseProcess | None = None
        if attack == "busy":  # the same stranger's CPU use without a message: what the machine's load costs
            keyless = ctx.Process(target=_busy_main, args=(ready,), daemon=True)
            keyless.start()
            ready.get(timeout=120)
        elif attack == "hostile":  # a stranger at the machine's arbiter: bad messages, as fast as it can
            broker._machine()  # joined: the arbiter's socket exists
            keyless = ctx.Process(
                target=_hostile_main, args=(Domain.machine_wide("bench").address(), ready), daemon=True
            )
            keyless.start()
            ready.get(timeout=120)
        elif attack == "keyless":
            keyless = ctx.Process(
                target=_keyless_main, args=(address, KEYLESS_CLIENTS, keyless_each, ready), daemon=True
            )
            keyless.start()
            ready.get(timeout=120)  # every keyless client has its connections in
        elif attack:
            if server == "broker" and link != "private":
                broker._machine()  # joined: the arbiter's socket exists (a run attaches at its first lease)
                attackers = _attack(address, Domain.machine_wide("bench").address())
            else:
                attackers = _attack(address)
        window = ctx.Array("d", 2, lock=False)
        procs = [
            ctx.Process(
                target=client_main,
                args=(
                    address,
                    authkey,
                    f"c{i}",
                    scenario.request,
                    ready,
                    go,
                    window,
                    results,
                    interval,
                    i / clients,
                    connect,
                ),
                daemon=True,
            )
            for i in range(clients)
        ]
        try:
            for proc in procs:
                proc.start()
            for _ in procs:
                ready.get(timeout=120)  # spawned
            began = time.monotonic()
            connect.set()
            for _ in procs:
                ready.get(timeout=120)  # connected and warmed up
            startup = time.monotonic() - began
            start = time.monotonic() + 0.05
            window[0], window[1] = start, start + duration
            go.set()
            collected = [results.get(timeout=duration + 120) for _ in procs]
            for proc in procs:
                proc.join(timeout=30)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
            service.close()
            for sock in attackers:
                sock.close()
            if keyless is not None:
                keyless.kill()  # its clients see it gone and exit
                keyless.join()
            if other is not None and other.is_alive():
                other.kill()
                other.join()
    latencies = [x for _, lat, _, _ in collected for x in lat]
    queued = sum(q for _, _, q, _ in collected)
    label = scenario.name if server == "broker" else server
    if server == "broker" and link != "private":
        label += f" ({link})"
    if attack == "stalled":
        label += " attacked"
    elif attack:
        label += f" {attack}"
    if offered:
        label += f" @{offered:g}/s"
    return Result(label, clients, duration, len(latencies), queued, latencies, startup, [c for *_, c in collected])


ATTACKERS = 16  # of each kind


def _attack(*addresses: str | None) -> list[socket.socket]:
    """Local processes that connect and then stall: silent ones, and ones that stop half-way
    through the first frame (the broker's key challenge; the arbiter's length prefix)."""
    socks = []
    for address in addresses:
        if address is None:
            continue
        for i in range(2 * ATTACKERS):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(address)
            if i % 2:
                sock.sendall(b"\x00\x00")  # half a length prefix, then nothing
            socks.append(sock)
    return socks


HOSTILE_FRAMES = (
    b"[" * 200_000,  # nesting no parser may follow
    json.dumps({"op": "attach", "id": 1, "run": f"{os.getuid()}.x", "label": "x" * 700_000, "gpus": {}}).encode(),
    b'{"op":"submit","id":2,"key":"k","client":"c","request":[1,NaN,false,null],"gpus":["GPU-bench-0"]}',
    json.dumps({"op": "attach", "id": 3, "run": "0.not-mine", "gpus": {"GPU-bench-0": -1}}).encode(),
    json.dumps({"op": "no such op", "id": 4}).encode(),
)


def _nobody() -> None:
    """Run as root (CI), the attacker is another user (``nobody``), as the threat is."""
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)


def _busy_main(ready: Any) -> None:
    """A process of another user that only burns one CPU, until killed: :func:`_hostile_main`'s
    load without its messages, so that the two rows tell the machine's load from the arbiter's work."""
    _nobody()
    ready.put("busy")
    while True:
        pass


def _hostile_main(address: str, ready: Any) -> None:
    """A hostile peer of the machine's arbiter, until killed: 16 connections that each hold
    half of a 1 MiB frame, and a loop that connects, sends one of :data:`HOSTILE_FRAMES` (or
    an announced 4 GiB frame), and hangs up, again and again; as another user where it can
    (:func:`_nobody`)."""
    _nobody()
    held = []
    for _ in range(16):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(address)
        sock.sendall(struct.pack(">I", 1 << 20) + b"x" * (1 << 19))
        held.append(sock)
    ready.put("hostile")
    for frame in itertools.cycle([*HOSTILE_FRAMES, None]):
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(1)
                sock.connect(address)
                sock.sendall(b"\xff\xff\xff\xff" if frame is None else struct.pack(">I", len(frame)) + frame)
                sock.recv(4096)
        except OSError:
            time.sleep(0.001)


def _keyless_main(address: str, clients: int, each: int, ready: Any) -> None:
    """Keyless same-user clients: ``clients`` processes, forked from this one, each holding
    ``each`` connections to the broker's socket in the middle of their handshake (the key's
    challenge read, never answered) and connecting again as soon as the broker drops one,
    so that they hold every handshake the broker lets them. Puts ``"keyless"`` on ``ready``
    once all their connections are in; they exit when this process is gone."""
    parent = os.getpid()
    r, w = os.pipe()
    for _ in range(clients):
        if os.fork() == 0:  # no threads here yet: the queue's feeder starts at the put below
            try:
                os.close(r)
                _keyless_client(address, each, w, parent)
            finally:
                os._exit(0)
    os.close(w)
    told = 0
    while told < clients:  # a byte from each client once its connections are in
        got = os.read(r, clients)
        if not got:
            raise RuntimeError("the keyless clients died")
        told += len(got)
    ready.put("keyless")
    while True:
        time.sleep(3600)


def _keyless_client(address: str, each: int, ready_fd: int, parent: int) -> None:
    selector = selectors.DefaultSelector()
    owed = each  # connections to (re)make
    told = False
    while os.getppid() == parent:
        while owed:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                sock.connect(address)
            except OSError:  # the backlog is full (EAGAIN), or the broker is gone: again in a moment
                sock.close()
                break
            selector.register(sock, selectors.EVENT_READ)
            owed -= 1
        if not owed and not told:
            os.write(ready_fd, b"x")
            told = True
        for key, _ in selector.select(0.001 if owed else 0.1):
            sock = cast(socket.socket, key.fileobj)
            try:
                data = sock.recv(4096)  # the challenge: read, never answered
            except OSError:
                data = b""
            if not data:  # dropped: straight back in
                selector.unregister(sock)
                sock.close()
                owed += 1


def _arbiter_main(root: str, ready: Any) -> None:
    """Another run on the same machine: it attaches first, so it is the arbiter; it asks for nothing."""
    os.environ[ROOT_ENV] = root
    link = MachineLink(Domain.machine_wide("bench"), Policy())
    link.attach({f"GPU-bench-{i}": 16 * GIB for i in range(8)}, lambda events: None)
    ready.put("arbiter")
    time.sleep(3600)


# -- output ------------------------------------------------------------------------------


def table(results: Sequence[Result]) -> str:
    head = ("scenario", "clients", "grants", "grants/s", "p50 ms", "p99 ms", "max ms", "queued", "start s", "conn ms")
    rows = [head]
    for r in results:
        rows.append(
            (
                r.scenario,
                str(r.clients),
                str(r.grants),
                f"{r.rate:,.0f}",
                f"{r.percentile(0.50) * 1e3:.3f}",
                f"{r.percentile(0.99) * 1e3:.3f}",
                f"{max(r.latencies, default=float('nan')) * 1e3:.3f}",
                f"{100 * r.queued / r.grants if r.grants else 0:.0f}%",
                f"{r.startup:.2f}",
                f"{max(r.connects, default=float('nan')) * 1e3:.1f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [
        "  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def ratios(rows: Sequence[Row], runs: dict[Row, list[Result]]) -> str:
    """Each attacked row against the same row alone, medians, attacked over alone: a run
    (start-up, then the work the row did alone in its window, at the row's grant rate),
    grants/s, and start-up (every client connected and warmed up)."""
    lines = ["attacked / alone (medians; run = start-up + the grants made alone, at this rate):"]
    for row in rows:
        if not row.attack:
            continue
        alone = runs[Row(row.scenario, row.clients, row.server, row.offered, row.link, "")]
        hit = runs[row]
        rate_alone, rate_hit = (statistics.median([r.rate for r in rs]) for rs in (alone, hit))
        up_alone, up_hit = (statistics.median([r.startup for r in rs]) for rs in (alone, hit))
        work = statistics.median([r.grants for r in alone])
        run_alone, run_hit = up_alone + work / rate_alone, up_hit + work / rate_hit
        lines.append(
            f"  {hit[0].scenario} x{row.clients}: run x{run_hit / run_alone:.2f} ({run_alone:.2f} s -> "
            f"{run_hit:.2f} s), grants/s x{rate_hit / rate_alone:.2f}, start-up {up_alone:.2f} s -> {up_hit:.2f} s "
            f"(slowest connection {max(c for r in alone for c in r.connects) * 1e3:.0f} ms -> "
            f"{max(c for r in hit for c in r.connects) * 1e3:.0f} ms)"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class Row:
    scenario: str
    clients: int
    server: str = "broker"
    offered: float = 0.0  # grants/s offered in total; 0: closed loop (as fast as it goes)
    link: str = "private"
    attack: str = ""  # "", "stalled", "keyless", "busy" or "hostile" (see run_scenario)


def plan(args: argparse.Namespace) -> list[Row]:
    if args.clients:
        counts = [int(c) for c in args.clients.split(",")]
        names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
        rows = [Row(name, n) for name in names for n in counts]
    elif args.quick:
        rows = [Row("immediate", 1), Row("immediate", 4), Row("contended", 8)]
    else:
        rows = [
            Row("immediate", 1),
            Row("immediate", 8),
            Row("immediate", 32),
            Row("immediate", 32, offered=1000.0),
            Row("contended", 8),
            Row("contended", 32),
        ]
        if args.scenario != "all":
            rows = [row for row in rows if row.scenario == args.scenario]
    links = LINKS if args.link == "all" else (args.link,)
    rows = [Row(r.scenario, r.clients, r.server, r.offered, link) for r in rows for link in links]
    if args.attack:  # each row in a row: as is, with stalled connections, keyless clients, a hostile peer
        rows = [
            Row(r.scenario, r.clients, r.server, r.offered, r.link, attacked)
            for r in rows
            for attacked in ("", "stalled", "keyless", "busy", "hostile")
            if attacked not in ("busy", "hostile") or r.link != "private"  # the arbiter's attacker: where there is one
        ]
    if args.baseline:
        counts = sorted({row.clients for row in rows})
        rows += [Row("immediate", n, server) for server in SERVERS[1:] for n in counts]
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: short windows, few clients")
    parser.add_argument("--duration", type=float, default=None, help="seconds per measurement (default 3, quick 0.3)")
    parser.add_argument("--repeat", type=int, default=1, help="measure each row N times, show the median run")
    parser.add_argument("--clients", default=None, help="comma-separated client counts (default: 1,8,32)")
    parser.add_argument(
        "--scenario", choices=[*SCENARIOS, "all"], default="all", help="which scenario to run (default all)"
    )
    parser.add_argument("--profile", action="store_true", help="cProfile the broker threads, print the top functions")
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="also time the bare transport: an echo server that grants at once (the wire alone)",
    )
    parser.add_argument(
        "--link",
        choices=[*LINKS, "all"],
        default="private",
        help="the broker's GPUs its own, a run alone on the machine (arbiter), or a run beside another (follower)",
    )
    parser.add_argument(
        "--attack",
        action="store_true",
        help=f"measure each row also with {ATTACKERS} silent and {ATTACKERS} half-frame connections on the sockets, "
        f"and beside {KEYLESS_CLIENTS} keyless clients that hold handshakes on the broker's socket and reconnect",
    )
    parser.add_argument(
        "--keyless-each",
        type=int,
        default=KEYLESS_EACH,
        help=f"handshakes each keyless client holds open (default {KEYLESS_EACH})",
    )
    args = parser.parse_args(argv)

    duration = args.duration if args.duration is not None else (0.3 if args.quick else 3.0)
    rows = plan(args)
    profiles = ThreadProfiles() if args.profile else None

    print(
        f"pytest-gpu broker benchmark · Python {platform.python_version()} · {os.cpu_count()} CPUs · "
        f"{duration:g}s per row{f', median of {args.repeat}' if args.repeat > 1 else ''} · one process per client"
    )
    for name, scenario in SCENARIOS.items():
        print(f"  {name}: {scenario.describe()}")
    runs: dict[Row, list[Result]] = {row: [] for row in rows}
    for _ in range(max(1, args.repeat)):  # round by round, so that drift on the machine hits every row alike
        for row in rows:
            result = run_scenario(
                SCENARIOS[row.scenario],
                row.clients,
                duration,
                profiles,
                row.server,
                row.offered,
                row.link,
                row.attack,
                args.keyless_each,
            )
            runs[row].append(result)
            print(
                f"  ... {result.scenario} x{row.clients}: {result.rate:,.0f} grants/s, start-up {result.startup:.2f} s",
                file=sys.stderr,
                flush=True,
            )
    results = [sorted(runs[row], key=lambda r: r.rate)[len(runs[row]) // 2] for row in rows]
    print()
    print(table(results))
    print()
    if args.attack:
        print(ratios(rows, runs))
        print()
    for r in results:
        if r.scenario == "immediate" and r.clients == 32:
            p99 = r.percentile(0.99) * 1e3
            ok = r.rate >= TARGET_GRANTS_PER_S and p99 < TARGET_P99_MS
            print(
                f"target (immediate, 32 clients): >= {TARGET_GRANTS_PER_S:,} grants/s and p99 < {TARGET_P99_MS:g} ms: "
                f"{'met' if ok else 'NOT met'} ({r.rate:,.0f} grants/s, p99 {p99:.2f} ms)"
            )
    if profiles is not None:
        print("\nbroker threads, by own time:")
        profiles.print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
