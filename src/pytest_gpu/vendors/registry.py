"""One interface per GPU vendor: how its GPUs are found, which variables narrow what a process
sees, how a process numbers them, and what a lease sets.

:class:`Vendor` is the interface; :data:`NVIDIA` (NVML, ``CUDA_VISIBLE_DEVICES``) and
:data:`AMD` (amdsmi, ``ROCR_VISIBLE_DEVICES`` then HIP's) and :data:`XPU` (Level Zero Sysman,
``ZE_AFFINITY_MASK``) implement it, over the code of :mod:`pytest_gpu.vendors.devices`,
:mod:`pytest_gpu.vendors.amd` and :mod:`pytest_gpu.vendors.intel`. A run's inventory names its
vendor (:attr:`Inventory.vendor`); :func:`of` gives the implementation.

Memory and per-process samples come from :meth:`Vendor.sampler` (:mod:`pytest_gpu.vendors.sampling`).
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Mapping, Sequence
from typing import Protocol

from . import amd as rocm
from . import intel as xpu
from .devices import Device, Inventory, NvmlUnavailable, cuda_view, nvml_devices
from .sampling import AmdSampler, NvmlSampler, Sampler, XpuSampler

CUDA_VAR = "CUDA_VISIBLE_DEVICES"
NVIDIA_VARS: tuple[str, ...] = (CUDA_VAR, "HIP_VISIBLE_DEVICES")  # HIP's too: HIP on NVIDIA reads it


class Vendor(Protocol):
    """What pytest-gpu needs to know of one vendor's GPUs."""

    name: str  # as --gpus and PYTEST_GPU_FAKE_GPUS spell it
    visibility: tuple[str, ...]  # the variables that narrow a process's view, outermost first

    def devices(self) -> tuple[tuple[Device, ...], str]:
        """Every GPU the driver reports, in the order its runtime enumerates them, and a note;
        raises :data:`UNAVAILABLE` when the driver cannot be asked."""
        ...

    def outer(self, environ: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
        """The visibility variables set in ``environ``."""
        ...

    def view(self, machine: tuple[Device, ...], outer: Sequence[tuple[str, str]]) -> list[int]:
        """Indices of the devices a process started under ``outer`` enumerates, in its order."""
        ...

    def lease_env(self, names: Sequence[str]) -> dict[str, str]:
        """The variables that make a subprocess see exactly the GPUs ``names`` (UUIDs, or a
        simulated machine's indices), in this order, as device 0, 1, …"""
        ...

    def sampler(self) -> Sampler:
        """The driver, open for memory and process samples (the caller closes it);
        :class:`pytest_gpu.vendors.sampling.Unavailable` says why not."""
        ...


class _Nvidia:
    name = "nvidia"
    visibility: tuple[str, ...] = NVIDIA_VARS

    def devices(self) -> tuple[tuple[Device, ...], str]:
        return nvml_devices()

    def outer(self, environ: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
        value = environ.get(CUDA_VAR)
        return () if value is None else ((CUDA_VAR, value),)

    def view(self, machine: tuple[Device, ...], outer: Sequence[tuple[str, str]]) -> list[int]:
        return cuda_view(machine, dict(outer).get(CUDA_VAR))

    def lease_env(self, names: Sequence[str]) -> dict[str, str]:
        return dict.fromkeys(NVIDIA_VARS, ",".join(names))

    def sampler(self) -> Sampler:
        return NvmlSampler()


class _Amd:
    name = "amd"
    visibility: tuple[str, ...] = rocm.VISIBILITY_VARS

    def devices(self) -> tuple[tuple[Device, ...], str]:
        return rocm.amdsmi_devices()

    def outer(self, environ: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
        return rocm.outer(environ)

    def view(self, machine: tuple[Device, ...], outer: Sequence[tuple[str, str]]) -> list[int]:
        return rocm.rocm_view(machine, dict(outer))

    def lease_env(self, names: Sequence[str]) -> dict[str, str]:
        return rocm.lease_env(names)

    def sampler(self) -> Sampler:
        with contextlib.redirect_stdout(io.StringIO()):  # amdsmi prints its load failures
            return AmdSampler()


class _Xpu:
    name = "xpu"
    visibility: tuple[str, ...] = xpu.VISIBILITY_VARS

    def devices(self) -> tuple[tuple[Device, ...], str]:
        return xpu.sysman_devices(os.environ)

    def outer(self, environ: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
        return xpu.outer(environ)

    def view(self, machine: tuple[Device, ...], outer: Sequence[tuple[str, str]]) -> list[int]:
        return xpu.xpu_view(machine, dict(outer))

    def lease_env(self, names: Sequence[str]) -> dict[str, str]:
        return xpu.lease_env(names)

    def sampler(self) -> Sampler:
        return XpuSampler()


NVIDIA: Vendor = _Nvidia()
AMD: Vendor = _Amd()
XPU: Vendor = _Xpu()
VENDORS: dict[str, Vendor] = {v.name: v for v in (NVIDIA, AMD, XPU)}
#: What :meth:`Vendor.devices` raises when the driver cannot be asked.
UNAVAILABLE = (NvmlUnavailable, rocm.AmdSmiUnavailable, xpu.ZesUnavailable)
#: Every variable a lease of any vendor sets to say which GPUs a process sees.
VISIBILITY = tuple(dict.fromkeys(name for v in VENDORS.values() for name in v.visibility))


def of(name: str) -> Vendor:
    """The vendor ``name`` (an inventory's, a fake machine's); :class:`KeyError` for an unknown one."""
    return VENDORS[name]


def started_with(inventory: Inventory) -> tuple[tuple[str, str], ...]:
    """The visibility variables the run started with (NVIDIA's inventory keeps its one as ``visible``)."""
    if inventory.vendor == NVIDIA.name:
        return () if inventory.visible is None else ((CUDA_VAR, inventory.visible),)
    return inventory.outer
