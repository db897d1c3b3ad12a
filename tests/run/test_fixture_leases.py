"""Leases for fixtures of any scope: ``gpu_lease_factory`` and ``ports_factory``.

End to end through inner runs on simulated GPUs: a module-scoped model shared by ten
tests under ``-n 4`` leases once per module, on one worker, and never over-commits; the
fixture's memory is the fixture's, not the first test's; tests see the fixture's GPUs next
to their own; a worker SIGKILLed while its fixture holds a lease gives it back at once;
class- and session-scoped variants; bad arguments. Then the pure parts: the planner counts
what a group's fixtures hold, the catalog's groups and ``held:`` entries.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from conftest import require
from helpers import NODE, one_node
from pytest_gpu.run.lifecycle import never_runs
from pytest_gpu.scheduling.catalog import HeldNeeds, _groups, firsts
from pytest_gpu.scheduling.catalog import entries as catalog_entries
from pytest_gpu.scheduling.catalog import jobs as catalog_jobs
from pytest_gpu.scheduling.planner import Job, Need

GiB = 2**30
Run = Callable[..., pytest.RunResult]

# The controller (or a serial run) writes who ran each test; at its end, what the GPU
# scheduler's planner learned that each fixture group holds.
RECORDER = """
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_runtest_logreport(report):
    if "PYTEST_XDIST_WORKER" in os.environ or report.when != "call":
        return
    node = getattr(report, "node", None)
    row = {"nodeid": report.nodeid, "worker": str(node.gateway.id) if node is not None else "main"}
    with open(os.path.join(HERE, "reports.jsonl"), "a") as fh:
        fh.write(json.dumps(row) + "\\n")


def pytest_sessionfinish(session):
    if "PYTEST_XDIST_WORKER" in os.environ:
        return
    dsession = session.config.pluginmanager.getplugin("dsession")
    planner = getattr(getattr(dsession, "sched", None), "planner", None)
    held = {g: [[n.count, n.memory] for n in needs] for g, needs in planner.held.items()} if planner else None
    with open(os.path.join(HERE, "held.json"), "w") as fh:
        json.dump(held, fh)
"""

# One module of a model suite: a module-scoped model on a 6GiB lease, ten tests computing
# on it (1GiB each, within the fixture's budget); every setup is logged.
MODEL_MODULE = """
import json
import os

import pytest
from pytest_gpu import sim

LOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "setups.jsonl")


@pytest.fixture(scope="module")
def model(gpu_lease_factory):
    lease = gpu_lease_factory(memory="6GiB")
    weights = sim.allocate("4GiB", lease.device)
    with open(LOG, "a") as fh:
        row = {"module": __name__, "worker": os.environ.get("PYTEST_XDIST_WORKER"), "gpus": list(lease.indices)}
        fh.write(json.dumps(row) + "\\n")
    yield weights
    weights.free()


@pytest.mark.parametrize("i", range(10))
def test_infer(model, i):
    assert not model.freed
    sim.hold("1GiB", 0.05)  # on the current device: the model's GPU, in the model's budget
"""

OTHERS = """
import time

import pytest
from pytest_gpu import sim


@pytest.mark.parametrize("i", range(8))
@pytest.mark.gpu(memory="5GiB")
def test_big(gpu, i):
    sim.hold("5GiB", 0.1)


@pytest.mark.parametrize("i", range(6))
def test_cpu(i):
    time.sleep(0.05)
"""


@pytest.fixture(autouse=True)
def not_a_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """This suite may run under xdist: an inner run's controller is no worker of it (the
    inner conftests tell the controller by ``PYTEST_XDIST_WORKER``)."""
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):
        monkeypatch.delenv(name, raising=False)


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _workers(path: Path) -> dict[str, set[str]]:
    """File -> the workers that ran its tests."""
    out: dict[str, set[str]] = {}
    for row in _rows(path / "reports.jsonl"):
        out.setdefault(row["nodeid"].split("::")[0], set()).add(row["worker"])
    return out


def test_module_model_shared_by_ten_tests_under_n4_leases_once_per_module(
    gpu_pytester: pytest.Pytester, run_inner: Run
) -> None:
    gpu_pytester.makeconftest(RECORDER)
    gpu_pytester.makepyfile(test_model_a=MODEL_MODULE, test_model_b=MODEL_MODULE, test_others=OTHERS)
    result = run_inner("--gpus", "sim:2x16GiB", "-n", "4", subprocess=True, timeout=240)
    # nothing over-committed: a simulated OOM would fail a test, a broken lease its teardown
    result.assert_outcomes(passed=34)
    result.stdout.fnmatch_lines(["pytest-gpu: 2 simulated GPUs * · 8 GPU tests · * · 0 violations"])
    setups = _rows(gpu_pytester.path / "setups.jsonl")
    assert sorted(row["module"] for row in setups) == ["test_model_a", "test_model_b"], setups
    workers = _workers(gpu_pytester.path)
    assert len(workers["test_model_a.py"]) == 1 and len(workers["test_model_b.py"]) == 1, workers
    assert len(set().union(*workers.values())) >= 3  # the other tests were spread
    # the scheduler learned what each module's fixture holds while its tests run
    held = json.loads((gpu_pytester.path / "held.json").read_text())
    assert held == {f"fixture:test_model_{m}.py": [[1, 6 * GiB]] for m in "ab"}, held


def test_without_the_scheduler_every_worker_sets_the_module_up(gpu_pytester: pytest.Pytester, run_inner: Run) -> None:
    """The control: xdist's own scheduling spreads the module (each worker leases once)."""
    gpu_pytester.makeconftest(RECORDER)
    gpu_pytester.makepyfile(test_model_a=MODEL_MODULE)
    result = run_inner("--gpus", "sim:2x16GiB", "-n", "2", "--gpu-schedule=off", subprocess=True)
    result.assert_outcomes(passed=10)
    assert len(_rows(gpu_pytester.path / "setups.jsonl")) == 2
    assert json.loads((gpu_pytester.path / "held.json").read_text()) is None  # no GPU scheduler


# -- confinement and verification ---------------------------------------------------------------

CONFINED = """
import os

import pytest
from pytest_gpu import sim


@pytest.fixture(scope="module")
def model(gpu_lease_factory):
    lease = gpu_lease_factory(memory="6GiB")
    # set up inside the first test's setup: allocated under the fixture's lease, not the test's
    weights = sim.allocate("4GiB")
    assert weights.physical == lease.indices[0]
    yield lease, weights
    weights.free()


def ordinal(device):
    return int(device.split(":")[1])


@pytest.mark.gpu(exclusive=True)
def test_first_with_its_own_whole_gpu(model, gpu):
    lease, weights = model
    assert lease.indices != gpu.indices  # the model went to the other GPU
    # the test sees its own lease first, then the fixture's; its own GPU stays current
    assert os.environ["CUDA_VISIBLE_DEVICES"] == f"{gpu.indices[0]},{lease.indices[0]}"
    assert os.environ["PYTEST_GPU_SIM_TAG"] == gpu.env["PYTEST_GPU_SIM_TAG"]
    assert sim.current_device() == ordinal(gpu.device)
    sim.hold("2GiB", 0.01)
    # the model's GPU is not outside this test's lease: it uses the model there
    sim.hold("1GiB", 0.01, device=lease.device)


def test_without_a_lease_of_its_own(model):
    lease, weights = model
    assert os.environ["CUDA_VISIBLE_DEVICES"] == str(lease.indices[0])
    assert os.environ["PYTEST_GPU_SIM_TAG"] == lease.env["PYTEST_GPU_SIM_TAG"]
    assert sim.current_device() == ordinal(lease.device)
    sim.hold("1GiB", 0.01)  # the model's budget: 6GiB, 4GiB of it the weights
    with pytest.raises(sim.OutOfMemoryError, match=r"is capped at 6GiB \\(its pytest-gpu lease\\)"):
        sim.allocate("3GiB")


def test_not_using_it():
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_after_it(model):
    assert not model[1].freed
"""


def test_fixture_memory_is_the_fixtures_and_its_gpus_are_the_tests_too(
    gpu_pytester: pytest.Pytester, run_inner: Run
) -> None:
    gpu_pytester.makepyfile(test_confined=CONFINED)
    result = run_inner("--gpus", "sim:2x16GiB")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["pytest-gpu: 2 simulated GPUs * · 1 GPU test · * · 0 violations"])
    assert "broke its GPU lease" not in result.stdout.str()


NO_LEASE = """
import pytest
from pytest_gpu import sim


@pytest.fixture(scope="module")
def model():
    weights = sim.allocate("3GiB", 0)
    yield weights
    weights.free()


@pytest.mark.gpu(memory="4GiB")
def test_first(model, gpu):
    pass


@pytest.mark.gpu(memory="4GiB")
def test_second(model, gpu):
    pass
"""

LEAKY = """
import pytest
from pytest_gpu import sim

KEPT = []


@pytest.fixture(scope="module")
def model(gpu_lease_factory):
    gpu_lease_factory(memory="4GiB")
    KEPT.append(sim.allocate("3GiB"))
    return KEPT[-1]


@pytest.mark.gpu(memory="1GiB")
def test_first(model, gpu):
    sim.hold("512MiB", 0.01)


@pytest.mark.gpu(memory="1GiB")
def test_last(model, gpu):
    sim.hold("512MiB", 0.01)
"""


def test_a_fixtures_leak_is_the_fixtures_never_the_first_tests(gpu_pytester: pytest.Pytester, run_inner: Run) -> None:
    # today's failure, for contrast: a module fixture allocating outside any lease of its own
    # is blamed on the first test that set it up
    gpu_pytester.makepyfile(test_nolease=NO_LEASE)
    before = run_inner("--gpus", "sim:1x16GiB")
    before.assert_outcomes(passed=2, errors=1)
    before.stdout.fnmatch_lines(["*test_nolease.py::test_first broke its GPU lease:", "*still holds 3GiB on GPU 0*"])

    # with gpu_lease_factory, both tests pass; the fixture's own leak (never freed) fails the
    # teardown of the test that ended the fixture, naming the fixture
    gpu_pytester.makepyfile(test_nolease="", test_leaky=LEAKY)
    trace = gpu_pytester.path / "trace.json"
    result = run_inner("--gpus", "sim:1x16GiB", f"--gpu-trace={trace}")
    result.assert_outcomes(passed=2, errors=1)
    out = result.stdout.str()
    assert "ERROR at teardown of test_last" in out
    result.stdout.fnmatch_lines(
        [
            "pytest-gpu: fixture 'model' (module scope, test_leaky.py) broke its GPU lease:",
            "  - still holds 3GiB on GPU 0 after the fixture's teardown (a leaked allocation, *",
        ]
    )
    assert "test_first broke" not in out and "test_last broke" not in out
    # the fixture's violation counts in the summary, named, and its lease is drawn in the trace
    result.stdout.fnmatch_lines(
        [
            "pytest-gpu: 1 simulated GPU * · 2 GPU tests · * · 1 violation",
            "pytest-gpu: lease broken by fixture 'model' (module scope, test_leaky.py) (judged during *test_last)",
        ]
    )
    events = json.loads(trace.read_text())["traceEvents"]
    (held,) = [e for e in events if e.get("cat") == "lease" and e["args"].get("holder") == "fixture"]
    assert held["name"] == "fixture 'model' (module scope, test_leaky.py)" and held["args"]["gpu"] == 0
    assert held["args"]["memory"] == 4 * 2**30 and held["args"]["violations"] == 1


TORCH = """
import pytest
from pytest_gpu.sim import torch_cuda

GiB = 2**30


@pytest.fixture(scope="module")
def model(gpu_lease_factory):
    import torch

    lease = gpu_lease_factory(memory="6GiB")
    return torch_cuda.empty(4 * GiB, device=lease.device)  # no teardown code: pytest drops the value


@pytest.mark.gpu(memory="2GiB")
def test_first(model, gpu):
    import torch

    assert torch.cuda.current_device() == int(gpu.device.split(":")[1])
    torch_cuda.empty(GiB, device=gpu.device).free()


def test_without_a_lease(model):
    import torch

    block = torch_cuda.empty(GiB)  # torch's current device: the model's
    assert block.device == model.device
    block.free()
    with pytest.raises(torch.OutOfMemoryError):  # the model's 6GiB, 4GiB of them the weights
        torch_cuda.empty(3 * GiB)


@pytest.mark.gpu(memory="1GiB")
def test_last(model, gpu):
    torch_cuda.empty(GiB // 2, device=gpu.device).free()
"""


def test_torch_model_returned_by_a_module_fixture_is_freed_before_its_lease_goes_back(
    gpu_pytester: pytest.Pytester, run_inner: Run
) -> None:
    """A plain ``return`` fixture: its value lives in pytest's cache and the last test's
    arguments until their teardown; the lease is verified (and given back) only after both
    let go of it, so torch's garbage-collected block is no leak."""
    require("torch", module="torch")
    gpu_pytester.makepyfile(test_torch=TORCH)
    result = run_inner("--gpus", "sim:2x16GiB", subprocess=True)
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["pytest-gpu: 2 simulated GPUs * · 2 GPU tests · * · 0 violations"])
    assert "broke its GPU lease" not in result.stdout.str()


REAL_GPUS = """
import pytest
from pytest_gpu import sim


@pytest.fixture(scope="module")
def model(gpu_lease_factory):
    lease = gpu_lease_factory(memory="6GiB")
    weights = sim.allocate("3GiB", lease.device)
    yield lease
    weights.free()


@pytest.mark.gpu(memory="1GiB")
def test_first(model, gpu):
    assert gpu.indices == model.indices  # one GPU: the two leases share it
    sim.hold("256MiB", 0.01)


@pytest.mark.gpu(memory="1GiB")
def test_second(model, gpu):
    sim.hold("256MiB", 0.01)
"""


def test_real_gpus_say_what_per_process_counters_cannot_tell_apart(
    gpu_pytester: pytest.Pytester, fake_run: Callable[..., pytest.RunResult]
) -> None:
    """Fake GPUs (the NVML verifier's path): NVML counts per process, so on a GPU a test's lease
    shares with a fixture's the test's peak is not told from the model's: a note, not a violation."""
    gpu_pytester.makepyfile(test_real=REAL_GPUS)
    result = fake_run("sim:1x16GiB", "-p", "no:xdist", "--gpus", "auto")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        [
            "pytest-gpu: 1 GPU (1x16GiB) [[]nvml[]] · 2 GPU tests · * · 0 violations",
            "pytest-gpu: not verified: GPU 0 shared with a fixture's lease in this process: peak and leftovers "
            "there are not told apart (NVML and torch count per process) (2 tests)",
        ]
    )


# -- a worker killed while its fixture holds a lease ---------------------------------------------

CRASH = """
import os
import signal
import time

import pytest
from pytest_gpu.run.lifecycle import RUN_KEY


@pytest.fixture(scope="module")
def model(gpu_lease_factory, ports_factory):
    lease = gpu_lease_factory(exclusive=True)
    ports_factory(2)
    return lease


def test_dies(request, model):
    open({holding!r}, "w").close()
    # die only once test_waiter is queued behind the fixture's whole GPU
    client = request.config.stash[RUN_KEY].client
    deadline = time.monotonic() + 30
    while not client.status()["waiting"] and time.monotonic() < deadline:
        time.sleep(0.02)
    with open({killed!r}, "w") as fh:
        fh.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)
"""

WAITER = """
import time

import pytest


@pytest.mark.gpu(exclusive=True)
def test_waiter(gpu):
    with open({granted!r}, "w") as fh:
        fh.write(repr(time.time()))
"""

CRASH_CONFTEST = """
import os
import time


def pytest_runtest_setup(item):
    # (a conftest's hook runs before pytest-gpu's acquire) ask only once the fixture holds the GPU
    if item.name == "test_waiter":
        deadline = time.monotonic() + 30
        while not os.path.exists({holding!r}) and time.monotonic() < deadline:
            time.sleep(0.02)
"""


def test_sigkill_of_a_worker_gives_its_fixtures_lease_back(gpu_pytester: pytest.Pytester, run_inner: Run) -> None:
    files = {name: str(gpu_pytester.path / name) for name in ("holding", "killed", "granted")}
    gpu_pytester.makeconftest(CRASH_CONFTEST.format(**files))
    gpu_pytester.makepyfile(test_crash=CRASH.format(**files), test_wait=WAITER.format(**files))
    result = run_inner("--gpus", "sim:1x16GiB", "-n", "2", "--gpu-wait-timeout", "20", subprocess=True)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.re_match_lines(
        [
            r"pytest-gpu: worker gw\d+ \(pid \d+\) died while running test_crash\.py::test_dies; "
            r"its GPU 0 and its 2 ports were reclaimed$"
        ]
    )
    # the waiter got the whole GPU as soon as the worker died, not at its wait timeout
    delay = float(Path(files["granted"]).read_text()) - float(Path(files["killed"]).read_text())
    assert 0 <= delay < 3.0, delay


# -- class and session scope ------------------------------------------------------------------------

CLASSES = """
import json
import os
import time

import pytest
from pytest_gpu import sim

LOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "setups.jsonl")


@pytest.fixture(scope="class")
def engine(request, gpu_lease_factory, ports_factory):
    lease = gpu_lease_factory(memory="3GiB")
    port = ports_factory(1)[0]
    block = sim.allocate("2GiB", lease.device)
    with open(LOG, "a") as fh:
        fh.write(json.dumps({"cls": request.cls.__name__, "port": port}) + "\\n")
    yield port
    block.free()


class TestOne:
    @pytest.mark.parametrize("i", range(4))
    def test_a(self, engine, ports, i):
        assert engine not in ports(2)  # the fixture's port stays the fixture's
        time.sleep(0.05)


class TestTwo:
    @pytest.mark.parametrize("i", range(4))
    def test_b(self, engine, i):
        sim.hold("512MiB", 0.05)


@pytest.mark.parametrize("i", range(6))
def test_cpu(i):
    time.sleep(0.05)
"""


def test_class_scoped_fixture_leases_once_per_class_on_one_worker(
    gpu_pytester: pytest.Pytester, run_inner: Run
) -> None:
    gpu_pytester.makeconftest(RECORDER)
    gpu_pytester.makepyfile(test_classes=CLASSES)
    result = run_inner("--gpus", "sim:1x16GiB", "-n", "3", subprocess=True)
    result.assert_outcomes(passed=14)  # a broken lease would fail a teardown
    setups = _rows(gpu_pytester.path / "setups.jsonl")
    assert sorted(row["cls"] for row in setups) == ["TestOne", "TestTwo"], setups
    assert setups[0]["port"] != setups[1]["port"]
    by_class: dict[str, set[str]] = {}
    for row in _rows(gpu_pytester.path / "reports.jsonl"):
        if "::Test" in row["nodeid"]:
            by_class.setdefault(row["nodeid"].split("::")[1], set()).add(row["worker"])
    assert {name: len(ws) for name, ws in by_class.items()} == {"TestOne": 1, "TestTwo": 1}, by_class
    held = json.loads((gpu_pytester.path / "held.json").read_text())
    assert held == {f"fixture:test_classes.py::{c}": [[1, 3 * GiB]] for c in ("TestOne", "TestTwo")}, held


SESSION_CONFTEST = """
import json
import os

import pytest
from pytest_gpu import sim
from pytest_gpu.run.lifecycle import RUN_KEY

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="session")
def server(gpu_lease_factory, ports_factory):
    lease = gpu_lease_factory(memory="2GiB")
    ports = ports_factory(2)
    cache = sim.allocate("1GiB", lease.device)
    with open(os.path.join(HERE, "setups.jsonl"), "a") as fh:
        fh.write(json.dumps({"gpus": list(lease.indices), "ports": ports}) + "\\n")
    yield lease, ports
    cache.free()


def pytest_sessionfinish(session):
    # after the last test's teardown: the session fixture's lease and ports are back
    status = session.config.stash[RUN_KEY].client.status()
    with open(os.path.join(HERE, "after.json"), "w") as fh:
        json.dump({"leases": status["leases"], "ports": status["ports"]}, fh)
"""

SESSION_MODULE = """
import os

from pytest_gpu import sim


def test_uses_it_{n}(server):
    lease, ports = server
    assert os.environ["CUDA_VISIBLE_DEVICES"] == str(lease.indices[0])
    sim.hold("512MiB", 0.01)


def test_cpu_{n}():
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
"""


def test_session_scoped_fixture_holds_its_lease_across_modules_until_the_end(
    gpu_pytester: pytest.Pytester, run_inner: Run
) -> None:
    gpu_pytester.makeconftest(SESSION_CONFTEST)
    gpu_pytester.makepyfile(test_s1=SESSION_MODULE.format(n=1), test_s2=SESSION_MODULE.format(n=2))
    result = run_inner("--gpus", "sim:2x16GiB")
    result.assert_outcomes(passed=4)  # a broken lease would fail a teardown
    assert len(_rows(gpu_pytester.path / "setups.jsonl")) == 1  # one lease for both modules
    assert json.loads((gpu_pytester.path / "after.json").read_text()) == {"leases": [], "ports": {}}


# -- bad arguments ----------------------------------------------------------------------------------

BAD = """
import pytest


@pytest.fixture(scope="class")
def sized(gpu_lease_factory):
    return gpu_lease_factory(memory="lots")


class TestSized:
    def test_it(self, sized):
        pass


@pytest.fixture(scope="module")
def unknown(gpu_lease_factory):
    return gpu_lease_factory(gpus=2)


def test_unknown(unknown):
    pass


@pytest.fixture(scope="session")
def no_ports(ports_factory):
    return ports_factory(0)


def test_no_ports(no_ports):
    pass


def test_in_a_test_body(gpu_lease_factory):
    gpu_lease_factory(memory="1GiB")


@pytest.fixture(scope="module")
def too_many(gpu_lease_factory):
    return gpu_lease_factory(3)


def test_too_many(too_many):
    pass
"""


def test_bad_arguments_name_the_fixture_and_the_expected_form(gpu_pytester: pytest.Pytester, run_inner: Run) -> None:
    gpu_pytester.makepyfile(test_bad=BAD)
    result = run_inner("--gpus", "sim:2x16GiB", "-rs")
    result.assert_outcomes(failed=1, errors=3, skipped=1)
    out = result.stdout.str()
    assert "During handling" not in out  # the message alone
    result.stdout.fnmatch_lines(
        [
            "pytest-gpu: fixture 'sized' (class scope, test_bad.py::TestSized): gpu_lease_factory: "
            "memory='lots' is not a size: expected an int of bytes or a string such as *",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "pytest-gpu: fixture 'unknown' (module scope, test_bad.py): gpu_lease_factory: unknown keyword "
            """'gpus'; expected gpu_lease_factory(count=1, memory="8GiB", exclusive=False)""",
        ]
    )
    result.stdout.fnmatch_lines(
        ["pytest-gpu: fixture 'no_ports' (session scope): ports_factory(n) expects a positive int, got 0"]
    )
    result.stdout.fnmatch_lines(
        [
            "pytest-gpu: gpu_lease_factory(...) was called outside a fixture's setup; call it in the body of a "
            "fixture (any scope) that requests it, before its yield; in a test, use the gpu fixture, or "
            "gpu_request for a section",
        ]
    )
    # a request this machine can never satisfy: skipped as a marker's is (--gpu-oversize)
    result.stdout.fnmatch_lines(
        ["SKIPPED * pytest-gpu: fixture 'too_many' (module scope, test_bad.py) needs 3 GPUs (whole GPU each) *"]
    )


def test_a_scoped_fixture_still_cannot_ask_for_the_tests_own_fixtures(gpu_pytester: pytest.Pytester, run_inner: Run):
    """``gpu_request`` stays the test's: pytest's ScopeMismatch points to the factory's README."""
    gpu_pytester.makepyfile(
        test_mismatch="""
        import pytest

        @pytest.fixture(scope="module")
        def model(gpu_request):
            return 1

        def test_it(model):
            pass
        """
    )
    result = run_inner("--gpus", "sim:1x16GiB")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*ScopeMismatch*gpu_request*"])


SELF_DEADLOCK = """
import pytest


@pytest.fixture(scope="module")
def model(gpu_lease_factory):
    return gpu_lease_factory(memory="6GiB")


def test_generate(model):
    pass


@pytest.mark.gpu  # a whole GPU, and the only one holds the module's model until the module ends
def test_full_size():
    pass


def test_after(model):
    pass
"""


def test_a_test_waiting_for_what_its_modules_fixture_holds_fails_at_once(
    gpu_pytester: pytest.Pytester, run_inner: Run
) -> None:
    """No scheduling helps on one GPU: the worker waits for a whole GPU while its own fixture
    holds a lease there. It fails at once, naming the cycle, not at --gpu-wait-timeout."""
    gpu_pytester.makepyfile(test_self=SELF_DEADLOCK)
    args = ("--gpus", "sim:1x16GiB", "-p", "no:xdist", "--gpu-wait-timeout", "600")
    result = run_inner(*args, subprocess=True, timeout=60)
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        [
            "pytest-gpu: test_self.py::test_full_size could not get 1 GPU (whole GPU): a deadlock (hold-and-wait): *",
            "  - main holds GPU-* (6GiB, fixture 'model' (module scope, test_self.py)) and waits for 1 GPU "
            "(whole GPU) for test_self.py::test_full_size",
        ]
    )


# -- the planner and the catalog (pure) -----------------------------------------------------------


def test_planner_counts_what_a_groups_fixtures_hold_while_its_tests_run() -> None:
    # one 16-unit GPU; group "m" is CPU-only by its tests' needs, but its model holds 12
    jobs = [Job(0, 5.0, None, "m"), Job(1, 5.0, None, "m"), Job(2, 1.0, Need(1, 8)), Job(3, 1.0, None)]

    def second_pick(held: dict[str, tuple[Need, ...]]) -> int | None:
        planner = one_node(jobs, [16])
        planner.held = held
        planner.add_worker("A", NODE)
        planner.add_worker("B", NODE)
        assert planner.pick("A", 0.0) == 0  # the group, longest first
        return planner.pick("B", 0.0)

    assert second_pick({}) == 2  # blind: the 8-unit test goes next to the model and waits at the broker
    assert second_pick({"m": (Need(1, 12),)}) == 3  # CPU work instead, while the model holds 12
    assert second_pick({"m": (Need(1, 6),)}) == 2  # 6 + 8 fit


def test_planner_predicts_a_group_test_fits_only_with_its_fixtures_memory() -> None:
    # worker B runs an 8-unit test; the group's next test needs 4 of its own plus the model's 6
    jobs = [Job(0, 10.0, Need(1, 8)), Job(1, 1.0, Need(1, 4), "m"), Job(2, 0.5, None)]
    planner = one_node(jobs, [16])
    planner.held = {"m": (Need(1, 6),)}
    planner.add_worker("B", NODE)
    planner.add_worker("A", NODE)
    assert planner.pick("B", 0.0) == 0
    assert planner.pick("A", 0.0) == 2  # 8 + 4 + 6 > 16: the CPU test first
    planner.held = {"m": (Need(1, 3),)}
    assert planner.pick("A", 0.0) == 1  # 8 + 4 + 3 fit


def test_held_needs_read_the_brokers_catalog_live() -> None:
    catalog: dict[str, Any] = {"test_a.py::test_x": {"group": "fixture:test_a.py"}}
    held = HeldNeeds(catalog)
    assert held.get("fixture:test_a.py", ()) == () and len(held) == 0
    catalog["held:fixture:test_a.py"] = {"held": [[1, 6 * GiB], [2, None]]}  # a worker set the fixture up
    assert held["fixture:test_a.py"] == (Need(1, 6 * GiB), Need(2, None))
    assert list(held) == ["fixture:test_a.py"]


GROUPS = """
import pytest


@pytest.fixture(scope="module")
def model(gpu_lease_factory):
    return 1


@pytest.fixture(scope="class")
def engine(gpu_lease_factory):
    return 2


@pytest.fixture(scope="session")
def server(gpu_lease_factory):
    return 3


@pytest.fixture(scope="module")
def plain():
    return 4


@pytest.fixture
def uses_model(model):
    return model


def test_direct(model):
    pass


def test_through_another(uses_model):
    pass


def test_session_only(server):
    pass


def test_plain(plain):
    pass


class TestEngine:
    def test_a(self, engine):
        pass

    def test_b(self, engine, model):
        pass


class TestOther:
    def test_c(self, engine):
        pass


@pytest.mark.xdist_group("g")
def test_grouped_too(model):
    pass
"""


def test_groups_from_leasing_fixtures_at_collection(gpu_pytester: pytest.Pytester) -> None:
    gpu_pytester.makepyfile(test_groups=GROUPS)
    items, _ = gpu_pytester.inline_genitems("--gpus", "sim:1x16GiB", "-p", "no:cacheprovider")
    groups = _groups(items, {})
    ids = {item.nodeid.split("::", 1)[1]: item.nodeid for item in items}
    module = groups[ids["test_direct"]]  # the module's instance of model
    # through another fixture, next to an xdist_group (merged), and a class whose test also
    # uses the module's model: one group
    for name in ("test_through_another", "test_grouped_too", "TestEngine::test_a", "TestEngine::test_b"):
        assert groups[ids[name]] == module, name
    assert groups[ids["TestOther::test_c"]] == "fixture:test_groups.py::TestOther"  # the class's own instance
    # a session-scoped fixture is set up once per worker: it groups nothing; nor does a plain one
    assert ids["test_session_only"] not in groups and ids["test_plain"] not in groups


LARGE = """


@pytest.mark.gpu
def test_large():  # a whole GPU of its own, no leasing fixture: while the module's model
    pass           # holds a GPU on its worker, it would wait for another


class TestOther2(TestOther):
    @pytest.mark.gpu(memory="1GiB")
    def test_small(self):
        pass
"""


def test_a_modules_gpu_tests_that_use_no_leasing_fixture_go_before_its_group(gpu_pytester: pytest.Pytester) -> None:
    """They are in the fixture's module (or class): on the group's worker after its tests, they
    would run (and wait for their GPUs) while the fixture still holds its lease."""
    gpu_pytester.makepyfile(test_groups=GROUPS + LARGE)
    items, _ = gpu_pytester.inline_genitems("--gpus", "sim:1x16GiB", "-p", "no:cacheprovider")
    groups = _groups(items, {})
    ids = {item.nodeid.split("::", 1)[1]: item.nodeid for item in items}
    module, other2 = groups[ids["test_direct"]], groups[ids["TestOther2::test_c"]]
    assert firsts(items, groups) == {
        ids["test_session_only"]: [module],
        ids["test_plain"]: [module],
        ids["test_large"]: [module],
        ids["TestOther2::test_small"]: [module, other2],
    }
    # the catalog says so of the GPU tests only: the others wait for no GPU at the broker
    run = SimpleNamespace(settings=None, never_fits=lambda request: None)  # what entries() asks of the run
    entries = catalog_entries(items, run, never_runs)  # type: ignore[arg-type]
    assert {nodeid: entry["before"] for nodeid, entry in entries.items() if "before" in entry} == {
        ids["test_large"]: [module],
        ids["TestOther2::test_small"]: [module, other2],
    }
    jobs = {job.index: job for job in catalog_jobs([item.nodeid for item in items], entries, {})}
    large = [item.nodeid for item in items].index(ids["test_large"])
    assert jobs[large].before == (module,) and jobs[large].need == Need(1, None)


def test_plugin_documents_the_factories(gpu_pytester: pytest.Pytester, run_inner: Run) -> None:
    result = run_inner("--fixtures", "-p", "no:xdist")
    result.stdout.fnmatch_lines(["gpu_lease_factory [[]session scope[]]*", "ports_factory [[]session scope[]]*"])


ONLY_FIXTURES = """
import pytest
from pytest_gpu import sim

@pytest.fixture(scope="module")
def model(gpu_lease_factory):
    lease = gpu_lease_factory(memory="2GiB")
    weights = sim.allocate("1GiB")
    yield lease
    weights.free()

def test_a(model):
    pass

def test_b(model):
    pass
"""


def test_a_run_whose_only_leases_are_fixtures_still_gets_its_summary(
    gpu_pytester: pytest.Pytester, run_inner: Run
) -> None:
    gpu_pytester.makepyfile(test_only=ONLY_FIXTURES)
    result = run_inner("--gpus", "sim:1x16GiB")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["pytest-gpu: 1 simulated GPU (1x16GiB) [[]sim:1x16GiB[]] · 0 GPU tests · *"])
