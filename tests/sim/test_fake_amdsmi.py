"""The fake ``libamd_smi.so`` (:mod:`pytest_gpu.sim.amdsmi`), driven through the real ``amdsmi`` package.

Each scenario runs in a fresh ``python -c`` process (the library's state is per process) that
calls :func:`preload`, imports ``amdsmi`` and prints a JSON dict of observations.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import amdsmi_site, require, with_amdsmi
from helpers import patience
from pytest_gpu.sim import amdsmi as fake_amdsmi
from pytest_gpu.sim.spec import SpecError, amd_uuid, parse


@pytest.fixture(autouse=True)
def _needs(monkeypatch: pytest.MonkeyPatch) -> None:
    require("C compiler", executable=os.environ.get("CC", "cc").split()[0] or "cc")
    monkeypatch.syspath_prepend(amdsmi_site())  # found (not imported) by the build's symbol list


GiB = 1 << 30
MiB = 1 << 20

PRELUDE = """\
import json, os, sys
from pytest_gpu.sim.amdsmi import preload
preload()
import amdsmi
from amdsmi import AmdSmiMemoryType
out = {}
def err(fn, *args):
    try:
        fn(*args)
    except amdsmi.AmdSmiLibraryException as exc:
        return exc.get_error_code()
    return None
"""


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One build of the library for the module (its own cache: the build itself is under test)."""
    path = tmp_path_factory.mktemp("fake-amdsmi-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(amdsmi_site())
        mp.setenv("XDG_CACHE_HOME", str(path))
        mp.delenv("CC", raising=False)
        fake_amdsmi.library_dir()
    yield path


def write_state(ledger: Path, *lines: str) -> None:
    """Replace ``ledger/nvml.state`` atomically, as the ledger does."""
    ledger.mkdir(parents=True, exist_ok=True)
    temp = ledger / "nvml.state.tmp"
    temp.write_text("\n".join(["v1", *lines]) + "\n")
    os.replace(temp, ledger / "nvml.state")


def run_py(cache_dir: Path, ledger: Path | None, code: str) -> dict[str, Any]:
    env = with_amdsmi({**os.environ, "XDG_CACHE_HOME": str(cache_dir)})
    for name in ("PYTEST_GPU_SIM_LEDGER", "CC", "ROCM_HOME", "ROCM_PATH"):
        env.pop(name, None)
    if ledger is not None:
        env["PYTEST_GPU_SIM_LEDGER"] = str(ledger)
    script = PRELUDE + textwrap.dedent(code) + "\nprint(json.dumps(out))\n"
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=patience(60))
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


U0, U1 = amd_uuid(0), amd_uuid(1)
AMD = (
    "option vendor amd",
    f"gpu 0 {U0} {192 * GiB} {GiB} {5 * GiB} 0 none AMD Instinct MI300X",
    f"gpu 1 {U1} {192 * GiB} 0 0 0 none AMD Instinct MI300X",
)


def test_devices_uuids_bdfs_and_vram_through_the_real_package(tmp_path: Path, cache_dir: Path) -> None:
    write_state(tmp_path, *AMD)
    out = run_py(
        cache_dir,
        tmp_path,
        """
        out["before_init"] = err(amdsmi.amdsmi_get_processor_handles)
        amdsmi.amdsmi_init()
        out["gpus"] = []
        for h in amdsmi.amdsmi_get_processor_handles():
            out["gpus"].append({
                "uuid": amdsmi.amdsmi_get_gpu_device_uuid(h),
                "hip_uuid": amdsmi.amdsmi_get_gpu_enumeration_info(h)["hip_uuid"],
                "bdf": amdsmi.amdsmi_get_gpu_device_bdf(h),
                "total": amdsmi.amdsmi_get_gpu_memory_total(h, AmdSmiMemoryType.VRAM),
                "used": amdsmi.amdsmi_get_gpu_memory_usage(h, AmdSmiMemoryType.VRAM),
                "vram_mb": amdsmi.amdsmi_get_gpu_vram_usage(h),
                "name": amdsmi.amdsmi_get_gpu_asic_info(h)["market_name"],
                "gtt": err(amdsmi.amdsmi_get_gpu_memory_total, h, AmdSmiMemoryType.GTT),
            })
        bad = amdsmi.amdsmi_wrapper.amdsmi_processor_handle(4096)
        out["bad_handle"] = err(amdsmi.amdsmi_get_gpu_device_uuid, bad)
        h = amdsmi.amdsmi_get_processor_handles()[0]
        out["unmodelled"] = err(amdsmi.amdsmi_get_gpu_activity, h)
        amdsmi.amdsmi_shut_down()
        out["after_shutdown"] = err(amdsmi.amdsmi_get_gpu_device_uuid, h)
        """,
    )
    assert out["before_init"] == 32  # AMDSMI_STATUS_NOT_INIT
    first, second = out["gpus"]
    assert [first["hip_uuid"], second["hip_uuid"]] == [U0, U1]
    # amd_smi_uuid.cc's layout: device id and fcn 0xff first, version 1, the serial last
    assert first["uuid"] == "51ff74a1-0000-1000-80a0-000000000000"
    assert second["uuid"].endswith("000000000001") and len(second["uuid"]) == 36
    assert [first["bdf"], second["bdf"]] == ["0000:05:00.0", "0000:25:00.0"]
    assert first["total"] == 192 * GiB
    assert first["used"] == 6 * GiB  # the driver's own reservation counts as used: amdsmi has no "reserved"
    assert first["vram_mb"] == {"vram_total": 192 * 1024, "vram_used": 6 * 1024}  # this struct is in MB
    assert first["name"] == "AMD Instinct MI300X"
    assert first["gtt"] == 2  # NOT_SUPPORTED: only VRAM is modelled
    assert out["bad_handle"] == 1  # INVAL
    assert out["unmodelled"] == 2  # NOT_SUPPORTED, as for what a GPU lacks
    assert out["after_shutdown"] == 32


def test_no_amd_machine_is_driver_not_loaded(tmp_path: Path, cache_dir: Path) -> None:
    nvidia = tmp_path / "nvidia"
    write_state(nvidia, f"gpu 0 GPU-00000000-aaaa {80 * GiB} 0 0 0 none NVIDIA H100")
    code = "out['init'] = err(amdsmi.amdsmi_init)"
    assert run_py(cache_dir, nvidia, code) == {"init": 34}  # AMDSMI_STATUS_DRIVER_NOT_LOADED
    assert run_py(cache_dir, tmp_path / "missing", code) == {"init": 34}
    assert run_py(cache_dir, None, code) == {"init": 34}


def test_the_process_list_in_bytes_without_the_gone(tmp_path: Path, cache_dir: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # exited and reaped: its pid names no process
    write_state(
        tmp_path,
        *AMD,
        f"proc {U0} {os.getpid()} {3 * GiB + 123}",
        f"proc {U0} {child.pid} {GiB}",
        f"proc {U1} {os.getpid()} {MiB}",
    )
    out = run_py(
        cache_dir,
        tmp_path,
        """
        amdsmi.amdsmi_init()
        h0, h1 = amdsmi.amdsmi_get_processor_handles()
        listed = amdsmi.amdsmi_get_gpu_process_list(h0)
        out["gpu0"] = [(p["pid"], p["mem"], p["memory_usage"]["vram_mem"]) for p in listed]
        out["gpu1"] = [(p["pid"], p["mem"]) for p in amdsmi.amdsmi_get_gpu_process_list(h1)]
        out["used0"] = amdsmi.amdsmi_get_gpu_memory_usage(h0, AmdSmiMemoryType.VRAM)
        # the C protocol: a buffer too small is filled, and OUT_OF_RESOURCES says how many there are
        import ctypes
        count = ctypes.c_uint32(0)
        amdsmi.amdsmi_wrapper.amdsmi_get_gpu_process_list(h0, ctypes.byref(count), None)
        out["count"] = count.value
        """,
    )
    me = os.getpid()
    assert out["gpu0"] == [[me, 3 * GiB + 123, 3 * GiB + 123]]  # exact bytes; the reaped child is gone
    assert out["gpu1"] == [[me, MiB]]
    assert out["used0"] == GiB + 5 * GiB - GiB  # reserved + used, less what the gone process held
    assert out["count"] == 1


def test_coarse_and_stale_process_lists(tmp_path: Path, cache_dir: Path) -> None:
    me = os.getpid()
    write_state(
        tmp_path,
        *AMD,
        "option amd_proc_unit 1048576",
        "option amd_proc_refresh_ms 60000",
        f"proc {U0} {me} {3 * MiB + 5}",
    )
    out = run_py(
        cache_dir,
        tmp_path,
        f"""
        import time
        amdsmi.amdsmi_init()
        h0 = amdsmi.amdsmi_get_processor_handles()[0]
        out["first"] = [p["mem"] for p in amdsmi.amdsmi_get_gpu_process_list(h0)]
        state = os.path.join(os.environ["PYTEST_GPU_SIM_LEDGER"], "nvml.state")
        text = open(state).read().replace("{3 * MiB + 5}", "{9 * MiB}")
        with open(state + ".tmp", "w") as f:
            f.write(text)
        os.replace(state + ".tmp", state)
        out["stale"] = [p["mem"] for p in amdsmi.amdsmi_get_gpu_process_list(h0)]
        out["used"] = amdsmi.amdsmi_get_gpu_memory_usage(h0, AmdSmiMemoryType.VRAM)
        """,
    )
    assert out["first"] == [3 * MiB]  # rounded down to whole MiB
    assert out["stale"] == [3 * MiB]  # the snapshot is at most a minute old: not yet refreshed
    assert out["used"] == 6 * GiB  # device totals are current


def test_the_ledger_renders_an_amd_machine_and_the_fake_nvml_refuses_it() -> None:
    from pytest_gpu.sim.ledger import render_state

    machine = parse("amd:sim:2x192GiB;proc-unit=1MiB;proc-refresh=1000;rocr-order=1,0")
    state = {"spec": machine.spec, "overhead": 0, "procs": {}, "tags": {}, "users": {}}
    text = render_state(machine, state)
    assert "option vendor amd\n" in text
    assert "option amd_proc_unit 1048576\n" in text and "option amd_proc_refresh_ms 1000\n" in text
    assert "option amd_rocr_order 1,0\n" in text
    assert f"gpu 1 {amd_uuid(1)} {192 * GiB} 0 0 0 none Simulated AMD GPU 192GiB" in text
    # every machine names its vendor: the fake NVML serves NVIDIA's alone (tests/sim/test_fake_nvml.py)
    assert "option vendor nvidia\n" in render_state(parse("sim:1x16GiB"), {**state, "spec": "sim:1x16GiB"})


def test_nvml_reports_driver_not_loaded_on_an_amd_machine(tmp_path: Path) -> None:
    require("C compiler", executable="cc")
    write_state(tmp_path, *AMD)
    code = textwrap.dedent(
        """
        import json, pynvml
        from pytest_gpu.sim.nvml import preload
        preload()
        try:
            pynvml.nvmlInit()
            print(json.dumps("initialised"))
        except pynvml.NVMLError as exc:
            print(json.dumps(str(exc)))
        """
    )
    env = {**os.environ, "PYTEST_GPU_SIM_LEDGER": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=patience(60))
    assert json.loads(done.stdout.strip().splitlines()[-1]) == "Driver Not Loaded", done.stderr


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ("amd:sim:2x16GiB;mig:0=2x8GiB", "is an NVIDIA driver's option"),
        ("amd:2x16GiB;no-v3", "is an NVIDIA driver's option"),
        ("sim:2x16GiB;proc-unit=1MiB", "expected it on an amd: machine"),
        ("amd:2x16GiB;proc-refresh=soon", "expected whole milliseconds"),
        ("sim:2x16GiB;rocr-order=1,0", "expected it on an amd: machine"),
        ("amd:2x16GiB;rocr-order=0,0", "expected every GPU index 0..1 once, such as rocr-order=1,0"),
        ("amd:3x16GiB;rocr-order=2,1", "expected every GPU index 0..2 once"),
    ],
)
def test_vendor_specs_refuse_what_the_vendor_lacks(spec: str, said: str) -> None:
    with pytest.raises(SpecError, match=said):
        parse(spec)


def test_vendor_prefix() -> None:
    assert parse("amd:sim:8x192GiB").vendor == "amd"
    assert parse("AMD:8x192GiB").gpus[7].uuid == amd_uuid(7)
    assert parse("nvidia:sim:2x16GiB") == parse("nvidia:sim:2x16GiB")
    assert parse("nvidia:sim:2x16GiB").vendor == parse("sim:2x16GiB").vendor == "nvidia"


def test_the_stubs_cover_every_symbol_the_package_binds() -> None:
    symbols = fake_amdsmi.wrapper_symbols()
    assert "amdsmi_get_gpu_process_list" in symbols and len(symbols) > 100
    generated = fake_amdsmi._unsupported()
    for name in symbols:
        assert (name in fake_amdsmi.implemented()) != (f" {name}(void)" in generated), name
