"""Older torch moves the current device with each memory fraction (issue 31, finding 9).

torch before 2.10 called ``SetDevice(device)`` in ``setMemoryFraction`` and never switched back
(c10/cuda/CUDACachingAllocator.cpp at pytorch/pytorch 001074d). The double models both releases
(``PYTEST_GPU_SIM_TORCH``); wherever pytest-gpu sets fractions on several GPUs (an isolated
body's rank, a lease resumed in the test process) the current device stays where it was, so a
body's ``.cuda()`` lands on ``cuda:0`` and not on the last GPU given a fraction.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_isolation import run_torch

from conftest import require, run_fake_python

RANK_BODY = """
import torch
from pytest_gpu.distributed import rankmain
rankmain._cap_torch_when_started(2**30)  # as an isolated test's rank does, before its body
x = torch.ones(4).cuda()  # the body's first CUDA use: torch's lazy init runs the caps
out["tensor"] = x.device.index
out["current"] = torch.cuda.current_device()
out["fractions"] = [round(torch.cuda.get_per_process_memory_fraction(i), 3) for i in range(torch.cuda.device_count())]
"""


@pytest.mark.slow
@pytest.mark.parametrize("version", ["2.9", "2.13"])
def test_an_isolated_body_starts_on_cuda_0_whatever_torch_does(tmp_path: Path, version: str) -> None:
    require("torch", module="torch")
    out = run_fake_python(tmp_path, "sim:3x16GiB", RANK_BODY, PYTEST_GPU_SIM_TORCH=version)
    assert out["tensor"] == 0 and out["current"] == 0, out  # torch 2.9: was 2, the last GPU capped
    assert all(0 < f < 0.1 for f in out["fractions"]), out  # and every GPU is capped


@pytest.mark.slow
def test_the_double_models_torch_before_the_set_device_change(tmp_path: Path) -> None:
    require("torch", module="torch")
    body = """
import torch
torch.cuda.init()
torch.cuda.set_per_process_memory_fraction(0.5, 2)
out["current"] = torch.cuda.current_device()
"""
    assert run_fake_python(tmp_path, "sim:3x16GiB", body, PYTEST_GPU_SIM_TORCH="2.9")["current"] == 2
    assert run_fake_python(tmp_path, "sim:3x16GiB", body, PYTEST_GPU_SIM_TORCH="2.10.1")["current"] == 0


def test_a_bad_torch_version_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_gpu.sim import torch_cuda

    monkeypatch.setenv(torch_cuda.TORCH_VERSION_ENV, "latest")
    with pytest.raises(ValueError, match=r"PYTEST_GPU_SIM_TORCH='latest': expected a torch version such as 2\.9"):
        torch_cuda.modelled_torch()


@pytest.mark.slow
def test_a_resumed_lease_leaves_the_test_on_its_device(tmp_path: Path) -> None:
    """A fixture's lease set up during the test ends its setup: the test's lease resumes, its caps
    set again on each of its GPUs; on torch 2.9 the test was left on the last of them."""
    out = run_torch(
        tmp_path,
        """
test = confine(lease("t", [1, 3], 2 * GiB), inv)
torch.cuda.init()  # CUDA starts inside the test: its caps applied at once, on cuda:1
torch.cuda.set_device(1)
fixture = confine(lease("f", [2], 2 * GiB), inv)
torch.cuda.set_device(1)  # the fixture's setup done; the test goes on where it was
test.resume()
out["current"] = torch.cuda.current_device()
fixture.undo()
test.undo()
""",
        PYTEST_GPU_SIM_TORCH="2.9",
    )
    assert out["current"] == 1  # not 3
