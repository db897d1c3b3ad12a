"""Skips where skips belong, ``backend="auto"`` that works where it runs, no green run that tested nothing.

- a distributed test whose rank pool cannot be placed on the run's GPUs (too many ranks x
  ``gpus_per_rank``, no GPUs, ``backend="nccl"`` where NCCL cannot run) is skipped at
  collection like an oversize ``gpu`` request (or fails under ``--gpu-oversize=fail``),
  never with the broker's traceback;
- ``backend="auto"`` is nccl only on real GPUs with a torch that has NCCL, gloo elsewhere,
  and the summary says which it chose, for the tests that ran (not those skipped before);
- the summary says in one line how many GPU tests were skipped and why, and
  ``--gpu-required`` (ini ``gpu_required``) stops a run with GPU tests and no GPUs at start.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import types
import xml.etree.ElementTree as ET
from types import SimpleNamespace

import pytest

from conftest import require
from helpers import patience
from pytest_gpu.base.requests import DefaultMemory
from pytest_gpu.distributed import backends
from pytest_gpu.distributed.backends import (
    AUTO_PROPERTY,
    AutoChoice,
    build_nccl_missing,
    fit_ranks,
    nccl_missing,
)
from pytest_gpu.distributed.runner import never_runs as pool_never_runs
from pytest_gpu.gpu.discovery import discover
from pytest_gpu.report.summary import Summary
from pytest_gpu.run.lifecycle import Leases
from pytest_gpu.scheduling.catalog import entries as catalog_entries
from pytest_gpu.sim import fake
from pytest_gpu.vendors.devices import Device, Inventory

GiB = 2**30

# Nothing here may run: each is skipped at collection on a run with 2 (simulated) GPUs or none.
SUITE = """
import pytest

@pytest.mark.distributed(world_size=4, backend="nccl")
def test_nccl_four(rank):
    raise AssertionError("must not run")

@pytest.mark.distributed(world_size=2, backend="nccl")
def test_nccl_two(rank):
    raise AssertionError("must not run")

@pytest.mark.distributed(world_size=2, backend="gloo", gpus_per_rank=2)
def test_gloo_two_gpus_each(rank):
    raise AssertionError("must not run")

@pytest.mark.gpu(3)
def test_gpu_three(gpu):
    raise AssertionError("must not run")

@pytest.mark.skip(reason="skipped before its pool: the summary says no backend chosen for it")
@pytest.mark.distributed(world_size=2)
def test_auto(rank):
    pass

def test_cpu():
    pass
"""

SIM = "2 simulated GPUs (2x16GiB)"
NCCL_ON_SIM = "the GPUs are simulated (sim:2x16GiB) and NCCL needs real ones"
SKIPPED_ON_SIM = [
    f"SKIPPED [[]1[]] test_suite.py:3: pytest-gpu: its pool of 4 ranks (nccl via spawn, 1 GPU/rank) needs 4 GPUs "
    f"(whole GPU each) but this run has {SIM}",
    f"SKIPPED [[]1[]] test_suite.py:7: pytest-gpu: backend='nccl' cannot run here: {NCCL_ON_SIM}; "
    "backend='auto' would take gloo here",
    f"SKIPPED [[]1[]] test_suite.py:11: pytest-gpu: its pool of 2 ranks (gloo via spawn, 2 GPU/rank) needs 4 GPUs "
    f"(whole GPU each) but this run has {SIM}",
    f"SKIPPED [[]1[]] test_suite.py:15: pytest-gpu: needs 3 GPUs (whole GPU each) but this run has {SIM}",
]


def _no_traceback(result: pytest.RunResult) -> None:
    out = result.stdout.str() + result.stderr.str()
    for text in ("BrokerError", "Traceback", "RuntimeError", "must not run"):
        assert text not in out


@pytest.mark.parametrize("workers", ["0", "2"])
def test_unplaceable_distributed_tests_are_skipped_at_collection_on_sim(gpu_pytester, run_inner, workers):
    gpu_pytester.makepyfile(test_suite=SUITE)
    result = run_inner("--gpus", "sim:2x16GiB", "-rs", "-n", workers, subprocess=workers != "0")
    result.assert_outcomes(passed=1, skipped=5)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines_random(SKIPPED_ON_SIM)
    result.stdout.fnmatch_lines(
        [
            f"pytest-gpu: 4 GPU tests skipped: 3 larger than this run's {SIM}; 1 nccl unavailable — {NCCL_ON_SIM} "
            "(-rs lists them)",
        ]
    )
    assert "backend='auto' chose" not in result.stdout.str()  # its one auto test was skipped, on no pool
    _no_traceback(result)


@pytest.mark.parametrize("workers", ["0", "2"])
def test_without_gpus_every_gpu_test_is_skipped_and_the_summary_says_why(gpu_pytester, run_inner, workers):
    gpu_pytester.makepyfile(test_suite=SUITE)
    result = run_inner("--gpus", "none", "-rs", "-n", workers, subprocess=workers != "0")
    result.assert_outcomes(passed=1, skipped=5)
    none = "but this run has no GPUs (--gpus none)"
    result.stdout.fnmatch_lines_random(
        [
            f"SKIPPED [[]1[]] test_suite.py:3: pytest-gpu: its pool of 4 ranks (nccl via spawn, 1 GPU/rank) "
            f"needs 4 GPUs (whole GPU each) {none}",
            f"SKIPPED [[]1[]] test_suite.py:7: pytest-gpu: its pool of 2 ranks (nccl via spawn, 1 GPU/rank) "
            f"needs 2 GPUs (whole GPU each) {none}",
            f"SKIPPED [[]1[]] test_suite.py:15: pytest-gpu: needs 3 GPUs (whole GPU each) {none}",
        ]
    )
    result.stdout.fnmatch_lines(["pytest-gpu: 4 GPU tests skipped: no GPUs — --gpus none (-rs lists them)"])
    assert "backend='auto' chose" not in result.stdout.str()
    _no_traceback(result)


def test_unplaceable_distributed_tests_fail_under_oversize_fail(gpu_pytester, run_inner):
    gpu_pytester.makepyfile(test_suite=SUITE)
    result = run_inner("--gpus", "sim:2x16GiB", "--gpu-oversize=fail")
    result.assert_outcomes(passed=1, skipped=1, errors=4)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines_random(
        [
            f"pytest-gpu: its pool of 4 ranks (nccl via spawn, 1 GPU/rank) needs 4 GPUs (whole GPU each) but this "
            f"run has {SIM} (--gpu-oversize=fail)",
            f"pytest-gpu: backend='nccl' cannot run here: {NCCL_ON_SIM}; backend='auto' would take gloo here "
            "(--gpu-oversize=fail)",
        ]
    )
    assert "GPU tests skipped" not in result.stdout.str()  # they failed: nothing was skipped silently
    _no_traceback(result)


def test_the_scheduler_plans_what_cannot_run_here_as_cpu_work(gpu_pytester):
    """A skipped test waits for no GPU: the catalog gives it none (nccl_two's pool would fit)."""
    gpu_pytester.makepyfile(test_suite=SUITE)
    items, _ = gpu_pytester.inline_genitems("--gpus", "sim:2x16GiB", "-p", "no:cacheprovider")
    run = SimpleNamespace(  # what entries() asks of the run
        settings=SimpleNamespace(default_memory=DefaultMemory(exclusive=True)),
        inventory=discover("sim:2x16GiB", environ={}),
        never_fits=lambda request: None if request.count <= 2 else "too many",
        node=None,  # not a --gpu-nodes worker
    )
    never = Leases(items[0].config, never=(pool_never_runs,)).never_runs  # as a worker's catalog is given it
    entries = catalog_entries(items, run, never)  # type: ignore[arg-type]
    gpus = {item.name: entries.get(item.nodeid, {}).get("gpus", 0) for item in items}
    assert gpus == dict.fromkeys(
        ["test_nccl_four", "test_nccl_two", "test_gloo_two_gpus_each", "test_gpu_three", "test_auto", "test_cpu"], 0
    )
    run.never_fits = lambda request: None  # as on a machine where they all fit: the GPU tests ask for theirs
    fitting = catalog_entries(items, run, never)  # type: ignore[arg-type]
    assert fitting[items[2].nodeid]["gpus"] == 4  # test_gloo_two_gpus_each: 2 ranks x 2 GPUs


# The README's GPU-less CI recipe: PYTEST_GPU_FAKE_GPUS=sim:2x16GiB pytest -n 2 --gpus auto
RECIPE = """
import pytest

@pytest.mark.distributed(world_size=2)
def test_allreduce(rank):
    import torch
    import torch.distributed as dist
    t = torch.ones(2)
    dist.all_reduce(t)
    assert t.tolist() == [2.0, 2.0]
    assert dist.get_backend() == "gloo"

@pytest.mark.distributed(world_size=2, backend="nccl")
def test_nccl(rank):
    raise AssertionError("must not run")

@pytest.mark.distributed(world_size=3, gpus_per_rank=1)
def test_three_ranks_a_gpu_each(rank):
    raise AssertionError("must not run")
"""


@pytest.mark.parametrize("workers", ["0", "2"])
def test_readme_recipe_on_fake_gpus_runs_auto_on_gloo_and_skips_nccl(gpu_pytester, fake_run, workers):
    require("torch", module="torch")
    gpu_pytester.makepyfile(test_recipe=RECIPE)
    result = fake_run("sim:2x16GiB", "-n", workers, "--gpus", "auto", "-rs")
    result.assert_outcomes(passed=1, skipped=2)
    faked = "the GPUs are fake (PYTEST_GPU_FAKE_GPUS=sim:2x16GiB) and NCCL needs real ones"
    result.stdout.fnmatch_lines_random(
        [
            f"SKIPPED [[]1[]] test_recipe.py:12: pytest-gpu: backend='nccl' cannot run here: {faked}; "
            "backend='auto' would take gloo here",
            "SKIPPED [[]1[]] test_recipe.py:16: pytest-gpu: its pool of 3 ranks (gloo via spawn, 1 GPU/rank) "
            "needs 3 GPUs (whole GPU each) but this run has 2 GPUs (2x16GiB)",
            f"pytest-gpu: backend='auto' chose gloo for 1 distributed test: {faked}",  # test_allreduce; not the skip
            f"pytest-gpu: 2 GPU tests skipped: 1 larger than this run's 2 GPUs (2x16GiB); 1 nccl unavailable — {faked} "
            "(-rs lists them)",
        ]
    )
    _no_traceback(result)


# -- --gpu-required ------------------------------------------------------------------------------

REQUIRED = (
    "ERROR: pytest-gpu: --gpu-required (ini gpu_required): this run has no GPUs (--gpus none), and 4 selected "
    "tests need GPUs (test_suite.py::test_nccl_four, ...); give the job its GPUs (the NVIDIA driver, "
    "CUDA_VISIBLE_DEVICES, --gpus), or leave --gpu-required out to let GPU tests be skipped"
)


@pytest.mark.parametrize("workers", ["0", "2"])
def test_gpu_required_stops_a_run_with_gpu_tests_and_no_gpus(gpu_pytester, run_inner, workers):
    gpu_pytester.makepyfile(test_suite=SUITE)
    result = run_inner("--gpus", "none", "--gpu-required", "-n", workers, subprocess=workers != "0")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([REQUIRED])
    result.assert_outcomes()  # not one test ran
    assert "must not run" not in result.stdout.str()


# no vendor's driver on the machine: NVML, amdsmi and Level Zero's loader all missing, whatever this one has
NO_DRIVERS = """
from pytest_gpu.vendors import amd, intel, nvidia


def _no_nvml():
    raise nvidia.NvmlUnavailable("NVML unavailable: NVML Shared Library Not Found")


def _no_amdsmi():
    raise amd.AmdSmiUnavailable("amdsmi is not installed (No module named 'amdsmi')")


def _no_level_zero(environ):
    raise intel.ZesUnavailable("no Level Zero loader (libze_loader.so.1: cannot open shared object file)")


nvidia.nvml_devices, amd.amdsmi_devices, intel.sysman_devices = _no_nvml, _no_amdsmi, _no_level_zero
"""
EVERY_VENDOR = (
    "ERROR: pytest-gpu: --gpu-required (ini gpu_required): this run has no GPUs (NVML unavailable: NVML Shared "
    "Library Not Found; amdsmi is not installed (No module named 'amdsmi'); no Level Zero loader "
    "(libze_loader.so.1: cannot open shared object file)), and 4 selected tests need GPUs "
    "(test_suite.py::test_nccl_four, ...); give the job its GPUs (NVIDIA: the NVIDIA driver, CUDA_VISIBLE_DEVICES; "
    "AMD: the amdgpu driver, amdsmi, ROCR_VISIBLE_DEVICES; Intel: the Intel GPU driver and Level Zero loader "
    "(libze_loader.so.1), ZE_AFFINITY_MASK, --gpus), or leave --gpu-required out to let GPU tests be skipped"
)


def test_gpu_required_with_auto_and_no_gpus_says_what_every_vendor_lacks(gpu_pytester, run_inner):
    """Issue 29: `--gpus auto` on a machine without GPUs said NVIDIA's reason and means only, so an
    AMD or Intel user was never told what is missing."""
    gpu_pytester.makeconftest(NO_DRIVERS)
    gpu_pytester.makepyfile(test_suite=SUITE)
    result = run_inner("--gpus", "auto", "--gpu-required", subprocess=True)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([EVERY_VENDOR])


def test_gpu_required_ini_key_and_what_it_leaves_alone(gpu_pytester, run_inner):
    gpu_pytester.makepyfile(test_suite=SUITE)
    gpu_pytester.makeini("[pytest]\ngpu_required = true\ngpus = none\n")
    stopped = run_inner()
    assert stopped.ret == pytest.ExitCode.USAGE_ERROR
    stopped.stderr.fnmatch_lines([REQUIRED])
    # a selection without GPU tests runs (deselection counts: the check is after it)
    cpu_only = run_inner("-k", "test_cpu or test_auto")
    cpu_only.assert_outcomes(passed=1, skipped=1)
    # --collect-only runs no test: it lists them as ever
    listed = run_inner("--collect-only", "-q")
    assert listed.ret == pytest.ExitCode.OK
    listed.stdout.fnmatch_lines(["test_suite.py::test_nccl_four"])
    # with GPUs (simulated ones too) the run goes on; what cannot run on them is still skipped
    on_sim = run_inner("--gpus", "sim:2x16GiB")
    on_sim.assert_outcomes(passed=1, skipped=5)
    # false turns it off
    gpu_pytester.makeini("[pytest]\ngpu_required = false\ngpus = none\n")
    run_inner().assert_outcomes(passed=1, skipped=5)


# Every way a test comes to need GPUs, and tests that look like GPU tests and are not skipped for
# having none: --gpu-required and the summary of a run without GPUs must count the same tests.
EVERY_WAY = """
import pytest

@pytest.mark.gpu(memory="1GiB")
def test_marker():
    raise AssertionError("must not run")

def test_gpu_fixture(gpu):
    raise AssertionError("must not run")

def test_section(gpu_request):
    with gpu_request(memory="1GiB"):
        raise AssertionError("must not run")

@pytest.fixture(scope="module")
def model(gpu_lease_factory):
    yield gpu_lease_factory(memory="1GiB")

@pytest.mark.parametrize("n", [1, 2, 3])
def test_with_a_leasing_fixture(model, n):
    raise AssertionError("must not run")

@pytest.mark.distributed(world_size=2, gpus_per_rank=1)
def test_pool_of_gpus(rank):
    raise AssertionError("must not run")

@pytest.mark.distributed(world_size=1)
def test_pool_on_the_cpu(rank):  # backend="auto": gloo, no GPU
    pass

@pytest.mark.gpu(memory="1GiB", isolate=True)
def test_isolated():
    raise AssertionError("must not run")

@pytest.mark.gpu(2)
@pytest.mark.parametrize("x", [1, 2])
def test_two_gpus(x):
    raise AssertionError("must not run")

@pytest.mark.skip(reason="its own skip")
@pytest.mark.gpu
def test_skipped_by_itself():
    pass

@pytest.mark.skipif(True, reason="its own skipif")
@pytest.mark.gpu
def test_skipped_by_its_skipif():
    pass

@pytest.mark.host_resources(cpus=1000000)
def test_too_many_cpus():  # skipped by pytest-gpu, for no GPU
    raise AssertionError("must not run")

@pytest.mark.gpu
def test_deselected():
    raise AssertionError("must not run")

def test_cpu():
    pass
"""


def test_gpu_required_counts_the_tests_a_run_without_gpus_skips_for_it(gpu_pytester, run_inner):
    """The same suite, with -k deselecting one: "10 selected tests need GPUs" where the run
    without --gpu-required skips 10 for having no GPUs (a fixture's lease counts, a test's own
    skip does not), and a test skipped for the machine's CPUs is not called a GPU test."""
    gpu_pytester.makepyfile(test_suite=EVERY_WAY)
    args = ("--gpus", "none", "-k", "not deselected", "-rs")
    skipped = run_inner(*args)
    skipped.assert_outcomes(passed=2, skipped=13)
    skipped.stdout.fnmatch_lines(
        [
            "pytest-gpu: 11 tests skipped: 10 no GPUs — --gpus none; 1 more CPUs or RAM than the machine has "
            "(-rs lists them)"
        ]
    )
    assert "must not run" not in skipped.stdout.str()
    required = run_inner(*args, "--gpu-required")
    assert required.ret == pytest.ExitCode.USAGE_ERROR
    required.stderr.fnmatch_lines(
        [
            "*--gpu-required (ini gpu_required): this run has no GPUs (--gpus none), and 10 "
            "selected tests need GPUs (test_suite.py::test_marker, ...);*"
        ]
    )
    # the run's own count, read off the same lines
    said = re.search(r"(\d+) no GPUs", skipped.stdout.str())
    needed = re.search(r"and (\d+) selected tests need GPUs", required.stderr.str())
    assert said is not None and needed is not None and said.group(1) == needed.group(1)


def test_gpu_required_bad_ini_value_is_a_usage_error(gpu_pytester, run_inner):
    gpu_pytester.makepyfile(test_suite=SUITE)
    gpu_pytester.makeini("[pytest]\ngpu_required = maybe\n")
    result = run_inner()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: ini key 'gpu_required': expected true or false, got 'maybe'"])


def test_gpu_required_is_in_the_options_table_as_a_flag():
    from pytest_gpu.run.options import FLAGS, OPTIONS

    rows = {ini: (option, default) for option, ini, default, _ in OPTIONS}
    assert rows["gpu_required"] == ("--gpu-required", "false")
    assert "gpu_required" in FLAGS


# -- backend="auto" and what nccl lacks (units) ----------------------------------------------------

CPU_BUILD = """from typing import Optional

__all__ = ['__version__', 'debug', 'cuda', 'git_version', 'hip', 'rocm', 'xpu']
__version__ = '2.13.0+cpu'
debug = False
cuda: Optional[str] = None
git_version = 'cf30153c4c131c8164ee7798e5022d810682e2cb'
hip: Optional[str] = None
"""
CUDA_BUILD_OLD = "__version__ = '1.13.1+cu117'\ndebug = False\ncuda = '11.7'\nhip = None\n"
ROCM_BUILD = "__version__ = '2.3.0+rocm6.0'\ncuda: Optional[str] = None\nhip: Optional[str] = '6.0.32830'\n"


def test_a_torch_build_has_nccl_where_it_is_a_cuda_or_rocm_build_for_linux():
    assert build_nccl_missing(CPU_BUILD, "linux") == "torch 2.13.0+cpu has no NCCL (a CPU build)"
    assert build_nccl_missing(CUDA_BUILD_OLD, "linux") is None
    assert build_nccl_missing(ROCM_BUILD, "linux") is None
    assert build_nccl_missing(CUDA_BUILD_OLD, "win32") == "torch 1.13.1+cu117 has no NCCL on win32"
    assert build_nccl_missing("# unreadable\n", "linux") is None  # cannot tell: the ranks' torch will


def _torch_stub(version: str, cuda: str | None, nccl: bool) -> tuple[types.ModuleType, types.ModuleType]:
    torch = types.ModuleType("torch")
    torch.__version__ = version  # type: ignore[attr-defined]
    torch.version = types.SimpleNamespace(cuda=cuda, hip=None)  # type: ignore[attr-defined]
    dist = types.ModuleType("torch.distributed")
    dist.is_available = lambda: True  # type: ignore[attr-defined]
    dist.is_nccl_available = lambda: nccl  # type: ignore[attr-defined]
    torch.distributed = dist  # type: ignore[attr-defined]
    return torch, dist


@pytest.mark.parametrize(
    ("version", "cuda", "nccl", "missing"),
    [
        ("2.3.0+cu121", "12.1", True, None),
        ("2.3.0+cpu", None, False, "torch 2.3.0+cpu has no NCCL (a CPU build)"),
        ("2.3.0+cu121", "12.1", False, "torch 2.3.0+cu121 has no NCCL"),  # built with USE_NCCL=0
    ],
)
def test_an_imported_torch_is_asked(monkeypatch, version, cuda, nccl, missing):
    torch, dist = _torch_stub(version, cuda, nccl)
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch.distributed", dist)
    assert backends.torch_nccl_missing() == missing


def test_auto_takes_gloo_for_more_ranks_than_gpus():
    two = Inventory((Device(0, "GPU-a", 80 * GiB), Device(1, "GPU-b", 80 * GiB)), "nvml")
    nccl = AutoChoice("nccl", "2 GPUs (2x80GiB) and a torch with NCCL")
    assert fit_ranks(nccl, 2, two) is nccl
    assert fit_ranks(nccl, 3, two) == AutoChoice(
        "gloo", "3 ranks would need 3 GPUs for nccl and this run has 2 GPUs (2x80GiB)"
    )
    gloo = AutoChoice("gloo", "torch 2.3.0+cpu has no NCCL (a CPU build)")
    assert fit_ranks(gloo, 3, two) is gloo


AUTO_SUITE = """
import pytest

@pytest.mark.skip(reason="the auto choice is read off its junitxml properties; no pool is started")
@pytest.mark.distributed(world_size=2)
def test_two(rank):
    pass

@pytest.mark.skip(reason="the auto choice is read off its junitxml properties; no pool is started")
@pytest.mark.distributed(world_size=3)
def test_three(rank):
    pass

@pytest.mark.distributed(world_size=3, gpus_per_rank=1)
def test_three_with_a_gpu_each(rank):
    raise AssertionError("must not run")
"""


def test_where_nccl_can_run_auto_takes_it_for_the_ranks_that_fit(gpu_pytester, run_inner, monkeypatch):
    monkeypatch.setattr(backends, "nccl_missing", lambda inventory: None)  # as on real GPUs with CUDA torch
    gpu_pytester.makepyfile(test_auto=AUTO_SUITE)
    result = run_inner("--gpus", "sim:2x16GiB", "-rs", "--junitxml=junit.xml", "-o", "junit_family=xunit1")
    result.assert_outcomes(skipped=3)
    result.stdout.fnmatch_lines([f"pytest-gpu: 1 GPU test skipped: larger than this run's {SIM} (-rs lists them)"])
    chosen = {
        case.get("name"): {p.get("name"): p.get("value") for p in case.iter("property")}.get(AUTO_PROPERTY)
        for case in ET.parse(gpu_pytester.path / "junit.xml").iter("testcase")
    }
    assert chosen == {
        "test_two": f"nccl: {SIM} and a torch with NCCL",
        "test_three": f"gloo: 3 ranks would need 3 GPUs for nccl and this run has {SIM}",
        "test_three_with_a_gpu_each": f"nccl: {SIM} and a torch with NCCL",
    }
    assert "backend='auto' chose" not in result.stdout.str()  # none of them ran on a pool
    # an explicit gpus_per_rank keeps its GPUs: the pool of 3 cannot be placed, and says so
    result.stdout.fnmatch_lines(
        [
            "SKIPPED [[]1[]] test_auto.py:13: pytest-gpu: its pool of 3 ranks (nccl via spawn, 1 GPU/rank) needs 3 "
            f"GPUs (whole GPU each) but this run has {SIM}"
        ]
    )


def test_nccl_needs_real_gpus(monkeypatch):
    monkeypatch.setattr(backends, "torch_nccl_missing", lambda: None)  # a torch with NCCL: the GPUs decide
    assert nccl_missing(discover("sim:2x16GiB", environ={})) == NCCL_ON_SIM
    real = Inventory((Device(0, "GPU-a", 16 * GiB),), "nvml")
    assert nccl_missing(real) is None
    monkeypatch.setattr(fake, "_active", "sim:1x8GiB")  # the fake machine's GPUs look real to NVML
    monkeypatch.setenv(fake.FAKE_ENV, "sim:1x8GiB")
    assert nccl_missing(real) == "the GPUs are fake (PYTEST_GPU_FAKE_GPUS=sim:1x8GiB) and NCCL needs real ones"


@pytest.mark.slow  # imports torch
def test_the_installed_torch_is_read_without_importing_it_and_agrees_with_it():
    require("torch", module="torch")
    code = textwrap.dedent(
        """
        import sys
        from pytest_gpu.distributed import backends
        unimported = backends.torch_nccl_missing()
        assert "torch" not in sys.modules, "torch was imported to answer"
        import torch.distributed
        print(repr(unimported)); print(repr(backends.torch_nccl_missing()))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=patience(300), check=True
    )
    unimported, imported = out.stdout.splitlines()
    assert unimported == imported


# -- the summary's line (units) ----------------------------------------------------------------


def _skip_report(nodeid: str, reason: str, why: str | None) -> pytest.TestReport:
    props = [("gpu_skipped", why)] if why else []
    return pytest.TestReport(
        nodeid, ("t.py", 1, nodeid), {}, "skipped", ("t.py", 1, f"Skipped: {reason}"), "setup", user_properties=props
    )


def test_the_backend_line_counts_the_tests_that_ran_on_a_pool_only():
    """A test skipped before its pool (a skip marker, too large here) had no backend chosen for it."""
    chosen = [(AUTO_PROPERTY, "gloo: this run has no GPUs (--gpus none)")]
    summary = Summary()
    for when, outcome in (("setup", "skipped"), ("teardown", "passed")):
        summary.add(
            pytest.TestReport("t.py::skipped", ("t.py", 1, "s"), {}, outcome, None, when, user_properties=chosen)
        )
    assert summary.backend_lines() == []
    for when in ("setup", "call", "teardown"):
        summary.add(pytest.TestReport("t.py::ran", ("t.py", 5, "r"), {}, "passed", None, when, user_properties=chosen))
    assert summary.backend_lines() == [
        "pytest-gpu: backend='auto' chose gloo for 1 distributed test: this run has no GPUs (--gpus none)"
    ]


def test_skipped_line_groups_by_why_and_counts_run_time_skips():
    summary = Summary()
    summary.add(_skip_report("t.py::a", "pytest-gpu: needs 1 GPU", "no GPUs — --gpus none"))
    summary.add(_skip_report("t.py::b", "pytest-gpu: needs 5 GPUs (1GiB each) ...", None))  # a gpu_request block
    summary.add(_skip_report("t.py::c", "not today", None))  # the test's own skip: not counted
    none = Inventory((), "none", "--gpus none")
    assert summary.skipped_lines(none) == ["pytest-gpu: 2 GPU tests skipped: no GPUs — --gpus none (-rs lists them)"]
    assert Summary().skipped_lines(none) == []
    two = Inventory((Device(0, "GPU-a", 16 * GiB), Device(1, "GPU-b", 16 * GiB)), "nvml")
    summary.add(
        _skip_report("t.py::d", "pytest-gpu: backend='nccl' ...", "nccl unavailable — torch 2.3.0+cpu has no NCCL")
    )
    assert summary.skipped_lines(two) == [
        "pytest-gpu: 3 GPU tests skipped: 1 larger than this run's 2 GPUs (2x16GiB); 1 nccl unavailable — torch "
        "2.3.0+cpu has no NCCL; 1 no GPUs — --gpus none (-rs lists them)"
    ]
