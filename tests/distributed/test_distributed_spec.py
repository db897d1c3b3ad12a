"""The ``distributed`` marker: build_spec (pure) and the collection error a bad marker gives."""

from __future__ import annotations

import pytest

from pytest_gpu.base.distspec import DIST_MARKER_FORM, DistSpec, build_spec
from pytest_gpu.base.requests import GpuRequestError

FORM = '@pytest.mark.distributed(world_size, *, backend="auto", gpus_per_rank=None, launcher="spawn", timeout=None)'
WHAT = "distributed marker"
# Plugins the inner runs do not need; hypothesis alone costs seconds per in-process run (re-imported each time).
QUIET = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "no:benchmark")


def spec(*args: object, auto: str = "gloo", **kwargs: object) -> DistSpec:
    return build_spec(args, kwargs, auto_backend=auto)


def error(*args: object, auto: str = "gloo", **kwargs: object) -> str:
    with pytest.raises(GpuRequestError) as info:
        build_spec(args, kwargs, auto_backend=auto)
    return str(info.value)


# -- valid markers ------------------------------------------------------------------------


def test_the_expected_form_is_the_documented_signature() -> None:
    assert DIST_MARKER_FORM == FORM


def test_defaults_without_gpus() -> None:
    assert spec(2) == DistSpec(world_size=2, backend="gloo", gpus_per_rank=0, launcher="spawn", timeout=None)


def test_world_size_by_keyword() -> None:
    assert spec(world_size=3) == DistSpec(3, "gloo", 0, "spawn")


def test_auto_backend_is_nccl_with_one_gpu_per_rank_where_nccl_is_chosen() -> None:
    assert spec(4, auto="nccl") == DistSpec(4, "nccl", 1, "spawn")


def test_explicit_gloo_with_gpus_needs_no_gpu() -> None:
    assert spec(2, backend="gloo", auto="nccl") == DistSpec(2, "gloo", 0, "spawn")


def test_nccl_gpus_per_rank_default_and_explicit() -> None:
    assert spec(2, backend="nccl") == DistSpec(2, "nccl", 1, "spawn")
    assert spec(2, backend="nccl", gpus_per_rank=2) == DistSpec(2, "nccl", 2, "spawn")


def test_gloo_may_ask_for_gpus() -> None:
    assert spec(2, backend="gloo", gpus_per_rank=1).gpus_per_rank == 1


def test_mpi_defaults_to_mpirun() -> None:
    assert spec(2, backend="mpi") == DistSpec(2, "mpi", 0, "mpirun")


def test_mpi_through_srun() -> None:
    assert spec(2, backend="mpi", launcher="srun").launcher == "srun"


@pytest.mark.parametrize("launcher", ["spawn", "torchrun", "mpirun", "srun"])
def test_every_launcher_with_gloo(launcher: str) -> None:
    assert spec(2, backend="gloo", launcher=launcher) == DistSpec(2, "gloo", 0, launcher)


def test_backend_none() -> None:
    assert spec(1, backend="none") == DistSpec(1, "none", 0, "spawn")


def test_timeout_becomes_float() -> None:
    result = spec(2, timeout=5)
    assert result.timeout == 5.0
    assert isinstance(result.timeout, float)
    assert spec(2, timeout=0.5).timeout == 0.5


def test_pool_key_ignores_the_timeout() -> None:
    assert spec(2, timeout=5).pool_key == spec(2).pool_key == (2, "gloo", "spawn", 0)
    assert spec(2, backend="nccl").pool_key == (2, "nccl", "spawn", 1)
    assert spec(3).pool_key != spec(2).pool_key


def test_describe() -> None:
    assert spec(2).describe() == "2 ranks (gloo via spawn)"
    assert spec(4, backend="nccl", gpus_per_rank=2).describe() == "4 ranks (nccl via spawn, 2 GPU/rank)"
    assert spec(2, backend="mpi").describe() == "2 ranks (mpi via mpirun)"


# -- bad markers: the exact message ----------------------------------------------------------


def test_unknown_keyword() -> None:
    assert error(2, ranks=2) == f"{WHAT}: unknown keyword 'ranks'; expected {FORM}"


def test_unknown_keywords_are_sorted() -> None:
    assert error(2, zeta=1, alpha=2) == f"{WHAT}: unknown keyword 'alpha', 'zeta'; expected {FORM}"


def test_world_size_missing() -> None:
    assert error() == f"{WHAT}: world_size is required; expected {FORM}"
    assert error(backend="gloo") == f"{WHAT}: world_size is required; expected {FORM}"


def test_world_size_twice() -> None:
    expected = f"{WHAT}: give world_size once, positionally or by keyword; expected {FORM}"
    assert error(2, world_size=2) == expected
    assert error(2, 3) == expected


@pytest.mark.parametrize(("value", "shown"), [(0, "0"), (-2, "-2"), (True, "True"), (2.0, "2.0"), ("2", "'2'")])
def test_world_size_not_a_positive_int(value: object, shown: str) -> None:
    assert error(value) == f"{WHAT}: world_size must be a positive int, got {shown}"
    assert error(world_size=value) == f"{WHAT}: world_size must be a positive int, got {shown}"


@pytest.mark.parametrize(("value", "shown"), [("mpich", "'mpich'"), ("GLOO", "'GLOO'"), (None, "None")])
def test_bad_backend(value: object, shown: str) -> None:
    expected = f"{WHAT}: backend must be one of auto, gloo, nccl, xccl, ccl, mpi, none, got {shown}"
    assert error(2, backend=value) == expected


@pytest.mark.parametrize(("value", "shown"), [("ssh", "'ssh'"), ("", "''"), (1, "1")])
def test_bad_launcher(value: object, shown: str) -> None:
    assert error(2, launcher=value) == f"{WHAT}: launcher must be one of spawn, torchrun, mpirun, srun, got {shown}"


@pytest.mark.parametrize("launcher", ["spawn", "torchrun"])
def test_mpi_needs_mpirun_or_srun(launcher: str) -> None:
    assert error(2, backend="mpi", launcher=launcher) == (
        f"{WHAT}: backend='mpi' needs launcher='mpirun' or 'srun', got {launcher!r}"
    )


@pytest.mark.parametrize(("value", "shown"), [(-1, "-1"), (True, "True"), (1.5, "1.5"), ("1", "'1'")])
def test_bad_gpus_per_rank(value: object, shown: str) -> None:
    assert error(2, gpus_per_rank=value) == f"{WHAT}: gpus_per_rank must be an int >= 0, got {shown}"


def test_nccl_without_gpus_per_rank() -> None:
    assert error(2, backend="nccl", gpus_per_rank=0) == f"{WHAT}: backend='nccl' needs gpus_per_rank >= 1"
    assert error(2, gpus_per_rank=0, auto="nccl") == f"{WHAT}: backend='nccl' needs gpus_per_rank >= 1"


@pytest.mark.parametrize(("value", "shown"), [(0, "0"), (-5, "-5"), (True, "True"), ("5", "'5'"), ([5], "[5]")])
def test_bad_timeout(value: object, shown: str) -> None:
    assert error(2, timeout=value) == f"{WHAT}: timeout must be a positive number of seconds, got {shown}"


def test_world_size_is_checked_before_the_other_arguments() -> None:
    assert error(0, backend="bogus") == f"{WHAT}: world_size must be a positive int, got 0"


# -- the collection error (pytester, in-process) ---------------------------------------------------

BAD_SUITE = """
import pytest

@pytest.mark.distributed(world_size=0)
def test_zero(rank):
    pass

@pytest.mark.distributed(2, backend="mpi", launcher="spawn")
def test_mpi_spawn(rank):
    pass

@pytest.mark.distributed(2)
def test_fine(rank):
    pass
"""


def test_bad_marker_fails_collection_naming_the_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_bad=BAD_SUITE)
    result = pytester.runpytest(*QUIET)
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(
        [
            "*ERROR collecting test_bad.py*",
            "pytest-gpu: invalid GPU request",
            f"test_bad.py::test_zero: {WHAT}: world_size must be a positive int, got 0",
            f"test_bad.py::test_mpi_spawn: {WHAT}: backend='mpi' needs launcher='mpirun' or 'srun', got 'spawn'",
            "*Interrupted: 1 error during collection*",
        ]
    )
    assert "test_fine" not in result.stdout.str()  # the whole module is refused, nothing ran
    result.assert_outcomes(errors=1)


def test_bad_class_marker_names_every_method(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_cls="""
        import pytest

        @pytest.mark.distributed(2, colour="red")
        class TestThing:
            def test_a(self, rank):
                pass

            def test_b(self, rank):
                pass
        """
    )
    result = pytester.runpytest(*QUIET)
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(
        [
            "pytest-gpu: invalid GPU request",
            f"test_cls.py::TestThing::test_a: {WHAT}: unknown keyword 'colour'; expected {FORM}",
            f"test_cls.py::TestThing::test_b: {WHAT}: unknown keyword 'colour'; expected {FORM}",
        ]
    )


def test_gpu_marker_and_distributed_marker_together(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_both="""
        import pytest

        @pytest.mark.gpu(1)
        @pytest.mark.distributed(world_size=2)
        def test_both(rank):
            pass
        """
    )
    result = pytester.runpytest(*QUIET)
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(
        [
            "pytest-gpu: invalid GPU request",
            "test_both.py::test_both: a distributed test gets its GPUs through "
            "distributed(gpus_per_rank=...), not a gpu marker",
        ]
    )


def test_bad_gpu_marker_on_a_distributed_test_reports_the_gpu_marker(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_both="""
        import pytest

        @pytest.mark.gpu(count=0)
        @pytest.mark.distributed(world_size=2)
        def test_both(rank):
            pass
        """
    )
    result = pytester.runpytest(*QUIET)
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(["pytest-gpu: invalid GPU request", "test_both.py::test_both: gpu marker*"])


def test_valid_markers_collect_under_strict_markers(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_ok="""
        import pytest

        @pytest.mark.distributed(2)
        def test_a(rank):
            pass

        @pytest.mark.distributed(world_size=2, backend="mpi", timeout=30)
        @pytest.mark.parametrize("n", [1, 2])
        def test_b(rank, n):
            pass
        """
    )
    result = pytester.runpytest(*QUIET, "--strict-markers", "--collect-only", "-q")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["test_ok.py::test_a", "test_ok.py::test_b[1]", "test_ok.py::test_b[2]"])


def test_marker_is_documented_in_markers_list(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest(*QUIET, "--markers")
    result.stdout.fnmatch_lines(
        [
            '@pytest.mark.distributed(world_size, *, backend="auto", gpus_per_rank=None, launcher="spawn", '
            "timeout=None): the test body runs on WORLD_SIZE ranks of a warm pool*"
        ]
    )
