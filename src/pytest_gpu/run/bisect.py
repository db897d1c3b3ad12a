"""``--gpu-bisect``: the smallest memory per GPU a test passes with, found by rerunning it alone
under caps, each try a fresh pytest (a fresh process and lease holding exactly the cap), as
ai-dynamo's profiler does. A caching allocator's test often passes under less than its peak.

:func:`search` is the bisection (pure); :func:`fresh_try` one try.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .written import STEP, Entry, Written, render

TRY_TIMEOUT_S = 600.0  # one try: the test, alone, with a pytest's start


class BisectError(RuntimeError):
    """A try that neither passed nor failed (a usage error, the test skipped or not found)."""


@dataclass(frozen=True)
class Found:
    """What bisecting a test found: it passes under ``passes`` and fails under ``fails``
    (within one :data:`STEP`; ``passes`` is ``None`` when it failed even under ``most``)."""

    passes: int | None
    fails: int
    tries: int


def search(passes: Callable[[int], bool], start: int, most: int, step: int = STEP) -> Found:
    """The smallest multiple of ``step`` (to within one step) under which ``passes``: from
    ``start`` (doubled until it passes, at most ``most``), then halving the gap to the largest
    cap it failed under (0 at first)."""
    tries = 0

    def tried(cap: int) -> bool:
        nonlocal tries
        tries += 1
        return passes(cap)

    low, high = 0, max(-(-start // step) * step, step)
    while not tried(high):
        if high >= most:
            return Found(None, high, tries)
        low, high = high, min(high * 2, most)
    while high - low > step:
        middle = max((low + high) // 2 // step * step, low + step)
        if tried(middle):
            high = middle
        else:
            low = middle
    return Found(high, low, tries)


def fresh_try(nodeid: str, cap: int, *, gpus: str, cwd: str, plugins: Sequence[str], workdir: str) -> bool:
    """Run test ``nodeid`` alone in a fresh pytest with ``cap`` bytes per GPU (its line in a
    requests file of its own): whether it passed; raises :class:`BisectError` when it neither
    passed nor failed. ``plugins``: the run's own ``-p`` arguments; the ini's addopts (``-n``)
    are dropped, as is PYTEST_ADDOPTS."""
    fd, path = tempfile.mkstemp(prefix="bisect-", suffix=".txt", dir=workdir)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(render(Written(entries={nodeid: Entry(cap)})))
    command = [
        sys.executable, "-m", "pytest", nodeid, "-q", "-p", "no:cacheprovider", *plugins,
        "-o", "addopts=", "-o", "gpu_write_requests=false", "-o", "gpu_check_requests=false",
        "--gpus", gpus, "--gpu-requests", path,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    try:
        done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=TRY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise BisectError(f"{nodeid} did not finish in {TRY_TIMEOUT_S:g}s under a cap") from None
    finally:
        os.unlink(path)
    out = done.stdout + done.stderr
    if done.returncode == 0 and re.search(r"\b1 passed\b", out):
        return True
    if done.returncode == 1 and re.search(r"\b1 (failed|error)\b", out):
        return False
    tail = "\n".join(out.strip().splitlines()[-5:])
    raise BisectError(f"{nodeid} neither passed nor failed alone (exit {done.returncode}): {tail}")
