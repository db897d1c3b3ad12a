"""nvidia-ml-py's version: the floor pyproject.toml declares, and the check for an older install."""

from __future__ import annotations

import importlib.metadata
import re

import pytest

from helpers import ROOT
from pytest_gpu.vendors import nvmlversion
from pytest_gpu.vendors.nvmlversion import MINIMUM, nvml_version_problem

PYPROJECT = ROOT / "pyproject.toml"


def test_pyproject_floor_excludes_the_scrambling_releases() -> None:
    tomllib = pytest.importorskip("tomllib")
    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    floors = [re.fullmatch(r"nvidia-ml-py\s*>=\s*([\d.]+)", d.strip()) for d in dependencies]
    found = [m.group(1) for m in floors if m]
    assert found == [MINIMUM] == ["12.535.108"], dependencies


@pytest.mark.parametrize("installed", ["12.535.77", "12.535", "11.525.150", "12.535.77.post1"])
def test_older_versions_are_a_problem(installed: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.metadata, "version", lambda name: installed)
    problem = nvml_version_problem()
    assert problem is not None
    assert f"nvidia-ml-py {installed} is older than 12.535.108" in problem
    assert "pip install 'nvidia-ml-py>=12.535.108'" in problem


@pytest.mark.parametrize("installed", ["12.535.108", "12.535.133", "12.550.52", "13.615.71", "575.51.2", "garbage"])
def test_new_enough_or_unreadable_versions_are_not(installed: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.metadata, "version", lambda name: installed)
    assert nvml_version_problem() is None


def test_absent_bindings_are_not_a_version_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert nvml_version_problem() is None


def test_asks_for_the_nvidia_ml_py_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []
    monkeypatch.setattr(importlib.metadata, "version", lambda name: asked.append(name) or "12.535.108")
    nvml_version_problem()
    assert asked == [nvmlversion.DISTRIBUTION] == ["nvidia-ml-py"]
