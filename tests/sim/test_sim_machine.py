"""A simulated machine is a machine: every process naming it shares its GPUs' memory.

``PYTEST_GPU_SIM_MACHINE`` names it (default: a run's own, one per run and spec, gone with the
run; outside any run, one per user and spec); its ledger lives in
the machine directory, where every user's processes can write it; a machine in use keeps
its spec; the foreign holder ``python -m pytest_gpu.sim hold`` puts memory on it from
outside any run.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import filelock  # noqa: F401 - imported before a fork that drops privileges (the child cannot read site-packages)
import pytest

from conftest import Holder
from helpers import patience, user_dir
from pytest_gpu import sim
from pytest_gpu.machine import domain
from pytest_gpu.machine.domain import Domain
from pytest_gpu.sim import LEDGER_ENV, OVERHEAD_ENV, SPEC_ENV, TAG_ENV, Ledger, OutOfMemoryError, SimMachineError

MiB, GiB = 2**20, 2**30
SPEC = "sim:2x4GiB"
DEFAULT_OVERHEAD = sim.DEFAULT_OVERHEAD


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh simulated machine name, and an environment that names no ledger of its own."""
    name = f"m-{uuid.uuid4().hex[:10]}"
    monkeypatch.setenv(domain.SIM_MACHINE_ENV, name)
    for var in (LEDGER_ENV, SPEC_ENV, OVERHEAD_ENV, TAG_ENV, "PYTEST_GPU_FAKE_GPUS", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    return name


def _state(path: Path) -> dict:
    return json.loads((path / "ledger.json").read_text())


# -- where the machine's ledger lives ------------------------------------------------------


def test_machine_ledger_lives_in_the_named_machines_directory(machine: str, private_machines: Path) -> None:
    led = sim.machine_ledger(SPEC, 256 * MiB)
    assert led.path == Domain.sim(SPEC).ledger_path == user_dir(private_machines) / f"sim-{machine}" / "sim-ledger"
    assert sim.machine_ledger_dir(SPEC) == led.path
    assert (led.spec, led.overhead) == (SPEC, 256 * MiB)
    assert (led.path / "nvml.state").read_text().count("\ngpu ") == 2  # rendered for the fake NVML
    assert list(_state(led.path)["users"]) == [str(os.getpid())]  # this process uses it


def test_default_machine_is_one_per_user_and_spec(monkeypatch: pytest.MonkeyPatch, private_machines: Path) -> None:
    monkeypatch.delenv(domain.SIM_MACHINE_ENV, raising=False)
    user = pwd.getpwuid(os.getuid()).pw_name
    one, two = sim.machine_ledger("sim:1x1GiB"), sim.machine_ledger("sim:2x1GiB")
    assert one.path == user_dir(private_machines) / f"sim-{user}-sim_1x1GiB" / "sim-ledger"
    assert two.path == user_dir(private_machines) / f"sim-{user}-sim_2x1GiB" / "sim-ledger"


def test_processes_naming_one_machine_share_its_memory(
    machine: str, hold: Callable[..., Holder], monkeypatch: pytest.MonkeyPatch
) -> None:
    holder = hold("--spec", SPEC, "--gpu", "1", "--memory", "3GiB")
    led = sim.machine_ledger(SPEC)
    assert led.used() == {0: 0, 1: 3 * GiB + DEFAULT_OVERHEAD}
    with pytest.raises(OutOfMemoryError, match=f"pid {holder.pid}: 3GiB"):
        led.allocate(GiB, 1, None, None)
    led.allocate(GiB, 0, None, None)  # the other GPU is free
    monkeypatch.setenv(domain.SIM_MACHINE_ENV, f"{machine}-other")
    assert sim.machine_ledger(SPEC).used() == {0: 0, 1: 0}  # another machine, other GPUs


def test_a_run_uses_the_simulated_machine_it_names(
    gpu_pytester: pytest.Pytester,
    run_inner: Callable[..., pytest.RunResult],
    hold: Callable[..., Holder],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The run's processes allocate on the machine another process already uses."""
    name = f"m-{uuid.uuid4().hex[:10]}"
    monkeypatch.setenv(domain.SIM_MACHINE_ENV, name)
    holder = hold("--spec", "sim:1x16GiB", "--gpu", "0", "--memory", "12GiB")
    expected = str(Domain.sim("sim:1x16GiB").ledger_path)
    gpu_pytester.makepyfile(
        test_shared=f"""
        import os
        import pytest
        from pytest_gpu import sim

        def test_the_gpu_is_shared():
            assert os.environ["PYTEST_GPU_SIM_LEDGER"] == {expected!r}
            with pytest.raises(sim.OutOfMemoryError, match="pid {holder.pid}: 12GiB"):
                sim.allocate("8GiB", device=0)
        """
    )
    run_inner("--gpus", "sim:1x16GiB").assert_outcomes(passed=1)


def test_a_run_on_a_machine_in_use_with_another_spec_is_a_usage_error(
    gpu_pytester: pytest.Pytester,
    run_inner: Callable[..., pytest.RunResult],
    hold: Callable[..., Holder],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    name = f"ci-{uuid.uuid4().hex[:10]}"
    monkeypatch.setenv(domain.SIM_MACHINE_ENV, name)
    holder = hold("--spec", SPEC, "--gpu", "0", "--memory", "1GiB")
    gpu_pytester.makepyfile("def test_a():\n    pass\n")
    runs = Path(tempfile.gettempdir()) / f"pytest-gpu-{os.getuid()}"
    before = set(runs.glob(f"run-{os.getpid()}-*"))  # an earlier in-process test may have left one
    result = run_inner("--gpus", "sim:1x16GiB")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            f"ERROR: pytest-gpu: PYTEST_GPU_SIM_MACHINE={name} is {SPEC}; this run asked for sim:1x16GiB. "
            f"The machine is in use (pid {holder.pid}*); ask for {SPEC}, *"
        ]
    )
    assert set(runs.glob(f"run-{os.getpid()}-*")) <= before  # the run made its directory, and removed it
    assert os.environ.get(LEDGER_ENV) is None


def test_an_in_process_run_that_ends_frees_what_it_held_on_the_machine(
    gpu_pytester: pytest.Pytester, run_inner: Callable[..., pytest.RunResult], machine: str
) -> None:
    """For the machine it names, a run that ends in this process is a process that exits."""
    gpu_pytester.makepyfile(
        test_ctx="""
        import pytest
        from pytest_gpu import sim

        @pytest.mark.gpu(memory="1GiB")
        def test_opens_a_context(gpu):
            sim.allocate("256MiB").free()
            assert sim.cuda.contexts() == {gpu.indices[0]}
        """
    )
    run_inner("--gpus", "sim:1x16GiB").assert_outcomes(passed=1)
    path = Domain.sim("sim:1x16GiB").ledger_path
    assert str(os.getpid()) not in _state(path)["procs"]
    assert str(os.getpid()) not in _state(path)["users"]
    run_inner("--gpus", "sim:1x16GiB", "--gpu-context-overhead", "1GiB").assert_outcomes(passed=1)  # idle: retuned


# -- a run's own machine ------------------------------------------------------------------

# Run A's test holds 12 GiB of the one simulated GPU until a file appears; run B's test asks
# for 8 GiB meanwhile: on one machine it is out of memory, on two it is not.
HOLDER = """
import os, time
from pathlib import Path
from pytest_gpu import sim

def test_holds():
    block = sim.allocate("12GiB", device=0)
    Path(os.environ["HELD"]).write_text(os.environ["PYTEST_GPU_SIM_LEDGER"])
    deadline = time.monotonic() + 120
    while not Path(os.environ["DONE"]).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    block.free()
"""
ASKER = """
import os
from pathlib import Path
from pytest_gpu import sim

def test_asks():
    try:
        sim.allocate("8GiB", device=0).free()
        Path(os.environ["OUTCOME"]).write_text("allocated")
    except sim.OutOfMemoryError as exc:
        Path(os.environ["OUTCOME"]).write_text(f"oom: {exc}")
"""


def _two_runs(gpu_pytester: pytest.Pytester, tmp_path: Path, named: str | None) -> tuple[str, str, str]:
    """Run A (a subprocess) holding memory while run B (another subprocess) asks for some;
    returns B's outcome and the two runs' ledger directories."""
    gpu_pytester.makepyfile(test_holder=HOLDER, test_asker=ASKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST_", "PYTEST_ADDOPTS"))}
    if named:
        env[domain.SIM_MACHINE_ENV] = named
    files = {name: tmp_path / name for name in ("held", "done", "outcome", "ledger_b")}
    env.update(HELD=str(files["held"]), DONE=str(files["done"]), OUTCOME=str(files["outcome"]))
    base = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--gpus", "sim:1x16GiB"]
    a = subprocess.Popen(
        [*base, "test_holder.py"],
        cwd=gpu_pytester.path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + patience(120)
        while not files["held"].exists():
            assert a.poll() is None and time.monotonic() < deadline, (
                a.communicate()[0] if a.poll() is not None else "timeout"
            )
            time.sleep(0.05)
        b_code = "import os, sys, pytest; sys.exit(pytest.main(sys.argv[1:]))"
        b = subprocess.run(
            [sys.executable, "-c", b_code, *base[3:], "test_asker.py"],
            cwd=gpu_pytester.path,
            env=env,
            capture_output=True,
            text=True,
            timeout=patience(120),
        )
        assert b.returncode == 0, b.stdout + b.stderr
    finally:
        files["done"].write_text("")
        out = a.communicate(timeout=patience(120))[0]
    assert a.returncode == 0, out
    return files["outcome"].read_text(), files["held"].read_text(), out


def test_two_runs_that_name_no_machine_have_one_each(
    gpu_pytester: pytest.Pytester, tmp_path: Path, private_machines: Path
) -> None:
    outcome, ledger_a, _ = _two_runs(gpu_pytester, tmp_path, named=None)
    assert outcome == "allocated"  # A's 12 GiB are on another machine
    root = user_dir(private_machines)
    assert Path(ledger_a).is_relative_to(root) and Path(ledger_a).relative_to(root).parts[0].startswith("run-")
    assert not [p.name for p in root.iterdir() if p.name.startswith("run-")]  # both gone with their runs


def test_two_runs_that_name_one_machine_share_it(
    gpu_pytester: pytest.Pytester, tmp_path: Path, private_machines: Path
) -> None:
    outcome, ledger_a, _ = _two_runs(gpu_pytester, tmp_path, named=f"ci-{uuid.uuid4().hex[:8]}")
    assert outcome.startswith("oom: ") and "12GiB" in outcome, outcome
    assert Path(ledger_a).exists()  # a named machine outlives its runs, as a machine does


def test_a_runs_workers_share_its_own_machine(
    gpu_pytester: pytest.Pytester, run_inner: Callable[..., pytest.RunResult], tmp_path: Path, private_machines: Path
) -> None:
    gpu_pytester.makepyfile(
        test_where=f"""
        import os
        import pytest
        from pathlib import Path

        @pytest.mark.parametrize("i", range(4))
        def test_where(i):
            out = Path({str(tmp_path)!r}) / f"{{os.getpid()}}-{{i}}"
            out.write_text(os.environ["PYTEST_GPU_SIM_LEDGER"] + " " + os.environ["PYTEST_GPU_SIM_RUN"])
        """
    )
    run_inner("-n", "2", "--gpus", "sim:1x16GiB", "-p", "xdist", subprocess=True).assert_outcomes(passed=4)
    seen = {p.read_text() for p in tmp_path.iterdir() if "-" in p.name}
    pids = {p.name.split("-")[0] for p in tmp_path.iterdir() if "-" in p.name}
    assert len(seen) == 1 and len(pids) == 2, (seen, pids)  # two workers, one machine
    ledger, run = seen.pop().split()
    assert run.startswith("run-") and f"/{run}/" in ledger
    assert not Path(ledger).exists()  # gone with the run


def test_a_killed_runs_own_machine_is_removed_by_the_next_run(private_machines: Path) -> None:
    code = (
        "import os, sys; from pytest_gpu import sim; from pytest_gpu.machine import domain; "
        "name = domain.claim_run_machines(); sim.machine_ledger('sim:1x1GiB').allocate(2**20, 0, None, None); "
        "print(name, flush=True); sys.stdin.read()"
    )
    env = {k: v for k, v in os.environ.items() if k not in (domain.SIM_MACHINE_ENV, domain.SIM_RUN_ENV)}
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout is not None
    name = proc.stdout.readline().strip()
    run = user_dir(private_machines) / name
    assert (run / "sim-sim_1x1GiB" / "sim-ledger" / "ledger.json").exists()
    assert domain.sweep_run_machines() == []  # its owner lives
    proc.kill()
    proc.wait()
    mine = domain.claim_run_machines()  # the next run: sweeps first
    try:
        assert mine is not None and not run.exists()
    finally:
        assert mine is not None
        domain.release_run_machines(mine)
    assert not (user_dir(private_machines) / mine).exists()
    assert os.environ.get(domain.SIM_RUN_ENV) is None


def test_a_named_machine_or_a_runs_own_process_claims_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(domain.SIM_RUN_ENV, "run-1-abcd")  # a worker, rank or subprocess of that run
    assert domain.claim_run_machines() is None
    assert domain.sim_machine_name(SPEC) == "run-1-abcd-sim_2x4GiB"
    monkeypatch.setenv(domain.SIM_MACHINE_ENV, "ci")
    assert domain.claim_run_machines() is None
    assert domain.sim_machine_name(SPEC) == "ci"


# -- one spec while in use ---------------------------------------------------------------


def test_a_machine_in_use_keeps_its_spec(machine: str, hold: Callable[..., Holder]) -> None:
    holder = hold("--spec", SPEC, "--gpu", "1", "--memory", "1GiB")
    with pytest.raises(SimMachineError) as caught:
        sim.machine_ledger("sim:1x8GiB")
    assert str(caught.value).startswith(
        f"pytest-gpu: {domain.SIM_MACHINE_ENV}={machine} is {SPEC}; this run asked for sim:1x8GiB. "
        f"The machine is in use (pid {holder.pid}); ask for {SPEC}, wait until it is idle, or name another "
        f"simulated machine with {domain.SIM_MACHINE_ENV}"
    )
    assert isinstance(caught.value, ValueError)  # a usage error for the plugin's fake-GPU switch


def test_an_idle_machine_takes_the_spec_asked_for(machine: str, hold: Callable[..., Holder]) -> None:
    hold("--spec", SPEC, "--gpu", "1", "--memory", "1GiB").kill()
    led = sim.machine_ledger("sim:1x8GiB")
    assert led.spec == "sim:1x8GiB"
    assert led.used() == {0: 0}


@pytest.mark.slow
def test_a_live_user_without_memory_keeps_the_machine(machine: str) -> None:
    user = subprocess.Popen(
        [sys.executable, "-c", f"from pytest_gpu import sim; sim.machine_ledger({SPEC!r}); print('in'); input()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert user.stdout is not None and user.stdout.readline() == "in\n"
        with pytest.raises(SimMachineError, match=f"in use \\(pid {user.pid}\\)"):
            sim.machine_ledger("sim:1x8GiB")
    finally:
        user.communicate("\n", timeout=patience(30))
    assert sim.machine_ledger("sim:1x8GiB").spec == "sim:1x8GiB"  # it exited: the machine is idle


def test_equivalent_specs_are_the_same_machine(machine: str, hold: Callable[..., Holder]) -> None:
    hold("--spec", "2x4GiB", "--gpu", "0", "--memory", "1GiB")  # "sim:" or not: one machine
    led = sim.machine_ledger(SPEC)
    assert led.spec == "2x4GiB"
    assert led.used()[0] == GiB + DEFAULT_OVERHEAD


def test_an_idle_ledger_is_not_reset_for_the_same_spec_written_otherwise(tmp_path: Path) -> None:
    Ledger.create(tmp_path, SPEC, 0).begin_tag("t", os.getpid())
    assert Ledger(tmp_path, "2x4GiB").used() == {0: 0, 1: 0}
    assert "t" in _state(tmp_path)["tags"]  # not replaced by a fresh ledger


def test_a_machine_in_use_keeps_its_context_size(machine: str, hold: Callable[..., Holder]) -> None:
    holder = hold("--spec", SPEC, "--gpu", "1", "--memory", "1GiB")
    with pytest.raises(SimMachineError) as caught:
        sim.machine_ledger(SPEC, 256 * MiB)
    assert "simulates CUDA contexts of 500MiB; this run asked for 256MiB (--gpu-context-overhead)" in str(caught.value)
    assert f"(pid {holder.pid})" in str(caught.value)
    assert sim.machine_ledger(SPEC).overhead == DEFAULT_OVERHEAD  # no size asked for: the machine's


# -- every user -----------------------------------------------------------------------------


def test_the_ledger_is_this_users_alone_whatever_the_umask(machine: str) -> None:
    old = os.umask(0o000)
    try:
        led = sim.machine_ledger(SPEC)
        led.allocate(GiB, 0, None, None)
    finally:
        os.umask(old)
    assert stat.S_IMODE(led.path.stat().st_mode) == 0o700
    assert stat.S_IMODE(led.path.parent.stat().st_mode) == 0o700
    for name in ("ledger.json", "nvml.state", "ledger.lock"):
        assert stat.S_IMODE((led.path / name).stat().st_mode) == 0o600, name
    assert not [p.name for p in led.path.iterdir() if p.name.endswith(".tmp")]  # no temporary file left


def _as_user(uid: int, body: Callable[[], None], groups: tuple[int, ...] = ()) -> None:
    """Run ``body`` in a forked child that is user ``uid`` (umask 077, in ``groups``); raise what it raised."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            os.close(read)
            os.setgroups(list(groups))
            os.setgid(uid)
            os.setuid(uid)
            os.umask(0o077)
            body()
        except BaseException as exc:
            os.write(write, f"{type(exc).__name__}: {exc}".encode()[:4000])
            code = 1
        os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        message = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    assert status == 0, message


@pytest.fixture
def shared_root(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A machine directory other users' processes can reach (pytest's tmp_path is root's, 0700)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run processes as other users (two-user test)")
    base = Path(tempfile.mkdtemp(prefix="pytest-gpu-users-", dir="/tmp"))
    base.chmod(0o755)
    (base / "machines").mkdir(mode=0o1777)
    (base / "machines").chmod(0o1777)  # as an administrator makes it (root's: no user can take names from others)
    monkeypatch.setenv(domain.ROOT_ENV, str(base / "machines"))
    yield base / "machines"
    shutil.rmtree(base, ignore_errors=True)


def test_another_user_can_neither_read_nor_write_a_users_machine(shared_root: Path, machine: str) -> None:
    first, second = 40001, 40002

    def creates() -> None:
        sim.machine_ledger(SPEC).allocate(GiB, 1, None, None)

    def pries() -> None:  # another user naming the same machine gets a machine of its own
        mine = sim.machine_ledger(SPEC)
        assert mine.used() == {0: 0, 1: 0}, mine.used()
        theirs = shared_root / f"user-{first}" / f"sim-{machine}" / "sim-ledger"
        for path in (theirs / "ledger.json", theirs.parent):
            try:
                path.stat()
            except PermissionError:
                continue
            raise AssertionError(f"{path} is reachable by another user")

    _as_user(first, creates)
    _as_user(second, pries)
    assert stat.S_IMODE((shared_root / f"user-{first}").stat().st_mode) == 0o700


def test_a_machine_shared_with_a_group_is_the_members_and_no_one_elses(
    shared_root: Path, machine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second, stranger, group = 40001, 40002, 40003, 40010
    monkeypatch.setenv(domain.SIM_GROUP_ENV, str(group))

    def creates() -> None:  # makes the machine, holds memory, exits without freeing
        sim.machine_ledger(SPEC).allocate(GiB, 1, None, None)

    def uses() -> None:  # another member: reads it, prunes the dead, replaces the files, allocates
        led = sim.machine_ledger(SPEC)
        assert led.used() == {0: 0, 1: 0}, led.used()
        led.allocate(3 * GiB, 1, None, None)

    def refused() -> None:  # not a member: a clear error, nothing touched
        with pytest.raises(SimMachineError, match=f"PYTEST_GPU_SIM_GROUP={group}: this user .* is not in that group"):
            sim.machine_ledger(SPEC)
        with pytest.raises(PermissionError):
            (shared_root / f"sim-{machine}" / "sim-ledger" / "ledger.json").stat()

    _as_user(first, creates, groups=(group,))
    path = Domain.sim(SPEC).ledger_path
    assert path == shared_root / f"sim-{machine}" / "sim-ledger"
    assert (path.stat().st_gid, stat.S_IMODE(path.stat().st_mode)) == (group, 0o2770)
    _as_user(second, uses, groups=(group,))
    assert (path / "ledger.json").stat().st_uid == second  # replaced by the second member
    assert stat.S_IMODE((path / "ledger.json").stat().st_mode) == 0o660
    _as_user(stranger, refused)


# -- what dead processes leave --------------------------------------------------------------


def test_the_tags_of_a_dead_owner_are_forgotten(tmp_path: Path) -> None:
    led = Ledger.create(tmp_path, SPEC, 0)
    owner = subprocess.Popen([sys.executable, "-c", "input()"], stdin=subprocess.PIPE)
    try:
        led.begin_tag("dead-run", owner.pid)
        led.begin_tag("live-run", os.getpid())
    finally:
        owner.communicate(b"\n", timeout=patience(30))
    led.used()  # any look at the ledger prunes
    assert set(_state(tmp_path)["tags"]) == {"live-run"}


# -- the fake-GPU switch --------------------------------------------------------------------


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST_", "PYTEST_ADDOPTS"))}
    return {**env, **extra}


def _fake_ledger(env: dict[str, str]) -> str:
    code = "import os; from pytest_gpu.sim import fake; fake.activate(); print(os.environ['PYTEST_GPU_SIM_LEDGER'])"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=patience(120))
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.slow
def test_fake_gpus_use_the_machine_ledger(machine: str, hold: Callable[..., Holder], tmp_path: Path) -> None:
    env = _clean_env(PYTEST_GPU_FAKE_GPUS=SPEC)
    assert _fake_ledger(env) == str(Domain.sim(SPEC).ledger_path)
    assert _fake_ledger({**env, LEDGER_ENV: str(tmp_path / "own")}) == str(tmp_path / "own")  # as told
    hold("--spec", "sim:1x8GiB", "--gpu", "0", "--memory", "1GiB")  # now another spec in use
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--co", "-q", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=patience(120),
    )
    assert done.returncode == pytest.ExitCode.USAGE_ERROR
    assert f"PYTEST_GPU_FAKE_GPUS: pytest-gpu: {domain.SIM_MACHINE_ENV}={machine} is sim:1x8GiB" in done.stderr


# -- python -m pytest_gpu.sim hold -------------------------------------------------------------


def _hold(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest_gpu.sim", "hold", *args], capture_output=True, text=True, timeout=patience(60)
    )


@pytest.mark.slow
def test_hold_for_some_seconds_then_frees(machine: str) -> None:
    done = _hold("--spec", SPEC, "--gpu", "1", "--memory", "1GiB", "--seconds", "0.1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("holding ") and done.stdout.split()[2:] == ["GPU", "1", "1GiB"]
    assert sim.machine_ledger(SPEC).used() == {0: 0, 1: 0}


def test_hold_names_the_machine_with_an_option(
    machine: str, hold: Callable[..., Holder], monkeypatch: pytest.MonkeyPatch
) -> None:
    holder = hold("--machine", "elsewhere", "--spec", SPEC, "--gpu", "0", "--memory", "1GiB")
    assert sim.machine_ledger(SPEC).used()[0] == 0
    monkeypatch.setenv(domain.SIM_MACHINE_ENV, "elsewhere")
    assert sim.machine_ledger(SPEC).contexts_of(holder.pid) == {0}


def test_hold_takes_a_named_machines_own_spec(machine: str, hold: Callable[..., Holder]) -> None:
    sim.machine_ledger("sim:3x2GiB")
    holder = hold("--gpu", "2", "--memory", "1GiB")  # no spec anywhere: the machine's
    assert sim.machine_ledger("sim:3x2GiB").contexts_of(holder.pid) == {2}


@pytest.mark.slow
def test_hold_says_what_went_wrong(machine: str, hold: Callable[..., Holder]) -> None:
    bad = _hold("--spec", "sim:4xlots", "--gpu", "0", "--memory", "1GiB")
    assert bad.returncode == 2
    assert "hold: 'sim:4xlots': bad size" in bad.stderr
    assert not (Domain.sim(SPEC).ledger_path / "ledger.json").exists()  # nothing written for it
    missing = _hold("--spec", SPEC, "--gpu", "2", "--memory", "1GiB")
    assert missing.returncode == 2
    assert "no usable GPU 2 (its units: [0, 1])" in missing.stderr
    full = _hold("--spec", SPEC, "--gpu", "0", "--memory", "4GiB")
    assert full.returncode == 1
    assert "Simulated CUDA out of memory on GPU 0" in full.stderr
    hold("--spec", SPEC, "--gpu", "0", "--memory", "1GiB")
    other = _hold("--spec", "sim:1x8GiB", "--gpu", "0", "--memory", "1GiB")
    assert other.returncode == 2
    assert f"{domain.SIM_MACHINE_ENV}={machine} is {SPEC}; this run asked for sim:1x8GiB" in other.stderr
