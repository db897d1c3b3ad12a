"""pytest-gpu's hooks, for ``conftest.py`` files and plugins.

Registered by the plugin's ``pytest_addhooks`` (as pytest-xdist registers its own). A
conftest that should also load with the plugin off (``-p no:gpu``) marks its
implementation ``@pytest.hookimpl(optionalhook=True)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from .gpu.isolation import Confinement, GpuLease


@pytest.hookspec(firstresult=True)
def pytest_gpu_item_request(item: pytest.Item) -> Mapping[str, Any] | None:
    """The GPU request of a test that has no ``gpu`` marker, derived by your own rule.

    Return the keyword arguments of a ``gpu`` marker — a dict with any of ``count``,
    ``memory`` and ``exclusive``, e.g. ``{"count": 2, "memory": "8GiB"}``; ``{}`` is a bare
    ``@pytest.mark.gpu`` — validated as the marker's are (a bad one fails collection naming
    the test). Return ``None`` for no opinion: the ``gpu_marker_map`` ini key, then the
    ``gpu`` fixture's default request, decide.

    Called once per collected test in each process that collects it (every xdist worker),
    for tests without a ``gpu`` marker (the marker wins) and without a ``distributed`` one
    (it gets its GPUs from ``gpus_per_rank``). Only the ``conftest.py`` files on the test's
    path take part; the first non-``None`` result wins, the deepest conftest's first.
    """


@pytest.hookspec
def pytest_gpu_confine(lease: GpuLease, confinement: Confinement) -> None:
    """Confine a framework of this test process to ``lease``, when the lease starts.

    Every implementation runs; torch's and CuPy's are built in (``pytest_gpu.gpu.adapters``,
    registered as ``gpu_adapters``: ``-p no:gpu_adapters`` drops them). Called in the process
    that holds the lease (the test's, or a fixture's through ``gpu_lease_factory``), after
    ``CUDA_VISIBLE_DEVICES`` and the lease's environment are decided and before the test body.

    Never import your framework here (a test that does not use it must not pay for it):
    ``confinement.when_imported("jax", apply)`` calls ``apply(module)`` now if it is
    imported, else right after the test imports it. ``confinement.ordinals`` are the leased
    GPUs as this process's CUDA numbers them (``lease.indices``' order), ``lease.memory``
    the bytes per GPU. Undo what you set with ``confinement.on_undo(step)``: the steps run
    last-added first when the lease ends. An error raised now fails the lease's setup; one
    raised by a late ``apply`` is a warning and a note in the test's verdict.
    """
