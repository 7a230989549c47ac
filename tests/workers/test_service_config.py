from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import Literal

import pytest
from kvmesh.shared.config.service_config import (
    DEFAULT_NATS_URL,
    ConfigError,
    add_config_arguments,
    config_from_args,
    config_to_argv,
    known_env_keys,
    option,
    unknown_env_keys,
)


@dataclass(frozen=True)
class DemoConfig:
    nats_url: str = DEFAULT_NATS_URL
    num_blocks: int = 64
    heartbeat_s: float = 1.0
    is_verbose: bool = False
    mode: Literal["disagg", "colocated"] = "disagg"
    transport: str = option("auto", help="kv transport", choices=("auto", "shm", "tcp"))
    max_tokens: int | None = None
    ports: tuple[int, ...] = (1, 2)

    def __post_init__(self) -> None:
        if self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {self.num_blocks}")


def parse(argv: list[str], env: dict[str, str] | None = None) -> DemoConfig:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, DemoConfig)
    return config_from_args(DemoConfig, parser.parse_args(argv), env or {})


def test_defaults_apply_without_flags_or_env() -> None:
    assert parse([]) == DemoConfig()


def test_flag_beats_env_beats_default() -> None:
    env = {"KVMESH_NUM_BLOCKS": "10", "KVMESH_HEARTBEAT_S": "0.5"}
    config = parse(["--num-blocks", "20"], env)
    assert config.num_blocks == 20  # flag wins
    assert config.heartbeat_s == 0.5  # env over default


def test_types_are_converted_from_strings() -> None:
    env = {
        "KVMESH_IS_VERBOSE": "yes",
        "KVMESH_MODE": "colocated",
        "KVMESH_MAX_TOKENS": "7",
        "KVMESH_PORTS": "5, 6,7",
        "KVMESH_NATS_URL": "nats://nats:4222",
    }
    config = parse([], env)
    assert config.is_verbose is True
    assert config.mode == "colocated"
    assert config.max_tokens == 7
    assert config.ports == (5, 6, 7)
    assert config.nats_url == "nats://nats:4222"


def test_bool_flag_negation_overrides_env() -> None:
    assert parse(["--no-is-verbose"], {"KVMESH_IS_VERBOSE": "1"}).is_verbose is False
    assert parse(["--is-verbose"]).is_verbose is True


def test_optional_accepts_none() -> None:
    assert parse(["--max-tokens", "none"], {"KVMESH_MAX_TOKENS": "3"}).max_tokens is None


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"KVMESH_NUM_BLOCKS": "many"}, "KVMESH_NUM_BLOCKS='many': expected int"),
        ({"KVMESH_IS_VERBOSE": "maybe"}, "expected a boolean"),
        ({"KVMESH_MODE": "split"}, "expected one of disagg, colocated"),
        ({"KVMESH_TRANSPORT": "carrier-pigeon"}, "expected one of auto, shm, tcp"),
        ({"KVMESH_NUM_BLOCKS": "0"}, "DemoConfig: num_blocks must be > 0"),
    ],
)
def test_bad_values_raise_config_error_naming_the_source(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        parse([], env)


def test_bad_flag_value_names_the_flag() -> None:
    with pytest.raises(ConfigError, match="--heartbeat-s='fast'"):
        parse(["--heartbeat-s", "fast"])


def test_known_and_unknown_env_keys() -> None:
    keys = known_env_keys(DemoConfig)
    assert "KVMESH_NATS_URL" in keys and "KVMESH_PORTS" in keys and len(keys) == 8
    env = {"KVMESH_NUM_BLOCKS": "1", "KVMESH_NUM_BLOKS": "2", "PATH": "/bin"}
    assert unknown_env_keys(DemoConfig, env) == ["KVMESH_NUM_BLOKS"]


def test_config_to_argv_round_trips() -> None:
    config = DemoConfig(num_blocks=3, is_verbose=True, mode="colocated", max_tokens=9, ports=(8,))
    assert parse(config_to_argv(config)) == config


def test_overrides_win_over_flags() -> None:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, DemoConfig, exclude=("mode",))
    args = parser.parse_args([])
    assert config_from_args(DemoConfig, args, {"KVMESH_MODE": "disagg"}, mode="colocated").mode == (
        "colocated"
    )


# --- `kvmesh serve`: the contract with services/<name> ----------------------------------------


def test_serve_builds_a_service_config_from_flags_and_env() -> None:
    from kvmesh.commands.serve import build_service_config

    env = {"KVMESH_HEARTBEAT_S": "0.5", "KVMESH_LOG_FORMAT": "json"}
    spec, config, log_config = build_service_config(
        "kv-registry", ["--nats-url", "nats://nats:4222", "--missed-heartbeats", "5"], env
    )
    assert spec.module.__name__ == "kvmesh.services.kv_registry"
    assert (config.nats_url, config.heartbeat_s, config.missed_heartbeats) == (
        "nats://nats:4222",
        0.5,
        5,
    )
    assert (log_config.log_level, log_config.log_format) == ("info", "json")


def test_serve_colocated_is_decode_with_mode_forced() -> None:
    from kvmesh.commands.serve import build_service_config, service_env_keys

    spec, config, _ = build_service_config("colocated", [], {"KVMESH_MODE": "disagg"})
    assert spec.module.__name__ == "kvmesh.services.decode" and config.mode == "colocated"
    assert "KVMESH_MODE" not in service_env_keys("colocated")
    with pytest.raises(SystemExit):  # --mode is not a flag of `serve colocated`
        build_service_config("colocated", ["--mode", "disagg"], {})


def test_serve_reports_a_missing_service_module_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvmesh.commands import serve

    monkeypatch.setitem(serve.SERVICES, "draft", ("kvmesh.services.draft_not_built", {}))
    with pytest.raises(serve.ServiceNotAvailableError, match="does not exist in this checkout"):
        serve.load_service("draft")
    with pytest.raises(serve.ServiceNotAvailableError, match="unknown service 'nope'"):
        serve.load_service("nope")


def test_every_service_config_follows_the_contract() -> None:
    from kvmesh.commands.serve import SERVICES, load_service

    for name in SERVICES:
        spec = load_service(name)
        keys = known_env_keys(spec.config_cls)
        assert {"KVMESH_NATS_URL", "KVMESH_WORKER_ID"} <= keys, name
        assert spec.config_cls().nats_url == DEFAULT_NATS_URL  # every field has a default


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"KVMESH_NATS_URL": "http://x:1"}, "nats_url must look like"),
        ({"KVMESH_WORKER_ID": "a.b"}, "NATS subject token"),
        ({"KVMESH_HEARTBEAT_S": "0"}, "heartbeat_s must be positive"),
        ({"KVMESH_BLOCK_SIZE": "0"}, "block_size must be positive"),
        ({"KVMESH_NUM_BLOCKS": "8", "KVMESH_KV_CACHE_BYTES": "9"}, "not both"),
        ({"KVMESH_KV_CACHE_BYTES": "-1"}, "kv_cache_bytes must be positive"),
        ({"KVMESH_THREADS": "0"}, "threads must be >= 1"),
        ({"KVMESH_DRAIN_TIMEOUT_S": "0"}, "drain_timeout_s must be positive"),
        ({"KVMESH_DEVICE": "cuda", "KVMESH_TRANSPORT": "shm"}, "--transport rdma"),
    ],
)
def test_prefill_and_decode_refuse_a_shared_field_alike(env: dict[str, str], needle: str) -> None:
    from kvmesh.services.decode.config import DecodeConfig
    from kvmesh.services.prefill.config import PrefillConfig

    for cls in (PrefillConfig, DecodeConfig):
        with pytest.raises(ConfigError, match=needle):
            config_from_args(cls, None, env)


def test_every_service_refuses_a_bad_worker_id_heartbeat_and_nats_url() -> None:
    from kvmesh.commands.serve import SERVICES, load_service

    for name in SERVICES:
        cls = load_service(name).config_cls
        for env, needle in (
            ({"KVMESH_NATS_URL": "http://x:1"}, "nats_url must look like"),
            ({"KVMESH_WORKER_ID": "a b"}, "NATS subject token"),
            ({"KVMESH_HEARTBEAT_S": "-1"}, "heartbeat_s must be positive"),
        ):
            with pytest.raises(ConfigError, match=needle):
                config_from_args(cls, None, env)


def test_prefill_drain_timeout_comes_from_its_flag() -> None:
    from kvmesh.services.prefill.config import PrefillConfig

    parser = argparse.ArgumentParser()
    add_config_arguments(parser, PrefillConfig)
    config = config_from_args(PrefillConfig, parser.parse_args(["--drain-timeout-s", "2.5"]), {})
    assert config.drain_timeout_s == 2.5
    assert PrefillConfig().drain_timeout_s == 10.0  # what prefill hard-coded before the flag


def test_colocated_decode_takes_any_transport_on_a_device() -> None:
    from kvmesh.services.decode.config import DecodeConfig

    env = {"KVMESH_DEVICE": "cuda", "KVMESH_TRANSPORT": "tcp", "KVMESH_MODE": "colocated"}
    assert config_from_args(DecodeConfig, None, env).role == "colocated"  # no data plane


def test_every_service_reads_the_nats_credentials() -> None:
    """They are how it logs in to NATS (shared/bus/nats_auth.py): never "ignored" at start."""
    from kvmesh.shared.bus.nats_auth import PASSWORD_ENV, PASSWORD_FILE_ENV, USER_ENV

    from kvmesh.commands.serve import SERVICES, service_env_keys

    for name in SERVICES:
        assert {USER_ENV, PASSWORD_ENV, PASSWORD_FILE_ENV} <= service_env_keys(name), name


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"KVMESH_MODEL": ""}, "model must name a model or a checkpoint directory"),
        ({"KVMESH_BLOCK_SIZE": "0"}, "block_size must be positive"),
        ({"KVMESH_NUM_BLOCKS": "-3"}, "num_blocks must be positive, got -3"),
        ({"KVMESH_ADVERTISE_HOST": "0.0.0.0"}, "advertise"),
    ],
)
def test_engine_workers_and_kv_stores_refuse_a_bad_kv_layout_alike(
    env: dict[str, str], needle: str
) -> None:
    from kvmesh.services.decode.config import DecodeConfig
    from kvmesh.services.draft.config import DraftConfig
    from kvmesh.services.kv_store.config import StoreConfig
    from kvmesh.services.prefill.config import PrefillConfig

    for cls in (PrefillConfig, DecodeConfig, DraftConfig, StoreConfig):
        with pytest.raises(ConfigError, match=needle):
            config_from_args(cls, None, env)


def test_a_kv_store_and_a_worker_of_one_model_join_its_mesh() -> None:
    from kvmesh.services.kv_store.config import StoreConfig
    from kvmesh.services.prefill.config import PrefillConfig

    env = {"KVMESH_MODEL": "/models/Qwen2.5-0.5B"}
    store = config_from_args(StoreConfig, None, env)
    assert store.mesh == config_from_args(PrefillConfig, None, env).mesh != "kvmesh-tiny"


def test_flag_choices_are_what_the_engine_transports_and_logs_accept() -> None:
    import typing

    from kvmesh.shared.config.worker_config import KvCacheDtype, TransportChoice
    from kvmesh.shared.engine.config import KV_CACHE_DTYPES
    from kvmesh.shared.obs.logs import LogLevelName
    from kvmesh.shared.transport.auto import BACKENDS

    assert typing.get_args(KvCacheDtype) == KV_CACHE_DTYPES
    assert set(typing.get_args(TransportChoice)) == {"auto", *BACKENDS}
    assert all(
        logging.getLevelName(name.upper()) != f"Level {name.upper()}"
        for name in typing.get_args(LogLevelName)
    )


@dataclass(frozen=True)
class Bounds:
    timeout_s: float = 1.0
    workers: int | None = None


@pytest.mark.parametrize(
    ("bounds", "needle"),
    [
        (Bounds(timeout_s=0.0), "timeout_s must be positive, got 0.0"),
        (Bounds(timeout_s=float("nan")), "timeout_s must be positive, got nan"),
        (Bounds(workers=0), "workers must be >= 1, got 0"),
    ],
)
def test_bound_checks_name_the_field_and_its_value(bounds: Bounds, needle: str) -> None:
    from kvmesh.shared.config.service_config import check_at_least, check_positive

    with pytest.raises(ValueError, match=needle):
        check_positive(bounds, "timeout_s")
        check_at_least(bounds, 1, "workers")


def test_bound_checks_pass_a_field_left_unset() -> None:
    from kvmesh.shared.config.service_config import check_at_least, check_positive

    check_positive(Bounds(), "timeout_s", "workers")
    check_at_least(Bounds(), 1, "workers")
