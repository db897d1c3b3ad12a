"""A class-level marker: every method gets 3 GiB; the closest marker wins."""

from __future__ import annotations

import pytest

from pytest_gpu import sim


@pytest.mark.gpu(memory="3GiB")
class TestInferenceServer:
    def test_load_weights(self) -> None:
        sim.hold("2GiB", 0.3)

    def test_batched_generate(self) -> None:
        with sim.allocate("2GiB"):
            sim.hold("512MiB", 0.4)

    def test_kv_cache_grows_and_shrinks(self) -> None:
        cache = [sim.allocate("512MiB") for _ in range(4)]
        for block in cache:
            block.free()
        sim.hold("1GiB", 0.2)

    @pytest.mark.gpu(memory="7GiB")  # closer than the class's marker: this one applies
    def test_speculative_decoding_with_draft_model(self) -> None:
        with sim.allocate("3GiB"):  # target model
            sim.hold("3GiB", 0.4)  # draft model

    def test_tokenizer_only(self) -> None:
        # still leases 3 GiB (the class marker), but does not need to touch the GPU
        assert "hello world".split() == ["hello", "world"]
