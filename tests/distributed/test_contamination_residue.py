"""What a test leaves on a rank, kind by kind, in this process: the checks of pytest_gpu.distributed.residue,
and the contamination verdict's wording (which test is blamed)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from conftest import require
from pytest_gpu.base.distspec import DistSettings, DistSpec
from pytest_gpu.distributed import contamination, rankmain, residue
from pytest_gpu.distributed import pool as pool_module
from pytest_gpu.distributed.pool import RankPool, RankRun
from pytest_gpu.distributed.runner import PoolManager

GLOO2 = DistSpec(world_size=2, backend="gloo", gpus_per_rank=0, launcher="spawn")


def test_environment_changes_are_named_by_variable_never_by_value() -> None:
    before = {"KEEP": "1", "GONE": "x", "EDITED": "old", "CUDA_MODULE_LOADING": "LAZY"}
    after = {"KEEP": "1", "EDITED": "secret-new", "NEW_A": "1", "NEW_B": "2"}
    assert residue.env_changes(before, after) == [
        "environment variables NEW_A and NEW_B added",
        "environment variable EDITED changed",
        "environment variable GONE removed",
    ]
    assert residue.env_changes(before, dict(before)) == []
    # what torch sets itself when CUDA starts is no test's doing
    assert residue.env_changes({}, {"CUDA_MODULE_LOADING": "LAZY"}) == []


def test_many_variables_are_counted_past_a_few() -> None:
    added = {f"V{i}": "1" for i in range(8)}
    assert residue.env_changes({}, added) == ["environment variables V0, V1, V2, V3, V4 and 3 more added"]


def test_a_setting_is_compared_with_the_snapshot() -> None:
    pristine = {"default dtype": "float32", "grad mode": "on"}
    assert residue.changed(pristine, {"default dtype": "float64", "grad mode": "on"}) == {
        "default dtype": "default dtype float64 (was float32)"
    }
    # the current device is only read once CUDA started: before, it was torch's first device
    assert residue.changed(pristine, {**pristine, "current CUDA device": "cuda:1"}) == {
        "current CUDA device": "current CUDA device cuda:1 (was cuda:0)"
    }
    assert residue.changed(pristine, {**pristine, "current CUDA device": "cuda:0"}) == {}


def test_lines_are_merged_over_ranks() -> None:
    assert residue.merge({0: ["a", "b"], 1: ["a"]}, 2) == ["a (on every rank)", "b (on rank 0)"]
    assert residue.merge({0: ["a"], 1: ["a"], 2: ["c"]}, 4) == ["a (on ranks 0 and 1)", "c (on rank 2)"]
    assert residue.merge({0: ["a"]}, 1) == ["a"]  # one rank: no need to say which


def test_a_replaced_seed_function_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    tracker = residue.Tracker()
    tracker.begin()
    assert tracker.reseeding_after() == []
    monkeypatch.setattr(random, "seed", lambda *args, **kwargs: None)  # a test's patch, never undone
    assert tracker.reseeding_after() == ["random.seed"]


def test_a_replaced_global_generator_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    numpy = pytest.importorskip("numpy")
    tracker = residue.Tracker()
    tracker.begin()
    monkeypatch.setattr(numpy.random.mtrand, "_rand", numpy.random.RandomState(1))
    assert tracker.reseeding_after() == ["numpy.random.mtrand._rand"]


def test_reseeding_as_the_rank_does_is_no_residue() -> None:
    tracker = residue.Tracker()
    tracker.begin()
    state = random.getstate()
    try:
        rankmain._reseed(1234)
        random.random()  # a test's own draws: the next test is reseeded anyway
    finally:
        random.setstate(state)
    assert tracker.reseeding_after() == []


@pytest.fixture
def torch() -> Iterator[Any]:
    require("torch", module="torch")
    import torch

    saved = (
        torch.get_default_dtype(),
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.benchmark,
        torch.backends.cuda.matmul.allow_tf32,
        torch.is_grad_enabled(),
        torch.get_default_device(),
    )
    yield torch
    dtype, deterministic, benchmark, tf32, grad, device = saved
    torch.set_default_dtype(dtype)
    torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.benchmark = benchmark
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.set_grad_enabled(grad)
    torch.set_default_device(device)


@pytest.mark.slow  # imports torch
@pytest.mark.parametrize(
    ("change", "line"),
    [
        (lambda t: t.set_default_dtype(t.float64), "default dtype float64 (was float32)"),
        (lambda t: t.use_deterministic_algorithms(True), "deterministic algorithms on (was off)"),
        (lambda t: setattr(t.backends.cudnn, "benchmark", True), "torch.backends.cudnn.benchmark on (was off)"),
        (
            lambda t: setattr(t.backends.cuda.matmul, "allow_tf32", True),
            "torch.backends.cuda.matmul.allow_tf32 on (was off)",
        ),
        (lambda t: t.set_grad_enabled(False), "grad mode off (was on)"),
        (lambda t: t.set_default_device("meta"), "default device meta (was cpu)"),
    ],
    ids=["dtype", "deterministic", "cudnn-benchmark", "tf32", "grad", "device"],
)
def test_a_changed_torch_default_is_named_on_the_test_that_changed_it(torch: Any, change: Any, line: str) -> None:
    tracker = residue.Tracker()
    tracker.begin()
    assert tracker.torch_after("first") == []
    change(torch)
    assert tracker.torch_after("second") == [line]
    # kept (later tests see it): the next test did nothing new, and the pool knows who left it
    assert tracker.torch_after("third") == []
    assert tracker.tainted() == [{"test": "second", "what": line}]


@pytest.mark.slow  # imports torch
def test_a_setting_put_back_is_no_ones_any_more(torch: Any) -> None:
    tracker = residue.Tracker()
    tracker.begin()
    torch.set_default_dtype(torch.float64)
    tracker.torch_after("leaves")
    torch.set_default_dtype(torch.float32)
    assert tracker.torch_after("puts back") == []  # putting it back is no residue
    assert tracker.tainted() == []
    torch.set_default_dtype(torch.float16)
    assert tracker.torch_after("again") == ["default dtype float16 (was float32)"]


# -- the verdict's wording: whom it blames ------------------------------------------------------------


def _run(after: list[str], tainted: dict[int, list[dict[str, str]]] | None = None) -> RankRun:
    results = {
        rank: {"outcome": "failed", "message": "", "longrepr": "boom", "tainted": (tainted or {}).get(rank, [])}
        for rank in range(2)
    }
    return RankRun(results=results, ran_before=len(after), previous=(after or [""])[-1])


def test_the_test_whose_residue_was_there_is_blamed_not_merely_the_last() -> None:
    left = {"test": "t.py::a", "what": "default dtype float64 (was float32)"}
    first = _run(["t.py::a", "t.py::b"], {0: [left], 1: [left]})
    head, blamed = contamination.contaminated("t.py::c", GLOO2, first)
    assert blamed == ["t.py::a"]
    assert head.splitlines()[:2] == [
        "pytest-gpu: contaminated by t.py::a: failed on its warm rank pool after 2 other tests, "
        "passed alone on fresh ranks",
        "  t.py::a left default dtype float64 (was float32) (on every rank), still so when t.py::c started",
    ]


def test_without_residue_the_test_just_before_is_blamed() -> None:
    head, blamed = contamination.contaminated("t.py::c", GLOO2, _run(["t.py::a", "t.py::b"]))
    assert blamed == ["t.py::b"]
    assert "t.py::b ran just before it on that pool" in head


def test_which_failures_are_rerun() -> None:
    class Item:
        def __init__(self, xfail: bool = False) -> None:
            self.xfail = xfail

        def get_closest_marker(self, name: str) -> object:
            return object() if self.xfail and name == "xfail" else None

    failed = _run(["t.py::a"])
    assert contamination.wanted(Item(), GLOO2, failed, True)  # type: ignore[arg-type]
    assert not contamination.wanted(Item(), GLOO2, failed, False)  # type: ignore[arg-type]  # the option off
    assert not contamination.wanted(Item(xfail=True), GLOO2, failed, True)  # type: ignore[arg-type]
    assert not contamination.wanted(Item(), GLOO2, _run([]), True)  # type: ignore[arg-type]  # its pool's first
    timed_out = _run(["t.py::a"])
    timed_out.timed_out = True
    assert not contamination.wanted(Item(), GLOO2, timed_out, True)  # type: ignore[arg-type]
    passed = RankRun(results={0: {"outcome": "passed"}, 1: {"outcome": "passed"}}, ran_before=1, previous="t.py::a")
    assert not contamination.wanted(Item(), GLOO2, passed, True)  # type: ignore[arg-type]


# -- the rerun's pool ------------------------------------------------------------------------------------


class StubPool(RankPool):
    """A pool that starts no process; every pool made is kept, to be looked at."""

    made: ClassVar[list[StubPool]] = []

    def start(self, config_args: list[str]) -> None:
        StubPool.made.append(self)

    def alive(self) -> bool:
        return not self._stopped

    def run_test(self, body: dict[str, Any], timeout: float) -> RankRun:
        self.tests_run += 1  # as a pool's run of a test that came back
        return RankRun()

    def close(self, graceful: bool = True) -> None:
        self._stopped = True


@pytest.mark.parametrize("holds_gpus", [False, True])
def test_a_rerun_alone_gets_fresh_ranks_and_shuts_them_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, holds_gpus: bool
) -> None:
    monkeypatch.setattr(pool_module, "RankPool", StubPool)
    monkeypatch.setattr(StubPool, "made", [])
    manager = PoolManager(None, DistSettings(), [], tmp_path)  # type: ignore[arg-type]  # no broker needed
    try:
        first = manager.execute(GLOO2, {"nodeid": "t.py::a"}, 60)[0]
        assert (first.ran_before, first.previous) == (0, "")
        second = manager.execute(GLOO2, {"nodeid": "t.py::b"}, 60)[0]
        assert (second.ran_before, second.previous) == (1, "t.py::a")
        warm = manager.pool
        assert warm is not None
        if holds_gpus:
            warm.holding = object()  # type: ignore[assignment]  # its lease, as far as the manager looks
        alone, _ = manager.execute(GLOO2, {"nodeid": "t.py::b"}, 60, alone=True)
        assert (alone.ran_before, alone.previous) == (0, "")  # nothing ran before it there
        assert len(StubPool.made) == 2 and StubPool.made[1]._stopped  # fresh, and shut down after
        # a warm pool holding GPUs is closed first (the fresh one may need them); one without stays
        assert warm._stopped is holds_gpus
        assert (manager.pool is warm) is not holds_gpus
    finally:
        manager.close()
