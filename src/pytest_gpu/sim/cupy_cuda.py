"""A CuPy stand-in on the simulated runtime: ``cupy.cuda.Device`` and the default memory pool.

What it models, after CuPy's own sources (``cupy/cuda/device.pyx``, ``cupy/cuda/memory.pyx``,
``cupy_backends/cuda/api/runtime.pyx``, read at cupy/cupy 6b6d956):

- ``runtime.setDevice`` is ``cudaSetDevice``, which since CUDA 12 opens the device's primary
  context (charged in the ledger); ``runtime.getDevice`` opens none. The current device is
  the calling thread's (:mod:`pytest_gpu.sim.cuda`).
- ``Device.__enter__`` pushes the current device on a per-thread stack and switches only
  when the target differs; ``Device.__exit__`` calls ``setDevice`` on the popped device
  *unconditionally*: leaving ``with Device(k)`` from a device without a context opens one
  there. ``Device.use()`` is a plain ``setDevice``.
- ``MemoryPool`` keeps one ``SingleDeviceMemoryPool`` per device (``getDeviceCount`` of
  them, made on first use); ``malloc``, ``set_limit``, ``get_limit``, ``free_all_blocks``,
  ``used_bytes``, ``total_bytes`` act on the *current* device's pool only. ``set_limit``
  with neither size nor fraction (or 0) lifts the limit; ``fraction`` is of
  ``cudaMemGetInfo``'s total (which opens a context). Sizes round up to 512 bytes; a freed
  block stays in the pool (reserved) until ``free_all_blocks``; a request past the limit
  frees the pool's cached blocks and retries once, then raises
  :class:`OutOfMemoryError`.

- ``runtime.deviceSynchronize`` and ``Device.synchronize`` are ``cudaDeviceSynchronize``: they
  wait for the process's kernels (a hung one: for ever, :func:`pytest_gpu.sim.hang`). After a
  sticky error every runtime call raises ``CUDARuntimeError`` (``cupy_backends.cuda.api.runtime``:
  ``status`` is the ``cudaError_t``, the message ``"<cudaGetErrorName>: <cudaGetErrorString>"``,
  such as ``cudaErrorAssert: device-side assert triggered``).

Left out: streams and arenas, block splitting (a cached block serves a request of the same
rounded size only), ``MemoryAsyncPool``, pinned memory, kernels.

:func:`module` builds the stand-in as a ``cupy`` module object (put it in ``sys.modules``
for the code under test). Not CuPy itself, and never run against CuPy here.
"""

from __future__ import annotations

import gc
import sys
import threading
import types
from dataclasses import dataclass, field
from typing import Any

from ..base.requests import parse_size
from . import cuda as sim_cuda

__all__ = ["CUDARuntimeError", "Device", "MemoryPointer", "MemoryPool", "OutOfMemoryError", "module"]

__tracebackhide__ = sim_cuda.hidden_in_tracebacks  # an OOM shows the test's line, as CuPy's (from Cython) does

ALLOCATION_UNIT = 512  # cupy.cuda.memory: every size rounds up to a multiple of it


class OutOfMemoryError(MemoryError):
    """``cupy.cuda.memory.OutOfMemoryError``."""

    def __init__(self, size: int, total: int, limit: int = 0) -> None:
        message = f"Out of memory allocating {size:,} bytes (allocated so far: {total:,} bytes"
        message += f", limit set to: {limit:,} bytes)." if limit else ")."
        super().__init__(message)


class CUDARuntimeError(RuntimeError):
    """``cupy_backends.cuda.api.runtime.CUDARuntimeError``: ``status`` is the ``cudaError_t``."""

    def __init__(self, status: int) -> None:
        self.status = status
        name = next(n for n, code in sim_cuda.ERROR_CODES.items() if code == status)
        text = next(t for t, n in sim_cuda.STICKY_ERRORS.items() if n == name)
        super().__init__(f"{name}: {text}")


def _checked() -> None:
    """CuPy's ``check_status`` of a runtime call made after a sticky error (every call fails with it)."""
    error = sim_cuda.sticky_error()
    if error is not None:
        raise CUDARuntimeError(sim_cuda.ERROR_CODES[sim_cuda.STICKY_ERRORS[error]])


class _Runtime:
    """``cupy_backends.cuda.api.runtime`` on the simulated CUDA."""

    CUDARuntimeError = CUDARuntimeError

    @staticmethod
    def getDevice() -> int:
        return sim_cuda.current_device()

    @staticmethod
    def setDevice(device: int) -> None:
        _checked()
        sim_cuda.set_device(device)  # cudaSetDevice: opens the primary context (CUDA 12)

    @staticmethod
    def getDeviceCount() -> int:
        return sim_cuda.device_count()

    @staticmethod
    def memGetInfo() -> tuple[int, int]:
        _checked()
        return sim_cuda.mem_get_info()

    @staticmethod
    def deviceSynchronize() -> None:
        _checked()
        sim_cuda.wait_for_kernels()
        sim_cuda.set_device(sim_cuda.current_device())  # needs (and opens) the current device's context


runtime = _Runtime()
_thread_local = threading.local()


def _stack() -> list[int]:
    """CuPy's ``_ThreadLocalStack``: the devices ``with Device(...)`` blocks left, per thread."""
    stack: list[int] | None = getattr(_thread_local, "device_stack", None)
    if stack is None:
        stack = _thread_local.device_stack = []
    return stack


class Device:
    """``cupy.cuda.Device``."""

    def __init__(self, device: int | Device | None = None) -> None:
        self.id = runtime.getDevice() if device is None else int(device)

    def __int__(self) -> int:
        return self.id

    def __enter__(self) -> Device:
        current = runtime.getDevice()
        _stack().append(current)
        if self.id != current:
            runtime.setDevice(self.id)
        return self

    def __exit__(self, *exc: object) -> None:
        runtime.setDevice(_stack().pop())  # unconditional, as CuPy's: opens a context there if none

    def use(self) -> Device:
        runtime.setDevice(self.id)
        return self

    def synchronize(self) -> None:
        """``cudaDeviceSynchronize`` with this device current, as CuPy's (``with self: ...``)."""
        with self:
            runtime.deviceSynchronize()

    def __repr__(self) -> str:
        return f"<CUDA Device {self.id}>"


class MemoryPointer:
    """What ``malloc`` returns; its memory goes back to the pool on :meth:`free` or when collected."""

    def __init__(self, pool: _SingleDevicePool, size: int, chunk: sim_cuda.Allocation) -> None:
        self._pool: _SingleDevicePool | None = pool
        self.size = size
        self.device_id = pool.device
        self._chunk = chunk

    def free(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.give_back(self.size, self._chunk)

    def __del__(self) -> None:
        if not sys.is_finalizing():
            self.free()


@dataclass
class _SingleDevicePool:
    """``SingleDeviceMemoryPool``: one device's cached chunks, limit and counters."""

    device: int
    limit: int = 0  # 0: none
    used: int = 0
    cached: dict[int, list[sim_cuda.Allocation]] = field(default_factory=dict)  # size -> free chunks

    def total(self) -> int:
        return self.used + sum(size * len(chunks) for size, chunks in self.cached.items())

    def malloc(self, nbytes: int) -> MemoryPointer:
        size = ALLOCATION_UNIT * -(-max(nbytes, 1) // ALLOCATION_UNIT)
        reuse = self.cached.get(size)
        if reuse:
            chunk = reuse.pop()
        else:
            if self.limit and self.total() + size > self.limit:
                self.free_all_blocks()
                if self.total() + size > self.limit:
                    gc.collect()  # CuPy collects, then frees the pool, before giving up
                    self.free_all_blocks()
                if self.total() + size > self.limit:
                    raise OutOfMemoryError(size, self.total(), self.limit)
            _checked()  # cudaMalloc after a sticky error
            try:
                chunk = sim_cuda.allocate(size, device=self.device)  # opens the context if none
            except sim_cuda.OutOfMemoryError:
                self.free_all_blocks()
                try:
                    chunk = sim_cuda.allocate(size, device=self.device)
                except sim_cuda.OutOfMemoryError:
                    raise OutOfMemoryError(size, self.total(), self.limit) from None
        self.used += size
        return MemoryPointer(self, size, chunk)

    def give_back(self, size: int, chunk: sim_cuda.Allocation) -> None:
        self.used -= size
        self.cached.setdefault(size, []).append(chunk)

    def free_all_blocks(self) -> None:
        for chunks in self.cached.values():
            for chunk in chunks:
                chunk.free()
        self.cached.clear()


class MemoryPool:
    """``cupy.cuda.MemoryPool``: every call acts on the current device's pool."""

    def __init__(self) -> None:
        self._pools: list[_SingleDevicePool] | None = None

    def device_pool(self) -> _SingleDevicePool:
        if self._pools is None:
            self._pools = [_SingleDevicePool(i) for i in range(runtime.getDeviceCount())]
        return self._pools[runtime.getDevice()]

    def malloc(self, size: int | str) -> MemoryPointer:
        return self.device_pool().malloc(parse_size(size))

    def free_all_blocks(self, stream: object = None) -> None:
        self.device_pool().free_all_blocks()

    def used_bytes(self) -> int:
        return self.device_pool().used

    def total_bytes(self) -> int:
        return self.device_pool().total()

    def free_bytes(self) -> int:
        pool = self.device_pool()
        return pool.total() - pool.used

    def set_limit(self, size: int | None = None, fraction: float | None = None) -> None:
        if size is None:
            if fraction is None:
                size = 0
            else:
                if not 0 <= fraction <= 1:
                    raise ValueError(f"memory limit fraction out of range: {fraction}")
                size = int(fraction * runtime.memGetInfo()[1])
        elif fraction is not None:
            raise ValueError("size and fraction cannot be specified at one time")
        if size < 0:
            raise ValueError(f"memory limit size out of range: {size}")
        self.device_pool().limit = int(size)

    def get_limit(self) -> int:
        return self.device_pool().limit


def module() -> Any:
    """A fresh ``cupy`` stand-in module: ``cupy.cuda.Device``, ``cupy.cuda.runtime``,
    ``cupy.cuda.MemoryPool``, ``cupy.get_default_memory_pool()``."""
    cupy = types.ModuleType("cupy")
    cuda = types.ModuleType("cupy.cuda")
    pool = MemoryPool()
    cuda.Device = Device  # type: ignore[attr-defined]
    cuda.runtime = runtime  # type: ignore[attr-defined]
    cuda.MemoryPool = MemoryPool  # type: ignore[attr-defined]
    cuda.OutOfMemoryError = OutOfMemoryError  # type: ignore[attr-defined]
    cupy.cuda = cuda  # type: ignore[attr-defined]
    cupy.get_default_memory_pool = lambda: pool  # type: ignore[attr-defined]
    return cupy
