"""pytest-gpu: run GPU-heavy test suites in parallel on every GPU, without OOMs or port clashes.

Layers (each uses only those above it):

    requests      what a test asks for (pure)
    host          the machine's CPUs and RAM as leases, thread counts that follow cpus=
    sim/          simulated GPUs as strict as CUDA and NVML: spec, ledger (the test
                  "physics"), cuda (a process's runtime), nvml (a fake libnvidia-ml.so.1),
                  torch_cuda (torch.cuda for the CPU build), fake (the PYTEST_GPU_FAKE_GPUS switch)
    gpu/          real GPUs: devices (NVML, index lists, MIG), runtime (the process's CUDA,
                  pinned before a lease), isolation (applying a lease), verification,
                  foreign (what processes outside pytest-gpu use, through NVML)
    placement     which GPUs a request gets, fairness (pure)
    machine/      every run of a machine shares one view of its GPUs: domain (where runs
                  meet), arbiter (the one pool), wire, server, link (lead, attach, fail over)
    ports         run-unique TCP ports
    broker        a run's lease service; client: its test-process side
    conventions   requests from a suite's own markers and the pytest_gpu_item_request hook
                  (declared in hookspecs)
    autoworkers   GPU-aware ``-n auto``
    session       one process's pytest-gpu state; lifecycle: one test's; fixture_leases:
                  leases held by fixtures of any scope
    reporting     the terminal summary (wording: counts that read right)
    plugin        pytest hooks only
    cli           the ``pytest-gpu`` command (inventory, report, status)
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .gpu.isolation import GpuLease
    from .leasing.requests import GpuRequest, parse_size

__all__ = ["GpuLease", "GpuRequest", "parse_size"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # lazily: the plugin is loaded into every pytest process, CPU-only suites included
    if name == "GpuLease":
        from .gpu.isolation import GpuLease

        return GpuLease
    if name in ("GpuRequest", "parse_size"):
        from .leasing import requests

        return getattr(requests, name)
    raise AttributeError(f"module 'pytest_gpu' has no attribute {name!r}")
