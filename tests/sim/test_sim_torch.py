"""pytest_gpu.sim.torch_cuda: torch.cuda of the CPU build behaving as torch 2.13 on CUDA 12.

Process state matters (the device list is fixed at the first CUDA call, contexts live as
long as the process), so each test runs a small script in a fresh interpreter that
imports torch, installs the double, records what it sees in ``out`` and prints it as JSON.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from conftest import require, run_fake_python
from helpers import ROOT, patience
from pytest_gpu.sim import spec, torch_cuda

MiB, GiB = 2**20, 2**30
OVERHEAD = 512 * MiB

PRELUDE = """
import gc, json, os, warnings
import torch
from pytest_gpu.sim import cuda as sim_cuda, torch_cuda
from pytest_gpu.sim.ledger import ledger
from pytest_gpu.sim.torch_cuda import empty

warnings.simplefilter("ignore", FutureWarning)  # reset_max_memory_allocated's deprecation note
torch_cuda.install(torch)
out = {}

def error(call):
    try:
        call()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"

def contexts():
    return sorted(sim_cuda.contexts())
"""


def run_script(
    tmp_path: Path,
    body: str,
    *,
    sim_spec: str = "sim:4x16GiB",
    visible: str | None = None,
    prelude: str = PRELUDE,
    **extra: str,
) -> Any:
    """Run ``body`` after ``prelude`` in a fresh interpreter on a private ledger; return its ``out``."""
    require("torch", module="torch")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES" and not k.startswith("PYTEST_GPU_")}
    env.update(
        PYTEST_GPU_SIM_LEDGER=str(tmp_path / "ledger"),
        PYTEST_GPU_SIM=sim_spec,
        PYTEST_GPU_CONTEXT_OVERHEAD="512MiB",
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]),
    )
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    env.update(extra)
    script = prelude + textwrap.dedent(body) + "\nprint(json.dumps(out))\n"
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=patience(120)
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_device_list_is_fixed_at_first_cuda_call_and_device_count_follows_torch(tmp_path: Path) -> None:
    out = run_script(
        tmp_path,
        """
        out["available"] = torch.cuda.is_available()  # cudaGetDeviceCount: fixes the list, no context
        out["fixed"] = sim_cuda.initialized()
        out["initialized_after_available"] = torch.cuda.is_initialized()
        out["contexts_after_available"] = contexts()
        os.environ["CUDA_VISIBLE_DEVICES"] = "0,1,3"
        out["count_before_init"] = torch.cuda.device_count()  # NVML + the current variable
        torch.cuda.init()
        out["initialized"] = torch.cuda.is_initialized()
        out["count_after_init"] = torch.cuda.device_count()  # the driver's (fixed) list
        os.environ["CUDA_VISIBLE_DEVICES"] = "0,1"
        out["count_later"] = torch.cuda.device_count()
        out["current"] = torch.cuda.current_device()
        out["unit_of_0"] = sim_cuda.unit_of(0)
        out["contexts_after_init"] = contexts()
        out["fraction_5"] = error(lambda: torch.cuda.set_per_process_memory_fraction(0.5, 5))
        out["fraction_0_bad"] = error(lambda: torch.cuda.set_per_process_memory_fraction(1.5, 0))
        out["set_device_1"] = error(lambda: torch.cuda.set_device(1))
        out["properties_1"] = error(lambda: torch.cuda.get_device_properties(1))
        torch.cuda.set_device(0)
        out["contexts_after_set_device"] = contexts()
        """,
        visible="2",
    )
    assert out["available"] is True and out["fixed"] is True
    assert out["initialized_after_available"] is False
    assert out["contexts_after_available"] == []
    assert out["count_before_init"] == 3
    assert out["initialized"] is True
    assert out["count_after_init"] == 1 and out["count_later"] == 1
    assert out["current"] == 0 and out["unit_of_0"] == 2
    assert out["contexts_after_init"] == []  # lazy init opens no context
    assert out["fraction_5"] == "RuntimeError: Allocator not initialized for device 5: did you call init?"
    assert out["fraction_0_bad"].startswith("ValueError: Invalid fraction value: 1.5")
    assert out["set_device_1"].startswith("AcceleratorError: CUDA error: invalid device ordinal")
    assert out["properties_1"] == "AssertionError: Invalid device id"
    assert out["contexts_after_set_device"] == [2]


@pytest.mark.slow
def test_legacy_device_count_is_cached_at_its_first_call(tmp_path: Path) -> None:
    """torch 2.0-2.3: device_count is lru_cache'd at its first call, CUDA started or not."""
    out = run_script(
        tmp_path,
        """
        torch_cuda.install(torch, legacy_device_count=True)
        torch.cuda.is_available()  # cudaGetDeviceCount: fixes the driver's list (4 GPUs)
        os.environ["CUDA_VISIBLE_DEVICES"] = "2"  # as a lease narrows it
        out["first"] = torch.cuda.device_count()
        del os.environ["CUDA_VISIBLE_DEVICES"]
        torch.cuda.init()
        out["after_init"] = torch.cuda.device_count()
        out["checked"] = error(lambda: torch.cuda.get_device_properties(2))
        out["unchecked"] = torch.cuda._get_device_properties(2).total_memory > 0
        out["driver"] = torch._C._cuda_getDeviceCount()
        """,
    )
    assert out["first"] == 1
    assert out["after_init"] == 1  # kept: the lru_cache never forgets
    assert out["checked"] == "AssertionError: Invalid device id"
    assert out["unchecked"] is True
    assert out["driver"] == 4


@pytest.mark.slow
def test_current_device_is_per_thread(tmp_path: Path) -> None:
    """CUDA's current device (and c10's recorded target) belong to the host thread: a thread
    starts on cuda:0, and its first allocation opens GPU 0's context."""
    out = run_script(
        tmp_path,
        """
        import threading
        torch.cuda.set_device(2)
        seen = {}

        def work():
            seen["start"] = torch.cuda.current_device()
            with torch.cuda.device(3):
                seen["guarded"] = torch.cuda.current_device()
            seen["after_guard"] = torch.cuda.current_device()
            seen["block_device"] = empty(MiB_).device

        MiB_ = 2**20
        worker = threading.Thread(target=work)
        worker.start()
        worker.join()
        out.update(seen)
        out["main"] = torch.cuda.current_device()
        out["contexts"] = contexts()
        """,
    )
    assert out["start"] == 0
    assert out["guarded"] == 3
    assert out["after_guard"] == 0
    assert out["block_device"] == 0
    assert out["main"] == 2  # the thread's choices are its own
    assert out["contexts"] == [0, 2, 3]


@pytest.mark.slow
def test_current_device_guards_and_contexts_follow_cuda_12(tmp_path: Path) -> None:
    out = run_script(
        tmp_path,
        """
        out["stats_before_init"] = error(lambda: torch.cuda.reset_peak_memory_stats(0))
        out["allocated_before_init"] = torch.cuda.memory_allocated(0)
        with torch.cuda.device(1):
            out["inside"] = torch.cuda.current_device()
        # the guard's exit records device 0 without switching to it: no context there
        out["after_guard"] = [torch.cuda.current_device(), contexts()]
        torch.cuda.set_device("cuda:1")
        with torch.cuda.device(torch.device("cuda:3")):
            out["inside_3"] = [torch.cuda.current_device(), contexts()]
        out["after_3"] = torch.cuda.current_device()  # back to 1, which has a context
        out["free_total_2"] = list(torch.cuda.mem_get_info(2))
        out["after_mem_get_info"] = [torch.cuda.current_device(), contexts()]
        props = torch.cuda.get_device_properties(2)
        out["properties"] = [props.name, props.total_memory, torch.cuda.get_device_name(2)]
        torch.cuda.set_per_process_memory_fraction(0.5, 0)  # torch >= 2.10: the allocator's cap only
        out["after_fraction"] = [torch.cuda.current_device(), contexts(), torch.cuda.get_per_process_memory_fraction(0)]
        torch_cuda.install(torch, legacy_memory_fraction=True)  # torch < 2.10
        torch.cuda.set_per_process_memory_fraction(0.5, 0)
        out["after_legacy_fraction"] = [torch.cuda.current_device(), contexts()]
        out["ledger_used"] = ledger().used()
        """,
    )
    assert out["stats_before_init"] == "RuntimeError: Invalid device argument 0: did you call init?"
    assert out["allocated_before_init"] == 0
    assert out["inside"] == 1
    assert out["after_guard"] == [0, [1]]
    assert out["inside_3"] == [3, [1, 3]]
    assert out["after_3"] == 1
    assert out["free_total_2"] == [16 * GiB - OVERHEAD, 16 * GiB]
    assert out["after_mem_get_info"] == [1, [1, 2, 3]]
    assert out["properties"] == ["Simulated GPU 16GiB", 16 * GiB, "Simulated GPU 16GiB"]
    assert out["after_fraction"] == [1, [1, 2, 3], 0.5]
    assert out["after_legacy_fraction"] == [0, [0, 1, 2, 3]]
    assert out["ledger_used"] == {str(i): OVERHEAD for i in range(4)}


@pytest.mark.slow
def test_caching_allocator_rounds_caches_and_reports_like_torch(tmp_path: Path) -> None:
    out = run_script(
        tmp_path,
        """
        torch.manual_seed(0)  # queued for lazy init, which must seed every device's generator
        def snapshot():
            return [torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), ledger().used()[0]]
        small = [empty(1000), empty(1000)]  # 512-byte blocks from one 2 MiB segment
        out["small"] = snapshot()
        mid = empty(5 * 2**20)  # between 1 and 10 MiB: a 20 MiB segment
        big = empty(30 * 2**20 + 1)  # rounded to 512 bytes, its segment to 2 MiB
        out["big"] = snapshot()
        del mid
        gc.collect()  # like a tensor, a Block gives its memory back when collected
        out["after_del"] = snapshot()
        reuse = empty(4 * 2**20)  # served from the cached 20 MiB segment
        out["reuse"] = snapshot()
        for block in small + [big, reuse]:
            block.free()
        out["all_freed"] = snapshot()
        out["peaks_before_reset"] = [torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()]
        torch.cuda.reset_peak_memory_stats()
        out["peaks_after_reset"] = [torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()]
        torch.cuda.empty_cache()
        out["after_empty_cache"] = snapshot() + [torch.cuda.max_memory_reserved()]
        stats = torch.cuda.memory_stats()
        out["stats"] = [stats["allocated_bytes.all.peak"], stats["reserved_bytes.all.current"],
                        stats["segment.all.allocated"], stats["num_device_free"]]
        out["summary"] = "PyTorch CUDA memory summary" in torch.cuda.memory_summary()
        other = empty(1, device="cuda:1")
        out["other"] = [other.device, other.size, torch.cuda.memory_allocated(1), torch.cuda.current_device(),
                        contexts()]
        out["seeded"] = len(torch.cuda.default_generators)
        pid = os.fork()  # CUDA is initialised: a forked child may not use it
        if pid == 0:
            message = error(torch.cuda.init)
            with open("child.txt", "w") as f:
                f.write(message)
            os._exit(0)
        os.waitpid(pid, 0)
        with open("child.txt") as f:
            out["child"] = f.read()
        torch_cuda.reset()  # as a new process: segments back to the ledger, torch.cuda uninitialised
        out["after_reset"] = [torch.cuda.is_initialized(), other.freed, ledger().used()[1], sim_cuda.initialized()]
        other.free()  # inert after reset
        """,
    )
    small, big = 2 * MiB, 20 * MiB + 32 * MiB + 2 * MiB
    assert out["small"] == [2 * 1024, small, OVERHEAD + small]
    assert out["big"] == [2 * 1024 + 5 * MiB + 30 * MiB + 512, big, OVERHEAD + big]
    assert out["after_del"] == [2 * 1024 + 30 * MiB + 512, big, OVERHEAD + big]
    assert out["reuse"] == [2 * 1024 + 34 * MiB + 512, big, OVERHEAD + big]
    assert out["all_freed"] == [0, big, OVERHEAD + big]  # reserved until empty_cache
    assert out["peaks_before_reset"] == [2 * 1024 + 35 * MiB + 512, big]
    assert out["peaks_after_reset"] == [0, big]  # peak := current, so the cache shows as peak
    assert out["after_empty_cache"] == [0, 0, OVERHEAD, big]
    assert out["stats"] == [0, 0, 3, 3]
    assert out["summary"] is True
    assert out["other"] == [1, 512, 512, 0, [0, 1]]
    assert out["seeded"] == 4
    assert out["child"].startswith("RuntimeError: Cannot re-initialize CUDA in forked subprocess")
    assert out["after_reset"] == [False, True, OVERHEAD, False]  # the context stays with the process


@pytest.mark.slow
def test_out_of_memory_retries_once_then_raises_torchs_error(tmp_path: Path) -> None:
    machine = spec.parse("sim:4x16GiB;reserved=1%")
    total = machine.gpus[0].total - machine.gpus[0].reserved
    out = run_script(
        tmp_path,
        """
        out["total"] = [torch.cuda.get_device_properties(0).total_memory, torch.cuda.mem_get_info(0)[1]]
        torch.cuda.set_per_process_memory_fraction(0.5, 0)
        first = empty(6 * 2**30)
        first.free()  # cached: still reserved
        second = empty(7 * 2**30)  # 6 + 7 GiB passes the cap: the cache is emptied, then one retry
        out["retry"] = [torch.cuda.memory_reserved(), torch.cuda.memory_stats()["num_alloc_retries"]]
        try:
            empty(2 * 2**30)
        except torch.cuda.OutOfMemoryError as exc:
            out["capped"] = str(exc)
        out["ooms"] = torch.cuda.memory_stats()["num_ooms"]
        try:
            empty(16 * 2**30, device=1)  # no cap on GPU 1: the device itself is too small
        except torch.OutOfMemoryError as exc:
            out["device_full"] = str(exc)
        sim_cuda.set_memory_cap(2, 2**30)  # what pytest-gpu's simulated lease applies
        try:
            empty(2 * 2**30, device=2)
        except torch.OutOfMemoryError as exc:
            out["lease"] = [str(exc), str(exc.__cause__)]
        torch.cuda.synchronize(3)  # cudaDeviceSynchronize needs a context on the device
        out["current"] = torch.cuda.current_device()
        out["ledger_used"] = ledger().used()
        """,
        sim_spec="sim:4x16GiB;reserved=1%",
    )
    assert out["total"] == [total, total]
    assert out["retry"] == [7 * GiB, 1]
    assert out["capped"].startswith(
        f"CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of {total / GiB:.2f} GiB "
        f"of which {(total - OVERHEAD - 7 * GiB) / GiB:.2f} GiB is free. "
        "Including non-PyTorch memory, this process has 7.50 GiB memory in use. "
        f"{int(0.5 * total) / GiB:.2f} GiB allowed; Of the allocated memory 7.00 GiB is allocated by PyTorch, "
        "and 0 bytes is reserved by PyTorch but unallocated."
    )
    assert out["ooms"] == 1
    assert out["device_full"].startswith("CUDA out of memory. Tried to allocate 16.00 GiB. GPU 1 has a total")
    assert "allowed" not in out["device_full"]
    assert out["lease"][0].startswith("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 2 has a total capacity")
    assert "pytest-gpu lease" in out["lease"][1]
    assert out["current"] == 0
    assert out["ledger_used"] == {"0": OVERHEAD + 7 * GiB, "1": OVERHEAD, "2": OVERHEAD, "3": OVERHEAD}


@pytest.mark.slow
def test_cuda_malloc_async_caps_what_is_used_and_keeps_what_is_freed(tmp_path: Path) -> None:
    """backend:cudaMallocAsync: the fraction caps the bytes in use; the pool keeps freed memory
    reserved (release threshold UINT64_MAX) until empty_cache trims it."""
    out = run_script(
        tmp_path,
        """
        MiB, GiB = 2**20, 2**30
        out["backend"] = torch.cuda.get_allocator_backend()
        torch.cuda.set_per_process_memory_fraction(GiB / torch.cuda.get_device_properties(1).total_memory, 1)
        out["contexts_after_fraction"] = contexts()  # CUDAGuard + cudaMemGetInfo
        empty(600 * MiB, device=1).free()
        b = empty(700 * MiB, device=1)
        out["reserved"] = torch.cuda.memory_reserved(1) // MiB
        out["max_reserved"] = torch.cuda.max_memory_reserved(1) // MiB
        out["max_allocated"] = torch.cuda.max_memory_allocated(1) // MiB
        out["ledger"] = (ledger().used()[1] - 512 * MiB) // MiB
        out["oom"] = error(lambda: empty(400 * MiB, device=1)).splitlines()[0]
        b.free()
        torch.cuda.empty_cache()
        out["after_empty"] = torch.cuda.memory_reserved(1)
        torch.cuda.reset_peak_memory_stats(1)
        out["peak_after_reset"] = torch.cuda.max_memory_reserved(1)
        """,
        PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync",
    )
    assert out["backend"] == "cudaMallocAsync"
    assert out["contexts_after_fraction"] == [1]
    assert (out["reserved"], out["max_reserved"], out["max_allocated"], out["ledger"]) == (1300, 1300, 700, 1300)
    assert out["oom"] == "OutOfMemoryError: Allocation on device 1 would exceed allowed memory. (out of memory)"
    assert out["after_empty"] == 0
    assert out["peak_after_reset"] == 0


@pytest.mark.slow
def test_expandable_segments_map_pages_past_the_cap(tmp_path: Path) -> None:
    """expandable_segments:True: the fraction is checked before whole 20 MiB pages are mapped;
    freed space is reused in place; empty_cache unmaps the pages nothing uses."""
    out = run_script(
        tmp_path,
        """
        MiB, GiB = 2**20, 2**30
        torch.cuda.set_per_process_memory_fraction(GiB / torch.cuda.get_device_properties(1).total_memory, 1)
        a = empty(1022 * MiB, device=1)
        out["reserved"] = torch.cuda.memory_reserved(1) // MiB
        out["allocated"] = torch.cuda.memory_allocated(1) // MiB
        out["ledger"] = (ledger().used()[1] - 512 * MiB) // MiB
        out["oom"] = error(lambda: empty(30 * MiB, device=1))[:40]
        a.free()
        b = empty(300 * MiB, device=1)
        out["reused"] = torch.cuda.memory_reserved(1) // MiB
        torch.cuda.empty_cache()
        out["trimmed"] = torch.cuda.memory_reserved(1) // MiB
        out["ledger_trimmed"] = (ledger().used()[1] - 512 * MiB) // MiB
        b.free()
        torch.cuda.empty_cache()
        out["empty"] = torch.cuda.memory_reserved(1)
        c = empty(50 * MiB, device=1)
        out["pages"] = torch.cuda.memory_reserved(1) // MiB
        """,
        PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True",
    )
    assert (out["reserved"], out["allocated"], out["ledger"]) == (1040, 1022, 1040)
    assert out["oom"] == "OutOfMemoryError: CUDA out of memory. Tr"
    assert out["reused"] == 1040
    assert (out["trimmed"], out["ledger_trimmed"]) == (300, 300)
    assert out["empty"] == 0
    assert out["pages"] == 60


def test_install_refuses_a_torch_built_with_cuda() -> None:
    cuda_torch = SimpleNamespace(_C=SimpleNamespace(_cuda_getDeviceCount=lambda: 8), cuda=SimpleNamespace())
    with pytest.raises(RuntimeError, match="real CUDA support"):
        torch_cuda.install(cuda_torch)  # type: ignore[arg-type]
    assert not vars(cuda_torch.cuda)  # nothing was patched


# -- tensors on a simulated GPU (pytest_gpu.sim.torch_tensors) -------------------------------


@pytest.mark.slow
def test_factories_put_tensors_on_the_simulated_gpus_through_the_caching_allocator(tmp_path: Path) -> None:
    out = run_script(
        tmp_path,
        """
        MiB = 2**20
        torch.cuda.set_device(1)
        x = torch.ones(1024, device="cuda")  # a bare "cuda": the current device
        out["x"] = [str(x.device), x.is_cuda, x.get_device(), torch.cuda.memory_allocated(1),
                    torch.cuda.memory_reserved(1), torch.cuda.memory_allocated(0)]
        y = torch.zeros(1, device="cuda:2")  # 4 bytes: a 512-byte block of a 2 MiB segment
        out["y"] = [str(y.device), torch.cuda.memory_allocated(2), torch.cuda.memory_reserved(2)]
        big = torch.empty(3 * MiB, dtype=torch.uint8, device=torch.device("cuda", 2))  # a 20 MiB segment
        out["big"] = torch.cuda.memory_reserved(2) // MiB
        out["made"] = [
            str(t.device)
            for t in (
                torch.tensor([1.0, 2.0], device="cuda"),
                torch.as_tensor([1, 2], device="cuda:3"),
                torch.arange(10, device="cuda:3"),
                torch.randn(2, 3, device="cuda:3"),
                torch.full((2,), 7.0, device="cuda:3"),
                torch.tril_indices(3, 3, device="cuda:3"),
                torch.zeros(3).to("cuda"),
                torch.zeros(3).to("cuda:3"),
                torch.zeros(3).cuda(),
                torch.zeros(3).cuda(3),
                torch.zeros(3).new_tensor([1], device="cuda"),
                x.new_zeros(2),
                torch.zeros_like(x),
            )
        ]
        out["values"] = [x.sum().item(), torch.full((2,), 7.0, device="cuda:3").tolist()]
        with torch.device("cuda:3"):  # torch's default-device context reaches the factories too
            out["default_device"] = str(torch.zeros(2).device)
        out["ledger"] = ledger().used()  # contexts (512 MiB) and segments, as NVML sees them
        out["contexts"] = contexts()
        del x
        out["freed"] = [torch.cuda.memory_allocated(1), torch.cuda.memory_reserved(1)]  # back to the cache
        del y, big
        torch.cuda.empty_cache()
        out["emptied"] = ledger().used()
        """,
    )
    assert out["x"] == ["cuda:1", True, 1, 4096, 2 * MiB, 0]
    assert out["y"] == ["cuda:2", 512, 2 * MiB]
    assert out["big"] == 22  # 2 MiB (small pool) + 20 MiB (large pool)
    assert out["made"] == ["cuda:1"] + ["cuda:3"] * 5 + ["cuda:1", "cuda:3"] * 2 + ["cuda:1"] * 3
    assert out["values"] == [1024.0, [7.0, 7.0]]
    assert out["default_device"] == "cuda:3"
    assert out["ledger"] == {"0": 0, "1": OVERHEAD + 2 * MiB, "2": OVERHEAD + 22 * MiB, "3": OVERHEAD + 2 * MiB}
    assert out["contexts"] == [1, 2, 3]  # none on GPU 0: nothing asked for it
    assert out["freed"] == [0, 2 * MiB]
    assert out["emptied"] == {"0": 0, "1": OVERHEAD, "2": OVERHEAD, "3": OVERHEAD}


@pytest.mark.slow
def test_operations_on_simulated_tensors_take_memory_as_on_cuda(tmp_path: Path) -> None:
    """A result that takes a new buffer on CUDA takes one here (rounded as torch rounds it); a
    view or an in-place change takes none; the memory goes back when the last view dies."""
    out = run_script(
        tmp_path,
        """
        MiB = 2**20
        x = torch.ones(256 * 1024, device="cuda:1")  # 1 MiB of float32
        base = torch.cuda.memory_allocated(1)
        views = [x[10:], x.view(512, 512).t(), x.reshape(1024, 256), x.unsqueeze(0), x.detach(), x.data]
        x.mul_(2)
        out["views"] = [torch.cuda.memory_allocated(1) - base, [str(v.device) for v in views]]
        y = x * 3  # 1 MiB more
        s = y.sum()  # a 0-dim result: one 512-byte block
        b = x > 1  # 256 KiB of bool
        out["results"] = [torch.cuda.memory_allocated(1) - base, str(y.device), str(s.device), s.item(), b.all().item()]
        out["peak"] = torch.cuda.max_memory_allocated(1) - base
        del x
        out["views_keep_it"] = torch.cuda.memory_allocated(1) - base
        del views
        out["last_view_gone"] = torch.cuda.memory_allocated(1)
        out["resized"] = y.resize_(512 * 1024).shape[0]  # grown in place: reallocated
        out["after_resize"] = torch.cuda.memory_allocated(1)
        """,
    )
    MiB = 2**20
    assert out["views"] == [0, ["cuda:1"] * 6]
    assert out["results"] == [MiB + 512 + MiB // 4, "cuda:1", "cuda:1", 1572864.0, True]
    assert out["peak"] == MiB + 512 + MiB // 4 + 512  # b.all()'s result came and went
    assert out["views_keep_it"] == MiB + 512 + MiB // 4
    assert out["last_view_gone"] == MiB + 512 + MiB // 4
    assert out["resized"] == 512 * 1024
    assert out["after_resize"] == 2 * MiB + 512 + MiB // 4


@pytest.mark.slow
def test_to_cuda_and_cpu_follow_torch_s_rules_on_simulated_tensors(tmp_path: Path) -> None:
    out = run_script(
        tmp_path,
        """
        x = torch.arange(4.0, device="cuda:1")
        out["alias"] = [x.to("cuda:1") is x, x.cuda(1) is x, x.to(torch.float32) is x, x.to(x) is x,
                        x.to("cuda:1", copy=True) is x]
        c = x.cpu()
        c += 1  # a copy on the host: x keeps its values
        out["cpu"] = [str(c.device), type(c) is torch.Tensor, x.tolist(), c.tolist()]
        z = x.to("cuda:3")
        h = x.half()
        out["moved"] = [str(z.device), torch.cuda.memory_allocated(3), str(h.device), str(h.dtype)]
        out["to_other"] = str(torch.ones(2).to(z).device)  # .to(tensor): that tensor's device
        out["mismatch"] = error(lambda: x + z)
        out["copy_across"] = z.copy_(x).tolist()  # copies may cross devices
        out["numpy"] = error(lambda: x.numpy())
        out["repr"] = repr(x)
        out["format"] = f"{x.sum():.1f}"
        """,
    )
    assert out["alias"] == [True, True, True, True, False]
    assert out["cpu"] == ["cpu", True, [0.0, 1.0, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0]]
    assert out["moved"] == ["cuda:3", 512, "cuda:1", "torch.float16"]
    assert out["to_other"] == "cuda:3"
    assert out["mismatch"] == (
        "RuntimeError: Expected all tensors to be on the same device, but found at least two devices, "
        "cuda:1 and cuda:3!"
    )
    assert out["copy_across"] == [0.0, 1.0, 2.0, 3.0]
    assert out["numpy"] == (
        "TypeError: can't convert cuda:1 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to host "
        "memory first."
    )
    assert out["repr"] == "tensor([0., 1., 2., 3.], device='cuda:1')"
    assert out["format"] == "6.0"


@pytest.mark.slow
def test_torchscript_still_compiles_torch_tensor(tmp_path: Path) -> None:
    """torch.tensor, as_tensor and asarray are wrapped (to resolve a bare "cuda"): TorchScript,
    which compiles them by identity, still knows them as its builtins."""
    (tmp_path / "scripted.py").write_text(
        textwrap.dedent(
            """
            import torch


            @torch.jit.script
            def plus_three(x: torch.Tensor) -> torch.Tensor:
                return x + torch.tensor([1.0]) + torch.as_tensor([2.0])
            """
        )
    )
    out = run_script(tmp_path, 'import scripted\nout["sum"] = scripted.plus_three(torch.ones(1)).tolist()')
    assert out["sum"] == [4.0]


@pytest.mark.slow
def test_modules_autograd_and_optimizers_run_on_simulated_gpus(tmp_path: Path) -> None:
    """Parameters moved to a simulated GPU, their gradients (made by the autograd engine) and the
    optimizer's state are charged there, as on CUDA; moving the model back frees them."""
    out = run_script(
        tmp_path,
        """
        import copy
        model = torch.nn.Linear(1024, 1024).to("cuda")  # 4 MiB of weight, 4 KiB of bias
        weights = torch.cuda.memory_allocated()
        out["params"] = [str(p.device) for p in model.parameters()] + [
            isinstance(model.weight, torch.nn.Parameter), model.weight.requires_grad, weights]
        model(torch.randn(8, 1024, device="cuda")).square().mean().backward()
        out["grads"] = [str(p.grad.device) for p in model.parameters()]
        with_grads = torch.cuda.memory_allocated()
        optimizer = torch.optim.Adam(model.parameters())
        optimizer.step()
        state = optimizer.state[model.weight]
        out["adam"] = [str(state["exp_avg"].device), str(state["exp_avg_sq"].device)]
        with_state = torch.cuda.memory_allocated()
        twin = copy.deepcopy(model)
        out["deepcopy"] = [str(twin.weight.device), torch.cuda.memory_allocated() - with_state]
        del twin, optimizer, state
        model.cpu()
        gc.collect()
        out["back"] = [str(model.weight.device), str(model.weight.grad.device), torch.cuda.memory_allocated()]
        out["sizes"] = [with_grads - weights, with_state - with_grads]
        """,
    )
    weights = 1024 * 1024 * 4 + 4096
    assert out["params"] == ["cuda:0", "cuda:0", True, True, weights]
    assert out["grads"] == ["cuda:0", "cuda:0"]
    assert out["adam"] == ["cuda:0", "cuda:0"]
    assert out["deepcopy"][0] == "cuda:0" and out["deepcopy"][1] >= 2 * weights  # the weights and their grads
    assert out["back"] == ["cpu", "cpu", 0]
    grads, state = out["sizes"]
    assert grads == weights and state == 2 * weights  # exp_avg and exp_avg_sq (step stays on the host)


@pytest.mark.slow
def test_simulated_tensors_fail_as_cuda_does(tmp_path: Path) -> None:
    """torch's OutOfMemoryError (its message, a cap from set_per_process_memory_fraction) for
    factories, charged before the host is asked for the bytes, and for op results alike;
    c10's invalid ordinal."""
    out = run_script(
        tmp_path,
        """
        MiB = 2**20
        torch.cuda.set_per_process_memory_fraction(0.01, 0)  # 163.84 MiB
        out["factory"] = error(lambda: torch.ones(2**40, dtype=torch.uint8, device="cuda:0"))  # never on the host
        x = torch.ones(64 * MiB, dtype=torch.uint8, device="cuda:0")
        out["result"] = error(lambda: torch.cat([x, x]))  # 128 MiB more, past the cap
        out["ooms"] = torch.cuda.memory_stats(0)["num_ooms"]
        out["allocated"] = torch.cuda.memory_allocated(0) // MiB
        out["factory_ordinal"] = error(lambda: torch.ones(1, device="cuda:7"))
        out["to_ordinal"] = error(lambda: torch.ones(1).to("cuda:7"))
        """,
    )
    total = 16 * GiB
    assert out["factory"].startswith(
        "OutOfMemoryError: CUDA out of memory. Tried to allocate 1024.00 GiB. GPU 0 has a total capacity of 16.00 GiB "
        f"of which {(total - OVERHEAD) / GiB:.2f} GiB is free. Including non-PyTorch memory, this process has "
        f"512.00 MiB memory in use. {int(0.01 * total) / MiB:.2f} MiB allowed;"
    ), out["factory"]
    assert out["result"].startswith("OutOfMemoryError: CUDA out of memory. Tried to allocate 128.00 MiB.")
    assert out["ooms"] == 2
    assert out["allocated"] == 64  # nothing charged for what failed
    for key in ("factory_ordinal", "to_ordinal"):
        assert out[key].startswith(
            "AcceleratorError: CUDA error: invalid device ordinal\nGPU device may be out of range"
        ), out[key]


@pytest.mark.slow
def test_a_thread_s_bare_cuda_is_its_own_current_device(tmp_path: Path) -> None:
    out = run_script(
        tmp_path,
        """
        import threading
        torch.cuda.set_device(2)
        seen = {}

        def work():
            seen["new"] = str(torch.ones(1, device="cuda").device)  # a new thread is on ordinal 0
            torch.cuda.set_device(3)
            seen["set"] = str(torch.ones(1, device="cuda").device)

        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
        out["thread"] = seen
        out["main"] = str(torch.ones(1, device="cuda").device)
        """,
    )
    assert out["thread"] == {"new": "cuda:0", "set": "cuda:3"}
    assert out["main"] == "cuda:2"


@pytest.mark.slow
def test_the_allocator_keeps_its_books_when_threads_allocate_and_free_tensors(tmp_path: Path) -> None:
    """The caching allocator's mutex: tensors freed in other threads (or by the garbage collector
    during an allocation) wait for it, so the blocks and the statistics stay consistent."""
    out = run_script(
        tmp_path,
        """
        import sys, threading
        sys.setswitchinterval(1e-6)  # switch threads as often as possible
        torch.ones(1, device="cuda")
        errors = []

        def work():
            try:
                for i in range(1500):
                    a = torch.empty(512 * (1 + i % 7), dtype=torch.uint8, device="cuda")
                    b = a[1:]
                    del a, b
            except Exception as exc:
                errors.append(repr(exc))

        threads = [threading.Thread(target=work) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        gc.collect()
        stats = torch.cuda.memory_stats()
        out["errors"] = errors
        out["books"] = [stats["allocated_bytes.all.current"], stats["active.all.current"],
                        stats["allocation.all.current"]]
        """,
    )
    assert out["errors"] == []
    assert out["books"] == [0, 0, 0]


XPU_PRELUDE = PRELUDE.replace("torch_cuda.install(torch)", "torch_cuda.install_xpu(torch)")


@pytest.mark.slow
def test_tensors_on_a_fake_intel_machine_are_xpu_tensors(tmp_path: Path) -> None:
    out = run_script(
        tmp_path,
        """
        x = torch.ones(1024, device="xpu:1")
        y = torch.zeros(4).xpu()
        out["xpu"] = [str(x.device), x.is_xpu, x.is_cuda, str(y.device), str((x + 1).device),
                      torch.xpu.memory_allocated(1), torch.xpu.memory_allocated(0)]
        out["cuda"] = error(lambda: torch.ones(1, device="cuda"))  # no CUDA on an Intel machine
        out["oom"] = error(lambda: torch.empty(2**40, dtype=torch.uint8, device="xpu")).split(".")[0]
        """,
        sim_spec="xpu:sim:2x64GiB",
        prelude=XPU_PRELUDE,
    )
    assert out["xpu"] == ["xpu:1", True, False, "xpu:0", "xpu:1", 4096, 512]
    assert out["cuda"].startswith("AssertionError: Torch not compiled with CUDA enabled")
    assert out["oom"] == "OutOfMemoryError: XPU out of memory"


@pytest.mark.slow
def test_torch_save_writes_a_simulated_tensor_as_a_cpu_tensor(tmp_path: Path) -> None:
    out = run_script(
        tmp_path,
        """
        import io
        model = torch.nn.Linear(4, 2).cuda()
        buffer = io.BytesIO()
        torch.save(model.state_dict(), buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=True)
        out["loaded"] = [str(loaded["weight"].device), type(loaded["weight"]) is torch.Tensor,
                         torch.equal(loaded["weight"], model.weight.detach().cpu())]
        model.load_state_dict(loaded)
        out["model"] = str(model.weight.device)
        """,
    )
    assert out["loaded"] == ["cpu", True, True]
    assert out["model"] == "cuda:0"


# -- the double before torch is imported --------------------------------------------------


def _fresh(tmp_path: Path, code: str, **extra: str) -> subprocess.CompletedProcess[str]:
    require("torch", module="torch")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES" and not k.startswith("PYTEST_GPU_")}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]))
    env.update(extra)
    command = [sys.executable, "-c", textwrap.dedent(code)]
    return subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=patience(120))


def test_empty_without_the_double_says_exactly_what_to_do(tmp_path: Path) -> None:
    done = _fresh(tmp_path, "from pytest_gpu.sim import torch_cuda\ntorch_cuda.empty(1)\n")
    assert done.returncode == 1
    assert f"RuntimeError: {torch_cuda.NOT_INSTALLED}" in done.stderr
    assert "--gpus sim:4x16GiB" in torch_cuda.NOT_INSTALLED
    assert "pytest_gpu.sim.torch_cuda.install(torch) after `import torch`" in torch_cuda.NOT_INSTALLED


@pytest.mark.slow
def test_empty_before_import_torch_on_fake_gpus_imports_torch_and_works(tmp_path: Path) -> None:
    code = """
    import sys
    from pytest_gpu.sim import fake, torch_cuda
    fake.activate()
    assert "torch" not in sys.modules
    block = torch_cuda.empty("1MiB", 0)
    import torch
    print(torch.cuda.memory_allocated(0), torch.cuda.is_available())
    block.free()
    """
    done = _fresh(
        tmp_path,
        code,
        PYTEST_GPU_FAKE_GPUS="sim:1x16GiB",
        PYTEST_GPU_SIM_LEDGER=str(tmp_path / "ledger"),
        PYTEST_GPU_MACHINE_DIR=str(tmp_path / "machines"),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(2**20), "True"]


# -- tracebacks: the double's frames stay out of them ------------------------------------------

TORCH_OOM_SUITE = """
import pytest
import torch
from pytest_gpu import sim
from pytest_gpu.sim import torch_cuda


@pytest.mark.gpu(memory="1GiB")
def test_factory(gpu):
    torch.ones(2**31, dtype=torch.uint8, device="cuda")  # the user's line: factory


@pytest.mark.gpu(memory="1GiB")
def test_result(gpu):
    x = torch.ones(2**29, dtype=torch.uint8, device="cuda")
    torch.cat([x, x])  # the user's line: result


@pytest.mark.gpu(memory="1GiB")
def test_empty(gpu):
    torch_cuda.empty("2GiB")  # the user's line: empty


@pytest.mark.gpu
def test_device_full(gpu):
    with sim.allocate("3GiB"):
        torch.empty(2**30, dtype=torch.uint8, device="cuda")  # the user's line: full


@pytest.mark.gpu
def test_shapes(gpu):
    torch.ones(3, device="cuda") + torch.ones(4, device="cuda")  # the user's line: shapes
"""


def test_torch_s_errors_on_simulated_gpus_show_the_test_s_line(gpu_pytester: pytest.Pytester, run_inner) -> None:
    """As torch's errors, which come from C++: the test's line and torch's message, no frame of
    the double, and no simulator error chained to an OOM whose message says it all."""
    require("torch", module="torch")
    gpu_pytester.makepyfile(test_oom=TORCH_OOM_SUITE)
    result = run_inner("--gpus", "sim:1x4GiB", "-p", "no:xdist", subprocess=True, timeout=180)
    result.assert_outcomes(failed=5)
    output = result.stdout.str()
    parts = re.split(r"^_{3,} (test_\w+) _{3,}$", output, flags=re.MULTILINE)
    pairs = zip(parts[1::2], parts[2::2], strict=True)
    sections = {name: text.split("short test summary info")[0] for name, text in pairs}
    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate"
    expected = {
        "test_factory": ("factory", f"{oom} 2.00 GiB"),
        "test_result": ("result", f"{oom} 1024.00 MiB"),
        "test_empty": ("empty", f"{oom} 2.00 GiB"),
        "test_device_full": ("full", f"{oom} 1024.00 MiB"),
        "test_shapes": ("shapes", "RuntimeError: The size of tensor a (3) must match the size of tensor b (4)"),
    }
    for name, (line, error) in expected.items():
        text = sections[name]
        assert re.search(rf"^>\s+.*# the user's line: {line}$", text, flags=re.MULTILINE), text
        assert re.search(rf"^E\s+{re.escape(error)}", text, flags=re.MULTILINE), text
        assert "pytest_gpu/sim/" not in text and "direct cause" not in text, text


def test_first_use_of_a_kernel_or_library_grows_the_context_not_torch_s_counters(tmp_path: Path) -> None:
    """Lazy module loading, cuBLAS and cuDNN, local memory: each first use grows the process's
    NVML figure for good, and nothing torch counts; cuBLAS's workspace is one per stream, in
    torch's allocator until ``_cuda_clearCublasWorkspaces`` (aten/src/ATen/cuda/CublasHandlePool.cpp)."""
    out = run_script(
        tmp_path,
        """
        def nvml():
            return ledger().used()[0]

        torch.cuda.set_device(0)
        out["opened"] = nvml()
        torch_cuda.launch("add", 0)
        torch_cuda.launch("add", 0)  # loaded once
        out["kernel"] = nvml()
        torch_cuda.launch("scan", 0, local_memory="64MiB")
        torch_cuda.launch("scan", 0, local_memory="16MiB")  # local memory never shrinks
        out["lmem"] = nvml()
        torch_cuda.matmul(0)
        out["cublas"] = nvml()
        out["cublas_allocated"] = torch.cuda.memory_allocated(0)
        torch_cuda.matmul(0)  # the same stream: its workspace again
        torch_cuda.matmul(0, stream=1)  # a new stream: a new workspace
        out["streams_allocated"] = torch.cuda.memory_allocated(0)
        torch.cuda.empty_cache()
        out["after_empty"] = torch.cuda.memory_allocated(0)
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
        out["cleared"] = (torch.cuda.memory_allocated(0), torch.cuda.memory_reserved(0))
        torch_cuda.convolution(0)
        out["cudnn"] = nvml()
        """,
    )
    ws = torch_cuda.CUBLAS_WORKSPACE
    assert out["opened"] == OVERHEAD
    assert out["kernel"] == OVERHEAD + torch_cuda.KERNEL_MODULE
    assert out["lmem"] == out["kernel"] + torch_cuda.KERNEL_MODULE + 64 * MiB
    segment = 10 * MiB  # 8.125 MiB: from a 20 MiB segment (between 1 and 10 MiB)
    assert out["cublas"] == out["lmem"] + torch_cuda.CUBLAS_CONTEXT + 2 * segment
    assert out["cublas_allocated"] == ws
    assert out["streams_allocated"] == 2 * ws
    assert out["after_empty"] == 2 * ws  # empty_cache keeps what is allocated
    assert out["cleared"] == [0, 0]
    assert out["cudnn"] == out["lmem"] + torch_cuda.CUBLAS_CONTEXT + torch_cuda.CUDNN_CONTEXT


GROWTH_SEEN = """
import os
import torch
from pytest_gpu.sim import torch_cuda
from pytest_gpu.vendors.{module} import {vendor}
from pytest_gpu.sim.spec import {uuid_of} as uuid_of
device = {device!r}


def mine():
    return {vendor}.sampler().processes(uuid_of(0))[os.getpid()]


module = getattr(torch, device.partition(":")[0])  # torch.cuda (ROCm's too) or torch.xpu
torch_cuda.empty("16MiB", device).free()
module.empty_cache()
out["opened"] = mine()
torch_cuda.launch("add", device, local_memory="64MiB")
out["kernel"] = mine()
torch_cuda.matmul(device, stream=1)
out["matmul"] = mine()
out["matmul_allocated"] = module.memory_allocated(0)
torch_cuda.convolution(device)
out["conv"] = mine()
"""


@pytest.mark.slow  # imports torch in a subprocess
@pytest.mark.parametrize(
    ("spec_", "module", "vendor", "device", "uuid_of"),
    [
        ("amd:sim:1x16GiB", "amd", "AMD", "cuda:0", "amd_uuid"),
        ("xpu:sim:1x64GiB", "intel", "XPU", "xpu:0", "xpu_uuid"),
    ],
    ids=["amdsmi", "sysman"],
)
def test_context_growth_shows_in_every_vendor_s_per_process_figure(
    tmp_path: Path, spec_: str, module: str, vendor: str, device: str, uuid_of: str
) -> None:
    """amdsmi's vram_mem (fdinfo's drm-memory-vram) and Sysman's memSize count a process's code
    objects and library state as NVML does: the doubles' context growth shows there. torch.xpu's
    matmul is oneDNN's, whose scratchpad is freed with the call: no workspace stays allocated; torch
    on ROCm keeps a per-stream workspace as on CUDA, of 32 MiB."""
    require("torch", module="torch")
    code = GROWTH_SEEN.format(module=module, vendor=vendor, device=device, uuid_of=uuid_of)
    out = run_fake_python(tmp_path, spec_, code, amdsmi=module == "amd", quiet=True)
    MiB = 2**20
    assert out["kernel"] == out["opened"] + torch_cuda.KERNEL_MODULE + 64 * MiB
    grown = out["matmul"] - out["kernel"]
    if module == "amd":  # cuBLAS's magnitude and ROCm's workspace (a segment of its own size)
        assert grown == torch_cuda.CUBLAS_CONTEXT + torch_cuda.HIPBLAS_WORKSPACE
        assert out["matmul_allocated"] == torch_cuda.HIPBLAS_WORKSPACE
    else:
        assert grown == torch_cuda.CUBLAS_CONTEXT
        assert out["matmul_allocated"] == 0
    assert out["conv"] == out["matmul"] + torch_cuda.CUDNN_CONTEXT


def test_empty_cache_gives_every_cached_segment_back_in_one_ledger_write(tmp_path: Path) -> None:
    """Issue 33 ("A lease at the floor"): the adapters empty torch's cache after every GPU test;
    each segment is a cudaFree, and the ledger is written once for them all, with the same result."""
    out = run_script(
        tmp_path,
        """
        import importlib
        ledger_module = importlib.import_module("pytest_gpu.sim.ledger")
        blocks = [empty(30 * 2**20), empty(60 * 2**20), empty(1000)]  # three segments: two large, one small
        for block in blocks:
            block.free()
        out["cached"] = [torch.cuda.memory_reserved(), ledger().used()[0]]
        writes = []
        real = ledger_module.Ledger._write
        ledger_module.Ledger._write = lambda self, *a: (writes.append(1), real(self, *a))[1]
        torch.cuda.empty_cache()
        out["writes"] = len(writes)
        stats = torch.cuda.memory_stats()
        out["after"] = [torch.cuda.memory_reserved(), ledger().used()[0], stats["num_device_free"],
                        stats["segment.all.current"]]
        """,
    )
    assert out["cached"] == [30 * MiB + 60 * MiB + 2 * MiB, OVERHEAD + 92 * MiB]
    assert out["writes"] == 1
    assert out["after"] == [0, OVERHEAD, 3, 0]
