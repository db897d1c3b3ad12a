"""A train -> resume -> export chain (pytest-dependency) on a dataset built once per run.

Under ``-n`` pytest-gpu's scheduler keeps the chain on one worker, in order, so the
checkpoint the first test writes is there for the next; if a step fails, the later
steps are skipped with pytest-dependency's reason instead of failing on a missing file.
The dataset is a ``shared_artifact``: built by the first test that asks, once for all
workers, and reused by later runs while its version stays the same.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pytest_gpu import sim

pytest.importorskip("pytest_dependency", reason="the chain needs pytest-dependency (pip install pytest-dependency)")

pytestmark = pytest.mark.gpu(memory="3GiB")


def _tokenize(path: Path) -> None:
    # stands in for an expensive preprocessing step (downloads, tokenization, ...)
    (path / "tokens.json").write_text(json.dumps(list(range(1000))))


@pytest.fixture
def dataset(shared_artifact) -> list[int]:
    return json.loads((shared_artifact("tokenized-corpus", _tokenize, version="1") / "tokens.json").read_text())


@pytest.fixture
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # one directory per worker process: the chain runs on one worker
    path = tmp_path_factory.getbasetemp() / "checkpoints"
    path.mkdir(exist_ok=True)
    return path


@pytest.mark.dependency()
def test_train_writes_checkpoint(dataset: list[int], checkpoints: Path) -> None:
    sim.hold("2GiB", 0.4)
    (checkpoints / "step-100.json").write_text(json.dumps({"step": 100, "seen": len(dataset)}))


@pytest.mark.dependency(depends=["test_train_writes_checkpoint"])
def test_resume_from_checkpoint(checkpoints: Path) -> None:
    state = json.loads((checkpoints / "step-100.json").read_text())
    sim.hold("2GiB", 0.3)
    (checkpoints / "step-200.json").write_text(json.dumps({**state, "step": 200}))


@pytest.mark.dependency(depends=["test_resume_from_checkpoint"])
def test_export_for_inference(checkpoints: Path, dataset: list[int]) -> None:
    assert json.loads((checkpoints / "step-200.json").read_text())["seen"] == len(dataset)
    sim.hold("1GiB", 0.2)
