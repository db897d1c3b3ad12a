"""Rank pools without rank processes: the process group's timeout, and when a pool is reused."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest

from pytest_gpu.base.distspec import DistSettings, DistSpec, group_timeout
from pytest_gpu.distributed import pool as pool_module
from pytest_gpu.distributed.pool import RankPool, RankRun
from pytest_gpu.distributed.runner import PoolManager

GLOO2 = DistSpec(world_size=2, backend="gloo", gpus_per_rank=0, launcher="spawn")


def test_group_timeout_outlasts_the_tests_of_the_pool() -> None:
    # NCCL's watchdog aborts a collective after the group's timeout: it must come after the
    # pool's own timeout, which reports the hang with every rank's stack
    settings = DistSettings(timeout=300.0, init_timeout=120.0, grace=10.0)
    assert group_timeout(settings, 300.0) > 300.0 + settings.grace
    assert group_timeout(settings, 3000.0) > 3000.0 + settings.grace
    assert group_timeout(DistSettings(init_timeout=900.0), 5.0) == 900.0  # never below the rendezvous bound


@pytest.mark.parametrize(("test_timeout", "covered"), [(300.0, 300.0), (60.0, 300.0), (900.0, 900.0)])
def test_the_ranks_get_a_group_timeout_past_the_tests_timeout(
    tmp_path: Path, test_timeout: float, covered: float
) -> None:
    settings = DistSettings(timeout=300.0)
    pool = RankPool(GLOO2, None, settings, tmp_path, test_timeout)  # type: ignore[arg-type]  # no broker needed
    body = pool.setup_body(["--rootdir", str(tmp_path)])
    assert body["group_timeout"] == group_timeout(settings, covered) > covered
    assert body["config_args"] == ["--rootdir", str(tmp_path)]


class StubPool(RankPool):
    """A pool that starts no process: records which test timeouts it was started for."""

    started: ClassVar[list[float]] = []

    def start(self, config_args: list[str]) -> None:
        StubPool.started.append(self.covers)

    def alive(self) -> bool:
        return not self._stopped

    def run_test(self, body: dict[str, Any], timeout: float) -> RankRun:
        assert timeout <= self.covers, "a test ran longer than its pool's process group allows"
        return RankRun()

    def close(self, graceful: bool = True) -> None:
        self._stopped = True


def test_a_test_longer_than_the_pool_allows_gets_a_fresh_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pool_module, "RankPool", StubPool)
    monkeypatch.setattr(StubPool, "started", [])
    manager = PoolManager(None, DistSettings(timeout=300.0), [], tmp_path)  # type: ignore[arg-type]
    try:
        for timeout in (300.0, 60.0, 300.0, 900.0, 300.0, 900.0):
            manager.execute(GLOO2, {}, timeout)
    finally:
        manager.close()
    assert StubPool.started == [300.0, 900.0]  # shorter tests reuse the pool they find


class _Launched:
    """A launcher stand-in: what it 'started' is a process it was given (it kills nothing)."""

    def __init__(self, pid: int) -> None:
        self.procs = [type("P", (), {"pid": pid})()]

    def kill(self, pids: Any) -> None:
        pass


def test_a_closed_pool_gives_up_its_claim_on_its_processes(tmp_path: Path) -> None:
    import subprocess

    from pytest_gpu.gpu.verification import claim_processes, claimed

    procs = [subprocess.Popen(["sleep", "30"]) for _ in range(3)]  # live: a claim on an ended process lapses
    try:
        launcher, rank0, rank1 = (p.pid for p in procs)
        pool = RankPool(GLOO2, None, DistSettings(), tmp_path, 60.0, "t.py::test_x")  # type: ignore[arg-type]
        pool.launcher = _Launched(launcher)  # type: ignore[assignment]
        pool.pids = {0: rank0, 1: rank1}
        pool.lease_key = pool.port = None
        claim_processes(pool._processes(), pool.holder)
        assert {p: claimed().get(p) for p in (launcher, rank0, rank1)} == dict.fromkeys(
            (launcher, rank0, rank1), "the rank pool of 2 ranks (gloo via spawn) started by t.py::test_x"
        )
        pool.run = type("R", (), {"client": None})()  # type: ignore[assignment]
        pool.close(graceful=False)
        assert not {launcher, rank0, rank1} & set(claimed())
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_a_pools_lease_is_checked_window_by_window() -> None:
    """After each test a pool ran: what its ranks used since the last check (the verifier's
    end), then the next window's baseline (its begin); the verdict is the pool's, named."""
    from dataclasses import replace
    from types import SimpleNamespace

    from pytest_gpu.gpu.isolation import Confinement, GpuLease
    from pytest_gpu.gpu.verification import Verdict
    from pytest_gpu.run.holding import Holding, Owner, TestState
    from pytest_gpu.run.session import ActiveLease, host_lease

    calls: list[str] = []
    leak = "still holds 1GiB on GPU 0 after the test (a rank of the pool still holds it)"

    class Ranks:
        def begin(self, lease: GpuLease, owner: int) -> None:
            calls.append(f"begin {owner}")

        def end(self, lease: GpuLease, others: Any = ()) -> Verdict:
            calls.append("end")
            return Verdict(violations=[leak] if len(calls) == 1 else [])

    lease = replace(host_lease("k", 0.0, False), indices=(0,), memory=2**30)
    active = ActiveLease(lease, Confinement(), Ranks(), 1.0, 2.0, owner_pid=7, confined=False)
    held = Holding(Owner("pool", "the rank pool"), active)
    run = SimpleNamespace(settings=SimpleNamespace(verify="warn"))
    verdict, span = held.check(run)  # type: ignore[arg-type]
    assert verdict.violations == [leak] and calls == ["end", "begin 7"]
    assert (span.gpus, span.asked, span.granted) == ((0,), 1.0, 2.0)
    again, later = held.check(run)  # type: ignore[arg-type]
    assert again.violations == [] and calls == ["end", "begin 7", "end", "begin 7"]
    assert later.granted == later.asked == span.released  # the next window starts where this one ended
    state = TestState()
    state.judged(held.owner, verdict, [span], during=" while it ran t.py::test_x")
    assert state.violations == [f"pytest-gpu: the rank pool broke its GPU lease while it ran t.py::test_x:\n  - {leak}"]
    assert state.notes == [] and len(state.held) == 1
    off, _ = held.check(SimpleNamespace(settings=SimpleNamespace(verify="off")))  # type: ignore[arg-type]
    assert off.violations == [] and len(calls) == 4  # --gpu-verify=off: not measured at all
