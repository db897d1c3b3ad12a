"""``--gpu-nodes``: which nodes a run spans and how a process is started on each (pure).

Forms (see docs-incoming/nodes-design.md):

    slurm          every node of the SLURM allocation this pytest runs in; a process is
                   started on node X with ``srun --overlap --nodes=1 --ntasks=1 --nodelist=X``
    ssh:h1,h2      the hosts named; a process is started through the SSH shim
                   (:mod:`pytest_gpu.nodes.sshgate`), which quotes execnet's bootstrap for ssh
    local:N        N nodes simulated on this machine (tests, benchmarks): each its own
                   machine directory (so its own simulated GPUs and arbiter) and temp directory

Every node's processes are execnet ``popen`` gateways whose ``python`` is the launch
prefix and the interpreter: xdist sends a popen worker the controller's ``sys.path`` and
argument paths (right on the shared filesystem node mode requires) and rsyncs nothing,
whereas an ``ssh=`` spec would have xdist rsync pytest's own packages to the host.
The node's name travels as ``env:PYTEST_GPU_NODE=<name>`` in the spec (execnet applies it
through the channel, before xdist's worker code runs); no secret is ever in a spec.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

NODE_ENV = "PYTEST_GPU_NODE"  # in a node's processes: the node's name
# tests: in the controller's environment, a directory: each node of ``slurm`` or ``ssh:`` is
# then simulated on this machine as ``local:N`` nodes are (its own machine and temp directories)
SIM_NODES_ENV = "PYTEST_GPU_SIM_NODES"
# simulated nodes of different GPUs: ``node0=sim:2x16GiB;node1=sim:1x40GiB`` (each listed node
# sees that fake machine: PYTEST_GPU_FAKE_GPUS in its processes; run with --gpus all)
SIM_NODE_GPUS_ENV = "PYTEST_GPU_SIM_NODE_GPUS"
NODE_KEY = "pytest_gpu_node"  # workerinput: the node the controller started the worker on
INVENTORIES_KEY = "pytest_gpu_node_inventories"  # workerinput: every started node's inventory (wire form)
FORMS = "slurm, ssh:HOST[,HOST...] or local:N"
OPTION = "--gpu-nodes"

_HOST = re.compile(r"[A-Za-z0-9_.@:\[\]-]+")  # user@host, IPv6 in brackets; no spaces, quotes or slashes


class NodesError(ValueError):
    """A ``--gpu-nodes`` value, or the run around it, that node mode cannot use."""


@dataclass(frozen=True)
class NodeForm:
    """A parsed ``--gpu-nodes`` value: ``kind`` is ``slurm``, ``ssh`` or ``local``."""

    kind: str
    hosts: tuple[str, ...] = ()  # ssh: the hosts given
    count: int = 0  # local: how many nodes


@dataclass(frozen=True)
class NodePlan:
    """The nodes of a run and how a process is started on each (:func:`resolve`)."""

    kind: str
    names: tuple[str, ...]
    # simulated nodes: the directory their machine and temp directories are made in
    sim_root: str | None = None
    unshare: bool = False  # simulated nodes: each node in its own network namespace
    env: Mapping[str, Mapping[str, str]] = field(default_factory=dict)  # per node, filled by node_env


def parse(value: str) -> NodeForm:
    """``--gpu-nodes``'s value, checked; :class:`NodesError` names the option and the forms."""
    text = value.strip()
    kind, sep, rest = text.partition(":")
    kind = kind.strip().lower()
    if kind == "slurm" and not sep:
        return NodeForm("slurm")
    if kind == "ssh" and sep:
        hosts = tuple(h.strip() for h in rest.split(","))
        if not rest.strip() or any(not h for h in hosts):
            raise NodesError(f"{OPTION}={value}: an empty host name; expected ssh:HOST[,HOST...]")
        for host in hosts:
            if host.startswith("-") or not _HOST.fullmatch(host):
                raise NodesError(
                    f"{OPTION}={value}: {host!r} is not a host name (letters, digits, '.', '-', '_', "
                    "'@' and ':' only, not starting with '-')"
                )
        dup = sorted({h for h in hosts if hosts.count(h) > 1})
        if dup:
            raise NodesError(f"{OPTION}={value}: {', '.join(dup)} given twice; each node once")
        return NodeForm("ssh", hosts=hosts)
    if kind == "local" and sep:
        count = rest.strip()
        if not count.isdigit() or int(count) < 1:
            raise NodesError(f"{OPTION}={value}: expected local:N with N a whole number of nodes, at least 1")
        return NodeForm("local", count=int(count))
    raise NodesError(f"{OPTION}={value}: expected {FORMS}")


def slurm_nodes(env: Mapping[str, str], hostnames: Callable[[str], list[str]]) -> tuple[str, ...]:
    """The nodes of the SLURM allocation this process runs in. ``hostnames`` expands a
    node list (``scontrol show hostnames``); :class:`NodesError` outside an allocation."""
    nodelist = env.get("SLURM_JOB_NODELIST", "").strip() or env.get("SLURM_NODELIST", "").strip()
    if not nodelist:
        raise NodesError(
            f"{OPTION}=slurm: not inside a SLURM allocation (no SLURM_JOB_NODELIST); "
            "run pytest from salloc or an sbatch script, or name hosts with ssh:HOST,..."
        )
    names = tuple(n.strip() for n in hostnames(nodelist) if n.strip())
    if not names:
        raise NodesError(f"{OPTION}=slurm: SLURM_JOB_NODELIST={nodelist} names no node")
    return names


def check_xdist(*, numprocesses: object, tx: Sequence[str], dist: str, user_dist: bool, launched: bool) -> int:
    """The workers per node, from ``-n``; :class:`NodesError` where the rest of the command
    line contradicts node mode. ``tx``: ``--tx`` as the user gave it (before xdist's ``-n``
    turns into popen specs); ``user_dist``: ``--dist`` was given; ``launched``: this pytest
    is a rank of srun, mpirun or torchrun."""
    if launched:
        raise NodesError(
            f"{OPTION}: this pytest is a rank of a launcher (srun, mpirun, torchrun); start one pytest "
            "(inside the allocation) and it starts the workers on every node; --shard is the mode for "
            "one pytest per node"
        )
    if tx:
        raise NodesError(f"{OPTION}: --tx given too; node mode makes the workers' specs itself (-n N per node)")
    if numprocesses in ("auto", "logical"):
        raise NodesError(f"{OPTION}: -n {numprocesses} is not supported yet; give the workers per node: -n N")
    if not isinstance(numprocesses, int) or numprocesses < 1:
        raise NodesError(f"{OPTION}: needs -n N (N >= 1): the xdist workers to start on each node")
    if user_dist and dist != "load":
        raise NodesError(f"{OPTION}: --dist {dist}: node mode places tests itself; leave --dist out")
    return numprocesses


def resolve(
    form: NodeForm,
    env: Mapping[str, str],
    hostnames: Callable[[str], list[str]],
    *,
    sim_root: Callable[[], str] | None = None,
    unshare: bool = False,
) -> NodePlan:
    """The run's nodes: ``slurm``'s from the allocation, ``ssh``'s as given, ``local:N``'s
    ``node0``.. ``node{N-1}``. Simulated (``local``, or any form with ``$PYTEST_GPU_SIM_NODES``):
    each node gets :func:`sim_node_env` under ``sim_root()`` (``$PYTEST_GPU_SIM_NODES`` wins)."""
    if form.kind == "slurm":
        names = slurm_nodes(env, hostnames)
    elif form.kind == "ssh":
        names = form.hosts
    else:
        names = tuple(f"node{i}" for i in range(form.count))
    root = env.get(SIM_NODES_ENV, "").strip() or None
    if root is None and form.kind == "local":
        assert sim_root is not None, "local nodes are simulated: a directory for them is needed"
        root = sim_root()
    if root is None:
        return NodePlan(form.kind, names)
    check_spec_value(root, SIM_NODES_ENV)
    envs = {n: sim_node_env(root, n) for n in names}
    for node, gpus in sim_node_gpus(env.get(SIM_NODE_GPUS_ENV, ""), names).items():
        envs[node]["PYTEST_GPU_FAKE_GPUS"] = gpus
    return NodePlan(form.kind, names, root, unshare, envs)


def sim_node_gpus(value: str, names: Sequence[str]) -> dict[str, str]:
    """``$PYTEST_GPU_SIM_NODE_GPUS`` (``node=spec;node=spec``): the fake GPUs of each node named."""
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in value.split(";"))):
        node, eq, gpus = part.partition("=")
        if not eq or node.strip() not in names or not gpus.strip():
            raise NodesError(
                f"{OPTION}: {SIM_NODE_GPUS_ENV}: expected node=spec for nodes of {', '.join(names)}; got {part!r}"
            )
        check_spec_value(gpus.strip(), SIM_NODE_GPUS_ENV)
        out[node.strip()] = gpus.strip()
    return out


def sim_node_env(root: str, name: str) -> dict[str, str]:
    """What makes a simulated node on this machine: its name, its own machine directory
    (its own domains, simulated machines and arbiter sockets, see
    :mod:`pytest_gpu.machine.domain`) and its own temp directory (run directory, basetemp)."""
    base = f"{root.rstrip('/')}/{name}"
    return {NODE_ENV: name, "PYTEST_GPU_MACHINE_DIR": f"{base}/machines", "TMPDIR": f"{base}/tmp"}


def launch_prefix(
    plan: NodePlan, node: str, python: str, cwd: str, sshgate: str, host_pid: int | None = None
) -> list[str]:
    """The command that starts ``python`` on ``node`` (execnet appends ``-u -c <bootstrap>``).

    ``sshgate``: how to run the SSH shim locally (``<python> -m pytest_gpu.nodes.sshgate``).
    ``host_pid``: a simulated node's host, whose network namespace the node's workers join
    (the host itself makes it: ``None``)."""
    if plan.kind == "slurm":
        prefix = [
            "srun",
            "--overlap",
            "--nodes=1",
            "--ntasks=1",
            f"--nodelist={node}",
            "--kill-on-bad-exit=1",
            "--unbuffered",  # srun line-buffers a task's output by default: execnet's frames end in no newline
            "--quiet",
            python,
        ]
    elif plan.kind == "ssh":
        prefix = [*shlex.split(sshgate), node, cwd, python]
    else:
        prefix = [python]
    if plan.unshare and plan.kind == "local":
        if host_pid is None:
            # the node's host makes the node's network namespace, with its own loopback up (a
            # node has one: tests bind 127.0.0.1) and no way to the others' (abstract Unix
            # sockets are per namespace too); it goes when the host's processes are all gone
            prefix = ["unshare", "-n", "sh", "-c", _LOOPBACK_UP, *prefix]
        else:  # the node's workers join it: when the host is gone, so is the node
            prefix = ["nsenter", f"--net=/proc/{host_pid}/ns/net", *prefix]
    return prefix


_LOOPBACK_UP = 'ip link set lo up && exec "$0" "$@"'


def tx_spec(plan: NodePlan, node: str, python: str, cwd: str, sshgate: str, host_pid: int | None = None) -> str:
    """The execnet spec of one process on ``node``: a popen gateway whose python is the
    launch prefix, and the node's environment as ``env:`` keys (``host_pid``: see
    :func:`launch_prefix`)."""
    words = launch_prefix(plan, node, python, cwd, sshgate, host_pid)
    for word in words:
        if "//" in word:  # execnet splits the spec on "//" (and python= with shlex: quoting is kept)
            raise NodesError(f"{OPTION}: cannot start a process on {node}: {word!r} contains '//'")
    parts = ["popen", "python=" + shlex.join(words)]
    env = {NODE_ENV: node, **plan.env.get(node, {})}
    for name, value in env.items():
        check_spec_value(value, name)
        parts.append(f"env:{name}={value}")
    return "//".join(parts)


def check_spec_value(value: str, what: str) -> None:
    """A value execnet's spec can carry (no ``//``, which separates its keys)."""
    if "//" in value:
        raise NodesError(f"{OPTION}: {what}={value!r} contains '//', which an execnet spec cannot carry")


def tx_specs(
    plan: NodePlan, per_node: int, python: str, cwd: str, sshgate: str, host_pids: Mapping[str, int] | None = None
) -> list[str]:
    """xdist's ``--tx`` list: ``per_node`` workers on every node, node by node (gw0.. on the
    first); ``host_pids``: the nodes' hosts (simulated nodes' workers join their namespace)."""
    pids = host_pids or {}
    return [tx_spec(plan, node, python, cwd, sshgate, pids.get(node)) for node in plan.names for _ in range(per_node)]


def node_of_spec(env: Mapping[str, str]) -> str | None:
    """The node a gateway was started on, from its spec's ``env:`` keys (``XSpec.env``)."""
    return env.get(NODE_ENV)
