"""Intel Sysman as the driver really behaves (issue 31): zesInit after a legacy zeInit, one Sysman
per process (and one per forked child), one DRM client under two fds, torch.xpu without the
memory fraction API. Each runs in a fresh interpreter: Level Zero's state is per process."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any

import pytest
from test_xpu import run_level_zero

from conftest import require, run_fake_python

GiB, MiB = 2**30, 2**20

INVENTORY = """
from pytest_gpu.gpu import runtime
from pytest_gpu.sim.spec import xpu_uuid
from pytest_gpu.vendors import intel
from pytest_gpu.vendors.devices import Device, Inventory
from pytest_gpu.vendors.intel import XPU
from pytest_gpu.vendors.sampling import Unavailable
machine = tuple(Device(i, xpu_uuid(i), 64 << 30) for i in range(4))
outer = XPU.outer(os.environ)
inventory = Inventory(tuple(machine[i] for i in XPU.view(machine, outer)), "sysman", "", machine, None, "xpu", outer)

def sample(index):
    try:
        return XPU.sampler().memory(xpu_uuid(index))[0]
    except Unavailable as exc:
        return f"unavailable: {exc}"
"""


def test_the_fake_models_legacy_sysman_init(tmp_path: Path) -> None:
    """compute-runtime: after a zeInit under ZES_ENABLE_SYSMAN=1, zesInit fails on a product without
    zesInit support, for good (call_once); Sysman then takes the core API's masked handles. A product
    with zesInit support leaves legacy mode at zesInit."""
    code = """
    out["zeinit"] = lib.zeInit(U32(0))
    out["zesinit"] = lib.zesInit(U32(0))
    out["again"] = lib.zesInit(U32(0))
    n = U32(0)
    out["zes_driver"] = lib.zesDriverGet(ctypes.byref(n), None)
    drivers = (ctypes.c_void_p * 1)()
    lib.zeDriverGet(ctypes.byref(U32(1)), drivers)
    count = U32(0)
    lib.zeDeviceGet(ctypes.c_void_p(drivers[0]), ctypes.byref(count), None)
    core = (ctypes.c_void_p * 4)()
    lib.zeDeviceGet(ctypes.c_void_p(drivers[0]), ctypes.byref(count), core)
    modules = U32(0)
    out["core_handle"] = lib.zesDeviceEnumMemoryModules(ctypes.c_void_p(core[0]), ctypes.byref(modules), None)
    out["modules"] = modules.value
    """
    legacy = run_level_zero(
        tmp_path, code, ZES_ENABLE_SYSMAN="1", PYTEST_GPU_SIM_ZES="no-zesinit", ZE_AFFINITY_MASK="2"
    )
    assert (legacy["zeinit"], legacy["zesinit"], legacy["again"]) == (0, 0x78000003, 0x78000003)
    assert legacy["zes_driver"] == 0x78000001  # zesDriverGet needs zesInit
    assert (legacy["core_handle"], legacy["modules"]) == (0, 1)  # the core handle is Sysman's now
    modern = run_level_zero(tmp_path, code, ZES_ENABLE_SYSMAN="1", ZE_AFFINITY_MASK="2")
    assert (modern["zesinit"], modern["zes_driver"]) == (0, 0)
    assert modern["core_handle"] == 0x78000004  # legacy mode ended: core handles are not Sysman's


def test_the_worker_starts_sysman_before_its_pin_and_keeps_it(tmp_path: Path) -> None:
    """Issue 31, finding 10: the worker's own pin (zeInit under ZES_ENABLE_SYSMAN=1) ran before the
    verifier's first zesInit, so on a product without zesInit support nothing was ever sampled; and
    torch.xpu starting later must not stop sampling. One Sysman per process (finding 11)."""
    out = run_level_zero(
        tmp_path,
        INVENTORY
        + textwrap.dedent(
            """
        runtime.pin(inventory)
        out["first"] = sample(1)
        os.environ["ZE_AFFINITY_MASK"] = "1"  # a lease's
        out["enumerated"] = enumerated()  # torch.xpu starts inside the test
        out["later"] = sample(1)
        out["one"] = XPU.sampler()._zes is XPU.sampler()._zes
        """
        ),
        ZES_ENABLE_SYSMAN="1",
        PYTEST_GPU_SIM_ZES="no-zesinit",
    )
    assert out["first"] == 0 and out["later"] == 0, out
    assert out["enumerated"] == 4  # the pin still holds
    assert out["one"]


def test_legacy_sysman_handles_are_translated_through_the_mask(tmp_path: Path) -> None:
    """Level Zero started before pytest-gpu could (a conftest's torch.xpu) under ZES_ENABLE_SYSMAN=1 on
    a product without zesInit support: Sysman works only through the core handles, which follow the
    mask. The GPUs they show are sampled (by UUID); the others are refused, not misnamed."""
    out = run_level_zero(
        tmp_path,
        INVENTORY
        + textwrap.dedent(
            """
        out["enumerated"] = enumerated()
        from pathlib import Path
        from pytest_gpu.sim.ledger import render_state
        from pytest_gpu.sim.spec import parse
        from pytest_gpu.vendors.sampling import Refused
        procs = {str(os.getpid()): {"ctx": {}, "allocs": {"a": [3, 3 << 30, None]}}}
        state = {"spec": "xpu:sim:4x64GiB", "overhead": 0, "procs": procs, "tags": {}, "users": {}}
        state_file = Path(os.environ["PYTEST_GPU_SIM_LEDGER"], "nvml.state")
        state_file.write_text(render_state(parse("xpu:sim:4x64GiB"), state))
        out["visible"] = sample(3)
        try:
            XPU.sampler().memory(xpu_uuid(0))
        except Refused as exc:
            out["hidden"] = str(exc)
        out["procs"] = {str(k): v for k, v in XPU.sampler().processes(xpu_uuid(3)).items()}
        out["pid"] = os.getpid()
        """
        ),
        ZES_ENABLE_SYSMAN="1",
        PYTEST_GPU_SIM_ZES="no-zesinit",
        ZE_AFFINITY_MASK="1,3",
    )
    assert out["enumerated"] == 2
    assert out["visible"] == 3 * GiB
    assert "ZE_AFFINITY_MASK" in out["hidden"]
    assert out["procs"][str(out["pid"])] == out["visible"]


def test_a_forked_child_starts_its_own_sysman(tmp_path: Path) -> None:
    """zes_api.h: each forked process must call zesInit; the kept Sysman is per process."""
    out = run_level_zero(
        tmp_path,
        INVENTORY
        + textwrap.dedent(
            """
        out["parent"] = sample(0)
        read, write = os.pipe()
        child = os.fork()
        if child == 0:
            os.write(write, str(sample(0)).encode())
            os._exit(0)
        os.waitpid(child, 0)
        out["child"] = os.read(read, 200).decode()
        """
        ),
    )
    assert out["parent"] == 0
    assert out["child"] == "0"


def test_one_client_under_two_fds_is_not_counted_twice(tmp_path: Path) -> None:
    """Finding 4: compute-runtime sums drm-total-vram over every fd of a process without looking at
    drm-client-id (zes_process_state_t has none): a process whose client has two fds reads 2x. The
    sampler bounds a process's figure by what the card has in use."""
    out = run_fake_python(
        tmp_path,
        "xpu:sim:2x64GiB",
        """
        import os
        from pytest_gpu.sim import zes
        from pytest_gpu.sim.ledger import ledger
        from pytest_gpu.sim.spec import xpu_uuid
        from pytest_gpu.vendors.intel import XPU
        ledger().allocate(4 << 30, 1, None, None)
        zes.share_client(os.environ["PYTEST_GPU_SIM_LEDGER"], os.getpid(), 2)
        sampler = XPU.sampler()
        out["process"] = sampler.processes(xpu_uuid(1))[os.getpid()]
        out["card"] = sampler.memory(xpu_uuid(1))[0]
        """,
    )
    assert 4 * GiB <= out["card"] < 5 * GiB  # its 4 GiB and its context
    assert out["process"] == out["card"]  # not twice that


XPU_FRACTION = """
import torch
from pytest_gpu.gpu.confine import confine
from pytest_gpu.gpu.isolation import make_lease
from pytest_gpu.gpu.discovery import discover
out["api"] = hasattr(torch.xpu, "set_per_process_memory_fraction")
inventory = discover("auto")
lease = make_lease("k", [1], 8 << 30, True, 0.0, inventory, "t")
done = confine(lease, inventory)
x = torch.empty(1 << 20, device="xpu")
out["device"] = str(x.device)
out["notes"] = done.notes
del x
done.undo()
lease = make_lease("k2", [0], 8 << 30, True, 0.0, inventory, "t")
done = confine(lease, inventory)
out["again"] = done.notes
done.undo()
"""


@pytest.mark.slow  # torch imported in a subprocess
@pytest.mark.parametrize("version", ["2.9", "2.13"])
def test_torch_xpu_without_the_fraction_api(tmp_path: Path, version: str) -> None:
    """Finding 9: torch.xpu.set_per_process_memory_fraction arrived in torch 2.10 (pytorch#165510);
    before, confining torch.xpu raised AttributeError inside torch's lazy init. The cap is then not
    enforced by torch, said once, and the lease is still verified."""
    require("torch", module="torch")
    out: dict[str, Any] = run_fake_python(tmp_path, "xpu:sim:2x64GiB", XPU_FRACTION, PYTEST_GPU_SIM_XPU_TORCH=version)
    assert out["device"] == "xpu:1"  # the lease's GPU 1, as the worker's runtime numbers it
    if version == "2.9":
        assert not out["api"]
        assert len(out["notes"]) == 1 and "set_per_process_memory_fraction" in out["notes"][0], out
        assert out["again"] == []  # said once per process
    else:
        assert out["api"] and out["notes"] == [] and out["again"] == []


@pytest.fixture(autouse=True)
def _no_inherited_sysman_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("ZES_ENABLE_SYSMAN", "PYTEST_GPU_SIM_ZES", "PYTEST_GPU_SIM_XPU_TORCH"):
        monkeypatch.delenv(name, raising=False)
    assert "ZES_ENABLE_SYSMAN" not in os.environ


WORKER_CONFTEST = """
import torch

torch.xpu.device_count()
torch.xpu.init()  # a conftest starts torch.xpu (and Level Zero) before any lease
"""

WORKER_TESTS = """
import os
import pytest
import torch
from pytest_gpu.sim import zes


@pytest.mark.parametrize("n", range(50))
@pytest.mark.gpu(memory="4GiB")
def test_clean(gpu, n):
    if n == 10:  # a library reaches the worker's DRM client through a second fd (dup, fd passing)
        zes.share_client(os.environ["PYTEST_GPU_SIM_LEDGER"], os.getpid(), 2)
    x = torch.empty(256 << 20, dtype=torch.uint8, device=gpu.device)
    del x
"""


def test_a_long_lived_worker_stays_verified_and_clean(vendor_run: Any, gpu_pytester: pytest.Pytester) -> None:
    """Issue 31: one worker, 50 clean tests, on a product without zesInit support whose Level Zero a
    conftest started under ZES_ENABLE_SYSMAN=1 (legacy Sysman), the worker's client reached through
    two fds from the 11th test on: every test is verified (no 'not checked' note), none is charged
    anything, and the process's figure is not doubled (no test reported as holding memory)."""
    require("torch", module="torch")
    gpu_pytester.makeconftest(WORKER_CONFTEST)
    gpu_pytester.makepyfile(test_worker=WORKER_TESTS)
    result = vendor_run(
        "xpu",
        "xpu:sim:2x64GiB",
        "--gpus",
        "xpu:auto",
        "-p",
        "no:xdist",
        "-rA",
        ZES_ENABLE_SYSMAN="1",
        PYTEST_GPU_SIM_ZES="no-zesinit",
    )
    result.assert_outcomes(passed=50)
    text = result.stdout.str()
    assert "[sysman] · 50 GPU tests · waited 0s in total · 0 violations" in text, text
    assert "not checked" not in text and "unavailable" not in text and "still holds" not in text, text
    assert "peaked far below their request (at most 256MiB)" in text  # the peak is torch's block, not 2x


FIRST_INIT_TESTS = """
import ctypes
import pytest
import torch

U32 = ctypes.c_uint32


def enumerated():
    lib = ctypes.CDLL("libze_loader.so.1")  # the fake loader the run preloaded
    assert lib.zeInit(U32(0)) == 0
    drivers = (ctypes.c_void_p * 1)()
    lib.zeDriverGet(ctypes.byref(U32(1)), drivers)
    count = U32(0)
    lib.zeDeviceGet(ctypes.c_void_p(drivers[0]), ctypes.byref(count), None)
    return count.value


@pytest.mark.gpu(memory="1GiB")
def test_first(gpu):
    torch.empty(1 << 20, device=gpu.device)  # torch.xpu, and Level Zero, start inside a lease


@pytest.mark.gpu(memory="1GiB")
def test_second(gpu):
    assert enumerated() == 3  # the worker's list, not the first lease's one device
"""


def test_level_zero_first_started_inside_a_lease_keeps_the_runs_devices(
    vendor_run: Any, gpu_pytester: pytest.Pytester
) -> None:
    """Finding 1 on a fake Intel machine: torch.xpu starting Level Zero inside a test (under the lease's
    ZE_AFFINITY_MASK) must find the worker's device list already pinned to the run's."""
    require("torch", module="torch")
    gpu_pytester.makepyfile(test_first_init=FIRST_INIT_TESTS)
    result = vendor_run("xpu", "xpu:sim:3x64GiB", "--gpus", "xpu:auto", "-p", "no:xdist")
    result.assert_outcomes(passed=2)


def test_an_unknown_modelled_product_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_gpu.sim import zes

    monkeypatch.setenv("PYTEST_GPU_SIM_ZES", "no-zesInit")
    monkeypatch.setenv("LD_LIBRARY_PATH", os.environ.get("LD_LIBRARY_PATH", ""))  # put back, whatever happens
    with pytest.raises(RuntimeError, match=r"PYTEST_GPU_SIM_ZES='no-zesInit': expected no-zesinit"):
        zes.preload()
