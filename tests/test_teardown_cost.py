"""A GPU test's teardown: what it costs.

Cost (issue 19, "A teardown that costs nothing"): the torch adapter collects garbage only
when torch still counts memory the lease's start did not have, youngest generation first;
a test that never starts CUDA costs torch nothing (one call queued with torch for every
lease, not one per lease). Counted, not timed: an inner run's conftest replaces
``gc.collect`` during each test's teardown and logs the calls (timings: bench/lease_cost.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import require

Run = Callable[..., pytest.RunResult]

# logs, per test, the gc.collect calls made during its teardown ("full": no generation given)
COUNT_GC = """
import gc
import json

import pytest

LOG = {log!r}
_real = gc.collect
_calls = []


def _counting(*args, **kwargs):
    _calls.append(args[0] if args else kwargs.get("generation", "full"))
    return _real(*args, **kwargs)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_teardown(item):
    _calls.clear()
    gc.collect = _counting
    try:
        return (yield)
    finally:
        gc.collect = _real
        gc.enable()  # test_cycle turns automatic collection off, to see what the teardown collects
        with open(LOG, "a") as fh:
            fh.write(json.dumps([item.name, list(_calls)]) + "\\n")
"""

# runs first (files run in name order): torch imported, CUDA never started
LAZY = """
import pytest
import torch

QUEUED = []


@pytest.mark.parametrize("n", range(4))
@pytest.mark.gpu(memory="1GiB")
def test_never_starts_cuda(n, gpu):
    assert torch.cuda.is_available() and not torch.cuda.is_initialized()
    QUEUED.append(len(torch.cuda._queued_calls))
    assert QUEUED[0] == QUEUED[-1], f"torch's queue of lazy calls grows by one a lease: {QUEUED}"
"""

USES = """
import gc

import pytest
import torch
from pytest_gpu.sim import torch_cuda

GiB = 2**30
KEPT = []


@pytest.mark.parametrize("n", range(3))
@pytest.mark.gpu(memory="1GiB")
def test_allocates(n, gpu):
    x = torch_cuda.empty(GiB // 4, device=gpu.device)
    y = torch_cuda.empty(GiB // 2)  # the current device: the lease's
    assert y.device == x.device
    del x, y


@pytest.mark.gpu(memory="2GiB")
def test_cycle(gpu):
    gc.disable()  # only the teardown collects (the conftest turns it back on)
    node = {"tensor": torch_cuda.empty(GiB, device=gpu.device)}
    node["self"] = node  # only the garbage collector frees the tensor


@pytest.mark.gpu(memory="2GiB")
def test_leak(gpu):
    KEPT.append(torch_cuda.empty(GiB, device=gpu.device))


@pytest.fixture(scope="module")
def model(gpu_lease_factory):
    lease = gpu_lease_factory(memory="2GiB")
    return torch_cuda.empty(GiB, device=lease.device)  # pytest drops it at the fixture's end


@pytest.mark.gpu(memory="1GiB")
def test_with_a_model(model, gpu):
    torch_cuda.empty(GiB // 4, device=gpu.device).free()
"""


def _gc_log(path: Path) -> dict[str, list[object]]:
    return {name: calls for name, calls in map(json.loads, path.read_text().splitlines())}


def test_teardown_collects_only_memory_still_held_and_never_costs_a_test_without_cuda(
    gpu_pytester: pytest.Pytester, run_inner: Run, tmp_path: Path
) -> None:
    require("torch", module="torch")
    log = tmp_path / "gc.jsonl"
    gpu_pytester.makeconftest(COUNT_GC.format(log=str(log)))
    gpu_pytester.makepyfile(test_a_lazy=LAZY, test_b_uses=USES)
    result = run_inner("--gpus", "sim:2x16GiB", subprocess=True, timeout=240)
    result.assert_outcomes(passed=10, errors=1)
    out = result.stdout.str()
    # the one true leak is still found, after every generation was tried
    result.stdout.fnmatch_lines(["*_ ERROR at teardown of test_leak _*", "*still holds 1GiB on GPU * after the test*"])
    assert "test_cycle broke" not in out and "test_with_a_model broke" not in out and "fixture 'model'" not in out
    calls = _gc_log(log)
    assert all(calls[f"test_never_starts_cuda[{n}]"] == [] for n in range(4)), calls
    assert all(calls[f"test_allocates[{n}]"] == [] for n in range(3)), calls  # was one full collection each
    assert calls["test_cycle"] == [0], calls  # the youngest generation freed it: no full collection
    assert calls["test_leak"] == [0, 1, 2], calls
    assert calls["test_with_a_model"] == [], calls  # the fixture's end: nothing was held, nothing collected
