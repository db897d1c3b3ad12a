"""Splitting a suite over the ranks of a launch (pure): longest-processing-time first."""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence


def partition(nodeids: Sequence[str], shards: int, durations: Mapping[str, float] | None = None) -> list[list[str]]:
    """Split ``nodeids`` into ``shards`` lists of about equal total duration.

    With recorded ``durations`` the longest tests are placed first, each on the shard
    with the least work so far (LPT; within 4/3 of the optimum). Tests without a record
    count as the median recorded duration. Without any history the split is by count,
    round-robin over the sorted node ids. The result is deterministic, so every rank
    computes the same split independently.
    """
    if shards <= 0:
        raise ValueError(f"shards must be positive, got {shards}")
    ordered = sorted(nodeids)
    known = {n: durations[n] for n in ordered if durations and n in durations}
    if not known:
        return [ordered[i::shards] for i in range(shards)]
    values = sorted(known.values())
    default = values[len(values) // 2]
    weight = {n: known.get(n, default) for n in ordered}
    heap = [(0.0, i) for i in range(shards)]
    result: list[list[str]] = [[] for _ in range(shards)]
    for nodeid in sorted(ordered, key=lambda n: (-weight[n], n)):
        load, index = heapq.heappop(heap)
        result[index].append(nodeid)
        heapq.heappush(heap, (load + weight[nodeid], index))
    return [sorted(part, key=ordered.index) for part in result]
