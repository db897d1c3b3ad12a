"""Shared test helpers.

Tests that need an optional component (torch, Open MPI, SLURM, Ray, ...) call
``require("name")``: when it is absent the test is skipped with the reason
``missing component: name``. `.ci/run` installs every component and fails the build if
any test is skipped with that reason.
"""

from __future__ import annotations

import importlib.util
import shutil

import pytest

pytest_plugins = ["pytester"]

MISSING = "missing component"


def require(component: str, *, module: str | None = None, executable: str | None = None) -> None:
    """Skip the calling test unless ``module`` imports / ``executable`` is on PATH."""
    if module is not None and importlib.util.find_spec(module) is None:
        pytest.skip(f"{MISSING}: {component} (python module {module!r} not installed)")
    if executable is not None and shutil.which(executable) is None:
        pytest.skip(f"{MISSING}: {component} ({executable!r} not on PATH)")
