"""kvmesh up's state file (shared/bus/mesh_state.py) is written only into a folder of this user's
and never through a link another user planted (issue 40, low)."""

import os

import pytest
from kvmesh.shared.bus.mesh_state import MeshState, running_meshes, write_state
from kvmesh.shared.config.private_path import UntrustedPathError


def _state() -> MeshState:
    return MeshState(mesh="m", nats_url="nats://127.0.0.1:4222", pid=os.getpid(), router_url="")


def test_state_is_written_and_found_again(monkeypatch, tmp_path):
    monkeypatch.setenv("KVMESH_STATE_DIR", str(tmp_path / "run"))
    path = write_state(_state())
    assert path.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "run").stat().st_mode & 0o777 == 0o700
    assert [m.mesh for m in running_meshes()] == ["m"]


def test_state_is_never_written_through_a_planted_link(monkeypatch, tmp_path):
    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)
    monkeypatch.setenv("KVMESH_STATE_DIR", str(folder))
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    state = _state()
    # the old writer opened <record>.tmp with O_TRUNC, following a link there
    (folder / state.path_name).with_suffix(".tmp").symlink_to(victim)
    (folder / state.path_name).symlink_to(victim)
    path = write_state(state)
    assert victim.read_text() == "keep me"
    assert not path.is_symlink() and path.read_text().startswith("{")


def test_state_folder_others_can_write_is_refused(monkeypatch, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # anyone could swap the folder below it
    monkeypatch.setenv("KVMESH_STATE_DIR", str(shared / "run"))
    with pytest.raises(UntrustedPathError, match="writable by other users"):
        write_state(_state())
