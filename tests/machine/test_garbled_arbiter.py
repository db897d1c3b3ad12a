"""A run whose machine's arbiter answers what the protocol does not allow: never an INTERNALERROR.

The arbiter is another process, maybe another user's or another version's, so what it
answers and tells is checked as strictly as what it is asked (pytest_gpu.machine.messages).
Here a stand-in (tests/fake_arbiter.py) holds the run's simulated machine's election and
address before the run starts, so the run attaches to it; its answer or event is then
garbage: the run says so in one summary line and goes on with an arbiter of its own, which
the call that met the garbage is asked again of.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from fake_arbiter import FakeArbiter
from pytest_gpu.machine.domain import Domain

pytestmark = pytest.mark.slow

SPEC = "sim:2x16GiB"
SAID = "is no usable arbiter: the machine's arbiter sent what its protocol does not allow"
ALONE = "this run shares its GPUs with no other run"

SUITE = """
import pytest

@pytest.mark.parametrize("i", range(4))
@pytest.mark.gpu(memory="1GiB")
def test_gpu(i, gpu):
    assert gpu.indices
"""


@pytest.fixture
def fake_arbiter(gpu_pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Any]]:
    """``fake_arbiter(answers=..., events=...)``: the stand-in, at the address of the simulated
    machine the inner run uses (named, so the run and this test find the same one)."""
    monkeypatch.setenv("PYTEST_GPU_SIM_MACHINE", "garbled")
    made: list[FakeArbiter] = []

    def make(**kwargs: Any) -> FakeArbiter:
        domain = Domain.sim(SPEC)
        made.append(FakeArbiter(domain.address(), lock=str(domain.lock_path), **kwargs))
        return made[-1]

    yield make
    for fake in made:
        fake.close()


def _one_line(result: pytest.RunResult, why: str) -> None:
    out = result.stdout.str() + result.stderr.str()
    assert "INTERNALERROR" not in out, out
    lines = [line for line in result.stdout.lines if SAID in line]
    assert len(lines) == 1 and why in lines[0] and ALONE in lines[0], out


def test_a_room_of_null_is_no_internalerror(
    gpu_pytester: pytest.Pytester, run_inner: Callable[..., pytest.RunResult], fake_arbiter: Callable[..., Any]
) -> None:
    """The scheduler asks the machine for each GPU's room: a ``null`` for an answer was a
    TypeError in the controller (INTERNALERROR); now the run plans with what the GPUs have
    and leaves that arbiter."""
    fake = fake_arbiter(answers={"room": lambda m: None})
    gpu_pytester.makepyfile(test_room=SUITE)
    result = run_inner("--gpus", SPEC, "-n", "2", subprocess=True, timeout=180)
    result.assert_outcomes(passed=4)
    _one_line(result, "its answer to 'room' must be a list")
    assert fake.seen[:2] == ["attach", "room"] and "submit" not in fake.seen


def test_a_grant_missing_a_field_fails_no_test(
    gpu_pytester: pytest.Pytester, run_inner: Callable[..., pytest.RunResult], fake_arbiter: Callable[..., Any]
) -> None:
    """The request that met the garbled grant is asked again of the run's own arbiter."""
    fake_arbiter(answers={"submit": lambda m: ["granted", {"memory": 2**30, "exclusive": False}]})
    gpu_pytester.makepyfile(test_grant=SUITE)
    result = run_inner("--gpus", SPEC, "-p", "no:randomly", subprocess=True, timeout=180)
    result.assert_outcomes(passed=4)
    _one_line(result, "a grant lacks 'gpus'")


def test_a_bad_event_leaves_the_arbiter_and_the_test_is_served(
    gpu_pytester: pytest.Pytester, run_inner: Callable[..., pytest.RunResult], fake_arbiter: Callable[..., Any]
) -> None:
    """The request waits (``queued``), then the arbiter's event for it is garbage: the run
    takes its request to an arbiter of its own, which grants it; every test passes."""
    bad = {"ev": [["granted", "c0/k0", {"gpus": [], "memory": -1, "exclusive": False}]]}
    fake_arbiter(events={"submit": [bad]})
    gpu_pytester.makepyfile(test_event=SUITE)
    result = run_inner("--gpus", SPEC, subprocess=True, timeout=180)
    result.assert_outcomes(passed=4)
    _one_line(result, "a grant's memory must be in [0, ")
