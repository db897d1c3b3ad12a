"""The benchmarks under ``bench/`` report figures only from runs that ran: a pytest that
ends without running the suite stops the benchmark instead of filling its table with
blanks (a table of blanks once passed for a measurement when the plugin was not
importable)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers import ROOT, patience


def broken_env(tmp_path: Path) -> dict[str, str]:
    """An environment whose pytest_gpu cannot be imported (as with a stale editable install)."""
    broken = tmp_path / "site" / "pytest_gpu"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('pytest_gpu broken on purpose')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_GPU")}
    env["PYTHONPATH"] = str(tmp_path / "site")
    return env


def test_makespan_stops_at_a_run_that_ran_nothing(tmp_path: Path) -> None:
    env = broken_env(tmp_path)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "makespan.py"), "--scenario", "shapes", "--quick", "--shapes", "worker"],
        env=env,
        capture_output=True,
        text=True,
        timeout=patience(300),
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "ended without a pytest summary" in out
    assert "broken on purpose" in out or "exit status" in out
    assert "| worker | 1 |" not in out  # no table of blanks


def test_concurrent_runs_fails_when_a_run_did_not_pass_its_tests(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "concurrent_runs.py"), "--quick"],
        env=broken_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=patience(300),
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "not a measurement: concurrent: 0 of 16 passed" in out


def test_first_failure_stops_at_a_run_that_pytest_itself_ended(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "first_failure.py"), "--quick"],
        env=broken_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=patience(300),
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "not a test outcome" in out and "broken on purpose" in out


def test_the_suite_bench_finds_a_test_file_where_a_revision_keeps_it(tmp_path: Path) -> None:
    """bench/suite.py runs the same tests at both revisions, across the move into folders."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_suite", ROOT / "bench" / "suite.py")
    assert spec is not None and spec.loader is not None
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    old, new = tmp_path / "old", tmp_path / "new"
    (old / "tests").mkdir(parents=True)
    (old / "tests" / "test_moved.py").write_text("")
    (new / "tests" / "leasing").mkdir(parents=True)
    (new / "tests" / "leasing" / "test_moved.py").write_text("")
    target = "tests/leasing/test_moved.py::test_x"
    assert suite.locate(new, target) == target
    assert suite.locate(old, target) == "tests/test_moved.py::test_x"
    assert suite.locate(new, "tests/test_moved.py") == "tests/leasing/test_moved.py"
    assert suite.locate(old, "tests/leasing/test_gone.py::test_x") == "tests/leasing/test_gone.py::test_x"
    assert suite.locate(old, "tests") == "tests"  # a folder, or the whole suite: as given
