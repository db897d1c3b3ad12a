"""Each launcher's command line, environment, availability and process handling, without
starting a launcher (``test_distributed_launchers`` runs the real ones end to end)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from pytest_gpu.base.distspec import LAUNCHERS, DistSettings, DistSpec
from pytest_gpu.distributed.launchers import LAUNCH_VARS, Launcher, exit_text, launcher_for
from pytest_gpu.distributed.pool import PoolError, RankPool

RANKMAIN = [sys.executable, "-m", "pytest_gpu.distributed.rankmain"]
POOL_ENV = {"PYTEST_GPU_RANK_ADDRESS": "/run/ctl.sock", "PYTEST_GPU_RANK_BACKEND": "gloo"}
OVERSUBSCRIBE = "OMPI_MCA_rmaps_base_oversubscribe"
AS_ROOT = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")


def launcher(name: str, world_size: int = 2) -> Launcher:
    backend = "mpi" if name == "mpirun" else "gloo"
    return launcher_for(DistSpec(world_size=world_size, backend=backend, gpus_per_rank=0, launcher=name))


@pytest.fixture(autouse=True)
def outer_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """This pytest runs as rank 3 of something else, with a GPU of its own and a variable of the user's."""
    for name in (OVERSUBSCRIBE, *AS_ROOT):
        monkeypatch.delenv(name, raising=False)
    for name in LAUNCH_VARS:
        monkeypatch.setenv(name, "3")
    monkeypatch.setenv("USERS_OWN", "kept")


@pytest.fixture
def on_path(monkeypatch: pytest.MonkeyPatch) -> dict[str, str | None]:
    """What ``shutil.which`` finds, as the launchers see it: edit the dict."""
    found: dict[str, str | None] = {"mpirun": "/opt/mpi/bin/mpirun", "srun": "/usr/bin/srun"}
    monkeypatch.setattr(shutil, "which", lambda name: found.get(name))
    return found


def common_env(env: dict[str, str], port: int) -> None:
    """What every launcher's processes get: no launch variable of the outer run, the rendezvous, the pool's."""
    assert env["USERS_OWN"] == "kept"
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["PYTHONUNBUFFERED"]) == ("127.0.0.1", str(port), "1")
    assert {k: env[k] for k in POOL_ENV} == POOL_ENV
    assert "CUDA_VISIBLE_DEVICES" not in env and "PYTEST_GPU_SIM_TAG" not in env and "LOCAL_WORLD_SIZE" not in env


def test_every_marker_launcher_has_a_class() -> None:
    assert {launcher(name).name for name in LAUNCHERS} == set(LAUNCHERS)


def test_spawn_starts_each_rank_numbered(on_path: dict[str, str | None]) -> None:
    spawn = launcher("spawn", world_size=3)
    on_path.clear()  # spawn needs nothing on PATH
    assert spawn.unavailable() is None
    started = spawn.processes(POOL_ENV, 29500)
    assert [argv for argv, _ in started] == [RANKMAIN] * 3
    for rank, (_, env) in enumerate(started):
        common_env(env, 29500)
        assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "PYTEST_GPU_RANK")} == dict.fromkeys(
            ("RANK", "LOCAL_RANK", "PYTEST_GPU_RANK"), str(rank)
        )
        assert env["WORLD_SIZE"] == env["PYTEST_GPU_WORLD_SIZE"] == "3"
        assert OVERSUBSCRIBE not in env


def test_torchrun_is_torchs_module_on_this_python(on_path: dict[str, str | None]) -> None:
    torchrun = launcher("torchrun")
    on_path.clear()
    assert torchrun.unavailable() is None
    ((argv, env),) = torchrun.processes(POOL_ENV, 29501)
    assert argv == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--nnodes=1",
        "--master-addr=127.0.0.1",
        "--master-port=29501",
        "-m",
        "pytest_gpu.distributed.rankmain",
    ]
    common_env(env, 29501)
    assert "RANK" not in env and "WORLD_SIZE" not in env  # torchrun numbers the ranks
    assert env[OVERSUBSCRIBE] == "1"


@pytest.mark.parametrize("root", [True, False])
def test_mpirun_from_path(on_path: dict[str, str | None], monkeypatch: pytest.MonkeyPatch, root: bool) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0 if root else 1000)
    mpirun = launcher("mpirun", world_size=4)
    assert mpirun.unavailable() is None
    ((argv, env),) = mpirun.processes(POOL_ENV, 29502)
    assert argv == ["/opt/mpi/bin/mpirun", "-n", "4", *RANKMAIN]
    common_env(env, 29502)
    assert "RANK" not in env
    assert env[OVERSUBSCRIBE] == "1"
    assert {k: env.get(k) for k in AS_ROOT} == dict.fromkeys(AS_ROOT, "1" if root else None)


def test_a_users_open_mpi_settings_win(on_path: dict[str, str | None], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setenv(OVERSUBSCRIBE, "0")
    monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT", "0")
    ((_, env),) = launcher("mpirun").processes(POOL_ENV, 1)
    assert (env[OVERSUBSCRIBE], env["OMPI_ALLOW_RUN_AS_ROOT"]) == ("0", "0")


def test_srun_from_path(on_path: dict[str, str | None]) -> None:
    srun = launcher("srun", world_size=3)
    assert srun.unavailable() is None
    ((argv, env),) = srun.processes(POOL_ENV, 29503)
    assert argv == ["/usr/bin/srun", "--ntasks=3", "--nodes=1", "--kill-on-bad-exit=1", *RANKMAIN]
    common_env(env, 29503)
    assert env[OVERSUBSCRIBE] == "1"


def test_mpirun_and_srun_say_what_path_lacks(on_path: dict[str, str | None]) -> None:
    on_path.clear()
    assert launcher("mpirun").unavailable() == (
        "launcher 'mpirun' needs an MPI's mpirun on PATH (e.g. apt-get install openmpi-bin)"
    )
    assert launcher("srun").unavailable() == "launcher 'srun' needs SLURM's srun on PATH, inside an allocation"


def test_a_missing_launcher_fails_the_pool_before_it_takes_a_port(
    tmp_path: Path, on_path: dict[str, str | None]
) -> None:
    on_path.clear()
    calls: list[str] = []
    client = SimpleNamespace(ports=lambda *a: calls.append("ports"), acquire=lambda *a: calls.append("acquire"))
    spec = DistSpec(world_size=2, backend="mpi", gpus_per_rank=0, launcher="srun")
    pool = RankPool(spec, SimpleNamespace(client=client), DistSettings(), tmp_path, 60.0)  # type: ignore[arg-type]
    with pytest.raises(PoolError, match=r"^launcher 'srun' needs SLURM's srun on PATH, inside an allocation$"):
        pool.start([])
    assert calls == []


# -- the processes a launcher started ----------------------------------------------------------------


class Ended:
    """A started process that has ended with ``code``."""

    def __init__(self, code: int | None, pid: int = 4242) -> None:
        self.returncode, self.pid = code, pid

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        return self.returncode


def test_exit_text() -> None:
    assert exit_text(None) == "still running"
    assert exit_text(0) == "exit code 0"
    assert exit_text(3) == "exit code 3"
    assert exit_text(-signal.SIGKILL) == "killed by SIGKILL (exit -9)"
    assert exit_text(-999) == "killed by signal 999"


def test_which_process_ended() -> None:
    spawn, mpirun = launcher("spawn"), launcher("mpirun")
    spawn.procs = [Ended(None), Ended(1)]  # type: ignore[list-item]
    assert spawn.ended() == "a rank process ended: exit code 1"
    mpirun.procs = [Ended(-signal.SIGTERM)]  # type: ignore[list-item]
    assert mpirun.ended() == "mpirun ended: killed by SIGTERM (exit -15)"
    mpirun.procs = [Ended(None)]  # type: ignore[list-item]
    assert mpirun.ended() is None


def test_a_gone_rank_is_described_as_its_launcher_can() -> None:
    spawn = launcher("spawn")
    spawn.procs = [Ended(0), Ended(-signal.SIGSEGV)]  # type: ignore[list-item]
    assert spawn.exit_of(1, 77) == "killed by SIGSEGV (exit -11)"  # spawn sees its ranks' exit status
    assert spawn.exit_of(2, 78) == "pid 78 is gone (launched by spawn; exit status not visible)"
    for name in ("torchrun", "mpirun", "srun"):
        gone = launcher(name)
        gone.procs = [Ended(0)]  # type: ignore[list-item]
        assert gone.exit_of(0, 77) == f"pid 77 is gone (launched by {name}; exit status not visible)"


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# a process that says when it is up, and leaves a note when asked (SIGTERM) to end
SLEEPER = """
import signal, sys, time
def end(*_):
    open(sys.argv[1], "w").close()
    sys.exit(0)
signal.signal(signal.SIGTERM, end)
print("up", flush=True)
time.sleep(60)
"""


def sleeper(note: Path) -> list[str]:
    return [sys.executable, "-c", SLEEPER, str(note)]


def test_start_puts_every_process_in_one_new_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spawn = launcher("spawn", world_size=2)
    monkeypatch.setattr(spawn, "processes", lambda env, port: [(sleeper(tmp_path / "note"), dict(os.environ))] * 2)
    log = tmp_path / "launcher.log"
    spawn.start({}, 1, log)
    try:
        assert len(spawn.procs) == 2 and spawn.pgid == spawn.procs[0].pid != os.getpgrp()
        assert {os.getpgid(p.pid) for p in spawn.procs} == {spawn.pgid}
    finally:
        spawn.kill([])
    assert all(gone(p.pid) for p in spawn.procs)
    assert not (tmp_path / "note").exists()  # SIGKILLed, not asked


@pytest.mark.parametrize(("name", "asked"), [("srun", True), ("mpirun", False), ("torchrun", False)])
def test_srun_is_asked_to_end_before_it_is_killed(tmp_path: Path, name: str, asked: bool) -> None:
    # a SIGKILLed srun leaves its SLURM job running: srun gets SIGTERM (and time) first
    ending = launcher(name)
    note = tmp_path / "note"
    proc = subprocess.Popen(sleeper(note), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
    ending.procs = [proc]
    ending.kill([])
    assert gone(proc.pid)
    assert note.exists() == asked


def test_kill_takes_the_ranks_it_was_told_of(tmp_path: Path) -> None:
    # a rank a launcher program started, in a group of its own: the pool knows its pid only
    rank = subprocess.Popen(sleeper(tmp_path / "note"), stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        launcher("torchrun").kill([rank.pid])
        assert gone(rank.pid)
    finally:
        if not gone(rank.pid):
            rank.kill()
            rank.wait()
