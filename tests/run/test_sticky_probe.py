"""The sticky-error probe (issue 31, finding 7): every sticky code, any framework, a hung kernel.

The doubles first: each of CUDA's sticky errors (700, 702, 710, 714-719, 911) is raised by the
simulated torch and CuPy with their real messages, and a hung kernel blocks every synchronize.
Then the probe: any error of a synchronize after a test quarantines the process, CuPy-only
and JAX-only processes are probed through their own framework, and a synchronize that does not
return within the timeout quarantines the process instead of blocking it.
"""

from __future__ import annotations

import sys
import time
import types
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from conftest import require, run_fake_python
from pytest_gpu import sim
from pytest_gpu.run.quarantine import probe
from pytest_gpu.sim import cupy_cuda

CODES = {
    "cudaErrorIllegalAddress": 700,
    "cudaErrorLaunchTimeout": 702,
    "cudaErrorAssert": 710,
    "cudaErrorHardwareStackError": 714,
    "cudaErrorIllegalInstruction": 715,
    "cudaErrorMisalignedAddress": 716,
    "cudaErrorInvalidAddressSpace": 717,
    "cudaErrorInvalidPc": 718,
    "cudaErrorLaunchFailure": 719,
    "cudaErrorExternalDevice": 911,
}


@pytest.fixture
def machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(sim.LEDGER_ENV, str(tmp_path / "ledger"))
    monkeypatch.setenv(sim.SPEC_ENV, "sim:2x4GiB")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv(sim.TAG_ENV, raising=False)
    sim.cuda.forget()
    yield
    sim.cuda.forget()


@pytest.fixture
def cupy(machine: None, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """The CuPy stand-in as the test process's ``cupy`` (no torch CUDA started here)."""
    module: types.ModuleType = cupy_cuda.module()
    monkeypatch.setitem(sys.modules, "cupy", module)
    return module


def test_every_sticky_code_is_modelled_with_its_name():
    assert {name: sim.cuda.ERROR_CODES[name] for name in sim.STICKY_ERRORS.values()} == CODES


def test_cupy_raises_each_sticky_error_as_cupy_does(cupy):
    for text, name in sim.STICKY_ERRORS.items():
        sim.cuda.clear_sticky()
        cupy.cuda.Device(1).use()
        sim.poison(text)
        runtime = cupy.cuda.runtime
        for call in (runtime.deviceSynchronize, cupy.cuda.Device(1).synchronize, partial(runtime.setDevice, 0)):
            with pytest.raises(cupy.cuda.runtime.CUDARuntimeError) as caught:
                call()
            assert caught.value.status == CODES[name]
            assert str(caught.value) == f"{name}: {text}"


def test_a_cupy_only_process_is_probed_for_every_sticky_error(cupy):
    """Before: only torch was asked, and only five codes were known."""
    for text, name in sim.STICKY_ERRORS.items():
        sim.cuda.clear_sticky()
        cupy.cuda.Device(1).use()  # the CuPy adapter makes each leased GPU current
        assert probe(["cuda:1"]) is None
        sim.poison(text)
        assert probe(["cuda:1"]) == f"{name}: {text}"


def test_any_error_of_the_synchronize_means_the_context_is_gone(cupy, monkeypatch):
    cupy.cuda.Device(0).use()

    def failing() -> None:
        raise RuntimeError("cudaErrorUnknown: unknown error")

    monkeypatch.setattr(cupy.cuda.runtime, "deviceSynchronize", failing)
    assert probe(["cuda:0"]) == "CuPy: cudaErrorUnknown: unknown error"


def test_a_hung_kernel_is_found_within_the_timeout(cupy):
    cupy.cuda.Device(0).use()
    sim.hang()
    try:
        started = time.monotonic()
        found = probe(["cuda:0"], timeout=0.5)
        assert time.monotonic() - started < 5
        assert found is not None and "did not finish within 0.5 s" in found and "hung kernel" in found
    finally:
        sim.release_hang()
    assert probe(["cuda:0"], timeout=5) is None  # it ended: usable again


def test_no_framework_loaded_nothing_is_asked(machine, monkeypatch):
    for name in ("cupy", "jax", "jax._src.xla_bridge"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    sim.poison()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        pytest.skip("torch's CUDA started in this process")
    assert probe(["cuda:0"]) is None  # the probe starts no framework's CUDA


class _JaxDevice:
    def __init__(self, hardware: int, fail: str = "") -> None:
        self.platform, self.id, self.local_hardware_id, self.fail = "gpu", hardware, hardware, fail


def _fake_jax(monkeypatch: pytest.MonkeyPatch, started: bool, devices: list[_JaxDevice]) -> list[int]:
    """A jax module with what the probe reads: ``jax._src.xla_bridge.backends_are_initialized``,
    ``local_devices``, ``device_put(...).block_until_ready()`` (XlaRuntimeError on a broken GPU)."""
    asked: list[int] = []
    jax = types.ModuleType("jax")
    bridge = types.ModuleType("jax._src.xla_bridge")
    bridge.backends_are_initialized = lambda: started  # type: ignore[attr-defined]

    def local_devices() -> list[_JaxDevice]:
        assert started, "local_devices() starts JAX's backends"
        return devices

    def device_put(value: object, device: _JaxDevice) -> types.SimpleNamespace:
        asked.append(device.id)

        def ready() -> None:
            if device.fail:
                raise RuntimeError(device.fail)

        return types.SimpleNamespace(block_until_ready=ready)

    jax.local_devices = local_devices  # type: ignore[attr-defined]
    jax.device_put = device_put  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "jax", jax)
    monkeypatch.setitem(sys.modules, "jax._src.xla_bridge", bridge)
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    return asked


def test_a_jax_only_process_is_probed_once_its_backends_started(monkeypatch):
    failure = "INTERNAL: CUDA error: an illegal memory access was encountered"
    asked = _fake_jax(monkeypatch, False, [_JaxDevice(0, failure)])
    assert probe(["cuda:0"]) is None and asked == []  # JAX never started: nothing asked
    asked = _fake_jax(monkeypatch, True, [_JaxDevice(0), _JaxDevice(1, failure)])
    assert probe(["cuda:0"]) is None and asked == [0]  # only the lease's GPUs
    assert probe(["cuda:1"]) == failure


@pytest.mark.slow
def test_torch_raises_each_sticky_error_and_the_probe_finds_it(tmp_path):
    require("torch", module="torch")
    out = run_fake_python(
        tmp_path,
        "sim:2x16GiB",
        """
import torch
from pytest_gpu import sim
from pytest_gpu.run.quarantine import probe
from pytest_gpu.sim import torch_cuda
x = torch_cuda.empty(2**20, device=1)
for text, name in sim.STICKY_ERRORS.items():
    sim.cuda.clear_sticky()
    assert probe(["cuda:1"]) is None
    sim.poison(text)
    try:
        torch.cuda.synchronize(1)
    except torch.AcceleratorError as exc:
        assert str(exc).startswith(f"CUDA error: {text}\\nSearch for `{name}'"), exc
    else:
        raise AssertionError(name)
    out[name] = probe(["cuda:1"])
sim.cuda.clear_sticky()
sim.hang()
out["hung"] = probe(["cuda:1"], timeout=0.5)
sim.release_hang()
out["after"] = probe(["cuda:1"])
""",
    )
    for name in CODES:
        assert out[name] is not None and out[name].startswith("CUDA error: "), (name, out[name])
    assert "did not finish within 0.5 s" in out["hung"]
    assert out["after"] is None


# -- the plugin ----------------------------------------------------------------------------

CUPY_SUITE = """
import sys
import pytest
from pytest_gpu import sim
from pytest_gpu.sim import cupy_cuda

@pytest.mark.gpu(memory="4GiB")
def test_a_breaks_cuda_quietly():
    import cupy
    cupy.get_default_memory_pool().malloc("1GiB")
    sim.poison("hardware stack error")  # a kernel's fault that the test never synchronised on

@pytest.mark.gpu(memory="12GiB")
def test_b_needs_the_gpu():
    import cupy
    cupy.get_default_memory_pool().malloc("10GiB").free()
"""

CONFTEST = """
import sys
from pytest_gpu.run import quarantine
from pytest_gpu.sim import cupy_cuda
sys.modules["cupy"] = cupy_cuda.module()  # the suite's CuPy, as if installed
quarantine.PROBE_TIMEOUT = 1.0
"""

HUNG_SUITE = """
import pytest
from pytest_gpu import sim

@pytest.mark.gpu(memory="4GiB")
def test_a_leaves_a_hung_kernel():
    import cupy
    cupy.get_default_memory_pool().malloc("1GiB")
    sim.hang()

@pytest.mark.gpu(memory="4GiB")
def test_b_needs_the_gpu():
    import cupy
    cupy.get_default_memory_pool().malloc("1GiB").free()
"""


@pytest.mark.parametrize("suite", ["sticky", "hung"])
def test_a_cupy_only_worker_is_quarantined_and_replaced(gpu_pytester, run_inner, suite):
    gpu_pytester.makeconftest(CONFTEST)
    gpu_pytester.makepyfile(test_probe=CUPY_SUITE if suite == "sticky" else HUNG_SUITE)
    args = ("--gpus", "sim:1x16GiB", "-n", "1", "-p", "no:randomly", "--gpu-wait-timeout=60")
    result = run_inner(*args, subprocess=True)
    out = result.stdout.str()
    assert "replacing crashed worker gw0" in out, out
    why = "cudaErrorHardwareStackError: hardware stack error" if suite == "sticky" else "did not finish within 1 s"
    assert "quarantined: test_probe.py::test_a_" in out and why in out, out
    result.assert_outcomes(passed=2, errors=1)  # a passed, yet broke CUDA: an error at its teardown
