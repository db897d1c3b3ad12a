"""A test process whose CUDA a sticky error broke is quarantined until it exits.

After a device-side assert or an illegal address (see :func:`probe` below) the
process's CUDA fails every call and keeps the memory it holds until the process exits.
So, once a test leaves it so (found after its fixtures are torn down, before any lease is
given back: the hooks are :mod:`pytest_gpu.run.sticky`'s):

- its leases are not given back: they stay charged to the process until it exits (the
  broker takes them back when its connection closes, and counts its contexts until the
  pid is gone);
- its teardown report names the test and the error (an error of its own if the test
  passed);
- an xdist worker under pytest-gpu's scheduler ends itself before its next test (after
  xdist heard this one complete), leaving a record in the run directory (:func:`write_record`):
  the scheduler puts the test it held back into pending instead of reporting it as crashed,
  xdist starts a replacement ("replacing crashed worker"), and the summary says what happened;
- without that (no xdist, or ``--dist`` chosen, where xdist would report the held test as
  crashed) the process stays, and every later lease it asks for is refused with a message
  naming the test that broke CUDA, never a raw CUDA error (:func:`refuse`).

This module is what the run's state (:attr:`GpuRun.quarantine <pytest_gpu.run.session.GpuRun.quarantine>`),
the controller and the node hosts read: the record, the refusal, the probe.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from ..leasing.client import BrokerError
from ..sim import cuda as sim_cuda
from ..sim.cuda import STICKY_ERRORS

RECORDS = "quarantine"  # the run directory's folder of workers that ended themselves
MAX_RECORD = 4096  # bytes of a record read at most: a larger one is not ours
EXIT_STATUS = 75  # what a quarantined worker exits with (EX_TEMPFAIL: its tests run elsewhere)


@dataclass(frozen=True)
class Quarantine:
    """Why this process's CUDA is unusable: ``test`` left it in ``error``."""

    test: str
    error: str
    worker: str
    ends: bool = False  # the process ends itself after the test (an xdist worker under pytest-gpu's scheduler)

    def describe(self) -> str:
        return f"{self.test} left this process's CUDA unusable ({self.error})"


class Quarantined(BrokerError):
    """A lease asked for by a process whose CUDA a sticky error broke."""


def refuse(found: Quarantine | None) -> None:
    """Raise :class:`Quarantined` for a lease asked for in a process quarantined for ``found``
    (``None``: not quarantined, nothing is raised)."""
    if found is not None:
        raise Quarantined(
            f"not run: {found.describe()}, and a sticky CUDA error lasts until the process exits "
            "(its GPU memory is held till then); under pytest-xdist (-n) with pytest-gpu's scheduler "
            "(no --dist) the worker ends itself and a fresh one takes the GPU tests after it"
        )


# -- the probe: is this process's CUDA still usable -------------------------------------------
#
# Sticky CUDA errors: whether this process's CUDA is still usable after a test.
#
# A kernel's device-side assert, an illegal address or instruction, a misaligned address
# or a launch failure corrupts the CUDA context for good: from then on every runtime call
# of the process fails with that error (torch raises ``torch.AcceleratorError`` from
# ``C10_CUDA_CHECK``: "CUDA error: device-side assert triggered ..."; CuPy
# ``CUDARuntimeError: cudaErrorAssert: device-side assert triggered``), and the memory the
# process holds is freed only when it exits. :func:`probe` asks the process's CUDA as
# the next test would: ``torch.cuda.synchronize`` on the lease's devices where torch has a
# context (the sticky error surfaces at the first synchronising call), or the simulated
# runtime's state on simulated GPUs. It opens no context and starts no CUDA that is not
# started already.


def sticky_message(error: BaseException | str) -> str | None:
    """The line of ``error``'s message that names a sticky CUDA error ("CUDA error:
    device-side assert triggered"), or ``None`` where it names none."""
    for line in str(error).splitlines():
        for text, name in STICKY_ERRORS.items():
            if text in line or name in line:
                return line.strip()[:300]
    return None


def probe(devices: tuple[str, ...] | list[str], simulated: bool) -> str | None:
    """The sticky error this process's CUDA is in, as a CUDA call on ``devices`` (``"cuda:N"``,
    the lease's) would raise it now, or ``None``: usable, or never started."""
    if simulated:
        error = sim_cuda.sticky_error()
        if error is not None:
            return f"CUDA error: {error}"
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is None or not _started(cuda):
        return None
    for device in devices:
        try:
            if not _has_context(torch, device):
                continue  # synchronising there would open a context
            cuda.synchronize(device)
        except Exception as exc:  # the error of the call: whichever CUDA raised
            found = sticky_message(exc)
            if found is not None:
                return found
    return None


def _started(cuda: object) -> bool:
    try:
        return bool(cuda.is_initialized())  # type: ignore[attr-defined]
    except Exception:
        return False


def _has_context(torch: object, device: str) -> bool:
    ordinal = int(device.partition(":")[2] or 0)
    check = getattr(getattr(torch, "_C", None), "_cuda_hasPrimaryContext", None)
    return True if check is None else bool(check(ordinal))


# -- records: what a worker that ended itself tells the controller ---------------------------


def write_record(run_dir: Path, found: Quarantine) -> None:
    """Leave ``found`` in the run directory, for the controller (see :func:`records`)."""
    folder = run_dir / RECORDS
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        (folder / f"{_safe(found.worker)}.json").write_text(
            json.dumps({"test": found.test, "error": found.error, "worker": found.worker, "ends": found.ends})
        )
    except OSError:
        pass  # the worker still ends itself; the summary then says it died


def records(run_dir: Path) -> dict[str, Quarantine]:
    """Worker name -> why it was quarantined, for every record in the run directory (a
    record that is not one this module wrote is ignored)."""
    found: dict[str, Quarantine] = {}
    folder = run_dir / RECORDS
    try:
        paths = sorted(folder.glob("*.json"))
    except OSError:
        return found
    for path in paths:
        record = _read_record(path)
        if record is not None:
            found[record.worker] = record
    return found


def ended(run_dir: Path, worker: str) -> bool:
    """Whether ``worker`` was quarantined and ended itself (it did not crash)."""
    found = _read_record(run_dir / RECORDS / f"{_safe(worker)}.json")
    return found is not None and found.ends


def _read_record(path: Path) -> Quarantine | None:
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_RECORD + 1)
        data = json.loads(raw) if len(raw) <= MAX_RECORD else None
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    fields = [data.get(k) for k in ("test", "error", "worker")]
    if not all(isinstance(f, str) and f for f in fields):
        return None
    test, error, worker = (str(f)[:1000] for f in fields)
    return Quarantine(test, error, worker, data.get("ends") is True)


def _safe(worker: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in worker)[:64] or "_"
