"""Exchanging JSON documents between the ranks of a launch through a shared directory.

A directory is the one channel every launcher and cluster offers (the log directory is
on a shared file system on clusters; node-local ``/tmp`` is not assumed to be). Each
rank writes its document atomically; readers wait for all of them up to a timeout, so a
rank that died or hangs is reported instead of waited for forever.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

POLL = 0.1  # a shared file system offers no change notification across nodes


def publish(directory: Path, name: str, rank: int, document: dict[str, Any]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"{name}-rank{rank}.json"
    tmp = directory / f".{name}-rank{rank}.json.tmp{os.getpid()}"
    tmp.write_text(json.dumps(document))
    os.replace(tmp, final)


def collect(
    directory: Path, name: str, world_size: int, timeout: float, ranks: list[int] | None = None
) -> dict[int, dict[str, Any]]:
    """Every rank's (or ``ranks``') document that arrived within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    wanted = list(range(world_size)) if ranks is None else ranks
    found: dict[int, dict[str, Any]] = {}
    while True:
        for rank in wanted:
            if rank in found:
                continue
            path = directory / f"{name}-rank{rank}.json"
            try:
                found[rank] = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
        if len(found) == len(wanted) or time.monotonic() >= deadline:
            return found
        time.sleep(POLL)
