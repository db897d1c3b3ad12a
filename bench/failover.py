"""The machine's arbiter handed over, hundreds of times, under CPU load: simulated OOMs.

Three runs (``--runs``) share one simulated ``sim:2x16GiB`` machine through the real
machine link (:class:`pytest_gpu.machine.link.MachineLink`: the election, the arbiter's
socket, the re-attach with the mirror, the foreign sampler over the fake NVML) and the real
simulated ledger (an allocation the arbiter should not have granted is an
``OutOfMemoryError``). Each run is one process with two clients, as a ``pytest -n 0`` run's
own process and an xdist worker: client ``c0`` in the run's process on GPU 0, client ``c1``
in a forked worker process on GPU 1. Each client leases, over and over, a test's share
sized so that exactly two leases fit on a GPU beside the contexts of the three runs'
processes there (two leases and one context more would not fit): one context the arbiter
does not count is an OOM.

A hand-over: the run whose process is the arbiter leaves as a pytest run ends (its worker
is told to exit, the link says it is ``exiting``, the link closes), and its processes
linger a random ``0..--linger-ms`` with their contexts open, as an exiting interpreter
does; the other runs elect a new arbiter and re-attach. A new run, to keep three,
attaches a random ``0..--join-ms`` after the arbiter's run has left: as the others elect,
so that it may win the election itself (runs start at any time; this is the moment that
matters). A run that its arbiter refused (it then coordinates with no one and would make
every later test fail) is replaced at once. The next hand-over starts once every run has finished a test on both its
clients since the last.

CPU load (``--load``, default one per CPU): busy-loop processes, so that the runs' threads
are descheduled at the worst moments, as under a full test suite.

    python bench/failover.py                      # 300 hand-overs, one busy loop per CPU
    python bench/failover.py --handovers 600 --load 4
    python bench/failover.py --quick              # 20 hand-overs
    python bench/failover.py --src /path/to/other/checkout/src   # the same against another tree

Prints: hand-overs, how many were followed by a failure (a simulated OOM, another error,
or a run refused and left alone, before the next hand-over), tests run, simulated OOMs (and
the first few messages), other errors, runs left alone, the load average (1 min) at the
start, mean and end, and the wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import random
import signal
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any


def _source() -> str:
    """``--src DIR``: the package to measure (default: this checkout's), read before the imports."""
    if "--src" in sys.argv:
        return os.path.abspath(sys.argv[sys.argv.index("--src") + 1])
    return str(Path(__file__).resolve().parents[1] / "src")


sys.path.insert(0, _source())

from pytest_gpu.base.requests import GpuRequest, format_size  # noqa: E402
from pytest_gpu.machine.domain import ROOT_ENV, SIM_MACHINE_ENV, Domain  # noqa: E402
from pytest_gpu.machine.link import MachineLink  # noqa: E402
from pytest_gpu.machine.placement import Policy  # noqa: E402
from pytest_gpu.machine.remote import MachineError  # noqa: E402
from pytest_gpu.run.session import ForeignSource  # noqa: E402
from pytest_gpu.sim import fake  # noqa: E402
from pytest_gpu.sim.ledger import OutOfMemoryError, ledger  # noqa: E402
from pytest_gpu.sim.spec import parse  # noqa: E402

SPEC = "sim:2x16GiB"
CONTEXT = 500 * 2**20
TESTS, OOMS, ERRORS, ALONE = 0, 1, 2, 3


def _alloc(unit: int, nbytes: int, hold: float) -> str:
    """A test's body: allocate its lease on ``unit``, hold it, free it; "" or the OOM."""
    try:
        handle = ledger().allocate(nbytes, unit, None, None)
    except OutOfMemoryError as exc:
        return str(exc)
    time.sleep(hold)
    ledger().free(handle)
    return ""


def _worker(conn: Connection) -> None:
    """An xdist worker's process: runs test bodies until told to exit, then lingers."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # its run is gone
            os._exit(0)
        if msg[0] == "quit":
            conn.send("bye")
            time.sleep(msg[1])  # the interpreter exiting: its context is still open
            os._exit(0)
        answer = _alloc(*msg[1:])
        try:
            conn.send(answer)
        except OSError:
            os._exit(0)


class Run:
    """One run's process: a machine link and two clients (see the module doc)."""

    def __init__(
        self, name: str, args: argparse.Namespace, gpus: dict[str, int], share: int, stats: Any, control: Connection
    ) -> None:
        self.name, self.args, self.share, self.stats = name, args, share, stats
        self.uuids = list(gpus)
        self.gpus = gpus
        self.stop = threading.Event()
        self.alone = False
        self.done = {"c0": 0, "c1": 0}
        self.granted: dict[str, threading.Event] = {}
        self.answers: dict[str, tuple[str, Any]] = {}
        self.lock = threading.Lock()
        mine, theirs = multiprocessing.Pipe()
        pid = os.fork()  # before any thread of this process: the worker is a plain copy
        if pid == 0:
            mine.close()
            _worker(theirs)
        theirs.close()
        self.worker, self.worker_pid = mine, pid
        self.link = MachineLink(
            Domain.sim(SPEC), Policy(overhead=CONTEXT, fixed=True), label=name, foreign=ForeignSource()
        )
        if control.recv() == "go":  # a run started as the arbiter's leaves: it attaches as the election begins
            time.sleep(random.uniform(0, args.join_ms / 1000))
        self.link.attach(gpus, self._sink)

    def _sink(self, events: list[tuple[str, str, dict[str, Any]]]) -> None:
        with self.lock:
            for kind, key, body in events:
                self.answers[key] = (kind, body)
                if key in self.granted:
                    self.granted[key].set()

    def _count(self, what: int, message: str = "") -> None:
        with self.stats.get_lock():
            self.stats[what] += 1
        if message:
            with open(self.args.log, "a") as out:
                out.write(f"{self.name}: {message}\n")

    def client(self, client: str, unit: int) -> None:
        n = 0
        request = GpuRequest(memory=self.share, exclusive=False)
        while not self.stop.is_set():
            n += 1
            key = f"{client}/k{n}"
            with self.lock:
                self.granted[key] = threading.Event()
            try:
                kind, value = self.link.submit(key, client, f"gw{unit}", f"t::{key}", request, [self.uuids[unit]])
                while kind == "queued":
                    if self.granted[key].wait(0.05):
                        with self.lock:
                            kind, value = self.answers.pop(key)
                    elif self.stop.is_set():
                        self.link.abandon(key)
                        return
                if kind != "granted":
                    self._count(ERRORS, f"{key}: {kind} {value}")
                    return
                if unit == 0:
                    oom = _alloc(0, self.share, self.args.hold_ms / 1000)
                else:
                    self.worker.send(("alloc", 1, self.share, self.args.hold_ms / 1000))
                    oom = self.worker.recv()
                self._count(TESTS)
                if oom:
                    self._count(OOMS, oom)
                self.link.release(key, [self.uuids[unit]])
                self.done[client] += 1
            except MachineError as exc:
                self._count(ERRORS, f"{key}: {exc}")
                return
            finally:
                with self.lock:
                    self.granted.pop(key, None)

    def serve(self, control: Connection) -> None:
        threads = [threading.Thread(target=self.client, args=(c, u), daemon=True) for c, u in (("c0", 0), ("c1", 1))]
        for t in threads:
            t.start()
        while True:
            msg = control.recv()
            if msg == "state":
                if self.link.domain is None and not self.alone:  # its arbiter refused it: it coordinates with no one
                    self.alone = True
                    self._count(ALONE, "left the machine's coordination (see the warning above)")
                control.send((self.link.is_arbiter and not self.alone, min(self.done.values()), self.alone))
            elif msg == "leave":
                self.stop.set()
                for t in threads:
                    t.join()
                linger = random.uniform(0, self.args.linger_ms / 1000)
                self.worker.send(("quit", linger))
                self.worker.recv()
                self.link.exiting("c1", [self.uuids[1]])  # its broker saw the worker's connection close
                self.link.close()  # the run ends; its process, and its context on GPU 0, linger
                control.send("left")
                time.sleep(linger)
                os._exit(0)


def start_run(
    name: str, args: argparse.Namespace, gpus: dict[str, int], share: int, stats: Any
) -> tuple[int, Connection]:
    mine, theirs = multiprocessing.Pipe()
    pid = os.fork()
    if pid == 0:
        mine.close()
        random.seed(f"{args.seed}-{name}")
        try:
            Run(name, args, gpus, share, stats, theirs).serve(theirs)
        except BaseException as exc:  # a run's crash is a figure, not the bench's crash
            with open(args.log, "a") as out:
                out.write(f"{name}: crashed: {exc!r}\n")
        os._exit(1)
    theirs.close()
    return pid, mine


def busy_loop() -> None:
    while True:
        pass


def reap() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--handovers", type=int, default=300)
    parser.add_argument("--load", type=int, default=os.cpu_count() or 1, help="busy loops (default: one per CPU)")
    parser.add_argument("--runs", type=int, default=3, help="runs sharing the machine (each holds a context per GPU)")
    parser.add_argument("--hold-ms", type=float, default=20.0, help="how long a test holds its memory")
    parser.add_argument("--linger-ms", type=float, default=60.0, help="how long a leaving run's processes live on")
    parser.add_argument(
        "--join-ms", type=float, default=10.0, help="a new run attaches this long (at most) after the arbiter's left"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="20 hand-overs")
    parser.add_argument("--src", default=_source(), help="the package's source tree to measure (another checkout's)")
    args = parser.parse_args()
    if args.quick:
        args.handovers = 20

    work = Path(tempfile.mkdtemp(prefix="failover-bench-"))
    args.log = str(work / "events.log")
    os.environ[ROOT_ENV] = str(work / "machines")
    os.environ[SIM_MACHINE_ENV] = f"failover-{os.getpid()}"
    for name in ("PYTEST_GPU_SIM_RUN", "PYTEST_GPU_SIM_GROUP", "PYTEST_GPU_SIM_LEDGER"):
        os.environ.pop(name, None)
    fake.activate(SPEC)
    devices = parse(SPEC).devices()[0]
    gpus = {d.uuid: d.capacity for d in devices}
    capacity = min(gpus.values())
    # two leases fit beside one context per run and half a context to spare; one context more does not
    share = (capacity - args.runs * CONTEXT - CONTEXT // 2) // 2
    stats = multiprocessing.Array("q", 4)

    load = []
    for _ in range(args.load):
        pid = os.fork()
        if pid == 0:
            busy_loop()
        load.append(pid)
    loads = [os.getloadavg()[0]]
    started = time.monotonic()
    runs: list[tuple[int, Connection]] = []
    handovers, born, stalled, bad = 0, 0, 0, 0

    def failures() -> int:
        return int(stats[OOMS] + stats[ERRORS] + stats[ALONE])

    try:
        for _ in range(args.runs):
            runs.append(start_run(f"run{born}", args, gpus, share, stats))
            runs[-1][1].send("now")
            born += 1
        seen = failures()
        while handovers < args.handovers:
            deadline = time.monotonic() + 60
            while True:  # every run has run a test on both clients since the last hand-over, and one is the arbiter
                states = []
                for _, conn in runs:
                    conn.send("state")
                    states.append(conn.recv() if conn.poll(30) else (False, -1, False))
                alone = [i for i, (_, _, lone) in enumerate(states) if lone]
                for i in reversed(alone):  # it would make the others' tests fail from now on: replaced
                    runs.pop(i)[1].send("leave")
                    runs.append(start_run(f"run{born}", args, gpus, share, stats))
                    runs[-1][1].send("now")
                    born += 1
                if alone:
                    continue
                arbiters = [i for i, (arb, _, _) in enumerate(states) if arb]
                if len(arbiters) == 1 and all(done >= 1 for _, done, _ in states):
                    break
                if time.monotonic() > deadline:
                    stalled += 1
                    print(f"stalled: {states}", file=sys.stderr)
                    break
                time.sleep(0.01)
            if failures() > seen:  # in the last hand-over, or the tests after it
                bad += 1
                seen = failures()
            if not arbiters:
                break
            pid, conn = runs.pop(arbiters[0])
            runs.append(start_run(f"run{born}", args, gpus, share, stats))
            born += 1
            conn.send("leave")
            if conn.poll(30):
                conn.recv()
            runs[-1][1].send("go")  # the next run attaches as the others elect a new arbiter
            handovers += 1
            reap()
            if handovers % 25 == 0:
                loads.append(os.getloadavg()[0])
                print(
                    f"  {handovers} hand-overs, {stats[OOMS]} OOMs, {stats[ERRORS]} errors, {stats[ALONE]} alone",
                    file=sys.stderr,
                )
    finally:
        wall = time.monotonic() - started
        loads.append(os.getloadavg()[0])
        for pid in [p for p, _ in runs] + load:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
        reap()
    bad += failures() > seen
    tests, ooms, errors, alone = stats[TESTS], stats[OOMS], stats[ERRORS], stats[ALONE]
    print(
        f"failover: {handovers} hand-overs, {bad} followed by a failure; {tests} tests, {ooms} simulated OOMs, "
        f"{errors} other errors, "
        f"{alone} runs left alone, "
        f"{stalled} stalls; tests of {format_size(share)} on {SPEC}, {args.runs} runs, {args.load} busy loops; "
        f"load average {loads[0]:.1f} at start, {sum(loads) / len(loads):.1f} mean, {loads[-1]:.1f} at end; "
        f"{wall:.0f} s wall"
    )
    log = Path(args.log)
    if log.exists():
        lines = log.read_text().splitlines()
        for line in lines[:5]:
            print(f"  {line}")
        if len(lines) > 5:
            print(f"  ... {len(lines) - 5} more in {log}")
    return 1 if ooms or errors or alone else 0


if __name__ == "__main__":
    sys.exit(main())
