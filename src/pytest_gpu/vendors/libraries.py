"""The GPU vendors' Python libraries (nvidia-ml-py's ``pynvml``, ``amdsmi``), imported when a run
needs them, with the warnings their import raises handed to pytest.

Importing one can warn: where the deprecated PyPI package ``pynvml`` is installed (a shim over
nvidia-ml-py that other packages still depend on), the first ``import pynvml`` of a process
raises a FutureWarning. The plugin imports these libraries while it configures, before pytest
records warnings: such a warning would be printed raw, be missing from the warnings summary,
and turn a ``filterwarnings = error`` suite into an INTERNALERROR. :func:`load` holds it;
:func:`report_to` hands it to pytest, which shows it in the warnings summary unless the user's
filters ignore it. A filter that makes it an error shows it there too instead of failing the
run: the plugin imported the library, not the user's code, and the user's own import of it
(their tests', their dependencies') still meets their filters where it happens, before or
without the plugin's. A process that never reports (the ``pytest-gpu`` command, a rank)
drops what it holds: the run's own process says it.

A library a process opens (NVML, amdsmi, Sysman) is kept open for the process's life and
opened again in a forked child (:class:`PerProcess`): opening costs more than the samples,
and a parent's library state is not the child's to use.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:  # the command and rank processes use this module without pytest
    import pytest

NVML_LIBRARY = "libnvidia-ml.so.1"  # what nvidia-ml-py loads on Linux

T = TypeVar("T")


class PerProcess(Generic[T]):
    """One ``T`` for this process (an opened vendor library), made by ``make`` at the first
    :meth:`get` and kept; a forked child makes its own, after ``inherited`` (if given) has
    dropped its copy of the parent's. A ``make`` that raises keeps nothing: the next
    :meth:`get` tries again (the driver may appear). Thread-safe."""

    def __init__(self, make: Callable[[], T], inherited: Callable[[T], None] | None = None) -> None:
        self._make = make
        self._inherited = inherited
        self._lock = threading.Lock()
        self._value: T | None = None
        self._pid = 0

    def get(self, renew: Callable[[T], bool] | None = None) -> T:
        """This process's ``T``; made anew where there is none yet, where it is a forked
        parent's, or where ``renew`` says the one kept is no longer right."""
        with self._lock:
            value = self._value
            if value is not None and self._pid != os.getpid():
                self._value = None
                if self._inherited is not None:
                    self._inherited(value)
            elif value is not None and (renew is None or not renew(value)):
                return value
            self._value, self._pid = self._make(), os.getpid()
            return self._value

    def take(self) -> T | None:
        """This process's ``T``, no longer kept (``None``: none, or only a forked parent's)."""
        with self._lock:
            value, self._value = self._value, None
            return value if self._pid == os.getpid() else None


class NvmlLibraryMissing(OSError):
    """No NVML library to load (no NVIDIA driver): ``pynvml`` was not imported."""


_held: list[warnings.WarningMessage] = []
_reporting: list[pytest.Config] = []  # the configs of the runs in this process, innermost last


def load(name: str) -> ModuleType:
    """``import name``, the warnings of its first import held for :func:`report_to`.

    Raises what the import raises (ImportError where it is not installed, ...)."""
    module = sys.modules.get(name)
    if module is not None:  # imported: nothing warns, and the process's warning filters are left alone
        return module
    caught: list[warnings.WarningMessage] = []
    try:
        # catch_warnings swaps the process's filters: the first import happens in the main thread,
        # where the plugin configures (discovery, the simulated machine)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # the user's filters decide when pytest is handed them
            module = __import__(name)
    finally:
        for message in caught:  # handed on outside the catch: pytest applies its own filters
            _take(message)
    return module


def nvml() -> ModuleType:
    """nvidia-ml-py's ``pynvml`` (:func:`load`), imported only where NVML's library loads: a machine
    without NVIDIA's driver never imports it. :class:`NvmlLibraryMissing` says so in pynvml's
    words; ImportError where nvidia-ml-py is not installed."""
    if "pynvml" not in sys.modules:  # once imported, pynvml's own library (perhaps the fake one) answers
        try:
            ctypes.CDLL(NVML_LIBRARY)  # as pynvml does at nvmlInit; it stays loaded for it
        except OSError:
            raise NvmlLibraryMissing("NVML Shared Library Not Found") from None
    return load("pynvml")


def report_to(config: pytest.Config) -> None:
    """Hand held warnings to ``config``'s run now, and those of later imports as they come,
    until the run's cleanup (called when the plugin configures, in every pytest process)."""
    _reporting.append(config)
    config.add_cleanup(lambda: _reporting.remove(config))
    while _held:
        _issue(config, _held.pop(0))


def _take(message: warnings.WarningMessage) -> None:
    if _reporting:
        _issue(_reporting[-1], message)
    else:
        _held.append(message)


def _issue(config: pytest.Config, message: warnings.WarningMessage) -> None:
    warning = message.message if isinstance(message.message, Warning) else message.category(str(message.message))
    try:
        # the user's filterwarnings and -W decide: ignored, or recorded for the warnings summary
        config.issue_config_time_warning(warning, stacklevel=2)
    except Warning:  # they make it an error: shown, not raised (see the module's docstring)
        config.hook.pytest_warning_recorded.call_historic(
            kwargs={"warning_message": message, "when": "config", "nodeid": "", "location": None}
        )
