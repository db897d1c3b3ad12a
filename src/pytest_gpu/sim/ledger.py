"""The simulated GPUs' memory: a cross-process ledger, the "physics" tests run against.

Independent of the broker: any process (a pytest worker, a test's subprocess, a plain
``pytest -p no:gpu`` run) that allocates through :mod:`pytest_gpu.sim.cuda` charges
memory here, and over-committing a device raises :class:`OutOfMemoryError`, so a broker
bug shows up as an OOM. As the driver does:

- a process's first use of a device (an allocation, ``set_device``, ``mem_get_info``)
  opens a context there, charged until the process exits;
- a context grows when a library or kernel is first used in it (:meth:`Ledger.grow_context`:
  a module loaded lazily, cuBLAS's or cuDNN's handle, local memory resized), charged to the
  process's context until it exits, never to a test's tag (the driver's, not an allocation);
- a device's ``reserved`` memory (the driver's own) can never be allocated;
- when a process dies its memory and contexts are freed (checked lazily on the next
  write, with the process's start time so a recycled pid does not count).
- on a machine whose spec has ``slowdown=share``, which processes compute on which device
  now (:meth:`Ledger.begin_compute`): :func:`pytest_gpu.sim.cuda.compute` shares a device's
  time among them, and a process's record goes with it, as its memory does.

Every write also renders ``nvml.state``, which the fake ``libnvidia-ml.so.1``
(:mod:`pytest_gpu.sim.nvml`) reads: NVML then reports exactly what the ledger holds.

The ledger lives in the directory named by ``PYTEST_GPU_SIM_LEDGER``; without it, in the
ledger of the *simulated machine* (:func:`machine_ledger`) for the spec in ``PYTEST_GPU_SIM``
(default ``sim:4x16GiB``).

A simulated machine is a machine: ``PYTEST_GPU_SIM_MACHINE=<name>`` names it (default: the
run's own, one per run and spec, gone with the run; outside any run one per user and spec:
:func:`pytest_gpu.machine.domain.sim_machine_name`), and every process
that names it shares its GPUs' memory, as the runs of one real machine share its GPUs. Its
ledger directory is its device files: this user's alone (0700, in the user's private
directory, see :mod:`pytest_gpu.machine.domain`), or, with ``PYTEST_GPU_SIM_GROUP``, the
members' of a group (02770), as ``/dev/nvidia*`` belong to a group. No one else can read or
write it; its members may, as users of a GPU may use it all. Files in it are replaced
whole (written aside under an unpredictable name, then renamed) and opened without
following links, through the directory's descriptor (checked once: this user's or its
group's), and ``ledger.json`` is checked for its shape before it is believed. A machine
keeps its spec and context size while any process uses it (a process with memory or a
context on it, or one that opened it with :func:`machine_ledger` and lives); an idle
machine takes the spec of whoever opens it next.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import os
import secrets
import stat
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

from ..base.procs import CTIME_TOLERANCE_S, owner_alive
from ..base.requests import format_size, parse_size
from ..base.safefiles import Unsafe, locked, open_dir, private_dir, read_bytes, replace_file, write_new
from ..machine.domain import SIM_MACHINE_ENV, Domain, reach, sim_machine_name, user_name, warn_once
from . import spec as specs

LEDGER_ENV = "PYTEST_GPU_SIM_LEDGER"
SPEC_ENV = "PYTEST_GPU_SIM"
OVERHEAD_ENV = "PYTEST_GPU_CONTEXT_OVERHEAD"
TAG_ENV = "PYTEST_GPU_SIM_TAG"
DEFAULT_SPEC = "sim:4x16GiB"
DEFAULT_OVERHEAD = 500 * 2**20
STATE_FILE = "nvml.state"


class OutOfMemoryError(MemoryError):
    """A simulated device (or this process's cap on it) has too little free memory."""

    __module__ = "pytest_gpu.sim"  # its public home, as tracebacks show it


class LedgerWriteError(OSError):
    """The ledger could not be written (its directory is full or read-only); ``filename`` is the directory."""

    def __str__(self) -> str:
        return f"pytest-gpu: cannot write the simulated GPU ledger at {self.filename}: {self.strerror}"


class SimMachineError(specs.SpecError):
    """The simulated machine a process names is in use with another spec or context size."""

    __module__ = "pytest_gpu.sim"


class SimDeviceError(RuntimeError):
    """An invalid device ordinal or unusable device, as CUDA reports it."""

    __module__ = "pytest_gpu.sim"


@dataclass
class TagUsage:
    """What the processes working under one tag (one test) used, per device unit."""

    peak: dict[int, int] = field(default_factory=dict)
    current: dict[int, int] = field(default_factory=dict)
    touched: set[int] = field(default_factory=set)
    # unit -> the (pid, thread id, thread name) of each thread that touched it under the tag;
    # not part of equality: who touched a device, not how much it used
    threads: dict[int, list[tuple[int, int, str]]] = field(default_factory=dict, compare=False)


LOCK_FILE = "ledger.lock"
MAX_LEDGER = 64 << 20  # bytes of ledger.json read at most: a larger one is not ours


def machine_ledger_dir(spec: str) -> Path:
    """The ledger directory of the simulated machine a process on ``spec`` uses (made on
    first use): ``Domain.sim(spec).ledger_path``, this user's or its group's.

    Raises :class:`LedgerWriteError` when it cannot be made or used safely, and
    :class:`SimMachineError` for a ``PYTEST_GPU_SIM_GROUP`` this user is not in.
    """
    try:
        domain = Domain.sim(spec)
        path = domain.ledger_path  # by name: for the processes it is handed to
        if not domain.wide:  # a group's was made with its machine directory
            private_dir(reach(path))
    except ValueError as exc:
        raise SimMachineError(str(exc)) from None
    except OSError as exc:
        raise LedgerWriteError(
            exc.errno or errno.EACCES,
            f"{exc.strerror or exc}; set PYTEST_GPU_MACHINE_DIR to a writable directory",
            exc.filename,
        ) from None
    return path


def _why(exc: OSError) -> str:
    return str(exc) if isinstance(exc, Unsafe) else (exc.strerror or str(exc))


def _user(uid: int) -> str:
    return f"{user_name(uid)} (uid {uid})"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_time(value: object) -> bool:
    return value is None or (isinstance(value, int | float) and not isinstance(value, bool))


def _is_tag(value: object) -> bool:
    return value is None or isinstance(value, str)


def _malformed(state: object) -> str | None:
    """What in ``state`` (a parsed ``ledger.json``) is not as this module writes it, or ``None``:
    every record is checked here, so none can fail later with a ``KeyError`` or ``TypeError``."""
    if not isinstance(state, dict):
        return "is not a JSON object"
    spec = state.get("spec")
    if not isinstance(spec, str):
        return "has no spec"
    try:
        units = len(_parse(spec).units())
    except specs.SpecError:
        return f"has spec {spec[:80]!r}, not a simulated machine"
    if not _is_int(state.get("overhead")):
        return "has no context size (overhead)"
    procs, tags, users = state.get("procs"), state.get("tags"), state.get("users", {})
    if not (isinstance(procs, dict) and isinstance(tags, dict) and isinstance(users, dict)):
        return "has no procs, tags or users"

    def unit(index: object) -> bool:  # a unit as a value: a number
        return _is_int(index) and cast("int", index) < units

    def key(name: object) -> bool:  # a unit as a JSON object's key: its number as text
        return isinstance(name, str) and name.isdigit() and int(name) < units

    for pid, proc in procs.items():
        where = f"procs[{pid!r}]"
        if not (pid.isdigit() and isinstance(proc, dict)):
            return f"has a malformed record {where}"
        ctx, allocs = proc.get("ctx"), proc.get("allocs")
        if not (_is_time(proc.get("ctime")) and _is_int(proc.get("seq")) and isinstance(ctx, dict)):
            return f"has a malformed record {where}"
        if not all(key(k) and _is_tag(v) for k, v in ctx.items()):
            return f"has a malformed record {where}.ctx"
        grow = proc.get("grow", {})
        if not (isinstance(grow, dict) and all(key(k) and _is_int(v) for k, v in grow.items())):
            return f"has a malformed record {where}.grow"
        busy = proc.get("busy", {})
        if not (isinstance(busy, dict) and all(key(k) and _is_int(v) for k, v in busy.items())):
            return f"has a malformed record {where}.busy"
        if not isinstance(allocs, dict) or not all(
            isinstance(a, list) and len(a) == 3 and unit(a[0]) and _is_int(a[1]) and _is_tag(a[2])
            for a in allocs.values()
        ):
            return f"has a malformed record {where}.allocs"
    if not all(pid.isdigit() and _is_time(ctime) for pid, ctime in users.items()):
        return "has a malformed record in users"
    for name, rec in tags.items():
        where = f"tags[{name[:80]!r}]"
        if not (isinstance(rec, dict) and _is_int(rec.get("owner")) and _is_time(rec.get("octime"))):
            return f"has a malformed record {where}"
        peak, touched, threads = rec.get("peak"), rec.get("touched"), rec.get("threads", {})
        if not (isinstance(peak, dict) and all(key(k) and _is_int(v) for k, v in peak.items())):
            return f"has a malformed record {where}.peak"
        if not (isinstance(touched, list) and all(unit(u) for u in touched)):
            return f"has a malformed record {where}.touched"
        if not (isinstance(threads, dict) and all(key(k) and isinstance(v, list) for k, v in threads.items())):
            return f"has a malformed record {where}.threads"
        for seen in threads.values():
            for who in seen:
                if not (isinstance(who, list) and len(who) == 3 and _is_int(who[0]) and isinstance(who[2], str)):
                    return f"has a malformed record {where}.threads"
                if not (isinstance(who[1], int) and not isinstance(who[1], bool)):
                    return f"has a malformed record {where}.threads"
    return None


def default_ledger_dir(spec: str) -> Path:
    """The ledger a process on ``spec`` uses without ``PYTEST_GPU_SIM_LEDGER``: its
    simulated machine's (:func:`machine_ledger_dir`)."""
    return machine_ledger_dir(spec)


def _ledger_dir() -> tuple[Path, str]:
    spec = os.environ.get(SPEC_ENV) or DEFAULT_SPEC
    configured = os.environ.get(LEDGER_ENV)
    return (Path(configured) if configured else machine_ledger_dir(spec)), spec


def _same_machine(a: str, b: str) -> bool:
    """Whether two specs describe the same machine (``sim:4x16GiB`` is ``4x16GiB``)."""
    if a == b:
        return True
    try:
        return replace(_parse(a), spec="") == replace(_parse(b), spec="")
    except specs.SpecError:
        return False


def _proc_start(pid: int) -> float | None:
    """What the ledger records of a process: its create time (``None`` where it cannot be read)."""
    import psutil  # imported on use: the plugin imports this module in every process

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None  # dead, not yet reaped (xdist leaves crashed workers so): its memory is gone
        return proc.create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def _alive(pid: int | str, ctime: float | None) -> bool:
    # one that may not be inspected counts as gone (as it always has here): were it dead,
    # the ledger would otherwise hold its memory and contexts for ever
    own = _own_start() if int(pid) == os.getpid() else None
    if own is not None:  # the asking process runs: the record is its own unless it names an earlier holder of the pid
        return ctime is None or abs(ctime - own) <= CTIME_TOLERANCE_S
    return owner_alive(int(pid), ctime, unsure=False)


_own: tuple[int, float | None] = (0, None)  # (pid, create time) of this process, read once per process


def _start_of(pid: int) -> float | None:
    """What the ledger records of process ``pid`` (:func:`_proc_start`); this process's, read once."""
    return _own_start() if pid == os.getpid() else _proc_start(pid)


def _own_start() -> float | None:
    """This process's create time as :func:`_proc_start` records it (read once; a fork reads its own)."""
    global _own
    if _own[0] != os.getpid():
        _own = (os.getpid(), _proc_start(os.getpid()))
    return _own[1]


class Ledger:
    """One ledger directory: ``ledger.json`` guarded by ``ledger.lock``, rendered to ``nvml.state``."""

    def __init__(self, path: Path, spec: str | None = None, overhead: int | None = None) -> None:
        self.path = Path(path)
        self.spec = spec
        self.overhead = overhead
        self._file_mode: int | None = None  # 0660 in a group's directory, else 0600
        self._fd: int | None = None  # the directory, checked once and used through this from then on
        self._owner: int | None = None  # whom its files must belong to: this user in a private one
        self._ident = (0, 0)  # (st_dev, st_ino) of the directory held
        self._parsed: tuple[bytes, dict[str, Any]] | None = None  # the last bytes _peek parsed, and their state
        self._opening = threading.Lock()

    def _dir(self) -> int:
        """The ledger directory's descriptor: opened (made if missing) and checked on first use,
        then every file is reached through it, so a directory above that is renamed and replaced
        by someone else's (whoever owns the machine directory can) redirects nothing.

        It must be this user's, or a group's of this user (not open to others): anything else
        is refused with :class:`LedgerWriteError`, never locked, read or written."""
        if self._fd is not None:
            if self._held(self._fd):
                return self._fd
            with self._opening:  # removed (by hand, by a test): made anew where its name leads
                if self._fd is not None and not self._held(self._fd):
                    os.close(self._fd)
                    self._fd = None
        with self._opening:
            if self._fd is None:
                try:
                    self.path.mkdir(parents=True, exist_ok=True)
                    fd = open_dir(self.path)
                except OSError as exc:
                    raise LedgerWriteError(exc.errno or errno.EACCES, _why(exc), str(self.path)) from None
                info = os.fstat(fd)
                mode = stat.S_IMODE(info.st_mode)
                mine = info.st_uid == os.geteuid()
                ours = info.st_gid in {os.getegid(), *os.getgroups()} and not mode & 0o007
                if not (mine or ours):
                    os.close(fd)
                    raise LedgerWriteError(
                        errno.EPERM,
                        f"it belongs to {_user(info.st_uid)}, neither this user nor a group of this user's; "
                        "not used (a directory above it renamed and replaced by someone else's?)",
                        str(self.path),
                    )
                self._file_mode = 0o660 if mode & 0o020 else 0o600
                self._owner = os.geteuid() if mine and not mode & 0o077 else None
                self._ident = (info.st_dev, info.st_ino)
                self._fd = fd
        assert self._fd is not None
        return self._fd

    def _held(self, fd: int) -> bool:
        """Whether ``fd`` is still this ledger's directory, which still exists; where its name
        leads elsewhere now, says so once (in one line) and keeps to the directory held."""
        info = os.fstat(fd)
        if (info.st_dev, info.st_ino) != self._ident or info.st_nlink == 0:
            return False
        try:
            named = os.stat(self.path)
            seen = None if (named.st_dev, named.st_ino) == self._ident else f"a directory of {_user(named.st_uid)}"
        except OSError as exc:
            seen = f"nothing ({exc.strerror or exc})"
        if seen is not None:
            warn_once(
                f"ledger:{self.path}",
                f"the simulated GPU ledger {self.path} leads to {seen} now, not to the directory this process "
                "opened (a directory above it was renamed and replaced); this process keeps to its own, held open",
            )
        return True

    @property
    def file_mode(self) -> int:
        self._dir()
        assert self._file_mode is not None  # set with the descriptor
        return self._file_mode

    @contextmanager
    def _lock(self) -> Iterator[None]:
        """The ledger's ``flock`` (a new descriptor each time: threads of a process exclude each other too)."""
        fd = self._dir()
        try:
            with locked(Path(LOCK_FILE), self.file_mode, owner=self._owner, dir_fd=fd):
                yield
        except OSError as exc:
            if isinstance(exc, LedgerWriteError):
                raise
            raise LedgerWriteError(exc.errno, _why(exc), str(self.path)) from exc

    def _raw(self) -> bytes | None:
        """``ledger.json``'s bytes, or ``None`` where there is none."""
        try:
            return read_bytes("ledger.json", MAX_LEDGER, owner=self._owner, dir_fd=self._dir())
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise LedgerWriteError(exc.errno or errno.EIO, _why(exc), str(self.path)) from None

    def _read(self) -> dict[str, Any] | None:
        """``ledger.json``, or ``None`` where there is none. One that is not a ledger (not JSON,
        or not of the shape this module writes) is :class:`LedgerWriteError`, naming the file."""
        raw = self._raw()
        return None if raw is None else self._parse(raw)

    def _peek(self) -> dict[str, Any] | None:
        """The ledger as it is now, for a look that neither writes nor prunes, read without the
        lock (every write swaps a whole file in: a file read is never half written) and parsed
        only when its bytes differ from the last ones parsed here (three looks a GPU test).
        ``None`` where only :meth:`_state` can answer: no ledger yet, or one of another machine
        spec, which is started afresh. The state returned is shared: not to be changed."""
        raw = self._raw()
        if raw is None:
            return None
        cached = self._parsed
        if cached is not None and cached[0] == raw:
            state = cached[1]
        else:
            state = self._parse(raw)
            self._parsed = (raw, state)
        return None if self._replaced(state) else state

    def _replaced(self, state: dict[str, Any]) -> bool:
        """Whether ``state`` is an idle machine of another spec than this ledger's, which a look
        under the lock starts afresh."""
        if not self.spec:
            return False
        return not _same_machine(state["spec"], self.spec) and not self._live(state)

    def _parse(self, raw: bytes) -> dict[str, Any]:
        where = self.path / "ledger.json"
        try:
            state = json.loads(raw)
        except (ValueError, RecursionError):
            state = None
        problem = "is not JSON" if state is None else _malformed(state)
        if problem is not None:
            raise LedgerWriteError(
                errno.EINVAL,
                f"{where} {problem}: not a ledger this module wrote (remove it to start afresh)",
                str(self.path),
            )
        found = cast("dict[str, Any]", state)
        found.setdefault("users", {})  # a ledger written before machines had users
        return found

    @classmethod
    def create(cls, path: Path, spec: str, overhead: int) -> Ledger:
        """Start a fresh ledger for ``spec`` (the plugin does this once per run)."""
        path.mkdir(parents=True, exist_ok=True)
        ledger = cls(path, spec, overhead)
        with ledger._lock():
            ledger._write(ledger._fresh())
        return ledger

    def _fresh(self) -> dict[str, Any]:
        spec = self.spec or DEFAULT_SPEC
        overhead = _context_of(spec) or self.overhead
        if overhead is None:
            raw = os.environ.get(OVERHEAD_ENV)
            overhead = parse_size(raw) if raw else DEFAULT_OVERHEAD
        return {"spec": spec, "overhead": overhead, "procs": {}, "tags": {}, "users": {}}

    def _write(self, state: dict[str, Any], rendered: str | None = None) -> None:
        """Write ``state``, and ``nvml.state`` unless its rendering is ``rendered`` (what the
        state as read rendered to, i.e. what the file holds: every write renders both)."""
        self._replace("ledger.json", json.dumps(state))
        now = render_state(self.machine(state["spec"]), state)
        if now != rendered:  # a tag's bookkeeping alone changes nothing NVML reports
            self._replace(STATE_FILE, now)

    def _replace(self, name: str, text: str) -> None:
        """Write ``name`` whole: aside (a name no one can foresee), then swapped in for it."""
        fd = self._dir()
        try:
            if not _swap_file(name, text.encode(), self.file_mode, fd):
                replace_file(Path(name), text.encode(), self.file_mode, dir_fd=fd)
        except OSError as exc:  # a full or read-only temp dir: say so, not with a bare errno
            if isinstance(exc, LedgerWriteError):
                raise
            raise LedgerWriteError(exc.errno, _why(exc), str(self.path)) from exc

    @contextmanager
    def _state(self, *, write: bool = True, prune: bool = True) -> Iterator[dict[str, Any]]:
        """The ledger under its lock; ``write=False`` for a read-only look, ``prune=False``
        where what dead processes held cannot change the answer (it is pruned on the next write).
        A look with neither is :meth:`_peek`'s, which must not be changed."""
        if not write and not prune:
            peeked = self._peek()
            if peeked is not None:
                yield peeked
                return
        with self._lock():
            fresh = False
            found = self._read()
            if found is not None:
                state = found
                if self._replaced(state):
                    state, fresh = self._fresh(), True
            else:
                state, fresh = self._fresh(), True
            pruned = prune and self._prune(state)
            if pruned:
                write = True  # NVML must stop listing the dead
            # what nvml.state holds now (every write renders it), unless pruning changed it already
            rendered = None if fresh or pruned or not write else render_state(self.machine(state["spec"]), state)
            yield state
            if write or fresh:
                self._write(state, rendered)

    @staticmethod
    def _users(state: dict[str, Any]) -> list[int]:
        """The live processes using the machine: holding memory or a context, or registered users."""
        procs = {pid: rec["ctime"] for pid, rec in state["procs"].items()}
        users = {**state.get("users", {}), **procs}
        return sorted(int(pid) for pid, ctime in users.items() if _alive(pid, ctime))

    @classmethod
    def _live(cls, state: dict[str, Any]) -> bool:
        return bool(cls._users(state))

    def _prune(self, state: dict[str, Any]) -> bool:
        """Free what dead processes held, as the driver does when a process exits; forget dead
        users and the tags of dead owners (a run that was killed cannot drop them)."""
        dead = [pid for pid, rec in state["procs"].items() if not _alive(pid, rec["ctime"])]
        for pid in dead:
            del state["procs"][pid]
        users = state.setdefault("users", {})
        gone = [pid for pid, ctime in users.items() if not _alive(pid, ctime)]
        for pid in gone:
            del users[pid]
        orphans = [
            tag for tag, rec in state["tags"].items() if "octime" in rec and not _alive(rec["owner"], rec["octime"])
        ]
        for tag in orphans:
            del state["tags"][tag]
        return bool(dead or gone or orphans)

    # -- the machine ---------------------------------------------------------------

    def open_machine(self, spec: str, overhead: int | None, name: str) -> None:
        """Open this ledger as simulated machine ``name`` for ``spec``: create it if new, take
        ``spec`` (and ``overhead``, where given) if it is idle, and register this process as
        one of its users. Raises :class:`SimMachineError` when it is in use with another spec
        or context size."""
        _parse(spec)  # a spec that cannot be read is refused before anything is written
        overhead = _context_of(spec) or overhead  # the machine's own context size (context=) wins
        pid = os.getpid()
        with self._lock():
            state = self._read()
            if state is not None:
                self._prune(state)
                same = _same_machine(state["spec"], spec) and overhead in (None, state["overhead"])
                if not same:
                    users = [u for u in self._users(state) if u != pid]
                    if users:
                        raise SimMachineError(_conflict(name, state, spec, overhead, users))
                    state = None  # idle: it becomes the machine asked for
            if state is None:
                self.spec, self.overhead = spec, overhead
                state = self._fresh()
            state["users"][str(pid)] = _proc_start(pid)
            self._write(state)
        self.spec, self.overhead = str(state["spec"]), int(state["overhead"])

    def release(self, pid: int) -> None:
        """Forget process ``pid`` as its exit would: its memory, contexts and use of the machine
        (an in-process run that ends is, for the machine, a process that exits)."""
        with self._state(prune=False) as state:
            state["procs"].pop(str(pid), None)
            state["users"].pop(str(pid), None)

    # -- queries -------------------------------------------------------------------

    def machine(self, spec: str | None = None) -> specs.Machine:
        """The fake machine the ledger simulates now (its state's spec, unless ``spec`` is given)."""
        if spec is None:
            with self._state(write=False, prune=False) as state:
                spec = str(state["spec"])
        return _parse(spec)

    def units(self, spec: str | None = None) -> tuple[specs.Unit, ...]:
        """Every device unit (GPUs, then MIG instances)."""
        return self.machine(spec).units()

    def used(self) -> dict[int, int]:
        """Bytes in use per device unit, contexts included (reserved memory not)."""
        with self._state(write=False) as state:
            return {u.index: _device_used(state, u.index) for u in self.units(state["spec"])}

    def tag_usage(self, tag: str, *, drop: bool = False) -> TagUsage:
        """Peak, current use and touched devices of ``tag``; ``drop`` forgets the tag."""
        with self._state(write=drop) as state:
            units = self.units(state["spec"])
            rec = state["tags"].get(tag)
            result = TagUsage()
            if rec is not None:
                result.peak = {int(k): v for k, v in rec["peak"].items()}
                result.touched = {int(k) for k in rec["touched"]}
                result.threads = {int(k): [(p, t, n) for p, t, n in v] for k, v in rec.get("threads", {}).items()}
                result.current = {u.index: used for u in units if (used := _tag_used(state, tag, u.index))}
            if drop:
                state["tags"].pop(tag, None)
            return result

    def allocations(self, pids: Iterable[int], whole: Iterable[int] = ()) -> dict[int, int]:
        """Bytes that processes ``pids`` hold per device unit, their contexts not counted, and
        processes ``whole`` hold, their contexts counted (a unit where none holds anything is absent)."""
        wanted = {str(pid) for pid in pids}
        entire = {str(pid) for pid in whole}
        found: dict[int, int] = {}
        with self._state(write=False, prune=False) as state:
            for pid, proc in state["procs"].items():
                if pid in entire:
                    for unit in proc["ctx"]:
                        found[int(unit)] = found.get(int(unit), 0) + state["overhead"] + _grown(proc, int(unit))
                if pid in wanted or pid in entire:
                    for unit, nbytes, _ in proc["allocs"].values():
                        found[unit] = found.get(unit, 0) + nbytes
        return found

    def contexts_of(self, pid: int) -> set[int]:
        """Device units on which process ``pid`` has a context (none once it is dead)."""
        # not pruned: only pid's own record answers, and a dead one counts as gone, as pruned
        with self._state(write=False, prune=False) as state:
            proc = state["procs"].get(str(pid))
            return {int(k) for k in proc["ctx"]} if proc and _alive(pid, proc["ctime"]) else set()

    def begin_tag(self, tag: str, owner: int) -> None:
        """Start accounting ``tag``; contexts of ``owner`` are not charged to it."""
        with self._state(prune=False) as state:
            state["tags"][tag] = {"owner": owner, "octime": _start_of(owner), "peak": {}, "touched": []}

    # -- allocation ----------------------------------------------------------------

    def _unit(self, unit: int, spec: str) -> specs.Unit:
        machine = self.machine(spec)
        units = self.units(spec)
        if not 0 <= unit < len(units):
            raise SimDeviceError(f"invalid device: simulated device {unit} does not exist")
        if unit < len(machine.gpus) and machine.gpus[unit].mig:
            raise SimDeviceError(f"simulated GPU {unit} is in MIG mode: only its MIG instances can be used")
        return units[unit]

    def allocate(
        self, nbytes: int, unit: int, tag: str | None, cap: int | None, *, thread: list[int | str] | None = None
    ) -> str:
        """Charge ``nbytes`` (0: just open a context) on ``unit`` to this process; returns a handle.

        ``thread``: [id, name] of the calling thread, recorded per touched unit under ``tag``
        (the driver knows which thread made a call; NVML does not report it)."""
        pid = os.getpid()
        with self._state() as state:
            info = self._unit(unit, state["spec"])
            proc = state["procs"].get(str(pid))
            if proc is None:  # (psutil's look at the process: only for its first record, not on every call)
                proc = state["procs"][str(pid)] = {"ctime": _start_of(pid), "ctx": {}, "allocs": {}, "seq": 0}
            new_ctx = str(unit) not in proc["ctx"]
            need = nbytes + (state["overhead"] if new_ctx else 0)
            used = _device_used(state, unit)
            usable = info.total - info.reserved
            if used + need > usable:
                holders = _holders(state, unit)
                what = f"{format_size(nbytes)}{' + context' if new_ctx else ''}" if nbytes else "a context"
                raise OutOfMemoryError(
                    f"Simulated CUDA out of memory on GPU {unit} ({info.uuid}): tried to allocate "
                    f"{what}; {format_size(used)} of {format_size(usable)} in use ({holders}), "
                    f"{format_size(usable - used)} free. (pid {pid})"
                )
            if cap is not None and nbytes:
                mine = sum(n for d, n, _ in proc["allocs"].values() if d == unit)
                if mine + nbytes > cap:
                    raise OutOfMemoryError(
                        f"Simulated CUDA out of memory on GPU {unit}: tried to allocate "
                        f"{format_size(nbytes)}; this process already holds {format_size(mine)} and "
                        f"is capped at {format_size(cap)} (its pytest-gpu lease). (pid {pid})"
                    )
            if new_ctx:
                proc["ctx"][str(unit)] = tag
            handle = ""
            if nbytes:
                proc["seq"] += 1
                handle = f"{pid}:{proc['seq']}"
                proc["allocs"][handle] = [unit, nbytes, tag]
            if tag is not None and tag in state["tags"] and (nbytes or new_ctx):
                rec = state["tags"][tag]
                if unit not in rec["touched"]:
                    rec["touched"].append(unit)
                if thread is not None:
                    seen = rec.setdefault("threads", {}).setdefault(str(unit), [])
                    who = [pid, *thread]
                    if who not in seen:
                        seen.append(who)
                # a context the worker itself opens counts as a touch, not as the test's memory:
                # the broker counts the worker's contexts
                now = _tag_used(state, tag, unit)
                key = str(unit)
                rec["peak"][key] = max(rec["peak"].get(key, 0), now)
            return handle

    def grow_context(self, unit: int, nbytes: int, tag: str | None, *, thread: list[int | str] | None = None) -> None:
        """This process's context on ``unit`` grows by ``nbytes`` (opened first if it is not):
        a module loaded on a kernel's first launch, a library's handle, local memory resized.
        Charged to the process until it exits, as the driver keeps it; never to ``tag``: a
        context's growth is no test's allocation. Raises :class:`OutOfMemoryError` where the
        device has no room for it."""
        self.allocate(0, unit, tag, None, thread=thread)
        pid = os.getpid()
        with self._state() as state:
            info = self._unit(unit, state["spec"])
            used = _device_used(state, unit)
            usable = info.total - info.reserved
            if used + nbytes > usable:
                raise OutOfMemoryError(
                    f"Simulated CUDA out of memory on GPU {unit} ({info.uuid}): the context could not grow by "
                    f"{format_size(nbytes)} (a module or library loading); {format_size(used)} of "
                    f"{format_size(usable)} in use, {format_size(usable - used)} free. (pid {pid})"
                )
            proc = state["procs"][str(pid)]
            grow = proc.setdefault("grow", {})
            grow[str(unit)] = grow.get(str(unit), 0) + nbytes

    # -- compute (a machine with slowdown=share) -----------------------------------------

    def begin_compute(self, unit: int, tag: str | None, *, thread: list[int | str] | None = None) -> None:
        """This process computes on ``unit`` (its context opened first, as a kernel's launch
        does) until :meth:`end_compute`; what it computes is shared with every other process
        computing there (:meth:`computing`). Its record goes with the process, as its memory."""
        self.allocate(0, unit, tag, None, thread=thread)
        with self._state(prune=False) as state:
            busy = state["procs"][str(os.getpid())].setdefault("busy", {})
            busy[str(unit)] = busy.get(str(unit), 0) + 1

    def end_compute(self, unit: int) -> None:
        """One of this process's computations on ``unit`` ended."""
        with self._state(prune=False) as state:
            proc = state["procs"].get(str(os.getpid()))
            busy = proc.get("busy", {}) if proc is not None else {}
            left = busy.get(str(unit), 0) - 1
            if left > 0:
                busy[str(unit)] = left
            else:
                busy.pop(str(unit), None)

    def computing(self, unit: int) -> int:
        """How many live processes compute on ``unit`` now (a dead one's work ended with it)."""
        with self._state(write=False) as state:
            return sum(1 for proc in state["procs"].values() if proc.get("busy", {}).get(str(unit), 0) > 0)

    def free(self, *handles: str) -> None:
        """Free the allocations ``handles`` name (those still held), in one write."""
        with self._state(prune=False) as state:
            for handle in handles:
                proc = state["procs"].get(handle.split(":", 1)[0])
                if proc is not None:
                    proc["allocs"].pop(handle, None)


_RENAME_EXCHANGE = 2  # renameat2(2)'s flag
_unswappable = False  # set once renameat2 is missing, or the filesystem cannot exchange


@functools.cache
def _renameat2() -> Any:
    found = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if found is not None:
        found.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        found.restype = ctypes.c_int
    return found


def _swap_file(name: str, data: bytes, mode: int, dir_fd: int) -> bool:
    """Write file ``name`` of ``dir_fd`` whole, as :func:`replace_file` does (aside under an
    unpredictable name, then in one step in its place, never through a link), but swapped in
    with ``RENAME_EXCHANGE`` and the old one unlinked; ``False`` (nothing done) where the
    system cannot, or ``name`` does not exist yet.

    Why: ext4 (``auto_da_alloc``, on by default) starts writing a file's data to disk when a
    plain rename replaces another file, ~0.1 ms and more on a busy disk, and every ledger
    write replaces two files; an exchange is as atomic and starts no writeback.
    """
    global _unswappable
    exchange = None if _unswappable else _renameat2()
    if exchange is None:
        _unswappable = True
        return False
    temp = f".{name}.{secrets.token_hex(8)}.tmp"
    write_new(temp, data, mode, dir_fd=dir_fd)
    try:
        if exchange(dir_fd, temp.encode(), dir_fd, name.encode(), _RENAME_EXCHANGE) == 0:
            return True
        error = ctypes.get_errno()
        if error in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            _unswappable = True  # this kernel or filesystem cannot: a plain replace from now on
        elif error != errno.ENOENT:  # ENOENT: nothing to swap with yet
            raise OSError(error, os.strerror(error), name)
        return False
    finally:
        with suppress(OSError):
            os.unlink(temp, dir_fd=dir_fd)  # the old file once swapped, else the unused new one


# a spec names one machine for good: parsed once per process
_parse = functools.lru_cache(maxsize=16)(specs.parse)


def _context_of(spec: str) -> int | None:
    """The context size a spec's machine has (its ``context=`` option), or ``None``."""
    try:
        return _parse(spec).context
    except specs.SpecError:
        return None


def _grown(proc: dict[str, Any], unit: int) -> int:
    """What a process's context on ``unit`` grew by since it opened (modules, handles, local memory)."""
    grown: int = proc.get("grow", {}).get(str(unit), 0)
    return grown


def _device_used(state: dict[str, Any], unit: int) -> int:
    total = 0
    for proc in state["procs"].values():
        if str(unit) in proc["ctx"]:
            total += state["overhead"] + _grown(proc, unit)
        total += sum(n for d, n, _ in proc["allocs"].values() if d == unit)
    return total


def _proc_used(state: dict[str, Any], proc: dict[str, Any], unit: int) -> int:
    ctx = state["overhead"] + _grown(proc, unit) if str(unit) in proc["ctx"] else 0
    used: int = ctx + sum(n for d, n, _ in proc["allocs"].values() if d == unit)  # the state is JSON: Any
    return used


def _tag_used(state: dict[str, Any], tag: str, unit: int) -> int:
    owner = str(state["tags"].get(tag, {}).get("owner"))
    total = 0
    for pid, proc in state["procs"].items():
        if pid != owner and proc["ctx"].get(str(unit), "\0") == tag:
            total += state["overhead"]
        total += sum(n for d, n, t in proc["allocs"].values() if d == unit and t == tag)
    return total


def _holders(state: dict[str, Any], unit: int) -> str:
    parts = []
    for pid, proc in state["procs"].items():
        mine = sum(n for d, n, _ in proc["allocs"].values() if d == unit)
        if mine or str(unit) in proc["ctx"]:
            parts.append(f"pid {pid}: {format_size(mine)}")
    return ", ".join(parts) or "contexts only"


def render_state(machine: specs.Machine, state: dict[str, Any]) -> str:
    """The ledger as the fake NVML reads it (format: see :mod:`pytest_gpu.sim.nvml`)."""
    lines = ["v1"]
    # whose machine: each fake library serves its own vendor's (another's: as without its driver)
    lines.append(f"option vendor {machine.vendor}")
    if machine.proc_unit:
        lines.append(f"option amd_proc_unit {machine.proc_unit}")
    if machine.proc_refresh_ms:
        lines.append(f"option amd_proc_refresh_ms {machine.proc_refresh_ms}")
    if machine.rocr_order:
        lines.append(f"option amd_rocr_order {','.join(map(str, machine.rocr_order))}")
    if machine.proc_fds > 1:
        lines.append(f"option amd_proc_fds {machine.proc_fds}")
    if machine.apu:
        lines.append("option amd_apu 1")
    if machine.no_uuid:
        lines.append(f"option amd_no_uuid {','.join(map(str, machine.no_uuid))}")
    if machine.pidns:
        lines.append(f"option pidns {machine.pidns}")
    if machine.no_v3:
        lines.append("option no_v3 1")
    if machine.no_usage:
        lines.append("option no_usage 1")
    for gpu in machine.gpus:
        units = [u.index for u in gpu.mig] or [gpu.index]
        used = sum(_device_used(state, u) for u in units)
        mig = 1 if gpu.mig else 0
        lines.append(f"gpu {gpu.index} {gpu.uuid} {gpu.total} {gpu.reserved} {used} {mig} {gpu.fault} {gpu.name}")
        for inst in gpu.mig:
            used = _device_used(state, inst.index)
            lines.append(f"mig {gpu.index} {inst.slot} {inst.uuid} {inst.total} {used} {inst.name}")
    uuids = {u.index: u.uuid for u in machine.units()}
    # as the driver: a process's usage is everything it holds on a device, its context included,
    # whatever test, pool or tag it works for (tags are the simulation's own bookkeeping)
    for pid, proc in state["procs"].items():
        for unit in sorted({int(k) for k in proc["ctx"]} | {d for d, _, _ in proc["allocs"].values()}):
            lines.append(f"proc {uuids[unit]} {pid} {_proc_used(state, proc, unit)}")
    return "\n".join(lines) + "\n"


def _conflict(name: str, state: dict[str, Any], spec: str, overhead: int | None, users: list[int]) -> str:
    named = os.environ.get(SIM_MACHINE_ENV, "").strip()
    which = f"{SIM_MACHINE_ENV}={named}" if named else f"the simulated machine {name}"
    pids = ", ".join(map(str, users[:5])) + (", ..." if len(users) > 5 else "")
    if not _same_machine(state["spec"], spec):
        what = f"{which} is {state['spec']}; this run asked for {spec}"
        fix = f"ask for {state['spec']}"
    else:
        what = (
            f"{which} simulates CUDA contexts of {format_size(state['overhead'])}; this run asked for "
            f"{format_size(overhead or 0)} (--gpu-context-overhead)"
        )
        fix = f"use --gpu-context-overhead={format_size(state['overhead'])}"
    return (
        f"pytest-gpu: {what}. The machine is in use (pid {pids}); {fix}, wait until it is idle, "
        f"or name another simulated machine with {SIM_MACHINE_ENV}"
    )


def machine_ledger(spec: str, overhead: int | None = None) -> Ledger:
    """The ledger of the simulated machine a process on ``spec`` uses (``PYTEST_GPU_SIM_MACHINE``,
    default its run's own, see :func:`pytest_gpu.machine.domain.sim_machine_name`), created if
    missing and shared by every process and user.

    ``overhead``: the CUDA context size the caller simulates (``None``: the machine's, or the
    default for a new machine). The caller is registered as a user of the machine until it
    exits (or :meth:`Ledger.release`). Raises :class:`SimMachineError` when the machine is in
    use with another spec or context size, :class:`LedgerWriteError` when its directory cannot
    be made.
    """
    found = Ledger(machine_ledger_dir(spec))
    found.open_machine(spec, overhead, sim_machine_name(spec))
    return found


def ledger() -> Ledger:
    """The ledger this process uses (from the environment, as the plugin set it)."""
    # asked on every simulated CUDA call: found by the variables themselves, without making paths
    named = (os.environ.get(LEDGER_ENV), os.environ.get(SPEC_ENV))
    found = _by_env.get(named)
    if found is None:
        path, spec = _ledger_dir()
        key = (str(path), spec)
        found = _ledgers.get(key)
        if found is None:  # one per ledger and process: its lock and device list are reused
            found = _ledgers[key] = Ledger(path, spec)
        if named[0] is not None:  # without PYTEST_GPU_SIM_LEDGER the path depends on more than these
            _by_env[named] = found
    return found


_ledgers: dict[tuple[str, str | None], Ledger] = {}
_by_env: dict[tuple[str | None, str | None], Ledger] = {}
