"""Where the runs of a machine meet, and who may meet there.

A *domain* is a set of GPUs that runs must share: the machine's real GPUs (``gpus``), or
one simulated machine (``sim-<name>``, see :func:`sim_machine_name`). Its runs elect one
arbiter (:mod:`.link`) and reach it on a Unix socket. There are two kinds:

- **machine-wide** (the real GPUs; a simulated machine shared with a group): every
  user's runs meet at one abstract Unix socket, named after the machine directory and the
  domain. Binding that name *is* the election: the kernel lets one process hold it and
  frees it when that process dies, and there is no file anyone could plant, hold or swap.
  Anyone may also bind it first (a squatter): a run checks who answers (``SO_PEERCRED``)
  and that it speaks the protocol in time, and otherwise coordinates with its own user's
  runs only, in its private domain, saying so once.
- **private** (a user's simulated machines; the fallback of a machine-wide one): a
  directory only this user can enter, holding the election's lock file and the socket.
  Another user cannot reach it at all.

A simulated machine is private to its *run* unless named: a pytest run that finds neither
``$PYTEST_GPU_SIM_MACHINE`` nor ``$PYTEST_GPU_SIM_GROUP`` claims a run name
(:func:`claim_run_machines`, in ``$PYTEST_GPU_SIM_RUN``, which its workers, ranks and
subprocesses inherit) and its simulated machines live in ``<private root>/<run>/``, removed
when the run ends; a run killed before it could remove them leaves an owner file naming a
dead process, and the next run removes them (:func:`sweep_run_machines`). Only processes
outside any run (a script under ``PYTEST_GPU_FAKE_GPUS``, ``python -m pytest_gpu.sim hold``)
use the one machine per user and spec.

The machine directory is ``$PYTEST_GPU_MACHINE_DIR`` or ``/tmp/pytest-gpu-machines`` (not
``$TMPDIR``: users with different temp directories must still meet). It is sticky and
world-writable like ``/tmp``; it holds each user's private root (``user-<uid>``, 0700) and
the directories of simulated machines shared with a group (02770, that group's). Where a
name there is taken by someone else (a link, another user's directory), this user's runs
use ``$XDG_RUNTIME_DIR``, then their home's cache, and say so once; an administrator who
makes the machine directory as root (``install -d -m 1777``) keeps every user's entries
out of every other user's reach. Whoever owns it may rename what is in it: so a process
checks its private root once and then reaches it through its open descriptor
(:func:`reach`), and a group's directory is never given its group and mode unless this
process just made it (:func:`~pytest_gpu.base.safefiles.group_dir`).
"""

from __future__ import annotations

import contextlib
import grp
import hashlib
import os
import re
import secrets
import shutil
import socket
import stat
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..base.procs import owner_alive, read_owner, write_owner
from ..base.requests import parse_size
from ..base.safefiles import group_dir, open_private_dir, private_dir, shared_dir

ROOT_ENV = "PYTEST_GPU_MACHINE_DIR"
SIM_MACHINE_ENV = "PYTEST_GPU_SIM_MACHINE"
SIM_GROUP_ENV = "PYTEST_GPU_SIM_GROUP"
USER_MEMORY_ENV = "PYTEST_GPU_USER_MEMORY"  # see user_memory_cap
PLACEMENT_ENV = "PYTEST_GPU_PLACEMENT"  # see placement_spreads
SIM_RUN_ENV = "PYTEST_GPU_SIM_RUN"  # set by a run for its own processes: whose private machines they use
RUN_GRACE_S = 60.0  # a run's machine directory younger than this without an owner file is being made
DEFAULT_ROOT = "/tmp/pytest-gpu-machines"
REAL = "gpus"
LEDGER_DIR = "sim-ledger"
PRESENT_MAX = 4096  # presence names one election counts at most (anyone may bind such names)
_TAG = re.compile(rb"[0-9a-f]{20}")  # a presence name's tail: the roster's digest of a run id

_warned: set[str] = set()
said: list[str] = []  # the warning lines of this process, in order
_holding = False  # a pytest run shows them in its summary (a test's captured stderr would hide them)
_private_roots: dict[tuple[str, int], _Root] = {}


def user_memory_cap() -> int | None:
    """``$PYTEST_GPU_USER_MEMORY`` (a size, ``48GiB``): the GPU memory one user's leases may
    hold on the machine at once, all runs and GPUs together, as the machine's arbiter reads it
    from its run's environment (``None``: no bound). :class:`ValueError` naming it for a value
    that is not a size."""
    value = os.environ.get(USER_MEMORY_ENV, "").strip()
    if not value:
        return None
    try:
        return parse_size(value)
    except ValueError as exc:
        raise ValueError(f"{USER_MEMORY_ENV}={value}: {exc}") from None


def placement_spreads() -> bool:
    """``$PYTEST_GPU_PLACEMENT``: ``spread`` (the default: idle GPUs first, see
    :mod:`pytest_gpu.machine.placement`) or ``affinity`` (the rule before: a worker's context
    GPUs first, busy or not), for bench/makespan.py to measure the two side by side; not a
    user's option. :class:`ValueError` naming it for any other value."""
    value = os.environ.get(PLACEMENT_ENV, "").strip()
    if value not in ("", "spread", "affinity"):
        raise ValueError(f"{PLACEMENT_ENV}={value[:80]!r}: expected 'spread' or 'affinity'")
    return value != "affinity"


class DomainError(OSError):
    """No directory for this user's runs can be made at all; ``filename`` is where."""

    def __str__(self) -> str:
        return (
            f"pytest-gpu: cannot create the machine directory {self.filename}: {self.strerror}; "
            f"set {ROOT_ENV} to a writable directory"
        )


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "_"


def warn_once(key: str, message: str) -> None:
    """One warning line per process and ``key``: on stderr, or, while a pytest run holds them
    (:func:`hold_warnings`), in :data:`said` for its summary. Not ``warnings.warn``: a
    ``filterwarnings = error`` suite would make it an INTERNALERROR."""
    if key in _warned:
        return
    _warned.add(key)
    line = f"pytest-gpu: warning: {message}"
    said.append(line)
    if not _holding:
        print(line, file=sys.stderr, flush=True)


def hold_warnings(holding: bool = True) -> None:
    """Keep warning lines for the run's summary (``holding``), or print them as they come again."""
    global _holding
    _holding = holding
    if not holding:
        said.clear()


def user_name(uid: int | None = None) -> str:
    """The name of user ``uid`` (default: this process's), or the number where it has none."""
    uid = os.getuid() if uid is None else uid
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return str(uid)


def sim_group() -> int | None:
    """The group a simulated machine is shared with (``$PYTEST_GPU_SIM_GROUP``: a name or
    gid this user belongs to), or ``None``: the machine is this user's alone.

    Raises :class:`ValueError` naming the variable for a group that does not exist or that
    this user is not in."""
    value = os.environ.get(SIM_GROUP_ENV, "").strip()
    if not value:
        return None
    try:
        gid = int(value) if value.isdigit() else grp.getgrnam(value).gr_gid
    except KeyError:
        raise ValueError(f"{SIM_GROUP_ENV}={value}: no such group") from None
    if gid != os.getegid() and gid not in os.getgroups() and os.geteuid() != 0:
        raise ValueError(f"{SIM_GROUP_ENV}={value}: this user ({user_name()}) is not in that group")
    return gid


def sim_machine_name(spec: str) -> str:
    """The simulated machine a process on ``spec`` uses: ``$PYTEST_GPU_SIM_MACHINE``; else,
    shared with a group, one per group and spec; else, in a run, one per run and spec
    (``<run>-<spec>``, the run's own); else, outside any run, one per user and spec
    (``<user>-<spec>``)."""
    named = os.environ.get(SIM_MACHINE_ENV, "").strip()
    if named:
        return _safe(named)
    gid = sim_group()
    run = run_name()
    if gid is None and run is not None:
        return _safe(f"{run}-{spec}")
    owner = user_name() if gid is None else _group_name(gid)
    return _safe(f"{owner}-{spec}")


def run_name() -> str | None:
    """The run whose own simulated machines this process uses (``$PYTEST_GPU_SIM_RUN``), if any."""
    value = os.environ.get(SIM_RUN_ENV, "").strip()
    return _safe(value) if value else None


def claim_run_machines(launch_id: str | None = None) -> str | None:
    """Make the simulated machines of the run this process starts its own (see the module's
    docstring): returns the new run name (set in ``$PYTEST_GPU_SIM_RUN``), or ``None`` where
    the environment shares them already (``$PYTEST_GPU_SIM_MACHINE``, ``$PYTEST_GPU_SIM_GROUP``)
    or names a run this process belongs to (``$PYTEST_GPU_SIM_RUN``: an xdist worker, a rank,
    a test's subprocess).

    ``launch_id``: the launch (torchrun, mpirun, srun) this process is a rank of; its ranks
    on this node claim one name together and share the run's machines, as they share the
    node's GPUs. Every claimant is an owner until :func:`release_run_machines`; the last one
    removes the machines. Runs killed before they could remove theirs are swept first."""
    if any(os.environ.get(name, "").strip() for name in (SIM_MACHINE_ENV, SIM_GROUP_ENV, SIM_RUN_ENV)):
        return None
    sweep_run_machines()
    if launch_id is not None:  # short: the machine's socket lives below it
        name = "launch-" + hashlib.sha256(launch_id.encode()).hexdigest()[:12]
    else:
        name = f"run-{os.getpid()}-{secrets.token_hex(4)}"
    run = private_dir(_root().through / name)  # through its descriptor: see private_root
    write_owner(run / f"owner-{os.getpid()}.json")
    os.environ[SIM_RUN_ENV] = name
    return name


def release_run_machines(name: str) -> None:
    """This process is no longer an owner of run ``name``'s machines (it claimed them with
    :func:`claim_run_machines`); the last owner removes them: ledgers, locks, sockets."""
    if os.environ.get(SIM_RUN_ENV) == name:
        del os.environ[SIM_RUN_ENV]
    try:
        run = _root().through / name  # never a tree someone else put where this user's was
    except OSError:
        return
    with contextlib.suppress(FileNotFoundError):
        (run / f"owner-{os.getpid()}.json").unlink()
    if not _live_owners(run):
        shutil.rmtree(run, ignore_errors=True)


def _live_owners(run: Path) -> list[int]:
    """The owners of run directory ``run`` still alive (owner files of dead ones are removed)."""
    alive = []
    for path in run.glob("owner-*.json"):
        try:
            pid, ctime = read_owner(path)
        except (OSError, ValueError, KeyError, TypeError):
            continue  # gone meanwhile, or not an owner file of ours: it keeps nothing alive
        if owner_alive(pid, ctime):
            alive.append(pid)
        else:
            with contextlib.suppress(OSError):
                path.unlink()
    return alive


def sweep_run_machines() -> list[Path]:
    """Remove the simulated machines of runs whose owners are all gone (killed before they
    could remove them); returns the run directories removed."""
    removed: list[Path] = []
    try:
        root = _root().through
        runs = [p for p in root.iterdir() if p.name.startswith(("run-", "launch-")) and p.is_dir()]
    except OSError:
        return removed
    for run in runs:
        try:
            had_owner = any(run.glob("owner-*.json"))
            if _live_owners(run):
                continue
            if not had_owner and time.time() - run.stat().st_mtime < RUN_GRACE_S:
                continue  # being made: its owner file comes next
        except FileNotFoundError:
            continue
        shutil.rmtree(run, ignore_errors=True)
        removed.append(run)
    return removed


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def machine_dir() -> Path:
    """The machine directory every user's runs share (not made here)."""
    return Path(os.path.abspath(os.environ.get(ROOT_ENV) or DEFAULT_ROOT))


def shared_machine_dir() -> Path:
    """The machine directory, made sticky and world-writable if missing; :class:`OSError`
    (:class:`~pytest_gpu.base.safefiles.Unsafe` among them) where it cannot be used so."""
    return shared_dir(machine_dir())


@dataclass(frozen=True)
class _Root:
    """A private root this process checked, and holds open from then on."""

    path: Path  # as every process names it
    fd: int
    ident: tuple[int, int]  # (st_dev, st_ino): what the name led to when checked

    @property
    def through(self) -> Path:
        """The directory reached through the descriptor (Linux: ``/proc/self/fd/N``), else by name."""
        anchor = Path(f"/proc/self/fd/{self.fd}")
        return anchor if self.held() and os.path.isdir(anchor) else self.path

    def held(self) -> bool:
        """Whether the descriptor still holds the directory checked, and it still exists."""
        try:
            info = os.fstat(self.fd)
        except OSError:
            return False  # closed by someone (a library closing every descriptor)
        return (info.st_dev, info.st_ino) == self.ident and info.st_nlink > 0


def private_root() -> Path:
    """This user's own directory (0700) for its private domains and simulated machines.

    ``user-<uid>`` in the machine directory; where that cannot be used safely,
    ``$XDG_RUNTIME_DIR/pytest-gpu-machines``, then ``~/.cache/pytest-gpu/machines-<host>``
    (one warning line); where none can, a new temporary directory for this process alone.

    Checked once, then held open: whoever owns the machine directory may rename
    ``user-<uid>`` and put a link or a directory of theirs in its place, so what this module
    does there goes through that descriptor (:func:`reach`: ``/proc/self/fd/N/...``), and no
    lock, ledger, socket or removal of this process's can be redirected. Each call looks
    whether the name still leads there, and where it does not says once, in one line, what
    it leads to instead, and returns the directory through the descriptor from then on."""
    root = _root()
    return root.path if _replaced(root) is None else root.through


def reach(path: Path) -> Path:
    """``path`` (in this user's private root, by name) through the root's descriptor: where
    this process's own directory is, whatever the name leads to now. Other paths as they are."""
    key = (str(machine_dir()), os.geteuid())
    root = _private_roots.get(key)
    if root is None or not (path == root.path or root.path in path.parents):
        return path
    root = _root()  # checked again: says what the name leads to, where it changed
    return root.through / path.relative_to(root.path)


def _root() -> _Root:
    key = (str(machine_dir()), os.geteuid())
    found = _private_roots.get(key)
    if found is not None and not found.held():  # removed (empty, by hand or a test): made anew
        del _private_roots[key]
        with contextlib.suppress(OSError):
            if (os.fstat(found.fd).st_dev, os.fstat(found.fd).st_ino) == found.ident:
                os.close(found.fd)  # still ours: a number closed by someone may be another's now
        found = None
    if found is not None:
        seen = _replaced(found)
        if seen is None:
            return found
        warn_once(
            f"replaced:{found.path}",
            f"{found.path} {seen} while this run used it (whoever owns {found.path.parent} may rename what is in it); "
            "this process keeps to its own directory, held open, and touches nothing there",
        )
        if found.through != found.path:
            return found
        del _private_roots[key]  # no descriptor to reach it through: choose again
    problems = []
    for candidate in _private_candidates():
        try:
            path = candidate()
            fd = open_private_dir(path)
        except OSError as exc:
            problems.append(str(exc) if exc.filename else f"{exc.strerror or exc}")
            continue
        if problems:
            warn_once(f"private:{key}", f"{problems[0]}; this user's runs meet in {path} instead")
        return _hold(key, path, fd)
    try:
        path = Path(tempfile.mkdtemp(prefix="pytest-gpu-machines-"))
        fd = open_private_dir(path)
    except OSError as exc:
        raise DomainError(exc.errno, exc.strerror or str(exc), str(machine_dir())) from exc
    warn_once(f"private:{key}", f"{'; '.join(problems)}; this run shares GPUs with no other run ({path})")
    return _hold(key, path, fd)


def _hold(key: tuple[str, int], path: Path, fd: int) -> _Root:
    info = os.fstat(fd)
    root = _private_roots[key] = _Root(path, fd, (info.st_dev, info.st_ino))
    return root


def _replaced(root: _Root) -> str | None:
    """What ``root``'s name leads to now, where that is not the directory checked (``None``: it is)."""
    try:
        info = os.lstat(root.path)
    except FileNotFoundError:
        return "was removed or renamed"
    except OSError as exc:
        return f"cannot be looked at ({exc.strerror or exc})"
    if (info.st_dev, info.st_ino) == root.ident:
        return None
    if stat.S_ISLNK(info.st_mode):
        return f"was replaced by a symbolic link of {user_name(info.st_uid)}'s"
    if info.st_uid != os.geteuid():
        return f"was replaced by a directory of {user_name(info.st_uid)}'s"
    return "was replaced by another directory"


def _private_candidates() -> list[Callable[[], Path]]:
    def in_machine_dir() -> Path:
        return shared_machine_dir() / f"user-{os.geteuid()}"

    def in_runtime_dir() -> Path:
        runtime = os.environ.get("XDG_RUNTIME_DIR", "")
        if not runtime:
            raise FileNotFoundError(2, "XDG_RUNTIME_DIR is not set", "XDG_RUNTIME_DIR")
        return Path(runtime) / "pytest-gpu-machines"

    def in_home() -> Path:
        cache = Path(os.path.expanduser("~")) / ".cache" / "pytest-gpu"
        cache.mkdir(parents=True, exist_ok=True, mode=0o700)
        return cache / f"machines-{_safe(socket.gethostname())}"

    return [in_machine_dir, in_runtime_dir, in_home]


@dataclass(frozen=True)
class Domain:
    """One set of GPUs that runs share: its name, who meets there, and its directory.

    ``path``: a private domain's directory (its lock and socket), a group-shared simulated
    machine's directory, or (the real GPUs) only a name. ``ledger`` (simulated machines):
    the ledger directory, the same whichever domain coordinates the machine's runs."""

    name: str
    path: Path
    wide: bool = False
    ledger: Path | None = None

    @classmethod
    def private(cls, name: str, ledger: Path | None = None) -> Domain:
        """This user's domain ``name``: only this user's runs meet there."""
        path = private_root() / _safe(name)
        private_dir(reach(path))
        return cls(name, path, wide=False, ledger=ledger if ledger is not None else path / LEDGER_DIR)

    @classmethod
    def machine_wide(cls, name: str, path: Path | None = None, ledger: Path | None = None) -> Domain:
        """Domain ``name`` where every user's runs meet (at an abstract socket)."""
        return cls(name, path if path is not None else machine_dir() / _safe(name), wide=True, ledger=ledger)

    @classmethod
    def real(cls) -> Domain:
        return cls.machine_wide(REAL)

    @classmethod
    def sim(cls, spec: str) -> Domain:
        """The simulated machine a run on ``spec`` uses: the run's own (see
        :func:`claim_run_machines`), one this user names, or, with
        ``$PYTEST_GPU_SIM_GROUP``, the group's (a directory only its members can enter,
        whose runs coordinate machine-wide).

        Where the group's directory cannot be used safely, this user's own machine (one
        warning line); :class:`ValueError` for a group that does not exist or that this user
        is not in."""
        name = f"sim-{sim_machine_name(spec)}"
        gid = sim_group()
        run = run_name()
        if gid is None and run is not None and not os.environ.get(SIM_MACHINE_ENV, "").strip():
            # the run's own: in its directory, which goes with the run (claim_run_machines)
            path = private_root() / run / _safe(f"sim-{spec}")
            private_dir(reach(path.parent))
            private_dir(reach(path))
            return cls(name, path, wide=False, ledger=path / LEDGER_DIR)
        if gid is None:
            return cls.private(name)
        try:
            path = group_dir(shared_machine_dir() / _safe(name), gid)
            ledger = group_dir(path / LEDGER_DIR, gid)
        except OSError as exc:  # its name taken by someone else (a link, a stranger's directory)
            warn_once(f"group:{name}", f"{exc}; this run uses a simulated machine of its user's own instead")
            return cls.private(name)
        return cls.machine_wide(name, path, ledger)

    def fallback(self) -> Domain:
        """Where this user's runs meet when this machine-wide domain cannot be used safely."""
        return Domain.private(self.name, ledger=self.ledger)

    @property
    def lock_path(self) -> Path:
        """Held (``flock``) by the run that is a private domain's arbiter (through the private
        root's descriptor: :func:`reach`)."""
        return reach(self.path / "arbiter.lock")

    @property
    def ledger_path(self) -> Path:
        """The simulated GPUs' ledger, for a simulated machine."""
        return self.ledger if self.ledger is not None else self.path / LEDGER_DIR

    def _presence_prefix(self) -> str:
        where = f"{machine_dir()}\0{self.name}" if self.wide else str(self.path)
        return f"\0pytest-gpu-present-{hashlib.sha256(where.encode()).hexdigest()[:24]}."

    def be_present(self, tag: str) -> socket.socket | None:
        """Say that a run (``tag``: the 20 hex digits of its roster digest) is attached here,
        for as long as the returned socket is open: an abstract name, which the kernel
        undoes when the process exits, SIGKILL included. ``None`` where it cannot be bound.

        Why: a run that wins an election without having heard a roster (it just arrived, as
        the arbiter's run left) learns from these names which runs will re-attach with
        leases it must not promise again (see :mod:`.link`)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(self._presence_prefix() + tag)  # bound, never listening: no one can connect
        except OSError:
            sock.close()
            return None
        return sock

    def present(self) -> set[str]:
        """The tags of the runs present here now (see :meth:`be_present`): the abstract names
        the kernel lists (``/proc/net/unix``), at most :data:`PRESENT_MAX`; none where it
        cannot be read. Anyone may bind such a name: a false one makes a new arbiter wait
        for a run that never comes, for ``RESUME_AFTER_S`` at most."""
        # bytes: no codec to import (a process may have given up the rights to read the stdlib)
        shown = b"@" + self._presence_prefix()[1:].encode()  # the kernel shows an abstract name's NUL as "@"
        found: set[str] = set()
        try:
            with open("/proc/net/unix", "rb") as table:
                for line in table:
                    name = line.rstrip(b"\n").rpartition(b" ")[2]
                    tag = name[len(shown) :]
                    if name.startswith(shown) and _TAG.fullmatch(tag):
                        found.add(tag.decode())
                        if len(found) >= PRESENT_MAX:
                            break
        except OSError:
            return set()
        return found

    def address(self) -> str:
        """The arbiter's socket: a machine-wide domain's abstract name (no file to leave
        behind, plant or swap: it vanishes with its process), or a private domain's socket
        file in its directory (through the private root's descriptor: :func:`reach`)."""
        if not self.wide:
            return str(reach(self.path / "arbiter.sock"))
        digest = hashlib.sha256(f"{machine_dir()}\0{self.name}".encode()).hexdigest()[:24]
        return f"\0pytest-gpu-{digest}"
