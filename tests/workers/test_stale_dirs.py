"""Folders and files named for their process, swept once that process is gone
(shared/config/stale_dirs.py)."""

from __future__ import annotations

import os
import subprocess

import pytest
from kvmesh.shared.bus.nats_server import NatsServer
from kvmesh.shared.config.stale_dirs import (
    make_owned_dir,
    owner_is_dead,
    sweep_dead_owner_files,
    sweep_dead_owners,
)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])  # its pid is free once it has exited
    proc.wait()
    return proc.pid


def test_only_a_dead_owners_folders_are_swept(tmp_path):
    dead = _dead_pid()
    assert owner_is_dead(str(dead)) and not owner_is_dead(str(os.getpid()))
    names = [f"x-{dead}-a", f"x-{os.getpid()}-b", "x-notapid-c", f"y-{dead}-d", f"x-{dead}"]
    for name in names:
        (tmp_path / name).mkdir()
    (tmp_path / f"x-{dead}-file").write_text("a file, not a folder")
    assert sweep_dead_owners(str(tmp_path), "x-") == [f"x-{dead}-a"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*names[1:], f"x-{dead}-file"])


def test_only_a_dead_owners_files_are_swept(tmp_path):
    dead = _dead_pid()
    names = [f"x-{dead}-a", f"x-{os.getpid()}-b", "x-notapid-c", f"y-{dead}-d", f"x-{dead}"]
    for name in names:
        (tmp_path / name).write_text("a segment")
    (tmp_path / f"x-{dead}-folder").mkdir()
    (tmp_path / f"x-{dead}-link").symlink_to(tmp_path / names[1])
    assert sweep_dead_owner_files(str(tmp_path), "x-") == [f"x-{dead}-a"]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([*names[1:], f"x-{dead}-folder", f"x-{dead}-link"])


def test_another_users_entries_are_kept(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to give a file and a folder to another user")
    dead = _dead_pid()
    (tmp_path / f"x-{dead}-file").write_text("")
    (tmp_path / f"x-{dead}-dir").mkdir()
    for name in (f"x-{dead}-file", f"x-{dead}-dir"):
        os.chown(tmp_path / name, 65534, 65534)
    assert sweep_dead_owner_files(str(tmp_path), "x-") == []
    assert sweep_dead_owners(str(tmp_path), "x-") == []
    assert len(list(tmp_path.iterdir())) == 2


def test_a_folder_holding_unexpected_names_is_kept(tmp_path):
    dead = _dead_pid()
    (tmp_path / f"x-{dead}-a").mkdir()
    (tmp_path / f"x-{dead}-a" / "sock").write_text("")
    (tmp_path / f"x-{dead}-b").mkdir()
    (tmp_path / f"x-{dead}-b" / "other").write_text("")
    assert sweep_dead_owners(str(tmp_path), "x-", only=frozenset({"sock"})) == [f"x-{dead}-a"]


def test_a_new_folder_carries_this_pid_and_sweeps_first(tmp_path):
    stale = tmp_path / f"x-{_dead_pid()}-a"
    stale.mkdir()
    made = make_owned_dir("x-", str(tmp_path))
    assert os.path.basename(made).startswith(f"x-{os.getpid()}-")
    assert oct(os.stat(made).st_mode & 0o777) == "0o700"
    assert not stale.exists()


def test_a_nats_servers_folder_is_its_owners_and_goes_when_it_stops():
    with NatsServer() as server:
        folder = server.state_dir
        assert folder.name.startswith(f"kvmesh-nats-{os.getpid()}-")
        assert (folder / "nats-server.log").exists()
    assert not folder.exists()
