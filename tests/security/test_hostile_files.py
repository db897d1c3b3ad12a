"""Two users on one machine, B attacking A's files (issue 30, items 3, 7, 9, 10): directories by
descriptor, not by path; libraries only of A's own; pictures written without following links.

B is a real second user (the fixtures of test_hostile_neighbours.py make both, and tests/neighbour.py
is B's tool). Where B must own the machine directory, B is made its owner, as whoever first makes
``/tmp/pytest-gpu-machines`` is.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from test_hostile_neighbours import SPEC, Machine, _go, _passed, _wait_ready, machine, users  # noqa: F401  (fixtures)

from helpers import patience, wait_for
from pytest_gpu.base.safefiles import Unsafe, group_dir
from pytest_gpu.machine import domain
from pytest_gpu.report import gantt
from pytest_gpu.run import rundir
from pytest_gpu.sim import nvml
from pytest_gpu.sim.ledger import Ledger, LedgerWriteError

STRANGER = 40001  # a uid no one uses: another user's, where a test as root makes one


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Machine:
    """test_hostile_neighbours.py's ``machine``: A, B and a machine directory (root's, 1777)."""
    found: Machine = request.getfixturevalue("machine")
    return found


def _owned_by(tree: Path, uid: int) -> list[Path]:
    found = []
    for path, dirs, files in os.walk(tree):
        for name in [*dirs, *files]:
            entry = Path(path) / name
            if entry.lstat().st_uid == uid:
                found.append(entry)
    return found


def _warnings(text: str) -> list[str]:
    return [line for line in text.splitlines() if "pytest-gpu: warning" in line]


# -- item 3: A's private directory redirected mid-run ----------------------------------------------


@pytest.mark.slow
def test_a_private_directory_swapped_mid_run_redirects_nothing(pair: Machine) -> None:
    a, b = pair.a, pair.b
    os.chown(pair.machines, b.uid, b.gid)  # B made the machine directory first: B may rename in it
    env = a.env(pair.machines)  # the run's own simulated machine, in A's private root
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--gpus", SPEC, "--timeout", "90"]
    run = a.popen(command, env)
    try:
        _wait_ready(pair, run)
        mine = pair.machines / f"user-{a.uid}"
        (machine_dir,) = [p for p in mine.glob("run-*/sim-*") if p.is_dir()]  # as root: A's run's own machine
        attack = pair.hold("swap_private", str(pair.machines), str(a.uid), str(machine_dir.relative_to(mine)))
        try:
            trap = pair.machines / f"trap-{a.uid}"
            forged = (trap / machine_dir.relative_to(mine) / "sim-ledger" / "ledger.json").read_bytes()
            assert mine.is_symlink()
            started = time.monotonic()
            result = _go(pair, run)  # B holds the ledger's lock and says the GPUs are full
            took = time.monotonic() - started
        finally:
            attack.kill()
            attack.wait()
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    text = result.stdout + result.stderr
    _passed(result)  # no wait on B's lock, no OOM from B's ledger, no malformed records
    assert took < 60, f"A's run took {took:.0f}s after B's swap"
    assert (trap / "b-sentinel").exists() and (trap / machine_dir.relative_to(mine) / "b-sentinel").exists()
    assert (trap / machine_dir.relative_to(mine) / "sim-ledger" / "ledger.json").read_bytes() == forged
    assert _owned_by(trap, a.uid) == []  # A created nothing in B's tree
    aside = pair.machines / f"aside-{a.uid}"
    assert not list(aside.glob("run-*")), "A's own run directory stays behind"  # removed through its descriptor
    said = [line for line in _warnings(text) if str(machine_dir.parents[1]) in line or "sim-ledger" in line]
    assert said, text  # A says what it saw
    assert len(said) == len(set(said)), said
    assert all("\n" not in line for line in said)


# -- item 10: A's run opens up its own private directory -----------------------------------------------


@pytest.mark.slow
def test_a_private_directory_renamed_to_a_group_machine_is_not_opened_up(pair: Machine) -> None:
    a, b = pair.a, pair.b
    os.chown(pair.machines, b.uid, b.gid)
    made = a.popen(
        [sys.executable, "-c", "from pytest_gpu.machine.domain import private_root; print(private_root())"],
        a.env(pair.machines),
    )
    _, err = made.communicate(timeout=patience(60))
    assert made.returncode == 0, err
    private = pair.machines / f"user-{a.uid}"
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    pair.attack("rename", str(pair.machines), private.name, "sim-shared")
    renamed = pair.machines / "sim-shared"
    go = a.home / "go"
    go.write_text("go")
    os.chown(go, a.uid, a.gid)
    result = pair.run_a("--timeout", "60")
    info = renamed.stat()
    assert stat.S_IMODE(info.st_mode) == 0o700, f"A's private directory was opened up: {oct(info.st_mode)}"
    assert info.st_uid == a.uid
    _passed(result)  # on a machine of A's own, saying why
    said = [line for line in _warnings(result.stdout + result.stderr) if str(renamed) in line]
    assert len(said) == 1, result.stdout + result.stderr


# -- item 7: another user's code runs as A ------------------------------------------------------------

NVML_SUITE = """
import pynvml

def test_nvml_sees_the_fake_machine():
    pynvml.nvmlInit()
    assert pynvml.nvmlDeviceGetCount() == 2
"""


@pytest.mark.slow
def test_a_library_planted_in_a_world_writable_cache_is_never_loaded(pair: Machine) -> None:
    a = pair.a
    cache = a.home.parent / f"cache-{a.uid}"  # A's cache, world-writable (HOME=/tmp, say)
    cache.mkdir(exist_ok=True)
    os.chown(cache, a.uid, a.gid)
    cache.chmod(0o777)
    marks = a.home.parent / "marks"
    marks.mkdir(exist_ok=True)
    marks.chmod(0o1777)
    marker = marks / f"loaded-by-{a.uid}"
    marker.unlink(missing_ok=True)
    if subprocess.run(["which", "cc"], capture_output=True).returncode:
        pytest.skip("missing component: cc (the fake NVML is built with it)")
    library = pair.attack("plant_library", str(cache), str(marker))
    assert Path(library).exists()
    temp = a.home / "tmp"
    temp.mkdir(exist_ok=True)
    os.chown(temp, a.uid, a.gid)
    suite = a.home / "test_nvml.py"
    suite.write_text(NVML_SUITE)
    os.chown(suite, a.uid, a.gid)
    env = a.env(pair.machines, XDG_CACHE_HOME=str(cache), TMPDIR=str(temp), PYTEST_GPU_FAKE_GPUS="sim:2x16GiB")
    proc = a.popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(suite)], env)
    out, err = proc.communicate(timeout=patience(120))
    assert not marker.exists(), "B's library ran as A"
    assert proc.returncode == 0, out + err
    assert "1 passed" in out, out + err
    built = list((temp / f"pytest-gpu-{a.uid}" / "fake-nvml").glob("*/libnvidia-ml.so.1"))
    assert built and all(p.stat().st_uid == a.uid for p in built)  # A's own, in A's private temporary directory


# -- item 9: `pytest-gpu report` in a shared directory --------------------------------------------------

TRACE = '{"traceEvents": [], "otherData": {"pytest_gpu": {}}}'


def _report(on: Machine, *args: str) -> subprocess.CompletedProcess[str]:
    proc = on.a.popen([sys.executable, "-m", "pytest_gpu.cli", "report", *args], on.a.env(on.machines))
    out, err = proc.communicate(timeout=patience(120))
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.slow
def test_report_never_follows_a_link_planted_where_its_picture_goes(pair: Machine) -> None:
    pytest.importorskip("matplotlib")
    a = pair.a
    shared = a.home.parent / "shared-reports"
    shared.mkdir(exist_ok=True)
    shared.chmod(0o1777)
    trace = shared / f"trace-{a.uid}.json"
    trace.write_text(TRACE)
    os.chown(trace, a.uid, a.gid)
    before = pair.victims()
    picture = trace.with_suffix(".png")
    picture.unlink(missing_ok=True)
    pair.attack("plant_link", str(picture), str(a.home / "victim.txt"))
    result = _report(pair, str(trace))
    assert pair.victims() == before  # A's file neither written nor changed
    assert picture.is_symlink()  # B's link is B's: A cannot replace it in a sticky directory
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"pytest-gpu report: cannot write {picture}")
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_report_refuses_a_deeply_nested_trace_in_one_line(pair: Machine) -> None:
    a = pair.a
    for depth in (200_000, 20):
        trace = a.home / f"deep-{depth}.json"
        trace.write_text("[" * depth + "]" * depth)
        os.chown(trace, a.uid, a.gid)
        result = _report(pair, str(trace))
        assert result.returncode == 2
        expected = "nested deeper than 12 levels; expected a trace written by pytest --gpu-trace"
        assert result.stderr == f"pytest-gpu report: {trace}: {expected}\n"


@pytest.mark.slow
def test_the_picture_replaces_a_file_of_its_own_user(pair: Machine) -> None:
    pytest.importorskip("matplotlib")
    a = pair.a
    trace = a.home / "trace.json"
    trace.write_text(TRACE)
    picture = a.home / "trace.png"
    picture.write_text("an old picture")
    for path in (trace, picture):
        os.chown(path, a.uid, a.gid)
    result = _report(pair, str(trace))
    assert result.returncode == 0, result.stderr
    assert picture.read_bytes().startswith(b"\x89PNG") and picture.stat().st_uid == a.uid
    wait_for(lambda: not list(a.home.glob(".trace.png.*")), timeout=5, what="no temporary picture left")


# -- the same points through the code's own seams (one process; fast) ------------------------------

GiB = 2**30


def _swap(directory: Path, owner: int | None = None) -> Path:
    """What the owner of ``directory``'s parent can do: move it aside, and put another directory
    (``owner``'s, where a test as root can make one) in its place; returns where it went."""
    aside = directory.with_name(directory.name + "-aside")
    directory.rename(aside)
    directory.mkdir()
    if owner is not None:
        os.chown(directory, owner, -1)
    return aside


def test_a_ledger_keeps_to_its_own_directory_once_its_name_leads_elsewhere(tmp_path: Path) -> None:
    led = Ledger.create(tmp_path / "machine" / "sim-ledger", "sim:2x16GiB", 0)
    led.allocate(GiB, 0, None, None)
    aside = _swap(tmp_path / "machine")
    forged = tmp_path / "machine" / "sim-ledger"
    forged.mkdir()
    (forged / "ledger.json").write_text("{}")
    led.allocate(GiB, 1, None, None)  # neither the forged ledger nor a new one: its own
    assert led.used() == {0: GiB, 1: GiB}  # both allocations, in its own ledger (contexts of 0 bytes)
    assert sorted(p.name for p in forged.iterdir()) == ["ledger.json"] and (forged / "ledger.json").read_text() == "{}"
    assert json.loads((aside / "sim-ledger" / "ledger.json").read_text())["procs"]
    said = [line for line in domain.said if str(forged) in line]
    assert len(said) == 1 and "leads to a directory of" in said[0], domain.said


def test_a_ledger_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to make a directory of another user")
    theirs = tmp_path / "sim-ledger"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, STRANGER, STRANGER)
    with pytest.raises(LedgerWriteError, match=r"belongs to (uid )?40001"):
        Ledger(theirs, "sim:2x16GiB").used()
    assert list(theirs.iterdir()) == []  # no lock, no ledger made there


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("not json", "is not JSON"),
        ("[]", "is not a JSON object"),
        (
            '{"spec": "sim:2x16GiB", "overhead": 0, "tags": {}, "procs": {"1": {"ctime": null, "ctx": {}, '
            '"allocs": {"1:1": ["0", 5, null]}, "seq": 1}}}',
            "has a malformed record procs['1'].allocs",
        ),
        (
            '{"spec": "sim:2x16GiB", "overhead": 0, "tags": {}, "procs": {"1": {"ctime": null, "ctx": {"7": null}, '
            '"allocs": {}, "seq": 1}}}',
            "has a malformed record procs['1'].ctx",
        ),
        ('{"spec": "sim:2x16GiB", "overhead": -1, "tags": {}, "procs": {}}', "has no context size"),
        (
            '{"spec": "sim:2x16GiB", "overhead": 0, "procs": {}, "tags": {"t": {"owner": 1, "peak": {}, '
            '"touched": [9]}}}',
            "has a malformed record tags['t'].touched",
        ),
    ],
)
def test_a_malformed_ledger_is_a_clear_error_naming_its_file(tmp_path: Path, content: str, problem: str) -> None:
    led = Ledger.create(tmp_path, "sim:2x16GiB", 0)
    (tmp_path / "ledger.json").write_text(content)
    with pytest.raises(LedgerWriteError) as info:
        led.allocate(GiB, 0, None, None)
    assert f"{tmp_path / 'ledger.json'} {problem}" in str(info.value)
    assert (tmp_path / "ledger.json").read_text() == content  # not overwritten


def test_a_run_keeps_to_its_private_root_through_its_descriptor_once_renamed() -> None:
    run = domain.claim_run_machines()
    assert run is not None
    try:
        root = domain.private_root()
        assert (root / run).is_dir()
        trap = root.with_name("trap")
        (trap / run).mkdir(parents=True)
        (trap / run / "b-sentinel").write_text("B's")
        aside = root.with_name(root.name + "-aside")
        root.rename(aside)
        root.symlink_to(trap)
        lock = Path(domain.Domain.private("sim-x").lock_path)
        assert lock.parent.resolve() == (aside / "sim-x").resolve()  # made in its own, not through the link
        warned = [line for line in domain.said if str(root) in line and "symbolic link" in line]
        assert len(warned) == 1, domain.said
    finally:
        domain.release_run_machines(run)
    assert (trap / run / "b-sentinel").exists()  # the other tree is left alone
    assert not (aside / run).exists()  # its own went, through the descriptor
    os.environ.pop(domain.SIM_RUN_ENV, None)


def test_an_existing_private_directory_is_never_opened_up_as_a_groups(tmp_path: Path) -> None:
    private = tmp_path / "sim-shared"
    private.mkdir(mode=0o700)
    (private / "mine").write_text("A's")
    with pytest.raises(Unsafe, match="left as it is"):
        group_dir(private, os.getegid())
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    made = group_dir(tmp_path / "fresh", os.getegid())  # one it makes is the group's
    assert stat.S_IMODE(made.stat().st_mode) == 0o2770


def test_a_world_writable_cache_is_passed_over_and_a_library_others_can_write_never_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o777)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    built = nvml.library_dir()
    assert built.parent == temp / f"pytest-gpu-{os.getuid()}" / "fake-nvml"
    assert not (cache / "pytest-gpu").exists()
    library = built / nvml.LIBRARY
    library.chmod(0o775)  # group-writable: someone else could have put it there
    with pytest.raises(RuntimeError, match="can be written by other users"):
        nvml.load_library(library)


def test_a_cache_that_is_the_users_own_link_is_followed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = tmp_path / "disk" / "cache"
    real.mkdir(parents=True)
    link = tmp_path / "cache"
    link.symlink_to(real)
    monkeypatch.setenv("XDG_CACHE_HOME", str(link))
    assert nvml.library_dir().parent == real / "pytest-gpu" / "fake-nvml"


def test_a_report_replaces_a_link_where_its_picture_goes_and_refuses_deep_traces(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    picture = tmp_path / "trace.png"
    picture.symlink_to(victim)
    chart = gantt.build_chart(json.loads(TRACE))
    gantt.render(chart, picture, "png")
    assert victim.read_text() == "mine" and not picture.is_symlink()
    deep = tmp_path / "deep.json"
    for depth in (13, 100_000):
        deep.write_text("[" * depth + "]" * depth)
        with pytest.raises(gantt.TraceError, match="nested deeper than 12 levels"):
            gantt.load_trace(deep)


def test_a_run_directory_put_in_place_of_the_one_made_is_not_removed(capsys: pytest.CaptureFixture[str]) -> None:
    run = rundir.create()
    aside = _swap(run)
    (run / "b-sentinel").write_text("B's")
    rundir.remove(run)
    assert (run / "b-sentinel").exists()
    assert f"{run} is not the run directory this run made; left as it is" in capsys.readouterr().err
    shutil.rmtree(run)
    shutil.rmtree(aside)
