"""The one switch: ``PYTEST_GPU_FAKE_GPUS=<spec>`` makes a process tree see a fake GPU machine.

With it, in every process that loads pytest-gpu (the pytest process, xdist workers, rank
processes, ``pytest-gpu inventory``):

- nvidia-ml-py loads the fake ``libnvidia-ml.so.1`` (:mod:`pytest_gpu.sim.nvml`), so
  ``--gpus auto`` and verification take exactly the code path of a real machine; on a fake
  AMD machine (``amd:sim:8x192GiB``) the ``amdsmi`` package loads the fake ``libamd_smi.so``
  (:mod:`pytest_gpu.sim.amdsmi`) and the fake NVML answers "Driver Not Loaded"; on a fake Intel
  machine (``xpu:sim:4x64GiB``) a fake Level Zero loader answers Sysman (:mod:`pytest_gpu.sim.zes`);
- :mod:`pytest_gpu.sim.cuda` is the machine's CUDA runtime;
- ``torch.cuda`` of torch's CPU build is given the simulated semantics
  (:mod:`pytest_gpu.sim.torch_cuda`) as soon as torch is imported; on a fake Intel machine
  ``torch.xpu`` is, instead (:func:`pytest_gpu.sim.torch_cuda.install_xpu`).

The ledger is shared by every process that sees the same ``PYTEST_GPU_SIM_LEDGER``; without
it, the switch sets it to the ledger of the simulated machine the process names
(``PYTEST_GPU_SIM_MACHINE``; default: a pytest run's own, which the run claims before this
switch is turned on, or outside any run one per user and spec: :func:`.ledger.machine_ledger`),
so every process tree that names the same machine shares its GPUs.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from functools import partial
from types import ModuleType
from typing import Any

from ..base.importhook import cancel, on_import
from ..machine.domain import claim_run_machines, release_run_machines
from ..vendors import kinds, libraries, nvidia
from . import amdsmi, cuda, nvml, zes
from .ledger import LEDGER_ENV, SPEC_ENV, ledger, machine_ledger
from .spec import Machine, parse

FAKE_ENV = "PYTEST_GPU_FAKE_GPUS"

_active: str | None = None
_saved: dict[str, str | None] = {}
notes: list[str] = []  # what could not be faked here (shown in the run's summary)


def requested() -> str | None:
    """The spec of ``PYTEST_GPU_FAKE_GPUS``, or ``None`` when fake GPUs are off."""
    value = os.environ.get(FAKE_ENV, "").strip()
    return value or None


def active() -> bool:
    """Whether this process runs on fake GPUs (the switch was on when it was activated)."""
    return _active is not None


def activate(spec: str | None = None) -> bool:
    """Turn fake GPUs on in this process (and, through the environment, its subprocesses).

    ``spec`` defaults to ``PYTEST_GPU_FAKE_GPUS``; returns ``False`` when there is none.
    Raises :class:`pytest_gpu.sim.spec.SpecError` for a spec that cannot be read, and its
    subclass :class:`pytest_gpu.sim.SimMachineError` when the simulated machine named is in
    use with another spec; :class:`pytest_gpu.sim.LedgerWriteError` when its ledger cannot be made.
    """
    global _active
    spec = spec or requested()
    if spec is None:
        return False
    if _active == spec:
        return True
    machine = parse(spec)
    if _active is None:
        _saved.update({name: os.environ.get(name) for name in (FAKE_ENV, SPEC_ENV, LEDGER_ENV, "LD_LIBRARY_PATH")})
    os.environ[FAKE_ENV] = spec
    os.environ[SPEC_ENV] = machine.spec
    if not os.environ.get(LEDGER_ENV):  # the simulated machine's: shared like a real one's GPUs
        os.environ[LEDGER_ENV] = str(machine_ledger(machine.spec).path)
    ledger().used()  # creates the ledger and its nvml.state if this is the first process
    for name in kinds.of(machine.vendor).fakes:
        _FAKES[name](machine)

    on_import("torch", _install_torch)
    _active = spec
    return True


def _note(note: str) -> None:
    if note not in notes:
        notes.append(note)


def _fake_nvml(machine: Machine) -> None:
    try:
        nvml.preload(no_v3=machine.no_v3)
    except RuntimeError as exc:  # no C compiler: the simulated CUDA still works, NVML does not
        _note(f"fake NVML unavailable: {exc}")


def _fake_amdsmi(machine: Machine) -> None:
    try:
        amdsmi.preload()
    except RuntimeError as exc:
        _note(f"fake libamd_smi.so unavailable: {exc}")
    shadow = amdsmi.shadowing_library()
    if shadow is not None:
        _note(f"the amdsmi package loads {shadow} (ROCM_HOME/ROCM_PATH), not the fake libamd_smi.so")


def _fake_zes(machine: Machine) -> None:
    try:
        zes.preload()
    except RuntimeError as exc:
        _note(f"fake Level Zero loader unavailable: {exc}")


#: The fake libraries a machine's vendor has (:attr:`pytest_gpu.vendors.kinds.Kind.fakes`), each loaded
#: into this process and its subprocesses (what cannot be is said in :data:`notes`).
_FAKES: dict[str, Callable[[Machine], None]] = {"nvml": _fake_nvml, "amdsmi": _fake_amdsmi, "zes": _fake_zes}


def _install_torch(torch: ModuleType) -> None:
    from . import torch_cuda  # local: slow; only once torch is imported on fake GPUs

    spec = _active or requested()
    kind = kinds.of(parse(spec).vendor) if spec is not None else kinds.DEFAULT
    try:  # torch.cuda (torch on ROCm on a fake AMD machine), torch.xpu on a fake Intel machine
        torch_cuda.install_for(torch, kind.device_kind, rocm=_amdsmi_package(kind))
    except RuntimeError as exc:  # torch built with CUDA (XPU): its own torch.cuda (torch.xpu) stays
        _note(f"torch.{kind.device_kind} left as it is: {exc}")


def _amdsmi_package(kind: kinds.Kind) -> ModuleType | None:
    """The ``amdsmi`` package on a fake machine whose torch is a ROCm build (torch on ROCm asks it);
    ``None`` elsewhere or where it cannot load the fake library (said in :data:`notes`)."""
    if kind.torch_build != "hip":
        return None
    import contextlib
    import io

    try:
        with contextlib.redirect_stdout(io.StringIO()):  # its load failure is printed
            package = libraries.load("amdsmi")
    except Exception as exc:  # not installed, or no library: torch counts as torch on CUDA would
        _note(f"torch.cuda counts without amdsmi ({type(exc).__name__}: {exc})")
        return None
    found: ModuleType = package
    return found


class ClaimError(Exception):
    """The run's own simulated machine could not be made (its directory: the text says why)."""


def start_for_run(launch_id: str | None) -> Callable[[], None] | None:
    """Turn the switch on for a pytest run that starts in this process (before conftest.py
    files import torch): on the run's own simulated machine, unless one is named or a ledger
    given; its workers, ranks and subprocesses inherit the name. Returns what removes the
    run's own machine when the run ends (``None``: it has none). ``launch_id``: the launch
    this process is a rank of (see :func:`~pytest_gpu.machine.domain.claim_run_machines`).

    Raises :class:`ClaimError`, or ``ValueError`` for a bad spec."""
    try:
        claimed = None if os.environ.get(LEDGER_ENV) else claim_run_machines(launch_id)
    except OSError as exc:
        raise ClaimError(str(exc)) from None
    try:
        activate()
    except BaseException:
        if claimed is not None:
            release_run_machines(claimed)
        raise
    return None if claimed is None else partial(release_run_machines, claimed)


def deactivate() -> None:
    """Turn fake GPUs off again in this process (a ``sim:`` run ends; the next may be real).

    The environment is put back as it was. nvidia-ml-py forgets the fake library, but a
    library loaded under the soname ``libnvidia-ml.so.1`` cannot be unloaded: a later
    ``nvmlInit`` in this process still finds the fake one (which, without its ledger,
    answers "Driver Not Loaded"). A torch already given the simulated ``torch.cuda``
    keeps it, as a process keeps its CUDA.

    For the simulated machine this process exits: what it held there (memory, contexts, its
    use of the machine) is freed, and its simulated CUDA runtime starts afresh next time.
    """
    global _active
    if _active is None:
        return
    from contextlib import suppress

    with suppress(OSError):  # a ledger that cannot be written keeps the record until this process exits
        ledger().release(os.getpid())
    cuda.forget()

    cancel("torch", _install_torch)
    nvidia.forget_kept_nvml()  # opened on the fake library, which pynvml forgets below
    pynvml: Any = sys.modules.get("pynvml")  # not imported: it holds no library
    if pynvml is not None:
        with pynvml.libLoadLock:
            pynvml.nvmlLib = None
            cache = getattr(pynvml, "_nvmlGetFunctionPointer_cache", None)
            if isinstance(cache, dict):
                cache.clear()
    for name, value in _saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _saved.clear()
    notes.clear()
    _active = None
