"""An xdist worker of ``--gpu-nodes`` mode: which node it is on, and its temp directory there."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from .spec import NODE_ENV, NODE_KEY


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
    parent.mkdir(mode=0o700, exist_ok=True)
    config.option.basetemp = str(parent / str(workerinput["workerid"]))
