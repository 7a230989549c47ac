"""``--disk-path`` must be a directory of the store's own user that nobody else may write to,
opened without following a symlink (issue 27, item 7): another user renamed the file during
preallocation in a shared directory and the store crashed, leaving a 1 GiB file, and a symlink
to a directory was followed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from kvmesh.services.kv_store.disk_file import DiskFile, check_disk_dir
from kvmesh.shared.config.service_errors import ServiceStartError


def _own_dir(tmp_path: Path, name: str, mode: int = 0o700) -> Path:
    d = tmp_path / name
    d.mkdir()
    d.chmod(mode)
    return d


def test_a_private_directory_of_this_user_is_taken(tmp_path: Path) -> None:
    d = _own_dir(tmp_path, "tier")
    assert check_disk_dir(str(d)) == d
    disk = DiskFile.create(d, 2, 4096)
    try:
        assert list(d.iterdir()) == []  # unlinked: nothing to rename, nothing left behind
    finally:
        disk.close()


def test_a_symlink_to_a_directory_is_refused(tmp_path: Path) -> None:
    target = _own_dir(tmp_path, "real")
    link = tmp_path / "link"
    link.symlink_to(target, target_is_directory=True)
    with pytest.raises(ServiceStartError, match="a symlink"):
        check_disk_dir(str(link))
    with pytest.raises(ServiceStartError, match="a symlink"):
        DiskFile.create(link, 2, 4096)
    assert list(target.iterdir()) == []


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770, 0o722])
def test_a_directory_others_may_write_to_is_refused(tmp_path: Path, mode: int) -> None:
    d = _own_dir(tmp_path, "shared", mode)
    with pytest.raises(ServiceStartError, match="writable by other users"):
        check_disk_dir(str(d))
    with pytest.raises(ServiceStartError, match="chmod go-w"):
        DiskFile.create(d, 2, 4096)
    assert list(d.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory away needs root")
def test_a_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    d = _own_dir(tmp_path, "theirs")
    os.chown(d, 65534, 65534)  # nobody
    with pytest.raises(ServiceStartError, match="not by this user"):
        check_disk_dir(str(d))


def test_a_directory_made_shared_after_the_check_is_refused_at_creation(tmp_path: Path) -> None:
    """The file is created in the directory the second check opened, not in a path looked up
    again: a directory opened to others between the two is caught."""
    d = _own_dir(tmp_path, "tier")
    checked = check_disk_dir(str(d))
    d.chmod(0o777)
    with pytest.raises(ServiceStartError, match="writable by other users"):
        DiskFile.create(checked, 2, 4096)
