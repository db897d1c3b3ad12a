"""NVML opened once per process, not twice per GPU test (issue 31, finding 11).

The fake libnvidia-ml.so.1 counts ``nvmlInit``/``nvmlShutdown`` as NVML does, and, NVML not being
fork-safe, a forked child's copy is not initialised: its calls answer "Uninitialized" until it
initialises NVML itself. The vendor's sampler is the process's one NVML, kept open; a forked
child opens its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import require, run_fake_python

pytestmark = pytest.mark.slow  # a fresh interpreter on a fake machine (the library is built from C)

CODE = """
import os
import pynvml
from pytest_gpu.vendors.nvidia import NVIDIA

uuid = NVIDIA.devices()[0][0].uuid
inits = []
real = pynvml.nvmlInit

def counting():
    inits.append(1)
    return real()

pynvml.nvmlInit = counting
for _ in range(5):  # what five GPU tests' verifiers ask
    driver = NVIDIA.sampler()
    out.setdefault("compute", driver.compute(uuid))
    driver.close()
out["inits"] = len(inits)

read, write = os.pipe()
child = os.fork()
if child == 0:
    said = []
    try:
        pynvml.nvmlDeviceGetCount()  # the parent's NVML, as the child inherited it
        said.append("parent's NVML answered")
    except pynvml.NVMLError as exc:
        said.append(str(exc))
    try:
        NVIDIA.sampler().compute(uuid)  # the child's own
        said.append("ok")
    except Exception as exc:
        said.append(repr(exc))
    os.write(write, "|".join(said).encode())
    os._exit(0)
os.waitpid(child, 0)
out["child"] = os.read(read, 1000).decode().split("|")
out["parent"] = len(NVIDIA.sampler().compute(uuid)) >= 0
out["inits_after"] = len(inits)
"""


def test_the_verifier_s_nvml_is_opened_once_and_a_forked_child_opens_its_own(tmp_path: Path) -> None:
    require("nvidia-ml-py", module="pynvml")
    out = run_fake_python(tmp_path, "sim:2x16GiB", CODE)
    assert out["inits"] == 1, out  # was 5: nvmlInit and nvmlShutdown around every sample
    assert out["child"] == ["Uninitialized", "ok"], out  # the double: a child must init; the product does
    assert out["parent"] and out["inits_after"] == 1, out  # the parent's stays open, untouched by the child
