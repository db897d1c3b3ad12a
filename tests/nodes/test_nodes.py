"""--gpu-nodes (issue 22): the option, the workers' specs, and runs over simulated nodes.

The end-to-end runs start every node on this machine: ``local:2`` (each node its own
machine directory, so its own simulated GPUs and arbiter, its own temp directory and,
where ``unshare -n`` works, its own network namespace), and ``ssh:`` through the SSH shim
with a stand-in ``ssh`` that runs the remote command here (there is no sshd to test with).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from xml.etree import ElementTree

import execnet
import psutil
import pytest
from execnet.gateway_io import popen_args

from conftest import INNER_ARGS, MISSING, require
from helpers import TESTS, patience
from pytest_gpu.nodes import messages, spec, sshgate
from pytest_gpu.nodes import worker as node_worker
from pytest_gpu.nodes.hosts import unshare_works
from pytest_gpu.nodes.spec import NodesError
from pytest_gpu.wire.frames import WireError

NO_NETNS = f"{MISSING}: a network namespace per simulated node (unshare -n and ip: util-linux, iproute2, root)"

# -- the option (pure) -----------------------------------------------------------------


def test_forms_parse() -> None:
    assert spec.parse("slurm") == spec.NodeForm("slurm")
    assert spec.parse(" SLURM ") == spec.NodeForm("slurm")
    assert spec.parse("ssh:a, b.example.org,user@c") == spec.NodeForm("ssh", hosts=("a", "b.example.org", "user@c"))
    assert spec.parse("local:3") == spec.NodeForm("local", count=3)


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("", "expected slurm, ssh:HOST[,HOST...] or local:N"),
        ("pbs", "expected slurm, ssh:HOST[,HOST...] or local:N"),
        ("slurm:a", "expected slurm"),
        ("ssh", "expected slurm"),
        ("ssh:", "an empty host name"),
        ("ssh:a,,b", "an empty host name"),
        ("ssh:a,a", "a given twice"),
        ("ssh:-oProxyCommand=x", "is not a host name"),
        ("ssh:a b", "is not a host name"),
        ("ssh:a/b", "is not a host name"),
        ("local:0", "local:N with N a whole number"),
        ("local:x", "local:N with N a whole number"),
        ("local:", "local:N with N a whole number"),
    ],
)
def test_bad_forms_are_named(value: str, said: str) -> None:
    with pytest.raises(NodesError, match="--gpu-nodes") as info:
        spec.parse(value)
    assert said in str(info.value)


def test_slurm_outside_an_allocation_is_refused() -> None:
    with pytest.raises(NodesError, match="not inside a SLURM allocation"):
        spec.slurm_nodes({}, lambda text: [text])
    assert spec.slurm_nodes({"SLURM_JOB_NODELIST": "n[1-2]"}, lambda text: ["n1", "n2"]) == ("n1", "n2")
    with pytest.raises(NodesError, match="names no node"):
        spec.slurm_nodes({"SLURM_JOB_NODELIST": "n[1-2]"}, lambda text: [])


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"launched": True}, "rank of a launcher"),
        ({"tx": ["popen"]}, "--tx given too"),
        ({"numprocesses": None}, "needs -n N"),
        ({"numprocesses": 0}, "needs -n N"),
        ({"numprocesses": "auto"}, "-n auto is not supported yet"),
        ({"dist": "loadfile", "user_dist": True}, "--dist loadfile"),
    ],
)
def test_xdist_options_that_contradict_node_mode(kwargs: dict[str, Any], said: str) -> None:
    given: dict[str, Any] = {"numprocesses": 2, "tx": [], "dist": "load", "user_dist": False, "launched": False}
    with pytest.raises(NodesError, match="--gpu-nodes") as info:
        spec.check_xdist(**{**given, **kwargs})
    assert said in str(info.value)
    assert spec.check_xdist(**given) == 2
    assert spec.check_xdist(**{**given, "dist": "load", "user_dist": True}) == 2


def test_slurm_specs_start_each_node_through_srun() -> None:
    plan = spec.resolve(spec.parse("slurm"), {"SLURM_JOB_NODELIST": "n[1-2]"}, lambda text: ["n1", "n2"])
    specs = spec.tx_specs(plan, 2, "/opt/py/bin/python", "/work", "unused")
    assert len(specs) == 4
    parsed = [execnet.XSpec(s) for s in specs]
    assert [p.env for p in parsed] == [{spec.NODE_ENV: n} for n in ("n1", "n1", "n2", "n2")]
    assert all(p.popen for p in parsed)  # popen: xdist rsyncs nothing, keeps the shared paths
    args = popen_args(parsed[2])
    assert args[: args.index("/opt/py/bin/python") + 1] == [
        "srun",
        "--overlap",
        "--nodes=1",
        "--ntasks=1",
        "--nodelist=n2",
        "--kill-on-bad-exit=1",
        "--unbuffered",
        "--quiet",
        "/opt/py/bin/python",
    ]


def test_simulated_nodes_have_their_own_directories_and_namespace() -> None:
    plan = spec.resolve(spec.parse("local:2"), {}, lambda text: [], sim_root=lambda: "/r oot", unshare=True)
    assert plan.names == ("node0", "node1")
    parsed = execnet.XSpec(spec.tx_spec(plan, "node1", "/usr/bin/python3", "/w", "unused"))
    assert parsed.env == {
        spec.NODE_ENV: "node1",
        "PYTEST_GPU_MACHINE_DIR": "/r oot/node1/machines",
        "TMPDIR": "/r oot/node1/tmp",
    }
    args = popen_args(parsed)
    assert args[:5] == ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$0" "$@"']  # the node's host
    assert args[5] == "/usr/bin/python3"
    # the node's workers join its host's namespace: one per node, gone with the node
    workers = spec.tx_specs(plan, 2, "/usr/bin/python3", "/w", "unused", {"node0": 11, "node1": 12})
    assert [popen_args(execnet.XSpec(w))[:3] for w in workers] == [
        ["nsenter", f"--net=/proc/{pid}/ns/net", "/usr/bin/python3"] for pid in (11, 11, 12, 12)
    ]
    # $PYTEST_GPU_SIM_NODES simulates any form's nodes (tests of slurm and ssh on one machine)
    plan = spec.resolve(spec.parse("ssh:a,b"), {spec.SIM_NODES_ENV: "/s"}, lambda text: [])
    assert plan.env["b"]["PYTEST_GPU_MACHINE_DIR"] == "/s/b/machines"
    assert not spec.resolve(spec.parse("ssh:a,b"), {}, lambda text: []).env


def test_a_value_execnet_cannot_carry_is_refused() -> None:
    with pytest.raises(NodesError, match="PYTEST_GPU_SIM_NODES='/a//b' contains '//'"):
        spec.resolve(spec.parse("local:1"), {spec.SIM_NODES_ENV: "/a//b"}, lambda text: [])
    plan = spec.resolve(spec.parse("local:1"), {}, lambda text: [], sim_root=lambda: "/a")
    with pytest.raises(NodesError, match="cannot start a process on node0: '/opt//python' contains '//'"):
        spec.tx_spec(plan, "node0", "/opt//python", "/w", "unused")


# -- the SSH shim ------------------------------------------------------------------------


def test_ssh_shim_quotes_the_bootstrap_for_the_remote_shell(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import sys;print(repr(sys.argv[1:]));print(open('here').read())", "a b", "'$x;"]
    (tmp_path / "here").write_text("in the cwd")
    cmd = sshgate.command("host1", str(tmp_path), argv, ssh="ssh")
    assert cmd[:7] == ["ssh", "-T", "-o", "BatchMode=yes", "-o", "ConnectTimeout=30", "host1"]
    # what ssh would hand the remote shell: run it with a shell here
    out = subprocess.run(["sh", "-c", cmd[7]], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == [repr(["a b", "'$x;"]), "in the cwd"]


# -- a worker's node -----------------------------------------------------------------------


def test_a_worker_on_the_wrong_node_stops(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # gettempdir() reads TMPDIR again
    inputs = {spec.NODE_KEY: "n2", "testrunuid": "abcdef0123456789", "workerid": "gw3"}
    config = SimpleNamespace(workerinput=inputs, option=SimpleNamespace(basetemp="/elsewhere/popen-gw3"))
    monkeypatch.setenv(spec.NODE_ENV, "n1")
    with pytest.raises(pytest.UsageError, match="started for node n2 but runs where PYTEST_GPU_NODE='n1'"):
        node_worker.setup(config)  # type: ignore[arg-type]
    monkeypatch.setenv(spec.NODE_ENV, "n2")
    node_worker.setup(config)  # type: ignore[arg-type]
    assert config.option.basetemp == str(tmp_path / "pytest-gpu-nodes-abcdef012345" / "gw3")
    assert (tmp_path / "pytest-gpu-nodes-abcdef012345").stat().st_mode & 0o777 == 0o700
    assert node_worker.node(config) == "n2"  # type: ignore[arg-type]
    # not a node worker: nothing changes
    plain = SimpleNamespace(workerinput={"workerid": "gw0"}, option=SimpleNamespace(basetemp="/x"))
    node_worker.setup(plain)  # type: ignore[arg-type]
    assert plain.option.basetemp == "/x"


def test_a_worker_refuses_a_link_for_its_temp_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The node's temp directory is shared: a link planted where the worker's basetemp parent
    goes (another user's directory, say) is refused, not followed."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "pytest-gpu-nodes-abcdef012345").symlink_to(elsewhere)
    inputs = {spec.NODE_KEY: "n2", "testrunuid": "abcdef0123456789", "workerid": "gw3"}
    config = SimpleNamespace(workerinput=inputs, option=SimpleNamespace(basetemp="/elsewhere/popen-gw3"))
    monkeypatch.setenv(spec.NODE_ENV, "n2")
    with pytest.raises(pytest.UsageError, match=r"--gpu-nodes: this worker's temp directory on node n2: .*link"):
        node_worker.setup(config)  # type: ignore[arg-type]
    assert config.option.basetemp == "/elsewhere/popen-gw3"


# -- runs ------------------------------------------------------------------------------------

SUITE = """
import json, os, tempfile
import pytest

@pytest.mark.parametrize("i", range(6))
@pytest.mark.gpu(memory="4GiB")
def test_where(i, gpu, tmp_path):
    rec = {
        "node": os.environ.get("PYTEST_GPU_NODE"),
        "ledger": os.environ.get("PYTEST_GPU_SIM_LEDGER"),
        "tmp": str(tmp_path),
        "tempdir": tempfile.gettempdir(),
        "netns": os.readlink("/proc/self/ns/net"),
        "worker": os.environ.get("PYTEST_XDIST_WORKER"),
        "gpus": len(gpu.indices),
    }
    with open(os.path.join(os.environ["NODES_OUT"], f"{i}.json"), "w") as f:
        json.dump(rec, f)
"""

NODE_ARGS = ("-p", "no:rerunfailures", "--gpus", "sim:2x16GiB")


@pytest.fixture
def nodes_run(
    run_inner: Callable[..., pytest.RunResult], gpu_pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> Callable[..., tuple[pytest.RunResult, list[dict[str, Any]]]]:
    """``nodes_run(*args)``: the six-test suite in its own process; its result and what each test saw."""
    out = gpu_pytester.path / "out"
    out.mkdir()
    monkeypatch.setenv("NODES_OUT", str(out))
    gpu_pytester.makepyfile(test_where=SUITE)

    def run(*args: str) -> tuple[pytest.RunResult, list[dict[str, Any]]]:
        result = run_inner(*NODE_ARGS, *args, subprocess=True, timeout=180)
        return result, [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]

    return run


def _left_in(cwd: Path) -> list[str]:
    """Processes still running in ``cwd`` (a run's node hosts, workers and launchers work there)."""
    left = []
    for proc in psutil.process_iter(["cwd", "cmdline", "status"]):
        if proc.pid == os.getpid() or proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue  # this test is there too (pytester's chdir)
        if proc.info["cwd"] == str(cwd):
            left.append(f"{proc.pid}: {' '.join(proc.info['cmdline'] or ())}")
    return left


def _sim_roots_left() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("pytest-gpu-nodes-*")}


@pytest.mark.slow
def test_two_simulated_nodes_each_lease_their_own_gpus(
    nodes_run: Callable[..., tuple[pytest.RunResult, list[dict[str, Any]]]],
) -> None:
    before = _sim_roots_left()
    result, seen = nodes_run("-n", "2", "--gpu-nodes=local:2", "--junitxml=report.xml", "--gpu-trace=trace.json")
    result.assert_outcomes(passed=6)
    # one junitxml, every test in it once, each testcase naming the node it ran on
    cases = list(ElementTree.parse(Path.cwd() / "report.xml").getroot().iter("testcase"))
    assert len(cases) == 6
    nodes = {c.get("name"): [p.get("value") for p in c.iter("property") if p.get("name") == "gpu_node"] for c in cases}
    assert len(nodes) == 6 and all(len(v) == 1 for v in nodes.values()), nodes
    assert sorted(v[0] for v in nodes.values()) == sorted(r["node"] for r in seen)
    assert {r["node"] for r in seen} == {"node0", "node1"}  # every node ran tests
    for rec in seen:
        node = rec["node"]
        # the node's own simulated machine (its ledger in its machine directory) and temp directory
        assert f"/{node}/machines/" in rec["ledger"], rec
        assert rec["tempdir"].endswith(f"/{node}/tmp"), rec
        assert rec["tmp"].startswith(rec["tempdir"] + "/pytest-gpu-nodes-"), rec
        assert rec["gpus"] == 1
    ledgers = {r["node"]: r["ledger"] for r in seen}
    assert ledgers["node0"] != ledgers["node1"]
    lines = result.stdout.lines
    assert any(line.startswith("pytest-gpu: node node0 (") and "2 simulated GPUs (2x16GiB)" in line for line in lines)
    assert any(line.startswith("pytest-gpu: node node1 (") and "granted" in line for line in lines)
    # each node's line: what ran there (tests, their busy time, waits, its GPUs' busy share)
    ran = {}
    for line in lines:
        pattern = r"pytest-gpu: node (node\d) \(.*· (\d+) tests? · busy \S+ · waited \S+ for GPUs · GPU busy 0:"
        found = re.match(pattern, line)
        if found:
            ran[found.group(1)] = int(found.group(2))
    assert ran == {n: sum(r["node"] == n for r in seen) for n in ("node0", "node1")}, lines
    # one trace: a track group per node (its workers, its GPUs), every test once, on its node's workers
    trace = json.loads((Path.cwd() / "trace.json").read_text())
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    groups = {g["name"]: g for g in trace["otherData"]["pytest_gpu"]["nodes"]}
    assert set(groups) == {"node0", "node1"}
    for name, group in groups.items():
        assert names[group["workers_pid"]] == f"node {name}: workers"
        assert [names[g["pid"]] for g in group["gpus"]] == [f"node {name}: GPU {i} (16GiB)" for i in (0, 1)]
    spans = [e for e in trace["traceEvents"] if e.get("cat") == "test"]
    assert sorted(e["args"]["nodeid"] for e in spans) == sorted(f"test_where.py::test_where[{i}]" for i in range(6))
    assert all(e["pid"] == groups[e["args"]["node"]]["workers_pid"] for e in spans)
    leases = [e for e in trace["traceEvents"] if e.get("cat") == "lease"]
    assert len(leases) == 6 and all(e["pid"] >= 10000 for e in leases)
    from pytest_gpu.report import gantt

    assert len(gantt.build_chart(trace).tests) == 6  # pytest-gpu report draws it
    # the run's line counts the nodes' GPUs, not the controller's (it leases none)
    assert any(line.startswith("pytest-gpu: 2 nodes (their GPUs above) · 6 GPU tests · ") for line in lines)
    assert "--gpus none" not in result.stdout.str()
    assert _sim_roots_left() <= before  # the simulated nodes' directories went with the run
    assert not _left_in(Path.cwd())  # pytester's directory: the run's processes worked there
    if not unshare_works():  # said last: everything above holds without namespaces too
        pytest.skip(NO_NETNS)
    # each node its own network namespace (all its workers in it), not this one's
    spaces = {r["node"]: r["netns"] for r in seen}
    assert spaces["node0"] != spaces["node1"]
    assert os.readlink("/proc/self/ns/net") not in spaces.values()
    assert all(r["netns"] == spaces[r["node"]] for r in seen)
    assert len({r["worker"] for r in seen}) > 2  # workers of one node shared it (not a given: load scheduling)


@pytest.mark.slow
def test_ssh_nodes_through_the_shim(
    nodes_run: Callable[..., tuple[pytest.RunResult, list[dict[str, Any]]]],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    """Through ``ssh``'s command line: a stand-in ``ssh`` runs the remote command with a shell
    here, and refuses host ``down`` as ssh does a host it cannot reach (exit 255): that node is
    reported and left out, the run goes on on the others."""
    fake = tmp_path / "ssh"
    fake.write_text(
        textwrap.dedent(
            """\
            #!/bin/sh
            # the options the shim gives, then the host, then the remote command
            while [ "$1" = "-T" ] || [ "$1" = "-o" ]; do [ "$1" = "-o" ] && shift; shift; done
            host=$1; shift
            echo "$host" >> "$(dirname "$0")/hosts"
            [ "$host" = down ] && { echo "ssh: connect to host down port 22: No route to host" >&2; exit 255; }
            exec sh -c "$1"
            """
        )
    )
    fake.chmod(0o755)
    monkeypatch.setenv(sshgate.SSH_ENV, shlex.quote(str(fake)))
    # short: a node's arbiter socket lives below it (AF_UNIX paths end at 107 bytes)
    root = Path(tempfile.mkdtemp(prefix="pgn-"))
    request.addfinalizer(lambda: shutil.rmtree(root, ignore_errors=True))
    monkeypatch.setenv(spec.SIM_NODES_ENV, str(root / "nodes"))
    result, seen = nodes_run("-n", "2", "--gpu-nodes=ssh:alpha,down,beta")
    result.assert_outcomes(passed=6)
    assert {r["node"] for r in seen} <= {"alpha", "beta"} and seen
    assert all(f"/nodes/{r['node']}/machines/" in r["ledger"] for r in seen)
    assert set((tmp_path / "hosts").read_text().split()) == {"alpha", "down", "beta"}
    result.stdout.fnmatch_lines(["pytest-gpu: node down: *left out of this run"])
    assert not _left_in(Path.cwd())
    assert any(line.startswith("pytest-gpu: node alpha (") for line in result.stdout.lines)


def test_usage_errors_name_the_option(
    run_inner: Callable[..., pytest.RunResult], gpu_pytester: pytest.Pytester
) -> None:
    gpu_pytester.makepyfile(test_a="def test_a(): pass")
    cases = [
        (("-n", "1", "--gpu-nodes=pbs"), "--gpu-nodes=pbs: expected slurm, ssh:HOST[,HOST...] or local:N"),
        (("-n", "1", "--gpu-nodes=slurm"), "--gpu-nodes=slurm: not inside a SLURM allocation"),
        (("--gpu-nodes=local:2",), "--gpu-nodes: needs -n N"),
        # as given: by the time node mode starts, xdist has turned it into this machine's count
        (("-n", "auto", "--gpu-nodes=local:2"), "--gpu-nodes: -n auto is not supported yet"),
        (("-n", "logical", "--gpu-nodes=local:2"), "--gpu-nodes: -n logical is not supported yet"),
        (("-n", "1", "--dist", "loadfile", "--gpu-nodes=local:2"), "--gpu-nodes: --dist loadfile"),
        (("-n", "1", "--tx", "popen", "--gpu-nodes=local:2"), "--gpu-nodes: --tx given too"),
    ]
    if importlib.util.find_spec("pytest_rerunfailures") is not None:
        cases.append((("-n", "1", "--gpu-nodes=local:2"), "--gpu-nodes: pytest-rerunfailures is active"))
    for args, said in cases:
        extra = () if "rerunfailures" in said else ("-p", "no:rerunfailures")
        result = run_inner(*extra, *args)
        assert result.ret == pytest.ExitCode.USAGE_ERROR, (args, result.stdout.str(), result.stderr.str())
        assert said in result.stderr.str(), (args, result.stderr.str())


# -- through SLURM: two nodes of a cluster on this machine ---------------------------------

SLURM_NODES_SCRIPT = TESTS / "tools" / "slurm-nodes.sh"


@pytest.fixture(scope="module")
def slurm_nodes() -> Iterator[str]:
    """A two-node SLURM cluster on this machine (``tests/tools/slurm-nodes.sh``: nodes n1 and n2,
    2 fake GPUs each, its own ports beside the one-node cluster's); yields its SLURM_CONF."""
    require("SLURM", executable="slurmctld")
    require("SLURM", executable="srun")
    if os.geteuid() != 0:
        pytest.skip("a SLURM cluster on this machine needs root (munge, slurmd)")
    base = Path(tempfile.mkdtemp(prefix="pytest-gpu-slurm-nodes-"))
    base.chmod(0o755)  # munged runs as the munge user
    try:
        started = subprocess.run(
            ["bash", str(SLURM_NODES_SCRIPT), "start", str(base), "2", "2", "4"],
            capture_output=True,
            text=True,
            timeout=patience(90),
        )
        assert started.returncode == 0, f"SLURM did not start:\n{started.stdout}\n{started.stderr}"
        yield str(base / "slurm.conf")
    finally:
        daemons = []
        for path in base.glob("*.bgpid"):
            try:
                daemons.append(psutil.Process(int(path.read_text())))
            except (OSError, ValueError, psutil.Error):
                pass
        subprocess.run(["bash", str(SLURM_NODES_SCRIPT), "stop", str(base)], timeout=patience(60), check=False)
        _, alive = psutil.wait_procs(daemons, timeout=patience(10))
        for proc in alive:  # one that ignored SIGTERM
            proc.kill()
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.slow
def test_slurm_nodes_each_lease_their_own_gpus(
    slurm_nodes: str,
    gpu_pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    """``salloc -N 2 pytest -n 1 --gpu-nodes=slurm``: a node host and a worker on each node,
    started through ``srun --overlap``; each node simulated with its own directories."""
    monkeypatch.setenv("SLURM_CONF", slurm_nodes)
    root = Path(tempfile.mkdtemp(prefix="pgn-"))  # short: the nodes' arbiter sockets live below it
    request.addfinalizer(lambda: shutil.rmtree(root, ignore_errors=True))
    monkeypatch.setenv(spec.SIM_NODES_ENV, str(root))
    out = gpu_pytester.path / "out"
    out.mkdir()
    monkeypatch.setenv("NODES_OUT", str(out))
    gpu_pytester.makepyfile(test_where=SUITE)
    result = gpu_pytester.run(
        "salloc",
        "-N",
        "2",
        sys.executable,
        "-m",
        "pytest",
        *INNER_ARGS,
        *NODE_ARGS,
        "-n",
        "1",
        "--gpu-nodes=slurm",
        timeout=180,
    )
    assert result.ret == 0, result.stdout.str() + result.stderr.str()
    result.stdout.fnmatch_lines(
        [
            "pytest-gpu: node n1 (*): 2 simulated GPUs (2x16GiB), * granted · * tests · busy *",
            "pytest-gpu: node n2 (*): 2 simulated GPUs (2x16GiB), * granted · * tests · busy *",
        ]
    )
    seen = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    assert len(seen) == 6 and {r["node"] for r in seen} == {"n1", "n2"}
    for rec in seen:
        assert rec["ledger"].startswith(f"{root}/{rec['node']}/machines/"), rec
        assert rec["tempdir"] == f"{root}/{rec['node']}/tmp", rec
    assert not _left_in(gpu_pytester.path)


@pytest.mark.slow
def test_gpu_required_is_read_on_the_worker_s_node(
    run_inner: Callable[..., pytest.RunResult], gpu_pytester: pytest.Pytester
) -> None:
    """--gpu-required: a worker writes what it found in its node's run directory, which is not
    the controller's; the controller asks the node's host, and the run stops before any test."""
    gpu_pytester.makepyfile(
        test_suite="""
        import pytest

        @pytest.mark.gpu
        def test_needs_a_gpu():
            raise AssertionError("must not run")
        """
    )
    args = ("-p", "no:rerunfailures", "--gpus", "none", "--gpu-required", "-n", "1", "--gpu-nodes=local:2")
    result = run_inner(*args, subprocess=True, timeout=180)
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str() + result.stderr.str()
    result.stderr.fnmatch_lines(["ERROR: pytest-gpu: --gpu-required (ini gpu_required): this run has no GPUs*"])
    assert "must not run" not in result.stdout.str()
    assert not _left_in(Path.cwd())


LOSES_NODE1 = """
import os, signal, time
import pytest

@pytest.mark.parametrize("i", range(8))
@pytest.mark.gpu(memory="4GiB")
def test_t(i, gpu):
    if os.environ.get("PYTEST_GPU_NODE") == "node1" and i >= 2:
        # node1 is lost: every process in its network namespace (its host, its workers) killed
        me = os.readlink("/proc/self/ns/net")
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if int(pid) != os.getpid() and os.readlink(f"/proc/{pid}/ns/net") == me:
                    os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.3)
"""


@pytest.mark.slow
def test_a_node_lost_mid_run(run_inner: Callable[..., pytest.RunResult], gpu_pytester: pytest.Pytester) -> None:
    """Its running test is reported crashed with the node named (in junitxml too, as every
    test's node is), its queued tests go to the other node, no worker is started on it again
    (xdist would try, fail, and end the run with an INTERNALERROR), and the run finishes;
    xdist's "replacing crashed worker" is not said of that worker, ours says why not."""
    if not unshare_works():
        pytest.skip(NO_NETNS + " (a simulated node is lost by killing its namespace)")
    gpu_pytester.makepyfile(test_lost=LOSES_NODE1)
    args = (*NODE_ARGS, "-n", "1", "--gpu-nodes=local:2", "-rf", "--junitxml=report.xml")
    result = run_inner(*args, subprocess=True, timeout=180)
    out = result.stdout.str()
    assert "INTERNALERROR" not in out + result.stderr.str(), out
    result.assert_outcomes(passed=7, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*worker 'gw1' crashed while running 'test_lost.py::test_t[[]*[]]' on node node1",
            "pytest-gpu: node node0 (*): 2 simulated GPUs (2x16GiB), * leases granted · * tests · busy *",
            "pytest-gpu: node node1: lost during the run (*)",
        ]
    )
    assert "node node1 lost" in out and "gw1 not replaced" in out
    assert "replacing crashed worker gw1" not in out, out
    cases = list(ElementTree.parse(Path.cwd() / "report.xml").getroot().iter("testcase"))
    nodes = {c.get("name"): [p.get("value") for p in c.iter("property") if p.get("name") == "gpu_node"] for c in cases}
    crashed = [c.get("name") for c in cases if c.find("error") is not None]  # xdist reports it outside a phase
    assert len(cases) == 8 and len(crashed) == 1, nodes
    assert nodes[crashed[0]] == ["node1"], nodes
    assert all(len(v) == 1 for v in nodes.values()), nodes
    assert not _left_in(Path.cwd())


PLACED = """
import json, os, time
import pytest

@pytest.mark.parametrize("i", range(4))
@pytest.mark.gpu
def test_whole_gpu(i, gpu):
    time.sleep(1.0)
    rec = {"node": os.environ["PYTEST_GPU_NODE"], "waited": gpu.waited}
    with open(os.path.join(os.environ["NODES_OUT"], f"{i}.json"), "w") as f:
        json.dump(rec, f)
"""


@pytest.mark.slow
def test_the_scheduler_places_by_node(
    run_inner: Callable[..., pytest.RunResult], gpu_pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two nodes of one GPU, two workers each, four whole-GPU tests: the scheduler hands a
    worker a test only when its node's GPU is predicted free, so no test waits at its node's
    broker; with the scheduler off (xdist's load scheduling) two tests share a node and one waits."""
    out = gpu_pytester.path / "out"
    out.mkdir()
    monkeypatch.setenv("NODES_OUT", str(out))
    gpu_pytester.makepyfile(test_placed=PLACED)
    args = ("-p", "no:rerunfailures", "--gpus", "sim:1x16GiB", "-n", "2", "--gpu-nodes=local:2")
    waits = {}
    for schedule in ("on", "off"):
        for path in out.glob("*.json"):
            path.unlink()
        result = run_inner(*args, f"--gpu-schedule={schedule}", subprocess=True, timeout=180)
        result.assert_outcomes(passed=4)
        seen = [json.loads(p.read_text()) for p in out.glob("*.json")]
        assert {r["node"] for r in seen} == {"node0", "node1"}
        waits[schedule] = max(r["waited"] for r in seen)
    assert waits["on"] < 0.5, waits
    assert waits["off"] > 0.5, waits  # the same run, placed without regard to nodes, waits


SLEEPS = """
import os, time
import pytest

@pytest.mark.parametrize("i", range(4))
@pytest.mark.gpu(memory="4GiB")
def test_sleeps(i, gpu):
    open(os.path.join(os.environ["NODES_OUT"], f"{os.environ['PYTEST_GPU_NODE']}-{i}"), "w").close()
    time.sleep(60)
"""


@pytest.mark.slow
def test_ctrl_c_leaves_nothing_running_on_any_node(
    gpu_pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGINT to the controller while tests run on both nodes: the run ends, and nothing of
    it is left: no node host, worker or launcher (each node host ends its run when its channel
    goes), no run directory (the controller's, or a node's: its simulated node's directory,
    where its run directory, machine directory and arbiter were, goes too), so no lease."""
    out = gpu_pytester.path / "out"
    out.mkdir()
    monkeypatch.setenv("NODES_OUT", str(out))
    tmp = Path(tempfile.mkdtemp(prefix="pgc-"))  # short: the simulated nodes' sockets live below it
    try:
        _interrupt_mid_run(gpu_pytester, out, tmp)
        left = sorted(
            str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.name.startswith(("run-", "pytest-gpu-nodes-"))
        )
        assert not left, left  # the controller's run directory, the simulated nodes' roots
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _runs_in(tmp: Path) -> list[Path]:
    """Run directories and simulated nodes' roots under ``tmp``."""
    return sorted(p for p in tmp.rglob("*") if p.name.startswith(("run-", "pytest-gpu-nodes-")))


def _interrupt_mid_run(gpu_pytester: pytest.Pytester, out: Path, tmp: Path) -> None:
    gpu_pytester.makepyfile(test_sleeps=SLEEPS)
    args = [*INNER_ARGS, *NODE_ARGS, "-n", "1", "--gpu-nodes=local:2"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", *args],
        cwd=gpu_pytester.path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp)},
    )
    try:
        deadline = time.monotonic() + patience(60)
        while {p.name.split("-")[0] for p in out.iterdir()} != {"node0", "node1"}:
            assert proc.poll() is None and time.monotonic() < deadline, "the tests did not start on both nodes"
            time.sleep(0.2)
        # what must go: the controller's run directory, the simulated nodes (their run directories inside)
        assert {p.name.split("-")[0] for p in _runs_in(tmp)} == {"run", "pytest"}, _runs_in(tmp)
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=patience(60))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, output
    deadline = time.monotonic() + patience(15)  # what the interrupt ended may take a moment to be reaped
    while _left_in(gpu_pytester.path) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _left_in(gpu_pytester.path), output


# -- plans go to the worker's node, in its broker's GPU indices --------------------------------


class _Worker:
    """An xdist ``WorkerController`` as the scheduler uses it."""

    def __init__(self, name: str, node: str) -> None:
        self.gateway = SimpleNamespace(id=name)
        self.node = node
        self.shutting_down = False
        self.sent: list[int] = []

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent += indices

    def shutdown(self) -> None:
        self.shutting_down = True


class _Nodes:
    """The scheduler's view of two nodes' brokers (``NodesFeature`` without processes)."""

    def __init__(self, views: dict[str, Any]) -> None:
        self._views = views
        self.preferred: list[tuple[str, str, str, tuple[int, ...], int | None]] = []

    def views(self) -> dict[str, Any]:
        return self._views

    def prefer(self, node: str, worker: str, test: str, gpus: tuple[int, ...], memory: int | None) -> None:
        self.preferred.append((node, worker, test, gpus, memory))

    def node_of(self, worker: Any) -> str:
        return str(worker.node)


def test_plans_go_to_the_worker_s_node_in_its_broker_s_indices() -> None:
    """Node ``a``'s broker numbers its GPUs 0 and 1, node ``b``'s 4 and 7 (``--gpus 4,7`` there),
    and b's GPU 4 has 1 GiB of room: the test b's worker takes is planned on b's GPU 7, and
    that plan goes to b's broker as GPU 7 (not 1, which b does not have; not to a's broker,
    nor the controller's, which has no GPUs)."""
    from pytest_gpu.leasing.view import NodeView
    from pytest_gpu.scheduling.scheduler import GpuScheduling

    gib = 1 << 30
    collection = ["t.py::test_a", "t.py::test_b"]
    catalog = {nodeid: {"gpus": 1, "memory": 4 * gib} for nodeid in collection}
    views = {
        "a": NodeView((16 * gib, 16 * gib), (0, 1), {}, {}, (0, 0), (16 * gib, 16 * gib), catalog),
        "b": NodeView((1 * gib, 16 * gib), (4, 7), {}, {}, (0, 0), (16 * gib, 16 * gib), dict(catalog)),
    }
    nodes = _Nodes(views)
    sched = object.__new__(GpuScheduling)
    sched.__dict__.update(
        numnodes=2,
        config=SimpleNamespace(getoption=lambda name, default=None: default),
        log=lambda *a: None,
        run=SimpleNamespace(broker=None),
        durations={},
        node2collection={},
        _names={},
        collection=None,
        planner=None,
        gpu_nodes=nodes,
        _node={},
    )
    workers = [_Worker("gw0", "a"), _Worker("gw1", "b")]
    for w in workers:
        sched.add_node(w)  # type: ignore[arg-type]
        sched.add_node_collection(w, collection)  # type: ignore[arg-type]
    sched.schedule()
    assert sorted(w.sent[0] for w in workers) == [0, 1]
    by_worker = {p[1]: p for p in nodes.preferred}
    assert by_worker["gw0"][0] == "a" and by_worker["gw0"][3] in ((0,), (1,))
    assert by_worker["gw1"][0] == "b" and by_worker["gw1"][3] == (7,), nodes.preferred
    assert {p[4] for p in nodes.preferred} == {4 * gib}
    assert {p[2] for p in nodes.preferred} == set(collection)


def test_a_node_host_passes_plans_to_its_broker_and_counts_refusals() -> None:
    """The node host's side of a plan: ``Broker.prefer`` with the message's values; a plan its
    broker refuses (GPUs that are not the node's) is counted, and the host goes on."""
    from pytest_gpu.nodes import agent

    calls: list[tuple[Any, ...]] = []

    def prefer(worker: str, test: str, gpus: tuple[int, ...], memory: int | None) -> None:
        if not set(gpus) <= {4, 7}:
            raise ValueError("not this node's")
        calls.append((worker, test, gpus, memory))

    run: Any = SimpleNamespace(broker=SimpleNamespace(prefer=prefer))
    assert agent.prefer(run, {"worker": "gw1", "test": "t::x", "gpus": [7], "memory": 1024})
    assert agent.prefer(run, {"worker": "gw1", "test": "t::y", "gpus": [4, 7], "memory": None})
    assert not agent.prefer(run, {"worker": "gw1", "test": "t::z", "gpus": [1], "memory": None})
    with pytest.raises(WireError, match="'prefer' lacks 'gpus', 'memory'"):  # the host counts it refused
        messages.request(("prefer", {"worker": "gw1", "test": "t::z"}))
    assert calls == [("gw1", "t::x", (7,), 1024), ("gw1", "t::y", (4, 7), None)]


class Channel:
    """An execnet channel's stand-in: what was sent, and the answers to give, in order."""

    def __init__(self, *answers: Any) -> None:
        self.sent: list[Any] = []
        self.answers = list(answers)

    def send(self, message: Any) -> None:
        self.sent.append(message)

    def receive(self, timeout: float | None = None) -> Any:
        if not self.answers:
            raise EOFError("the other side is gone")
        return self.answers.pop(0)


FIGURES = {
    "room": [16 << 30, 8 << 30],
    "order": [0, 1],
    "placements": {"gw0": [[[1], 1 << 30]]},
    "contexts": {"gw0": [1]},
    "context_sizes": [500 << 20, 500 << 20],
    "limits": [15 << 30, 15 << 30],
    "refused_plans": 0,
    "grants": 3,
    "crashes": 0,
    "required": None,
    "catalog": {"t.py::a": {"gpus": 1, "memory": None}},
}


@pytest.mark.parametrize(
    "message, why",
    [
        (("prefer", {"worker": "w", "test": "t", "gpus": ["1"], "memory": None}), "an item of gpus must be an integer"),
        (("state", {"faults": "yes"}), "faults must be true or false"),
        (("state", {"worker": "gw0", "verbose": True}), "'state' has no field 'verbose'"),
        (("stat", {}), "unknown message 'stat'"),
        ("state", "must be \\(kind, body\\)"),
    ],
)
def test_what_a_node_host_is_told_is_checked(message: Any, why: str) -> None:
    with pytest.raises(WireError, match=why):
        messages.request(message)


def test_a_node_host_that_is_told_nonsense_says_so_and_starts_nothing() -> None:
    from pytest_gpu.nodes import agent

    channel = Channel(("start", {"node": "node0"}))
    agent.serve(channel)
    [(kind, why)] = channel.sent
    assert kind == "error" and "'start' lacks 'settings', 'cwd', 'package'" in why


def test_what_a_node_host_answers_is_checked_and_a_garbled_one_is_lost() -> None:
    from pytest_gpu.nodes.hosts import NodeHosts

    kind, figures = messages.answer("state", ("state", FIGURES))
    assert kind == "state" and figures["placements"] == {"gw0": [([1], 1 << 30)]}
    hosts = NodeHosts(SimpleNamespace(names=("node0", "node1")), None, {"node0": "", "node1": ""}, lambda: None)  # type: ignore[arg-type]
    for name, answer in (("node0", ("state", FIGURES)), ("node1", ("state", {**FIGURES, "room": None}))):
        hosts.hosts[name].info = {"node": name}
        hosts.hosts[name].channel = Channel(answer)
    views = hosts.views()
    assert list(views) == ["node0"] and views["node0"].placements == {"gw0": [((1,), 1 << 30)]}
    assert hosts.hosts["node1"].lost is not None and "room must be a list" in hosts.hosts["node1"].lost
    assert hosts.catalogs["node0"] == {"t.py::a": {"gpus": 1, "memory": None}} and hosts.catalogs["node1"] == {}


# -- nodes of different GPUs -------------------------------------------------------------------

MIXED = """
import os, time
import pytest

@pytest.mark.parametrize("i", range(3))
@pytest.mark.gpu(memory="30GiB")
def test_big(i, gpu):
    time.sleep(0.2)
    assert os.environ["PYTEST_GPU_NODE"] == "node1"  # only node1's GPU gives 30 GiB

@pytest.mark.gpu(count=2, memory="4GiB")
def test_pair(gpu):
    assert os.environ["PYTEST_GPU_NODE"] == "node0"  # only node0 has two GPUs

@pytest.mark.parametrize("i", range(4))
@pytest.mark.gpu(memory="4GiB")
def test_small(i, gpu):
    time.sleep(0.2)

@pytest.mark.gpu(count=3, memory="4GiB")
def test_three(gpu):
    pass

@pytest.mark.gpu(memory="60GiB")
def test_sixty(gpu):
    pass
"""


@pytest.mark.slow
def test_nodes_of_different_gpus(
    run_inner: Callable[..., pytest.RunResult], gpu_pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """node0 has 2 GPUs of 16 GiB, node1 one of 40 GiB (each node its own fake machine): a
    30 GiB test runs on node1 only and a two-GPU test on node0 only (neither skipped as too
    large on the node whose worker collected it); a three-GPU test and a 60 GiB one fit no
    node and are skipped at collection, naming the largest node."""
    require("C compiler", executable="cc")  # the fake libnvidia-ml.so.1 is built from C
    monkeypatch.setenv(spec.SIM_NODE_GPUS_ENV, "node0=sim:2x16GiB;node1=sim:1x40GiB")
    gpu_pytester.makepyfile(test_mixed=MIXED)
    args = ("-p", "no:rerunfailures", "--gpus", "auto", "-n", "2", "--gpu-nodes=local:2", "-rs")
    result = run_inner(*args, subprocess=True, timeout=180)
    result.assert_outcomes(passed=8, skipped=2)
    result.stdout.fnmatch_lines(
        [
            "pytest-gpu: node node0 (*): 2 GPUs (2x16GiB)*",
            "pytest-gpu: node node1 (*): 1 GPU (1x40GiB)*",
        ]
    )
    result.stdout.fnmatch_lines_random(
        [
            "*SKIPPED*test_mixed.py*fits no node of the run, not even the largest: needs 3 GPUs* "
            "but node node1 has 1 GPU*",
            "*SKIPPED*test_mixed.py*fits no node of the run, not even the largest: needs 60GiB per GPU but the "
            "largest GPU of node node1 offers 39.5GiB after the CUDA context (1 *GPU (1x40GiB))",
        ]
    )


def test_simulated_node_gpus_are_read_per_node() -> None:
    assert spec.sim_node_gpus("node0=sim:2x16GiB; node1=sim:1x40GiB", ("node0", "node1")) == {
        "node0": "sim:2x16GiB",
        "node1": "sim:1x40GiB",
    }
    with pytest.raises(NodesError, match="expected node=spec for nodes of node0, node1; got 'node7=sim:1x8GiB'"):
        spec.sim_node_gpus("node7=sim:1x8GiB", ("node0", "node1"))


def test_no_namespace_without_the_tools_that_make_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``ip`` a node's namespace would have no loopback (its node host would fail to
    start), so simulated nodes then share this machine's namespace instead."""
    from pytest_gpu.nodes import hosts

    real = shutil.which
    monkeypatch.setattr(hosts.shutil, "which", lambda name: None if name == "ip" else real(name))
    assert hosts.unshare_works() is False


# -- skips decided while a test runs -------------------------------------------------------------

RUN_TIME_SKIPS = """
import pytest

@pytest.fixture
def three(gpu_lease_factory):
    return gpu_lease_factory(count=3)

def test_block(gpu_request):
    with gpu_request(count=3):
        raise AssertionError("must not run")

def test_fixture(three):
    raise AssertionError("must not run")

@pytest.mark.gpu
def test_fits(gpu):
    pass
"""


@pytest.mark.slow
def test_run_time_skips_name_the_node_s_gpus(
    run_inner: Callable[..., pytest.RunResult], gpu_pytester: pytest.Pytester
) -> None:
    """A ``gpu_request`` block and a ``gpu_lease_factory`` lease too large for the node's GPUs
    skip on the node's worker, worded from that node's inventory; the controller's summary
    line says so too, not the controller's own "no GPUs — --gpus none" (it leases none)."""
    gpu_pytester.makepyfile(test_late=RUN_TIME_SKIPS)
    result = run_inner(*NODE_ARGS, "-n", "1", "--gpu-nodes=local:2", "-rs", subprocess=True, timeout=180)
    result.assert_outcomes(passed=1, skipped=2)
    out = result.stdout.str()
    assert "no GPUs" not in out and "--gpus none" not in out, out
    result.stdout.fnmatch_lines_random(
        [
            "SKIPPED*test_late.py*pytest-gpu: needs 3 GPUs* but node node? has 2 simulated GPUs (2x16GiB)*",
            "SKIPPED*test_late.py*pytest-gpu: *three* needs 3 GPUs* but node node? has 2 simulated GPUs (2x16GiB)*",
            "pytest-gpu: 2 GPU tests skipped: *larger than node node?'s 2 simulated GPUs (2x16GiB)* (-rs lists them)",
        ]
    )


def test_a_run_time_skip_that_says_no_why_is_not_worded_from_the_controller_s_inventory() -> None:
    """Under ``--gpu-nodes`` the controller's inventory is no GPU: a skip a worker sent
    without its words (a rank pool's, say) takes the words the controller sets."""
    from pytest_gpu.report.summary import Summary
    from pytest_gpu.vendors.devices import Inventory

    summary = Summary(unsaid_why="larger than the GPUs of the node it ran on")
    report = pytest.TestReport(
        "t.py::b", ("t.py", 1, "b"), {}, "skipped", ("t.py", 1, "Skipped: pytest-gpu: needs 5 GPUs"), "call"
    )
    summary.add(report)
    none = Inventory((), "none", "--gpus none")
    assert summary.skipped_lines(none) == [
        "pytest-gpu: 1 GPU test skipped: larger than the GPUs of the node it ran on (-rs lists them)"
    ]


# -- a node's crashed workers -------------------------------------------------------------------

KILLED_ON_NODE1 = """
import os, signal, time
import pytest

@pytest.mark.parametrize("i", range(6))
@pytest.mark.gpu(memory="4GiB")
def test_t(i, gpu):
    flag = os.environ["CRASH_FLAG"]
    if os.environ["PYTEST_GPU_NODE"] == "node1" and not os.path.exists(flag):
        open(flag, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)  # dies holding its lease, on node1
    time.sleep(0.3)
"""


@pytest.mark.slow
def test_a_worker_killed_holding_a_lease_is_said_with_its_node(
    run_inner: Callable[..., pytest.RunResult],
    gpu_pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The crash record is node1's broker's: the node host carries it to the controller,
    whose summary has its line (the test, what was reclaimed) with the node named, as one
    machine's summary has a line per process that died holding leases."""
    monkeypatch.setenv("CRASH_FLAG", str(gpu_pytester.path / "crashed"))
    gpu_pytester.makepyfile(test_crash=KILLED_ON_NODE1)
    result = run_inner(*NODE_ARGS, "-n", "1", "--gpu-nodes=local:2", subprocess=True, timeout=180)
    result.assert_outcomes(passed=5, failed=1)
    result.stdout.fnmatch_lines(
        [
            "pytest-gpu: node node1 (*): 2 simulated GPUs (2x16GiB), * granted, 1 process went away holding leases*",
            "pytest-gpu: node node1: worker gw* (pid *) died while running test_crash.py::test_t[[]*[]]; "
            "its GPU * was reclaimed",
        ]
    )
    assert not _left_in(Path.cwd())


def test_a_node_s_crash_and_quarantine_records_reach_the_controller(tmp_path: Path) -> None:
    """What a node host sends (its broker's crash records, its run directory's quarantine
    records) survives execnet and comes back as the records the summary's lines are made of,
    by node; a node with neither is left out."""
    from pytest_gpu.leasing.protocol import CrashRecord
    from pytest_gpu.nodes import agent
    from pytest_gpu.nodes.hosts import NodeHosts
    from pytest_gpu.run import quarantine

    crash = CrashRecord("gw1", 4242, "t.py::killed", (0,), (29500,), 1.5)
    folder = tmp_path / quarantine.RECORDS
    folder.mkdir()
    record = {"test": "t.py::broke", "error": "CUDA error: an illegal memory access", "worker": "gw3", "ends": True}
    (folder / "gw3.json").write_text(json.dumps(record))
    run = SimpleNamespace(broker=SimpleNamespace(crashes=[crash]), run_dir=tmp_path)
    sent = execnet.loads(execnet.dumps(agent.fault_records(run)))  # type: ignore[arg-type]

    hosts = NodeHosts(SimpleNamespace(names=("node0", "node1")), None, {"node0": "", "node1": ""}, lambda: None)  # type: ignore[arg-type]
    for name in ("node0", "node1"):
        hosts.hosts[name].info = {"node": name}
    hosts.hosts["node0"].final = {"faults": {"crashes": [], "quarantined": []}}
    hosts.hosts["node1"].final = {"faults": sent}
    crashes, quarantined = hosts.faults()["node1"]
    assert crashes == [crash]
    assert quarantined == {"gw3": quarantine.Quarantine(**record)}
    assert list(hosts.faults()) == ["node1"]


def test_a_node_s_view_crosses_its_channel_and_translates_its_gpu_indices() -> None:
    """What a node host sends of its broker (:meth:`NodeView.to_wire`) survives execnet and
    comes back as the same view; its GPU indices (``--gpus 4,7`` there) are the planner's
    positions 0 and 1, both ways, and a plan for a GPU the node lacks goes nowhere."""
    from pytest_gpu.leasing.view import NodeView

    view = NodeView(
        room=(1 << 30, 16 << 30),
        order=(4, 7),
        placements={"gw1": [((7,), 2 << 30)], "gw2": [((4, 7), None)]},
        contexts={"gw1": frozenset({7})},
        context_sizes=(500 << 20, 500 << 20),
        limits=((16 << 30) - (500 << 20),) * 2,
    )
    catalog = {"t.py::x": {"gpus": 1}}
    back = NodeView.from_wire(execnet.loads(execnet.dumps(view.to_wire())), catalog)
    assert back == view and back.catalog is catalog
    assert back.placed == {"gw1": [((1,), 2 << 30)], "gw2": [((0, 1), None)]}
    assert back.opened == {"gw1": frozenset({1})}
    assert back.indices((1,)) == (7,) and back.indices((0, 1)) == (4, 7)
    assert back.indices((2,)) is None  # not a GPU of this node
    assert back.positions((7, 3)) == (1,)
    assert back.can_ever(2, 8 << 30) and not back.can_ever(1, 16 << 30) and not back.can_ever(3, None)
    assert NodeView((8, 8)).order == (0, 1) and NodeView((8,)).can_ever(1, 1 << 40)  # no limits known
    with pytest.raises(ValueError, match="2 GPUs' room names 1 GPU indices"):
        NodeView((8, 8), order=(3,))
