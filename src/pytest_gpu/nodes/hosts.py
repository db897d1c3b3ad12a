"""The controller's side of ``--gpu-nodes``: the node plan, the node hosts, the workers' specs.

:func:`configure` (at ``pytest_configure``, before xdist starts anything) reads and checks
the option, makes the plan (:mod:`pytest_gpu.nodes.spec`), starts one node host per node
(:mod:`pytest_gpu.nodes.agent`) and sets xdist's ``--tx`` to ``-n`` workers on each node
whose host started. A node whose host could not start is reported and left out; with
none left the run stops with a usage error.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

import pytest_gpu

from ..base import privates
from ..base.launch import LaunchContext
from ..leasing.protocol import CrashRecord
from ..leasing.view import NodeView
from ..run.keys import DIST_CHOSEN_KEY, TX_GIVEN_KEY, WORKERS_GIVEN_KEY
from ..run.options import Settings
from ..run.quarantine import Quarantine
from ..run.session import WIRE_KEY
from ..wire.frames import WireError
from . import messages
from . import spec as spec_
from .spec import INVENTORIES_KEY, NODE_KEY, NodePlan, NodesError

# What the controller runs on the node (``gateway.remote_exec``): execnet runs a string or a
# module's *source* outside any package, so this imports the node's host (:mod:`.agent`) itself,
# with the controller's sys.path (sent first) under which the node must find the same pytest_gpu.
BOOTSTRAP = """
import sys
sys.path[:] = channel.receive()
from pytest_gpu.nodes import agent
agent.serve(channel)
"""

START_TIMEOUT_S = 120.0  # a node host's start: srun may wait for the step, discovery may load NVML
CLOSE_TIMEOUT_S = 30.0
ALIVE_TIMEOUT_S = 10.0  # a node host answers at once: its one thread only reads the broker's state

NODES_KEY = pytest.StashKey["NodeHosts"]()


def _hostnames(nodelist: str) -> list[str]:
    """``scontrol show hostnames``: SLURM's node list syntax expanded (``n[1-3]``)."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30, check=True
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise NodesError(
            f"{spec_.OPTION}=slurm: cannot expand SLURM_JOB_NODELIST={nodelist} with scontrol: {exc}"
        ) from None
    return out.stdout.split()


def unshare_works() -> bool:
    """Whether this machine gives a process its own network namespace (``unshare -n``: root, or
    unprivileged user namespaces)."""
    # unshare makes the node's namespace, ip brings its loopback up, nsenter puts the workers in it
    if any(shutil.which(tool) is None for tool in ("unshare", "ip", "nsenter")):
        return False
    try:
        probe = ["unshare", "-n", "sh", "-c", "ip link set lo up"]
        return subprocess.run(probe, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@dataclass
class NodeHost:
    """One node's host as the controller sees it."""

    name: str
    spec: str  # the execnet spec it (and the node's workers) start with
    gateway: Any = None
    channel: Any = None
    info: dict[str, Any] = field(default_factory=dict)  # the "started" reply
    error: str | None = None  # why it did not start
    final: dict[str, Any] = field(default_factory=dict)  # the "closed" reply
    lost: str | None = None  # why it stopped answering during the run


class NodeHosts:
    """Every node's host: started once per run, closed at its end (see :mod:`.agent`)."""

    def __init__(self, plan: NodePlan, settings: Settings, specs: dict[str, str], cleanup: Callable[[], None]) -> None:
        self.plan = plan
        self.settings = settings
        self.hosts = {name: NodeHost(name, specs[name]) for name in plan.names}
        self._cleanup = cleanup
        self._group: Any = None
        # each node's broker catalog (its views'; kept up to date by every state reply)
        self.catalogs: dict[str, dict[str, Any]] = {name: {} for name in plan.names}

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        """Start every node's host (all at once, then wait for each)."""
        import execnet  # local: only --gpu-nodes runs need execnet

        self._group = execnet.Group()
        package = os.path.dirname(os.path.abspath(pytest_gpu.__file__))
        for host in self.hosts.values():
            try:
                host.gateway = self._group.makegateway(host.spec)
                host.channel = host.gateway.remote_exec(BOOTSTRAP)
                host.channel.send(list(sys.path))
                body = {"settings": self.settings.to_wire(), "node": host.name, "cwd": os.getcwd(), "package": package}
                host.channel.send(("start", body))
            except Exception as exc:  # execnet raises what the launch raised (srun, ssh refusing)
                said = f"{_short(exc)}; its launcher's own words, if any, are above"
                host.error = f"node {host.name}: cannot start a process there ({said})"
        for host in self.hosts.values():
            if host.error is not None:
                continue
            try:
                kind, body = messages.answer("start", host.channel.receive(timeout))
            except WireError as exc:
                host.error = f"node {host.name}: its node host answered what the protocol does not allow: {exc}"
                continue
            except Exception as exc:  # RemoteError (an import failed there), TimeoutError, EOFError
                host.error = f"node {host.name}: its node host did not start: {_short(exc)}"
                continue
            if kind == "started":
                host.info = body
            else:
                host.error = str(body)

    @property
    def up(self) -> list[str]:
        """The nodes whose host started, in the plan's order."""
        return [n for n, h in self.hosts.items() if h.error is None and h.info]

    def wire(self, node: str) -> dict[str, Any]:
        """The run as ``node``'s workers join it (its broker's address and key, its inventory)."""
        return dict(self.hosts[node].info["wire"])

    def state(
        self, node: str, worker: str | None = None, timeout: float = 30.0, faults: bool = False
    ) -> dict[str, Any]:
        """``node``'s broker as the scheduler and the summary read it; ``worker``: with what that
        worker found for ``--gpu-required`` (in the node's run directory); ``faults``: with
        its crash and quarantine records (:func:`.agent.fault_records`)."""
        host = self.hosts[node]
        body: dict[str, Any] = {} if worker is None else {"worker": worker}
        if faults:
            body["faults"] = True
        host.channel.send(("state", body))
        return self._answer(node, timeout)

    def _answer(self, node: str, timeout: float | None) -> dict[str, Any]:
        """``node``'s reply to a ``state`` already sent (the catalog's news taken in);
        :class:`WireError` for one that is not what the protocol says."""
        kind, body = messages.answer("state", self.hosts[node].channel.receive(timeout))
        if kind == "error":
            raise RuntimeError(f"node {node}: {body}")
        self.catalogs[node].update(body["catalog"])
        return dict(body)

    def views(self) -> dict[str, NodeView]:
        """Every live node's broker now (the scheduler's view before each fill; each node's
        catalog is brought up to date too). A node that no longer answers is marked lost and
        left out.

        Every node is asked before any answer is read, so a fill waits for the slowest node's
        round trip, not for the sum of them."""
        asked: list[str] = []
        for name in self.up:
            host = self.hosts[name]
            if host.lost is not None:
                continue
            try:
                host.channel.send(("state", {}))
            except Exception as exc:  # its channel closed: the node is gone
                host.lost = _short(exc)
                continue
            asked.append(name)
        views: dict[str, NodeView] = {}
        for name in asked:
            try:
                figures = self._answer(name, ALIVE_TIMEOUT_S)
            except Exception as exc:  # gone: its workers' removal follows from xdist
                self.hosts[name].lost = _short(exc)
                continue
            views[name] = NodeView.from_wire(figures, self.catalogs[name])
        return views

    def prefer(self, node: str, worker: str, test: str, gpus: tuple[int, ...], memory: int | None) -> None:
        """Pass the scheduler's plan for ``test`` to ``node``'s broker (``gpus``: its indices);
        no answer is awaited (the node host counts one its broker refused: ``refused_plans``)."""
        host = self.hosts[node]
        if host.lost is not None or host.channel is None:
            return
        body = {"worker": worker, "test": test, "gpus": list(gpus), "memory": memory}
        try:
            host.channel.send(("prefer", body))
        except Exception as exc:  # its channel closed: the node is gone
            host.lost = _short(exc)

    def node_of(self, worker: Any) -> str:
        """The node of an xdist ``WorkerController`` (its spec's ``env:PYTEST_GPU_NODE``)."""
        node = node_of(worker)
        assert node is not None, f"worker {privates.worker_id(worker)} has no node of this run"
        return node

    def alive(self, node: str) -> bool:
        """Whether ``node``'s host still answers (a node whose host is gone is lost: its
        processes went together, or its launcher's connection did)."""
        host = self.hosts[node]
        if host.lost is None:
            try:
                self.state(node, timeout=ALIVE_TIMEOUT_S)
            except Exception as exc:  # EOFError, OSError, TimeoutError: it is gone
                host.lost = _short(exc)
        return host.lost is None

    def gpus(self) -> dict[str, list[tuple[int, int]]]:
        """Each started node's GPUs, ``(index, total bytes)``, as its node host found them."""
        return {name: [(int(i), int(m)) for i, m in self.hosts[name].info.get("gpus", ())] for name in self.up}

    def faults(self) -> dict[str, tuple[list[CrashRecord], dict[str, Quarantine]]]:
        """Each node's processes that went away holding leases, and those a sticky CUDA error
        ended (worker -> record), from its host's last figures or asked now; a node that no
        longer answers is left out (its line says it was lost)."""
        found: dict[str, tuple[list[CrashRecord], dict[str, Quarantine]]] = {}
        for name in self.up:
            host = self.hosts[name]
            figures = host.final
            if not figures:
                if host.lost is not None:
                    continue
                try:
                    figures = self.state(name, timeout=ALIVE_TIMEOUT_S, faults=True)
                except Exception as exc:  # gone: its line says so
                    host.lost = _short(exc)
                    continue
            records = figures.get("faults") or {}
            crashes = [
                CrashRecord(
                    str(c["worker"]),
                    int(c["pid"]),
                    None if c.get("test") is None else str(c["test"]),
                    tuple(int(i) for i in c["gpus"]),
                    tuple(int(p) for p in c["ports"]),
                    float(c["at"]),
                )
                for c in records.get("crashes", ())
            ]
            quarantined = {str(q["worker"]): Quarantine(**q) for q in records.get("quarantined", ())}
            if crashes or quarantined:
                found[name] = (crashes, quarantined)
        return found

    def lines(self, words: Callable[[str, list[int]], str] | None = None) -> list[str]:
        """The summary's lines about the nodes (each node's broker asked now); ``words(node,
        its GPU indices)``: what ran there (the controller's timeline), added to its line."""
        out = []
        for name, host in self.hosts.items():
            if host.error is not None:
                out.append(f"pytest-gpu: {host.error}; left out of this run")
                continue
            if not host.final and not self.alive(name):
                out.append(f"pytest-gpu: node {name}: lost during the run ({host.lost})")
                continue
            figures = host.final or self.state(name)
            grants, crashes = int(figures["grants"]), int(figures["crashes"])
            said = f", {grants} lease{'' if grants == 1 else 's'} granted"
            if crashes:
                said += f", {crashes} process{'' if crashes == 1 else 'es'} went away holding leases"
            refused = int(figures.get("refused_plans", 0))
            if refused:  # the scheduler's plans name this node's GPUs: a refusal is a bug to report
                said += f", {refused} scheduler plan{'' if refused == 1 else 's'} refused"
            where, gpus = host.info.get("hostname", "?"), host.info.get("inventory", "?")
            ran = f" · {words(name, [i for i, _ in self.gpus().get(name, [])])}" if words is not None else ""
            out.append(f"pytest-gpu: node {name} ({where}): {gpus}{said}{ran}")
            warnings = host.info.get("warnings", [])
            out.extend(f"pytest-gpu: node {name}: {w.removeprefix('pytest-gpu: ')}" for w in warnings)
        return out

    def finish(self) -> None:
        """Ask every node host for its last figures and end its run (idempotent)."""
        for host in self.hosts.values():
            if host.channel is None or host.final or host.error is not None:
                continue
            with contextlib.suppress(Exception):  # a node lost meanwhile: its host ended with its channel
                host.channel.send(("close", {}))
                kind, body = messages.answer("close", host.channel.receive(CLOSE_TIMEOUT_S))
                if kind == "closed":
                    host.final = dict(body)

    def close(self) -> None:
        """End every node host and its gateway, and remove the simulated nodes' directories."""
        try:
            self.finish()
        finally:
            if self._group is not None:
                self._group.terminate(CLOSE_TIMEOUT_S)
                self._group = None
            self._cleanup()


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__


def configure(config: pytest.Config, settings: Settings, launch: LaunchContext | None) -> NodeHosts | None:
    """Node mode's start at the controller (see the module's docstring); ``None`` without ``--gpu-nodes``.

    Raises :class:`pytest.UsageError` naming ``--gpu-nodes`` for what node mode cannot use."""
    value = config.getoption("gpu_nodes", None)
    if not value:
        return None
    given_tx: list[str] = config.stash.get(TX_GIVEN_KEY, [])
    # -n as given: by now xdist has turned -n auto into the controller's own count
    given_n = config.stash.get(WORKERS_GIVEN_KEY, None)
    try:
        form = spec_.parse(str(value))
        per_node = spec_.check_xdist(
            numprocesses=given_n if given_n in ("auto", "logical") else getattr(config.option, "numprocesses", None),
            tx=given_tx,
            dist=str(getattr(config.option, "dist", "no")),
            user_dist=config.stash.get(DIST_CHOSEN_KEY, False),
            launched=launch is not None,
        )
        if config.pluginmanager.hasplugin("rerunfailures"):
            # its workers connect to the controller's 127.0.0.1 in their pytest_configure
            raise NodesError(
                f"{spec_.OPTION}: pytest-rerunfailures is active: its xdist workers connect to the controller "
                "at 127.0.0.1, which a worker on another node cannot reach; run with -p no:rerunfailures"
            )
        if config.getoption("collectonly", False):
            return None  # xdist starts no worker to collect only
        made: list[str] = []

        def sim_root() -> str:
            made.append(tempfile.mkdtemp(prefix="pytest-gpu-nodes-"))
            return made[-1]

        plan = spec_.resolve(form, os.environ, _hostnames, sim_root=sim_root, unshare=unshare_works())
        for env in plan.env.values():  # each simulated node's own directories
            for name in ("PYTEST_GPU_MACHINE_DIR", "TMPDIR"):
                os.makedirs(env[name], mode=0o700, exist_ok=True)
        python, cwd = sys.executable, os.getcwd()
        gate = f"{python} -m pytest_gpu.nodes.sshgate"
        specs = {node: spec_.tx_spec(plan, node, python, cwd, gate) for node in plan.names}
    except NodesError as exc:
        raise pytest.UsageError(str(exc)) from None

    def cleanup() -> None:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)

    hosts = NodeHosts(plan, settings, specs, cleanup)
    try:
        hosts.start()
        if not hosts.up:
            raise pytest.UsageError(
                f"{spec_.OPTION}: no node could start: " + "; ".join(str(h.error) for h in hosts.hosts.values())
            )
    except BaseException:
        hosts.close()
        raise
    config.add_cleanup(hosts.close)  # after xdist ended the workers (at the session's finish)
    up = spec_.NodePlan(plan.kind, tuple(hosts.up), plan.sim_root, plan.unshare, plan.env)
    pids = {node: int(hosts.hosts[node].info["pid"]) for node in up.names}
    try:
        config.option.tx = spec_.tx_specs(up, per_node, python, cwd, gate, pids)
    except NodesError as exc:
        raise pytest.UsageError(str(exc)) from None
    config.stash[NODES_KEY] = hosts
    return hosts


def node_of(worker: Any) -> str | None:
    """The node an xdist ``WorkerController`` runs on (its spec's ``env:PYTEST_GPU_NODE``)."""
    return spec_.node_of_spec(privates.worker_env(worker))


def raise_reported(hosts: NodeHosts, worker: Any) -> None:
    """As ``worker``'s collection comes in: raise what it found for ``--gpu-required`` (its
    node's host reads it where the worker wrote it, in that node's run directory)."""
    message = hosts.state(hosts.node_of(worker), privates.worker_id(worker)).get("required")
    if message:
        raise pytest.UsageError(str(message))


def guard_replacements(config: pytest.Config, hosts: NodeHosts) -> None:
    """Do not replace a crashed worker of a lost node.

    xdist replaces a crashed worker with a new one from the same spec; on a lost node its
    launcher cannot start one and xdist ends the whole run with an INTERNALERROR. By then
    xdist has reported the worker's running test crashed and returned its queued tests to
    the others; so a worker whose node's host is gone is not replaced, xdist's "replacing
    crashed worker" line says so instead, and the run goes on with the other nodes (see
    :func:`pytest_gpu.base.privates.refuse_replacements`; where xdist lacks what that wraps,
    xdist's own behaviour stays)."""

    def refusal(worker: Any) -> str | None:
        node = node_of(worker)
        if node is None or node not in hosts.hosts or hosts.alive(node):
            return None
        return f"pytest-gpu: node {node} lost ({hosts.hosts[node].lost}): {privates.worker_id(worker)} not replaced"

    privates.refuse_replacements(config, refusal)


def workerinput(hosts: NodeHosts, worker: Any) -> dict[str, Any]:
    """What a new worker's ``workerinput`` carries of its node: its node's run, the node it
    was started on, and every node's inventory."""
    node = hosts.node_of(worker)
    assert node in hosts.hosts, f"worker {privates.worker_id(worker)} has no node of this run"
    return {
        WIRE_KEY: hosts.wire(node),
        NODE_KEY: node,
        # a test too large for this node but not for another is left to the other's workers
        INVENTORIES_KEY: {name: hosts.wire(name)["inventory"] for name in hosts.up},
    }
