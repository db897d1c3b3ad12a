"""The head's watchdog: ``python -m pytest_gpu.raycluster.watchdog --owner PID --owner-ctime T -- ray start ...``.

It is an executable of its own so that the head outlives no run: started in a new
process session, it runs ``ray start --head --block`` as its child, so every Ray process
of our head is in the watchdog's session and the sweep at the end kills exactly those,
and nothing else. It stops the head when told to (SIGTERM from :func:`.stop.stop`) and
also when the run's owner process is gone, even after a SIGKILL, so a crashed run leaves
no cluster behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from ..base.procs import owner_alive
from .stop import STOP_GRACE, kill_session


def _die_with_parent() -> None:  # pragma: no cover - runs in the forked child
    """Linux: SIGTERM this child when the watchdog dies, however it dies."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def watch(owner_pid: int, owner_ctime: float, command: Sequence[str], poll: float = 0.5) -> int:
    """Run ``command`` (the head) until it exits, the owner dies or this process is told to stop.

    Then give the head ``STOP_GRACE`` seconds to drain after SIGTERM and SIGKILL what is
    left of this process's session. Returns 0 when it stopped the head, else the head's
    own exit status.
    """
    stopping: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        stopping.append(signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, on_signal)
    preexec = _die_with_parent if sys.platform.startswith("linux") else None
    child = subprocess.Popen(list(command), preexec_fn=preexec)  # the watchdog has one thread
    while not stopping and child.poll() is None and owner_alive(owner_pid, owner_ctime):
        time.sleep(poll)
    exited = child.poll()  # None: stopped by us (owner gone or told to), not on its own
    if exited is None:
        child.terminate()
        try:
            child.wait(STOP_GRACE)
        except subprocess.TimeoutExpired:
            pass
    kill_session(os.getsid(0), exclude=(os.getpid(),))
    if exited is None:
        return 0
    return exited if exited >= 0 else 128 - exited


def main(argv: Sequence[str] | None = None) -> int:
    """The watchdog's command line (see :func:`watch`)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m pytest_gpu.raycluster.watchdog", description=watch.__doc__)
    parser.add_argument("--owner", type=int, required=True, help="pid of the run's owner process")
    parser.add_argument("--owner-ctime", type=float, required=True, help="its create time (psutil)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- ray start --head --block ...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    return watch(args.owner, args.owner_ctime, command)


if __name__ == "__main__":
    sys.exit(main())
