"""pytest_gpu.gpu.foreign: what processes outside pytest-gpu use on the GPUs, through NVML.

NVML is the fake ``libnvidia-ml.so.1`` of a simulated machine, loaded by the real
nvidia-ml-py in a sampler process of its own (the fake switch changes a process for good);
foreign processes are ``python -m pytest_gpu.sim hold`` holders on that machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import pytest

from conftest import Holder, require
from helpers import patience
from pytest_gpu.gpu.foreign import Foreign, ForeignProcess, ForeignSampler, descends_from
from pytest_gpu.sim.spec import gpu_uuid, mig_uuid

MiB, GiB = 2**20, 2**30
OVERHEAD = 500 * MiB  # the simulated machine's CUDA context

SERVER = textwrap.dedent(
    """
    import json, sys
    from pytest_gpu.sim import fake
    assert fake.activate()
    from pytest_gpu.gpu.foreign import ForeignSampler

    sampler = ForeignSampler(json.loads(sys.argv[1]))
    print(json.dumps({"ready": sampler.unavailable}), flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        if ask.get("close"):
            sampler.close()
            continue
        if ask.get("call"):
            print(json.dumps(sampler(ask["uuids"], set(ask["roots"]))), flush=True)
            continue
        roots = {int(k): v for k, v in ask["ctimes"].items()} if "ctimes" in ask else set(ask["roots"])
        found = sampler.sample(roots, ask.get("accounted"))
        print(json.dumps({u: [f.bytes, [list(p) for p in f.processes], f.note] for u, f in found.items()}), flush=True)
    """
)


class Sampler:
    """A :class:`ForeignSampler` on the fake NVML of simulated machine ``name``, in its own process."""

    def __init__(self, spec: str, name: str, uuids: list[str]) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_GPU_SIM", "CUDA_VISIBLE"))}
        env.update(PYTEST_GPU_FAKE_GPUS=spec, PYTEST_GPU_SIM_MACHINE=name)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, json.dumps(uuids)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert json.loads(self._read()) == {"ready": None}

    def _read(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the sampler died (exit {self.proc.wait(timeout=patience(30))})"
        return line

    def _ask(self, request: dict[str, Any]) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._read())

    def sample(self, roots: Any = (), accounted: dict[str, int] | None = None) -> dict[str, Foreign]:
        request: dict[str, Any] = {"accounted": accounted}
        if isinstance(roots, dict):
            request["ctimes"] = roots
        else:
            request["roots"] = sorted(roots)
        answer = self._ask(request)
        return {u: Foreign(n, tuple(ForeignProcess(*p) for p in procs), note) for u, (n, procs, note) in answer.items()}

    def call(self, uuids: list[str], roots: set[int]) -> dict[str, int]:
        return self._ask({"call": True, "uuids": uuids, "roots": sorted(roots)})

    def close_sampler(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"close": True}) + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=patience(30))
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture
def machine(hold: Callable[..., Holder]) -> Iterator[Callable[..., tuple[Sampler, Callable[..., Holder]]]]:
    """``machine(spec, uuids)``: a fresh simulated machine; returns its sampler and a holder starter."""
    require("C compiler", executable="cc")  # the fake libnvidia-ml.so.1 is built from C
    samplers: list[Sampler] = []

    def make(spec: str, uuids: list[str]) -> tuple[Sampler, Callable[..., Holder]]:
        name = f"f-{uuid.uuid4().hex[:10]}"

        def holder(gpu: int, memory: str) -> Holder:
            return hold("--machine", name, "--spec", spec, "--gpu", str(gpu), "--memory", memory)

        sampler = Sampler(spec, name, uuids)
        samplers.append(sampler)
        return sampler, holder

    yield make
    for sampler in samplers:
        sampler.stop()


GPU0, GPU1 = gpu_uuid(0), gpu_uuid(1)


# -- per process ------------------------------------------------------------------------------


def _name(pid: int) -> str:
    return psutil.Process(pid).name()


@pytest.mark.slow
def test_a_holder_is_foreign_with_its_pid_and_bytes(machine) -> None:
    sampler, hold = machine("sim:2x4GiB", [GPU0, GPU1])
    holder = hold(1, "1GiB")
    found = sampler.sample()
    assert found[GPU0] == Foreign(0, (), None)
    assert found[GPU1] == Foreign(
        GiB + OVERHEAD, (ForeignProcess(holder.pid, GiB + OVERHEAD, _name(holder.pid)),), None
    )
    assert sampler.call([GPU1], set()) == {GPU1: GiB + OVERHEAD}  # the arbiter's ForeignSource


@pytest.mark.slow
def test_a_root_and_its_children_are_ours(machine) -> None:
    sampler, hold = machine("sim:2x4GiB", [GPU0, GPU1])
    holder = hold(1, "1GiB")
    assert sampler.sample({holder.pid})[GPU1] == Foreign(0, (), None)
    assert sampler.sample({os.getpid()})[GPU1] == Foreign(0, (), None)  # this process started it
    me = psutil.Process().create_time()
    assert sampler.sample({os.getpid(): me})[GPU1].bytes == 0
    assert sampler.sample({os.getpid(): me - 5})[GPU1].bytes == GiB + OVERHEAD  # a recycled root pid


@pytest.mark.slow
def test_a_killed_holder_is_gone_on_the_next_sample(machine) -> None:
    sampler, hold = machine("sim:2x4GiB", [GPU0, GPU1])
    holder, other = hold(1, "1GiB"), hold(1, "512MiB")
    assert sampler.sample()[GPU1].bytes == 1536 * MiB + 2 * OVERHEAD
    holder.kill()
    assert sampler.sample()[GPU1].processes == (ForeignProcess(other.pid, 512 * MiB + OVERHEAD, _name(other.pid)),)
    other.kill(reap=False)  # a zombie: the driver freed its memory at exit
    deadline = time.monotonic() + patience(10)
    while psutil.Process(other.pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert sampler.sample()[GPU1] == Foreign(0, (), None)


@pytest.mark.slow
def test_an_old_driver_without_v3_records_still_lists_processes(machine) -> None:
    sampler, hold = machine("sim:2x4GiB;no-v3", [GPU1])
    holder = hold(1, "1GiB")
    assert sampler.sample()[GPU1].processes == (ForeignProcess(holder.pid, GiB + OVERHEAD, _name(holder.pid)),)


# -- by difference ----------------------------------------------------------------------------


@pytest.mark.slow
def test_host_pids_in_a_container_are_estimated_by_difference(machine) -> None:
    sampler, hold = machine("sim:2x4GiB;pidns=5000000", [GPU0, GPU1])
    holder, other = hold(1, "1GiB"), hold(0, "512MiB")
    found = sampler.sample({holder.pid}, {GPU1: 256 * MiB})  # its pid, even: NVML reports another one
    assert found[GPU1].bytes == GiB + OVERHEAD - 256 * MiB
    assert found[GPU1].processes == ()
    note = found[GPU1].note
    assert note is not None
    hidden = ", ".join(str(pid + 5000000) for pid in sorted([holder.pid, other.pid]))
    assert f"NVML reports processes ({hidden}) that do not exist in this pid namespace (a container?)" in note
    assert f"foreign usage on {GPU1} is its used memory less the 256MiB pytest-gpu accounts for" in note
    assert found[GPU0].bytes == 512 * MiB + OVERHEAD
    holder.kill()
    found = sampler.sample((), {GPU1: 256 * MiB})
    assert found[GPU1].bytes == 0  # the driver freed it at its exit (the ledger has not been written since)
    assert found[GPU0].bytes == 512 * MiB + OVERHEAD


@pytest.mark.slow
def test_a_gpu_that_refuses_process_lists_is_estimated_by_difference(machine) -> None:
    inst = mig_uuid(0, 0)
    sampler, hold = machine("sim:1x16GiB;mig:0=2x8GiB", [inst, mig_uuid(0, 1)])
    holder = hold(1, "2GiB")  # unit 1: the GPU's first MIG instance
    found = sampler.sample(set(), {inst: 0})
    assert found[inst].bytes == 2 * GiB + OVERHEAD
    assert found[inst].note is not None and "NVML cannot list the processes there (Insufficient Permissions)" in (
        found[inst].note
    )
    assert found[mig_uuid(0, 1)].bytes == 0
    holder.kill()
    assert sampler.sample(set(), {inst: 0})[inst].bytes == 0


@pytest.mark.slow
def test_a_gpu_nvml_refuses_is_unknown_and_said(machine) -> None:
    sampler, hold = machine("sim:2x4GiB;fault:0=no_permission", [GPU0, GPU1])
    holder = hold(1, "1GiB")
    found = sampler.sample()
    assert found[GPU0] == Foreign(
        0, (), f"NVML refuses {GPU0} (Insufficient Permissions): its foreign usage is unknown"
    )
    assert found[GPU1].processes == (ForeignProcess(holder.pid, GiB + OVERHEAD, _name(holder.pid)),)


@pytest.mark.slow
def test_a_closed_sampler_says_so(machine) -> None:
    sampler, _ = machine("sim:2x4GiB", [GPU0])
    sampler.close_sampler()
    assert sampler.sample()[GPU0] == Foreign(0, (), "the sampler was closed: foreign GPU usage is unknown")


def test_without_nvml_every_gpu_is_unknown() -> None:
    with ForeignSampler([GPU0]) as sampler:
        if sampler.unavailable is None:
            pytest.skip("NVML works in this process (a real GPU machine, or the fake NVML loaded)")
        found = sampler.sample(set())
    assert found[GPU0].bytes == 0
    assert found[GPU0].note is not None and found[GPU0].note.startswith("NVML unavailable (")


# -- whose processes ----------------------------------------------------------------------------


def _spawn(code: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_descends_from() -> None:
    child = _spawn("import sys; sys.stdin = None; print('up', flush=True); import time; time.sleep(60)")
    try:
        assert child.stdout is not None and child.stdout.readline() == "up\n"
        me = os.getpid()
        assert descends_from(child.pid, {me})
        assert descends_from(child.pid, {child.pid})
        assert not descends_from(child.pid, set())
        assert not descends_from(me, {child.pid})  # a parent is not a child
        ctime = psutil.Process().create_time()
        assert descends_from(child.pid, {me: ctime})
        assert descends_from(child.pid, {me: ctime - 1})  # psutil's whole-second boot time moved (NTP)
        assert not descends_from(child.pid, {me: ctime - 60})  # that pid was someone else's
    finally:
        child.kill()
        child.wait()
    assert not descends_from(child.pid, {os.getpid()})  # gone
    assert not descends_from(child.pid, {os.getpid(): 0.0})


def test_an_orphan_of_a_dead_root_is_foreign() -> None:
    middle = _spawn(
        "import subprocess, sys\n"
        "orphan = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(orphan.pid, flush=True)\n"
    )
    assert middle.stdout is not None
    orphan = int(middle.stdout.readline())
    middle.wait(timeout=patience(30))
    try:
        assert not descends_from(orphan, {middle.pid})  # re-parented to init (or a subreaper)
        assert not descends_from(orphan, {os.getpid()})
    finally:
        psutil.Process(orphan).kill()


def test_a_zombie_is_not_ours_and_does_not_raise() -> None:
    child = _spawn("pass")
    deadline = time.monotonic() + patience(10)
    while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        assert isinstance(descends_from(child.pid, {os.getpid(): psutil.Process().create_time()}), bool)
    finally:
        child.wait()


@pytest.mark.slow
def test_a_holder_on_another_machine_is_not_seen(machine, hold: Callable[..., Holder]) -> None:
    """Two simulated machines are two machines."""
    sampler, _ = machine("sim:2x4GiB", [GPU1])
    hold("--machine", f"o-{uuid.uuid4().hex[:8]}", "--spec", "sim:2x4GiB", "--gpu", "1", "--memory", "1GiB")
    assert sampler.sample()[GPU1] == Foreign(0, (), None)


# -- NVML's answers the fake NVML does not give ---------------------------------------------------


class _NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


def _stub_nvml(compute: list[tuple[int, int | None]], graphics: list[tuple[int, int | None]] | None) -> Any:
    """A pynvml whose one GPU has these process lists (``graphics=None``: that list is refused)."""
    from types import SimpleNamespace

    def records(pairs: list[tuple[int, int | None]]) -> list[Any]:
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in pairs]

    def graphics_list(handle: object) -> list[Any]:
        if graphics is None:
            raise _NVMLError(3)  # NOT_SUPPORTED
        return records(graphics)

    return SimpleNamespace(
        NVMLError=_NVMLError,
        NVML_ERROR_FUNCTION_NOT_FOUND=13,
        NVML_ERROR_NOT_SUPPORTED=3,
        nvmlMemory_v2=2,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetHandleByUUID=lambda uuid: uuid,
        nvmlDeviceGetMemoryInfo=lambda handle, version=None: SimpleNamespace(used=3 * GiB, reserved=GiB),
        nvmlDeviceGetComputeRunningProcesses_v3=lambda handle: records(compute),
        nvmlDeviceGetGraphicsRunningProcesses_v3=graphics_list,
    )


def test_a_process_in_both_lists_counts_once(monkeypatch: pytest.MonkeyPatch) -> None:
    me = os.getpid()
    monkeypatch.setitem(sys.modules, "pynvml", _stub_nvml([(me, 100)], [(me, 100)]))
    with ForeignSampler([GPU0]) as sampler:
        assert sampler.sample(set())[GPU0] == Foreign(100, (ForeignProcess(me, 100, _name(me)),), None)
        assert sampler.sample({me})[GPU0] == Foreign(0, (), None)


def test_a_refused_graphics_list_leaves_the_compute_list(monkeypatch: pytest.MonkeyPatch) -> None:
    me = os.getpid()
    monkeypatch.setitem(sys.modules, "pynvml", _stub_nvml([(me, 100)], None))
    with ForeignSampler([GPU0]) as sampler:
        assert sampler.sample(set())[GPU0].bytes == 100


def test_memory_nvml_does_not_report_is_estimated_by_difference(monkeypatch: pytest.MonkeyPatch) -> None:
    me, parent = os.getpid(), os.getppid()
    monkeypatch.setitem(sys.modules, "pynvml", _stub_nvml([(me, 100), (parent, None)], []))
    with ForeignSampler([GPU0], accounted=lambda: {GPU0: GiB}) as sampler:
        found = sampler.sample(set())[GPU0]
    assert found.bytes == 2 * GiB  # used (reserve excluded) less what pytest-gpu accounts for
    assert set(found.processes) == {ForeignProcess(me, 100, _name(me)), ForeignProcess(parent, 0, _name(parent))}
    assert found.note == (
        f"NVML does not say how much memory process {parent} uses: foreign usage on {GPU0} is its used "
        "memory less the 1GiB pytest-gpu accounts for"
    )
