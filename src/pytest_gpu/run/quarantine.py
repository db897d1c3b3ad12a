"""A test process whose CUDA a sticky error broke is quarantined until it exits.

After a device-side assert or an illegal address (see :func:`probe` below) the
process's CUDA fails every call and keeps the memory it holds until the process exits.
So, once a test leaves it so (found after its fixtures are torn down, before any lease is
given back):

- its leases are not given back: they stay charged to the process until it exits (the
  broker takes them back when its connection closes, and counts its contexts until the
  pid is gone);
- its teardown report names the test and the error (an error of its own if the test
  passed);
- an xdist worker under pytest-gpu's scheduler ends itself before its next test (after
  xdist heard this one complete), leaving a record in the run directory: the scheduler
  puts the test it held back into pending instead of reporting it as crashed, xdist
  starts a replacement ("replacing crashed worker"), and the summary says what happened;
- without that (no xdist, or ``--dist`` chosen, where xdist would report the held test as
  crashed) the process stays, and every later lease it asks for is refused with a message
  naming the test that broke CUDA, never a raw CUDA error.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from ..leasing.client import BrokerError
from ..sim.cuda import STICKY_ERRORS

if TYPE_CHECKING:
    from .holding import TestState
    from .session import GpuRun

RECORDS = "quarantine"  # the run directory's folder of workers that ended themselves
MAX_RECORD = 4096  # bytes of a record read at most: a larger one is not ours
EXIT_STATUS = 75  # what a quarantined worker exits with (EX_TEMPFAIL: its tests run elsewhere)
_CALL_ERROR = pytest.StashKey[str]()  # the sticky error the test's call raised, as it said it
_CALL_FAILED = pytest.StashKey[bool]()  # the test's call raised: its failure is reported already


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


def note_call(item: pytest.Item, call: pytest.CallInfo[None]) -> None:
    """Remember the sticky CUDA error the test's call raised, if it raised one."""
    if call.when == "call" and call.excinfo is not None:
        item.stash[_CALL_FAILED] = True
        found = sticky_message(call.excinfo.value)
        if found is not None:
            item.stash[_CALL_ERROR] = found


def check(item: pytest.Item, run: GpuRun, state: TestState | None) -> None:
    """After the test's fixtures are torn down and before its leases are given back: is
    CUDA still usable? If not, quarantine this process (see the module docstring)."""
    if run.quarantine is not None:
        return
    devices: list[str] = []
    if state is not None:
        for active in [*state.sections, *([state.main] if state.main is not None else [])]:
            devices += [d for d in active.lease.devices if d not in devices]
    error = item.stash.get(_CALL_ERROR, None)
    if devices or error is not None:
        error = probe(devices, run.inventory.simulated) or error
    if error is None:
        return
    run.quarantine = Quarantine(item.nodeid, error, run.worker, _ends_itself(item.config))
    _write_record(run)


def refuse(run: GpuRun, test: str) -> None:
    """Raise :class:`Quarantined` for a lease ``test`` asks for in a quarantined process."""
    found = run.quarantine
    if found is not None:
        raise Quarantined(
            f"not run: {found.describe()}, and a sticky CUDA error lasts until the process exits "
            "(its GPU memory is held till then); under pytest-xdist (-n) with pytest-gpu's scheduler "
            "(no --dist) the worker ends itself and a fresh one takes the GPU tests after it"
        )


def make_report(item: pytest.Item, report: pytest.TestReport, run: GpuRun) -> None:
    """The quarantining test's teardown report names it and the error."""
    found = run.quarantine
    if found is None or report.when != "teardown" or found.test != item.nodeid:
        return
    then = (
        f"worker {found.worker} ends itself after this test and xdist starts another"
        if _ends_itself(item.config)
        else "later GPU tests of this process are not run"
    )
    text = (
        f"pytest-gpu: {found.describe()}: a sticky CUDA error lasts until the process exits. "
        f"Its GPU memory and leases stay held till then; {then}."
    )
    if report.passed and not item.stash.get(_CALL_FAILED, False):  # it passed, yet broke CUDA: an error
        report.outcome = "failed"
        report.longrepr = text
    else:
        report.sections.append(("pytest-gpu quarantine", text))


def end_worker(config: pytest.Config, run: GpuRun, close_pools: Callable[[], object]) -> None:
    """Before a quarantined worker's next test: end the process, as a crash would end it,
    so that xdist replaces it (its leases and memory go back when it has exited);
    ``close_pools`` first: its rank pools must not outlive it."""
    if run.quarantine is None or not _ends_itself(config):
        return
    try:
        close_pools()
    finally:
        sys.stderr.write(f"pytest-gpu: worker {run.worker} ends: {run.quarantine.describe()}\n")
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(EXIT_STATUS)


def _ends_itself(config: pytest.Config) -> bool:
    """Whether this process is an xdist worker that may end itself: under pytest-gpu's
    scheduler, which gives the test it holds back to pending instead of calling it crashed."""
    from .keys import SCHEDULE_KEY

    workerinput = getattr(config, "workerinput", None)
    return bool(workerinput is not None and workerinput.get(SCHEDULE_KEY))


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
        from ..sim import cuda as sim_cuda

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


def _write_record(run: GpuRun) -> None:
    found = run.quarantine
    assert found is not None
    folder = run.run_dir / RECORDS
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        (folder / f"{_safe(run.worker)}.json").write_text(
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
