"""The SSH launch shim of ``--gpu-nodes=ssh:...``: ``python -m pytest_gpu.nodes.sshgate HOST CWD PYTHON ARG...``.

execnet starts a popen gateway as ``<python> -u -c <bootstrap line>``; as the ``python``
of a popen spec, this shim turns that into one ``ssh`` whose remote command is quoted for
the remote shell (ssh joins its arguments with spaces and hands them to that shell, which
would split the bootstrap line's ``;`` and parentheses), and which first enters the
controller's working directory there (the nodes share the filesystem). The gateway's
channel is ssh's stdin and stdout; ``BatchMode`` makes a host that asks for a password
fail at once instead of hanging the run, and ``ConnectTimeout`` one that does not answer.
Nothing secret is on this command line: the broker's key travels later, over the channel.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Sequence

SSH_ENV = "PYTEST_GPU_SSH"  # the ssh client to run (default: ssh); tests put a local stand-in here


def command(host: str, cwd: str, argv: Sequence[str], ssh: str = "ssh") -> list[str]:
    """The ssh command line that runs ``argv`` in ``cwd`` on ``host`` (pure)."""
    remote = f"cd {shlex.quote(cwd)} && exec {' '.join(shlex.quote(a) for a in argv)}"
    # ConnectTimeout: execnet waits for the gateway without a timeout of its own
    return [*shlex.split(ssh), "-T", "-o", "BatchMode=yes", "-o", "ConnectTimeout=30", host, remote]


def main(args: Sequence[str]) -> int:
    """Replace this process by the ssh command (see :func:`command`)."""
    if len(args) < 3:
        print("usage: python -m pytest_gpu.nodes.sshgate HOST CWD PYTHON [ARG...]", file=sys.stderr)
        return 2
    host, cwd, *argv = args
    cmd = command(host, cwd, argv, os.environ.get(SSH_ENV, "").strip() or "ssh")
    os.execvp(cmd[0], cmd)
    return 1  # not reached: execvp replaces the process or raises


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
