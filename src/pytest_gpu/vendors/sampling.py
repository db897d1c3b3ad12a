"""A vendor's driver, opened to sample memory per GPU and per process: what every one answers (pure).

A :class:`Sampler` answers, for a GPU named by UUID, how much memory is in use there
(:meth:`~Sampler.memory`) and what each process uses (:meth:`~Sampler.processes`). What the
driver will not say is an exception whose message says why, in words a report can show:
:class:`Refused` (the GPU cannot be queried at all), :class:`Unlistable` (its processes cannot
be listed). :meth:`pytest_gpu.vendors.vendor.Vendor.sampler` opens a vendor's (NVML's in
:mod:`~pytest_gpu.vendors.nvidia`, amdsmi's in :mod:`~pytest_gpu.vendors.amd`, Level Zero
Sysman's in :mod:`~pytest_gpu.vendors.intel`); a driver that cannot be opened at all raises
:class:`Unavailable`, as its discovery does.
"""

from __future__ import annotations

from typing import Protocol


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
    """No driver could be opened, or it cannot be asked (the message says why): each vendor's
    discovery and sampler raise a subclass of their own."""
