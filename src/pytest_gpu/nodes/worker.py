"""An xdist worker of ``--gpu-nodes`` mode: which node it is on, and its temp directory there.

:class:`NodeWorker` is the feature's hook object in such a worker.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from ..base.safefiles import Unsafe, private_dir
from ..run.session import GpuRun
from ..vendors.devices import Inventory
from .spec import INVENTORIES_KEY, NODE_ENV, NODE_KEY

if TYPE_CHECKING:
    from ..run.session import GpuRun


class NodeWorker:
    """``--gpu-nodes`` in a worker: each report (and junitxml's testcase) names the node it ran on."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> None:
        name = node(self.config)
        if name is not None:
            item.user_properties.append(("gpu_node", name))


def node(config: pytest.Config) -> str | None:
    """The node this worker was started on (``None``: not a node worker)."""
    workerinput = getattr(config, "workerinput", None)
    return None if workerinput is None else workerinput.get(NODE_KEY)


def setup(config: pytest.Config) -> None:
    """At the worker's ``pytest_cmdline_main``, before pytest's tmpdir plugin reads ``basetemp``.

    The worker must run on the node the controller meant (its launch prefix ran it there:
    ``$PYTEST_GPU_NODE`` says so); and xdist hands it ``<controller's basetemp>/popen-gwN``,
    whose parent exists on the controller's node only (pytest makes a given basetemp
    without its parents), so the worker's basetemp moves into its node's temp directory."""
    meant = node(config)
    if meant is None:
        return
    here = os.environ.get(NODE_ENV)
    if here != meant:
        raise pytest.UsageError(
            f"--gpu-nodes: this worker was started for node {meant} but runs where {NODE_ENV}={here!r}"
        )
    workerinput = config.workerinput  # type: ignore[attr-defined]
    parent = Path(tempfile.gettempdir()) / f"pytest-gpu-nodes-{str(workerinput['testrunuid'])[:12]}"
    try:  # in the shared temp directory: never another user's directory, nor a link to one
        private_dir(parent)
    except Unsafe as exc:
        raise pytest.UsageError(f"--gpu-nodes: this worker's temp directory on node {meant}: {exc}") from None
    config.option.basetemp = str(parent / str(workerinput["workerid"]))


def every_node(config: pytest.Config, run: GpuRun) -> dict[str, GpuRun] | None:
    """Every node of the run as this worker's oversize check sees it: its own ``run``, and a
    run over each other node's inventory (for :meth:`GpuRun.never_fits` only: no broker);
    ``None``: not a node worker."""
    here = node(config)
    if here is None:
        return None
    inventories = config.workerinput.get(INVENTORIES_KEY, {})  # type: ignore[attr-defined]
    runs = {
        name: GpuRun(run.settings, Inventory.from_wire(wire), "", b"", run.worker, run.run_dir, node=name)
        for name, wire in inventories.items()
        if name != here
    }
    runs[here] = run
    return runs


def largest(config: pytest.Config, run: GpuRun) -> tuple[str, int] | None:
    """The node of the run whose GPUs give one lease the most, and that most (bytes after a
    CUDA context); ``None``: not a node worker."""
    runs = every_node(config, run)
    if not runs:
        return None
    name, best = max(runs.items(), key=lambda kv: (kv[1].usable_memory, len(kv[1].inventory.devices), kv[0]))
    return name, best.usable_memory
