"""End-to-end: bad markers, bad options and ini keys, requests the machine can never satisfy.

Every error is checked with its exact text.
"""

from __future__ import annotations

import pytest

MARKER_FORM = (
    "@pytest.mark.gpu, @pytest.mark.gpu(2) or "
    '@pytest.mark.gpu(count=2, memory="8GiB", exclusive=False, cpus=4, host_memory="16GiB")'
)
SIZE_FORM = 'an int of bytes or a string such as "512MiB", "8GiB" (binary) or "8GB" (SI)'
GPUS_FORM = "auto, none, an index list such as 0,2,3, or simulated devices such as sim:4x16GiB"

BAD_MARKERS = """
import pytest

@pytest.mark.gpu(0)
def test_zero():
    pass

@pytest.mark.gpu(count=-2)
def test_negative():
    pass

@pytest.mark.gpu(colour="red")
def test_unknown_keyword():
    pass

@pytest.mark.gpu(memory="lots")
def test_unparsable_size():
    pass

def test_innocent():
    pass
"""


def test_bad_marker_arguments_fail_collection_naming_test_and_form(gpu_pytester, run_inner):
    gpu_pytester.makepyfile(test_bad=BAD_MARKERS)
    result = run_inner("--gpus", "sim:4x16GiB")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.assert_outcomes(errors=1)
    expected = [
        "pytest-gpu: invalid GPU request",
        f"test_bad.py::test_zero: gpu marker: count must be a positive int, got 0; expected {MARKER_FORM}",
        f"test_bad.py::test_negative: gpu marker: count must be a positive int, got -2; expected {MARKER_FORM}",
        f"test_bad.py::test_unknown_keyword: gpu marker: unknown keyword 'colour'; expected {MARKER_FORM}",
        f"test_bad.py::test_unparsable_size: gpu marker: memory='lots' is not a size: expected {SIZE_FORM}, got 'lots'",
    ]
    lines = result.stdout.lines
    start = lines.index(expected[0])
    assert lines[start : start + len(expected)] == expected
    result.stdout.fnmatch_lines(["ERROR test_bad.py - pytest-gpu: invalid GPU request"])
    assert "test_innocent" not in result.stdout.str()  # nothing of the module ran


def test_bad_marker_fails_collection_under_xdist(gpu_pytester, run_inner):
    gpu_pytester.makepyfile(test_bad="import pytest\n\n@pytest.mark.gpu(2, size=3)\ndef test_x():\n    pass\n")
    result = run_inner("--gpus", "sim:2x16GiB", "-n", "2", subprocess=True)
    assert result.ret != pytest.ExitCode.OK
    result.stdout.fnmatch_lines([f"test_bad.py::test_x: gpu marker: unknown keyword 'size'; expected {MARKER_FORM}"])


def test_bad_gpu_request_arguments_fail_the_test(gpu_pytester, run_inner):
    gpu_pytester.makepyfile(
        test_section="""
        def test_zero(gpu_request):
            with gpu_request(count=0):
                pass

        def test_unknown(gpu_request):
            with gpu_request(memory="1GiB", shared=True):
                pass
        """
    )
    result = run_inner("--gpus", "sim:2x16GiB")
    result.assert_outcomes(failed=2)
    form = 'gpu_request(count=1, memory="8GiB", exclusive=False)'
    result.stdout.fnmatch_lines(
        [f"pytest-gpu: test_section.py::test_zero: gpu_request: count must be a positive int, got 0; expected {form}"]
    )
    result.stdout.fnmatch_lines(
        [f"pytest-gpu: test_section.py::test_unknown: gpu_request: unknown keyword 'shared'; expected {form}"]
    )


def test_a_bad_gpu_request_in_a_test_or_a_fixture_is_one_line_without_frames(gpu_pytester, run_inner):
    gpu_pytester.makepyfile(
        test_lots="""
        import pytest

        def test_section(gpu_request):
            with gpu_request(memory="lots"):
                pass

        @pytest.fixture
        def model(gpu_request):
            with gpu_request(memory="lots") as lease:
                yield lease

        def test_fixture(model):
            pass
        """
    )
    result = run_inner("--gpus", "sim:1x16GiB")
    result.assert_outcomes(failed=1, errors=1)
    expected = f"gpu_request: memory='lots' is not a size: expected {SIZE_FORM}, got 'lots'"
    result.stdout.fnmatch_lines([f"pytest-gpu: test_lots.py::test_section: {expected}"])
    result.stdout.fnmatch_lines([f"pytest-gpu: test_lots.py::test_fixture: {expected}"])
    out = result.stdout.str()
    for noise in ("contextlib", "lifecycle.py", "GpuRun(settings=", "Settings(", "def _section"):
        assert noise not in out, noise


def test_a_run_reads_short_in_a_traceback(gpu_pytester, run_inner):
    gpu_pytester.makepyfile(
        test_repr="""
        def test_repr(request):
            from pytest_gpu.run.record import RUN_KEY
            text = repr(request.config.stash[RUN_KEY])
            assert text.startswith("<GpuRun main gpus='sim:1x16GiB' run_dir=") and len(text) < 200, text
        """
    )
    run_inner("--gpus", "sim:1x16GiB").assert_outcomes(passed=1)


# (option, value, ini key, the message after "ERROR: <where>")
BAD_OPTIONS = [
    ("--gpus", "garbage", "gpus", None),
    ("--gpu-verify", "maybe", "gpu_verify", "expected one of fail, warn, off, got 'maybe'"),
    ("--gpu-oversize", "x", "gpu_oversize", "expected one of skip, fail, got 'x'"),
    ("--gpu-wait-timeout", "-1", "gpu_wait_timeout", "expected a positive number of seconds, got '-1'"),
    ("--gpu-wait-timeout", "abc", "gpu_wait_timeout", "expected a positive number of seconds, got 'abc'"),
    ("--gpu-wait-timeout", "0", "gpu_wait_timeout", "expected a positive number of seconds, got '0'"),
    (
        "--gpu-amd-process-lag",
        "-1",
        "gpu_amd_process_lag",
        "expected seconds from 0 to 60 (0: the driver reads it live), got '-1'",
    ),
    (
        "--gpu-amd-process-lag",
        "soon",
        "gpu_amd_process_lag",
        "expected seconds from 0 to 60 (0: the driver reads it live), got 'soon'",
    ),
    (
        "--gpu-default-memory",
        "abc",
        "gpu_default_memory",
        f"expected 'exclusive' or a size; expected {SIZE_FORM}, got 'abc'",
    ),
    (
        "--gpu-default-memory",
        "0",
        "gpu_default_memory",
        "expected 'exclusive' or a size; expected a positive size, got '0'",
    ),
    ("--gpu-context-overhead", "abc", "gpu_context_overhead", f"expected {SIZE_FORM}, got 'abc'"),
    ("--gpu-port-range", "5-1", "gpu_port_range", "expected 1024 <= LOW <= HIGH <= 65535, got '5-1'"),
    ("--gpu-port-range", "abc", "gpu_port_range", "expected a port range LOW-HIGH such as 20000-32767, got 'abc'"),
    ("--gpu-trace", ".", "gpu_trace", "expected the path of a file to write the trace to, got directory '.'"),
    (
        "--gpu-trace",
        "nowhere/t.json",  # relative (to the inner run's directory): were it made, it is made there
        "gpu_trace",
        "'nowhere' does not exist; expected the path of a file in an existing directory, got 'nowhere/t.json'",
    ),
]


def _expected_error(option: str, value: str, ini: str, message: str | None, *, from_ini: bool) -> str:
    if message is None:  # --gpus names itself, wherever the value came from
        return f"ERROR: --gpus {value!r}: expected {GPUS_FORM}"
    where = f"ini key {ini!r}" if from_ini else option
    return f"ERROR: {where}: {message}"


@pytest.mark.parametrize(("option", "value", "ini", "message"), BAD_OPTIONS)
def test_bad_option_value_is_a_usage_error(gpu_pytester, run_inner, option, value, ini, message):
    gpu_pytester.makepyfile("def test_cpu():\n    pass\n")
    result = run_inner(f"{option}={value}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert _expected_error(option, value, ini, message, from_ini=False) in result.errlines
    assert "test_cpu" not in result.stdout.str()  # nothing ran


@pytest.mark.parametrize(("option", "value", "ini", "message"), BAD_OPTIONS)
def test_bad_ini_value_is_a_usage_error(gpu_pytester, run_inner, option, value, ini, message):
    gpu_pytester.makeini(f"[pytest]\n{ini} = {value}\n")
    gpu_pytester.makepyfile("def test_cpu():\n    pass\n")
    result = run_inner()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert _expected_error(option, value, ini, message, from_ini=True) in result.errlines


def test_a_bad_user_memory_bound_is_a_usage_error_at_start(gpu_pytester, run_inner, monkeypatch):
    """The machine's arbiter, which may live in any run, reads it: a bad one stops the run at
    start naming the variable, not each GPU test with a broker error."""
    monkeypatch.setenv("PYTEST_GPU_USER_MEMORY", "lots")
    gpu_pytester.makepyfile("def test_cpu():\n    pass\n")
    result = run_inner()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert f"ERROR: PYTEST_GPU_USER_MEMORY=lots: expected {SIZE_FORM}, got 'lots'" in result.errlines
    assert "test_cpu" not in result.stdout.str()


# A size with a space around it ("8GB "): refused wherever a size is read, naming the value and
# what to write, not read as 8GB. (option, ini key, value, what the message says before the size's)
SPACED_SIZES = [
    ("--gpu-default-memory", "gpu_default_memory", "8GB ", "expected 'exclusive' or a size; "),
    ("--gpu-context-overhead", "gpu_context_overhead", " 500MiB", ""),
    ("--gpu-host-memory", "gpu_host_memory", "8GiB ", "expected 'auto' or a size; "),
]


def _spaced(value: str) -> str:
    return f"space around the size in {value!r}: write {value.strip()!r} (expected {SIZE_FORM})"


@pytest.mark.parametrize("from_ini", [False, True], ids=["option", "ini"])
@pytest.mark.parametrize(("option", "ini", "value", "before"), SPACED_SIZES, ids=[s[1] for s in SPACED_SIZES])
def test_a_size_option_with_a_space_around_it_is_a_usage_error(
    gpu_pytester, run_inner, option, ini, value, before, from_ini
):
    gpu_pytester.makepyfile("def test_cpu():\n    pass\n")
    if from_ini:  # a pytest.ini value loses its trailing space; a TOML string keeps it
        gpu_pytester.makepyprojecttoml(f'[tool.pytest.ini_options]\n{ini} = "{value}"\n')
    result = run_inner(*(() if from_ini else (f"{option}={value}",)))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    where = f"ini key {ini!r}" if from_ini else option
    assert f"ERROR: {where}: {before}{_spaced(value)}" in result.errlines
    assert "test_cpu" not in result.stdout.str()


def test_a_request_size_with_a_space_around_it_is_refused_naming_the_test(gpu_pytester, run_inner):
    gpu_pytester.makepyfile(
        test_spaced="""
        import pytest

        @pytest.mark.gpu(memory="8GB ")
        def test_marker():
            pass

        @pytest.mark.host_resources(host_memory=" 2GiB")
        def test_host():
            pass
        """
    )
    result = run_inner("--gpus", "sim:1x16GiB")
    assert result.ret == pytest.ExitCode.INTERRUPTED  # the markers: a collection error
    host_form = (
        '@pytest.mark.host_resources(cpus=2), @pytest.mark.host_resources(host_memory="8GiB") or '
        '@pytest.mark.host_resources(cpus=2, host_memory="8GiB")'
    )
    result.stdout.fnmatch_lines(
        [
            f"test_spaced.py::test_marker: gpu marker: memory='8GB ' is not a size: {_spaced('8GB ')}",
            f"test_spaced.py::test_host: host_resources marker: host_memory=' 2GiB' is not a size: "
            f"{_spaced(' 2GiB')}; expected {host_form}",
        ],
        consecutive=True,
    )
    gpu_pytester.makepyfile(
        test_spaced="def test_section(gpu_request):\n    with gpu_request(memory='1GiB '):\n        pass\n"
    )
    result = run_inner("--gpus", "sim:1x16GiB")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [f"pytest-gpu: test_spaced.py::test_section: gpu_request: memory='1GiB ' is not a size: {_spaced('1GiB ')}"]
    )


def test_the_amd_lag_wait_is_a_flag_and_a_true_false_ini_key(gpu_pytester, run_inner, monkeypatch):
    gpu_pytester.makepyfile(
        test_wait="""
        import os
        from pytest_gpu.run.record import RUN_KEY

        def test_wait(request):
            assert request.config.stash[RUN_KEY].settings.amd_lag_wait is (os.environ["EXPECT"] == "1")
        """
    )
    for ini, args, expect in (("", (), "0"), ("", ("--gpu-amd-lag-wait",), "1"), ("gpu_amd_lag_wait = yes", (), "1")):
        gpu_pytester.makeini(f"[pytest]\n{ini}\n")
        monkeypatch.setenv("EXPECT", expect)
        run_inner("--gpus", "sim:1x16GiB", *args).assert_outcomes(passed=1)
    gpu_pytester.makeini("[pytest]\ngpu_amd_lag_wait = sometimes\n")
    result = run_inner("--gpus", "sim:1x16GiB")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "ERROR: ini key 'gpu_amd_lag_wait': expected true or false, got 'sometimes'" in result.errlines


def test_a_sim_machine_beyond_the_bounds_is_a_usage_error(gpu_pytester, run_inner):
    gpu_pytester.makepyfile("def test_cpu():\n    pass\n")
    result = run_inner("--gpus", "sim:30000x1GiB")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "ERROR: --gpus 'sim:30000x1GiB': 30000 GPUs; a simulated machine has at most 64" in result.errlines


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("--gpus", "sim:4x1KiB"),
            "ERROR: --gpus 'sim:4x1KiB': a device of 1KiB is no larger than one CUDA context (500MiB, "
            "--gpu-context-overhead); expected COUNTxSIZE with sizes larger than that, such as 4x16GiB",
        ),
        (
            ("--gpus", "sim:2x1GiB", "--gpu-context-overhead", "1GiB"),
            "ERROR: --gpus 'sim:2x1GiB': a device of 1GiB is no larger than one CUDA context (1GiB, "
            "--gpu-context-overhead); expected COUNTxSIZE with sizes larger than that, such as 4x16GiB",
        ),
    ],
)
def test_simulated_gpus_no_larger_than_a_context_are_a_usage_error(gpu_pytester, run_inner, args, message):
    """Not "-500MiB after the CUDA context" at every test: refused before any test runs."""
    gpu_pytester.makepyfile("def test_cpu():\n    pass\n")
    result = run_inner(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert message in result.errlines
    assert "test_cpu" not in result.stdout.str()


def test_a_context_given_by_the_spec_is_the_one_a_small_gpu_is_checked_against(gpu_pytester, run_inner):
    gpu_pytester.makepyfile("def test_cpu():\n    pass\n")
    run_inner("--gpus", "sim:1x256MiB;context=64MiB").assert_outcomes(passed=1)  # 256MiB < 500MiB, the default


def test_a_trace_directory_that_is_missing_or_a_file_is_a_usage_error_and_never_made(gpu_pytester, run_inner):
    gpu_pytester.makepyfile("def test_cpu():\n    pass\n")
    result = run_inner("--gpus", "sim:1x16GiB", "--gpu-trace=out/sub/run.json")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert (
        "ERROR: --gpu-trace: 'out/sub' does not exist; expected the path of a file in an existing directory, "
        "got 'out/sub/run.json'"
    ) in result.errlines
    assert not (gpu_pytester.path / "out").exists()
    (gpu_pytester.path / "blocker").write_text("a file, so blocker/ cannot be a directory")
    result = run_inner("--gpus", "sim:1x16GiB", "--gpu-trace=blocker/run.json")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert (
        "ERROR: --gpu-trace: 'blocker' is not a directory; expected the path of a file in an existing directory, "
        "got 'blocker/run.json'"
    ) in result.errlines


def test_a_trace_that_cannot_be_written_is_reported_and_the_outcome_stands(gpu_pytester, run_inner):
    # the directory exists when the run starts (else a usage error) and is a file by its end
    gpu_pytester.makeconftest(
        "import os\n\n"
        "def pytest_sessionstart(session):\n"
        "    os.rmdir('blocker')\n"
        "    with open('blocker', 'w') as f:\n"
        "        f.write('a file, so blocker/ cannot be a directory')\n"
    )
    gpu_pytester.makepyfile("def test_cpu():\n    pass\n")
    (gpu_pytester.path / "blocker").mkdir()
    result = run_inner("--gpus", "sim:1x16GiB", "--gpu-trace=blocker/run.json")
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["pytest-gpu: --gpu-trace: could not write the trace to blocker/run.json: *"])
    assert "Traceback" not in result.stdout.str() + result.stderr.str()
    assert sorted(p.name for p in gpu_pytester.path.iterdir() if p.name.endswith(".tmp")) == []


def test_command_line_beats_ini(gpu_pytester, run_inner):
    gpu_pytester.makeini("[pytest]\ngpu_verify = maybe\ngpus = sim:1x8GiB\n")
    gpu_pytester.makepyfile("import pytest\n\n@pytest.mark.gpu\ndef test_g(gpu):\n    assert gpu.indices == (0,)\n")
    result = run_inner("--gpu-verify=warn")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["pytest-gpu: 1 simulated GPU (1x8GiB) [[]sim:1x8GiB[]] · 1 GPU test *"])


OVERSIZE = """
import pytest

@pytest.mark.gpu(3)
def test_three():
    pass

@pytest.mark.gpu(memory="1GiB")
def test_fits(gpu):
    pass

def test_section(gpu_request):
    with gpu_request(count=5, memory="1GiB"):
        raise AssertionError("must not get here")

def test_cpu():
    pass

@pytest.mark.gpu(memory="20GiB")
def test_twenty(gpu):
    raise AssertionError("must not run")

@pytest.mark.gpu(memory="20GiB", isolate=True)
def test_twenty_isolated():
    raise AssertionError("must not run")
"""
SIM2 = "2 simulated GPUs (2x16GiB)"
MEMORY_OVER = f"needs 20GiB per GPU but the largest GPU offers 15.5GiB after the CUDA context ({SIM2})"


@pytest.mark.parametrize("workers", ["0", "2"])
def test_oversize_is_skipped_naming_need_and_inventory(gpu_pytester, run_inner, workers):
    """A count and a memory= larger than the machine's GPUs alike: skipped with the reason (a
    suite written for larger GPUs runs the rest), never an error that stops the collection."""
    gpu_pytester.makepyfile(test_over=OVERSIZE)
    result = run_inner("--gpus", "sim:2x16GiB", "-rs", "-n", workers, subprocess=workers != "0")
    result.assert_outcomes(passed=2, skipped=4)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines_random(
        [
            "SKIPPED [[]1[]] test_over.py:3: pytest-gpu: needs 3 GPUs (whole GPU each) but this run has 2 "
            "simulated GPUs (2x16GiB)",
            "SKIPPED [[]1[]] test_over.py:*: pytest-gpu: needs 5 GPUs (1GiB each) but this run has 2 simulated GPUs "
            "(2x16GiB)",
            f"SKIPPED [[]1[]] test_over.py:18: pytest-gpu: {MEMORY_OVER}",
            f"SKIPPED [[]1[]] test_over.py:22: pytest-gpu: its pool of 1 isolated process (1 GPU (20GiB)) "
            f"{MEMORY_OVER}",
            "pytest-gpu: 4 GPU tests skipped: larger than this run's 2 simulated GPUs (2x16GiB) (-rs lists them)",
        ]
    )
    assert "must not" not in result.stdout.str()


def test_oversize_fail(gpu_pytester, run_inner):
    gpu_pytester.makepyfile(test_over=OVERSIZE)
    result = run_inner("--gpus", "sim:2x16GiB", "--gpu-oversize=fail")
    result.assert_outcomes(passed=2, failed=1, errors=3)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "*_ ERROR at setup of test_three _*",
            "pytest-gpu: needs 3 GPUs (whole GPU each) but this run has 2 simulated GPUs (2x16GiB) "
            "(--gpu-oversize=fail)",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "*_ test_section _*",
            "pytest-gpu: needs 5 GPUs (1GiB each) but this run has 2 simulated GPUs (2x16GiB) (--gpu-oversize=fail)",
        ]
    )
    result.stdout.fnmatch_lines(
        ["*_ ERROR at setup of test_twenty _*", f"pytest-gpu: {MEMORY_OVER} (--gpu-oversize=fail)"]
    )
    result.stdout.fnmatch_lines(
        [
            "*_ ERROR at setup of test_twenty_isolated _*",
            f"pytest-gpu: its pool of 1 isolated process (1 GPU (20GiB)) {MEMORY_OVER} (--gpu-oversize=fail)",
        ]
    )
    assert "must not" not in result.stdout.str()


def test_gpus_none_skips_gpu_tests_and_runs_the_rest(gpu_pytester, run_inner):
    gpu_pytester.makepyfile(
        test_none="""
        import pytest

        @pytest.mark.gpu
        def test_marker():
            pass

        def test_fixture(gpu):
            pass

        @pytest.mark.gpu(memory="1TiB")
        def test_huge():
            pass

        def test_cpu(port):
            assert port > 0
        """
    )
    result = run_inner("--gpus", "none", "-rs")
    result.assert_outcomes(passed=1, skipped=3)
    none = "but this run has no GPUs (--gpus none)"
    result.stdout.fnmatch_lines_random(
        [
            f"SKIPPED [[]1[]] test_none.py:3: pytest-gpu: needs 1 GPU (whole GPU) {none}",
            f"SKIPPED [[]1[]] test_none.py: pytest-gpu: needs 1 GPU (whole GPU) {none}",
            f"SKIPPED [[]1[]] test_none.py:10: pytest-gpu: needs 1 GPU (1024GiB) {none}",
        ]
    )
    result.stdout.fnmatch_lines(["pytest-gpu: no GPUs (--gpus none) [[]none[]] · 0 GPU tests · *"])


def test_gpus_none_with_oversize_fail(gpu_pytester, run_inner):
    gpu_pytester.makepyfile("import pytest\n\n@pytest.mark.gpu\ndef test_marker():\n    pass\n")
    result = run_inner("--gpus", "none", "--gpu-oversize=fail")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        ["pytest-gpu: needs 1 GPU (whole GPU) but this run has no GPUs (--gpus none) (--gpu-oversize=fail)"]
    )


def test_help_lists_the_gpu_options_together_and_ray_in_a_group_of_its_own(gpu_pytester):
    out = gpu_pytester.runpytest("--help").stdout.str()
    gpu, ray = out.index("pytest-gpu: GPU-aware parallel test runs"), out.index("pytest-gpu: Ray clusters")
    assert gpu < out.index("--gpu-schedule") < out.index("--gpu-trace") < out.index("--dist-timeout") < ray
    assert ray < out.index("--ray-address") < out.index("--ray-start-timeout")


@pytest.mark.parametrize("args", [(), ("--co",), ("-k", "nothing")], ids=["run", "collect-only", "deselected"])
def test_a_cpu_only_suite_hears_nothing_from_pytest_gpu(gpu_pytester, run_inner, args):
    gpu_pytester.makepyfile("def test_a():\n    pass\n\ndef test_b(port):\n    assert port\n")
    result = run_inner("--gpus", "sim:2x16GiB", *args)
    assert "pytest-gpu" not in result.stdout.str() + result.stderr.str()


def test_a_collection_error_hears_nothing_from_pytest_gpu(gpu_pytester, run_inner):
    gpu_pytester.makepyfile("import nothing_such_here\n")
    result = run_inner("--gpus", "none")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    assert "pytest-gpu" not in result.stdout.str()
