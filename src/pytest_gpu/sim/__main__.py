"""``python -m pytest_gpu.sim``: tools for the simulated machines.

``hold --gpu I --memory SIZE [--seconds S] [--machine NAME] [--spec SPEC]``
    A *foreign process*: a process outside any pytest run that allocates ``SIZE`` of
    simulated memory on GPU ``I`` (NVML's index; a MIG instance's unit number) of a
    simulated machine, through :mod:`pytest_gpu.sim.cuda` as a program would. It prints
    ``holding <pid> GPU <I> <SIZE>`` on stdout once the memory is held, then holds it until
    it is killed or, with ``--seconds``, for that long (then frees it and exits 0).

    The machine: ``--machine`` (else ``PYTEST_GPU_SIM_MACHINE``, else the default one per
    user and spec) of the spec ``--spec`` (else ``PYTEST_GPU_FAKE_GPUS``, else
    ``PYTEST_GPU_SIM``, else the named machine's own spec, else ``sim:4x16GiB``). Without
    ``--machine`` and ``--spec``, a ``PYTEST_GPU_SIM_LEDGER`` in the environment (a run's
    subprocess) names the ledger itself.

Exit status: 0 after ``--seconds``; 1 when the GPU has too little free memory; 2 for a
usage error (an unknown GPU, a bad size or spec, a machine in use with another spec).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Sequence

from ..base.requests import SizeError, format_size, parse_size
from ..machine.domain import SIM_MACHINE_ENV, Domain
from . import cuda
from .fake import FAKE_ENV
from .ledger import (
    DEFAULT_SPEC,
    LEDGER_ENV,
    SPEC_ENV,
    TAG_ENV,
    OutOfMemoryError,
    SimDeviceError,
    ledger,
    machine_ledger,
)
from .spec import SpecError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pytest_gpu.sim", description="Tools for simulated GPU machines.")
    commands = parser.add_subparsers(dest="command", required=True)
    hold = commands.add_parser("hold", help="hold simulated GPU memory as a process outside any pytest run")
    hold.add_argument("--gpu", type=int, required=True, help="the GPU's index (a MIG instance's unit number)")
    hold.add_argument("--memory", required=True, help="how much to hold, e.g. 2GiB")
    hold.add_argument(
        "--seconds", type=float, default=None, help="hold this long, then free and exit (default: until killed)"
    )
    hold.add_argument("--machine", default=None, help="the simulated machine (default: $PYTEST_GPU_SIM_MACHINE)")
    hold.add_argument("--spec", default=None, help="its spec, e.g. sim:4x16GiB (default: $PYTEST_GPU_FAKE_GPUS)")
    return parser


def _existing_spec() -> str | None:
    """The spec of the simulated machine named by ``$PYTEST_GPU_SIM_MACHINE``, if it exists."""
    if not os.environ.get(SIM_MACHINE_ENV, "").strip():
        return None  # the default machine is named after its spec
    try:
        state = json.loads((Domain.sim("").ledger_path / "ledger.json").read_text())
    except (OSError, ValueError):
        return None
    return str(state.get("spec") or "") or None


def _use_ledger(args: argparse.Namespace) -> None:
    """Point this process's simulated CUDA at the machine asked for (through the environment)."""
    if args.machine is not None:
        os.environ[SIM_MACHINE_ENV] = args.machine
    elif args.spec is None and os.environ.get(LEDGER_ENV):
        return  # a run's subprocess: the run's ledger
    spec = (
        args.spec
        or os.environ.get(FAKE_ENV, "").strip()
        or os.environ.get(SPEC_ENV, "").strip()
        or _existing_spec()
        or DEFAULT_SPEC
    )
    found = machine_ledger(spec)
    assert found.spec is not None  # machine_ledger opened the machine: its spec is known
    os.environ[LEDGER_ENV] = str(found.path)
    os.environ[SPEC_ENV] = found.spec


def hold(args: argparse.Namespace) -> int:
    try:
        nbytes = parse_size(args.memory)
        _use_ledger(args)
    except (SizeError, SpecError) as exc:
        print(f"hold: {exc}", file=sys.stderr)
        return 2
    os.environ.pop(TAG_ENV, None)  # outside every run: no test's memory
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)  # --gpu is the machine's numbering
    cuda.init()
    ordinal = cuda.ordinal_of(args.gpu)
    if ordinal is None:
        units = [u.index for u in ledger().units()]
        print(f"hold: the simulated machine has no usable GPU {args.gpu} (its units: {units})", file=sys.stderr)
        return 2
    # SIGTERM frees the memory on the way out, as a program's exit would
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        allocation = cuda.allocate(nbytes, ordinal)
    except (OutOfMemoryError, SimDeviceError) as exc:
        print(f"hold: {exc}", file=sys.stderr)
        return 1
    with allocation:
        print(f"holding {os.getpid()} GPU {args.gpu} {format_size(nbytes)}", flush=True)
        try:
            if args.seconds is None:
                while True:
                    signal.pause()
            time.sleep(max(args.seconds, 0.0))
        except KeyboardInterrupt:
            return 130
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "hold":
        return hold(args)
    return 2  # pragma: no cover - argparse refuses other commands


if __name__ == "__main__":
    sys.exit(main())
