"""Each vendor's driver, opened to sample memory per GPU and per process: NVML, amdsmi.

A :class:`Sampler` answers, for a GPU named by UUID, how much memory is in use there
(:meth:`~Sampler.memory`) and what each process uses (:meth:`~Sampler.processes`). What the
driver will not say is an exception whose message says why, in words a report can show:
:class:`Refused` (the GPU cannot be queried at all), :class:`Unlistable` (its processes cannot
be listed). :meth:`pytest_gpu.vendors.registry.Vendor.sampler` opens a vendor's.

The NVML code is what pytest-gpu always ran, moved here unchanged: the foreign sampler's
(:meth:`~NvmlSampler.processes`: compute and graphics lists, v3 records where the driver has
them; v2 memory with the driver's reserve) and the verifier's and calibration's
(:meth:`~NvmlSampler.compute`: pynvml's own compute list). amdsmi's reads the per-process
list of :mod:`pytest_gpu.vendors.amd`; Level Zero Sysman's, :mod:`pytest_gpu.vendors.intel`'s.
"""

from __future__ import annotations

import contextlib
import functools
from types import ModuleType
from typing import Any, Protocol

from . import libraries


class Refused(Exception):
    """The driver will not query a GPU (the message says why)."""


class Unlistable(Exception):
    """The driver will not list a GPU's processes (the message says why; ``cause``: the driver's
    own words, for a report that names the GPU its own way)."""

    def __init__(self, message: str, cause: str = "") -> None:
        super().__init__(message)
        self.cause = cause or message


class Sampler(Protocol):
    """One vendor's driver, open for samples until :meth:`close`."""

    name: str  # the driver's library as reports name it: "NVML", "amdsmi"

    def memory(self, uuid: str) -> tuple[int, int | None]:
        """(used, reserved) bytes on GPU ``uuid``; ``used`` includes the driver's reserve when
        ``reserved`` is None (not reported). :class:`Refused` when the GPU cannot be queried."""
        ...

    def processes(self, uuid: str) -> dict[int, int | None]:
        """Every process on GPU ``uuid``, once each: pid -> bytes (None: not given).
        :class:`Unlistable` when the driver will not list them."""
        ...

    def compute(self, uuid: str) -> list[tuple[int, int | None]]:
        """The compute processes on GPU ``uuid`` as a lease's verifier reads them: (pid, bytes or
        None), as the driver lists them. :class:`Unlistable` when it will not."""
        ...

    def problem(self) -> str:
        """Why no per-process figure of this driver can be trusted ("" when they can)."""
        ...

    def forget(self, uuid: str) -> None:
        """Drop what is cached about GPU ``uuid`` (after it was refused)."""
        ...

    def close(self) -> None: ...


class Unavailable(RuntimeError):
    """No driver could be opened (the message says why)."""


@functools.cache
def version_problem() -> str:
    """Why the installed nvidia-ml-py's process lists cannot be trusted ("": they can); read once."""
    from .nvmlversion import nvml_version_problem

    return nvml_version_problem() or ""


class NvmlSampler:
    """NVML, initialised once (:class:`Unavailable` when it cannot be); :meth:`close` shuts it down."""

    name = "NVML"

    def __init__(self) -> None:
        self._handles: dict[str, Any] = {}
        try:
            pynvml = libraries.nvml()
            pynvml.nvmlInit()
        except ImportError:
            raise Unavailable("nvidia-ml-py is not installed") from None
        except Exception as exc:  # NVMLError (no driver, no library) and whatever a broken install raises
            raise Unavailable(f"NVML unavailable ({exc})") from None
        self._nvml: ModuleType = pynvml

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:
            pass
        self._handles.clear()

    def problem(self) -> str:
        return version_problem()

    def forget(self, uuid: str) -> None:
        self._handles.pop(uuid, None)

    def _handle(self, uuid: str) -> Any:
        handle = self._handles.get(uuid)
        if handle is None:
            handle = self._handles[uuid] = self._nvml.nvmlDeviceGetHandleByUUID(uuid)
        return handle

    def memory(self, uuid: str) -> tuple[int, int | None]:
        pynvml = self._nvml
        try:
            handle = self._handle(uuid)
            version = getattr(pynvml, "nvmlMemory_v2", None)
            if version is not None:
                try:
                    info = pynvml.nvmlDeviceGetMemoryInfo(handle, version=version)
                    return int(info.used), int(info.reserved)  # v2: used excludes reserved
                except pynvml.NVMLError as exc:
                    if exc.value not in (pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, pynvml.NVML_ERROR_NOT_SUPPORTED):
                        raise
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)
            return int(info.used), None
        except pynvml.NVMLError as exc:
            raise Refused(str(exc)) from None

    def processes(self, uuid: str) -> dict[int, int | None]:
        """Every process on the device, compute and graphics, once each (pid -> bytes)."""
        handle = self._handle(uuid)
        found: dict[int, int | None] = {}
        for kind in ("Compute", "Graphics"):
            try:
                procs = self._list(handle, kind)
            except Unlistable:
                if kind == "Compute":
                    raise
                continue  # no graphics list (a compute-only GPU may refuse it): compute is what matters
            for proc in procs:
                used = None if proc.usedGpuMemory is None else int(proc.usedGpuMemory)
                known = found.get(int(proc.pid))
                # one process in both lists holds one amount of memory, not two
                found[int(proc.pid)] = used if known is None else max(known, used or 0)
        return found

    def compute(self, uuid: str) -> list[tuple[int, int | None]]:
        """pynvml's own compute list (its record version): what the verifier always read."""
        pynvml = self._nvml
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except (pynvml.NVMLError, _mismatch(pynvml)) as exc:
            # MIG without privileges: NoPermission; a driver older than the bindings:
            # nvidia-ml-py raises its library-mismatch error (not an NVMLError)
            raise Unlistable(f"NVML cannot list the processes there ({exc})", str(exc)) from None
        return [(int(p.pid), None if p.usedGpuMemory is None else int(p.usedGpuMemory)) for p in procs]

    def _list(self, handle: Any, kind: str) -> list[Any]:
        """One of NVML's process lists, in the newest records both the driver and the bindings have."""
        pynvml = self._nvml
        for suffix in ("_v3", "_v2", ""):
            function = getattr(pynvml, f"nvmlDeviceGet{kind}RunningProcesses{suffix}", None)
            if function is None:
                continue
            try:
                return list(function(handle))
            except pynvml.NVMLError as exc:
                if exc.value == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                    continue  # an older driver: try older records
                raise Unlistable(f"NVML cannot list the processes there ({exc})") from None
            except Exception as exc:  # nvidia-ml-py's library-mismatch error is not an NVMLError
                raise Unlistable(f"NVML cannot list the processes there ({exc})") from None
        raise Unlistable("NVML has no process list for it")


class AmdSampler:
    """amdsmi, initialised once (:class:`Unavailable` when it cannot be); GPUs named by ROCr UUID.

    Its per-process figures are the driver's (bytes, possibly rounded and a moment old); the
    used VRAM it reports includes the driver's own reservation (``reserved`` is not reported)."""

    name = "amdsmi"

    def __init__(self) -> None:
        from .amd import AmdSmiUnavailable, open_amdsmi

        try:
            self._amdsmi, self._handles = open_amdsmi()
        except AmdSmiUnavailable as exc:
            raise Unavailable(str(exc)) from None

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._amdsmi.amdsmi_shut_down()
        self._handles.clear()

    def problem(self) -> str:
        return ""

    def forget(self, uuid: str) -> None:
        pass  # handles stay valid while the device is present; a vanished one is not found again

    def _handle(self, uuid: str) -> Any:
        from .amd import uuid_key

        handle = self._handles.get(uuid_key(uuid))
        if handle is None:
            raise Refused("amdsmi does not report it")
        return handle

    def memory(self, uuid: str) -> tuple[int, int | None]:
        handle = self._handle(uuid)
        try:
            return int(self._amdsmi.amdsmi_get_gpu_memory_usage(handle, self._amdsmi.AmdSmiMemoryType.VRAM)), None
        except self._amdsmi.AmdSmiException as exc:
            raise Refused(_said(exc)) from None

    def processes(self, uuid: str) -> dict[int, int | None]:
        handle = self._handle(uuid)
        try:
            listed = self._amdsmi.amdsmi_get_gpu_process_list(handle)
        except self._amdsmi.AmdSmiException as exc:
            raise Unlistable(f"amdsmi cannot list the processes there ({_said(exc)})", _said(exc)) from None
        return {int(p["pid"]): int(p["memory_usage"]["vram_mem"]) for p in listed}

    def compute(self, uuid: str) -> list[tuple[int, int | None]]:
        """amdsmi's list is of compute (KFD) processes."""
        try:
            return list(self.processes(uuid).items())
        except Refused as exc:
            raise Unlistable(f"amdsmi cannot list the processes there ({exc})", str(exc)) from None


class XpuSampler:
    """Level Zero Sysman, initialised (:class:`Unavailable` when it cannot be); GPUs named by the
    UUIDs :func:`pytest_gpu.vendors.intel.sysman_devices` gives. Memory and processes are per card: a
    tile (``<uuid>/tile<T>``) is refused, so its lease shows as not verified."""

    name = "Level Zero Sysman"

    def __init__(self) -> None:
        from .intel import Sysman, ZesError, ZesUnavailable

        try:
            self._zes = Sysman()
            self._handles = {card.uuid: card.handle for card in self._zes.cards()}
        except (ZesUnavailable, ZesError) as exc:
            raise Unavailable(str(exc)) from None
        self._error: type[Exception] = ZesError

    def close(self) -> None:
        self._handles.clear()  # Sysman has no shutdown call: the loader stays for the process

    def problem(self) -> str:
        return ""

    def forget(self, uuid: str) -> None:
        pass

    def _handle(self, uuid: str) -> Any:
        if "/tile" in uuid:
            raise Refused("Level Zero Sysman reports memory and processes per card, not per tile")
        handle = self._handles.get(uuid)
        if handle is None:
            raise Refused("Level Zero Sysman does not report it")
        return handle

    def memory(self, uuid: str) -> tuple[int, int | None]:
        handle = self._handle(uuid)
        try:
            return self._zes.memory(handle)[0], None
        except self._error as exc:
            raise Refused(str(exc)) from None

    def processes(self, uuid: str) -> dict[int, int | None]:
        try:
            handle = self._handle(uuid)
        except Refused as exc:
            raise Unlistable(f"Level Zero Sysman cannot list the processes there ({exc})", str(exc)) from None
        try:
            return dict(self._zes.processes(handle))
        except self._error as exc:
            raise Unlistable(f"Level Zero Sysman cannot list the processes there ({exc})", str(exc)) from None

    def compute(self, uuid: str) -> list[tuple[int, int | None]]:
        return list(self.processes(uuid).items())


def _mismatch(pynvml: ModuleType) -> type[Exception]:
    found = getattr(pynvml, "NVMLLibraryMismatchError", None)
    return found if isinstance(found, type) and issubclass(found, Exception) else pynvml.NVMLError


def _said(exc: Exception) -> str:
    from .amd import said

    return said(exc)
