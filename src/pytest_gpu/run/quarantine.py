"""A test process whose CUDA a sticky error broke is quarantined until it exits.

After a device-side assert, an illegal address or any other sticky error, or a kernel that
never ends (see :func:`probe` below), the process's CUDA fails (or blocks) every call and
keeps the memory it holds until the process exits.
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
import queue
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from ..leasing.client import BrokerError
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
# A kernel's device-side assert, an illegal address or instruction, a misaligned address, a
# hardware stack error, an invalid program counter or address space, a launch failure or
# timeout, an external device's error (:data:`~pytest_gpu.sim.cuda.STICKY_ERRORS`) corrupts the
# CUDA context for good: from then on every runtime call of the process fails with that error
# (torch raises ``torch.AcceleratorError`` from ``C10_CUDA_CHECK``: "CUDA error: device-side
# assert triggered ..."; CuPy ``CUDARuntimeError: cudaErrorAssert: device-side assert
# triggered``), and the memory the process holds is freed only when it exits. :func:`probe`
# asks the process's CUDA as the next test would, through every framework the process has
# already loaded and started (it imports none and starts none): torch's ``synchronize`` on the
# lease's devices where torch has a context, CuPy's ``deviceSynchronize`` on them (the CuPy
# adapter made each one current at the lease's start, so each has its context), and JAX's
# ``block_until_ready`` on a tiny array put on each. Any exception there means the context is
# gone, whatever its code: a synchronize after a test has no other way to fail. The calls run
# in a thread of their own (CUDA's current device is per thread: the test thread's stays), for
# at most ``timeout`` seconds: a synchronize that does not return waits on a kernel that never
# ends, and the process is as lost as after a sticky error.

#: Seconds the probe waits for the GPU work a test left to finish.
PROBE_TIMEOUT = 60.0


def sticky_message(error: BaseException | str) -> str | None:
    """The line of ``error``'s message that names a sticky CUDA error ("CUDA error:
    device-side assert triggered"), or ``None`` where it names none."""
    for line in str(error).splitlines():
        for text, name in STICKY_ERRORS.items():
            if text in line or name in line:
                return line.strip()[:300]
    return None


def probe(devices: tuple[str, ...] | list[str], timeout: float | None = None) -> str | None:
    """The error this process's CUDA is in, as a synchronize on ``devices`` (``"cuda:N"``, the
    lease's) raises it now through the frameworks the process uses, or what says it did not
    return within ``timeout`` seconds (default :data:`PROBE_TIMEOUT`); ``None``: usable, or
    never started."""
    timeout = PROBE_TIMEOUT if timeout is None else timeout
    checks = _checks(devices)
    if not checks:
        return None
    finished, found = _PROBER.run(checks, timeout)
    if not finished:
        return (
            f"the GPU work it left did not finish within {timeout:g} s of its end "
            "(a hung kernel?): a synchronize never returned"
        )
    return found


class _Prober:
    """The thread the checks run in, kept from one test's probe to the next (starting one
    cost each GPU test ~60 µs). A daemon: a synchronize that never returns must not keep the
    process from exiting; a probe that timed out leaves it behind, and the next probe (in a
    process that is not quarantined, a test's own probe) starts another."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()

    def run(self, checks: list[tuple[str, Callable[[], object]]], timeout: float) -> tuple[bool, str | None]:
        """(whether the checks finished within ``timeout`` seconds, the first error they raised)."""
        job = _Job(checks)
        with self._lock:
            if self._thread is None or not self._thread.is_alive():  # none yet, a forked child's, or stuck
                self._jobs = queue.SimpleQueue()
                self._thread = threading.Thread(
                    target=_serve, args=(self._jobs,), name="pytest-gpu sticky-error probe", daemon=True
                )
                self._thread.start()
            self._jobs.put(job)
        if not job.done.wait(timeout):
            with self._lock:
                self._thread = None  # stuck in a synchronize: never given another job
            return False, None
        return True, job.found


@dataclass
class _Job:
    checks: list[tuple[str, Callable[[], object]]]
    found: str | None = None
    done: threading.Event = field(default_factory=threading.Event)


def _serve(jobs: queue.SimpleQueue[_Job]) -> None:
    while True:
        job = jobs.get()
        try:
            job.found = _first_error(job.checks)
        finally:
            job.done.set()


_PROBER = _Prober()


def _first_error(checks: list[tuple[str, Callable[[], object]]]) -> str | None:
    for framework, check in checks:
        try:
            check()
        except Exception as exc:  # whichever CUDA raised, whatever its code: the context is gone
            return sticky_message(exc) or f"{framework}: {_first_line(exc)}"
    return None


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return (lines[0] if lines else type(error).__name__)[:300]


def _checks(devices: tuple[str, ...] | list[str]) -> list[tuple[str, Callable[[], object]]]:
    """The synchronising calls to make, per framework the process loaded and started."""
    ordinals = [int(d.partition(":")[2] or 0) for d in devices if d.partition(":")[0] == "cuda"]
    if not ordinals:
        return []
    checks: list[tuple[str, Callable[[], object]]] = []
    checks += _torch_checks(ordinals)
    checks += _cupy_checks(ordinals)
    checks += _jax_checks(ordinals)
    return checks


def _torch_checks(ordinals: list[int]) -> list[tuple[str, Callable[[], object]]]:
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is None or not _started(cuda):
        return []
    has_context = getattr(getattr(torch, "_C", None), "_cuda_hasPrimaryContext", None)
    found: list[tuple[str, Callable[[], object]]] = []
    for ordinal in ordinals:
        try:
            if has_context is not None and not has_context(ordinal):
                continue  # synchronising there would open a context
        except Exception:  # the query itself failed: let the synchronize say why
            pass
        found.append(("torch", partial(cuda.synchronize, ordinal)))
    return found


def _cupy_checks(ordinals: list[int]) -> list[tuple[str, Callable[[], object]]]:
    cupy = sys.modules.get("cupy")
    runtime = getattr(getattr(cupy, "cuda", None), "runtime", None)
    if runtime is None:
        return []

    def check(ordinal: int) -> None:
        runtime.setDevice(ordinal)  # the probe thread's current device only
        runtime.deviceSynchronize()

    return [("CuPy", partial(check, ordinal)) for ordinal in ordinals]


def _jax_checks(ordinals: list[int]) -> list[tuple[str, Callable[[], object]]]:
    jax = sys.modules.get("jax")
    bridge = sys.modules.get("jax._src.xla_bridge")
    started = getattr(bridge, "backends_are_initialized", None)
    if jax is None or started is None:
        return []
    try:
        if not started():
            return []  # asking for devices would start JAX's backends
        gpus = [d for d in jax.local_devices() if getattr(d, "platform", "cpu") != "cpu"]  # the GPUs, any vendor's
    except Exception as exc:
        failed = _first_line(exc)
        return [("JAX", partial(_raise, failed))]
    found: list[tuple[str, Callable[[], object]]] = []
    for device in gpus:
        if getattr(device, "local_hardware_id", getattr(device, "id", None)) in ordinals:
            found.append(("JAX", partial(lambda d: jax.device_put(0, d).block_until_ready(), device)))
    return found


def _raise(message: str) -> None:
    raise RuntimeError(message)


def _started(cuda: object) -> bool:
    try:
        return bool(cuda.is_initialized())  # type: ignore[attr-defined]
    except Exception:
        return False


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
