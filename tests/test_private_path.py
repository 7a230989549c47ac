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
    with pytest.raises(UntrustedPathError, match="writable by others"):
        check_ancestors(tmp_path / "cache" / "x.so")


def test_check_ancestors_accepts_a_sticky_shared_folder_above(tmp_path):
    os.chmod(tmp_path, 0o1777)  # /tmp: others may not rename or remove what is ours
    check_ancestors(tmp_path / "cache" / "x.so")


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
