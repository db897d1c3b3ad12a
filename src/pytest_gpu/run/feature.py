"""What every feature's hook object shares: the config it serves, and the run it reads.

Each feature of pytest-gpu (a test's leases, the quarantine, ``--gpu-required``, distributed
tests, the summary, the scheduler, node mode, ...) is one object with the hooks it needs,
registered by the process's role (:mod:`pytest_gpu.roles`) only where it is enabled, as
pytest's own ``LogXML`` or ``LFPlugin`` are. The role registers most of them before the
initial conftests load (hook order follows registration: a conftest's plain hooks run before
a feature's); the run exists from ``pytest_configure`` on, and no hook of a feature fires
before it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from .record import RUN_KEY

if TYPE_CHECKING:
    from .session import GpuRun


class Feature:
    """A feature's hook object (see the module docstring)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    @property
    def run(self) -> GpuRun:
        """The process's run (``pytest_configure`` on, until the role closes it)."""
        return self.config.stash[RUN_KEY]

    @property
    def has_run(self) -> bool:
        """Whether the run exists (``False`` in ``pytest_unconfigure`` when ``pytest_configure`` failed)."""
        return RUN_KEY in self.config.stash
