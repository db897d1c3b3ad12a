"""What earlier runs measured, kept in pytest's cache (``.pytest_cache``).

``pytest_gpu/durations``: node id -> seconds (setup + call + teardown), for the scheduler
and for sharding. ``pytest_gpu/peaks``: node id -> highest bytes on one GPU (``--gpu-learn``).
Only one process per run writes (the xdist controller, or rank 0 of a launch).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

DURATIONS_KEY = "pytest_gpu/durations"
PEAKS_KEY = "pytest_gpu/peaks"


def cache(config: object) -> Any:
    """pytest's cache, or ``None`` under ``-p no:cacheprovider``."""
    return getattr(config, "cache", None)


def load(config: pytest.Config, key: str) -> dict[str, Any]:
    found = cache(config)
    if found is None:
        return {}
    value = found.get(key, {})
    return dict(value) if isinstance(value, dict) else {}  # a hand-edited file must not break the run


def merge(config: pytest.Config, key: str, fresh: Mapping[str, Any]) -> None:
    """Update ``key`` with ``fresh`` (older entries for other tests are kept)."""
    found = cache(config)
    if found is None or not fresh:
        return
    values = load(config, key)
    values.update(fresh)
    found.set(key, values)
