"""Which process-group backend a distributed test gets here: what ``backend="auto"`` picks,
and what is missing when ``backend="nccl"`` is asked for where it cannot run.

NCCL needs real GPUs (simulated and fake ones are CPU memory behind a simulated CUDA) and a
torch built with it (torch's CPU build has none, nor has torch on Windows or macOS).

The choice is made where the ``distributed`` marker is read: at collection, in the process
that collects the tests (pytest alone, or each xdist worker), since the pool's key and the
GPUs it leases depend on it. torch is not imported for it: where a test module imported it
already, ``torch.distributed.is_nccl_available()`` answers; otherwise torch's
``version.py`` is read from its package directory (``importlib.util.find_spec``, no
import): a CUDA or ROCm build on Linux has NCCL (RCCL), a CPU build does not.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..sim import fake
from ..vendors import registry as vendors

if TYPE_CHECKING:
    from ..vendors.devices import Inventory

# the user property of a test whose marker left the backend to "auto": what auto chose, and why
AUTO_PROPERTY = "dist_backend_auto"
_VERSION_LINE = re.compile(r"^(__version__|cuda|hip|xpu)\s*(?::[^=]*)?=\s*(.+?)\s*$", re.MULTILINE)
_UNREAD = object()  # a version.py value that is not a literal (a newer torch's expression): unknown


@dataclass(frozen=True)
class AutoChoice:
    """What ``backend="auto"`` chose here, and why (said once in the run's summary)."""

    backend: str  # "nccl" or "gloo"
    why: str

    def describe(self) -> str:
        """The wire form of :data:`AUTO_PROPERTY`: ``"gloo: why"``."""
        return f"{self.backend}: {self.why}"


def auto_backend(inventory: Inventory) -> AutoChoice:
    """The vendor's collective backend (``nccl``; ``xccl`` on Intel GPUs) where this run's GPUs are
    real and torch has it, ``gloo`` otherwise."""
    vendor = vendors.of(inventory.vendor)
    lacking = collective_missing(vendor.collective, inventory)
    if lacking is None:
        return AutoChoice(vendor.collective, f"{inventory.describe()} and a torch with {vendor.collective_label}")
    return AutoChoice("gloo", lacking)


def fit_ranks(choice: AutoChoice, world_size: int, inventory: Inventory) -> AutoChoice:
    """``auto``'s choice for ``world_size`` ranks that ask for no ``gpus_per_rank``: nccl gives
    each rank a GPU of its own, so with more ranks than the run has GPUs ``auto`` takes gloo
    (the test runs, on CPU ranks, instead of being skipped)."""
    if choice.backend in ("nccl", "xccl") and world_size > len(inventory.devices):
        return AutoChoice(
            "gloo",
            f"{world_size} ranks would need {world_size} GPUs for {choice.backend} and this run has "
            f"{inventory.describe()}",
        )
    return choice


def collective_missing(backend: str, inventory: Inventory) -> str | None:
    """The piece the collective ``backend`` (a vendor's, :attr:`~pytest_gpu.vendors.vendor.Vendor.collective`)
    lacks here, in words; ``None``: none."""
    return xccl_missing(inventory) if backend == "xccl" else nccl_missing(inventory)


def nccl_missing(inventory: Inventory) -> str | None:
    """The piece NCCL lacks here (GPUs, real GPUs, NCCL in torch), in words; ``None``: none."""
    if not inventory.devices:
        return f"this run has {inventory.describe()}"
    if inventory.simulated:
        return f"the GPUs are simulated ({inventory.source}) and NCCL needs real ones"
    if fake.active():
        return f"the GPUs are fake ({fake.FAKE_ENV}={fake.requested() or ''}) and NCCL needs real ones"
    return torch_nccl_missing()


def xccl_missing(inventory: Inventory) -> str | None:
    """The piece XCCL lacks here (Intel GPUs, real ones, XCCL in torch), in words; ``None``: none.

    torch has XCCL from 2.8 on, in its XPU builds (``torch.distributed.is_xccl_available``);
    where torch is not imported, its ``version.py`` says whether it is an XPU build (``xpu =``)."""
    if not inventory.devices:
        return f"this run has {inventory.describe()}"
    if fake.active():
        return f"the GPUs are fake ({fake.FAKE_ENV}={fake.requested() or ''}) and XCCL needs real ones"
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "__version__"):
        try:
            import torch.distributed as dist
        except ImportError as exc:
            return f"torch.distributed cannot be imported ({exc})"
        available = getattr(dist, "is_xccl_available", None)
        if available is None:
            return f"torch {torch.__version__} has no XCCL (torch.distributed.is_xccl_available: torch >= 2.8)"
        return None if available() else f"torch {torch.__version__} has no XCCL (not an XPU build)"
    return _installed_torch_xccl_missing(vendors.of(inventory.vendor).kind.torch_build)


@functools.lru_cache(maxsize=1)
def _installed_version_py() -> tuple[bool, str | None]:
    """Whether torch is installed, and its ``torch/version.py`` (``None``: unreadable), read
    without importing torch; read once."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return False, None
    try:
        return True, (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text(encoding="utf-8")
    except OSError:
        return True, None


def _version_fields(version_py: str) -> dict[str, object]:
    """``__version__``, ``cuda``, ``hip`` and ``xpu`` of a ``torch/version.py`` (a value that is
    not a literal: :data:`_UNREAD`)."""
    found: dict[str, object] = {}
    for name, value in _VERSION_LINE.findall(version_py):
        try:
            found[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            found[name] = _UNREAD
    return found


def _said_version(found: dict[str, object]) -> str:
    version = found.get("__version__", "?")
    return version if isinstance(version, str) else "?"


@functools.lru_cache(maxsize=1)
def _installed_torch_xccl_missing(build: str) -> str | None:
    """The installed torch's answer for XCCL, from its ``version.py``."""
    installed, text = _installed_version_py()
    if not installed:
        return "torch is not installed"
    return None if text is None else build_xccl_missing(text, build)  # unreadable: the ranks' torch says it


def build_xccl_missing(version_py: str, build: str) -> str | None:
    """What a torch whose ``torch/version.py`` reads ``version_py`` lacks for XCCL: not an XPU build
    (its field ``build``, the Intel vendor's :attr:`~pytest_gpu.vendors.kinds.Kind.torch_build`, is
    ``xpu = None``), or older than 2.8."""
    found = _version_fields(version_py)
    said = _said_version(found)
    if found.get(build) is None:
        return f"torch {said} has no XCCL (not an XPU build)"
    numbers = re.match(r"(\d+)\.(\d+)", said)
    if numbers and (int(numbers.group(1)), int(numbers.group(2))) < (2, 8):
        return f"torch {said} has no XCCL (torch >= 2.8)"
    return None


def torch_nccl_missing() -> str | None:
    """Why this interpreter's torch cannot give NCCL ("torch 2.3.0+cpu has no NCCL ..."), or ``None``."""
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "__version__"):  # imported (not half-way): ask it
        try:
            import torch.distributed as dist
        except ImportError as exc:
            return f"torch.distributed cannot be imported ({exc})"
        version = str(torch.__version__)
        if not dist.is_available():
            return f"torch {version} was built without torch.distributed"
        if not dist.is_nccl_available():
            built = getattr(torch, "version", None)
            return f"torch {version} has no NCCL{_cpu_build(getattr(built, 'cuda', None), getattr(built, 'hip', None))}"
        return None
    return _installed_torch_nccl_missing()


@functools.lru_cache(maxsize=1)
def _installed_torch_nccl_missing() -> str | None:
    """The installed torch's answer for NCCL, from its ``version.py``."""
    installed, text = _installed_version_py()
    if not installed:
        return "torch is not installed"
    # unreadable: cannot tell; the ranks' torch says it, should it lack NCCL
    return None if text is None else build_nccl_missing(text, sys.platform)


def build_nccl_missing(version_py: str, platform: str) -> str | None:
    """What a torch whose ``torch/version.py`` reads ``version_py`` lacks for NCCL on ``platform``.

    Its builds with NCCL are the CUDA and ROCm (RCCL) builds for Linux; a ``version.py``
    that cannot be read as such (no ``cuda =`` line) is taken to have it (the ranks' torch
    then says what it lacks)."""
    found = _version_fields(version_py)
    version = _said_version(found)
    if platform != "linux":
        return f"torch {version} has no NCCL on {platform}"
    hip = None if found.get("hip") is _UNREAD else found.get("hip")  # an unread hip: as if absent
    if "cuda" in found and not found["cuda"] and not hip:  # an unread cuda: taken to have NCCL
        return f"torch {version} has no NCCL{_cpu_build(None, None)}"
    return None


def _cpu_build(cuda: object, hip: object) -> str:
    return " (a CPU build)" if not cuda and not hip else ""
