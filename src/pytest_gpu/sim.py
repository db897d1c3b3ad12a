"""Simulated GPU memory: a cross-process ledger that behaves like device memory.

This is the "physics" the project is tested against, independent of the broker: any
process (a pytest worker, a test's subprocess, a plain ``pytest -p no:gpu`` run) that
calls :func:`allocate` charges memory on a simulated device, and over-committing a
device raises :class:`OutOfMemoryError` — so a broker bug shows up as an OOM.

Like CUDA:

- ``device`` is relative to ``CUDA_VISIBLE_DEVICES`` (indices or simulated UUIDs), read
  at each call; the default device is 0;
- the first use of a device by a process charges a context overhead, kept until the
  process exits;
- when a process dies its memory and contexts are freed (checked lazily on the next
  ledger operation, with the process's start time so a recycled pid does not count).

Unlike CUDA, an allocation is not freed when its handle is garbage-collected: it is a
raw ``cudaMalloc``, freed by :meth:`Allocation.free` or by leaving its ``with`` block.

The ledger lives in the directory named by ``PYTEST_GPU_SIM_LEDGER`` (the plugin sets
it for its run); without it, in a per-user default directory for the device spec in
``PYTEST_GPU_SIM`` (default ``sim:4x16GiB``).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .devices import Device, parse_sim_spec
from .requests import format_size, parse_size

LEDGER_ENV = "PYTEST_GPU_SIM_LEDGER"
SPEC_ENV = "PYTEST_GPU_SIM"
OVERHEAD_ENV = "PYTEST_GPU_CONTEXT_OVERHEAD"
TAG_ENV = "PYTEST_GPU_SIM_TAG"
DEFAULT_SPEC = "sim:4x16GiB"
DEFAULT_OVERHEAD = 500 * 2**20

__all__ = [
    "Allocation",
    "OutOfMemoryError",
    "SimDeviceError",
    "allocate",
    "hold",
    "usage",
]


class OutOfMemoryError(MemoryError):
    """A simulated device (or this process's cap on it) has too little free memory."""


class SimDeviceError(RuntimeError):
    """An invalid device ordinal, as CUDA reports it."""


@dataclass
class TagUsage:
    """What the processes working under one tag (one test) used, per physical device."""

    peak: dict[int, int] = field(default_factory=dict)
    current: dict[int, int] = field(default_factory=dict)
    touched: set[int] = field(default_factory=set)


def default_ledger_dir(spec: str) -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR") or os.path.join(os.path.expanduser("~"), ".cache")
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", spec)
    return Path(base) / "pytest-gpu" / f"sim-ledger-{safe}"


def _ledger_dir() -> tuple[Path, str]:
    spec = os.environ.get(SPEC_ENV) or DEFAULT_SPEC
    configured = os.environ.get(LEDGER_ENV)
    return (Path(configured) if configured else default_ledger_dir(spec)), spec


def _proc_start(pid: int) -> float | None:
    import psutil  # imported on use: the plugin imports this module in every process

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None  # dead, not yet reaped (xdist leaves crashed workers so): its memory is gone
        return proc.create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


class Ledger:
    """One ledger directory: ``ledger.json`` guarded by ``ledger.lock``."""

    def __init__(self, path: Path, spec: str | None = None, overhead: int | None = None) -> None:
        self.path = Path(path)
        self.spec = spec
        self.overhead = overhead
        from filelock import FileLock

        self._lock = FileLock(str(self.path / "ledger.lock"))
        self._devices: list[Device] | None = None

    @classmethod
    def create(cls, path: Path, spec: str, overhead: int) -> Ledger:
        """Start a fresh ledger for ``spec`` (the plugin does this once per run)."""
        path.mkdir(parents=True, exist_ok=True)
        ledger = cls(path, spec, overhead)
        with ledger._lock:
            ledger._write(ledger._fresh())
        return ledger

    def _fresh(self) -> dict[str, Any]:
        spec = self.spec or DEFAULT_SPEC
        devices = parse_sim_spec(spec)
        overhead = self.overhead
        if overhead is None:
            raw = os.environ.get(OVERHEAD_ENV)
            overhead = parse_size(raw) if raw else DEFAULT_OVERHEAD
        return {
            "spec": spec,
            "overhead": overhead,
            "devices": [[d.uuid, d.total_memory] for d in devices],
            "procs": {},
            "tags": {},
        }

    def _write(self, state: dict[str, Any]) -> None:
        tmp = self.path / f"ledger.json.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.path / "ledger.json")

    @contextmanager
    def _state(self, *, write: bool = True, prune: bool = True) -> Iterator[dict[str, Any]]:
        """The ledger under its lock; ``write=False`` for a read-only look, ``prune=False``
        where what dead processes held cannot change the answer (it is pruned on the next write)."""
        self.path.mkdir(parents=True, exist_ok=True)
        with self._lock:
            file = self.path / "ledger.json"
            fresh = False
            if file.exists():
                state = json.loads(file.read_text())
                if self.spec and state["spec"] != self.spec and not self._live(state):
                    state, fresh = self._fresh(), True
            else:
                state, fresh = self._fresh(), True
            if prune:
                self._prune(state)
            yield state
            if write or fresh:
                self._write(state)

    @staticmethod
    def _live(state: dict[str, Any]) -> bool:
        return any(_proc_start(int(pid)) == rec["ctime"] for pid, rec in state["procs"].items())

    def _prune(self, state: dict[str, Any]) -> None:
        """Free what dead processes held, as the driver does when a process exits."""
        for pid in list(state["procs"]):
            if _proc_start(int(pid)) != state["procs"][pid]["ctime"]:
                del state["procs"][pid]

    # -- queries -------------------------------------------------------------------

    def devices(self) -> list[Device]:
        if self._devices is None:  # fixed for the ledger's life: read once per process
            with self._state(write=False, prune=False) as state:
                self._devices = [
                    Device(i, uuid, total, f"Simulated GPU {format_size(total)}", True)
                    for i, (uuid, total) in enumerate(state["devices"])
                ]
        return list(self._devices)

    def used(self) -> dict[int, int]:
        """Bytes in use per physical device, contexts included."""
        with self._state(write=False) as state:
            return {i: _device_used(state, i) for i in range(len(state["devices"]))}

    def tag_usage(self, tag: str, *, drop: bool = False) -> TagUsage:
        """Peak, current use and touched devices of ``tag``; ``drop`` forgets the tag."""
        with self._state(write=drop) as state:
            rec = state["tags"].get(tag)
            result = TagUsage()
            if rec is not None:
                result.peak = {int(k): v for k, v in rec["peak"].items()}
                result.touched = {int(k) for k in rec["touched"]}
                result.current = {i: used for i in range(len(state["devices"])) if (used := _tag_used(state, tag, i))}
            if drop:
                state["tags"].pop(tag, None)
            return result

    def contexts_of(self, pid: int) -> set[int]:
        """Physical devices on which process ``pid`` has a context."""
        with self._state(write=False) as state:
            proc = state["procs"].get(str(pid))
            return {int(k) for k in proc["ctx"]} if proc else set()

    def begin_tag(self, tag: str, owner: int) -> None:
        """Start accounting ``tag``; contexts of ``owner`` are not charged to it."""
        with self._state(prune=False) as state:
            state["tags"][tag] = {"owner": owner, "peak": {}, "touched": []}

    # -- allocation ----------------------------------------------------------------

    def allocate(self, nbytes: int, physical: int, tag: str | None, cap: int | None) -> str:
        pid = os.getpid()
        with self._state() as state:
            if not 0 <= physical < len(state["devices"]):
                raise SimDeviceError(f"invalid device ordinal: simulated GPU {physical} does not exist")
            uuid, total = state["devices"][physical]
            proc = state["procs"].setdefault(str(pid), {"ctime": _proc_start(pid), "ctx": {}, "allocs": {}, "seq": 0})
            new_ctx = str(physical) not in proc["ctx"]
            need = nbytes + (state["overhead"] if new_ctx else 0)
            used = _device_used(state, physical)
            if used + need > total:
                holders = _holders(state, physical)
                raise OutOfMemoryError(
                    f"Simulated CUDA out of memory on GPU {physical} ({uuid}): tried to allocate "
                    f"{format_size(nbytes)}{' + context' if new_ctx else ''}; "
                    f"{format_size(used)} of {format_size(total)} in use ({holders}), "
                    f"{format_size(total - used)} free. (pid {pid})"
                )
            if cap is not None:
                mine = sum(n for d, n, _ in proc["allocs"].values() if d == physical)
                if mine + nbytes > cap:
                    raise OutOfMemoryError(
                        f"Simulated CUDA out of memory on GPU {physical}: tried to allocate "
                        f"{format_size(nbytes)}; this process already holds {format_size(mine)} and "
                        f"is capped at {format_size(cap)} (its pytest-gpu lease). (pid {pid})"
                    )
            if new_ctx:
                proc["ctx"][str(physical)] = tag
            proc["seq"] += 1
            handle = f"{pid}:{proc['seq']}"
            proc["allocs"][handle] = [physical, nbytes, tag]
            if tag is not None and tag in state["tags"]:
                rec = state["tags"][tag]
                if physical not in rec["touched"]:
                    rec["touched"].append(physical)
                now = _tag_used(state, tag, physical)
                key = str(physical)
                rec["peak"][key] = max(rec["peak"].get(key, 0), now)
            return handle

    def free(self, handle: str) -> None:
        pid = handle.split(":", 1)[0]
        with self._state(prune=False) as state:
            proc = state["procs"].get(pid)
            if proc is not None:
                proc["allocs"].pop(handle, None)


def _device_used(state: dict[str, Any], physical: int) -> int:
    total = 0
    for proc in state["procs"].values():
        if str(physical) in proc["ctx"]:
            total += state["overhead"]
        total += sum(n for d, n, _ in proc["allocs"].values() if d == physical)
    return total


def _tag_used(state: dict[str, Any], tag: str, physical: int) -> int:
    owner = str(state["tags"].get(tag, {}).get("owner"))
    total = 0
    for pid, proc in state["procs"].items():
        if pid != owner and proc["ctx"].get(str(physical), "\0") == tag:
            total += state["overhead"]
        total += sum(n for d, n, t in proc["allocs"].values() if d == physical and t == tag)
    return total


def _holders(state: dict[str, Any], physical: int) -> str:
    parts = []
    for pid, proc in state["procs"].items():
        mine = sum(n for d, n, _ in proc["allocs"].values() if d == physical)
        if mine or str(physical) in proc["ctx"]:
            parts.append(f"pid {pid}: {format_size(mine)}")
    return ", ".join(parts) or "contexts only"


# -- the public, CUDA-like API ---------------------------------------------------------

_caps: dict[int, int] = {}


def set_memory_cap(physical: int, nbytes: int | None) -> None:
    """Cap this process's allocations on a physical device (the simulated analogue of
    ``torch.cuda.set_per_process_memory_fraction``); ``None`` lifts the cap."""
    if nbytes is None:
        _caps.pop(physical, None)
    else:
        _caps[physical] = nbytes


def ledger() -> Ledger:
    """The ledger this process uses (from the environment, as the plugin set it)."""
    path, spec = _ledger_dir()
    key = (str(path), spec)
    found = _ledgers.get(key)
    if found is None:  # one per ledger and process: its lock and device list are reused
        found = _ledgers[key] = Ledger(path, spec)
    return found


_ledgers: dict[tuple[str, str | None], Ledger] = {}


def resolve_device(device: int | None, uuids: list[str]) -> int:
    """Physical index of ``device`` as this process sees it through CUDA_VISIBLE_DEVICES."""
    ordinal = 0 if device is None else device
    if isinstance(ordinal, bool) or not isinstance(ordinal, int):
        raise SimDeviceError(f"device must be an int ordinal, got {device!r}")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        order = list(range(len(uuids)))
    else:
        order = []
        for raw in visible.split(","):
            entry = raw.strip()
            if entry.isdigit() and int(entry) < len(uuids):
                idx = int(entry)
            elif entry and entry in uuids:
                idx = uuids.index(entry)
            else:
                break  # like CUDA: an invalid entry ends the list
            if idx in order:
                break
            order.append(idx)
    if not 0 <= ordinal < len(order):
        raise SimDeviceError(
            f"invalid device ordinal {ordinal}: this process sees {len(order)} simulated GPU(s) "
            f"(CUDA_VISIBLE_DEVICES={visible!r})"
        )
    return order[ordinal]


class Allocation:
    """Simulated device memory; free it with :meth:`free` or a ``with`` block."""

    def __init__(self, ledger_: Ledger, handle: str, nbytes: int, device: int, physical: int) -> None:
        self._ledger = ledger_
        self._handle: str | None = handle
        self.nbytes = nbytes
        self.device = device
        self.physical = physical

    def free(self) -> None:
        if self._handle is not None:
            self._ledger.free(self._handle)
            self._handle = None

    @property
    def freed(self) -> bool:
        return self._handle is None

    def __enter__(self) -> Allocation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    def __repr__(self) -> str:
        state = "freed" if self.freed else "live"
        return f"<sim.Allocation {format_size(self.nbytes)} on cuda:{self.device} (GPU {self.physical}) {state}>"


def allocate(nbytes: int | str, device: int | None = None) -> Allocation:
    """Allocate simulated memory on ``device`` (relative to CUDA_VISIBLE_DEVICES).

    Raises :class:`OutOfMemoryError` when the device or this process's cap is exceeded.
    """
    size = parse_size(nbytes)
    led = ledger()
    uuids = [d.uuid for d in led.devices()]
    physical = resolve_device(device, uuids)
    handle = led.allocate(size, physical, os.environ.get(TAG_ENV), _caps.get(physical))
    return Allocation(led, handle, size, 0 if device is None else device, physical)


def hold(nbytes: int | str, seconds: float, device: int | None = None) -> None:
    """Allocate ``nbytes``, sleep ``seconds``, free: a stand-in for a GPU kernel's work."""
    with allocate(nbytes, device):
        time.sleep(seconds)


def usage() -> dict[int, int]:
    """Bytes in use per physical simulated device, contexts included."""
    return ledger().used()
