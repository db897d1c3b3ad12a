"""Issue 31 on a real NVIDIA GPU: the sticky-error probe (finding 7), the current device after
memory fractions (9), NVML kept open per process (11). Each check is a short subprocess.

Runs only where ``nvidia-smi`` sees a GPU and torch has CUDA; elsewhere skipped, saying so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from test_real_gpu import GPUS, NO_GPU, cuda_torch, real_gpus

from helpers import patience

pytestmark = pytest.mark.skipif(not GPUS, reason=NO_GPU)
__all__ = ["cuda_torch", "real_gpus"]  # the real-GPU suite's fixtures, used here


def _python(code: str, timeout: float = 120, **env: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", "import json\nout = {}\n" + code + "\nprint('OUT', json.dumps(out))"],
        capture_output=True,
        text=True,
        timeout=patience(timeout),
        env={**os.environ, **env},
    )
    line = next((x for x in done.stdout.splitlines() if x.startswith("OUT ")), None)
    assert line is not None, done.stdout + done.stderr
    found: dict = json.loads(line[4:])
    return found


def test_a_device_side_assert_and_a_busy_kernel_are_found_by_the_probe(cuda_torch):
    out = _python(
        """
import torch
from pytest_gpu.run.quarantine import probe
x = torch.ones(4, device="cuda")
out["clean"] = probe(["cuda:0"])
torch.cuda._sleep(int(2e10))  # a kernel that spins for about ten seconds: a hang to a 2 s probe
out["busy"] = probe(["cuda:0"], timeout=2)
""",
        timeout=240,
    )
    assert out["clean"] is None
    assert "did not finish within 2 s" in out["busy"], out
    out = _python(
        """
import torch
from pytest_gpu.run.quarantine import probe
x = torch.ones(4, device="cuda")
x[torch.tensor([7], device="cuda")] = 1.0  # an index out of range: a device-side assert (710)
out["found"] = probe(["cuda:0"])
"""
    )
    assert "device-side assert triggered" in out["found"], out


def test_the_rank_s_fractions_leave_the_body_on_cuda_0(cuda_torch):
    if len(GPUS) < 2:
        pytest.skip("one GPU: the current device cannot move (real-GPU suite)")
    out = _python(
        """
import torch
from pytest_gpu.distributed import rankmain
rankmain._cap_torch_when_started(2**30)
out["tensor"] = torch.ones(4).cuda().device.index
out["current"] = torch.cuda.current_device()
out["torch"] = torch.__version__
"""
    )
    assert out["tensor"] == 0 and out["current"] == 0, out


def test_nvml_is_initialised_once_per_process_and_anew_in_a_forked_child(real_gpus):
    pytest.importorskip("pynvml", reason="nvidia-ml-py not installed (real-GPU suite)")
    out = _python(
        """
import os, time
import pynvml
from pytest_gpu.vendors.nvidia import NVIDIA
uuid = NVIDIA.devices()[0][0].uuid
inits, real = [], pynvml.nvmlInit
pynvml.nvmlInit = lambda: (inits.append(1), real())[1]
start = time.perf_counter()
for _ in range(20):
    driver = NVIDIA.sampler()
    driver.compute(uuid)
    driver.close()
out["ms_per_sample"] = (time.perf_counter() - start) * 50
out["inits"] = len(inits)
read, write = os.pipe()
if os.fork() == 0:
    try:
        NVIDIA.sampler().compute(uuid)
        os.write(write, b"ok")
    finally:
        os._exit(0)
os.wait()
out["child"] = os.read(read, 100).decode()
"""
    )
    assert out["inits"] == 1 and out["child"] == "ok", out
