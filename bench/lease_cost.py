"""Benchmark what one GPU lease costs a test: the same tiny tests with and without a ``gpu`` marker.

Generates N tests that each allocate and free 256 MiB of simulated GPU memory
(``pytest_gpu.sim``), once with ``@pytest.mark.gpu(memory="1GiB")`` (acquire from the
broker, pin CUDA, confine, verify through the ledger, release) and once without a marker
(the allocation lands on GPU 0, nothing else), and runs both under ``pytest -n 2 --gpus
sim:4x16GiB``, alternating (ABBA). Prints each wall time, the medians, and the cost of
one lease in worker milliseconds: (median with - median without) x workers / N.

With ``--baseline-src DIR`` (the ``src`` folder of another checkout, e.g. a
``git worktree`` of an older commit) the same two suites also run on that code, in the
same rotation, and the lease costs of both are printed side by side.

``--scenario torch`` (issue 19, "A teardown that costs nothing"): torch imported, on fake
GPUs (``PYTEST_GPU_FAKE_GPUS=sim:4x16GiB``: the fake NVML, torch's CPU build given the
simulated ``torch.cuda``), N tests marked ``gpu(memory="1GiB")`` that each allocate 256 MiB
through ``pytest_gpu.sim.torch_cuda.empty`` and drop it, in one pytest process (no ``-n``),
five arms alternating: with the plugin (``--gpus auto``: lease, confinement of torch,
verification through NVML and torch's counters, release), with ``--gpu-verify=off``, with
``-p no:gpu_adapters`` (torch not confined), with both (the lease alone) and with
``-p no:gpu`` (no plugin: the conftest turns the fake GPUs on itself). A GPU test's cost
is (median of an arm - median of ``-p no:gpu``) / N, in wall time and in CPU time (user +
system of the pytest process: steadier on a loaded machine); each run gets a private
ledger and machine directory, and the bytecode cache is warmed first.

Run from the repository root::

    python bench/lease_cost.py            # 200 tests, 5 runs a side
    python bench/lease_cost.py --quick    # 40 tests, 1 run a side
    python bench/lease_cost.py --scenario torch --runs 7
    git worktree add /tmp/old b49dd27 && python bench/lease_cost.py --baseline-src /tmp/old/src
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKERS = 2
TEST = """
import pytest
from pytest_gpu import sim

@pytest.mark.parametrize("n", range({n}))
{mark}
def test_tiny(n):
    with sim.allocate("256MiB"):
        pass
"""


TORCH_CONFTEST = """
from pytest_gpu.sim import fake

fake.activate()  # PYTEST_GPU_FAKE_GPUS: the plugin has done it already; under -p no:gpu, nobody has
import torch  # noqa: E402  (given the simulated torch.cuda as it is imported)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: a GPU test (the plugin's marker, for -p no:gpu)")
"""
TORCH_TEST = """
import pytest
from pytest_gpu.sim import torch_cuda

@pytest.mark.parametrize("n", range({n}))
@pytest.mark.gpu(memory="1GiB")
def test_tiny(n):
    x = torch_cuda.empty(256 * 2**20)  # the current device: the lease's (cuda:0 without the plugin)
    del x
"""
# The breakdown: a plugin (``-p lease_probe``, only in the "probed" arm) that wraps the plugin's
# per-test steps with perf_counter_ns timers at import, before the run starts; the product has
# no timer of its own, so the other arms pay nothing. Each step's time is its own (exclusive):
# what a step calls that is itself timed (a ledger write inside the adapters' undo) counts once,
# where it is deepest. Ledger time outside every hook is the test body's own cudaMalloc.
PROBE = """
import functools, importlib, inspect, json, os, time
from contextlib import contextmanager

import pytest

from pytest_gpu.gpu import confine as _confine, isolation, verification
from pytest_gpu.leasing import client
from pytest_gpu.run import infra, lifecycle, session, sticky
_ledger = importlib.import_module("pytest_gpu.sim.ledger")  # the module (sim.ledger is its function)

_stack = []  # [part, start ns, CPU ns at start, ns of timed steps inside, CPU ns of them]
_ns = {}  # part -> wall ns (perf_counter_ns)
_cpu = {}  # part -> CPU ns of the whole process (process_time_ns: the broker's thread too), steadier under load


def _enter(part):
    _stack.append([part, time.perf_counter_ns(), time.process_time_ns(), 0, 0])


def _exit():
    part, start, cpu_start, inner, cpu_inner = _stack.pop()
    spent, cpu = time.perf_counter_ns() - start, time.process_time_ns() - cpu_start
    if part == "ledger" and not _stack:
        part = "ledger (test body)"
    _ns[part] = _ns.get(part, 0) + spent - inner
    _cpu[part] = _cpu.get(part, 0) + cpu - cpu_inner
    if _stack:
        _stack[-1][3] += spent
        _stack[-1][4] += cpu


def _timed(part, function):
    def timed(*args, **kwargs):
        _enter(part)
        try:
            return function(*args, **kwargs)
        finally:
            _exit()
    return timed


def _timed_cm(part, function):
    @contextmanager
    def timed(*args, **kwargs):
        _enter(part)
        try:
            with function(*args, **kwargs) as value:
                yield value
        finally:
            _exit()
    return timed


_ledger.Ledger._lock = _timed_cm("ledger", _ledger.Ledger._lock)
if hasattr(_ledger.Ledger, "_peek"):  # a look read without the lock (a --baseline-src may predate it)
    _ledger.Ledger._peek = _timed("ledger", _ledger.Ledger._peek)
for _name in ("acquire", "release", "context_size"):
    setattr(client.BrokerClient, _name, _timed("broker", getattr(client.BrokerClient, _name)))
session.confine_lease = _timed("confine", session.confine_lease)
isolation.Confinement.undo = _timed("confine", isolation.Confinement.undo)
for _cls in (verification.NvmlVerifier, verification.SimVerifier):
    _cls.begin = _timed("verification", _cls.begin)
    _cls.end = _timed("verification", _cls.end)
for _name in ("setup", "teardown", "make_report", "release_failure"):
    setattr(lifecycle, _name, _timed("rest", getattr(lifecycle, _name)))
infra.Infrastructure._sample = _timed("infra evidence", infra.Infrastructure._sample)
sticky.probe = _timed("sticky probe", sticky.probe)


def _timed_wrapper(part, function):
    # a hook wrapper (a generator): each of its steps is timed, not the hooks it wraps
    def timed(*args, **kwargs):
        steps = function(*args, **kwargs)
        resume = functools.partial(next, steps)
        while True:
            _enter(part)
            try:
                value = resume()
            except StopIteration as stop:
                return stop.value
            finally:
                _exit()
            try:
                sent = yield value
            except BaseException as exc:
                resume = functools.partial(steps.throw, exc)
            else:
                resume = functools.partial(steps.send, sent)
    return timed


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    # every other per-test hook of the plugin, whole: what no part above names is "other hooks"
    for name in dir(config.hook):
        if not name.startswith(("pytest_runtest_", "pytest_fixture_", "pytest_report_teststatus")):
            continue
        for impl in getattr(config.hook, name).get_hookimpls():
            if not type(impl.plugin).__module__.startswith("pytest_gpu"):
                continue
            function = impl.function
            wrapped = _timed_wrapper if inspect.isgeneratorfunction(function) else _timed
            impl.function = functools.wraps(function)(wrapped("other hooks", function))


def pytest_sessionfinish(session):
    with open(os.environ["LEASE_PROBE_OUT"], "w") as out:
        json.dump({"wall": _ns, "cpu": _cpu}, out)
"""
PARTS = (
    "broker",
    "ledger",
    "ledger (test body)",
    "confine",
    "verification",
    "infra evidence",
    "sticky probe",
    "rest",
    "other hooks",
)
TORCH_ARMS = {  # name -> pytest arguments
    "plugin": ["--gpus", "auto"],
    "verify off": ["--gpus", "auto", "--gpu-verify=off"],
    "no adapters": ["--gpus", "auto", "-p", "no:gpu_adapters"],
    "lease only": ["--gpus", "auto", "-p", "no:gpu_adapters", "--gpu-verify=off"],
    "-p no:gpu": ["-p", "no:gpu"],
}


def run_torch(
    directory: Path, args: list[str], src: str | None, root: Path, n: int, probe: Path | None = None
) -> tuple[float, float]:
    """(wall seconds, CPU seconds: user + system of the pytest process and its children);
    ``probe``: where the probed arm writes its breakdown (``-p lease_probe``, from ``root``)."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:benchmark"]
    command += ["-p", "no:randomly", "-p", "no:xdist", *args, str(directory)]
    env = dict(os.environ)
    for name in [k for k in env if k.startswith("PYTEST_GPU_") or k in ("CUDA_VISIBLE_DEVICES", "PYTEST_ADDOPTS")]:
        del env[name]
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # every run would recompile torch's and pytest's imports otherwise
    env.update(
        PYTEST_GPU_FAKE_GPUS="sim:4x16GiB",
        PYTEST_GPU_SIM_LEDGER=str(root / f"ledger-{n}"),  # a machine of its own: no other run's GPUs
        PYTEST_GPU_MACHINE_DIR=str(root / f"machines-{n}"),
        PYTHONPYCACHEPREFIX=str(root / "pycache"),
    )
    if src:
        env["PYTHONPATH"] = src
    if probe is not None:
        env["PYTHONPATH"] = os.pathsep.join(x for x in (env.get("PYTHONPATH"), str(root / "probe")) if x)
        env["LEASE_PROBE_OUT"] = str(probe)
        command[4:4] = ["-p", "lease_probe"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return elapsed, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def torch_scenario(tests: int, runs: int, codes: list[tuple[str, str | None]]) -> None:
    breakdowns: dict[tuple[str, str], list[dict[str, float]]] = {(c, k): [] for c, _ in codes for k in ("wall", "cpu")}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        directory = root / "suite"
        directory.mkdir()
        (directory / "conftest.py").write_text(TORCH_CONFTEST)
        (directory / "test_tiny.py").write_text(TORCH_TEST.format(n=tests))
        (root / "probe").mkdir()
        (root / "probe" / "lease_probe.py").write_text(PROBE)
        names = [*TORCH_ARMS, "probed"]  # probed: the plugin arm with the timers, for the breakdown alone
        arms = [(code, src, name) for code, src in codes for name in names]

        def one(code: str, src: str | None, name: str, count: int) -> tuple[float, float]:
            if name != "probed":
                return run_torch(directory, TORCH_ARMS[name], src, root, count)
            out = root / f"probe-{count}.json"
            result = run_torch(directory, TORCH_ARMS["plugin"], src, root, count, probe=out)
            found = json.loads(out.read_text())
            for kind in ("wall", "cpu"):
                breakdowns[code, kind].append({part: found[kind].get(part, 0) / tests / 1e6 for part in PARTS})
            return result

        count = 0
        for code, src, name in arms:  # warm the bytecode cache (not counted)
            count += 1
            one(code, src, name, count)
        for found in breakdowns.values():
            found.clear()
        walls: dict[tuple[str, str], list[float]] = {(code, name): [] for code, _, name in arms}
        cpus: dict[tuple[str, str], list[float]] = {(code, name): [] for code, _, name in arms}
        print(f"load before: {uptime()}", flush=True)
        for i in range(runs):  # ABCDEF FEDCBA: a drift in machine load hits every arm alike
            for code, src, name in arms if i % 2 == 0 else arms[::-1]:
                count += 1
                wall, cpu = one(code, src, name, count)
                walls[code, name].append(wall)
                cpus[code, name].append(cpu)
                print(f"run {i + 1}: {code:8s} {name:12s} wall {wall:6.2f} s  cpu {cpu:6.2f} s", flush=True)
        print(f"load after: {uptime()}")
    for code, _ in codes:
        for what, figures in (("wall", walls), ("cpu", cpus)):
            medians = {name: statistics.median(figures[code, name]) for name in TORCH_ARMS}
            bare = medians["-p no:gpu"]
            costs = ", ".join(
                f"{name} {medians[name]:.2f} s ({(medians[name] - bare) / tests * 1000:+.1f} ms a test)"
                for name in TORCH_ARMS
                if name != "-p no:gpu"
            )
            head = f"{code}: torch, {tests} GPU tests, one process, {what} median of {runs}"
            print(f"{head}: -p no:gpu {bare:.2f} s; {costs}")
        print(f"{code}: one GPU test's cost, ms, min / median of {runs} (wall | CPU):")
        for name in ("plugin", "lease only"):
            row = []
            for figures in (walls, cpus):  # each round's arm less the same round's -p no:gpu
                pairs = zip(figures[code, name], figures[code, "-p no:gpu"], strict=True)
                cost = sorted((a - b) / tests * 1000 for a, b in pairs)
                row.append(f"{cost[0]:6.2f} / {statistics.median(cost):6.2f}")
            print(f"  {name + ' - (-p no:gpu)':40s} {row[0]}  | {row[1]}")
        for part in (*PARTS, "sum"):
            row = []
            for kind in ("wall", "cpu"):
                got = sorted(sum(p.values()) if part == "sum" else p.get(part, 0.0) for p in breakdowns[code, kind])
                row.append(f"{got[0]:6.2f} / {statistics.median(got):6.2f}")
            print(f"  {'probed: ' + part:40s} {row[0]}  | {row[1]}")


def uptime() -> str:
    """``uptime``'s line (the load the figures were taken under)."""
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def run(directory: Path, src: str | None) -> float:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:benchmark"]
    command += ["-p", "no:randomly", "-n", str(WORKERS), "--gpus", "sim:4x16GiB", str(directory)]
    env = dict(os.environ, PYTHONPATH=src) if src else None  # PYTHONPATH comes before the installed package
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{directory.name} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=int, default=200)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="40 tests, 1 run a side")
    parser.add_argument("--baseline-src", help="the src folder of another checkout, measured in the same rotation")
    parser.add_argument(
        "--scenario",
        choices=("sim", "torch"),
        default="sim",
        help="sim: simulated GPUs, -n 2, with and without a marker (default); torch: torch imported, fake GPUs, "
        "with the plugin, without its adapters and with -p no:gpu",
    )
    args = parser.parse_args()
    tests, runs = (40, 1) if args.quick else (args.tests, args.runs)
    codes: list[tuple[str, str | None]] = [("this", None)]
    if args.baseline_src:
        codes.append(("baseline", str(Path(args.baseline_src).resolve())))
    if args.scenario == "torch":
        codes[0] = ("this", str(Path(__file__).resolve().parents[1] / "src"))  # this checkout, not the installed one
        torch_scenario(tests, runs, codes)
        return
    with tempfile.TemporaryDirectory() as tmp:
        leased, plain = Path(tmp, "leased"), Path(tmp, "plain")
        for directory, mark in ((leased, '@pytest.mark.gpu(memory="1GiB")'), (plain, "")):
            directory.mkdir()
            (directory / "test_tiny.py").write_text(TEST.format(n=tests, mark=mark))
        arms = [(code, src, name, d) for code, src in codes for name, d in (("leased", leased), ("plain", plain))]
        times: dict[tuple[str, str], list[float]] = {(code, name): [] for code, _, name, _ in arms}
        for i in range(runs):  # ABBA: a drift in machine load hits every arm alike
            for code, src, name, directory in arms if i % 2 == 0 else arms[::-1]:
                times[code, name].append(run(directory, src))
                print(f"run {i + 1}: {code:8s} {name:6s} {times[code, name][-1]:6.2f} s", flush=True)
    for code, _ in codes:
        with_lease, without = statistics.median(times[code, "leased"]), statistics.median(times[code, "plain"])
        per_test = (with_lease - without) * WORKERS / tests * 1000
        print(
            f"{code}: {tests} tests, -n {WORKERS}, median of {runs}: with a lease {with_lease:.2f} s, "
            f"without {without:.2f} s; one lease costs about {per_test:.1f} ms of worker time per test"
        )


if __name__ == "__main__":
    main()
