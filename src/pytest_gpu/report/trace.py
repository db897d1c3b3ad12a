"""``--gpu-trace``: the run as a Chrome / Perfetto trace (JSON), from the timeline (pure but for :func:`write`).

Open it in https://ui.perfetto.dev or chrome://tracing. Layout:

* process 1 "workers": one thread per worker; a span per test (category ``test``, its
  request, GPUs and outcome in ``args``; ``counted``: what pytest's closing line counts it
  as, a phase at a time, e.g. ``["passed", "error"]`` for a teardown that raised after a
  passing call) with its waits for GPUs nested inside (category ``wait``; a test that
  waited for none, as the summary counts it, has none, whatever its broker round trip took).
* process 100+i "GPU i": a span per lease on that GPU (category ``lease``): a test's, or
  another holder's (a fixture's, a rank pool's: ``args.holder`` says which, ``args.nodeid``
  the test during which it was judged). Leases that share a GPU run side by side, so each
  GPU has lanes (threads): a lease takes the first lane free at its start. A counter
  ``leased memory`` shows the GiB promised.

Under ``--gpu-nodes`` each node is a track group of its own: process ``NODE_PID * (k + 1) + 1``
"node X: workers" (its workers' threads), and ``NODE_PID * (k + 1) + 100 + i`` "node X: GPU i"
for its GPUs, numbered as that node numbers them (``k``: the node's place in the run's list;
``otherData.pytest_gpu.nodes`` lists each node's pids and GPUs). Every test appears once, on
its node's workers' track.

Times are microseconds from the first test's start; ``otherData.pytest_gpu`` holds the
inventory and the wall-clock start, for ``pytest-gpu report``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..base.requests import format_size
from .timeline import TestRecord, Timeline

WORKERS_PID = 1
GPU_PID = 100
NODE_PID = 10000  # --gpu-nodes: node k's processes are NODE_PID * (k + 1) + the pids above
GIB = 2**30


def build(
    timeline: Timeline,
    gpus: Sequence[tuple[int, int]],
    inventory: str,
    source: str,
    nodes: Mapping[str, Sequence[tuple[int, int]]] | None = None,
) -> dict[str, Any]:
    """The trace of ``timeline`` on ``gpus`` (``(index, total bytes)`` each); ``nodes``
    (``--gpu-nodes``): each node's GPUs instead, each node a track group (see the module docstring)."""
    tests = timeline.tests()
    begin, _ = timeline.bounds()
    workers = sorted({r.worker for r in tests}, key=_worker_order)
    tids = {w: n + 1 for n, w in enumerate(workers)}

    def us(t: float) -> int:
        return round((t - begin) * 1e6)

    groups: list[tuple[str | None, int, Sequence[tuple[int, int]]]]  # (node, pid offset, its GPUs)
    if nodes is None:
        groups = [(None, 0, gpus)]
    else:
        groups = [(name, NODE_PID * (k + 1), node_gpus) for k, (name, node_gpus) in enumerate(nodes.items())]
    offset = {name: base for name, base, _ in groups}
    events: list[dict[str, Any]] = []
    for name, base, group_gpus in groups:
        label = "" if name is None else f"node {name}: "
        pid = base + WORKERS_PID
        events.append(_meta("process_name", pid, None, f"{label}workers"))
        if name is not None:
            events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": base}})
        mine = [w for w in workers if any(r.worker == w and r.node == name for r in tests)] if name else workers
        events += [_meta("thread_name", pid, tids[w], w) for w in mine]
        for index, total in group_gpus:
            gpid = base + GPU_PID + index
            events.append(_meta("process_name", gpid, None, f"{label}GPU {index} ({format_size(total)})"))
            events.append({"ph": "M", "name": "process_sort_index", "pid": gpid, "args": {"sort_index": base + index}})
    for rec in tests:
        base = offset.get(rec.node, 0) if nodes is not None else 0
        stop = max(rec.stop, rec.start)
        events.append(
            {
                "ph": "X",
                "cat": "test",
                "name": short(rec.nodeid),
                "pid": base + WORKERS_PID,
                "tid": tids[rec.worker],
                "ts": us(rec.start),
                "dur": max(us(stop) - us(rec.start), 1),
                "args": {
                    "nodeid": rec.nodeid,
                    "worker": rec.worker,
                    "outcome": rec.outcome,
                    "counted": rec.counted,
                    "gpus": sorted({g for s in rec.leases for g in s.gpus}),
                    "request": rec.request or None,
                    "wait_s": round(rec.waited, 6),
                }
                | ({"node": rec.node} if rec.node is not None else {}),
            }
        )
        # a test that waited for no GPU (its own figure, the summary's: TestRecord.waited) draws no
        # wait: from asking to being granted at once is the broker's round trip, not waiting
        waited = rec.waited >= 1e-3
        for span in rec.leases:
            if waited and span.granted - span.asked >= 1e-3:
                events.append(
                    {
                        "ph": "X",
                        "cat": "wait",
                        "name": "wait for GPU",
                        "pid": base + WORKERS_PID,
                        "tid": tids[rec.worker],
                        "ts": us(span.asked),
                        "dur": max(us(span.granted) - us(span.asked), 1),
                        "args": {"nodeid": rec.nodeid, "request": rec.request or None},
                    }
                )
    for name, base, group_gpus in groups:
        mine_tests = tests if name is None else [r for r in tests if r.node == name]
        events += _gpu_events(mine_tests, [i for i, _ in group_gpus], us, base)
    other: dict[str, Any] = {}
    if nodes is not None:
        other["nodes"] = [
            {
                "name": name,
                "workers_pid": base + WORKERS_PID,
                "gpus": [{"index": i, "memory": total, "pid": base + GPU_PID + i} for i, total in group_gpus],
            }
            for name, base, group_gpus in groups
        ]
    return {
        "displayTimeUnit": "ms",
        "traceEvents": events,
        "otherData": {
            "pytest_gpu": {
                "version": 1,
                "inventory": inventory,
                "source": source,
                "gpus": [{"index": i, "memory": total} for i, total in gpus],
                "started": begin,
                "makespan": timeline.makespan(),
                "workers": workers,
            }
            | other
        },
    }


def _gpu_events(tests: Sequence[TestRecord], gpus: Sequence[int], us: Any, base: int = 0) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for gpu in gpus:
        pid = base + GPU_PID + gpu
        leases = sorted(
            [(span, rec, None) for rec in tests for span in rec.leases if gpu in span.gpus]
            + [(span, rec, held) for rec in tests for held in rec.held for span in held.spans if gpu in span.gpus],
            key=lambda row: (row[0].granted, row[1].nodeid),
        )
        lanes: list[int] = []  # end time (us) of the last lease in each lane
        changes: list[tuple[int, int]] = []
        for span, rec, held in leases:
            start, end = us(span.granted), max(us(span.released), us(span.granted) + 1)
            lane = next((n for n, free_at in enumerate(lanes) if free_at <= start), len(lanes))
            if lane == len(lanes):
                lanes.append(end)
                events.append(_meta("thread_name", pid, lane, f"GPU {gpu} / {lane}"))
            lanes[lane] = end
            args: dict[str, Any] = {
                "nodeid": rec.nodeid,
                "worker": rec.worker,
                "gpu": gpu,
                "memory": span.memory,
                "exclusive": span.exclusive,
                "peak": rec.peak,
                "outcome": rec.outcome,
            }
            if held is not None:  # a fixture's or pool's lease: its own name, no test's peak or outcome
                args.update(holder=held.kind, peak=None, outcome=None, violations=held.violations)
            name = short(rec.nodeid) if held is None else held.name
            events.append(
                {"ph": "X", "cat": "lease", "name": name, "pid": pid, "tid": lane, "ts": start, "dur": end - start}
                | {"args": args}
            )
            changes += [(start, span.memory), (end, -span.memory)]
        level = 0
        for ts, delta in sorted(changes):
            level += delta
            events.append(
                {"ph": "C", "name": "leased memory", "pid": pid, "ts": ts, "args": {"GiB": round(level / GIB, 3)}}
            )
    return events


def _meta(name: str, pid: int, tid: int | None, value: str) -> dict[str, Any]:
    event: dict[str, Any] = {"ph": "M", "name": name, "pid": pid, "args": {"name": value}}
    if tid is not None:
        event["tid"] = tid
    return event


def _worker_order(name: str) -> tuple[int, str]:
    digits = name[2:] if name.startswith("gw") else ""
    return (int(digits), name) if digits.isdigit() else (-1, name)


def short(nodeid: str) -> str:
    """``tests/test_x.py::TestY::test_z[1]`` -> ``TestY::test_z[1]``."""
    return nodeid.split("::", 1)[1] if "::" in nodeid else nodeid


def write(path: str | os.PathLike[str], data: dict[str, Any]) -> Path:
    """Write the trace atomically (a reader never sees half a file) into an existing directory."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(data, separators=(",", ":")))
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)  # after a failure; after the rename it is gone already
    return target
