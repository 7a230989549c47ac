"""Mesh names and their subjects: one token each, derived from the model, never shared."""

from __future__ import annotations

import pytest
from kvmesh.shared.config.service_config import ConfigError, config_from_args
from kvmesh.shared.config.subjects import DEFAULT_MESH, Subjects, check_mesh, mesh_from_model


def test_every_subject_of_a_mesh_lives_under_its_prefix() -> None:
    a, b = Subjects("mesh-a"), Subjects("mesh-b")
    names = [n for n in dir(Subjects) if n.isupper() and n != "PREFILL_STREAM"]
    for s in (a, b):
        for name in names:
            assert getattr(s, name).startswith(f"kvmesh.{s.mesh}.")
        assert s.decode_reserve("d0") == f"kvmesh.{s.mesh}.decode.d0.reserve"
        assert s.request_tokens("r1").startswith(s.request_events("r1"))
    assert {getattr(a, n) for n in names}.isdisjoint({getattr(b, n) for n in names})
    assert a.PREFILL_STREAM == "KVMESH_PREFILL_mesh-a" != b.PREFILL_STREAM


@pytest.mark.parametrize(
    ("model", "mesh"),
    [
        ("kvmesh-tiny", "kvmesh-tiny"),
        ("/models/Llama-3.1-8B-Instruct/", "Llama-3-1-8B-Instruct"),
        ("./ckpt/qwen2 0.5b", "qwen2-0-5b"),
        ("/", "kvmesh"),
    ],
)
def test_default_mesh_is_derived_from_the_model(model: str, mesh: str) -> None:
    assert mesh_from_model(model) == mesh
    check_mesh(mesh)


def test_builtin_models_mesh_is_the_default_mesh() -> None:
    from kvmesh.shared.model.loader import TINY_NAME

    assert mesh_from_model(TINY_NAME) == DEFAULT_MESH


@pytest.mark.parametrize("bad", ["", "a.b", "a b", "a*", "a>", "x" * 65, "mesh/1"])
def test_mesh_name_outside_subject_token_characters_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match=r"letters, digits, '-' and '_'"):
        check_mesh(bad)


def test_every_service_takes_mesh_from_flag_env_or_model() -> None:
    from kvmesh.services.decode.config import DecodeConfig
    from kvmesh.services.kv_registry.config import RegistryConfig
    from kvmesh.services.prefill.config import PrefillConfig
    from kvmesh.services.router.config import RouterConfig

    from kvmesh.commands.up_config import UpConfig
    from kvmesh.commands.up_model import DEFAULT_MODEL

    for cls in (RouterConfig, DecodeConfig, PrefillConfig, UpConfig):
        # a service's default model is kvmesh-tiny; kvmesh up's is the real one it fetches
        default_mesh = mesh_from_model(DEFAULT_MODEL) if cls is UpConfig else DEFAULT_MESH
        assert config_from_args(cls, None, {}).mesh == default_mesh
        assert config_from_args(cls, None, {"KVMESH_MODEL": "/m/phi-3"}).mesh == "phi-3"
        assert config_from_args(cls, None, {"KVMESH_MESH": "blue"}).mesh == "blue"
        with pytest.raises(ConfigError, match=r"mesh name 'a\.b' is not valid"):
            config_from_args(cls, None, {"KVMESH_MESH": "a.b"})
    assert config_from_args(RegistryConfig, None, {}).mesh == DEFAULT_MESH
    assert config_from_args(RegistryConfig, None, {"KVMESH_MESH": "blue"}).mesh == "blue"
