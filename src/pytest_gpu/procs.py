"""Ending process trees (rank pools, the Ray head): one way to do it, used by both."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import psutil


def kill_and_wait(procs: Sequence[psutil.Process], timeout: float = 5.0) -> None:
    """SIGKILL every process of ``procs`` still alive, then wait up to ``timeout`` for them all."""
    import psutil

    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=timeout)
