"""A warm pool of rank processes, owned by one pytest process (a worker, or the only one).

A pool is started for a :class:`DistSpec` key, keeps its process group, its
rendezvous port and its GPU lease while it lives, and runs one test after another.
Its launcher (:mod:`.launchers`) starts and kills its processes; it talks to its ranks,
and reads what they write, as :mod:`.protocol` says. Its :class:`~.runner.PoolManager`
tears it down when a test needs another key, when it has been idle for
``--dist-pool-idle`` seconds, at session end, and whenever it can no longer be
trusted: a rank died, a test timed out, or the world failed its health barrier.
"""

from __future__ import annotations

import itertools
import os
import queue
import secrets
import shutil
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import sim
from ..base.distspec import DistSettings, DistSpec, group_timeout
from ..base.spans import LeaseSpan
from ..base.wording import numbered
from ..gpu.isolation import VISIBILITY
from ..gpu.verification import NvmlRankVerifier, SimRankVerifier, Verdict, claim_processes, release_processes
from ..leasing.host import THREAD_VARS
from ..run.holding import Holding, Owner, hold
from ..run.session import GpuRun
from ..vendors import registry as vendors
from ..wire.frames import WireError
from ..wire.schema import blob
from ..wire.server import Bounds, KeyAuth, Peer, Server
from . import cover, protocol
from .launchers import launcher_for
from .protocol import Message

_ids = itertools.count()


class RankServer(Server):
    """The pool's end of its ranks' connections (:data:`.protocol.POOL`): every message
    that arrives, and every connection that closes (``DIED``), is filed in
    :attr:`arrivals` for the pool's own thread, which waits for the ranks' replies."""

    protocol = protocol.POOL
    thread_prefix = "pytest-gpu-pool"

    def __init__(self, address: str, authkey: bytes) -> None:
        # its peers are the pool's own ranks, past the key: no share, no hello deadline
        limit = protocol.MAX_FRAME
        super().__init__(address, KeyAuth(authkey), Bounds(max_request=limit, max_brackets=None, max_answer=limit))
        self.arrivals: queue.Queue[tuple[Peer, str, dict[str, Any]]] = queue.Queue()

    def on_message(self, kind: str, peer: Peer, body: Any) -> None:
        self.arrivals.put((peer, kind, body))

    def unknown(self, peer: Peer, kind: Any, rid: int | None) -> None:
        self.arrivals.put((peer, str(kind)[:40], {}))  # the pool names it: a protocol error

    def invalid(self, peer: Peer, kind: str, rid: int | None, error: WireError) -> None:
        self.arrivals.put((peer, protocol.INVALID, {"kind": kind, "error": str(error)}))

    def disconnected(self, peer: Peer, why: str) -> None:
        self.arrivals.put((peer, protocol.DIED, {}))


class PoolError(RuntimeError):
    """A pool could not be started; the message says why, with the ranks' output."""


class PoolDied(RuntimeError):
    """The pool was found dead before a test could be sent to it."""


@dataclass
class RankRun:
    """What one test did on a pool: per-rank results and what to attach to the report."""

    results: dict[int, dict[str, Any]] = field(default_factory=dict)
    sections: list[tuple[str, str]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # timeouts, crashes, poisoned world
    broken: bool = False  # the pool must not be reused
    seconds: float = 0.0  # wall time of the run on the pool
    # the pool's GPU lease, checked once the test ran (None: the pool holds no GPU)
    checked: tuple[Owner, Verdict, LeaseSpan] | None = None
    # contamination (runner.rerun_alone): how many tests its pool ran before it, the last of
    # them, and whether it ran past its own timeout (not rerun: a rerun would cost it again)
    ran_before: int = 0
    previous: str = ""
    timed_out: bool = False

    @property
    def outcome(self) -> str:
        outcomes = [r["outcome"] for r in self.results.values()]
        if self.problems or "failed" in outcomes:
            return "failed"
        if outcomes and all(o == "xfailed" for o in outcomes):
            return "xfailed"
        if "skipped" in outcomes:
            return "skipped"
        return "passed"


class RankPool:
    """``world_size`` rank processes with a process group, ready to run test bodies."""

    def __init__(
        self, spec: DistSpec, run: GpuRun, settings: DistSettings, base: Path, timeout: float, test: str = ""
    ) -> None:
        self.spec = spec
        self.run = run
        self.settings = settings
        self.covers = max(settings.timeout, timeout)  # the longest test timeout its process group outlasts
        self.id = f"pool{next(_ids)}-{os.getpid()}"  # internal: its directory, its run ids
        self.dir = base / self.id
        # how the broker names what the pool holds (its GPUs, its port): in a crash report or a
        # "held by" list, a person recognises the test that started it, never the pool's id
        self.holder = (
            f"the rank pool of {spec.describe()} started by {test}" if test else f"a rank pool of {spec.describe()}"
        )
        # port owners read "<who>@<unique>" (the broker names a dead worker's tests by what precedes the @)
        self.ports_owner = f"{self.holder}@{self.id}"
        self.conns: dict[int, Peer] = {}  # each rank's control connection (its peer's data: the rank)
        self.lifelines: list[Peer] = []
        self._inbox: dict[int, deque[Message]] = {}  # what each rank said that no one has read yet
        self.pids: dict[int, int] = {}
        self.launcher = launcher_for(spec)  # starts (and ends) the rank processes
        self.owner = Owner("pool", self.holder, test)
        self.holding: Holding | None = None  # its GPUs, for every rank
        self.port: int | None = None
        self.server: RankServer | None = None
        self.last_used = time.monotonic()
        self.tests_run = 0
        self.last_test = ""  # the node id of the last test it ran (set by its manager)
        self._runs = itertools.count()
        # what the ranks had written when a test was interrupted in this process (see start, run_test),
        # and where the pool was then ("its rank pool of ... was starting, for 2.1s (...); the pool was killed")
        self.abandoned: list[tuple[str, str]] = []
        self.interrupted = ""
        self.stage = ""  # what its start waits for now
        self.began = time.monotonic()  # when its start began, or its current test's run
        self._waiter: tuple[threading.Thread, str] | None = None  # the thread waiting for it, and its own name
        self._joiner: tuple[threading.Thread, str] | None = None  # one waiting for its start in another (joined)
        self._stopped = False
        self._set = False  # every rank set up: in its loop, where it answers CLOSE

    @property
    def what(self) -> str:
        """The pool as a test's report names it."""
        if self.spec.isolated and self.spec.lease is not None:
            return f"its process of its own (isolate=True, {self.spec.lease.describe()})"
        return f"its rank pool of {self.spec.describe()}"

    # -- start --------------------------------------------------------------------------

    def start(self, config_args: list[str]) -> None:
        self.began = time.monotonic()
        try:
            with self._waiting():
                self._start(config_args)
        except BaseException as exc:
            # an interruption (KeyboardInterrupt, pytest-timeout) while the ranks set up: no farewell
            try:
                if not isinstance(exc, Exception):
                    self._abandon_start()
            finally:
                self.close(graceful=isinstance(exc, Exception))
            raise

    @contextmanager
    def _waiting(self) -> Iterator[None]:
        """While this thread waits for the pool, its name says for what (see :meth:`_label`)."""
        thread = threading.current_thread()
        name = thread.name
        self._waiter = (thread, name)
        try:
            yield
        finally:
            self._waiter = None
            thread.name = name

    def _label(self, doing: str) -> None:
        """Name the waiting thread after what it waits for: the one label a stack dump of this
        process shows beside its frames (pytest-timeout's thread method dumps every thread's,
        then ends the process, before any report could say where the pool was)."""
        since = time.strftime("%H:%M:%S", time.localtime(time.time() - (time.monotonic() - self.began)))
        for waiter in (self._waiter, self._joiner):
            if waiter is not None:
                thread, name = waiter
                thread.name = f"{name} (pytest-gpu: {self.what} {doing}, since {since})"

    def _at(self, stage: str) -> None:
        """The start reached ``stage``: said in an interrupted test's report and the thread's name."""
        self.stage = stage
        self._label(f"starting: {stage}")

    def _start(self, config_args: list[str]) -> None:
        problem = self.launcher.unavailable()  # before a port and GPUs are taken (and waited for)
        if problem is not None:
            raise PoolError(problem)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._at("waiting for its port and GPUs")
        client = self.run.client
        self.port = port = client.ports(1, self.ports_owner)[0]
        slices = None
        request = self.spec.gpu_request(self.run.settings.default_memory)
        if request is not None:
            # held for the ranks: this process is not confined to it; verified after each test
            self.holding = hold(self.run, self.owner, request, confine=False)
            inventory = self.run.inventory
            names = vendors.of(inventory.vendor).lease_names(
                [inventory.by_index(i) for i in self.holding.lease.indices]
            )
            g = self.spec.gpus_per_rank
            slices = ";".join(",".join(names[r * g : (r + 1) * g]) for r in range(self.spec.world_size))
        address, authkey = self._listen()
        self._at("starting its ranks")
        self.launcher.start(self._env(address, authkey, slices), port, self.dir / protocol.LAUNCHER_LOG)
        self._at("waiting for its ranks to connect")
        # the pool's processes outlive the test that starts them: their GPU use is the pool's
        claim_processes(self._processes(), self.holder)
        self._gather()
        claim_processes(self._processes(), self.holder)  # the ranks, as they said hello
        verifier = self.holding.active.verifier if self.holding is not None else None
        if isinstance(verifier, (SimRankVerifier, NvmlRankVerifier)):
            verifier.pids = list(self.pids.values())  # their contexts are the pool's
        self._at("its ranks setting up: pytest's configuration and conftests, the process group")
        self._set_up(config_args)
        if isinstance(verifier, NvmlRankVerifier) and self.holding is not None and self.run.settings.verify != "off":
            # real GPUs: what the ranks hold once set up (contexts, NCCL's buffers) is the pool's standing cost
            verifier.begin(self.holding.lease, os.getpid())

    def _set_up(self, config_args: list[str]) -> None:
        """Every rank joins the process group: one that could not (or not in time) fails the start."""
        body = self.setup_body(config_args)
        for rank in self.conns:
            self._send(rank, protocol.SETUP, dict(body))
        # one rank that could not set up fails the start at once: the others may wait for it
        # (at the rendezvous, for a store it never started) until the group's timeout
        replies = self._collect(
            set(self.conns), time.monotonic() + self.settings.init_timeout, lambda reply: reply[0] != protocol.READY
        )
        errors = []
        for rank, (kind, reply) in sorted(replies.items()):
            match kind:
                case protocol.READY:
                    continue
                case protocol.SETUP_FAILED:
                    error = reply["error"]
                case protocol.DIED:
                    error = f"it died while setting up: {self._exit_of(rank)}"
                case _:
                    error = str(self._protocol_error(rank, kind, reply, (protocol.READY, protocol.SETUP_FAILED)))
            errors.append(f"rank {rank}:\n{error}")
        missing = sorted(set(self.conns) - set(replies))
        if errors or missing:
            detail = "\n".join(errors)
            if missing and errors:
                detail += f"\n{numbered('rank', missing)} had not finished setting up then"
            elif missing:
                detail += (
                    f"\n{numbered('rank', missing)} did not finish setting up within {self.settings.init_timeout:g}s"
                )
            raise self._failed("set up", f"\n{detail}")
        self._set = True

    @contextmanager
    def joined(self) -> Iterator[None]:
        """While this thread waits for the start another thread runs (a pool started ahead of
        its test): its name says what it waits for, as the starting thread's does; interrupted
        (pytest-timeout, Ctrl-C), it keeps what :meth:`_abandon_start` keeps, as a start of its own would."""
        thread = threading.current_thread()
        name = thread.name
        self._joiner = (thread, name)
        try:
            if self.stage:
                self._label(f"starting: {self.stage}")
            yield
        except BaseException as exc:
            if not isinstance(exc, Exception):
                self._abandon_start()
            raise
        finally:
            self._joiner = None
            thread.name = name

    def _abandon_start(self) -> None:
        """The start was interrupted: keep the stacks of the ranks that had connected (their
        faulthandler is set up by then) and what every rank had written, and where it was."""
        seconds = time.monotonic() - self.began
        connected = set(self.pids)
        if connected and not self._stopped:
            self._dump_stacks(connected)
        ranks = range(self.spec.world_size)
        self.abandoned = protocol.written_since(dict.fromkeys(protocol.offsets(self.dir, len(ranks)), 0))
        stage, missing = self.stage, sorted(set(ranks) - connected)
        if stage.startswith("waiting for its ranks") and connected and missing:
            stage += f"; {numbered('rank', missing)} had not connected yet"
        self.interrupted = f"{self.what} was starting, for {seconds:.1f}s" + (f" ({stage})" if stage else "")
        self.interrupted += f"; {self._killed()}"

    def _failed(self, verb: str, why: str) -> PoolError:
        return PoolError(f"could not {verb} {self.spec.describe()}:{why}\n{protocol.summary(self.dir)}")

    def setup_body(self, config_args: list[str]) -> protocol.SetupBody:
        """What every rank sets up with: pytest's configuration, and its process group's timeout."""
        return {
            "sys_path": list(sys.path),
            "cwd": os.getcwd(),
            "config_args": config_args,
            "group_timeout": group_timeout(self.settings, self.covers),
        }

    def _env(self, address: str, authkey: bytes, slices: str | None) -> dict[str, str]:
        """What a rank needs from its pool (the launcher adds the rest of its environment)."""
        env = {
            "PYTEST_GPU_RANK_ADDRESS": address,
            "PYTEST_GPU_RANK_AUTHKEY": authkey.hex(),
            "PYTEST_GPU_RANK_LOG_DIR": str(self.dir),
            "PYTEST_GPU_RANK_BACKEND": self.spec.backend,
            "PYTEST_GPU_OWNER_PGID": str(os.getpgrp()),
        }
        if slices is not None:
            env["PYTEST_GPU_RANK_GPUS"] = slices
            env[protocol.RANK_VENDOR_ENV] = self.run.inventory.vendor  # whose variables a rank sets for its slice
        if self.holding is not None:
            lease = self.holding.lease
            env[protocol.RANK_MEMORY_ENV] = str(lease.memory)  # each rank's cap on each of its GPUs
            if sim.TAG_ENV in lease.env:  # simulated GPUs: the ranks' allocations are the pool's lease's
                env[sim.TAG_ENV] = lease.env[sim.TAG_ENV]
            if self.spec.isolated:  # a test's own lease: its process confined as the test process would be
                env[protocol.RANK_ISOLATED_ENV] = "1"
                env.update({k: v for k, v in lease.env.items() if k not in VISIBILITY})  # JAX's, TF's, ...
                cpus = self.spec.lease.cpus if self.spec.lease is not None else 0
                if cpus:  # its threads follow its CPUs, as confine_threads makes a test process's
                    env.update(dict.fromkeys(THREAD_VARS, str(cpus)))
        measured = cover.rank_config()  # pytest --cov: the ranks measure too
        if measured is not None:
            env[cover.ENV] = measured
        return env

    def _listen(self) -> tuple[str, bytes]:
        """Start the pool's server for its ranks; the address and key they connect with."""
        authkey = secrets.token_bytes(32)
        address = str(self.dir / "ctl.sock")  # reached through its directory, however deep
        self.server = RankServer(address, authkey).start()
        return address, authkey

    def _gather(self) -> None:
        """Wait for every rank's two connections, each opened with HELLO or LIFELINE."""
        assert self.server is not None
        deadline = time.monotonic() + self.settings.init_timeout
        ws = self.spec.world_size
        while len(self.conns) < ws or len(self.lifelines) < ws:
            try:
                peer, kind, body = self.server.arrivals.get(timeout=0.2)
            except queue.Empty:
                ended = self.launcher.ended()
                if ended is not None or time.monotonic() > deadline:
                    why = ended or f"not every rank connected within {self.settings.init_timeout:g}s"
                    raise self._failed("start", f" {why}") from None
                continue
            match kind:
                case protocol.HELLO:
                    peer.data = body["rank"]
                    self.conns[body["rank"]] = peer
                    self.pids[body["rank"]] = body["pid"]
                    self._inbox[body["rank"]] = deque()
                case protocol.LIFELINE:
                    self.lifelines.append(peer)
                case protocol.DIED:
                    self._file(peer, kind, body)  # a rank's: its death shows when it is asked
                case _:
                    self.server.drop(peer, "out of step")
                    error = (
                        protocol.garbled("a connecting rank", body["kind"], body["error"])
                        if kind == protocol.INVALID
                        else protocol.unexpected("a connecting rank", kind, (protocol.HELLO, protocol.LIFELINE))
                    )
                    raise self._failed("start", f" {error}")

    def _send(self, rank: int, kind: str, body: dict[str, Any]) -> None:
        """Event ``kind`` to ``rank``; :class:`PoolDied` when its connection is gone."""
        peer = self.conns[rank]
        if peer.closed or self.server is None:
            raise PoolDied(self._death_note())
        self.server.tell(peer, kind, body)

    def _file(self, peer: Peer, kind: str, body: dict[str, Any]) -> None:
        """File what a rank said for whoever reads it (a lifeline's closing is its rank's)."""
        rank = peer.data
        if isinstance(rank, int) and rank in self._inbox:
            self._inbox[rank].append((kind, body))

    def _drain(self, timeout: float | None = None) -> bool:
        """File what has arrived (waiting up to ``timeout`` for something); whether anything came."""
        if self.server is None:
            return False
        arrivals = self.server.arrivals
        try:
            first = arrivals.get(timeout=timeout) if timeout else arrivals.get_nowait()
        except queue.Empty:
            return False
        self._file(*first)
        with suppress(queue.Empty):
            while True:
                self._file(*arrivals.get_nowait())
        return True

    def _protocol_error(
        self, rank: int, kind: str, reply: dict[str, Any], expected: tuple[str, ...]
    ) -> protocol.ProtocolError:
        if kind == protocol.INVALID:
            return protocol.garbled(f"rank {rank}", reply["kind"], reply["error"])
        return protocol.unexpected(f"rank {rank}", kind, expected)

    # -- one test ------------------------------------------------------------------------

    def alive(self) -> bool:
        if self._stopped or not self.conns:
            return False
        if self.launcher.ended() is not None:
            return False
        self._drain()
        # an idle rank has nothing to say: anything from it (its connection closing) means trouble
        return not any(self._inbox.get(rank) for rank in self.conns)

    def _collect(
        self, ranks: set[int], deadline: float, enough: Callable[[Message], bool] = lambda _: False
    ) -> dict[int, Message]:
        """The next reply of each of ``ranks`` until ``deadline``, or until one reply is
        ``enough`` to stop waiting for the others; a closed connection gives ``(DIED, {})``."""
        replies: dict[int, Message] = {}
        while True:
            for rank in ranks - replies.keys():
                inbox = self._inbox.get(rank)
                if inbox:
                    replies[rank] = inbox.popleft()
            left = deadline - time.monotonic()
            if replies.keys() >= ranks or left <= 0 or any(map(enough, replies.values())) or not self._drain(left):
                return replies

    def run_test(self, body: dict[str, Any], timeout: float) -> RankRun:
        """Run one test body on every rank; the pool is marked broken if it cannot be trusted.

        Each run has an id of its own, sent with the body and echoed in every rank's result: a
        result for another run (one the ranks were still busy with) is discarded, fails the test
        and breaks the pool; it is never taken for this test's result.

        Whatever ends the wait early in this process (pytest-timeout's signal raising here,
        KeyboardInterrupt, any exception) kills the pool before it propagates, after asking the
        ranks still in the body for their stacks (kept in ``abandoned``): no rank goes on
        running a body whose test is over.
        """
        started = self.began = time.monotonic()
        if not self.alive():
            raise PoolDied(self._death_note())
        offsets = protocol.offsets(self.dir, self.spec.world_size)
        run_id = f"{self.id}/{next(self._runs)}/{secrets.token_hex(4)}"
        outcome = RankRun()
        try:
            with self._waiting():
                self._label(f"running the body of {body.get('nodeid') or 'a test'}")
                sent = dict(body, run_id=run_id, kwargs=blob(body.get("kwargs", b"")))  # pickled: opaque on the wire
                for rank in self.conns:
                    self._send(rank, protocol.RUN, sent)
                self._wait_for_results(run_id, outcome, started, timeout, offsets)
        except PoolDied:
            raise
        except BaseException:
            try:
                self._abandon(outcome, offsets)
            finally:
                self.close(graceful=False)
            raise
        outcome.seconds = time.monotonic() - started
        if self.holding is not None:  # what the ranks used during the test: judged as the test's run
            verdict, span = self.holding.check(self.run)
            outcome.checked = (self.owner, verdict, span)
        self.tests_run += 1
        self.last_used = time.monotonic()
        return outcome

    def _wait_for_results(
        self, run_id: str, outcome: RankRun, started: float, timeout: float, offsets: protocol.Offsets
    ) -> None:
        pending = set(self.conns)
        deadline = started + timeout
        while pending:
            got = self._collect(pending, deadline)
            for rank, (kind, reply) in got.items():
                pending.discard(rank)
                if kind == protocol.DIED:
                    outcome.problems.append(f"rank {rank} died during the test: {self._exit_of(rank)}")
                elif kind != protocol.RESULT:
                    error = self._protocol_error(rank, kind, reply, (protocol.RESULT,))
                    outcome.problems.append(f"{error}; the pool was killed")
                elif reply.get("run_id") != run_id:
                    # the rank was still busy with an earlier body: its answer belongs to another test
                    outcome.problems.append(
                        f"rank {rank} answered for another test run ({reply.get('run_id')!r}, not {run_id!r}); "
                        "that result was discarded and the pool, out of step, was killed"
                    )
                    pending.add(rank)  # its own result may still come, within the grace
                else:
                    outcome.results[rank] = reply
            if not got:
                break  # the deadline passed
            trouble = outcome.problems or any(r["outcome"] == "failed" for r in outcome.results.values())
            if pending and trouble:
                deadline = min(deadline, time.monotonic() + self.settings.grace)
        if pending:
            limit = (
                "its timeout"
                if deadline >= started + timeout
                else f"the {self.settings.grace:g}s grace after a failure"
            )
            outcome.problems.append(
                f"{numbered('rank', sorted(pending))} did not finish within {limit} "
                f"({timeout:g}s); their stacks are attached, the pool was killed"
            )
            self._dump_stacks(pending)
            outcome.broken = True
            outcome.timed_out = deadline >= started + timeout
        if outcome.problems:
            outcome.broken = True
            for rank in sorted(set(self.conns) - set(outcome.results)):
                log = protocol.tail(protocol.rank_file(self.dir, rank, "stderr"))
                if log.strip() and rank not in pending:
                    outcome.sections.append((f"rank {rank} log tail", log))
        elif any(r["outcome"] == "failed" or r.get("poisoned") for r in outcome.results.values()):
            ok, detail = self._health()
            if not ok:
                outcome.broken = True
                outcome.sections.append(
                    ("pytest-gpu pool", f"the world failed its health barrier ({detail}); pool replaced")
                )
        outcome.sections[:0] = protocol.written_since(offsets)

    def _abandon(self, outcome: RankRun, offsets: protocol.Offsets) -> None:
        """The test was interrupted: keep the stacks of the ranks still running it, and their output."""
        self.abandoned = []
        seconds = time.monotonic() - self.began
        busy = set(self.conns) - set(outcome.results)
        if busy and not self._stopped:
            self._dump_stacks(busy)
        self.abandoned = protocol.written_since(offsets)
        ran = "ran its body"
        if busy and not self.spec.isolated:
            ran += f" ({numbered('rank', sorted(busy))} still in it)"
        self.interrupted = f"{self.what} {ran}, for {seconds:.1f}s; {self._killed()}"

    def _killed(self) -> str:
        """What an interrupted test's report says became of the pool, and of its ranks' stacks."""
        stacks = any(name.endswith(" stack") for name, _ in self.abandoned)
        if self.spec.isolated:
            return "its process was killed" + (", its stack follows" if stacks else "")
        return "the pool was killed" + (", the ranks' stacks follow" if stacks else "")

    def _health(self) -> tuple[bool, str]:
        for rank in self.conns:
            with suppress(PoolDied):  # gone since its result: its DIED is read below
                self._send(rank, protocol.CHECK, {"timeout": self.settings.grace})
        replies = self._collect(set(self.conns), time.monotonic() + self.settings.grace + 5)
        bad = []
        for rank, (kind, reply) in replies.items():
            match kind:
                case protocol.CHECKED if reply["ok"]:
                    continue
                case protocol.CHECKED:
                    bad.append(f"rank {rank}: {reply.get('detail') or kind}")
                case protocol.DIED:
                    bad.append(f"rank {rank}: {kind}")
                case _:
                    bad.append(f"rank {rank}: {self._protocol_error(rank, kind, reply, (protocol.CHECKED,))}")
        missing = sorted(set(self.conns) - set(replies))
        if missing:
            bad.append(f"{numbered('rank', missing)} did not answer")
        return (not bad, "; ".join(bad))

    def _dump_stacks(self, ranks: set[int]) -> None:
        for rank in sorted(ranks):
            pid = self.pids.get(rank)
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGUSR1)
                except OSError:
                    pass
        time.sleep(1.0)  # faulthandler writes from a signal handler: give it a moment

    def _processes(self) -> list[int]:
        """The pids of the pool's processes: what its launcher started, and the ranks."""
        return [*(p.pid for p in self.launcher.procs), *self.pids.values()]

    def _exit_of(self, rank: int) -> str:
        return self.launcher.exit_of(rank, self.pids.get(rank))

    def _death_note(self) -> str:
        states = [f"rank {r}: {self._exit_of(r)}" for r in sorted(self.conns)] or ["no rank connected"]
        return f"the warm pool {self.spec.describe()} had died since its last test ({'; '.join(states)})"

    # -- stop --------------------------------------------------------------------------------

    def give_back_late(self) -> None:
        """A pool closed (by another thread) while its start ran on: what the start took after
        :meth:`close` (processes, GPUs, its port) is given back too. Nothing if it is not closed."""
        if not self._stopped:
            return
        self.launcher.kill(self.pids.values())
        release_processes(self._processes())
        if self.server is not None:
            with suppress(OSError, ValueError):  # closed already by close(): its pipes are gone
                self.server.close()
        holding, self.holding = self.holding, None
        if holding is not None:
            holding.release(self.run)
        if self.port is not None:
            self.port = None
            self.run.client.release_ports(self.ports_owner)
        shutil.rmtree(self.dir, ignore_errors=True)

    def close(self, graceful: bool = True) -> None:
        """Stop every process of the pool (ranks and their children) and give back port and GPUs.

        ``graceful`` asks the ranks to leave their process group first; a pool that hung or
        lost a rank, or whose ranks never all set up (none of them answers then), is killed at once.
        """
        if self._stopped:
            return
        if graceful and self._set and self.conns and self.alive():
            for rank in self.conns:
                try:
                    self._send(rank, protocol.CLOSE, {})
                except PoolDied:
                    pass
            self._collect(set(self.conns), time.monotonic() + 5)  # CLOSED, or DIED: either way, the kill follows
        self._stopped = True
        self.launcher.kill(self.pids.values())
        release_processes(self._processes())
        if self.server is not None:
            self.server.close()  # every rank's connections with it
        client = self.run.client
        if self.holding is not None:
            # what the ranks used since the last test's check is nobody's: they were killed above
            holding, self.holding = self.holding, None
            holding.release(self.run)
        if self.port is not None:
            client.release_ports(self.ports_owner)
            self.port = None
        shutil.rmtree(self.dir, ignore_errors=True)
