"""Tests that need several GPUs, whole GPUs, or more GPUs than the machine has."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pytest_gpu import GpuLease, sim


@pytest.mark.gpu(count=2, memory="4GiB")
def test_data_parallel_two_replicas(gpu: GpuLease) -> None:  # gpu: the plugin's fixture
    # gpu.devices: the leased GPUs as this process's CUDA numbers them (it sees the whole
    # run's GPUs: CUDA fixes its device list once per process, so they are not cuda:0, cuda:1)
    first, second = gpu.devices
    with sim.allocate("3GiB", device=first) as a, sim.allocate("3GiB", device=second) as b:
        assert a.physical != b.physical
        sim.hold("512MiB", 0.4)  # the default device is the lease's first GPU


@pytest.mark.gpu(2, memory="6GiB")  # count may be positional
def test_pipeline_parallel_stages(gpu: GpuLease) -> None:
    with sim.allocate("4GiB", device=gpu.devices[0]):
        sim.hold("4GiB", 0.5, device=gpu.devices[1])


@pytest.mark.gpu(count=2, memory="8GiB")
def test_tensor_parallel_matmul(gpu: GpuLease) -> None:
    with sim.allocate("6GiB", device=gpu.devices[0]), sim.allocate("6GiB", device=gpu.devices[1]):
        sim.hold("1GiB", 0.5)


@pytest.mark.gpu(count=2, memory="2GiB")
def test_subprocess_sees_exactly_the_lease(gpu: GpuLease) -> None:
    assert len(gpu.indices) == 2 and gpu.device == gpu.devices[0]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == gpu.visible_devices == gpu.env["CUDA_VISIBLE_DEVICES"]
    # a new process starts CUDA with only the lease visible: there it is cuda:0 and cuda:1
    code = "from pytest_gpu import sim; [sim.hold('1GiB', 0.2, device=d) for d in (0, 1)]"
    subprocess.run([sys.executable, "-c", code], env={**os.environ, **gpu.env}, check=True)


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
def test_eight_gpu_all_reduce(gpu: GpuLease) -> None:
    # skipped on a 4-GPU run, with a reason naming need and inventory (--gpu-oversize=skip)
    for device in gpu.devices:
        sim.hold("1GiB", 0.1, device=device)
