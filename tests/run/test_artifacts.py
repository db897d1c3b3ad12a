"""The shared_artifact fixture: built once per run across workers, reused across runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pytest_gpu.run.artifacts import ArtifactBuildError, ArtifactStore

SUITE = """
import os, signal, time
import pytest

def build(path):
    if os.environ.get("KILL_FIRST_BUILDER") and not os.path.exists(os.environ["KILLED_MARK"]):
        open(os.environ["KILLED_MARK"], "w").close()
        os.kill(os.getpid(), signal.SIGKILL)      # the builder dies mid-build
    if os.environ.get("FAIL_BUILD"):
        raise ValueError("the dataset server is down")
    time.sleep(0.3)                               # others pile up on the lock meanwhile
    with open(os.environ["COUNT_FILE"], "a") as f:
        f.write(f"{os.getpid()}\\n")
    (path / "data.txt").write_text("hello")

@pytest.mark.parametrize("i", range(8))
def test_use(shared_artifact, i):
    path = shared_artifact("dataset", build, version=os.environ.get("VERSION", "1"))
    assert (path / "data.txt").read_text() == "hello"
"""
# the cache plugin stays on here: it is where artifacts live across runs
ARGS = ("-p", "no:benchmark", "-p", "no:hypothesispytest")


def builds(pytester: pytest.Pytester) -> int:
    count = pytester.path / "count"
    return len(count.read_text().splitlines()) if count.exists() else 0


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    pytester.makepyfile(test_suite=SUITE)
    monkeypatch.setenv("COUNT_FILE", str(pytester.path / "count"))
    monkeypatch.setenv("KILLED_MARK", str(pytester.path / "killed"))
    for name in ("FAIL_BUILD", "KILL_FIRST_BUILDER", "VERSION"):
        monkeypatch.delenv(name, raising=False)
    return pytester


def test_built_once_under_xdist_then_reused_until_the_version_changes(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    suite.runpytest_subprocess("-n", "8", *ARGS).assert_outcomes(passed=8)  # 8 workers race for one build
    assert builds(suite) == 1
    suite.runpytest_subprocess("-n", "4", *ARGS).assert_outcomes(passed=8)
    assert builds(suite) == 1  # a later run reuses it
    monkeypatch.setenv("VERSION", "2")
    suite.runpytest_subprocess("-n", "4", *ARGS).assert_outcomes(passed=8)
    assert builds(suite) == 2
    suite.runpytest_subprocess("-n", "4", "--gpu-rebuild-artifacts", *ARGS).assert_outcomes(passed=8)
    assert builds(suite) == 3  # forced: once in that run, not once per test
    store = suite.path / ".pytest_cache" / "d" / "pytest_gpu_artifacts" / "dataset"
    assert sorted(p.name for p in store.iterdir() if not p.name.startswith(".lock")) == ["v-1", "v-2"]


def test_a_failing_build_fails_every_user_with_the_builders_traceback(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAIL_BUILD", "1")
    result = suite.runpytest_subprocess("-n", "2", *ARGS)
    result.assert_outcomes(failed=8)
    text = result.stdout.str()
    assert text.count("ValueError: the dataset server is down") >= 8
    assert "shared_artifact('dataset', version='1'): the build failed in process" in text
    assert builds(suite) == 0
    # the next run tries again
    monkeypatch.delenv("FAIL_BUILD")
    suite.runpytest_subprocess("-n", "2", *ARGS).assert_outcomes(passed=8)
    assert builds(suite) == 1


def test_a_waiter_takes_over_when_the_builder_dies(suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILL_FIRST_BUILDER", "1")
    result = suite.runpytest_subprocess("-n", "2", *ARGS)
    result.assert_outcomes(passed=7, failed=1)  # only the test whose worker was killed
    result.stdout.fnmatch_lines(["*crashed while running*"])
    assert builds(suite) == 1
    store = suite.path / ".pytest_cache" / "d" / "pytest_gpu_artifacts" / "dataset"
    assert not list(store.glob(".build-*"))  # the dead builder's half-built directory is gone


def test_store_rejects_bad_arguments_and_sweeps_dead_builders(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "root", tmp_path / "run", rebuild=False)
    with pytest.raises(ValueError, match="name must be a non-empty string, got ''"):
        store.get("", lambda p: None)
    with pytest.raises(TypeError, match=r"shared_artifact\('x'\): build must be a callable taking a Path"):
        store.get("x", "not callable")  # type: ignore[arg-type]
    dead = tmp_path / "root" / "x" / ".build-999999999-abcd"
    dead.mkdir(parents=True)
    path = store.get("x", lambda p: (p / "f").write_text("1"))
    assert (path / "f").read_text() == "1" and not dead.exists()
    calls: list[Path] = []
    assert store.get("x", calls.append) == path and calls == []  # built: not built again

    def broken(p: Path) -> None:
        raise KeyError("nope")

    with pytest.raises(ArtifactBuildError, match="KeyError: 'nope'"):
        store.get("y", broken)
    with pytest.raises(ArtifactBuildError, match="KeyError: 'nope'"):  # remembered for the run
        store.get("y", lambda p: None)
    assert os.listdir(tmp_path / "root" / "y") == [".lock"]
