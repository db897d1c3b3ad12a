"""The one list of GPU vendors, and what is said of each: its name, its words, and what a
simulated machine of it is (pure).

The product (:mod:`pytest_gpu.vendors.registry`, one object per vendor that implements
:class:`pytest_gpu.vendors.vendor.Vendor` over one of these) and the simulated machines
(:mod:`pytest_gpu.sim.spec`) take their vendors from :data:`ALL`; the first is the default
(a spec or an inventory that names none is NVIDIA's).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Kind:
    """One vendor's name and words: what needs no driver to be said."""

    name: str  # as --gpus and PYTEST_GPU_FAKE_GPUS spell it
    label: str  # its GPUs in messages: "NVIDIA", "AMD", "Intel"
    runtime: str  # the runtime whose context a test process opens there: "CUDA", "HIP", "Level Zero"
    device_kind: str  # how torch names its devices: "cuda" (torch on ROCm too), "xpu"
    torch_build: str  # the field of torch/version.py that says a torch is built for its GPUs
    named: bool  # whether an inventory says whose GPUs they are ("2 AMD GPUs"); NVIDIA's go unnamed, as always
    # a simulated machine of it (pytest_gpu.sim.spec)
    sim_uuid_prefix: str  # its simulated GPU's UUID: this, then the GPU's index in 12 digits ...
    sim_uuid_base: int  # ... of this base (10 or 16)
    sim_options: tuple[str, ...]  # the spec's options only its fake driver has (a prefix each)
    sim_option_refused: str  # why another vendor's machine refuses one: formatted with option=, vendor=
    fakes: tuple[str, ...]  # the fake libraries its machine loads (pytest_gpu.sim's modules of that name)

    @property
    def context(self) -> str:
        """What a test process opens on one of its GPUs, as messages name it: "CUDA context"."""
        return f"{self.runtime} context"

    def sim_uuid(self, index: int) -> str:
        """The UUID of its simulated GPU ``index``."""
        return self.sim_uuid_prefix + (f"{index:012d}" if self.sim_uuid_base == 10 else f"{index:012x}")

    def sim_index(self, uuid: str) -> int | None:
        """The index of its simulated GPU whose UUID is ``uuid`` (``None``: not one of its form)."""
        digits = "[0-9]" if self.sim_uuid_base == 10 else "[0-9a-f]"
        found = re.fullmatch(f"{re.escape(self.sim_uuid_prefix)}({digits}{{12}})", uuid)
        return None if found is None else int(found.group(1), self.sim_uuid_base)

    def gpu_label(self, index: int) -> str:
        """Its GPU ``index`` as ``pytest-gpu status`` names it: ``GPU 2``, ``AMD GPU 2``."""
        return f"{self.label} GPU {index}" if self.named else f"GPU {index}"


NVIDIA = Kind(
    name="nvidia",
    label="NVIDIA",
    runtime="CUDA",
    device_kind="cuda",
    torch_build="cuda",
    named=False,
    sim_uuid_prefix="GPU-51a00000-0000-4000-8000-",
    sim_uuid_base=10,
    sim_options=("mig:", "no-v3", "no-usage", "pidns"),
    sim_option_refused=(
        "{option!r} is an NVIDIA driver's option; a fake {vendor} machine has no NVML "
        "(expected only reserved=, context= or fault: options there)"
    ),
    fakes=("nvml",),
)
AMD = Kind(
    name="amd",
    label="AMD",
    runtime="HIP",
    device_kind="cuda",  # torch on ROCm names HIP's devices "cuda"
    torch_build="hip",
    named=True,
    # ROCr's "GPU-" and 16 hex digits: the ASIC serial 0x51a0... | index (fake_amdsmi.c's serial_of)
    sim_uuid_prefix="GPU-51a0",
    sim_uuid_base=16,
    sim_options=("proc-unit", "proc-refresh", "rocr-order", "proc-fds", "apu", "no-uuid"),
    sim_option_refused="{option!r} describes amdsmi's process list; expected it on an amd: machine",
    fakes=("nvml", "amdsmi"),  # the fake NVML answers "Driver Not Loaded" there
)
XPU = Kind(
    name="xpu",
    label="Intel",
    runtime="Level Zero",
    device_kind="xpu",
    torch_build="xpu",
    named=True,
    # the 16 bytes of Sysman's core.uuid as 8-4-4-4-12 hex digits (fake_zes.c's uuid_of)
    sim_uuid_prefix="51a0e000-0000-4000-8000-",
    sim_uuid_base=16,
    sim_options=(),
    sim_option_refused="",
    fakes=("nvml", "zes"),
)

#: Every vendor pytest-gpu knows, the default first.
ALL: tuple[Kind, ...] = (NVIDIA, AMD, XPU)
NAMES: tuple[str, ...] = tuple(kind.name for kind in ALL)
DEFAULT = ALL[0]


def of(name: str) -> Kind:
    """The vendor ``name``; :class:`KeyError` for an unknown one."""
    for kind in ALL:
        if kind.name == name:
            return kind
    raise KeyError(name)
