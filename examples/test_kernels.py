"""A module-level marker: ``pytestmark`` gives every test here 2 GiB on one GPU."""

from __future__ import annotations

import pytest

from pytest_gpu import sim

pytestmark = pytest.mark.gpu(memory="2GiB")


def test_softmax_kernel() -> None:
    sim.hold("1GiB", 0.2)


def test_layernorm_kernel() -> None:
    sim.hold("1536MiB", 0.2)


def test_fused_adam_kernel() -> None:
    with sim.allocate("1GiB"):
        sim.hold("512MiB", 0.3)


@pytest.mark.gpu(memory="5GiB")  # closer than the module's marker
def test_flash_attention_kernel() -> None:
    sim.hold("4GiB", 0.4)
