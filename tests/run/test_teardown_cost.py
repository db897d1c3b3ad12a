"""A GPU test's teardown: what it costs, and a verdict that a failure's frames cannot spoil.

Cost (issue 19, "A teardown that costs nothing"): the torch adapter collects garbage only
when torch still counts memory the lease's start did not have, youngest generation first;
a test that never starts CUDA costs torch nothing (one call queued with torch for every
lease, not one per lease). Counted, not timed: an inner run's conftest replaces
``gc.collect`` during each test's teardown and logs the calls (timings: bench/lease_cost.py).

Failures (issue 19, "No false leak for a failing test"): pytest keeps the frames of a failed
setup or call past the verdict (``sys.last_traceback``; a reference cycle through
``CallInfo.from_call``'s frame, also for ``pytest.fail``/``xfail``); the teardown clears their
locals before the lease is verified, after the report and any post-mortem have seen them.
"""

from __future__ import annotations

import gc
import json
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import require
from pytest_gpu.run import lifecycle
from pytest_gpu.run.lifecycle import STATE_KEY, TestState

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


# -- a failing test's frames -----------------------------------------------------------------

FAILING_SIM = """
import pytest
from pytest_gpu import sim

KEPT = []


class Tensor:
    '''Device memory freed when the object is, as a framework's array is.'''

    def __init__(self, size, device):
        self.memory = sim.allocate(size, device)

    def __del__(self):
        self.memory.free()


@pytest.mark.gpu(memory="2GiB")
def test_fails_holding_memory(gpu):
    x = Tensor("1GiB", gpu.device)
    assert x.memory.nbytes == 0  # (not x itself: an in-process pytester records what assert compares)


@pytest.mark.gpu(memory="2GiB")
def test_raises_from_a_helper(gpu):
    def load():
        weights = Tensor("1GiB", gpu.device)
        raise RuntimeError(f"bad weights {weights.memory.nbytes}")

    try:
        load()
    except RuntimeError as exc:
        kept = Tensor("512MiB", gpu.device)
        raise ValueError(f"could not load, kept {kept.memory.nbytes}") from exc


@pytest.mark.gpu(memory="2GiB")
def test_fails_through_pytest_fail(gpu):
    x = Tensor("1GiB", gpu.device)
    pytest.fail(f"wrong size {x.memory.nbytes}")  # a BaseException: not in sys.last_value


@pytest.mark.gpu(memory="2GiB")
def test_xfails_holding_memory(gpu):
    x = Tensor("1GiB", gpu.device)
    pytest.xfail(f"known bug {x.memory.nbytes}")


@pytest.fixture
def weights(gpu):
    loaded = Tensor("1GiB", gpu.device)
    raise RuntimeError(f"cannot load {loaded.memory.nbytes}")


@pytest.mark.gpu(memory="2GiB")
def test_setup_fails_holding_memory(weights):
    pass


@pytest.mark.gpu(memory="2GiB")
def test_leaks(gpu):
    KEPT.append(Tensor("1GiB", gpu.device))
"""

# what a post-mortem (--pdb: pytest_exception_interact) sees of the failing frame
SEE_LOCALS = """
import json


def pytest_exception_interact(node, call, report):
    if call.when == "call":
        with open({log!r}, "a") as fh:
            fh.write(json.dumps([node.name, sorted(call.excinfo.traceback[-1].frame.f_locals)]) + "\\n")
"""


def test_a_failing_tests_frames_are_no_leak_and_a_true_leak_still_is(
    gpu_pytester: pytest.Pytester, run_inner: Run, tmp_path: Path
) -> None:
    log = tmp_path / "locals.jsonl"
    gpu_pytester.makeconftest(SEE_LOCALS.format(log=str(log)))
    gpu_pytester.makepyfile(test_f=FAILING_SIM)
    result = run_inner("--gpus", "sim:2x16GiB", "-l")  # -l: the report shows the failing frame's locals
    result.assert_outcomes(failed=3, passed=1, xfailed=1, errors=2)  # errors: the fixture's, the leak
    out = result.stdout.str()
    assert out.count("broke its GPU lease") == 1 and "test_leaks broke its GPU lease" in out
    result.stdout.fnmatch_lines(["*_ ERROR at setup of test_setup_fails_holding_memory _*", "*cannot load*"])
    result.stdout.fnmatch_lines(["*_ ERROR at teardown of test_leaks _*", "*still holds 1GiB on GPU * after the test*"])
    result.stdout.fnmatch_lines(["*_ test_fails_holding_memory _*", "x * = <test_f.Tensor object at *>"])
    seen = dict(map(json.loads, log.read_text().splitlines()))
    assert "x" in seen["test_fails_holding_memory"]  # the post-mortem came first: the locals were there
    result.stdout.fnmatch_lines(["pytest-gpu: * · 6 GPU tests · * · 1 violation*"])


FAILING_TORCH = """
import pytest
import torch  # given the simulated torch.cuda as it is imported
from pytest_gpu.sim import torch_cuda

GiB = 2**30
KEPT = []


@pytest.mark.gpu(memory="2GiB")
def test_fails_holding_a_tensor(gpu):
    x = torch_cuda.empty(GiB, device=gpu.device)
    assert x.nbytes == 0


@pytest.mark.gpu(memory="2GiB")
def test_leaks(gpu):
    KEPT.append(torch_cuda.empty(GiB, device=gpu.device))
"""


@pytest.mark.parametrize("gpus", ["simulated", "fake"])
def test_a_failing_test_holding_a_tensor_gets_its_failure_only(
    gpu_pytester: pytest.Pytester, run_inner: Run, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, gpus: str
) -> None:
    """The torch double, on simulated GPUs (the ledger judges) and on fake ones (NVML and
    torch's counters judge, as on a real machine)."""
    require("torch", module="torch")
    if gpus == "fake":
        require("C compiler", executable="cc")  # the fake libnvidia-ml.so.1 is built from C
        monkeypatch.setenv("PYTEST_GPU_FAKE_GPUS", "sim:2x16GiB")
        monkeypatch.setenv("PYTEST_GPU_SIM_LEDGER", str(tmp_path / "fake-ledger"))
    gpu_pytester.makepyfile(test_t=FAILING_TORCH)
    result = run_inner("--gpus", "sim:2x16GiB" if gpus == "simulated" else "auto", subprocess=True, timeout=240)
    result.assert_outcomes(failed=1, passed=1, errors=1)
    assert "test_fails_holding_a_tensor broke" not in result.stdout.str()
    result.stdout.fnmatch_lines(["*_ ERROR at teardown of test_leaks _*", "*still holds 1GiB on GPU * after the test*"])


# -- release_failure itself --------------------------------------------------------------------


class _Held:
    pass


def _fail_with_chained_locals() -> tuple[BaseException, list[weakref.ref[_Held]]]:
    refs: list[weakref.ref[_Held]] = []

    def load() -> None:
        weights = _Held()
        refs.append(weakref.ref(weights))
        raise KeyError("weights")

    try:
        try:
            load()
        except KeyError:
            kept = _Held()
            refs.append(weakref.ref(kept))
            raise ValueError("could not load") from None  # __context__ stays, __cause__ is None
    except ValueError as exc:
        return exc, refs
    raise AssertionError("unreachable")


def _item(state: TestState) -> SimpleNamespace:
    return SimpleNamespace(stash={STATE_KEY: state})


def test_release_failure_clears_the_frames_of_the_failure_and_of_what_it_was_raised_during(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    exc, refs = _fail_with_chained_locals()
    monkeypatch.setattr(sys, "last_value", exc, raising=False)  # as pytest keeps it
    monkeypatch.setattr(sys, "last_traceback", exc.__traceback__, raising=False)
    state = TestState(indices={0}, failures=[exc])  # as make_report keeps it
    for failure in (exc, exc.__context__):
        assert failure is not None
        tb = failure.__traceback__
        while tb is not None:  # as -l and debuggers do: each frame's f_locals snapshot holds the values too
            assert isinstance(tb.tb_frame.f_locals, object)
            tb = tb.tb_next
    del exc, failure
    gc.collect()
    assert all(ref() is not None for ref in refs)  # the traceback holds them, as pytest's does
    lifecycle.release_failure(_item(state))  # type: ignore[arg-type]
    assert [ref() for ref in refs] == [None, None]  # freed by reference counting: no collection
    assert sys.last_traceback is not None  # the traceback itself stays (post-mortem after the session)
    assert state.failures == []


def test_release_failure_leaves_a_cpu_tests_failure_as_pytest_keeps_it(monkeypatch: pytest.MonkeyPatch) -> None:
    exc, refs = _fail_with_chained_locals()
    monkeypatch.setattr(sys, "last_value", exc, raising=False)
    state = TestState(failures=[exc])
    del exc
    lifecycle.release_failure(_item(state))  # type: ignore[arg-type]
    assert all(ref() is not None for ref in refs)  # pytest's sys.last_value still holds them
    assert state.failures == []  # but the test's record does not


@pytest.mark.skipif(sys.version_info < (3, 11), reason="ExceptionGroup is Python 3.11's")
def test_release_failure_clears_the_frames_of_an_exception_groups_members() -> None:
    refs: list[weakref.ref[_Held]] = []

    def part() -> None:
        held = _Held()
        refs.append(weakref.ref(held))
        raise KeyError("part")

    errors: list[Exception] = []
    for _ in range(2):
        try:
            part()
        except KeyError as exc:
            errors.append(exc)
    group = ExceptionGroup("parts", errors)  # noqa: F821 (3.11's builtin)
    del errors
    state = TestState(indices={0}, failures=[group])
    del group
    assert all(ref() is not None for ref in refs)
    lifecycle.release_failure(_item(state))  # type: ignore[arg-type]
    assert [ref() for ref in refs] == [None, None]


# -- the simulated driver's part (issue 33, "A lease at the floor") ------------------------------

# logs, per test, the ledger writes of its teardown and psutil's looks at a process in the whole test
COUNT_LEDGER = """
import importlib
import json

import pytest

ledger = importlib.import_module("pytest_gpu.sim.ledger")
LOG = {log!r}
_write, _start = ledger.Ledger._write, ledger._proc_start
_seen = {{"writes": 0, "looks": 0}}


def _writing(self, *args, **kwargs):
    _seen["writes"] += 1
    return _write(self, *args, **kwargs)


def _looking(pid):
    _seen["looks"] += 1
    return _start(pid)


ledger.Ledger._write = _writing
ledger._proc_start = _looking


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item):
    _seen["looks"] = 0
    return (yield)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_teardown(item):
    _seen["writes"] = 0
    try:
        return (yield)
    finally:
        with open(LOG, "a") as fh:
            fh.write(json.dumps([item.name, _seen["writes"], _seen["looks"]]) + "\\n")
"""

SEGMENTS = """
import pytest
import torch


@pytest.mark.parametrize("n", range(6))
@pytest.mark.gpu(memory="1GiB")
def test_three_segments(n, gpu):
    tensors = [torch.empty(m * 2**20, dtype=torch.uint8, device=gpu.device) for m in (30, 60, 90)]
    assert torch.cuda.memory_reserved() >= 180 * 2**20
    del tensors  # cached by torch until the lease ends
"""


def test_a_gpu_test_s_teardown_writes_the_simulated_ledger_once_and_never_looks_processes_up(
    gpu_pytester: pytest.Pytester, run_inner: Run, tmp_path: Path
) -> None:
    """Under ``-n 2`` on simulated GPUs: emptying torch's cache of three segments is one write of
    the ledger, not three; and an allocation no longer looks its process up with psutil."""
    require("torch", module="torch")
    log = tmp_path / "ledger.jsonl"
    gpu_pytester.makeconftest(COUNT_LEDGER.format(log=str(log)))
    gpu_pytester.makepyfile(test_segments=SEGMENTS)
    result = run_inner("-n", "2", "--gpus", "sim:2x16GiB", subprocess=True, timeout=240)
    result.assert_outcomes(passed=6)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(rows) == 6
    # the cache's three segments, then the lease's tag dropped by its verification: was 4 (one per segment)
    assert all(writes == 2 for _, writes, _ in rows), rows
    # each worker's own start, read once: was one per allocation and per lease's tag
    assert sum(looks for _, _, looks in rows) <= 2, rows
