"""``--gpus`` resolved by vendor: NVIDIA through NVML, AMD through amdsmi, Intel through Level Zero Sysman.

``auto`` finds NVIDIA GPUs as it always has (:func:`pytest_gpu.vendors.devices.discover`); on a
machine where NVML reports none, it asks amdsmi (when the ``rocm`` extra is installed). A
vendor prefix picks one on a machine that has both: ``nvidia:auto`` (NVML only, exactly
``auto`` on an NVIDIA machine; also ``nvidia:0,2``), ``amd:auto``. Where ``auto`` finds both
(amdsmi installed and answering beside NVML), it takes NVIDIA's and its note names AMD's. A
request that names two vendors (``nvidia:0,amd:1``) is refused, naming both: a run leases one
vendor's GPUs.
``amd:0,2`` picks AMD GPUs by amdsmi's index, as ``0,2`` picks NVIDIA's by NVML's.

Intel GPUs (:mod:`pytest_gpu.vendors.intel`): ``xpu:auto`` and ``xpu:0,2`` (indices as
``ZE_AFFINITY_MASK`` counts devices), ``xpu:sim:4x64GiB`` (simulated); ``auto`` asks Level Zero
Sysman last, on a machine where neither NVML nor amdsmi finds a GPU.

An AMD inventory keeps the ROCm visibility variables the run started with
(:attr:`Inventory.outer`) and lists the machine in ROCr's order
(:mod:`pytest_gpu.vendors.amd`), so that a process's view of it can be computed as ROCm's
runtime enumerates it.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace

from ..vendors.devices import GPUS_FORM, DeviceSpecError, Inventory
from ..vendors.devices import discover as nvidia_discover

VENDORS = ("nvidia", "amd", "xpu")
FORM = f"{GPUS_FORM}; or one vendor's: nvidia:auto, nvidia:0,2, amd:auto, amd:0,2, xpu:auto, xpu:0,2, xpu:sim:4x64GiB"


def split(spec: str) -> tuple[str | None, str]:
    """(``nvidia``/``amd``/``None``, the rest) of a ``--gpus`` value; :class:`DeviceSpecError` for
    one that names two vendors (``nvidia:0,amd:1``) or an unknown one (``intel:auto``)."""
    value = spec.strip()
    named = re.findall(r"(?:^|,)\s*([A-Za-z]+)\s*:", value)
    vendors = sorted({v.lower() for v in named if v.lower() != "sim"})
    unknown = [v for v in vendors if v not in VENDORS]
    if unknown:
        raise DeviceSpecError(f"--gpus {spec!r}: unknown vendor {unknown[0]!r}; expected {FORM}")
    if len(vendors) > 1:
        raise DeviceSpecError(
            f"--gpus {spec!r} names {' and '.join(vendors)} GPUs; a run leases one vendor's GPUs: "
            f"expected {vendors[0]}:… or {vendors[1]}:…, not both"
        )
    if not vendors:
        return None, value
    head, _, rest = value.partition(":")
    if head.strip().lower() != vendors[0]:  # "0,nvidia:1": the vendor must lead
        raise DeviceSpecError(f"--gpus {spec!r}: the vendor goes first, as in {vendors[0]}:0,1; expected {FORM}")
    return vendors[0], rest.strip()


def discover(spec: str, environ: Mapping[str, str] | None = None) -> Inventory:
    """Resolve a ``--gpus`` value into an :class:`Inventory` of one vendor's GPUs."""
    env = os.environ if environ is None else environ
    vendor, rest = split(spec)
    if vendor == "amd":
        if rest.lower() == "auto":
            return amd_inventory(env, required=True)
        if re.fullmatch(r"\d+(\s*,\s*\d+)*", rest):
            return _amd_indices(spec, [int(x) for x in rest.split(",")], env)
        raise DeviceSpecError(f"--gpus {spec!r}: expected amd:auto or amd: and amdsmi's indices such as amd:0,2")
    if vendor == "xpu":
        if rest.lower().startswith("sim:"):  # simulated Intel GPUs, as sim:… are NVIDIA's
            return _xpu_sim(spec, rest, env)
        if rest.lower() == "auto":
            return xpu_inventory(env, required=True)
        if re.fullmatch(r"\d+(\s*,\s*\d+)*", rest):
            return _xpu_indices(spec, [int(x) for x in rest.split(",")], env)
        raise DeviceSpecError(
            f"--gpus {spec!r}: expected xpu:auto, xpu: and device indices as ZE_AFFINITY_MASK counts them "
            "(such as xpu:0,2), or simulated Intel GPUs such as xpu:sim:4x64GiB"
        )
    if vendor == "nvidia" and rest.lower().startswith("sim:"):
        raise DeviceSpecError(f"--gpus {spec!r}: simulated devices take no vendor; expected {rest}")
    found = nvidia_discover(rest, env)
    if vendor is None and rest.lower() == "auto":
        if not found.devices and not found.machine:
            amd = amd_inventory(env, required=False)
            if amd.devices or amd.machine:
                return amd
            intel = xpu_inventory(env, required=False)
            if intel.devices or intel.machine:
                return intel
        elif importlib.util.find_spec("amdsmi") is not None:  # a machine with both? (amdsmi: a ROCm install)
            amd = amd_inventory(env, required=False)
            if amd.devices:
                also = f"this machine also has {amd.describe()}: --gpus amd:auto leases those instead"
                return replace(found, note="; ".join(filter(None, [found.note, also])))
    return found


@dataclass(frozen=True)
class _Words:
    """How discovery speaks of one vendor's GPUs (AMD's through amdsmi, Intel's through Sysman)."""

    vendor: str  # vendors.of(vendor)
    source: str  # Inventory.source when the driver answered
    missing: str  # {missing}, {known}: indices the driver does not report
    kind: str  # "AMD GPU": before {hidden} is/are hidden
    visible_by: str  # what leaves indices visible, after "expected indices "
    none_found: str  # the driver reports no GPU at all
    none_left: str  # {said}: the run's variables leave none


_AMD_WORDS = _Words(
    "amd",
    "amdsmi",
    "no usable AMD GPU with amdsmi index {missing}; this machine has {known}",
    "AMD GPU",
    "ROCm leaves visible",
    "amdsmi reports no usable AMD GPUs",
    "{said} leave none of the GPUs amdsmi reports",
)
_XPU_WORDS = _Words(
    "xpu",
    "sysman",
    "no Intel GPU device {missing}; Level Zero Sysman reports {known}",
    "Intel GPU",
    "the run's ZE_AFFINITY_MASK leaves visible",
    "Level Zero Sysman reports no Intel GPUs",
    "{said} leaves none of the devices Sysman reports",
)


def _said(started: tuple[tuple[str, str], ...]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in started)


def _by_indices(words: _Words, spec: str, wanted: list[int], environ: Mapping[str, str]) -> Inventory:
    """``amd:0,2`` / ``xpu:0,2``: these GPUs by the driver's index, each one that the run's
    visibility variables leave visible."""
    from ..vendors.registry import UNAVAILABLE, of

    vendor = of(words.vendor)
    try:
        found, note = vendor.devices()
    except UNAVAILABLE as exc:
        raise DeviceSpecError(f"--gpus {spec!r}: {exc}") from None
    known = {d.index: d for d in found}
    missing = [i for i in wanted if i not in known]
    if missing:
        raise DeviceSpecError(
            f"--gpus {spec!r}: "
            + words.missing.format(missing=missing, known=sorted(known))
            + (f" ({note})" if note else "")
        )
    if len(set(wanted)) != len(wanted):
        raise DeviceSpecError(f"--gpus {spec!r}: an index is listed twice")
    started = vendor.outer(environ)
    seen = set(vendor.view(found, started))
    hidden = [i for i in wanted if i not in seen]
    if hidden:
        raise DeviceSpecError(
            f"--gpus {spec!r}: {words.kind} {hidden} {'is' if len(hidden) == 1 else 'are'} hidden by "
            f"{_said(started)}; expected indices {words.visible_by}"
        )
    return Inventory(tuple(known[i] for i in wanted), words.source, note, found, None, vendor.name, started)


def _visible(words: _Words, environ: Mapping[str, str], required: bool) -> Inventory:
    """The GPUs the driver reports that the run's visibility variables leave it; ``required``
    (``amd:auto``, ``xpu:auto``): the driver being unavailable is said in the empty inventory's
    note, as NVML's is for ``auto``."""
    from ..vendors.registry import UNAVAILABLE, of

    vendor = of(words.vendor)
    try:
        found, note = vendor.devices()
    except UNAVAILABLE as exc:
        return Inventory((), f"{words.vendor}:auto" if required else "auto", str(exc), vendor=vendor.name)
    started = vendor.outer(environ)
    by_index = {d.index: d for d in found}
    usable = tuple(by_index[i] for i in vendor.view(found, started))
    if not usable:
        why = words.none_found if not found else words.none_left.format(said=_said(started))
        note = "; ".join(filter(None, [why, note]))
    return Inventory(usable, words.source, note, found, None, vendor.name, started)


def _amd_indices(spec: str, wanted: list[int], environ: Mapping[str, str]) -> Inventory:
    """``amd:0,2``: these AMD GPUs by amdsmi's index (what ``amd-smi`` prints)."""
    return _by_indices(_AMD_WORDS, spec, wanted, environ)


def amd_inventory(environ: Mapping[str, str], *, required: bool) -> Inventory:
    """The AMD GPUs amdsmi reports that the run's ROCm visibility variables leave it."""
    return _visible(_AMD_WORDS, environ, required)


def _xpu_indices(spec: str, wanted: list[int], environ: Mapping[str, str]) -> Inventory:
    """``xpu:0,2``: these Intel GPU devices (``ZE_AFFINITY_MASK``'s indices)."""
    return _by_indices(_XPU_WORDS, spec, wanted, environ)


def xpu_inventory(environ: Mapping[str, str], *, required: bool) -> Inventory:
    """The Intel GPU devices Level Zero Sysman reports that the run's ``ZE_AFFINITY_MASK`` leaves it."""
    return _visible(_XPU_WORDS, environ, required)


def _xpu_sim(spec: str, rest: str, environ: Mapping[str, str]) -> Inventory:
    """``xpu:sim:4x64GiB``: simulated Intel GPUs (the run makes them its fake machine, so torch.xpu
    and the simulated runtime follow ``ZE_AFFINITY_MASK``), narrowed by the run's mask."""
    from ..vendors.devices import sim_machine
    from ..vendors.registry import XPU

    source = f"xpu:{rest}"
    found, note = sim_machine(source)  # DeviceSpecError names the spec and the expected form
    started = XPU.outer(environ)
    by_index = {d.index: d for d in found}
    usable = tuple(by_index[i] for i in XPU.view(found, started))
    if not usable:
        note = "; ".join(filter(None, [f"{_said(started)} leaves none of the simulated Intel GPUs", note]))
    return Inventory(usable, source, note, found, None, XPU.name, started)
