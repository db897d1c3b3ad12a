"""The package as published: what pyproject.toml declares matches the package's files.

The wheel itself is built, installed and run outside the checkout by `.ci/wheel_check`;
these checks catch the same mistakes in the fast tier, before a build."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path
from typing import Any

import pytest

import pytest_gpu
from helpers import ROOT

PACKAGE = Path(pytest_gpu.__file__).parent


def _pyproject() -> dict[str, Any]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    data: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return data


def _shipped(path: Path, package_data: dict[str, list[str]]) -> bool:
    """Does a package-data glob of the file's own package (or "*") name it?"""
    package = ".".join(path.parent.relative_to(PACKAGE.parent).parts)
    patterns = package_data.get(package, []) + package_data.get("*", [])
    return any(fnmatch.fnmatch(path.name, pattern) for pattern in patterns)


def test_every_file_of_the_package_that_is_not_python_is_declared_package_data() -> None:
    package_data = _pyproject()["tool"]["setuptools"]["package-data"]
    data_files = [
        path
        for path in PACKAGE.rglob("*")
        if path.is_file() and path.suffix not in (".py", ".pyc") and "__pycache__" not in path.parts
    ]
    assert {p.name for p in data_files} >= {"py.typed", "fake_nvml.c"}
    missing = [str(p.relative_to(PACKAGE.parent)) for p in data_files if not _shipped(p, package_data)]
    assert missing == [], f"not in [tool.setuptools.package-data], so not in the wheel: {missing}"


def test_the_package_data_check_sees_a_missing_file() -> None:
    assert _shipped(PACKAGE / "sim" / "nvml" / "fake_nvml.c", {"pytest_gpu.sim.nvml": ["*.c"]})
    assert not _shipped(PACKAGE / "sim" / "nvml" / "fake_nvml.c", {"pytest_gpu": ["*.c"]})


def test_the_version_is_one() -> None:
    assert _pyproject()["project"]["version"] == pytest_gpu.__version__


def test_the_lowest_python_classifier_is_requires_python() -> None:
    project = _pyproject()["project"]
    versions = sorted(
        tuple(int(x) for x in m.group(1).split("."))
        for c in project["classifiers"]
        if (m := re.fullmatch(r"Programming Language :: Python :: (3\.\d+)", c))
    )
    assert project["requires-python"] == f">={versions[0][0]}.{versions[0][1]}"


def test_the_license_file_is_the_declared_license() -> None:
    project = _pyproject()["project"]
    assert project["license"] == "MIT" and project["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text().startswith("MIT License\n\nCopyright (c) 2026 the pytest-gpu authors\n")
