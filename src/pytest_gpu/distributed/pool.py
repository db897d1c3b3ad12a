"""Warm pools of rank processes, owned by one pytest process (a worker, or the only one).

A pool is started for a :class:`DistSpec` key, keeps its process group, its
rendezvous port and its GPU lease while it lives, and runs one test after another.
It is torn down when a test needs another key, when it has been idle for
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
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Listener, wait
from pathlib import Path
from typing import Any

import psutil

from ..procs import kill_and_wait
from ..report.wording import numbered
from ..run.session import GpuRun
from . import cover
from .spec import DistSpec

LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "PYTEST_GPU_RANK",
    "PYTEST_GPU_WORLD_SIZE",
    "CUDA_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "PYTEST_GPU_SIM_TAG",
)
_ids = itertools.count()
# How far the process group's own timeout lies past the longest test a pool runs: the time
# the pool needs to collect every rank's stack and kill the ranks once that test timed out.
GROUP_TIMEOUT_MARGIN = 60.0


class PoolError(RuntimeError):
    """A pool could not be started; the message says why, with the ranks' output."""


class PoolDied(RuntimeError):
    """The pool was found dead before a test could be sent to it."""


@dataclass(frozen=True)
class DistSettings:
    timeout: float = 300.0  # per test, unless the marker says otherwise
    pool: bool = True
    idle: float = 60.0
    init_timeout: float = 120.0
    grace: float = 10.0  # how long the other ranks get once one rank failed or died
    wait_timeout: float = 1800.0


def group_timeout(settings: DistSettings, test_timeout: float) -> float:
    """The ``timeout`` of a pool's process group, for tests of up to ``test_timeout`` seconds.

    torch applies it to every collective (NCCL's watchdog aborts the ranks when one waits
    longer), so it must outlast the pool's own per-test timeout, which reports a hang with
    every rank's stack; ``init_timeout`` (the rendezvous) is bounded by the pool's set-up wait.
    """
    return max(settings.init_timeout, test_timeout + settings.grace + GROUP_TIMEOUT_MARGIN)


@dataclass
class RankRun:
    """What one test did on a pool: per-rank results and what to attach to the report."""

    results: dict[int, dict[str, Any]] = field(default_factory=dict)
    sections: list[tuple[str, str]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # timeouts, crashes, poisoned world
    broken: bool = False  # the pool must not be reused
    seconds: float = 0.0  # wall time of the run on the pool

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


def _signal_text(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name} (exit {code})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


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
        self.conns: dict[int, Connection] = {}
        self.lifelines: list[Connection] = []
        self.pids: dict[int, int] = {}
        self.procs: list[subprocess.Popen[bytes]] = []
        self.pgid: int | None = None
        self.lease_key: str | None = None
        self.port: int | None = None
        self.listener: Listener | None = None
        self.last_used = time.monotonic()
        self.tests_run = 0
        self._runs = itertools.count()
        # what the ranks had written when a test was interrupted in this process (see run_test)
        self.abandoned: list[tuple[str, str]] = []
        self._stopped = False

    # -- start --------------------------------------------------------------------------

    def start(self, config_args: list[str]) -> None:
        try:
            self._start(config_args)
        except BaseException as exc:
            # an interruption (KeyboardInterrupt, pytest-timeout) while the ranks set up: no farewell
            self.close(graceful=isinstance(exc, Exception))
            raise

    def _start(self, config_args: list[str]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        client = self.run.client
        self.port = client.ports(1, self.ports_owner)[0]
        slices = None
        request = self.spec.gpu_request(self.run.settings.default_memory)
        if request is not None:
            grant = client.acquire(request, self.holder, self.settings.wait_timeout)
            self.lease_key = grant.key
            names = [
                str(i) if self.run.inventory.simulated else self.run.inventory.by_index(i).uuid for i in grant.indices
            ]
            g = self.spec.gpus_per_rank
            slices = ";".join(",".join(names[r * g : (r + 1) * g]) for r in range(self.spec.world_size))
        authkey = secrets.token_bytes(32)
        address = str(self.dir / "ctl.sock")
        self.listener = Listener(address, family="AF_UNIX", authkey=authkey)
        arrivals: queue.Queue[tuple[str, dict[str, Any], Connection]] = queue.Queue()
        threading.Thread(target=self._accept, args=(arrivals,), daemon=True).start()
        env = self._env(address, authkey, slices)
        self._launch(env)
        self._gather(arrivals)
        body = self.setup_body(config_args)
        for conn in self.conns.values():
            conn.send(("setup", body))
        replies = self._collect(set(self.conns), time.monotonic() + self.settings.init_timeout)
        errors = [f"rank {r}:\n{body['error']}" for r, (kind, body) in sorted(replies.items()) if kind != "ready"]
        missing = sorted(set(self.conns) - set(replies))
        if errors or missing:
            detail = "\n".join(errors)
            if missing:
                detail += (
                    f"\n{numbered('rank', missing)} did not finish setting up within {self.settings.init_timeout:g}s"
                )
            raise PoolError(f"could not set up {self.spec.describe()}:\n{detail}\n{self._logs_tail()}")

    def setup_body(self, config_args: list[str]) -> dict[str, Any]:
        """What every rank sets up with: pytest's configuration, and its process group's timeout."""
        return {
            "sys_path": list(sys.path),
            "cwd": os.getcwd(),
            "config_args": config_args,
            "group_timeout": group_timeout(self.settings, self.covers),
        }

    def _env(self, address: str, authkey: bytes, slices: str | None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
        env.update(
            {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(self.port),
                "PYTEST_GPU_RANK_ADDRESS": address,
                "PYTEST_GPU_RANK_AUTHKEY": authkey.hex(),
                "PYTEST_GPU_RANK_LOG_DIR": str(self.dir),
                "PYTEST_GPU_RANK_BACKEND": self.spec.backend,
                "PYTEST_GPU_OWNER_PGID": str(os.getpgrp()),
                "PYTHONUNBUFFERED": "1",
            }
        )
        if slices is not None:
            env["PYTEST_GPU_RANK_GPUS"] = slices
        measured = cover.rank_config()  # pytest --cov: the ranks measure too
        if measured is not None:
            env[cover.ENV] = measured
        return env

    def _command(self) -> list[str]:
        ws = str(self.spec.world_size)
        rank_cmd = [sys.executable, "-m", "pytest_gpu.distributed.rankmain"]
        if self.spec.launcher == "torchrun":
            return [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nproc-per-node={ws}",
                "--nnodes=1",
                "--master-addr=127.0.0.1",
                f"--master-port={self.port}",
                "-m",
                "pytest_gpu.distributed.rankmain",
            ]
        if self.spec.launcher == "mpirun":
            exe = shutil.which("mpirun")
            if exe is None:
                raise PoolError("launcher 'mpirun' needs an MPI's mpirun on PATH (e.g. apt-get install openmpi-bin)")
            return [exe, "-n", ws, *rank_cmd]
        if self.spec.launcher == "srun":
            exe = shutil.which("srun")
            if exe is None:
                raise PoolError("launcher 'srun' needs SLURM's srun on PATH, inside an allocation")
            return [exe, f"--ntasks={ws}", "--nodes=1", "--kill-on-bad-exit=1", *rank_cmd]
        raise AssertionError(self.spec.launcher)

    def _launch(self, env: dict[str, str]) -> None:
        out = open(self.dir / "launcher.log", "ab")
        try:
            if self.spec.launcher == "spawn":
                for r in range(self.spec.world_size):
                    rank_env = dict(env, PYTEST_GPU_RANK=str(r), PYTEST_GPU_WORLD_SIZE=str(self.spec.world_size))
                    rank_env.update(RANK=str(r), WORLD_SIZE=str(self.spec.world_size), LOCAL_RANK=str(r))
                    group = _join_group(0 if self.pgid is None else self.pgid)
                    proc = subprocess.Popen(
                        [sys.executable, "-m", "pytest_gpu.distributed.rankmain"],
                        env=rank_env,
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=out,
                        **group,
                    )
                    self.procs.append(proc)
                    if self.pgid is None:
                        self.pgid = proc.pid
            else:
                if self.spec.launcher == "mpirun" and os.geteuid() == 0:
                    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
                    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
                env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
                proc = subprocess.Popen(
                    self._command(), env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out, **_join_group(0)
                )
                self.procs.append(proc)
                self.pgid = proc.pid
        finally:
            out.close()

    def _accept(self, arrivals: queue.Queue[tuple[str, dict[str, Any], Connection]]) -> None:
        assert self.listener is not None
        while not self._stopped:
            try:
                conn = self.listener.accept()
                kind, body = conn.recv()
            except Exception:
                if self._stopped:
                    return
                continue
            arrivals.put((kind, body, conn))

    def _gather(self, arrivals: queue.Queue[tuple[str, dict[str, Any], Connection]]) -> None:
        deadline = time.monotonic() + self.settings.init_timeout
        ws = self.spec.world_size
        while len(self.conns) < ws or len(self.lifelines) < ws:
            try:
                kind, body, conn = arrivals.get(timeout=0.2)
            except queue.Empty:
                dead = [p for p in self.procs if p.poll() is not None]
                if dead or time.monotonic() > deadline:
                    who = "a rank process" if self.spec.launcher == "spawn" else self.spec.launcher
                    why = (
                        f"{who} ended: {_signal_text(dead[0].returncode)}"
                        if dead
                        else f"not every rank connected within {self.settings.init_timeout:g}s"
                    )
                    raise PoolError(f"could not start {self.spec.describe()}: {why}\n{self._logs_tail()}") from None
                continue
            if kind == "hello":
                self.conns[int(body["rank"])] = conn
                self.pids[int(body["rank"])] = int(body["pid"])
            else:
                self.lifelines.append(conn)

    def _logs_tail(self) -> str:
        parts = []
        for path in [*sorted(self.dir.glob("*.std*")), self.dir / "launcher.log"]:
            tail = _tail(path)
            if tail.strip():
                parts.append(f"--- {path.name} ---\n{tail}")
        return "\n".join(parts)

    # -- one test ------------------------------------------------------------------------

    def alive(self) -> bool:
        if self._stopped or not self.conns:
            return False
        if any(p.poll() is not None for p in self.procs):
            return False
        for conn in self.conns.values():
            try:
                if conn.poll():  # an idle rank has nothing to say: data here means EOF
                    return False
            except (OSError, EOFError):
                return False
        return True

    def _offsets(self) -> dict[Path, int]:
        sizes = {}
        for r in range(self.spec.world_size):
            for stream in ("stdout", "stderr", "stack"):
                path = self.dir / f"rank{r}.{stream}"
                sizes[path] = path.stat().st_size if path.exists() else 0
        return sizes

    def _new_output(self, offsets: dict[Path, int], streams: tuple[str, ...]) -> list[tuple[str, str]]:
        sections = []
        for path, start in offsets.items():
            rank, stream = path.stem.removeprefix("rank"), path.suffix[1:]
            if stream not in streams or not path.exists():
                continue
            with open(path, "rb") as fh:
                fh.seek(start)
                text = fh.read().decode(errors="replace")
            if text.strip():
                sections.append((f"rank {rank} {stream}", text))
        return sections

    def _collect(self, ranks: set[int], deadline: float) -> dict[int, tuple[str, dict[str, Any]]]:
        """Replies from ``ranks`` until ``deadline``; a closed connection gives ("died", {})."""
        replies: dict[int, tuple[str, dict[str, Any]]] = {}
        by_conn = {self.conns[r]: r for r in ranks}
        while by_conn:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for conn in wait(list(by_conn), timeout=left):
                rank = by_conn.pop(conn)  # type: ignore[call-overload]
                try:
                    replies[rank] = conn.recv()
                except (EOFError, OSError):
                    replies[rank] = ("died", {})
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
        started = time.monotonic()
        if not self.alive():
            raise PoolDied(self._death_note())
        offsets = self._offsets()
        run_id = f"{self.id}/{next(self._runs)}/{secrets.token_hex(4)}"
        outcome = RankRun()
        try:
            for conn in self.conns.values():
                try:
                    conn.send(("run", dict(body, run_id=run_id)))
                except OSError:
                    raise PoolDied(self._death_note()) from None
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
        self.tests_run += 1
        self.last_used = time.monotonic()
        return outcome

    def _wait_for_results(
        self, run_id: str, outcome: RankRun, started: float, timeout: float, offsets: dict[Path, int]
    ) -> None:
        pending = set(self.conns)
        deadline = started + timeout
        while pending:
            got = self._collect(pending, deadline)
            for rank, (kind, reply) in got.items():
                pending.discard(rank)
                if kind != "result":
                    outcome.problems.append(f"rank {rank} died during the test: {self._exit_of(rank)}")
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
        if outcome.problems:
            outcome.broken = True
            for rank in sorted(set(self.conns) - set(outcome.results)):
                log = _tail(self.dir / f"rank{rank}.stderr")
                if log.strip() and rank not in pending:
                    outcome.sections.append((f"rank {rank} log tail", log))
        elif any(r["outcome"] == "failed" or r.get("poisoned") for r in outcome.results.values()):
            ok, detail = self._health()
            if not ok:
                outcome.broken = True
                outcome.sections.append(
                    ("pytest-gpu pool", f"the world failed its health barrier ({detail}); pool replaced")
                )
        outcome.sections[:0] = self._new_output(offsets, ("stdout", "stderr", "stack"))

    def _abandon(self, outcome: RankRun, offsets: dict[Path, int]) -> None:
        """The test was interrupted: keep the stacks of the ranks still running it, and their output."""
        self.abandoned = []
        busy = set(self.conns) - set(outcome.results)
        if busy and not self._stopped:
            self._dump_stacks(busy)
        self.abandoned = [
            *self._new_output(offsets, ("stdout", "stderr", "stack")),
            (
                "pytest-gpu pool",
                f"the test was interrupted while its ranks ran; its pool of {self.spec.describe()} was killed",
            ),
        ]

    def _health(self) -> tuple[bool, str]:
        for conn in self.conns.values():
            conn.send(("check", {"timeout": self.settings.grace}))
        replies = self._collect(set(self.conns), time.monotonic() + self.settings.grace + 5)
        bad = [f"rank {r}: {b.get('detail') or k}" for r, (k, b) in replies.items() if k != "checked" or not b["ok"]]
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

    def _exit_of(self, rank: int) -> str:
        if self.spec.launcher == "spawn" and rank < len(self.procs):
            proc = self.procs[rank]
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
            return _signal_text(proc.returncode)
        return f"pid {self.pids.get(rank)} is gone (launched by {self.spec.launcher}; exit status not visible)"

    def _death_note(self) -> str:
        states = [f"rank {r}: {self._exit_of(r)}" for r in sorted(self.conns)] or ["no rank connected"]
        return f"the warm pool {self.spec.describe()} had died since its last test ({'; '.join(states)})"

    # -- stop --------------------------------------------------------------------------------

    def close(self, graceful: bool = True) -> None:
        """Stop every process of the pool (ranks and their children) and give back port and GPUs.

        ``graceful`` asks the ranks to leave their process group first; a pool that hung or
        lost a rank is killed at once.
        """
        if self._stopped:
            return
        if graceful and self.conns and self.alive():
            for conn in self.conns.values():
                try:
                    conn.send(("close", {}))
                except OSError:
                    pass
            self._collect(set(self.conns), time.monotonic() + 5)
        self._stopped = True
        self._kill_all()
        for conn in [*self.conns.values(), *self.lifelines]:
            try:
                conn.close()
            except OSError:
                pass
        if self.listener is not None:
            try:
                self.listener.close()
            except OSError:
                pass
        client = self.run.client
        if self.lease_key is not None:
            client.release(self.lease_key)
            self.lease_key = None
        if self.port is not None:
            client.release_ports(self.ports_owner)
            self.port = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def _kill_all(self) -> None:
        if self.spec.launcher == "srun":
            # srun gives its job allocation back only when it exits by itself: a SIGKILLed srun
            # leaves the SLURM job running (holding its CPUs and GPUs). SIGTERM makes it end the
            # step (its tasks get the signal) and release the allocation.
            for proc in self.procs:
                if proc.poll() is None:
                    proc.terminate()
            for proc in self.procs:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        victims: list[psutil.Process] = []
        for pid in [*self.pids.values(), *(p.pid for p in self.procs)]:
            try:
                proc = psutil.Process(pid)
                victims += [proc, *proc.children(recursive=True)]
            except psutil.Error:
                pass
        if self.pgid is not None:
            try:
                os.killpg(self.pgid, signal.SIGKILL)
            except OSError:
                pass
        kill_and_wait(victims)
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


def _join_group(pgid: int) -> dict[str, Any]:
    """Popen arguments that put the child in process group ``pgid`` (0: a new group of its own).

    Ranks get a group of their own (so ``killpg`` takes them and their children) but stay
    in pytest's session, since a process can only join a group of its own session.
    """
    if sys.version_info >= (3, 11):
        return {"process_group": pgid}
    return {"preexec_fn": lambda: os.setpgid(0, pgid)}  # pragma: no cover - Python 3.10


class PoolManager:
    """The pools of one pytest process: at most one warm pool at a time."""

    def __init__(self, run: GpuRun, settings: DistSettings, config_args: list[str], base: Path) -> None:
        self.run = run
        self.settings = settings
        self.config_args = config_args
        self.base = base
        self.pool: RankPool | None = None
        self.started = 0
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._running: RankPool | None = None  # the pool a test is running on, while it runs
        self.abandoned: list[tuple[str, str]] = []  # the sections of the last interrupted test

    def _fresh(self, spec: DistSpec, timeout: float, test: str = "") -> RankPool:
        pool = RankPool(spec, self.run, self.settings, self.base, timeout, test)
        pool.start(self.config_args)
        self.started += 1
        return pool

    def execute(self, spec: DistSpec, body: dict[str, Any], timeout: float) -> tuple[RankRun, list[str]]:
        """Run a test on a pool for ``spec``; returns the run and notes for the report.

        Anything that ends this early (pytest-timeout's signal, KeyboardInterrupt, an error)
        kills the pool in use, so that the next test gets a fresh one; what the interrupted
        ranks had written (their stacks first) is then in ``abandoned``.
        """
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self.abandoned = []
            try:
                return self._execute(spec, body, timeout)
            except BaseException:
                running, self._running = self._running, None
                try:
                    if running is not None:
                        self.abandoned = running.abandoned
                        running.close(graceful=False)
                finally:
                    if self.pool is not None:
                        self.pool.close(graceful=False)
                        self.pool = None
                raise

    def _run(self, pool: RankPool, body: dict[str, Any], timeout: float) -> RankRun:
        self._running = pool
        result = pool.run_test(body, timeout)
        self._running = None
        return result

    def _execute(self, spec: DistSpec, body: dict[str, Any], timeout: float) -> tuple[RankRun, list[str]]:
        notes: list[str] = []
        test = str(body.get("nodeid", ""))  # a pool started for this test is named after it
        if not self.settings.pool:
            pool = self._fresh(spec, timeout, test)
            result = None
            try:
                result = self._run(pool, body, timeout)
                return result, notes
            finally:
                pool.close(graceful=result is not None and not result.broken)
        # a test longer than the pool's process group allows needs a new group (and pool)
        if self.pool is not None and (self.pool.spec.pool_key != spec.pool_key or self.pool.covers < timeout):
            self.pool.close()
            self.pool = None
        if self.pool is not None and not self.pool.alive():
            notes.append(self.pool._death_note() + "; this test ran in a fresh pool")
            self.pool.close()
            self.pool = None
        if self.pool is None:
            self.pool = self._fresh(spec, timeout, test)
        try:
            result = self._run(self.pool, body, timeout)
        except PoolDied as exc:
            notes.append(f"{exc}; this test was retried once in a fresh pool")
            self.pool.close()
            self.pool = None
            self.pool = self._fresh(spec, timeout, test)
            result = self._run(self.pool, body, timeout)
        if result.broken:
            self.pool.close(graceful=False)
            self.pool = None
        else:
            self._timer = threading.Timer(self.settings.idle, self._idle_close)
            self._timer.daemon = True
            self._timer.start()
        return result, notes

    def _idle_close(self) -> None:
        with self._lock:
            if self.pool is not None and time.monotonic() - self.pool.last_used >= self.settings.idle - 0.01:
                self.pool.close()
                self.pool = None

    def close(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            if self.pool is not None:
                self.pool.close()
                self.pool = None
