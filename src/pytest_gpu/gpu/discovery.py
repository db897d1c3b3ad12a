"""``--gpus`` resolved into an :class:`~pytest_gpu.vendors.devices.Inventory` of one vendor's GPUs.

``auto`` asks each vendor in turn (:data:`pytest_gpu.vendors.registry.VENDORS`: NVIDIA through
NVML, AMD through amdsmi, Intel through Level Zero Sysman) and takes the first that has GPUs;
where that is NVIDIA's and another vendor's library is installed and answers with GPUs too,
the note names them. Where none has any, the inventory is empty and its note says every
vendor's reason (no NVIDIA driver, no amdsmi or amdgpu, no Level Zero loader), so that
``--gpu-required`` and ``pytest-gpu inventory`` tell every user what is missing.

A vendor prefix picks one: ``nvidia:auto`` (NVML only, exactly ``auto`` on an NVIDIA
machine; also ``nvidia:0,2``), ``amd:auto``, ``amd:0,2`` (amdsmi's indices), ``xpu:auto``,
``xpu:0,2`` (indices as ``ZE_AFFINITY_MASK`` counts devices). A request that names two
vendors (``nvidia:0,amd:1``) is refused, naming both: a run leases one vendor's GPUs.
``none`` means no GPUs; ``sim:4x16GiB`` simulated NVIDIA GPUs and ``xpu:sim:4x64GiB``
simulated Intel GPUs (:mod:`pytest_gpu.sim.spec`), narrowed by the run's visibility variables
as a real machine's are.

Each vendor's inventory keeps the visibility variables the run started with and lists the
machine in its runtime's order (:meth:`pytest_gpu.vendors.vendor.Vendor.view`), so that a
process's view of it can be computed as its runtime enumerates it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import replace

from ..sim.spec import PREFIX as SIM_PREFIX
from ..sim.spec import SpecError, parse
from ..vendors import registry as vendors
from ..vendors.devices import DeviceSpecError, Inventory
from ..vendors.nvidia import GPUS_FORM

FORM = f"{GPUS_FORM}; or one vendor's: nvidia:auto, nvidia:0,2, amd:auto, amd:0,2, xpu:auto, xpu:0,2, xpu:sim:4x64GiB"


def split(spec: str) -> tuple[str | None, str]:
    """(the vendor's name or ``None``, the rest) of a ``--gpus`` value; :class:`DeviceSpecError` for
    one that names two vendors (``nvidia:0,amd:1``) or an unknown one (``intel:auto``)."""
    value = spec.strip()
    named = re.findall(r"(?:^|,)\s*([A-Za-z]+)\s*:", value)
    asked = sorted({v.lower() for v in named if v.lower() != "sim"})
    unknown = [v for v in asked if v not in vendors.VENDORS]
    if unknown:
        raise DeviceSpecError(f"--gpus {spec!r}: unknown vendor {unknown[0]!r}; expected {FORM}")
    if len(asked) > 1:
        raise DeviceSpecError(
            f"--gpus {spec!r} names {' and '.join(asked)} GPUs; a run leases one vendor's GPUs: "
            f"expected {asked[0]}:… or {asked[1]}:…, not both"
        )
    if not asked:
        return None, value
    head, _, rest = value.partition(":")
    if head.strip().lower() != asked[0]:  # "0,nvidia:1": the vendor must lead
        raise DeviceSpecError(f"--gpus {spec!r}: the vendor goes first, as in {asked[0]}:0,1; expected {FORM}")
    return asked[0], rest.strip()


def discover(spec: str, environ: Mapping[str, str] | None = None) -> Inventory:
    """Resolve a ``--gpus`` value into an :class:`Inventory` of one vendor's GPUs."""
    env = os.environ if environ is None else environ
    name, rest = split(spec)
    if rest.lower() == "none":
        return Inventory((), "none", "--gpus none")
    if name is None and rest.lower() == "auto":
        return _auto(env)
    vendor = vendors.DEFAULT if name is None else vendors.of(name)
    if rest.lower().startswith(SIM_PREFIX):
        return simulated(vendor, vendor.sim_spec(spec, rest, named=name is not None), env)
    return vendor.discover(spec, rest, env, "auto" if name is None else f"{name}:auto")


def _auto(environ: Mapping[str, str]) -> Inventory:
    """``auto``: the first vendor with GPUs here; where none has any, every vendor's reason."""
    first, *others = vendors.VENDORS.values()
    found = first.found(environ)
    if found.devices or found.machine:
        also = [other for other in others if other.installed()]
        for other in also:  # a machine with both? (an installed library: ROCm's amdsmi, ...)
            theirs = other.found(environ)
            if theirs.devices:
                said = f"this machine also has {theirs.describe()}: --gpus {other.name}:auto leases those instead"
                return replace(found, note="; ".join(filter(None, [found.note, said])))
        return found
    reasons = [found.note]
    for other in others:
        theirs = other.found(environ)
        if theirs.devices or theirs.machine:
            return theirs
        reasons.append(theirs.note)
    return replace(found, source="auto", note="; ".join(filter(None, reasons)))


def candidates(inventory: Inventory) -> tuple[vendors.Vendor, ...]:
    """Whose GPUs ``inventory`` could have had: its vendor's, or, where ``auto`` found no vendor's
    GPUs at all, every vendor's (what each lacks is in its note)."""
    if inventory.source == "auto" and not inventory.machine:
        return tuple(vendors.VENDORS.values())
    return (vendors.of(inventory.vendor),)


def simulated(vendor: vendors.Vendor, spec: str, environ: Mapping[str, str]) -> Inventory:
    """``sim:4x16GiB``, ``xpu:sim:4x64GiB``: a simulated machine of ``vendor``'s (the run makes it its
    fake machine, so its runtime's simulation follows the visibility variables), narrowed by the
    run's visibility variables as a real one's GPUs are."""
    try:
        found, note = parse(spec).devices()
    except SpecError as exc:
        raise DeviceSpecError(f"--gpus {exc}") from None
    return vendor.narrowed(found, spec, note, environ)
