"""The vendors pytest-gpu knows, one object each, in :data:`pytest_gpu.vendors.kinds.ALL`'s order:
:data:`NVIDIA` (NVML, ``CUDA_VISIBLE_DEVICES``), :data:`AMD` (amdsmi, ``ROCR_VISIBLE_DEVICES``
then HIP's) and :data:`XPU` (Level Zero Sysman, ``ZE_AFFINITY_MASK``), each implementing
:class:`~pytest_gpu.vendors.vendor.Vendor`. A run's inventory names its vendor
(:attr:`Inventory.vendor`); :func:`of` gives the object.
"""

from __future__ import annotations

from .amd import AMD
from .intel import XPU
from .kinds import DEFAULT as DEFAULT_KIND
from .kinds import NAMES
from .nvidia import NVIDIA
from .vendor import Vendor

__all__ = ["AMD", "DEFAULT", "NVIDIA", "VENDORS", "VISIBILITY", "XPU", "Vendor", "of"]

VENDORS: dict[str, Vendor] = {v.name: v for v in (NVIDIA, AMD, XPU)}
if tuple(VENDORS) != NAMES:  # one list of vendors: the implementations follow it
    raise ImportError(f"pytest_gpu.vendors.registry lists {tuple(VENDORS)}, pytest_gpu.vendors.kinds {NAMES}")
#: The vendor of a ``--gpus`` value or a spec that names none.
DEFAULT = VENDORS[DEFAULT_KIND.name]
#: Every variable a lease of any vendor sets to say which GPUs a process sees.
VISIBILITY = tuple(dict.fromkeys(name for v in VENDORS.values() for name in v.visibility))


def of(name: str) -> Vendor:
    """The vendor ``name`` (an inventory's, a lease's, a fake machine's); :class:`KeyError` for an unknown one."""
    return VENDORS[name]
