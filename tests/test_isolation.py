"""Confinement: the environment, and the torch/CuPy adapters on (stand-in) real GPUs.

The machines have no GPU, so torch and NVML are replaced by recording stand-ins in
``sys.modules``: they show which calls the plugin makes, and on which device ordinals.
"""

from __future__ import annotations

import os
import sys
import types

import pytest

from pytest_gpu import sim
from pytest_gpu.gpu.devices import Device, Inventory, parse_sim_spec
from pytest_gpu.gpu.isolation import confine, make_lease

GiB = 2**30


class FakeCuda:
    """``torch.cuda`` as far as pytest-gpu uses it; records every call that changes state."""

    def __init__(self, *, initialized: bool = False, current: int = 0, available: bool = True) -> None:
        self.calls: list[tuple] = []
        self.initialized = initialized
        self.current = current
        self.available = available

    def is_available(self) -> bool:
        return self.available

    def is_initialized(self) -> bool:
        return self.initialized

    def current_device(self) -> int:
        return self.current

    def set_device(self, ordinal: int) -> None:
        self.calls.append(("set_device", ordinal))
        self.current = ordinal

    def set_per_process_memory_fraction(self, fraction: float, ordinal: int) -> None:
        self.calls.append(("fraction", fraction, ordinal))

    def reset_peak_memory_stats(self, ordinal: int) -> None:
        self.calls.append(("reset_peak", ordinal))

    def memory_allocated(self, ordinal: int) -> int:
        return 0

    def max_memory_reserved(self, ordinal: int) -> int:
        return 0


def fake_torch(**kwargs) -> types.ModuleType:
    torch = types.ModuleType("torch")
    torch.cuda = FakeCuda(**kwargs)
    return torch


def real_inventory(indices=(0, 1, 2, 3), total: int = 16 * GiB) -> Inventory:
    """Non-simulated devices, as NVML discovery would give them."""
    return Inventory(tuple(Device(i, f"GPU-real-{i:04d}", total, "Fake GPU") for i in indices), "nvml")


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", sim.TAG_ENV):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_torch_gets_device_and_caps_on_leased_gpus_only(clean_env):
    torch = fake_torch()
    clean_env.setitem(sys.modules, "torch", torch)
    clean_env.setenv("CUDA_VISIBLE_DEVICES", "outer")
    inventory = real_inventory()
    lease = make_lease("k", [1, 3], 4 * GiB, False, 0.0, inventory, "tag")

    visible = "GPU-real-0001,GPU-real-0003"  # UUIDs: immune to ordering differences
    assert lease.visible_devices == visible
    assert lease.uuids == ("GPU-real-0001", "GPU-real-0003")
    assert lease.device == "cuda:1"  # torch is loaded: it numbers the whole inventory
    assert lease.env == {
        "CUDA_VISIBLE_DEVICES": visible,
        "HIP_VISIBLE_DEVICES": visible,
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }

    done = confine(lease, inventory)
    assert torch.cuda.calls == [
        ("fraction", 0.25, 1),
        ("reset_peak", 1),
        ("fraction", 0.25, 3),
        ("reset_peak", 3),
        ("set_device", 1),
    ]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == visible
    assert os.environ["HIP_VISIBLE_DEVICES"] == visible

    done.undo()
    assert torch.cuda.calls[5:] == [("fraction", 1.0, 3), ("fraction", 1.0, 1)]
    assert {call[-1] for call in torch.cuda.calls} == {1, 3}  # GPUs 0 and 2 never touched
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "outer"
    assert "HIP_VISIBLE_DEVICES" not in os.environ
    assert done.notes == []


def test_torch_current_device_is_restored(clean_env):
    torch = fake_torch(initialized=True, current=2)
    clean_env.setitem(sys.modules, "torch", torch)
    inventory = real_inventory()
    lease = make_lease("k", [0], 8 * GiB, False, 0.0, inventory, "tag")
    done = confine(lease, inventory)
    assert torch.cuda.calls == [("fraction", 0.5, 0), ("reset_peak", 0), ("set_device", 0)]
    done.undo()
    assert torch.cuda.calls[3:] == [("set_device", 2), ("fraction", 1.0, 0)]


def test_torch_ordinals_follow_an_outer_visible_list():
    """With CUDA_VISIBLE_DEVICES=2,3 outside the run, physical GPU 3 is torch's cuda:1."""
    torch = fake_torch()
    inventory = real_inventory(indices=(2, 3))
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "torch", torch)
        mp.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        lease = make_lease("k", [3], 16 * GiB, True, 0.0, inventory, "tag")
        assert lease.device == "cuda:1"
        done = confine(lease, inventory)
        done.undo()
    assert torch.cuda.calls == [("fraction", 1.0, 1), ("reset_peak", 1), ("set_device", 1), ("fraction", 1.0, 1)]


def test_torch_without_cuda_is_left_alone(clean_env):
    torch = fake_torch(available=False)
    clean_env.setitem(sys.modules, "torch", torch)
    inventory = real_inventory()
    done = confine(make_lease("k", [2], GiB, False, 0.0, inventory, "t"), inventory)
    done.undo()
    assert torch.cuda.calls == []


def test_no_framework_loaded_imports_none(clean_env):
    for name in ("torch", "cupy"):
        clean_env.delitem(sys.modules, name, raising=False)
    inventory = real_inventory()
    lease = make_lease("k", [2], GiB, False, 0.0, inventory, "t")
    assert lease.device == "cuda:0"  # CUDA will start inside the test, seeing only the lease
    done = confine(lease, inventory)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "GPU-real-0002"
    done.undo()
    assert "torch" not in sys.modules
    assert "cupy" not in sys.modules
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_simulated_lease_does_not_touch_torch(clean_env):
    torch = fake_torch()
    clean_env.setitem(sys.modules, "torch", torch)
    inventory = Inventory(parse_sim_spec("sim:2x16GiB"), "sim:2x16GiB")
    lease = make_lease("k", [1], 2 * GiB, False, 0.0, inventory, "tag-1")
    assert lease.visible_devices == "1"
    assert lease.env[sim.TAG_ENV] == "tag-1"
    assert lease.device == "cuda:0"
    done = confine(lease, inventory)
    assert os.environ[sim.TAG_ENV] == "tag-1"
    done.undo()
    assert torch.cuda.calls == []
    assert sim.TAG_ENV not in os.environ


def test_cupy_device_and_pool_limit(clean_env):
    calls: list[tuple] = []

    class Device:
        def __init__(self, ordinal: int) -> None:
            self.ordinal = ordinal

        def use(self) -> None:
            calls.append(("use", self.ordinal))

    class Pool:
        limit = 0

        def get_limit(self) -> int:
            return self.limit

        def set_limit(self, size: int) -> None:
            calls.append(("set_limit", size))
            self.limit = size

    pool = Pool()
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(Device=Device)
    cupy.get_default_memory_pool = lambda: pool
    clean_env.setitem(sys.modules, "cupy", cupy)
    clean_env.delitem(sys.modules, "torch", raising=False)
    inventory = real_inventory()
    lease = make_lease("k", [2, 3], 3 * GiB, False, 0.0, inventory, "t")
    assert lease.device == "cuda:2"
    done = confine(lease, inventory)
    assert calls == [("use", 2), ("set_limit", 3 * GiB)]
    done.undo()
    assert calls[2:] == [("set_limit", 0)]


# -- the same through pytest, on a stand-in NVML inventory ------------------------------------


def fake_pynvml(count: int = 4, total: int = 16 * GiB) -> types.ModuleType:
    nvml = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    nvml.NVMLError = NVMLError
    nvml.nvmlInit = lambda: None
    nvml.nvmlShutdown = lambda: None
    nvml.nvmlDeviceGetCount = lambda: count
    nvml.nvmlDeviceGetHandleByIndex = lambda i: i
    nvml.nvmlDeviceGetHandleByUUID = lambda uuid: int(uuid.rsplit("-", 1)[1])
    nvml.nvmlDeviceGetUUID = lambda h: f"GPU-fake-{h:04d}"
    nvml.nvmlDeviceGetName = lambda h: "Fake GPU"
    nvml.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=total)
    nvml.nvmlDeviceGetComputeRunningProcesses = lambda h: []
    return nvml


def test_torch_confined_through_pytest_on_nvml_inventory(gpu_pytester, run_inner, monkeypatch):
    torch = fake_torch()
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    monkeypatch.setitem(sys.modules, "torch", torch)
    gpu_pytester.makepyfile(
        test_torch="""
        import os
        import pytest
        import torch

        SEEN = {}

        @pytest.mark.gpu(count=2, memory="4GiB")
        def test_confined(gpu):
            a, b = gpu.indices
            SEEN["indices"] = (a, b)
            assert gpu.uuids == (f"GPU-fake-{a:04d}", f"GPU-fake-{b:04d}")
            assert gpu.device == f"cuda:{a}"
            assert os.environ["CUDA_VISIBLE_DEVICES"] == f"GPU-fake-{a:04d},GPU-fake-{b:04d}"
            assert os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
            assert torch.cuda.calls == [
                ("fraction", 0.25, a),
                ("reset_peak", a),
                ("fraction", 0.25, b),
                ("reset_peak", b),
                ("set_device", a),
            ]

        def test_after():
            a, b = SEEN["indices"]
            assert torch.cuda.calls[5:] == [("fraction", 1.0, b), ("fraction", 1.0, a)]
            assert "CUDA_VISIBLE_DEVICES" not in os.environ
        """
    )
    result = run_inner("--gpus", "auto")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["pytest-gpu: 4 GPUs (4x16GiB) [[]nvml[]] · 1 GPU test · * · 0 violations"])
    touched = {call[-1] for call in torch.cuda.calls}
    assert len(touched) == 2  # only the two leased GPUs, never the other two


def test_torch_initialised_inside_a_test_is_warned_about(gpu_pytester, run_inner, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(count=2))
    monkeypatch.setitem(sys.modules, "torch", fake_torch())
    monkeypatch.delitem(sys.modules, "torch")  # not loaded when the test starts
    gpu_pytester.makepyfile(
        test_late="""
        import sys
        import types
        import pytest

        @pytest.mark.gpu(memory="1GiB")
        def test_late_torch(gpu):
            torch = types.ModuleType("torch")
            torch.cuda = types.SimpleNamespace(
                is_available=lambda: True,
                is_initialized=lambda: True,
                memory_allocated=lambda i: 0,
                max_memory_reserved=lambda i: 0,
            )
            sys.modules["torch"] = torch
        """
    )
    result = run_inner("--gpus", "auto")
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines(["*PytestWarning: pytest-gpu: torch initialised CUDA inside this test*"])


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
