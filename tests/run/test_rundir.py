"""Run directories on a shared machine: an unusable per-user parent, racing runs, a full temp dir."""

from __future__ import annotations

import errno
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers import patience
from pytest_gpu.run import rundir

sim_ledger = importlib.import_module("pytest_gpu.sim.ledger")  # pytest_gpu.sim.ledger is also a function

FOREIGN_UID = 54321  # no such user needed: root can chown to any uid


@pytest.fixture
def temp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temp dir of the test's own, as ``$TMPDIR`` (gettempdir caches its answer, so set that too)."""
    base = tmp_path / "tmp"
    base.mkdir()
    monkeypatch.setenv("TMPDIR", str(base))
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    return base


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temp dir with a short path: the broker's socket in it must fit AF_UNIX's 108 bytes."""
    base = Path(tempfile.mkdtemp(prefix="pg-"))
    yield base
    shutil.rmtree(base)


def _shared(base: Path) -> Path:
    return base / f"pytest-gpu-{os.getuid()}"


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _spoil(shared: Path, how: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Make ``shared`` unusable in way ``how``; returns what the warning must say."""
    if how == "foreign":
        if os.geteuid() != 0:
            pytest.skip("only root can make a directory another user's")
        shared.mkdir()
        os.chown(shared, FOREIGN_UID, FOREIGN_UID)
        return f"belongs to another user (uid {FOREIGN_UID})"
    if how == "file":
        shared.write_text("not a directory")
        return "is not a directory"
    if how == "symlink":
        (shared.parent / "elsewhere").mkdir()
        shared.symlink_to(shared.parent / "elsewhere")
        return "is a symbolic link"
    assert how == "unwritable"  # root passes any permission check: say os.access's answer is no
    shared.mkdir(mode=0o700)
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: Path(path) != shared and real(path, mode, **kw))
    return "is not writable"


def _identity(path: Path) -> tuple[int, int, int]:
    info = path.lstat()
    return info.st_ino, info.st_mode, info.st_uid


# -- 1. an unusable $TMPDIR/pytest-gpu-<uid> ------------------------------------------


@pytest.mark.parametrize("how", ["foreign", "file", "symlink", "unwritable"])
def test_unusable_shared_dir_falls_back_to_a_private_one(
    how: str, temp_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    shared = _shared(temp_dir)
    why = _spoil(shared, how, monkeypatch)
    before = _identity(shared)
    run = rundir.create()
    fallback = run.parent
    assert fallback.parent == temp_dir and fallback.name.startswith(f"pytest-gpu-{os.getuid()}-")
    assert fallback.stat().st_mode & 0o777 == 0o700 and run.stat().st_mode & 0o777 == 0o700
    assert (run / rundir.OWNER_FILE).is_file()
    err = capsys.readouterr().err
    assert err == f"pytest-gpu: warning: {shared} {why}; this run uses {fallback} instead\n"
    assert _identity(shared) == before  # left as it was
    rundir.remove(run)
    assert not fallback.exists()  # the private parent goes with the run


def test_a_killed_runs_private_fallback_is_swept(temp_dir: Path) -> None:
    fallback = temp_dir / f"pytest-gpu-{os.getuid()}-leftover"
    stale = fallback / f"run-{_dead_pid()}-x"
    stale.mkdir(parents=True)
    (stale / rundir.OWNER_FILE).write_text(json.dumps({"pid": _dead_pid(), "ctime": 1.0}))
    os.utime(fallback, (0, 0))
    young = temp_dir / f"pytest-gpu-{os.getuid()}-young"  # a run's fallback, its run directory not made yet
    young.mkdir()
    assert rundir.sweep_stale() == [stale]
    os.utime(fallback, (0, 0))  # removing the run directory touched it
    rundir.sweep_stale()
    assert not fallback.exists() and young.is_dir()


def test_foreign_owned_shared_dir_leaves_runs_working(
    gpu_pytester: pytest.Pytester,
    run_inner: Callable[..., pytest.RunResult],
    monkeypatch: pytest.MonkeyPatch,
    short_tmp: Path,
) -> None:
    """The issue's case, end to end: a CPU-only and a simulated-GPU test pass, with one line saying why."""
    base = short_tmp
    shared = _shared(base)
    shared.mkdir()
    if os.geteuid() == 0:
        os.chown(shared, FOREIGN_UID, FOREIGN_UID)
        why = f"belongs to another user (uid {FOREIGN_UID})"
    else:  # a user cannot give a directory away; a file in its place fails the same way
        shared.rmdir()
        shared.write_text("")
        why = "is not a directory"
    monkeypatch.setenv("TMPDIR", str(base))
    gpu_pytester.makepyfile(
        test_both="""
        import pytest
        from pytest_gpu.run.lifecycle import RUN_KEY

        def test_cpu():
            pass

        @pytest.mark.gpu(memory="1GiB")
        def test_gpu(gpu, request):
            print("RUNDIR", request.config.stash[RUN_KEY].run_dir)
        """
    )
    result = run_inner("--gpus", "sim:1x16GiB", "-s", subprocess=True)
    result.assert_outcomes(passed=2)
    warnings = [line for line in result.errlines if line.startswith("pytest-gpu: warning:")]
    assert len(warnings) == 1 and f"{shared} {why}; this run uses {base}/pytest-gpu-" in warnings[0]
    found = re.search(r"RUNDIR (\S+)", result.stdout.str())
    assert found is not None
    run_dir = Path(found[1])
    assert run_dir.parent.parent == base  # fallback/run-*
    assert [p.name for p in base.iterdir()] == [shared.name]  # the run left nothing behind


# -- 2. runs that start and sweep at once ------------------------------------------------


def _fresh_run(root: Path, pid: int, owner: str | None, age: float = 0.0) -> Path:
    run = root / f"run-{pid}-abc"
    run.mkdir(parents=True)
    if owner is not None:
        (run / rundir.OWNER_FILE).write_text(owner)
    if age:
        os.utime(run, (time.time() - age, time.time() - age))
    return run


@pytest.mark.parametrize(
    ("creator", "owner", "age", "kept"),
    [
        ("alive", "", 3600, True),  # the creator is writing it: a half-written owner file
        ("alive", None, 3600, True),  # ... or not yet begun to
        ("dead", '{"pid": ', 0, True),  # within the grace period
        ("dead", None, 0, True),
        ("dead", '{"pid": ', 3600, False),  # died before finishing it
        ("dead", None, 3600, False),
        ("alive", "owner", 3600, True),
        ("dead", "owner", 0, False),
        ("alive", "reused", 0, False),  # the pid is someone else's now
        ("alive", "shifted", 0, True),  # the boot time psutil adds moved a second (NTP)
    ],
)
def test_sweep_keeps_runs_being_created_and_removes_dead_ones(
    tmp_path: Path, creator: str, owner: str | None, age: float, kept: bool
) -> None:
    import psutil

    pid = os.getpid() if creator == "alive" else _dead_pid()
    if owner == "owner":
        owner = json.dumps({"pid": pid, "ctime": psutil.Process(pid).create_time() if creator == "alive" else 1.0})
    elif owner == "reused":
        owner = json.dumps({"pid": pid, "ctime": psutil.Process(pid).create_time() - 3600})
    elif owner == "shifted":
        owner = json.dumps({"pid": pid, "ctime": psutil.Process(pid).create_time() + 1.0})
    run = _fresh_run(tmp_path, pid, owner, age)
    assert rundir.sweep_stale(tmp_path) == ([] if kept else [run])
    assert run.is_dir() == kept


def test_sweep_keeps_a_run_whose_owner_may_not_be_inspected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil

    def denied(self: psutil.Process) -> float:
        raise psutil.AccessDenied(self.pid)

    run = _fresh_run(tmp_path, os.getpid(), json.dumps({"pid": os.getpid(), "ctime": 1.0}), 3600)
    monkeypatch.setattr(psutil.Process, "create_time", denied)
    assert rundir.sweep_stale(tmp_path) == []
    assert run.is_dir()


def test_sweep_tolerates_a_directory_removed_under_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gone = _fresh_run(tmp_path, _dead_pid(), None, 3600)
    kept = _fresh_run(tmp_path, os.getpid(), None)
    real = Path.is_dir

    def is_dir(self: Path) -> bool:  # another run's sweep removes it right after this one listed it
        found = real(self)
        if self == gone and found:
            for child in self.iterdir():
                child.unlink()
            self.rmdir()
        return found

    monkeypatch.setattr(Path, "is_dir", is_dir)
    rundir.sweep_stale(tmp_path)
    assert not gone.exists() and kept.is_dir()


STRESS = r"""
import json, os, sys, tempfile, time
from pathlib import Path
from pytest_gpu.run import rundir

seconds, dead = float(sys.argv[1]), int(sys.argv[2])
root = rundir.base_dir()
held, lost, rounds = [], set(), 0
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    rounds += 1
    held.append(rundir.create())
    # litter for the sweeps to race over: a run whose owner is gone, one that died before writing it
    stale = Path(tempfile.mkdtemp(prefix=f"run-{dead}-", dir=root))
    (stale / rundir.OWNER_FILE).write_text(json.dumps({"pid": dead, "ctime": 1.0}))
    os.utime(Path(tempfile.mkdtemp(prefix=f"run-{dead}-", dir=root)), (0, 0))
    rundir.sweep_stale()
    lost.update(str(run) for run in held if not (run / rundir.OWNER_FILE).is_file())
    held = [run for run in held if str(run) not in lost]
    if len(held) > 3:
        rundir.remove(held.pop(0))
for run in held:
    rundir.remove(run)
print(json.dumps({"rounds": rounds, "lost": sorted(lost)}))
"""


def test_racing_runs_lose_no_live_directory(tmp_path: Path) -> None:
    """4 processes create and sweep at once; none loses its run directory or sees an error.

    PYTEST_GPU_STRESS_S sets how long (default 10 s; the issue's acceptance run is 20 s).
    """
    seconds = os.environ.get("PYTEST_GPU_STRESS_S", "10")
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    dead = str(_dead_pid())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", STRESS, seconds, dead],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    results = [proc.communicate(timeout=float(seconds) + patience(60)) for proc in procs]
    for proc, (out, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, err
        report = json.loads(out)
        assert report["rounds"] > 10 and report["lost"] == [], report


# -- 3. a full or read-only temp dir -------------------------------------------------------


def _no_space(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every Path.write_text writes part of its text, then finds the disk full."""

    def write_text(self: Path, data: str, *args: object, **kwargs: object) -> int:
        with open(self, "w") as f:
            f.write(data[:3])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Path, "write_text", write_text)


def _no_space_for_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every write(2) writes a few bytes, then finds the disk full."""
    real = os.write
    seen: set[int] = set()

    def write(fd: int, data: bytes) -> int:
        if fd in seen:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        seen.add(fd)
        return real(fd, bytes(data[:3]))

    monkeypatch.setattr(os, "write", write)


def test_ledger_write_on_a_full_disk_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    led = sim_ledger.Ledger.create(tmp_path, "sim:1x16GiB", 0)
    before = sorted(p.name for p in tmp_path.iterdir())
    with monkeypatch.context() as m:
        _no_space_for_writes(m)
        with pytest.raises(sim_ledger.LedgerWriteError) as caught:
            led.allocate(2**20, 0, None, None)
    assert str(caught.value) == (
        f"pytest-gpu: cannot write the simulated GPU ledger at {tmp_path}: No space left on device"
    )
    assert isinstance(caught.value, OSError) and caught.value.errno == errno.ENOSPC
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no half-written temp files
    assert led.used() == {0: 0}  # nothing was charged


def test_run_dir_on_a_full_disk_is_one_clear_error(temp_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_space(monkeypatch)
    with pytest.raises(rundir.RunDirError) as caught:
        rundir.create()
    shared = _shared(temp_dir)
    assert str(caught.value) == (
        f"pytest-gpu: cannot create the run directory in {shared}: No space left on device; "
        "point TMPDIR at a writable directory with free space"
    )
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(shared)
    assert list(shared.iterdir()) == []  # the half-made run directory is gone


def _read_only(base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``base`` as a read-only file system has it (root passes permission bits, not that)."""
    real = os.mkdir

    def mkdir(path: str | os.PathLike[str], *args: object, **kwargs: object) -> None:
        if Path(path).parent == base:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        real(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "mkdir", mkdir)
    # Python 3.10's Path.mkdir calls the os.mkdir its accessor bound at import, not os.mkdir
    real_path_mkdir = Path.mkdir

    def path_mkdir(self: Path, *args: Any, **kwargs: Any) -> None:
        if self.parent == base:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        real_path_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", path_mkdir)


def test_run_dir_on_a_read_only_temp_dir_is_one_clear_error(temp_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _read_only(temp_dir, monkeypatch)
    with pytest.raises(rundir.RunDirError) as caught:
        rundir.create()
    assert str(caught.value) == (
        f"pytest-gpu: cannot create the run directory in {temp_dir}: Read-only file system; "
        "point TMPDIR at a writable directory with free space"
    )
    assert caught.value.errno == errno.EROFS and list(temp_dir.iterdir()) == []


def test_no_usable_temp_dir_at_all_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def gettempdir() -> str:  # what tempfile says when every candidate is full or read-only
        raise FileNotFoundError(errno.ENOENT, "No usable temporary directory found in ['/tmp']")

    monkeypatch.setattr(tempfile, "gettempdir", gettempdir)
    with pytest.raises(rundir.RunDirError, match=r"directory: No usable temporary directory found in \['/tmp'\];"):
        rundir.create()


def test_read_only_temp_dir_is_a_usage_error_not_an_internal_error(
    gpu_pytester: pytest.Pytester, run_inner: Callable[..., pytest.RunResult]
) -> None:
    base = gpu_pytester.path / "tmp"
    base.mkdir()
    gpu_pytester.makeconftest(
        f"""
        import errno, os, pathlib, tempfile

        tempfile.tempdir = {str(base)!r}
        _mkdir = os.mkdir

        def mkdir(path, *args, **kwargs):  # {base} is on a read-only file system
            if os.path.dirname(os.fspath(path)) == tempfile.tempdir:
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))
            return _mkdir(path, *args, **kwargs)

        os.mkdir = mkdir
        _path_mkdir = pathlib.Path.mkdir

        def path_mkdir(self, *args, **kwargs):  # Python 3.10's Path.mkdir does not call os.mkdir
            if str(self.parent) == tempfile.tempdir:
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
            return _path_mkdir(self, *args, **kwargs)

        pathlib.Path.mkdir = path_mkdir
        """
    )
    gpu_pytester.makepyfile(test_cpu="def test_cpu():\n    pass\n")
    result = run_inner(subprocess=True)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [f"ERROR: pytest-gpu: cannot create the run directory in {base}: Read-only file system*"]
    )
