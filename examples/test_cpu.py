"""CPU-only tests: no marker, no lease, no broker round trip — they run as before."""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections import Counter

import pytest


def tokenize(text: str) -> list[str]:
    return re.findall(r"[a-z]+|\d+|[^\sa-z\d]", text.lower())


def test_tokenizer_splits_words_numbers_and_punctuation() -> None:
    assert tokenize("Batch 32, lr=3e-4!") == ["batch", "32", ",", "lr", "=", "3", "e", "-", "4", "!"]


def test_vocabulary_counts() -> None:
    corpus = "the cat sat on the mat the end " * 200
    counts = Counter(tokenize(corpus))
    assert counts.most_common(1) == [("the", 600)]


def test_config_round_trip() -> None:
    config = {"model": {"layers": 24, "hidden": 2048}, "optim": {"lr": 3e-4, "betas": [0.9, 0.95]}}
    assert json.loads(json.dumps(config)) == config


def test_checkpoint_digest_is_stable() -> None:
    blob = bytes(range(256)) * 4096
    assert hashlib.sha256(blob).hexdigest() == hashlib.sha256(bytearray(blob)).hexdigest()


@pytest.mark.parametrize("n", [10, 100, 1000])
def test_learning_rate_schedule_is_monotonic_after_warmup(n: int) -> None:
    warmup = n // 10
    lrs = [min(1.0, (step + 1) / warmup) * (1 - step / n) for step in range(n)]
    after = lrs[warmup:]
    assert all(a >= b for a, b in itertools.pairwise(after))


def test_shard_assignment_covers_every_sample() -> None:
    world, samples = 4, 1003
    shards = [list(range(rank, samples, world)) for rank in range(world)]
    assert sorted(i for shard in shards for i in shard) == list(range(samples))
