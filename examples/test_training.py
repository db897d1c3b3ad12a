"""Single-GPU tests with mixed memory needs, from 1 GiB to 12 GiB per test.

Each test does its "GPU work" on the simulated device the plugin leased to it:
``sim.hold(size, seconds)`` allocates, sleeps (the kernel running), frees. Like a CUDA
allocation without a device it lands on the current device, which pytest-gpu sets to the
leased GPU, so the same code lands on whichever GPU the lease names. Without pytest-gpu
every test lands on GPU 0 and the big ones run out of memory together.
"""

from __future__ import annotations

import pytest

from pytest_gpu import parse_size, sim


@pytest.mark.gpu(memory="1GiB")
def test_embedding_lookup() -> None:
    sim.hold("768MiB", 0.2)


@pytest.mark.gpu(memory="2GiB")
def test_attention_kernel() -> None:
    with sim.allocate("1GiB") as qkv, sim.allocate("512MiB") as scores:
        assert qkv.device == scores.device  # both on the current device: the lease's
        sim.hold("256MiB", 0.3)


@pytest.mark.gpu(memory="4GiB")
def test_mixed_precision_step() -> None:
    weights = sim.allocate("2GiB")
    try:
        sim.hold("1GiB", 0.4)  # activations, freed when the step ends
    finally:
        weights.free()


@pytest.mark.gpu(memory="8GiB")
def test_optimizer_state_fits() -> None:
    with sim.allocate("3GiB"), sim.allocate("3GiB"):  # Adam's two moments
        sim.hold("1GiB", 0.5)


@pytest.mark.gpu(memory="12GiB")
def test_finetune_large_model() -> None:
    sim.hold("11GiB", 0.8)


@pytest.mark.gpu(memory="10GiB")
def test_long_context_inference() -> None:
    sim.hold("9GiB", 0.6)


# A parametrized family: each case asks for what its batch size needs.
BATCH_MEMORY = {8: "1GiB", 16: "2GiB", 32: "3GiB", 64: "5GiB", 128: "8GiB", 256: "12GiB"}


@pytest.mark.parametrize(
    "batch",
    [pytest.param(b, marks=pytest.mark.gpu(memory=m), id=f"batch{b}") for b, m in BATCH_MEMORY.items()],
)
def test_training_step_by_batch_size(batch: int) -> None:
    budget = parse_size(BATCH_MEMORY[batch])
    activations = budget * 3 // 4  # what the step needs at this batch size
    sim.hold(activations, 0.2 + batch / 1000)
