"""A test process waiting for a GPU its own idle warm rank pool holds closes that pool
first (issue 19, item 5), instead of waiting out ``--dist-pool-idle``."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from pytest_gpu.base.requests import GpuRequest
from pytest_gpu.leasing.broker import Broker
from pytest_gpu.leasing.client import BrokerClient
from pytest_gpu.machine.link import MachineLink
from pytest_gpu.machine.placement import Policy
from pytest_gpu.machine.ports import PortAllocator

GiB, MiB = 2**30, 2**20


def test_a_queued_request_gives_up_what_its_process_holds_idle_and_is_granted(tmp_path: Path) -> None:
    """The broker says "queued" (another worker, not waiting, holds the rest): ``on_wait``
    runs before the wait and may release through the same client (it is re-entrant); the
    request is then granted at once, not after the idle pool's timeout."""
    policy = Policy(overhead=500 * MiB)
    ports = PortAllocator((30000, 30999), check=lambda port: True, seed=0)
    authkey = os.urandom(16)
    broker = Broker(
        {0: 16 * GiB},
        str(tmp_path / "b.sock"),
        authkey,
        policy,
        (ports.lo, ports.hi),
        link=MachineLink(None, policy, ports=ports),
    ).start()
    mine, other = BrokerClient(broker.address, authkey, "gw0"), BrokerClient(broker.address, authkey, "gw1")
    try:
        other.acquire(GpuRequest(count=1, memory=6 * GiB, exclusive=False), "gw1's test", 5)
        pool = mine.acquire(GpuRequest(count=1, memory=6 * GiB, exclusive=False), "gw0's idle pool", 5)
        given_up: list[float] = []

        def on_wait() -> None:
            given_up.append(time.monotonic())
            mine.release(pool.key)  # the idle pool closes

        started = time.monotonic()
        grant = mine.acquire(GpuRequest(count=1, memory=8 * GiB, exclusive=False), "gw0's next test", 20, on_wait)
        assert given_up and tuple(grant.indices) == (0,)
        assert time.monotonic() - started < 5
    finally:
        mine.close()
        other.close()
        broker.close()


SUITE = """
import pytest
from pytest_gpu import sim

@pytest.mark.distributed(world_size=1, backend="none", gpus_per_rank=1)
def test_a_distributed(rank):
    assert rank.rank == 0

@pytest.mark.gpu(memory="8GiB")
def test_b_plain():
    sim.allocate("4GiB").free()
"""


@pytest.mark.parametrize("workers", [(), ("-n", "1")], ids=["one-process", "xdist"])
def test_plain_test_after_a_pool_on_the_same_gpu_does_not_wait_for_the_pool(gpu_pytester, run_inner, workers):
    """The pool's lease is exclusive (the default) on the only GPU: before the change the
    plain test waited until the pool's idle timeout (120 s), past its wait timeout (30 s)."""
    gpu_pytester.makepyfile(test_pool=SUITE)
    started = time.monotonic()
    result = run_inner(
        "--gpus",
        "sim:1x16GiB",
        "-p",
        "no:randomly",
        "--dist-pool-idle=120",
        "--gpu-wait-timeout=30",
        *workers,
        subprocess=True,
        timeout=170,
    )
    took = time.monotonic() - started
    result.assert_outcomes(passed=2)
    assert took < 25, f"the plain test waited for the pool ({took:.0f}s)\n{result.stdout.str()}"
