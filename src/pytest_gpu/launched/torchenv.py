"""torch.distributed's variables for the ranks of mpirun and srun, which do not set them.

torchrun gives each rank ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``; mpirun and srun give only their own (``OMPI_COMM_WORLD_*``,
``SLURM_*``), so ``init_process_group(init_method="env://")`` fails under them with
"RANK expected, but not set". Each rank sets the variables that are absent from its
place in the launch (:class:`~pytest_gpu.base.launch.LaunchContext`). The master is
rank 0's host, and its port one rank 0 found free there: rank 0 publishes both through the
gather directory, every other rank reads them (so all agree, on one node or many).
"""

from __future__ import annotations

import os
import socket
from collections.abc import MutableMapping
from pathlib import Path

from ..base.launch import LaunchContext
from . import gather

LAUNCHERS = ("mpirun", "srun")  # torchrun sets the variables itself
VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
DOCUMENT = "torch-master"


def rank_variables(ctx: LaunchContext) -> dict[str, str]:
    """This rank's place, in torch's words."""
    return {
        "RANK": str(ctx.rank),
        "WORLD_SIZE": str(ctx.world_size),
        "LOCAL_RANK": str(ctx.local_rank),
        "LOCAL_WORLD_SIZE": str(ctx.local_size),
    }


def free_port() -> int:
    """A TCP port free on this host now (rank 0 binds it again moments later, as torchrun's does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def master(ctx: LaunchContext, directory: Path, timeout: float) -> tuple[str, str] | None:
    """(MASTER_ADDR, MASTER_PORT) of this launch: rank 0 chooses and publishes them, the
    others wait for them up to ``timeout`` seconds (``None`` if rank 0 never said)."""
    if ctx.is_root:
        address, port = socket.gethostname(), str(free_port())
        gather.publish(directory, DOCUMENT, 0, {"run": ctx.run_id, "addr": address, "port": port})
        return address, port
    found = gather.collect(directory, DOCUMENT, ctx.world_size, timeout, ranks=[0]).get(0)
    if found is None or found.get("run") != ctx.run_id:
        return None
    return checked_master(found.get("addr"), found.get("port"))


def checked_master(addr: object, port: object) -> tuple[str, str] | None:
    """What rank 0 published, if it reads as a host and a port (it crossed a file: a torn or
    foreign document gives ``None``, and the rank's place is set without a master)."""
    if not isinstance(addr, str) or not isinstance(port, str):
        return None
    if not 0 < len(addr) <= 255 or any(c.isspace() or not c.isprintable() for c in addr):
        return None
    if not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        return None
    return addr, port


def provide(
    ctx: LaunchContext, directory: Path, timeout: float, environ: MutableMapping[str, str] | None = None
) -> dict[str, str]:
    """Set the torch variables absent from ``environ`` (``os.environ``) under mpirun or srun.

    A variable already set (by the user, or by ``mpirun -x``) is kept. Returns what was set.
    """
    env = os.environ if environ is None else environ
    if ctx.launcher not in LAUNCHERS:
        return {}
    wanted = {k: v for k, v in rank_variables(ctx).items() if k not in env}
    if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        agreed = master(ctx, directory, timeout)
        if agreed is not None:
            for name, value in zip(("MASTER_ADDR", "MASTER_PORT"), agreed, strict=True):
                if name not in env:
                    wanted[name] = value
    env.update(wanted)
    return wanted
