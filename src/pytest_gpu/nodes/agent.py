"""A node's host in ``--gpu-nodes`` mode: that node's run (inventory, broker, arbiter link).

The controller starts one per node through an execnet gateway with the node's launch
prefix and runs this module there (``gateway.remote_exec``). It is today's owner of GPUs,
unchanged, on its node: :meth:`GpuRun.start` discovers the node's GPUs (or its simulated
ones), makes the run directory in the node's temp directory, starts the broker on a Unix
socket there and links to the node's machine arbiter. The broker's key is made here and
goes to the controller over the channel only (the controller hands it to the node's
workers in ``workerinput``).

The messages, each checked as it arrives (here and at the controller), are
:data:`.messages.AGENT`.

The run ends on ``close`` and when the channel closes (the controller is gone: Ctrl-C,
killed); execnet then gives this thread five seconds before it interrupts the process.
"""

from __future__ import annotations

import os
import socket
from dataclasses import asdict
from typing import Any

import pytest_gpu

from ..machine import domain
from ..run import quarantine, required
from ..run.options import Settings
from ..run.rundir import RunDirError
from ..run.session import GpuRun
from ..sim import fake
from ..sim.ledger import LedgerWriteError
from ..vendors.devices import DeviceSpecError
from ..wire.frames import WireError
from . import messages


def state(
    run: GpuRun,
    worker: str | None = None,
    sent: dict[str, Any] | None = None,
    refused: int = 0,
    faults: bool = False,
) -> dict[str, Any]:
    """What the controller reads of this node's broker (plain values, for execnet): its
    view (:meth:`Broker.view`, the scheduler's), its counts, and what the summary asks;
    ``worker``: also what that worker found for ``--gpu-required`` (``required``: ``None``, none).
    ``catalog``: the entries of the broker's catalog (what the node's workers collected, what
    their fixtures hold) not in ``sent`` or changed since, which ``sent`` then records.
    ``refused``: how many of the scheduler's plans this node's broker refused (see :func:`prefer`).
    ``faults``: also what the summary says of this node's faults (:func:`faults`): asked for by
    the summary and sent with ``closed``, not with the scheduler's every ``state``."""
    broker = run.broker
    assert broker is not None  # a node host owns its node's broker
    figures = {
        **broker.view().to_wire(),  # room, order, placements, contexts, context_sizes, limits
        "refused_plans": refused,
        "grants": broker.grants,
        "crashes": len(broker.crashes),
        "required": required.reported(run, worker) if worker is not None else None,
        "catalog": _catalog_news(dict(broker.catalog), sent),
    }
    if faults:
        figures["faults"] = fault_records(run)
    return figures


def fault_records(run: GpuRun) -> dict[str, list[dict[str, Any]]]:
    """This node's processes that went away holding leases (its broker's crash records) and
    those a sticky CUDA error ended (the quarantine records of its run directory), as plain
    values: on one machine the summary has a line for each, here the controller does."""
    broker = run.broker
    assert broker is not None
    crashes = [{**asdict(c), "gpus": list(c.gpus), "ports": list(c.ports)} for c in broker.crashes]
    return {"crashes": crashes, "quarantined": [asdict(q) for q in quarantine.records(run.run_dir).values()]}


def prefer(run: GpuRun, body: dict[str, Any]) -> bool:
    """The scheduler's plan for a test of one of this node's workers, to this node's broker
    (:meth:`Broker.prefer`); ``False`` where the broker refused it (GPUs not this node's:
    the controller translated with another node's indices, a bug the summary then shows)."""
    broker = run.broker
    assert broker is not None
    try:
        broker.prefer(body["worker"], body["test"], tuple(body["gpus"]), body["memory"])
    except ValueError:
        return False
    return True


def _catalog_news(catalog: dict[str, Any], sent: dict[str, Any] | None) -> dict[str, Any]:
    if sent is None:
        return {}
    news = {key: value for key, value in catalog.items() if sent.get(key, _UNSENT) != value}
    sent.update(news)
    return news


_UNSENT = object()


def start(body: dict[str, Any]) -> tuple[GpuRun | None, tuple[str, Any]]:
    """Start the node's run from the controller's ``start`` message; the reply to send."""
    node = str(body["node"])
    try:
        os.chdir(body["cwd"])
    except OSError as exc:
        return None, ("error", f"node {node}: cannot enter the run's directory {body['cwd']}: {exc}")
    package = os.path.dirname(os.path.abspath(pytest_gpu.__file__))
    if package != body["package"]:
        return None, (
            "error",
            f"node {node}: imports pytest_gpu from {package}, the controller from {body['package']}; "
            "node mode needs the suite and its environment on a filesystem every node shares",
        )
    domain.hold_warnings()  # the controller's summary is where the run speaks, not this node's stderr
    try:
        fake.activate()  # a simulated node of its own fake GPUs (PYTEST_GPU_FAKE_GPUS), as the plugin does
        run = GpuRun.start(Settings.from_wire(body["settings"]), worker=f"node-{node}")
    except (DeviceSpecError, RunDirError, LedgerWriteError, OSError) as exc:
        return None, ("error", f"node {node}: {exc}")
    info = {
        "wire": dict(run.to_wire()),
        "node": node,
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "inventory": run.inventory.describe(),
        "gpus": [[d.index, d.total_memory] for d in run.inventory.devices],
        "warnings": list(domain.said),
    }
    return run, ("started", info)


def serve(channel: Any) -> None:
    """The node host's life: start, answer, end the run when told or when the channel goes."""
    try:
        kind, body = messages.request(channel.receive())
    except WireError as exc:
        channel.send(("error", f"a node host: {exc}"))
        return
    if kind != "start":
        channel.send(("error", f"expected start, got {kind!r}"))
        return
    run, reply = start(body)
    channel.send(reply)
    if run is None:
        return
    sent: dict[str, Any] = {}  # the catalog entries the controller has
    refused = 0  # plans this node's broker refused
    try:
        while True:
            try:
                said = channel.receive()
            except EOFError:  # the controller is gone
                return
            try:
                kind, body = messages.request(said)
            except WireError as exc:
                if isinstance(said, tuple) and said[:1] == ("prefer",):
                    refused += 1  # no answer: the controller reads none
                else:
                    channel.send(("error", f"node {run.node or '?'}: {exc}"))
                continue
            if kind == "state":
                channel.send(("state", state(run, body.get("worker"), sent, refused, body.get("faults", False))))
            elif kind == "prefer":  # no reply: the scheduler does not wait on a node per test
                refused += not prefer(run, body)
            else:  # close
                channel.send(("closed", state(run, None, sent, refused, faults=True)))
                return
    finally:
        run.close()
