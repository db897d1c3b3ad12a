"""Files in directories other users can write: nothing planted there redirects us (pytest_gpu.base.safefiles)."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from pytest_gpu.base.safefiles import (
    Unsafe,
    create_file,
    group_dir,
    locked,
    open_or_create,
    private_dir,
    read_bytes,
    replace_file,
    shared_dir,
)

STRANGER = 40001  # a uid no one uses: what another user's file is owned by


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file of ours, 0600, that a planted link points at."""
    path = tmp_path / "victim.txt"
    path.write_text("mine")
    path.chmod(0o600)
    return path


def _untouched(victim: Path) -> None:
    assert victim.read_text() == "mine"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600


def test_a_planted_link_is_never_followed_to_create_open_or_lock(tmp_path: Path, victim: Path) -> None:
    planted = tmp_path / "planted"
    planted.symlink_to(victim)
    with pytest.raises(FileExistsError):
        create_file(planted, 0o666)
    with pytest.raises(Unsafe, match="is a symbolic link"):
        open_or_create(planted, 0o666)
    with pytest.raises(Unsafe, match="is a symbolic link"):
        read_bytes(planted, 100)
    with pytest.raises(Unsafe, match="is a symbolic link"), locked(planted):
        pass
    _untouched(victim)


def test_a_file_is_replaced_whole_and_a_link_in_its_place_is_replaced_not_followed(
    tmp_path: Path, victim: Path
) -> None:
    target = tmp_path / "state"
    target.symlink_to(victim)
    replace_file(target, b"new", 0o640)
    assert not target.is_symlink() and target.read_bytes() == b"new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    _untouched(victim)


def test_replace_uses_names_no_one_can_foresee(tmp_path: Path, victim: Path) -> None:
    # the old ledger wrote "<name>.<pid>.tmp": a name another user could plant first
    for name in (f"state.{os.getpid()}.tmp", f".state.{os.getpid()}.tmp"):
        (tmp_path / name).symlink_to(victim)
    replace_file(tmp_path / "state", b"x", 0o600)
    _untouched(victim)


def test_a_fifo_planted_where_a_file_belongs_does_not_block(tmp_path: Path) -> None:
    fifo = tmp_path / "ledger.json"
    os.mkfifo(fifo)
    done = threading.Event()

    def read() -> None:
        with pytest.raises(Unsafe, match="not a regular file"):
            read_bytes(fifo, 100)
        done.set()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(5)
    assert done.is_set(), "opening a planted FIFO blocked"


def test_modes_are_exact_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o000)
    try:
        fd = create_file(tmp_path / "f", 0o600)
        os.close(fd)
        private_dir(tmp_path / "private")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "f").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "private").stat().st_mode) == 0o700


def test_a_private_dir_refuses_a_link_or_another_users_directory(tmp_path: Path, victim: Path) -> None:
    (tmp_path / "link").symlink_to(tmp_path)
    with pytest.raises(Unsafe, match="symbolic link"):
        private_dir(tmp_path / "link")
    if os.geteuid() != 0:
        pytest.skip("needs root to make a directory of another user")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    theirs.chmod(0o777)
    os.chown(theirs, STRANGER, STRANGER)
    with pytest.raises(Unsafe, match=f"belongs to another user, uid {STRANGER}"):
        private_dir(theirs)
    assert stat.S_IMODE(theirs.stat().st_mode) == 0o777  # refused, not changed


def test_a_shared_dir_of_another_user_must_be_sticky(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to make a directory of another user")
    theirs = tmp_path / "open"
    theirs.mkdir()
    theirs.chmod(0o777)  # world-writable but not sticky: its users could remove each other's files
    os.chown(theirs, STRANGER, STRANGER)
    with pytest.raises(Unsafe, match="is not sticky and world-writable"):
        shared_dir(theirs)
    theirs.chmod(0o1777)
    assert shared_dir(theirs) == theirs


def test_a_group_dir_is_the_groups_alone(tmp_path: Path) -> None:
    gid = os.getegid()
    made = group_dir(tmp_path / "g", gid)
    info = made.stat()
    assert (info.st_gid, stat.S_IMODE(info.st_mode)) == (gid, 0o2770)
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o2777)
    if os.geteuid() == 0:
        os.chown(loose, STRANGER, gid)  # another member's, open to everyone: not the group's alone
        with pytest.raises(Unsafe, match="expected 2770"):
            group_dir(loose, gid)


def test_another_users_lock_file_is_locked_read_only_and_never_written(tmp_path: Path) -> None:
    path = tmp_path / "lock"
    path.write_text("theirs")
    path.chmod(0o444)
    with locked(path):
        assert path.read_text() == "theirs"
    with pytest.raises(Unsafe, match="belongs to"), locked(path, owner=STRANGER):
        pass
