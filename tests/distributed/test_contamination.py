"""Pool contamination end to end: a failure on a warm pool rerun alone, and what tests leave on ranks.

Inner pytest runs on real gloo ranks (CPU), under ``-n 2`` on simulated GPUs where the issue
asks for it; ``xdist_group`` keeps the tests that must share a pool on one worker, in order.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from test_distributed import COMMON, Inner, line_of, make_suite  # tests/distributed is on sys.path (prepend mode)

from conftest import require

pytestmark = pytest.mark.slow  # inner pytest runs, torch in the ranks

SIM = ("--gpus", "sim:2x16GiB")

DTYPE = """
SAME = pytest.mark.xdist_group("one-pool")


@D2
@SAME
def test_sets_float64(rank):
    import torch

    torch.set_default_dtype(torch.float64)


@D2
@SAME
def test_expects_float32(rank):
    import torch

    assert torch.ones(1).dtype == torch.float32


@D2
@SAME
def test_passes_on_the_pool_that_replaced_it(rank):
    import torch

    assert torch.ones(1).dtype == torch.float32


@D2
@SAME
def test_fails_on_its_own(rank):
    assert rank.rank == 5, "a real bug"


@D2
@pytest.mark.xdist_group("elsewhere")
def test_on_the_other_worker(rank):
    pid_note("other", rank)
"""


@pytest.fixture(scope="module")
def dtype_run(tmp_path_factory: pytest.TempPathFactory) -> Inner:
    require("torch", module="torch")
    suite = make_suite(tmp_path_factory.mktemp("dtype"), {"test_dtype.py": textwrap.dedent(COMMON + DTYPE)})
    suite.env["COLUMNS"] = "300"  # the short summary's lines whole
    return suite.run("-n", "2", *SIM)


def failure(run: Inner, nodeid: str) -> str:
    """A failed test's text, without the "[gw0] linux -- Python ..." line xdist may put first."""
    report = run.report(nodeid)
    assert report["outcome"] == "failed", report
    text: str = report["longrepr"]
    return text.split("\n", 1)[1] if text.startswith("[gw") else text


def test_a_changed_default_dtype_fails_the_next_test_and_names_the_first(dtype_run: Inner) -> None:
    result = dtype_run
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.output
    text = failure(result, "test_dtype.py::test_expects_float32")
    first = "pytest-gpu: contaminated by test_dtype.py::test_sets_float64: failed on its warm rank pool after 1 other"
    assert text.startswith(first), text
    assert "test_dtype.py::test_sets_float64 left default dtype float64 (was float32) (on every rank)" in text
    assert "assert torch.float64 == torch.float32" in text  # the failure on the warm pool follows
    props = result.props("test_dtype::test_expects_float32")
    assert props["dist_contaminated_by"] == "test_dtype.py::test_sets_float64"
    assert props["dist_rerun_alone"] == "passed"
    # the terminal's short summary lists it as failed, with the culprit
    line = "FAILED test_dtype.py::test_expects_float32 - pytest-gpu: contaminated by test_dtype.py::test_sets_float64"
    assert line in result.output


def test_the_test_that_left_it_is_named_with_what_it_left(dtype_run: Inner) -> None:
    report = dtype_run.report("test_dtype.py::test_sets_float64")
    assert report["outcome"] == "passed"
    assert report["sections"]["Captured pytest-gpu residue call"] == (
        "default dtype float64 (was float32) (on every rank)"
    )
    assert dtype_run.props("test_dtype::test_sets_float64")["dist_residue"] == (
        "default dtype float64 (was float32) (on every rank)"
    )
    # in the warnings summary, at the test's own line (pytest's: its first decorator's)
    warning = "ResidueWarning: test_dtype.py::test_sets_float64 left on its rank pool: default dtype float64 (was"
    found = re.search(rf"test_dtype.py:(\d+): {re.escape(warning)}", dtype_run.output)
    assert found is not None, dtype_run.output
    at = line_of(textwrap.dedent(COMMON + DTYPE), "def test_sets_float64")
    assert at - 2 <= int(found.group(1)) <= at


def test_a_failure_that_fails_alone_too_is_the_tests_own(dtype_run: Inner) -> None:
    report = dtype_run.report("test_dtype.py::test_fails_on_its_own")
    text = failure(dtype_run, "test_dtype.py::test_fails_on_its_own")
    assert "contaminated" not in text
    assert text.startswith("distributed test failed on 2 of 2 ranks"), text
    assert "a real bug" in text
    assert "pytest-gpu: failed again alone on fresh ranks: the failure is its own" in text
    assert "a real bug" in report["sections"]["Captured pytest-gpu rerun alone call"]
    assert dtype_run.props("test_dtype::test_fails_on_its_own")["dist_rerun_alone"] == "failed"
    # the contaminated pool was replaced: the next test there passes
    assert dtype_run.outcome("test_dtype.py::test_passes_on_the_pool_that_replaced_it") == "passed"
    assert dtype_run.outcome("test_dtype.py::test_on_the_other_worker") == "passed"
    assert dtype_run.leftovers == []


def test_rerun_alone_off_leaves_the_failure_as_it_was(tmp_path: Path) -> None:
    require("torch", module="torch")
    suite = make_suite(tmp_path, {"test_dtype.py": textwrap.dedent(COMMON + DTYPE)})
    (suite.path / "pytest.ini").write_text("[pytest]\ndist_rerun_alone = off\n")  # the ini key
    result = suite.run(*SIM, "-k", "float")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.output
    text = result.report("test_dtype.py::test_expects_float32")["longrepr"]
    assert "contaminated" not in text and "alone" not in text, text
    assert "assert torch.float64 == torch.float32" in text
    assert "dist_rerun_alone" not in result.props("test_dtype::test_expects_float32")
    # the residue is still named on the test that left it
    assert "dist_residue" in result.props("test_dtype::test_sets_float64")


def test_a_bad_rerun_alone_value_is_an_error_naming_the_option(tmp_path: Path) -> None:
    suite = make_suite(tmp_path, {"test_x.py": "def test_x():\n    pass\n"})
    result = suite.run("--dist-rerun-alone=maybe")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "--dist-rerun-alone: expected one of on, off, got 'maybe'" in result.output


UNSEEN = """
STATE = {}


@D2
def test_leaves_a_global(rank):
    STATE["mode"] = "eval"


@D2
def test_reads_the_global(rank):
    assert "mode" not in STATE


@D2
def test_first_on_a_fresh_pool_fails(rank):
    assert False, "first"
"""


def test_contamination_the_check_cannot_see_names_the_test_before(tmp_path: Path) -> None:
    require("torch", module="torch")
    suite = make_suite(tmp_path, {"test_unseen.py": textwrap.dedent(COMMON + UNSEEN)})
    result = suite.run("-k", "global")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.output
    text = result.report("test_unseen.py::test_reads_the_global")["longrepr"]
    assert text.startswith("pytest-gpu: contaminated by test_unseen.py::test_leaves_a_global: "), text
    assert "test_unseen.py::test_leaves_a_global ran just before it on that pool" in text
    assert "dist_residue" not in result.props("test_unseen::test_leaves_a_global")
    # the first test of a pool ran on fresh ranks already: never rerun
    alone = suite.run("-k", "fresh_pool")
    text = alone.report("test_unseen.py::test_first_on_a_fresh_pool_fails")["longrepr"]
    assert "alone" not in text and "contaminated" not in text
    assert "dist_rerun_alone" not in alone.props("test_unseen::test_first_on_a_fresh_pool_fails")


# -- each kind of residue, on real ranks -----------------------------------------------------------

KINDS = """
import random


@D2
def test_leaves_env_and_cwd(rank, tmp_path):
    os.environ["LEFT_BY_TEST"] = "1"
    del os.environ["INNER_CWD"]
    os.chdir(tmp_path)


@D2
def test_finds_env_and_cwd_put_back(rank):
    assert "LEFT_BY_TEST" not in os.environ and os.environ["INNER_CWD"] == os.getcwd()
    pid_note("put-back", rank)


@D2
def test_leaves_a_sub_group(rank):
    import torch.distributed as dist

    dist.new_group([0, 1])


@D2
def test_replaces_the_seed_function(rank):
    random.seed = lambda *args, **kwargs: None


@D2
def test_after_the_seed_function_was_replaced(rank):
    pid_note("after-seed", rank)
    random.seed(5)
    first = random.random()
    random.seed(5)
    assert random.random() == first


@D2
def test_destroys_the_default_group(rank):
    import torch.distributed as dist

    dist.destroy_process_group()


@D2
def test_after_the_default_group_was_destroyed(rank):
    pid_note("after-destroyed", rank)
    allreduce_check(rank)


@NONE2
def test_sets_up_a_default_group(rank):
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank.rank, world_size=2)
    allreduce_check(rank)


@NONE2
def test_sets_up_a_default_group_again(rank):
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank.rank, world_size=2)
    allreduce_check(rank)
    dist.destroy_process_group()
"""


def test_each_kind_of_residue_is_named_on_the_test_that_left_it(tmp_path: Path) -> None:
    require("torch", module="torch")
    suite = make_suite(tmp_path, {"test_kinds.py": textwrap.dedent(COMMON + KINDS)})
    result = suite.run(*SIM)
    assert result.ret == pytest.ExitCode.OK, result.output[-5000:]

    def residue(test: str) -> str:
        return result.props(f"test_kinds::{test}").get("dist_residue", "")

    assert residue("test_leaves_env_and_cwd") == (
        "environment variable LEFT_BY_TEST added (put back) (on every rank); "
        "environment variable INNER_CWD removed (put back) (on every rank); "
        "working directory changed (put back) (on every rank)"
    )
    assert (
        residue("test_leaves_a_sub_group") == "1 process-group sub-group not destroyed (destroyed now) (on every rank)"
    )
    assert residue("test_replaces_the_seed_function") == (
        "random.seed replaced: the pool's reseeding no longer holds (the pool is replaced) (on every rank)"
    )
    assert residue("test_destroys_the_default_group") == (
        "default process group destroyed (the pool is replaced) (on every rank)"
    )
    assert residue("test_sets_up_a_default_group") == (
        "default process group set up and not destroyed (destroyed now) (on every rank)"
    )
    for clean in ("test_finds_env_and_cwd_put_back", "test_sets_up_a_default_group_again"):
        assert residue(clean) == "", clean
    # what could not be put back replaced the pool: the next test ran on fresh ranks
    for after in ("test_after_the_seed_function_was_replaced", "test_after_the_default_group_was_destroyed"):
        assert result.props(f"test_kinds::{after}")["dist_pool"] == "fresh", after
    assert result.props("test_kinds::test_finds_env_and_cwd_put_back")["dist_pool"] == "warm"
    # a warning for what later tests would meet or what replaced the pool; none for what was put back
    assert "test_kinds.py::test_replaces_the_seed_function left on its rank pool: random.seed replaced" in result.output
    assert (
        "test_kinds.py::test_destroys_the_default_group left on its rank pool: default process group" in result.output
    )
    assert "test_kinds.py::test_leaves_env_and_cwd left on its rank pool" not in result.output
    assert "test_kinds.py::test_leaves_a_sub_group left on its rank pool" not in result.output
    assert result.leftovers == []


DEVICE = """
@pytest.mark.distributed(world_size=1, backend="gloo", gpus_per_rank=2)
def test_moves_the_current_device(rank):
    import torch

    torch.ones(1, device="cuda:0")
    torch.cuda.set_device(1)


@pytest.mark.distributed(world_size=1, backend="gloo", gpus_per_rank=2)
def test_expects_the_first_device(rank):
    import torch

    assert torch.cuda.current_device() == 0
"""


def test_a_moved_current_device_is_named_and_blamed(tmp_path: Path) -> None:
    require("C compiler", executable="cc")  # fake GPUs: torch.cuda in the ranks (the fake NVML is built from C)
    suite = make_suite(tmp_path, {"test_device.py": textwrap.dedent(COMMON + DEVICE)})
    suite.env.update(PYTEST_GPU_FAKE_GPUS="sim:2x8GiB", PYTEST_GPU_SIM_LEDGER=str(tmp_path / "ledger"))
    result = suite.run("--gpus", "auto", "--gpu-default-memory=2GiB")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.output[-5000:]
    props = result.props("test_device::test_moves_the_current_device")
    assert props["dist_residue"] == "current CUDA device cuda:1 (was cuda:0)", props
    text = result.report("test_device.py::test_expects_the_first_device")["longrepr"]
    assert text.startswith("pytest-gpu: contaminated by test_device.py::test_moves_the_current_device: "), text
    assert "left current CUDA device cuda:1 (was cuda:0), still so when" in text
