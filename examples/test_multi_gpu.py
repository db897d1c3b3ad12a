"""Tests that need several GPUs, whole GPUs, or more GPUs than the machine has."""

from __future__ import annotations

import os

import pytest

from pytest_gpu import GpuLease, sim


@pytest.mark.gpu(count=2, memory="4GiB")
def test_data_parallel_two_replicas() -> None:
    # cuda:0 and cuda:1 are the two leased GPUs, whatever their physical indices
    with sim.allocate("3GiB", device=0) as a, sim.allocate("3GiB", device=1) as b:
        assert a.physical != b.physical
        sim.hold("512MiB", 0.4, device=0)


@pytest.mark.gpu(2, memory="6GiB")  # count may be positional
def test_pipeline_parallel_stages() -> None:
    with sim.allocate("4GiB", device=0):
        sim.hold("4GiB", 0.5, device=1)


@pytest.mark.gpu(count=2, memory="8GiB")
def test_tensor_parallel_matmul() -> None:
    with sim.allocate("6GiB", device=0), sim.allocate("6GiB", device=1):
        sim.hold("1GiB", 0.5, device=0)


@pytest.mark.gpu(count=2, memory="2GiB")
def test_lease_is_what_the_process_sees(gpu: GpuLease) -> None:  # gpu: the plugin's fixture
    assert len(gpu.indices) == 2 and gpu.device == "cuda:0"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == gpu.visible_devices == gpu.env["CUDA_VISIBLE_DEVICES"]
    for ordinal in (0, 1):
        sim.hold("1GiB", 0.2, device=ordinal)


@pytest.mark.gpu(exclusive=True)
def test_whole_gpu_benchmark() -> None:
    # no co-tenant: a benchmark that would be disturbed by neighbours
    sim.hold("12GiB", 0.6)


@pytest.mark.gpu(exclusive=True)
def test_whole_gpu_memory_sweep(gpu: GpuLease) -> None:
    # an exclusive lease gets everything the GPU can give after CUDA contexts
    assert gpu.exclusive and gpu.memory >= 12 * 2**30
    sim.hold(gpu.memory - 2**30, 0.5)


@pytest.mark.gpu(count=8, memory="8GiB")
def test_eight_gpu_all_reduce() -> None:
    # skipped on a 4-GPU run, with a reason naming need and inventory (--gpu-oversize=skip)
    for ordinal in range(8):
        sim.hold("1GiB", 0.1, device=ordinal)
