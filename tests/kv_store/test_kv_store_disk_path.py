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


@pytest.mark.parametrize("mode", [0o770, 0o777, 0o720])
def test_a_directory_under_a_parent_others_may_write_to_is_refused(
    tmp_path: Path, mode: int
) -> None:
    """Issue 40: only the last component was checked. A parent others may write to lets them
    rename the store's directory away and put their own in its place (sshd's StrictModes
    refuses the same)."""
    parent = _own_dir(tmp_path, "parent", mode)
    d = _own_dir(parent, "tier")
    with pytest.raises(ServiceStartError, match=f"{parent} above it is writable by other"):
        check_disk_dir(str(d))
    with pytest.raises(ServiceStartError, match="chmod go-w"):
        DiskFile.create(d, 2, 4096)
    assert list(d.iterdir()) == []


def test_a_directory_reached_through_a_symlinked_parent_is_checked_where_it_lives(
    tmp_path: Path,
) -> None:
    """A symlink above the directory is resolved first; the real directories are checked."""
    real = _own_dir(tmp_path, "real", 0o770)
    d = _own_dir(real, "tier")
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    with pytest.raises(ServiceStartError, match=f"{real} above it is writable by other"):
        check_disk_dir(str(link / "tier"))
    real.chmod(0o700)
    assert check_disk_dir(str(link / "tier")) == link / "tier"
    assert d.is_dir()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory away needs root")
def test_a_directory_under_a_parent_of_another_user_is_refused(tmp_path: Path) -> None:
    parent = _own_dir(tmp_path, "theirs", 0o755)
    d = _own_dir(parent, "tier")
    os.chown(parent, 65534, 65534)  # nobody
    with pytest.raises(ServiceStartError, match="owned by uid 65534"):
        check_disk_dir(str(d))


def test_a_directory_under_roots_sticky_tmp_is_taken(tmp_path: Path) -> None:
    """Root's sticky directories (mode 1777, as /tmp) are exempt: others may not rename what
    is not theirs in them."""
    tmp = os.stat("/tmp")
    if not (
        tmp.st_uid == 0 and tmp.st_mode & 0o1022 == 0o1022 and str(tmp_path).startswith("/tmp/")
    ):
        pytest.skip("tmp_path is not under root's sticky, world-writable /tmp here")
    d = _own_dir(tmp_path, "tier")
    assert check_disk_dir(str(d)) == d
