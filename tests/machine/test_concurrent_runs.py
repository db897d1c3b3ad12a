"""Several pytest runs on one (simulated) machine: they share its GPUs as one run would.

Each run here is a real ``pytest -n N`` process; runs that name the same simulated
machine (``PYTEST_GPU_SIM_MACHINE``) share its GPUs' memory, as runs on one real machine
share its GPUs, and the machine's arbiter decides for all of them. Timing targets (the
makespan of concurrent runs against one combined run) are in ``bench/concurrent_runs.py``.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import INNER_ARGS
from helpers import patience, wait_for
from pytest_gpu.machine.domain import Domain
from pytest_gpu.machine.link import status

SPEC = "sim:2x16GiB"

HEAVY = """
import os, time, pytest
import pytest_gpu.sim as sim

@pytest.mark.gpu(memory="6GiB")
@pytest.mark.parametrize("i", range(16))
def test_heavy(gpu, i):
    start = time.time()
    block = sim.allocate(6 * 2**30, gpu.device)  # an OOM here fails the test
    time.sleep(0.2)
    block.free()
    with open(os.environ["TIMES"], "a") as out:
        out.write(f"{os.environ['RUN']} {start} {time.time()}\\n")
"""

EXCLUSIVE = """
import os, time, pytest

@pytest.mark.gpu(exclusive=True)
@pytest.mark.parametrize("i", range(6))
def test_whole(gpu, i):
    start = time.time()
    time.sleep(0.15)
    with open(os.environ["TIMES"], "a") as out:
        out.write(f"{os.environ['RUN']} {gpu.indices[0]} {start} {time.time()}\\n")
"""


def start_run(path: Path, name: str, machine: str, workers: int, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTEST_GPU_SIM_MACHINE": machine, "RUN": name, "TIMES": str(path / "times.txt")}
    command = [sys.executable, "-m", "pytest", *INNER_ARGS, "-q", "-n", str(workers), "--gpus", SPEC, *args]
    return subprocess.Popen(command, cwd=path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen[str], timeout: float = 240) -> str:
    out, _ = proc.communicate(timeout=patience(timeout))
    return out


@pytest.mark.parametrize("runs", [2, 4])
def test_concurrent_runs_share_the_machine_without_oom(gpu_pytester, runs):
    path = gpu_pytester.path
    gpu_pytester.makepyfile(test_heavy=HEAVY)
    procs = [start_run(path, f"r{i}", "shared", 4, "test_heavy.py") for i in range(runs)]
    outputs = [finish(p) for p in procs]
    for proc, out in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, out
        assert "16 passed" in out and "OutOfMemoryError" not in out, out
        assert "· 0 violations" in out, out
    # they ran side by side, not one after another
    spans: dict[str, list[float]] = {}
    for line in (path / "times.txt").read_text().splitlines():
        run, start, end = line.split()
        span = spans.setdefault(run, [float("inf"), 0.0])
        span[0], span[1] = min(span[0], float(start)), max(span[1], float(end))
    assert len(spans) == runs
    assert max(s[0] for s in spans.values()) < min(s[1] for s in spans.values()), spans


def test_exclusive_leases_never_overlap_across_runs(gpu_pytester):
    path = gpu_pytester.path
    gpu_pytester.makepyfile(test_whole=EXCLUSIVE)
    procs = [start_run(path, f"r{i}", "shared", 2, "test_whole.py") for i in range(3)]
    for proc in procs:
        out = finish(proc)
        assert proc.returncode == 0 and "6 passed" in out, out
    by_gpu: dict[str, list[tuple[float, float, str]]] = {}
    for line in (path / "times.txt").read_text().splitlines():
        run, gpu, start, end = line.split()
        by_gpu.setdefault(gpu, []).append((float(start), float(end), run))
    assert sum(len(v) for v in by_gpu.values()) == 18
    for gpu, spans in by_gpu.items():
        spans.sort()
        for (_, end, run), (start, _, other) in itertools.pairwise(spans):
            assert end <= start, f"GPU {gpu}: {run} and {other} held it at once"


# Two 7.3 GiB leases and two 500 MiB contexts leave 0.42 GiB of a 16 GiB GPU: a single
# context the arbiter does not count is an OOM.
FIRST = """
import os, time, pytest
import pytest_gpu.sim as sim

@pytest.mark.gpu(memory="7.3GiB")
def test_first(gpu):
    sim.allocate(int(7.3 * 2**30), gpu.device).free()

def test_until_the_others_are_busy():
    # this run (the arbiter: without xdist it leases first) ends while the others lease
    deadline = time.time() + 60
    while time.time() < deadline:
        if os.path.exists(os.environ["TIMES"]) and len(open(os.environ["TIMES"]).readlines()) >= 6:
            return
        time.sleep(0.02)
"""

BUSY = """
import os, time, pytest
import pytest_gpu.sim as sim

@pytest.mark.gpu(memory="7.3GiB")
@pytest.mark.parametrize("i", range(8))
def test_busy(gpu, i):
    block = sim.allocate(int(7.3 * 2**30), gpu.device)  # an OOM here fails the test
    time.sleep(0.1)
    block.free()
    with open(os.environ["TIMES"], "a") as out:
        out.write(f"{os.environ['RUN']}\\n")
"""


@pytest.mark.slow
# the known rarer race (see the docstring): a failure is run again, at most twice, and each
# run is 8 whole trials; the bug this test was written for fails every run of 8
@pytest.mark.flaky(reruns=2)
def test_a_new_arbiter_counts_every_context_of_the_runs_that_re_attach(gpu_pytester):
    """The arbiter's run ends mid-way through three others: it counts its own process's
    contexts until it has left, and the new arbiter learns from each run what it holds,
    waits for and where its processes have contexts (exiting ones too) before it grants
    anything. 8 times, four runs, not one simulated OOM.

    Before the fix 11 of 20 trials ran out of memory, so 8 trials miss that bug once in
    about 600 runs. A rarer race remained, on the tree before issue 19 as after it (measured
    2026-11-26: 2 of 80 trials on this tree, 1 of 60 on the one before issue 19): the
    arbiter's own run, leaving, had what it held granted before its exiting process's
    context counted as foreign (Arbiter.detach; issue 29 found it when the arbiter's events
    got faster, 6 trials of 48, and fixed it: 0 of 32 since; the unit test is test_machine's
    test_what_a_leaving_run_held_is_granted_only_once_its_process_counts_as_foreign). A
    failing run is still run again (at most twice)."""
    trials, at_once, failed, ooms = 8, 2, [], 0
    for batch in range(0, trials, at_once):
        running = []
        for trial in range(batch, batch + at_once):  # on machines of their own
            path = gpu_pytester.path / f"t{trial}"
            path.mkdir()
            (path / "test_first.py").write_text(FIRST)
            (path / "test_busy.py").write_text(BUSY)
            machine = f"failover-{trial}"
            procs = [start_run(path, "first", machine, 0, "test_first.py")]
            running.append(procs + [start_run(path, f"busy{i}", machine, 2, "test_busy.py") for i in range(3)])
        for procs in running:
            outputs = [finish(p) for p in procs]
            bad = [out for proc, out in zip(procs, outputs, strict=True) if proc.returncode != 0]
            if bad:
                failed.append(bad[0])
                ooms += any("OutOfMemoryError" in out for out in bad)
    assert not failed, f"{len(failed)} of {trials} trials failed, {ooms} with an OOM; the first:\n{failed[0]}"


HOLDS = """
import time, pytest
import pytest_gpu.sim as sim

@pytest.mark.gpu(exclusive=True)
@pytest.mark.parametrize("i", range(2))
def test_holds(gpu, i):
    block = sim.allocate(8 * 2**30, gpu.device)
    time.sleep(120)
"""

NEEDS = """
import pytest
import pytest_gpu.sim as sim

@pytest.mark.gpu(exclusive=True, memory="8GiB")
@pytest.mark.parametrize("i", range(2))
def test_needs(gpu, i):
    sim.allocate(8 * 2**30, gpu.device).free()
"""


def leases_of(domain: Domain) -> list[dict]:
    state = status(domain) or {"leases": [], "waiting": []}
    return state["leases"]


def test_a_run_killed_mid_run_frees_its_leases_within_a_second_and_the_others_go_on(gpu_pytester):
    path = gpu_pytester.path
    gpu_pytester.makepyfile(test_holds=HOLDS, test_needs=NEEDS)
    env_machine = "killed"
    holder = start_run(path, "holder", env_machine, 2, "test_holds.py")
    try:
        os.environ["PYTEST_GPU_SIM_MACHINE"] = env_machine
        domain = Domain.sim(SPEC)
        wait_for(lambda: len(leases_of(domain)) == 2, 120, "the holder run holds both GPUs")
        waiter = start_run(path, "waiter", env_machine, 2, "test_needs.py")
        wait_for(lambda: len((status(domain) or {}).get("waiting", [])) == 2, 120, "the other run waits")
        holder.send_signal(signal.SIGKILL)  # the controller: its workers are orphans now
        killed = time.monotonic()
        wait_for(
            lambda: not leases_of(domain) or all(r["test"].startswith("test_needs") for r in leases_of(domain)),
            5,
            "leases freed",
        )
        assert time.monotonic() - killed < 1.0
        out = finish(waiter)
        # its tests ran where the orphans' memory (8 GiB each, until they exit) left room, or waited for it
        assert waiter.returncode == 0 and "2 passed" in out, out
        assert "OutOfMemoryError" not in out
    finally:
        os.environ.pop("PYTEST_GPU_SIM_MACHINE", None)
        holder.kill()
        holder.wait()


FOREIGN = """
import pytest
import pytest_gpu.sim as sim

@pytest.mark.gpu(memory="8GiB")
@pytest.mark.parametrize("i", range(4))
def test_big(gpu, i):
    sim.allocate(8 * 2**30, gpu.device).free()
    assert gpu.indices == (1,)
"""


def test_a_gpu_a_foreign_process_fills_is_avoided_and_the_summary_says_so(gpu_pytester, hold):
    gpu_pytester.makepyfile(test_foreign=FOREIGN)
    hold("--machine", "foreign", "--spec", SPEC, "--gpu", "0", "--memory", "12GiB")
    proc = start_run(gpu_pytester.path, "r", "foreign", 2, "test_foreign.py")
    out = finish(proc)
    assert proc.returncode == 0 and "4 passed" in out, out
    assert "OutOfMemoryError" not in out
    # 12 GiB and the holder's CUDA context, as NVML counts them
    assert re.search(
        r"pytest-gpu: GPU 0 was avoided by [1-4] tests?: processes outside pytest-gpu used 12.5GiB there", out
    ), out


PORTS = """
import os, socket, time, pytest

@pytest.mark.parametrize("i", range(8))
def test_binds_late(ports, i):
    a, b = ports(2)
    start = time.time()
    time.sleep(0.3)  # what a server does between being told its port and listening on it
    with socket.socket() as one, socket.socket() as two:
        one.bind(("", a))  # EADDRINUSE here: another run was handed the same port
        two.bind(("", b))
        time.sleep(0.1)
    with open(os.environ["TIMES"], "a") as out:
        out.write(f"{os.environ['RUN']} {a} {b} {start} {time.time()}\\n")
"""


@pytest.mark.slow
def test_concurrent_runs_are_never_handed_the_same_port(gpu_pytester):
    """Two runs with one narrow --gpu-port-range whose tests bind late: the machine's arbiter
    hands out ports for every run, so no port is held by two runs at once."""
    gpu_pytester.makepyfile(test_ports=PORTS)
    runs = [start_run(gpu_pytester.path, f"r{i}", "ports", 2, "--gpu-port-range=35100-35109") for i in range(2)]
    outs = [finish(run) for run in runs]
    for out in outs:
        assert "8 passed" in out and "INTERNALERROR" not in out, out
    held = [line.split() for line in (gpu_pytester.path / "times.txt").read_text().splitlines()]
    assert len(held) == 16
    for (run1, *ports1, s1, e1), (run2, *ports2, s2, e2) in itertools.combinations(held, 2):
        if run1 != run2 and set(ports1) & set(ports2):
            assert float(e1) <= float(s2) or float(e2) <= float(s1), f"{run1} and {run2} held {ports1} {ports2} at once"
