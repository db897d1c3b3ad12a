"""Confinement: the environment, and the torch/CuPy adapters, against doubles as strict as CUDA.

torch's adapter runs against torch's CPU build given simulated CUDA
(:mod:`pytest_gpu.sim.torch_cuda`) in a fresh process per scenario, on GPUs the fake
``libnvidia-ml.so.1`` reports (``PYTEST_GPU_FAKE_GPUS``): the device list is fixed at
first use, ``set_device`` opens contexts, freed memory stays cached until
``empty_cache``. CuPy's runs against :mod:`pytest_gpu.sim.cupy_cuda`, whose pool acts on the current device
only and whose ``Device`` restores devices (opening contexts) as CuPy's does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from conftest import require
from helpers import patience
from pytest_gpu import sim
from pytest_gpu.gpu import runtime
from pytest_gpu.gpu.confine import confine
from pytest_gpu.gpu.isolation import TF_GROWTH, XLA_FRACTION, XLA_PREALLOCATE, make_lease
from pytest_gpu.sim import cupy_cuda
from pytest_gpu.sim.spec import parse
from pytest_gpu.vendors import nvidia
from pytest_gpu.vendors.devices import Device, Inventory
from pytest_gpu.vendors.nvidia import NVIDIA

GiB, MiB = 2**30, 2**20


def real_inventory(indices=(0, 1, 2, 3), total: int = 16 * GiB) -> Inventory:
    """Non-simulated devices, as NVML discovery would give them (the machine has 4)."""
    machine = tuple(Device(i, f"GPU-real-{i:04d}", total, "Fake GPU") for i in range(4))
    return Inventory(tuple(d for d in machine if d.index in indices), "nvml", machine=machine)


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", sim.TAG_ENV, XLA_FRACTION):
        # set first, so that monkeypatch restores each as it was, absent included: a test that ends
        # its leases out of order (a fixture's outliving the test's) must not leave them set
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    runtime.forget()  # each test is a new process: its CUDA not yet pinned
    yield monkeypatch
    runtime.forget()


PRELUDE = """
import json, os, sys
import torch
from pytest_gpu.sim import fake, torch_cuda, cuda as simcuda
assert fake.activate()
from pytest_gpu.gpu import runtime
from pytest_gpu.gpu.discovery import discover
from pytest_gpu.gpu.confine import confine
from pytest_gpu.gpu.isolation import make_lease
GiB, MiB = 2**30, 2**20
inv = discover(os.environ.get("GPUS", "auto"))
out = {}
def lease(key, indices, memory):
    return make_lease(key, indices, memory, False, 0.0, inv, "tag-" + key)
"""


def run_torch(tmp_path: Path, body: str, spec: str = "sim:4x16GiB", **env: str) -> dict:
    """Run ``body`` after PRELUDE in a fresh process on fake GPUs; it fills ``out``."""
    require("torch", module="torch")
    require("C compiler", executable="cc")  # the fake libnvidia-ml.so.1 is built from C
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_GPU_") and k != "CUDA_VISIBLE_DEVICES"}
    clean.update(PYTEST_GPU_FAKE_GPUS=spec, PYTEST_GPU_SIM_LEDGER=str(tmp_path / "ledger"), **env)
    code = PRELUDE + body + "\nprint('OUT', json.dumps(out))\n"
    done = subprocess.run(
        [sys.executable, "-c", code], env=clean, capture_output=True, text=True, timeout=patience(120)
    )
    assert done.returncode == 0, done.stdout + done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("OUT "))
    return json.loads(line[4:])


@pytest.mark.slow
def test_torch_gets_device_and_caps_on_leased_gpus_only(tmp_path):
    out = run_torch(
        tmp_path,
        """
a = lease("a", [1, 3], 4 * GiB)
out["device"], out["devices"], out["env"] = a.device, list(a.devices), a.visible_devices
done = confine(a, inv)
out["current"] = torch.cuda.current_device()
for d in (1, 3):
    blk = torch_cuda.empty(4 * GiB - 64 * MiB, device=d)  # fits the lease on each leased GPU
    blk.free()
try:
    torch_cuda.empty(4 * GiB + 64 * MiB, device=3)
    out["capped"] = False
except torch.OutOfMemoryError:
    out["capped"] = True
out["during"] = sorted(simcuda.contexts())
done.undo()
out["after"] = sorted(simcuda.contexts())
out["notes"] = done.notes
""",
    )
    # the worker's CUDA sees the whole machine: GPU 1 is cuda:1, not cuda:0
    assert out["device"] == "cuda:1" and out["devices"] == ["cuda:1", "cuda:3"]
    assert out["env"].startswith("GPU-") and out["current"] == 1
    assert out["capped"] is True  # the second GPU is capped too
    assert out["during"] == out["after"] == [1, 3]  # contexts on the leased GPUs only
    assert out["notes"] == []


@pytest.mark.slow
def test_cached_memory_of_an_earlier_test_is_neither_its_peak_nor_kept(tmp_path):
    """Item 2: reset_peak_memory_stats sets the peak to the current reserve: the cache must be empty first."""
    out = run_torch(
        tmp_path,
        """
a = confine(lease("a", [1], 12 * GiB), inv)
torch_cuda.empty(10 * GiB).free()          # freed, but cached by torch's allocator
out["cached"] = torch.cuda.memory_reserved(1)
a.undo()
out["reserved_after"] = torch.cuda.memory_reserved(1)
out["ledger_after"] = simcuda.usage()[1]
b = confine(lease("b", [1], 4 * GiB), inv)
torch_cuda.empty(1 * GiB).free()
out["peak_b"] = torch.cuda.max_memory_reserved(1)
b.undo()
""",
    )
    assert out["cached"] >= 10 * GiB
    assert out["reserved_after"] == 0  # given back at the end of the lease, not kept by the worker
    assert out["ledger_after"] == 512 * MiB or out["ledger_after"] <= 600 * MiB  # the context only
    assert out["peak_b"] < 2 * GiB  # the second test's own peak, not the first test's cache


@pytest.mark.slow
def test_undo_opens_no_context_outside_the_lease(tmp_path):
    """Item 3: going back to a device the process never used would open a context there (CUDA 12)."""
    out = run_torch(
        tmp_path,
        """
torch.cuda.init()  # torch initialised (current device 0), no context anywhere yet
out["before"] = sorted(simcuda.contexts())
done = confine(lease("a", [2], 4 * GiB), inv)
torch_cuda.empty(GiB).free()
done.undo()
out["after"] = sorted(simcuda.contexts())
out["current"] = torch.cuda.current_device()
""",
    )
    assert out["before"] == []
    assert out["after"] == [2]  # never a context on GPU 0
    assert out["current"] == 2


@pytest.mark.slow
def test_fraction_is_of_the_total_torch_sees(tmp_path):
    """Item 13: NVML's total includes the driver's reserve; torch's cap is a fraction of what CUDA sees."""
    out = run_torch(
        tmp_path,
        """
done = confine(lease("a", [1], 4 * GiB), inv)
blk = torch_cuda.empty(4 * GiB - 2 * MiB)  # the whole lease (less a block's rounding)
blk.free()
try:
    torch_cuda.empty(4 * GiB + 32 * MiB)
    out["over"] = "allowed"
except torch.OutOfMemoryError:
    out["over"] = "refused"
done.undo()
""",
        spec="sim:4x16GiB;reserved=1%",
    )
    assert out["over"] == "refused"


def test_no_framework_loaded_imports_none(clean_env):
    for name in ("torch", "cupy"):
        clean_env.delitem(sys.modules, name, raising=False)
    inventory = real_inventory()
    lease = make_lease("k", [2], GiB, False, 0.0, inventory, "t")
    assert lease.device == "cuda:2"  # the worker's CUDA is pinned to the run's list first
    done = confine(lease, inventory)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "GPU-real-0002"
    done.undo()
    assert "torch" not in sys.modules
    assert "cupy" not in sys.modules
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_index_list_ordinals_are_physical_without_an_outer_list(clean_env):
    """Item 1: --gpus 0,2,3 with no outer CUDA_VISIBLE_DEVICES: CUDA still numbers all 4 GPUs."""
    inventory = real_inventory(indices=(0, 2, 3))
    lease = make_lease("k", [2], GiB, False, 0.0, inventory, "t")
    assert lease.device == "cuda:2"  # not its position in the inventory (cuda:1 = physical 1, excluded)
    clean_env.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    runtime.forget()  # another run, started under CUDA_VISIBLE_DEVICES=2,3
    outer = Inventory(inventory.devices[1:], "nvml", machine=inventory.machine, visible="2,3")
    assert make_lease("k", [3], GiB, False, 0.0, outer, "t").device == "cuda:1"


def test_lease_env_sets_jax_and_tensorflow_memory_behaviour(clean_env):
    """Item 14: JAX preallocates 75 % of every visible GPU, TF all of it, unless told otherwise."""
    inventory = Inventory(parse("sim:2x16GiB").devices()[0], "sim:2x16GiB")
    lease = make_lease("k", [1], 4 * GiB, False, 0.0, inventory, "tag-1")
    assert lease.env[XLA_PREALLOCATE] == "false"
    assert lease.env[XLA_FRACTION] == "0.2500"
    assert lease.env[TF_GROWTH] == "true"
    done = confine(lease, inventory)
    assert os.environ[XLA_FRACTION] == "0.2500"
    done.undo()
    assert XLA_FRACTION not in os.environ


def test_simulated_lease_sets_the_tag_and_the_current_device(clean_env, tmp_path):
    clean_env.setenv(sim.LEDGER_ENV, str(tmp_path / "ledger"))
    clean_env.setenv(sim.SPEC_ENV, "sim:2x16GiB")
    sim.cuda.forget()
    inventory = Inventory(parse("sim:2x16GiB").devices()[0], "sim:2x16GiB")
    lease = make_lease("k", [1], 2 * GiB, False, 0.0, inventory, "tag-1")
    assert lease.visible_devices == "1"
    assert lease.env[sim.TAG_ENV] == "tag-1"
    assert lease.device == "cuda:1"
    done = confine(lease, inventory)
    assert os.environ[sim.TAG_ENV] == "tag-1"
    assert sim.current_device() == 1
    with sim.allocate("1GiB") as block:
        assert block.physical == 1
    done.undo()
    assert sim.TAG_ENV not in os.environ
    assert sim.cuda.contexts() == {1}  # no context opened on GPU 0 by going back
    sim.cuda.forget()


def cupy_on_sim(monkeypatch, tmp_path):
    """The CuPy stand-in (:mod:`pytest_gpu.sim.cupy_cuda`) on a private simulated machine, as ``cupy``."""
    monkeypatch.setenv(sim.LEDGER_ENV, str(tmp_path / "ledger"))
    monkeypatch.setenv(sim.SPEC_ENV, "sim:4x16GiB")
    sim.cuda.forget()
    cupy = cupy_cuda.module()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    return cupy


def test_cupy_stand_in_restores_devices_as_cupy_does(clean_env, tmp_path):
    """CuPy's ``Device.__exit__`` calls setDevice on the device it found, unconditionally: a
    context opens there (CUDA 12); ``set_limit`` acts on the current device's pool only."""
    cupy = cupy_on_sim(clean_env, tmp_path)
    with cupy.cuda.Device(1):
        cupy.get_default_memory_pool().set_limit(size=GiB)
    assert sim.cuda.current_device() == 0
    assert sim.cuda.contexts() == {0, 1}  # the way back opened GPU 0's context
    pool = cupy.get_default_memory_pool()
    assert pool.get_limit() == 0
    cupy.cuda.Device(1).use()
    assert pool.get_limit() == GiB
    block = pool.malloc("768MiB")
    with pytest.raises(cupy_cuda.OutOfMemoryError, match="limit set to"):
        pool.malloc("512MiB")
    block.free()
    assert pool.total_bytes() == 768 * MiB  # cached until free_all_blocks
    pool.free_all_blocks()
    assert pool.total_bytes() == 0
    sim.cuda.forget()


def test_cupy_limits_every_leased_gpu_and_opens_no_context_outside(clean_env, tmp_path):
    """Item 13 and issue 19 (6): the adapter caps each leased GPU's pool, never sets a device
    outside the lease (a `with Device(k)` would go back to GPU 0 and open its context) and
    finishes on the lease's first ordinal; its undo lifts the caps, again inside the lease."""
    cupy = cupy_on_sim(clean_env, tmp_path)
    pool = cupy.get_default_memory_pool()
    inventory = real_inventory()  # real GPUs: no simulated confinement moves the device first
    lease = make_lease("k", [2, 3], 3 * GiB, False, 0.0, inventory, "t")
    done = confine(lease, inventory)
    assert sim.cuda.current_device() == 2
    assert sim.cuda.contexts() == {2, 3}  # none on GPU 0, where the process started
    limits = {}
    for ordinal in (2, 3):  # they have contexts: making them current opens none
        cupy.cuda.Device(ordinal).use()
        limits[ordinal] = pool.get_limit()
    limits.update({i: pool._pools[i].limit for i in (0, 1)})  # the stand-in's own table: no device switch
    assert limits == {0: 0, 1: 0, 2: 3 * GiB, 3: 3 * GiB}
    done.undo()
    assert sim.cuda.current_device() == 2
    assert sim.cuda.contexts() == {2, 3}
    for ordinal in (2, 3):
        cupy.cuda.Device(ordinal).use()
        assert pool.get_limit() == 0
    sim.cuda.forget()


def test_cupy_pool_limit_is_each_leases_own_budget_on_top(clean_env, tmp_path):
    """CuPy's pool limit follows the rule torch's fraction does: a lease begun while the pool
    holds a fixture's arrays gets its own budget on top of them; its end gives the fixture's
    limit back, and the last lease's end the limit the pool had before any lease."""
    cupy = cupy_on_sim(clean_env, tmp_path)
    pool = cupy.get_default_memory_pool()
    inventory = real_inventory()
    cupy.cuda.Device(2).use()
    pool.set_limit(size=10 * GiB)  # the suite's own limit
    fixture = confine(make_lease("f", [2], 4 * GiB, False, 0.0, inventory, "f"), inventory)
    model = pool.malloc("2GiB")
    test = confine(make_lease("t", [2], 1 * GiB, False, 0.0, inventory, "t"), inventory)
    assert pool.get_limit() == 3 * GiB  # 2GiB held + its own 1GiB (not 4 + 1)
    test.undo()
    cupy.cuda.Device(2).use()
    assert pool.get_limit() == 4 * GiB  # the fixture's own
    model.free()
    fixture.undo()
    cupy.cuda.Device(2).use()
    assert pool.get_limit() == 10 * GiB
    sim.cuda.forget()


def test_plugin_never_imports_torch(gpu_pytester, run_inner):
    """A CPU-only suite (and a simulated-GPU one) with the plugin loaded does not import torch."""
    out = gpu_pytester.path / "modules.txt"
    gpu_pytester.makeconftest(
        f"""
        import sys

        def pytest_unconfigure(config):
            with open({str(out)!r}, "w") as f:
                f.write(repr(("torch" in sys.modules, "cupy" in sys.modules, "pytest_gpu.plugin" in sys.modules)))
        """
    )
    gpu_pytester.makepyfile(
        test_cpu="""
        import sys
        import pytest
        from pytest_gpu import sim

        def test_cpu(port):
            assert "torch" not in sys.modules

        @pytest.mark.gpu(memory="1GiB")
        def test_sim(gpu):
            sim.hold("512MiB", 0.01)
            assert "torch" not in sys.modules
        """
    )
    result = run_inner("--gpus", "sim:1x16GiB", subprocess=True)
    result.assert_outcomes(passed=2)
    assert out.read_text() == repr((False, False, True))


@pytest.fixture
def sim_machine(clean_env, tmp_path):
    """A simulated 2x16GiB machine for in-process confinement, and its inventory."""
    clean_env.setenv(sim.LEDGER_ENV, str(tmp_path / "ledger"))
    clean_env.setenv(sim.SPEC_ENV, "sim:2x16GiB")
    sim.cuda.forget()
    yield Inventory(parse("sim:2x16GiB").devices()[0], "sim:2x16GiB")
    sim.cuda.forget()


def _sim_lease(inventory: Inventory, key: str, memory: int):
    return confine(make_lease(key, [1], memory, False, 0.0, inventory, f"tag-{key}"), inventory)


def test_a_section_is_capped_at_its_own_budget_on_top_of_the_test(sim_machine):
    """A gpu_request section on the main lease's GPU: its own budget on top of what the test holds
    (its verdict judges it against that budget alone); ending it gives the main lease its own cap."""
    main = _sim_lease(sim_machine, "m", 2 * GiB)
    kept = sim.allocate("512MiB")  # the test's own, before the section
    section = _sim_lease(sim_machine, "s", 1 * GiB)
    sim.allocate("1GiB").free()  # the section's budget, on top of the test's 512MiB
    with pytest.raises(sim.OutOfMemoryError, match=r"capped at 1\.5GiB"):  # not main + section: 3GiB
        sim.allocate("1.25GiB")
    section.undo()
    sim.allocate("1.5GiB").free()  # the main lease's own cap again: 2GiB in all, its 512MiB counted
    with pytest.raises(sim.OutOfMemoryError, match="capped at 2GiB"):
        sim.allocate("1.75GiB")
    kept.free()
    main.undo()
    with sim.allocate("2.5GiB"):  # no lease: no cap
        pass


def test_a_lease_beside_a_fixtures_gets_its_own_budget_on_top_of_it(sim_machine):
    """Item 5: a fixture's lease in the same process does not raise a test's cap (the test's
    verdict must not depend on -n): the test gets its own budget on top of the fixture's memory;
    once the test ends, the fixture's own cap is back."""
    fixture = _sim_lease(sim_machine, "f", 3 * GiB)
    model = sim.allocate("2GiB")  # the fixture's tensors
    test = _sim_lease(sim_machine, "t", 1 * GiB)
    sim.allocate("1GiB").free()  # the test's budget, beside the fixture's 2GiB
    with pytest.raises(sim.OutOfMemoryError, match=r"capped at 3GiB"):  # 2 + 1, not 2 + 3 + 1
        sim.allocate("1.5GiB")
    test.undo()
    sim.allocate("1GiB").free()  # the fixture's own 3GiB again (2GiB of it in use)
    with pytest.raises(sim.OutOfMemoryError, match=r"capped at 3GiB"):
        sim.allocate("1.5GiB")
    model.free()
    fixture.undo()


def test_a_fixture_set_up_during_a_test_leaves_the_test_its_own_budget(sim_machine):
    """A module fixture leases during the first test's setup (after the test's lease began) and
    outlives it: while it is set up its own cap holds; once the test resumes, the test's cap is its
    own budget on top of what the fixture allocated (not squeezed by it, not widened by it)."""
    test = _sim_lease(sim_machine, "t", 1 * GiB)
    fixture = _sim_lease(sim_machine, "f", 3 * GiB)
    model = sim.allocate("2.5GiB")  # the fixture's setup: within its 3GiB
    test.resume()
    sim.allocate("1GiB").free()
    with pytest.raises(sim.OutOfMemoryError, match=r"capped at 3\.5GiB"):
        sim.allocate("1.25GiB")
    test.undo()  # the test ends first, the fixture lives on
    sim.allocate("512MiB").free()  # the fixture's cap: 3GiB of its own
    with pytest.raises(sim.OutOfMemoryError, match=r"capped at 3GiB"):
        sim.allocate("768MiB")
    model.free()
    fixture.undo()
    with sim.allocate("4GiB"):
        pass


def test_what_an_ended_lease_left_is_not_taken_from_the_next(sim_machine):
    """Item 4: memory a test left behind (a leak, reported on it) is not taken from the next
    test's budget: its cap is its own budget on top of what the process still holds."""
    leaky = _sim_lease(sim_machine, "a", 1 * GiB)
    leak = sim.allocate("600MiB")
    leaky.undo()
    after = _sim_lease(sim_machine, "b", 1 * GiB)
    sim.allocate("1GiB").free()  # 600MiB + its own 1GiB: not "capped at 1GiB" with 424MiB free
    with pytest.raises(sim.OutOfMemoryError, match=r"capped at 1\.6GiB"):
        sim.allocate("1.25GiB")
    after.undo()
    leak.free()


def test_a_failing_adapter_undoes_what_was_applied(clean_env, tmp_path):
    clean_env.setenv(sim.LEDGER_ENV, str(tmp_path / "ledger"))
    clean_env.setenv(sim.SPEC_ENV, "sim:2x16GiB")
    sim.cuda.forget()

    class Pool:
        def free_all_blocks(self) -> None:
            raise RuntimeError("cupy says no")

    class Device:
        def __init__(self, ordinal: int) -> None:
            pass

        def use(self) -> Device:
            return self

        def __enter__(self) -> Device:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(Device=Device)
    cupy.get_default_memory_pool = lambda: Pool()
    clean_env.setitem(sys.modules, "cupy", cupy)
    inventory = Inventory(parse("sim:2x16GiB").devices()[0], "sim:2x16GiB")
    with pytest.raises(RuntimeError, match="cupy says no"):
        confine(make_lease("k", [1], GiB, False, 0.0, inventory, "tag-1"), inventory)
    assert sim.TAG_ENV not in os.environ
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    with sim.allocate("2GiB", device=1):  # the sim cap set before the failure was lifted
        pass
    sim.cuda.forget()


@pytest.mark.slow
def test_torch_sections_and_lazy_start(tmp_path):
    """Sections on the main lease's GPU and elsewhere; torch's CUDA is started only when the test uses it."""
    out = run_torch(
        tmp_path,
        """
main = confine(lease("m", [1], 4 * GiB), inv)
out["started_by_confine"] = torch.cuda.is_initialized()  # deferred with torch.cuda._lazy_call
kept = torch_cuda.empty(3 * GiB)  # the test starts CUDA: the confinement applies now
out["current"] = torch.cuda.current_device()
same = confine(lease("s", [1], 2 * GiB), inv)
def fits(nbytes):
    try:
        torch_cuda.empty(nbytes).free()
        return True
    except torch.OutOfMemoryError:
        return False
out["section"] = [fits(2 * GiB), fits(3 * GiB)]  # its own 2GiB on top of the test's 3GiB, not 4 + 2
same.undo()
out["section_peak"] = same.peaks[1]  # the section's own, above the test's 3GiB
out["after_same"] = [fits(GiB), fits(2 * GiB)]  # the main lease's own cap again: 1GiB of it left
other = confine(lease("o", [2], 2 * GiB), inv)
torch_cuda.empty(GiB).free()
other.undo()
out["current_after_other"] = torch.cuda.current_device()  # back on the main lease's GPU
kept.free()
main.undo()
out["main_peak"] = main.peaks[1]  # its own, the section's 2GiB window not in it
""",
    )
    assert out["started_by_confine"] is False
    assert out["current"] == 1
    assert out["section"] == [True, False]
    assert out["section_peak"] == 2 * GiB
    assert out["after_same"] == [True, False]
    assert out["main_peak"] == 4 * GiB  # 3GiB kept + 1GiB tried after the section
    assert out["current_after_other"] == 1


@pytest.mark.slow
def test_undo_with_a_torch_whose_fraction_call_switches_device(tmp_path):
    """Item 3 on torch < 2.10: setMemoryFraction calls SetDevice and leaves it there."""
    out = run_torch(
        tmp_path,
        """
torch_cuda.install(torch, legacy_memory_fraction=True)
torch.cuda.init()
done = confine(lease("a", [1, 3], 2 * GiB), inv)
out["during"] = torch.cuda.current_device()
done.undo()
out["after"] = torch.cuda.current_device()
out["contexts"] = sorted(simcuda.contexts())
""",
    )
    assert out["during"] == 1
    assert out["after"] == 1  # not left on GPU 3, where the last fraction reset switched it
    assert out["contexts"] == [1, 3]  # and never a context on GPU 0, where the process started


@pytest.mark.slow
def test_a_torch_that_caches_device_count_at_first_call_still_gets_its_cap(tmp_path):
    """Issue 19 (6) on torch 2.0-2.3: device_count is lru_cache'd at its first call; when CUDA
    starts inside a lease that count is the lease's (1 GPU), and get_device_properties(2) asserts
    2 < 1. The adapter reads the total without that check, so the cap still holds."""
    out = run_torch(
        tmp_path,
        """
torch_cuda.install(torch, legacy_device_count=True)
done = confine(lease("a", [2], 2 * GiB), inv)  # torch loaded, CUDA not started: applied at lazy init
torch_cuda.empty(GiB, device=2).free()  # CUDA starts inside the lease
out["cached_count"] = torch.cuda.device_count()  # the lease's narrowed view, kept for good
try:
    torch_cuda.empty(3 * GiB, device=2)
    out["over_budget"] = "allowed"
except torch.OutOfMemoryError:
    out["over_budget"] = "refused"
out["notes"] = done.notes
done.undo()
""",
    )
    assert out["cached_count"] == 1  # the double is as strict as that torch
    assert out["over_budget"] == "refused"
    assert out["notes"] == []


def test_real_ordinals_come_from_what_the_driver_enumerates(clean_env, monkeypatch):
    """After cuInit the driver's own device UUIDs decide the ordinals (a GPU NVML refused still counts)."""
    inventory = real_inventory(indices=(0, 2))  # NVML gave GPUs 0 and 2 to the run; the machine has 4
    hexes = {d.index: NVIDIA.runtime_id(d.uuid) for d in inventory.machine}
    monkeypatch.setattr(nvidia, "cu_init", lambda: ([hexes[0], hexes[3], hexes[2]], ""))
    assert runtime.pin(inventory) == [0, 3, 2]
    assert make_lease("k", [2], GiB, False, 0.0, inventory, "t").device == "cuda:2"
    runtime.forget()
    # a UUID no NVML device has: the view is predicted from CUDA_VISIBLE_DEVICES at the pin
    monkeypatch.setattr(nvidia, "cu_init", lambda: (["ff" * 16], ""))
    assert runtime.pin(inventory) == [0, 1, 2, 3]


def test_a_lease_names_the_ordinals_of_the_pinned_cuda(clean_env, monkeypatch):
    """The first lease of a process pins CUDA before naming its device, so device and confinement agree."""
    inventory = real_inventory(indices=(0, 2))
    hexes = {d.index: NVIDIA.runtime_id(d.uuid) for d in inventory.machine}
    monkeypatch.setattr(nvidia, "cu_init", lambda: ([hexes[2], hexes[0]], ""))  # the driver's own order
    lease = make_lease("k", [2], GiB, False, 0.0, inventory, "t")
    assert lease.device == "cuda:0"
