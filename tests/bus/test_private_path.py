"""shared/config/private_path.py and the kernel cache that uses it (issue 40, high #2): a folder
or a library another local user can change is never used, and a planted library never runs."""

import ctypes
import os
import shutil
import subprocess

import pytest
from kvmesh.kernels import cpu_ops
from kvmesh.shared.config.private_path import (
    UntrustedPathError,
    check_ancestors,
    open_parent,
    private_dir,
    trusted_file,
)

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")


def test_private_dir_makes_a_0700_folder_when_missing(tmp_path):
    folder = private_dir(tmp_path / "cache")
    assert folder.is_dir() and (folder.stat().st_mode & 0o777) == 0o700


def test_private_dir_tightens_a_loose_folder_of_our_own(tmp_path):
    (tmp_path / "cache").mkdir(mode=0o755)
    os.chmod(tmp_path / "cache", 0o777)
    private_dir(tmp_path / "cache")
    assert (tmp_path / "cache").stat().st_mode & 0o777 == 0o700


def test_private_dir_refuses_a_link_to_a_folder(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "cache").symlink_to(tmp_path / "real")
    with pytest.raises(UntrustedPathError, match="not a folder"):
        private_dir(tmp_path / "cache")


@as_root
def test_private_dir_refuses_a_folder_of_another_user(tmp_path):
    (tmp_path / "cache").mkdir(mode=0o700)
    os.chown(tmp_path / "cache", NOBODY, NOBODY)
    with pytest.raises(UntrustedPathError, match="owned by"):
        private_dir(tmp_path / "cache")


def test_check_ancestors_refuses_a_folder_others_can_write_above(tmp_path):
    os.chmod(tmp_path, 0o777)  # anyone could rename our folder away and put theirs in its place
    with pytest.raises(UntrustedPathError, match="writable by other users"):
        check_ancestors(tmp_path / "cache" / "x.so")


@as_root
def test_check_ancestors_accepts_a_sticky_shared_folder_above_only_if_roots(tmp_path):
    os.chmod(tmp_path, 0o1777)  # root's, as /tmp: others may not rename or remove what is ours
    check_ancestors(tmp_path / "cache" / "x.so")
    os.chown(tmp_path, NOBODY, NOBODY)  # sticky, but its owner may rename anything in it
    with pytest.raises(UntrustedPathError, match="owned by uid 65534"):
        check_ancestors(tmp_path / "cache" / "x.so")


def test_one_walk_for_every_caller_links_followed_only_when_trusted(tmp_path):
    """check_ancestors (the kernel cache, kvmesh up's state) and the kv-store's --disk-path
    share open_parent's walk: a link on the way is walked where it points, and the refusal is
    the same words for both."""
    from kvmesh.services.kv_store.disk_file import check_disk_dir
    from kvmesh.shared.config.service_errors import ServiceStartError

    real = tmp_path / "real"
    (real / "tier").mkdir(parents=True, mode=0o700)
    os.chmod(real, 0o770)
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    why = f"{real} above it is writable by other users"
    with pytest.raises(UntrustedPathError, match=why):
        check_ancestors(tmp_path / "link" / "tier" / "x.so")
    with pytest.raises(ServiceStartError, match=why):
        check_disk_dir(str(tmp_path / "link" / "tier"))
    os.chmod(real, 0o700)
    check_ancestors(tmp_path / "link" / "tier" / "x.so")
    fd, name = open_parent(tmp_path / "link" / "tier")
    try:
        assert name == "tier" and os.path.samestat(os.fstat(fd), os.stat(real))
    finally:
        os.close(fd)


@as_root
def test_check_ancestors_refuses_a_folder_of_another_user_above(tmp_path):
    (tmp_path / "theirs").mkdir(mode=0o755)
    os.chown(tmp_path / "theirs", NOBODY, NOBODY)
    with pytest.raises(UntrustedPathError, match="owned by"):
        check_ancestors(tmp_path / "theirs" / "cache")


def test_trusted_file_is_false_for_a_missing_file(tmp_path):
    assert trusted_file(tmp_path / "x.so") is False


def test_trusted_file_refuses_a_file_others_can_write(tmp_path):
    (tmp_path / "x.so").write_bytes(b"")
    os.chmod(tmp_path / "x.so", 0o664)
    with pytest.raises(UntrustedPathError, match="writable by others"):
        trusted_file(tmp_path / "x.so")


def test_trusted_file_refuses_a_link(tmp_path):
    (tmp_path / "real.so").write_bytes(b"")
    (tmp_path / "x.so").symlink_to(tmp_path / "real.so")
    with pytest.raises(UntrustedPathError, match="not a regular file"):
        trusted_file(tmp_path / "x.so")


@as_root
def test_trusted_file_refuses_a_file_of_another_user(tmp_path):
    (tmp_path / "x.so").write_bytes(b"")
    os.chown(tmp_path / "x.so", NOBODY, NOBODY)
    with pytest.raises(UntrustedPathError, match="owned by"):
        trusted_file(tmp_path / "x.so")


@pytest.fixture(scope="module")
def built_library():
    ops = cpu_ops.load_cpu_ops()
    assert ops is not None, "gcc is part of the test machine; the C kernels must build"
    return ops.path


def _plant(path, marker):
    """A shared library whose constructor writes ``marker``: what an attacker would plant."""
    source = path.with_suffix(".c")
    source.write_text(
        "#include <stdio.h>\n__attribute__((constructor)) static void pwn(void) {"
        f' FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n'
    )
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(path), str(source)], check=True)
    source.unlink()


@as_root
def test_build_never_loads_a_library_another_user_planted_in_the_cache(
    monkeypatch, tmp_path, built_library
):
    name = built_library.name  # the key an attacker computes from the sources and /proc/cpuinfo
    marker = tmp_path / "ran"
    planted = tmp_path / "kvmesh-cache-0"  # the attacker's folder, where ours would be
    planted.mkdir(mode=0o755)
    _plant(planted / name, marker)
    os.chown(planted / name, NOBODY, NOBODY)
    os.chown(planted, NOBODY, NOBODY)
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(planted))
    ours = tmp_path / "ours"  # the next folder holds this machine's real build (no compiling)
    ours.mkdir(mode=0o700)
    shutil.copy(built_library, ours / name)
    monkeypatch.setattr(cpu_ops, "_temp_cache_dir", lambda: ours)
    path = cpu_ops.build()
    assert path == ours / name
    ctypes.CDLL(str(path))
    assert not marker.exists()


def test_build_uses_a_fresh_private_folder_when_no_cache_folder_is_trusted(
    monkeypatch, tmp_path, built_library
):
    name = built_library.name
    marker = tmp_path / "ran"
    for folder in ("home-cache", "tmp-cache"):
        (tmp_path / folder).mkdir(mode=0o755)
        _plant(tmp_path / folder / name, marker)
        os.chmod(tmp_path / folder / name, 0o666)  # ours, but anyone could have rewritten it
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "home-cache"))
    monkeypatch.setattr(cpu_ops, "_temp_cache_dir", lambda: tmp_path / "tmp-cache")
    fresh = tmp_path / "fresh"
    fresh.mkdir(mode=0o700)
    shutil.copy(built_library, fresh / name)
    monkeypatch.setattr(cpu_ops, "fresh_private_dir", lambda prefix: fresh)
    path = cpu_ops.build()
    assert path == fresh / name
    ctypes.CDLL(str(path))
    assert not marker.exists()
