"""The suite's bounds on waits for processes scale with the machine's load (helpers.patience).

A fixed ``timeout=60`` on a process is a failure on a loaded 2-core machine, not a hang: every
bound a test puts on a process it started goes through ``patience``, which stretches it by the
load per CPU, up to ``MAX_SLOWDOWN`` times (a hang still fails). The check below reads the
test files' syntax: a process wait with a bare number for its timeout is named with its line.
"""

from __future__ import annotations

import ast
import os
import re
from types import SimpleNamespace

import pytest

import helpers
from helpers import MAX_SLOWDOWN, TESTS, patience, slowdown, wait_for

# calls that wait on a process: subprocess's, Popen's, pytester's, psutil's
PROCESS_WAITS = {"communicate", "runpytest_subprocess", "wait_procs", "check_output", "check_call"}
SUBPROCESS_RUNS = {"run", "call"}  # as subprocess.run / subprocess.call


def _machine(monkeypatch: pytest.MonkeyPatch, load: tuple[float, float, float], cpus: int) -> None:
    monkeypatch.setattr(os, "getloadavg", lambda: load)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)


def test_an_idle_machine_waits_the_idle_figure(monkeypatch: pytest.MonkeyPatch) -> None:
    _machine(monkeypatch, (0.3, 1.5, 2.0), cpus=2)
    assert slowdown() == 1.0
    assert patience(60) == 60


@pytest.mark.parametrize(
    ("load", "cpus", "factor"),
    [
        ((8.0, 2.0, 1.0), 2, 4.0),  # a burst that has just begun: the 1-minute figure
        ((1.0, 6.0, 9.0), 2, 3.0),  # one that has just ended: the 5-minute figure
        ((9.0, 9.0, 9.0), 16, 1.0),  # load 9 is nothing to 16 CPUs
        ((400.0, 300.0, 200.0), 2, MAX_SLOWDOWN),  # bounded: a hang still fails
    ],
    ids=["burst", "after-a-burst", "many-cpus", "capped"],
)
def test_a_loaded_machine_waits_longer(
    monkeypatch: pytest.MonkeyPatch, load: tuple[float, float, float], cpus: int, factor: float
) -> None:
    _machine(monkeypatch, load, cpus)
    assert slowdown() == factor
    assert patience(60) == 60 * factor


def test_wait_for_is_patient_and_still_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    _machine(monkeypatch, (8.0, 8.0, 8.0), cpus=2)
    clock = iter(float(n) for n in range(100))  # a second a poll: the bound is 4 x 5 s
    monkeypatch.setattr(helpers, "time", SimpleNamespace(monotonic=lambda: next(clock), sleep=lambda seconds: None))
    with pytest.raises(AssertionError, match=r"not within 20s \(5s on an idle machine\): the thing"):
        wait_for(lambda: False, timeout=5, what="the thing")


def _callee(call: ast.Call) -> tuple[str | None, str]:
    """``(object, name)`` of ``obj.name(...)``, ``(None, name)`` of ``name(...)``."""
    func = call.func
    if isinstance(func, ast.Attribute):
        owner = func.value.id if isinstance(func.value, ast.Name) else "?"
        return owner, func.attr
    return None, func.id if isinstance(func, ast.Name) else "?"


def _is_number(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool)


def fixed_process_waits(source: str) -> list[int]:
    """Lines of ``source`` that bound a wait on a process by a bare number (not ``patience(...)``):
    ``subprocess.run(..., timeout=60)``, ``proc.communicate(timeout=60)``, ``proc.wait(timeout=30)``,
    ``pytester.runpytest_subprocess(..., timeout=120)``, ``psutil.wait_procs(procs, timeout=5)``,
    and ``deadline = time.monotonic() + 60``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            owner, name = _callee(node)
            waits = (
                name in PROCESS_WAITS
                or (name in SUBPROCESS_RUNS and owner == "subprocess")
                or (name == "wait" and not node.args)  # Popen.wait(timeout=...), not queue.wait(key, timeout=...)
            )
            timeout = next((k.value for k in node.keywords if k.arg == "timeout"), None)
            if name == "wait_procs" and timeout is None and len(node.args) > 1:
                timeout = node.args[1]
            if waits and timeout is not None and _is_number(timeout):
                found.append(node.lineno)
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and isinstance(node.left, ast.Call):
            owner, name = _callee(node.left)
            if (owner, name) == ("time", "monotonic") and _is_number(node.right):
                found.append(node.lineno)
    return sorted(found)


# Deadlines that bound the plugin's own timing, or threads of this process, not a process's
# progress: they are what the test asserts, and stretching them would hide a regression.
NOT_A_PROCESS_WAIT = {
    ("test_compat_lease_cancel.py", "within --timeout=3"),
}


def test_the_check_sees_each_form() -> None:
    source = """
import subprocess, time, psutil
subprocess.run(["x"], timeout=60)
proc.communicate(timeout=60)
proc.wait(timeout=30)
pytester.runpytest_subprocess("-q", timeout=120)
psutil.wait_procs(procs, timeout=5)
deadline = time.monotonic() + 60
subprocess.run(["x"], timeout=patience(60))
proc.wait(timeout=patience(30))
events.wait("c0/k0", timeout=1.0)
client.acquire(request, "t", timeout=5)
deadline = time.monotonic() + patience(60)
"""
    assert fixed_process_waits(source) == [3, 4, 5, 6, 7, 8]


# what a file must hold for fixed_process_waits to find anything (ruff format spells it so):
# the files without it are not parsed, half of the suite's source
CANDIDATE = re.compile(r"timeout=[0-9]|monotonic\(\) \+ [0-9]|wait_procs\(")


def test_no_process_wait_in_the_suite_has_a_fixed_bound() -> None:
    offenders = []
    paths = sorted(TESTS.rglob("*.py"))
    assert len({path.parent for path in paths}) > 10, "the scan must reach every folder of the suite"
    for path in paths:
        text = path.read_text(encoding="utf-8")
        if not CANDIDATE.search(text):
            continue
        lines = text.splitlines()
        for lineno in fixed_process_waits(text):
            line = lines[lineno - 1].strip()
            if any(path.name == name and mark in line for name, mark in NOT_A_PROCESS_WAIT):
                continue
            offenders.append(f"{path.relative_to(TESTS)}:{lineno}: {line}")
    assert not offenders, "a bare number bounds a wait on a process; use helpers.patience(...):\n" + "\n".join(
        offenders
    )
