"""pytest-gpu's hooks, for ``conftest.py`` files and plugins.

Registered by the plugin's ``pytest_addhooks`` (as pytest-xdist registers its own). A
conftest that should also load with the plugin off (``-p no:gpu``) marks its
implementation ``@pytest.hookimpl(optionalhook=True)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest


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
