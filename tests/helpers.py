"""Helper functions shared by several test files: ``from helpers import wait_for``.

Fixtures, ``require`` and the tiers live in ``conftest.py``; what one test file alone
needs stays in that file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pwd
import secrets
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import psutil
import pytest

from pytest_gpu.base.requests import GpuRequest
from pytest_gpu.leasing.view import NodeView
from pytest_gpu.scheduling.planner import Grant, Job, Order, Planner

T = TypeVar("T")

# -- where things are ------------------------------------------------------------------------

#: The suite's folder (tests/): its shared modules, tools/, and a folder per subsystem.
TESTS = Path(__file__).resolve().parent
#: The repository: src/, docs/, examples/, bench/, pyproject.toml.
ROOT = TESTS.parent

# -- bounds on waits, scaled by the machine's load ----------------------------------------

# A loaded machine stretches a bound at most this much: a hang still fails, in finite time.
MAX_SLOWDOWN = 8.0


def slowdown() -> float:
    """How many times longer than on an idle machine a process takes now, as far as the load
    shows: the load average per CPU this process may run on (the larger of the 1- and
    5-minute averages: a burst that has just begun shows in the first, one that has just
    ended still in the second); at least 1, at most :data:`MAX_SLOWDOWN`."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    one, five, _ = os.getloadavg()
    return min(max(1.0, max(one, five) / max(cpus, 1)), MAX_SLOWDOWN)


def patience(seconds: float) -> float:
    """The bound on a wait that takes at most ``seconds`` on an idle machine, on this machine
    now: ``seconds`` times :func:`slowdown`.

    Every fixed bound of a test on a process it started (``subprocess.run(timeout=...)``,
    ``communicate``, ``wait``, ``runpytest_subprocess``, a deadline polled for a process's
    event) is ``patience(idle figure)``: a shared 2-core runner under load is no failure, and
    a hang still is one (the bound stays finite). Not for a timeout the test hands the plugin
    (``--timeout=3``, ``acquire(timeout=...)``, ``--gpu-wait-timeout``): that is what it tests.
    ``tests/project/test_patience.py`` checks that no process wait in tests/ has a bare number."""
    return seconds * slowdown()


def wait_for(condition: Callable[[], T], timeout: float = 5.0, what: str = "condition", interval: float = 0.005) -> T:
    """Poll ``condition`` until it returns something true, and return that; fail the test
    naming ``what`` after ``patience(timeout)`` seconds (``timeout``: the idle machine's bound)."""
    bound = patience(timeout)
    deadline = time.monotonic() + bound
    while not (value := condition()):
        assert time.monotonic() < deadline, f"not within {bound:.3g}s ({timeout:g}s on an idle machine): {what}"
        time.sleep(interval)
    return value


# -- GPU requests --------------------------------------------------------------------------


def user_dir(machines: Path) -> Path:
    """This user's own directory in the machine directory ``machines`` (its private domains
    and simulated machines, see pytest_gpu.machine.domain)."""
    return machines / f"user-{os.geteuid()}"


def whole(count: int = 1, at_least: int | None = None) -> GpuRequest:
    """``count`` whole GPUs (exclusive), each with at least ``at_least`` bytes if given."""
    return GpuRequest(count=count, memory=None, exclusive=True, min_memory=at_least)


def shared(memory: int, count: int = 1) -> GpuRequest:
    """``memory`` bytes on each of ``count`` shared GPUs."""
    return GpuRequest(count=count, memory=memory, exclusive=False)


# -- inner runs ------------------------------------------------------------------------------


def cached_args(pytester: pytest.Pytester) -> tuple[str, ...]:
    """As conftest's INNER_ARGS, but with pytest's cache on, kept inside the pytester directory."""
    from conftest import INNER_ARGS

    plugins = [
        arg
        for pair in zip(INNER_ARGS[::2], INNER_ARGS[1::2], strict=True)
        if pair[1] != "no:cacheprovider"
        for arg in pair
    ]
    return (*plugins, "-o", f"cache_dir={pytester.path / '.pytest_cache'}")


def by_group(groups: dict[str, str]) -> dict[str, set[str]]:
    """Node id -> group id, turned into group id -> its members' node ids."""
    out: dict[str, set[str]] = {}
    for nodeid, group in groups.items():
        out.setdefault(group, set()).add(nodeid)
    return out


def load_trace(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A ``--gpu-trace`` file: its events, and pytest-gpu's own data about the run."""
    data = json.loads(path.read_text())
    return data["traceEvents"], data["otherData"]["pytest_gpu"]


# -- processes ---------------------------------------------------------------------------

RANKMAIN = "pytest_gpu.distributed.rankmain"


def rank_processes(var: str, mark: str) -> list[str]:
    """Rank processes (and their launchers) still alive whose environment has ``var=mark``:
    those of the inner run that a test marked so; ``pid: command line`` each."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            cmdline = " ".join(proc.info["cmdline"] or ())
            if RANKMAIN in cmdline and proc.environ().get(var) == mark:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(f"{proc.pid}: {cmdline}")
        except psutil.Error:
            continue
    return found


@contextlib.contextmanager
def throwaway_user(prefix: str) -> Iterator[pwd.struct_passwd]:
    """A Unix user made for a test (root only) and removed after it, its processes first."""
    name = f"{prefix}{secrets.token_hex(3)}"
    subprocess.run(
        ["useradd", "--no-create-home", "--user-group", "--shell", "/bin/false", name], check=True, capture_output=True
    )
    entry = pwd.getpwnam(name)
    try:
        yield entry
    finally:
        subprocess.run(["pkill", "-KILL", "-u", name], capture_output=True)
        wait_for(
            lambda: (
                not [p for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real == entry.pw_uid]
            ),
            timeout=10,
            what=f"the processes of {name} gone",
        )
        subprocess.run(["userdel", name], check=True, capture_output=True)
        subprocess.run(["groupdel", name], capture_output=True)  # gone with the user where USERGROUPS_ENAB


# -- the planner ---------------------------------------------------------------------------

NODE = "m"  # the one node of a planner made by one_node (a run on one machine)


def one_node(jobs: Iterable[Job], room: Sequence[int], order: Order | None = None) -> Planner:
    """A planner of ``jobs`` over one node whose GPUs have ``room``: a run on one machine."""
    planner = Planner(jobs, order)
    planner.nodes = {NODE: NodeView(tuple(room))}
    return planner


def see(
    planner: Planner, node: str = NODE, *, placed: Mapping[str, Sequence[Grant]] | None = None, **changes: Any
) -> None:
    """``node``'s view changed as the scheduler's next refresh reads it: ``changes`` to its
    :class:`NodeView` fields, ``placed`` its grants (worker -> Grants at the planner's positions)."""
    if placed is not None:
        changes["placements"] = {w: [(g.gpus, g.memory) for g in grants] for w, grants in placed.items()}
    if "room" in changes and "order" not in changes:
        changes["order"] = ()  # positions as the new room's
    planner.nodes = {**planner.nodes, node: dataclasses.replace(planner.nodes[node], **changes)}


def as_other_user(uid: int, body: Callable[[], Any]) -> Any:
    """``body()``'s JSON-able result, computed in a forked child that is user ``uid`` in no
    group (skipped where this process cannot change user: not root)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as another user")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            out = json.dumps({"ok": body()})
        except BaseException as exc:
            out = json.dumps({"error": f"{type(exc).__name__}: {exc}"})
        os.write(write, out.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        result = json.loads(pipe.read() or b'{"error": "no answer"}')
    os.waitpid(pid, 0)
    assert "error" not in result, result["error"]
    return result["ok"]
