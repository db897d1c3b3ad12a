"""Sticky CUDA errors: whether this process's CUDA is still usable after a test.

A kernel's device-side assert, an illegal address or instruction, a misaligned address
or a launch failure corrupts the CUDA context for good: from then on every runtime call
of the process fails with that error (torch raises ``torch.AcceleratorError`` from
``C10_CUDA_CHECK``: "CUDA error: device-side assert triggered ..."; CuPy
``CUDARuntimeError: cudaErrorAssert: device-side assert triggered``), and the memory the
process holds is freed only when it exits. :func:`probe` asks the process's CUDA as
the next test would: ``torch.cuda.synchronize`` on the lease's devices where torch has a
context (the sticky error surfaces at the first synchronising call), or the simulated
runtime's state on simulated GPUs. It opens no context and starts no CUDA that is not
started already.
"""

from __future__ import annotations

import sys

from ..sim.cuda import STICKY_ERRORS

__all__ = ["probe", "sticky_message"]


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
