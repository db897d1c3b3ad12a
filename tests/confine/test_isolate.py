"""``gpu(..., isolate=True)``: a multi-GPU test body, unedited, in a process that sees exactly its lease.

The inner suites below are written as for a machine of their own (``device_count() == 2``,
``cuda:1``); they run beside a session fixture that holds GPU 0 for the whole run, so the
lease never starts at GPU 0 and ``cuda:1`` is never physical GPU 1: what the body's
process calls ``cuda:1`` must be the lease's second GPU, and be charged there. Simulated
GPUs (``--gpus sim:``, the ledger's verifier) with ``-n 0``, fake GPUs (the NVML path of a
real machine) with ``-n 2``; the unit tests check the marker's parsing and the pools' key.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import require
from pytest_gpu.base.distspec import isolated_spec
from pytest_gpu.base.requests import GpuRequest, GpuRequestError, split_isolate
from pytest_gpu.base.spans import LeaseSpan
from pytest_gpu.distributed.runner import with_torch_peaks
from pytest_gpu.gpu.verification import Verdict
from pytest_gpu.run.conventions import MarkerMapError, parse_marker_map

# -- the marker's keyword ------------------------------------------------------------------------


def test_isolate_is_split_from_the_lease_keywords() -> None:
    assert split_isolate({"memory": "8GiB", "isolate": True}, "gpu marker") == ({"memory": "8GiB"}, True)
    assert split_isolate({"count": 2}, "gpu marker") == ({"count": 2}, False)


def test_isolate_must_be_a_bool() -> None:
    with pytest.raises(GpuRequestError, match=r"gpu marker: isolate must be True or False, got 'yes'; expected"):
        split_isolate({"isolate": "yes"}, "gpu marker")


def test_the_marker_map_takes_isolate_as_a_word_or_a_key() -> None:
    mapping = parse_marker_map(["multi_gpu: count=2 memory=8GiB isolate", "pair: count=2 isolate=false"])
    assert mapping == {
        "multi_gpu": {"count": 2, "memory": "8GiB", "isolate": True},
        "pair": {"count": 2, "isolate": False},
    }
    with pytest.raises(MarkerMapError, match="isolate must be true or false, got 'maybe'"):
        parse_marker_map(["multi_gpu: count=2 isolate=maybe"])


def test_pools_are_keyed_by_the_leases_shape() -> None:
    two = GpuRequest(count=2, memory=2**30, exclusive=False)
    assert isolated_spec(two).pool_key == isolated_spec(GpuRequest(count=2, memory=2**30, exclusive=False)).pool_key
    assert isolated_spec(two).pool_key != isolated_spec(GpuRequest(count=2, memory=2**31, exclusive=False)).pool_key
    assert isolated_spec(two).pool_key != isolated_spec(GpuRequest(count=1, memory=2**30, exclusive=False)).pool_key
    spec = isolated_spec(two)
    assert (spec.world_size, spec.gpus_per_rank, spec.backend, spec.isolated) == (1, 2, "none", True)
    assert spec.gpu_request(default_memory=None) is two  # type: ignore[arg-type]  # the lease, not a default


def test_torch_peaks_from_its_process_count_where_nvml_has_none() -> None:
    span = LeaseSpan((2, 3), 2**30, False, 0.0, 0.0, 1.0)
    verdict = with_torch_peaks(Verdict(peak={2: 0, 3: 5}, measured=False), span, [0, 2**31])
    assert verdict.measured and verdict.peak == {2: 0, 3: 2**31}, verdict  # ordinal 1 is the lease's GPU 3
    assert verdict.violations == ["peak 2GiB on GPU 3 is above its budget of 1GiB"], verdict
    exact = Verdict(peak={2: 7, 3: 7})  # the simulated ledger's (measured): kept as it is
    assert with_torch_peaks(exact, span, [0, 2**31]).peak == {2: 7, 3: 7}


# -- inner runs -----------------------------------------------------------------------------------

CONFTEST = """
import json
import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def holds_a_gpu(gpu_lease_factory):
    # held for the whole run (by each worker): the isolated tests' leases are other GPUs
    lease = gpu_lease_factory(count=1, exclusive=True)
    (Path(os.environ["ISOLATE_OUT"]) / f"held-{os.getpid()}.json").write_text(json.dumps(lease.indices))
"""

SUITE = """
import gc
import json
import os
from pathlib import Path

import pytest

OUT = Path(os.environ["ISOLATE_OUT"])
TWO = pytest.mark.gpu(2, memory="2GiB", isolate=True)
KEPT = []


def note(name, **values):
    (OUT / f"{name}.json").write_text(json.dumps(values))


@TWO
def test_a_sees_its_lease(tmp_path):
    import torch
    from pytest_gpu.sim import cuda, torch_cuda

    assert torch.cuda.device_count() == 2  # written for a machine of its own
    block = torch_cuda.empty("1GiB", "cuda:1")
    fraction = torch.cuda.get_per_process_memory_fraction(1)
    note("a", pid=os.getpid(), cuda1=cuda.unit_of(1), fraction=fraction, total=torch.cuda.mem_get_info(1)[1],
         tmp=str(tmp_path), frozen=gc.get_freeze_count(), xla=os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"))
    block.free()


@TWO
def test_b_warm():
    note("b", pid=os.getpid(), frozen=gc.get_freeze_count())


def test_c_plain():
    note("c", pid=os.getpid())


@TWO
def test_d_fails():
    x = 1
    assert x == 2


@TWO
def test_e_keeps_memory():
    import torch
    from pytest_gpu.sim import torch_cuda

    KEPT.append(torch_cuda.empty("512MiB", "cuda:1"))
    note("e", pid=os.getpid())


@TWO
def test_f_after_the_leak():
    note("f", pid=os.getpid())


@pytest.mark.multi_gpu  # the suite's own marker, mapped by gpu_marker_map: the test is not edited
def test_h_the_suites_own_marker():
    import torch

    assert torch.cuda.device_count() == 2
    note("h", pid=os.getpid())


@pytest.mark.gpu(2, memory="2GiB", cpus=1, isolate=True)
def test_i_its_threads_follow_its_cpus():
    assert os.environ["OMP_NUM_THREADS"] == "1"


@TWO
def test_g_over_its_budget():
    import torch
    from pytest_gpu.sim import torch_cuda

    torch_cuda.empty("3GiB", "cuda:0")
"""


INI = """
[pytest]
markers = multi_gpu: needs two GPUs
gpu_marker_map =
    multi_gpu: count=2 memory=2GiB isolate
"""


def _cases(xml: Path) -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    for case in ET.parse(xml).iter("testcase"):
        name = str(case.get("name"))
        entry = out.setdefault(name, {})
        props = {str(p.get("name")): p.get("value") for p in case.iter("property")}
        entry.update(props)
        for kind in ("failure", "error"):
            found = case.find(kind)
            if found is not None:
                entry[kind] = f"{found.get('message')}\n{found.text}"
    return out


def _lease(cases: dict[str, dict[str, object]], name: str) -> list[int]:
    return [int(i) for i in str(cases[name]["gpu_indices"]).split(",")]


def _check(tmp_path: Path, result: pytest.RunResult, *, workers: int) -> None:
    out = tmp_path / "out"
    cases = _cases(tmp_path / "junit.xml")
    text = result.stdout.str()
    a, b, c = (json.loads((out / f"{n}.json").read_text()) for n in "abc")
    held = {i for f in out.glob("held-*.json") for i in json.loads(f.read_text())}
    assert len(held) == workers, held
    # its own process, seeing exactly its lease: cuda:1 is the lease's second GPU
    lease = _lease(cases, "test_a_sees_its_lease")
    assert len(lease) == 2 and not held & set(lease), (lease, held)
    assert a["cuda1"] == lease[1] != 1, (a, lease)  # not what the worker's own CUDA calls cuda:1
    assert a["pid"] != c["pid"], "the body ran in the test process"
    assert a["tmp"].endswith("test_a_sees_its_lease0"), a  # a fixture's value, sent to the body's process
    # capped as a test process's lease caps torch (and JAX told not to preallocate)
    assert abs(a["fraction"] * a["total"] - 2 * 2**30) < 2**20, a
    assert a["xla"] == "false", a
    # charged to the physical GPU: its peak there, as the test's own
    peaks = dict(p.split("=") for p in str(cases["test_a_sees_its_lease"]["gpu_peak_bytes"]).split(",") if p)
    # simulated GPUs: the ledger's peak; fake GPUs (NVML, which has no peak): torch's, from its process
    assert int(peaks[str(lease[1])]) == 2**30 and int(peaks[str(lease[0])]) == 0, peaks
    # the pool is reused by the next test of the same shape (on its worker)
    assert cases["test_a_sees_its_lease"]["dist_pool"] == "fresh"
    if workers == 1:
        assert cases["test_b_warm"]["dist_pool"] == "warm" and b["pid"] == a["pid"], (cases, a, b)
        # what the first body imported (torch) is out of the later tests' full collections
        assert b["frozen"] > a["frozen"] + 10_000, (a, b)
    else:
        assert any(case.get("dist_pool") == "warm" for case in cases.values()), cases
    # a failure reads as the test's own: its traceback and the exception in the summary line
    assert "AssertionError: assert 1 == 2" in str(cases["test_d_fails"]["failure"])
    assert ">       assert x == 2" in text and "E       assert 1 == 2" in text, text
    assert "FAILED test_suite.py::test_d_fails - AssertionError: assert 1 == 2" in text, text
    # a leak is the test's own violation, on the physical GPU, and the next test is not charged with it
    keeps = cases["test_e_keeps_memory"]
    assert "test_suite.py::test_e_keeps_memory broke its GPU lease" in str(keeps["error"]), keeps
    assert f"still holds 512MiB on GPU {_lease(cases, 'test_e_keeps_memory')[1]}" in str(keeps["error"]), keeps
    after = cases["test_f_after_the_leak"]
    assert "error" not in after and after["dist_pool"] == "fresh", after
    e, f = (json.loads((out / f"{n}.json").read_text()) for n in "ef")
    assert f["pid"] != e["pid"], (e, f)
    # its memory cap: an allocation past its lease is torch's OOM in the body
    assert "OutOfMemoryError" in str(cases["test_g_over_its_budget"]["failure"])
    # a suite's own marker mapped with isolate: the same, on the pool of the same shape
    h = json.loads((out / "h.json").read_text())
    own = cases["test_h_the_suites_own_marker"]
    assert "failure" not in own and h["pid"] != c["pid"], (own, h, c)
    if workers == 1:
        assert own["dist_pool"] == "warm" and h["pid"] == f["pid"], (own, h, f)
    result.assert_outcomes(passed=7, failed=2, errors=1)


def _suite(gpu_pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require("torch", module="torch")
    gpu_pytester.makeconftest(CONFTEST)
    gpu_pytester.makeini(INI)
    gpu_pytester.makepyfile(test_suite=SUITE)
    (tmp_path / "out").mkdir()
    monkeypatch.setenv("ISOLATE_OUT", str(tmp_path / "out"))


def test_isolated_tests_on_simulated_gpus(
    gpu_pytester: pytest.Pytester,
    run_inner: Callable[..., pytest.RunResult],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _suite(gpu_pytester, tmp_path, monkeypatch)
    result = run_inner(
        "--gpus", "sim:4x8GiB", "--gpu-verify=fail", f"--junitxml={tmp_path / 'junit.xml'}", "-p", "no:xdist",
        subprocess=True, timeout=300,
    )  # fmt: skip
    _check(tmp_path, result, workers=1)


def test_isolated_tests_on_fake_gpus_under_xdist(
    gpu_pytester: pytest.Pytester,
    fake_run: Callable[..., pytest.RunResult],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _suite(gpu_pytester, tmp_path, monkeypatch)
    junit = f"--junitxml={tmp_path / 'junit.xml'}"
    result = fake_run("sim:6x8GiB", "--gpus", "auto", "--gpu-verify=fail", junit, "-n", "2")
    _check(tmp_path, result, workers=2)


BAD = """
import threading

import pytest


@pytest.fixture
def lock():
    return threading.Lock()


@pytest.mark.gpu(2, isolate="yes")
def test_bad_keyword():
    pass


@pytest.mark.gpu(2, memory="1GiB", isolate=True)
def test_wants_the_gpu_fixture(gpu):
    pass


@pytest.mark.gpu(1, memory="1GiB", isolate=True)
def test_unpicklable(lock):
    pass

"""

UNITTEST = """
import unittest

import pytest


class TestCase(unittest.TestCase):
    @pytest.mark.gpu(1, memory="1GiB", isolate=True)
    def test_unittest(self):
        pass
"""


def test_bad_arguments_and_fixtures_are_named(
    gpu_pytester: pytest.Pytester, run_inner: Callable[..., pytest.RunResult]
) -> None:
    gpu_pytester.makepyfile(test_bad=BAD, test_unit=UNITTEST)
    result = run_inner("--gpus", "sim:2x8GiB", "-p", "no:xdist")
    text = result.stdout.str()
    assert "test_bad.py::test_bad_keyword: gpu marker: isolate must be True or False, got 'yes'" in text, text
    assert "test_bad.py::test_wants_the_gpu_fixture: gpu(..., isolate=True): the body runs in a process" in text, text
    assert "but it asks for 'gpu', leasing GPUs in the test process" in text, text
    assert "test_unit.py::TestCase::test_unittest: gpu(..., isolate=True) only applies to test functions" in text, text
    # a collection error (the marker is checked with the module's other tests): nothing ran
    assert result.ret == pytest.ExitCode.INTERRUPTED, text


def test_an_unpicklable_fixture_is_named(
    gpu_pytester: pytest.Pytester, run_inner: Callable[..., pytest.RunResult]
) -> None:
    require("torch", module="torch")  # not imported: a pool's rank starts only after the fixtures are sent
    fixed = BAD.replace('isolate="yes"', "isolate=False").replace("(gpu)", "()")
    gpu_pytester.makepyfile(test_bad=fixed)
    result = run_inner("--gpus", "sim:2x8GiB", "-p", "no:xdist", "-k", "unpicklable")
    text = result.stdout.str()
    assert "test_bad.py::test_unpicklable: the value of fixture 'lock' (lock) cannot be sent" in text, text
    assert "isolate=True" in text, text
    result.assert_outcomes(failed=1, deselected=2)


def test_a_lease_no_gpu_here_can_give_is_skipped_as_any(
    gpu_pytester: pytest.Pytester, run_inner: Callable[..., pytest.RunResult]
) -> None:
    gpu_pytester.makepyfile(
        test_big="""
        import pytest

        @pytest.mark.gpu(8, memory="1GiB", isolate=True)
        def test_eight():
            pass
        """
    )
    result = run_inner("--gpus", "sim:2x8GiB", "-p", "no:xdist", "-rs")
    result.assert_outcomes(skipped=1)
    assert "needs 8 GPUs (1GiB each) but this run has" in result.stdout.str(), result.stdout.str()


def test_a_refused_lease_is_one_line_naming_the_test(
    gpu_pytester: pytest.Pytester, run_inner: Callable[..., pytest.RunResult]
) -> None:
    gpu_pytester.makeconftest(
        """
        import pytest

        @pytest.fixture(scope="session", autouse=True)
        def hog(gpu_lease_factory):
            gpu_lease_factory(count=2, exclusive=True)  # what the test waits for, held by its own process
        """
    )
    gpu_pytester.makepyfile(
        test_waits="""
        import pytest

        @pytest.mark.gpu(2, memory="1GiB", isolate=True)
        def test_waits():
            pass
        """
    )
    result = run_inner("--gpus", "sim:2x8GiB", "-p", "no:xdist")
    text = result.stdout.str()
    result.assert_outcomes(failed=1)
    assert "pytest-gpu: test_waits.py::test_waits could not get 2 GPUs (1GiB each): a deadlock" in text, text
    assert "client.py" not in text and "Traceback" not in text, text
