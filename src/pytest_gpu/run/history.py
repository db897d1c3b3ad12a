"""What earlier runs measured, kept in pytest's cache (``.pytest_cache``).

``pytest_gpu/durations``: node id -> seconds (setup + call + teardown), for the scheduler
and for sharding. ``pytest_gpu/peaks``: node id -> highest bytes on one GPU (``--gpu-learn``).
Only one process per run writes (the xdist controller, or rank 0 of a launch).

pytest's own entries are read, never written: ``cache/lastfailed`` (node ids that failed
last time, kept by ``--lf``/``--ff``) and ``cache/nodeids`` (every node id seen, kept by
``--nf``), so the scheduler orders tests as those options would.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

DURATIONS_KEY = "pytest_gpu/durations"
PEAKS_KEY = "pytest_gpu/peaks"
LASTFAILED_KEY = "cache/lastfailed"  # pytest's cacheprovider
NODEIDS_KEY = "cache/nodeids"  # pytest's cacheprovider


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


def last_failed(config: pytest.Config) -> set[str]:
    """Node ids (tests, or collectors that failed to collect) that failed in the last run."""
    return set(load(config, LASTFAILED_KEY))


def known_nodeids(config: pytest.Config) -> set[str] | None:
    """Every node id earlier runs collected; ``None`` when nothing was recorded (all would look new)."""
    found = cache(config)
    value = found.get(NODEIDS_KEY, None) if found is not None else None
    return {str(n) for n in value} if isinstance(value, list) and value else None
