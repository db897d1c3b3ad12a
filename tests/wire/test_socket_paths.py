"""A run's sockets are reachable whatever the length of ``$TMPDIR``.

A run's sockets sit deep below ``$TMPDIR`` (its broker's in its run directory, a rank
pool's in the pool's, a simulated node's in that node's own temp directory) and a socket
address holds 107 bytes: under a 38-character ``TMPDIR`` (usual on CI runners)
``--gpu-nodes=local:2`` stopped with "AF_UNIX path too long", under a 15-character one a
distributed test failed on its pool's ``ctl.sock``. Every bind and connect now reaches a
long path through its directory's descriptor (``pytest_gpu.wire.sockets``); here each runs
end to end under a 90-character ``TMPDIR``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import require

pytestmark = pytest.mark.slow

DEPTH = 90  # characters of $TMPDIR


def deep_tmpdir(monkeypatch: pytest.MonkeyPatch, base: Path) -> Path:
    """A ``TMPDIR`` of :data:`DEPTH` characters or more (runs below it add 60 to 100 more)."""
    path = base / "tmp"
    while len(str(path)) < DEPTH:
        path = path / ("d" * min(40, DEPTH - len(str(path)) + 1))
    path.mkdir(parents=True)
    monkeypatch.setenv("TMPDIR", str(path))
    return path


DISTRIBUTED = """
import os
import pytest

@pytest.mark.distributed(world_size=2, backend="gloo")
def test_allreduce(rank):
    import torch
    import torch.distributed as dist

    assert os.environ["TMPDIR"] == os.environ["DEEP"]
    t = torch.ones(1) * (rank.rank + 1)
    dist.all_reduce(t)
    assert t.item() == 3

@pytest.mark.gpu(memory="1GiB")
def test_gpu(gpu):
    assert gpu.indices
"""


def test_a_distributed_test_and_a_gpu_test_under_a_deep_tmpdir(
    gpu_pytester: pytest.Pytester,
    run_inner: Callable[..., pytest.RunResult],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    require("torch", module="torch")
    deep = deep_tmpdir(monkeypatch, tmp_path)
    monkeypatch.setenv("DEEP", str(deep))
    gpu_pytester.makepyfile(test_deep=DISTRIBUTED)
    for args in ((), ("-n", "2")):
        result = run_inner("--gpus", "sim:2x16GiB", *args, subprocess=True, timeout=240)
        assert "AF_UNIX path too long" not in result.stdout.str() + result.stderr.str()
        result.assert_outcomes(passed=2)


NODES = """
import os
import pytest

@pytest.mark.parametrize("i", range(4))
@pytest.mark.gpu(memory="1GiB")
def test_gpu(i, gpu):
    assert os.environ["PYTEST_GPU_NODE"] in ("node0", "node1")
    assert os.environ["TMPDIR"].startswith(os.environ["DEEP"] + "/pytest-gpu-nodes-")
"""


def test_simulated_nodes_under_a_deep_tmpdir(
    gpu_pytester: pytest.Pytester,
    run_inner: Callable[..., pytest.RunResult],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    deep = deep_tmpdir(monkeypatch, tmp_path)
    monkeypatch.setenv("DEEP", str(deep))
    gpu_pytester.makepyfile(test_nodes=NODES)
    args = ("-p", "no:rerunfailures", "--gpus", "sim:2x16GiB", "-n", "1", "--gpu-nodes=local:2")
    result = run_inner(*args, subprocess=True, timeout=240)
    assert "AF_UNIX path too long" not in result.stdout.str() + result.stderr.str()
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["pytest-gpu: node node0 (*", "pytest-gpu: node node1 (*"])
