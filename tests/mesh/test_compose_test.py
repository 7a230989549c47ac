"""The pure parts of ``make compose-test`` (scripts/compose_*.py), without Docker: the Debian
mirror read from apt's sources, the wheelhouse's requirements and constraints, the stack's
environment, and how the checks judge what they see."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import compose_checks as checks  # noqa: E402
import compose_host as host  # noqa: E402
import compose_stack as stack  # noqa: E402


def test_debian_mirror_from_a_deb822_sources_file_skips_security() -> None:
    sources = {
        "/etc/apt/sources.list.d/debian.sources": (
            "Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm bookworm-updates\n"
            "Components: main\n\n"
            "Types: deb\nURIs: http://deb.debian.org/debian-security\n"
            "Suites: bookworm-security\nComponents: main\n"
        )
    }
    assert host.debian_mirror(sources) == "http://deb.debian.org/debian"


def test_debian_mirror_from_a_one_line_sources_list_with_options() -> None:
    sources = {
        "/etc/apt/sources.list": (
            "# deb http://old.example/debian bookworm main\n"
            "deb-src http://src.example/debian bookworm main\n"
            "deb [arch=amd64] http://mirror.example/debian bookworm main\n"
        )
    }
    assert host.debian_mirror(sources) == "http://mirror.example/debian"


def test_debian_mirror_missing_says_how_to_give_one() -> None:
    with pytest.raises(host.HostError, match="KVMESH_DEBIAN_MIRROR"):
        host.debian_mirror({"/etc/apt/sources.list": "deb http://x/debian trixie main\n"})


def test_wheelhouse_requirements_are_the_dependencies_and_the_build_backend() -> None:
    pyproject = {
        "project": {"dependencies": ["torch>=2.4", "msgspec>=0.19"]},
        "build-system": {"requires": ["setuptools>=77", "wheel"]},
    }
    assert host.requirements(pyproject) == [
        "torch>=2.4",
        "msgspec>=0.19",
        "setuptools>=77",
        "wheel",
    ]


def test_wheelhouse_constraints_keep_pins_only() -> None:
    freeze = "-e git+https://x/kvmesh#egg=kvmesh\ntorch==2.13.0+cpu\nfoo @ file:///tmp/foo\nnats-py==2.16.0\n"
    assert host.constraints(freeze) == ["torch==2.13.0+cpu", "nats-py==2.16.0"]


def test_stack_environment_drops_the_callers_kvmesh_variables(monkeypatch) -> None:
    monkeypatch.setenv("KVMESH_MODEL", "/somewhere/else")
    monkeypatch.setenv("KVMESH_NATS_PASSWORD_ADMIN", "stale")
    settings = stack.StackSettings("p1", "kvmesh-tiny", Path("/m"), "kvmesh-tiny", "base:1")
    ports = {"nats": 1, "router": 2, "prometheus": 3}
    env = stack.compose_env(
        settings, {"KVMESH_NATS_PASSWORD_ADMIN": "fresh"}, ports, Path("/a.conf")
    )
    assert env["KVMESH_MODEL"] == "kvmesh-tiny" and env["KVMESH_NATS_PASSWORD_ADMIN"] == "fresh"
    assert env["KVMESH_ROUTER_BIND"] == "127.0.0.1" and env["KVMESH_ROUTER_PORT"] == "2"
    assert env["COMPOSE_PROJECT_NAME"] == "p1" and env["KVMESH_NATS_AUTH_CONF"] == "/a.conf"


def test_env_file_pairs() -> None:
    text = "# made by kvmesh nats-config\nKVMESH_NATS_PASSWORD_ROUTER=abc=\n\n"
    assert stack.parse_env_file(text) == {"KVMESH_NATS_PASSWORD_ROUTER": "abc="}


def test_expected_roles_are_the_compose_files_services_with_the_pools_scaled() -> None:
    import yaml

    compose = yaml.safe_load((SCRIPTS.parent / "docker-compose.yml").read_text())
    services = checks.kvmesh_services(compose)
    assert "nats" not in services and {"decode", "prefill", "router"} <= set(services)
    roles = checks.expected_roles(services, {"prefill": 2, "decode": 3})
    assert roles == Counter({name: 1 for name in services}) + Counter(decode=2, prefill=1)


def test_admin_status_wants_every_role_but_the_queue_keeper_and_the_queue_it_made() -> None:
    roles = Counter({"prefill-queue": 1, "decode": 2, "router": 1})
    assert checks.heartbeat_roles(roles) == Counter(decode=2, router=1)
    assert checks.queue_made({"prefill_queue": {"depth": 0, "workers": 1}})
    missing = {"depth": 0, "workers": 0, "note": "no prefill queue KVMESH_PREFILL_x"}
    assert not checks.queue_made({"prefill_queue": missing})
    assert not checks.queue_made({})


def test_roles_listed_count_every_worker_the_registry_included() -> None:
    status = {
        "registry": {"worker_id": "kv-registry-1"},
        "workers": [
            {"role": "decode"},
            {"role": "decode"},
            {"role": "kv-registry"},
            {"role": "router"},
        ],
    }
    assert checks.roles_listed(status) == Counter(decode=2, router=1, **{"kv-registry": 1})


@pytest.mark.parametrize(
    ("outcome", "verdict"),
    [
        (checks.Outcome(200, text="abc"), "right"),
        (checks.Outcome(200, text="abd"), "wrong-text"),
        (checks.Outcome(503, error="no decode worker is ready"), "clear-error"),
        (checks.Outcome(500, error=None), "unclear-500"),
        (checks.Outcome(0, error="ServerDisconnectedError: "), "unclear-0"),
    ],
)
def test_a_request_ends_right_or_with_a_clear_error(outcome, verdict) -> None:
    assert checks.judge(outcome, "abc") == verdict


def test_targets_up_counts_per_job_and_names_the_down_ones() -> None:
    targets = [
        {"labels": {"job": "decode"}, "scrapeUrl": "http://a:9102/metrics", "health": "up"},
        {
            "labels": {"job": "decode"},
            "scrapeUrl": "http://b:9102/metrics",
            "health": "down",
            "lastError": "connection refused",
        },
    ]
    up, down = checks.targets_up(targets)
    assert up == Counter(decode=1)
    assert down == ["decode http://b:9102/metrics: down connection refused"]


def test_worker_ids_from_json_logs_one_per_start() -> None:
    logs = "\n".join(
        [
            '{"event": "loading model", "worker_id": "decode-a"}',
            '{"event": "decode ready", "worker_id": "decode-a", "metrics_port": 9102}',
            "Traceback (most recent call last):",
            '2026-01-01T00:00:00Z {"event": "decode ready", "worker_id": "decode-b", "metrics_port": 9102}',
        ]
    )
    assert checks.worker_ids(logs) == ["decode-a", "decode-b"]


def test_retries_from_the_routers_metrics_by_role() -> None:
    text = "\n".join(
        [
            "# HELP kvmesh_router_retries_total Requests run again because a worker died",
            "# TYPE kvmesh_router_retries_total counter",
            'kvmesh_router_retries_total{role="decode"} 3.0',
            'kvmesh_router_retries_total{role="decode-migrate"} 2.0',
            'kvmesh_router_retries_created{role="decode"} 1.7e+09',
            'kvmesh_router_aborts_total{reason="client"} 1.0',
        ]
    )
    assert checks.retries(text) == {"decode": 3.0, "decode-migrate": 2.0}


def _compose_test():
    import compose_test

    return compose_test


def test_stack_settings_mount_a_checkpoints_parent_and_name_the_mesh_after_it(tmp_path) -> None:
    model = tmp_path / "My Llama"
    model.mkdir()
    (model / "config.json").write_text("{}")
    settings = _compose_test().stack_settings(str(model))
    assert (settings.model, settings.models_dir, settings.mesh) == (
        "/models/My Llama",
        tmp_path,
        "My-Llama",
    )
    tiny = _compose_test().stack_settings("kvmesh-tiny")
    assert (tiny.model, tiny.mesh) == ("kvmesh-tiny", "kvmesh-tiny")


def test_stack_settings_refuse_a_checkpoint_the_containers_cannot_read(tmp_path) -> None:
    tmp_path.chmod(0o755)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "model.safetensors").chmod(0o600)
    with pytest.raises(host.HostError, match=r"model.safetensors .* chmod -R a\+rX"):
        _compose_test().stack_settings(str(tmp_path))
    with pytest.raises(host.HostError, match=r"not 'kvmesh-tiny', a checkpoint directory"):
        _compose_test().stack_settings(str(tmp_path / "nothing"))


def test_the_default_model_is_kvmesh_ups_and_a_fetchable_name_mounts_its_cached_import(
    tmp_path, monkeypatch
) -> None:
    """`make compose-test` runs the stack on the model `kvmesh up` serves by default; a
    fetchable name is resolved (fetched once) to its checkpoint in kvmesh's cache."""
    from kvmesh.shared.model import model_ref

    assert _compose_test().parse_args([]).model == "smollm2-135m-instruct"
    cached = tmp_path / "smollm2-135m-instruct"
    cached.mkdir()
    (cached / "config.json").write_text("{}")
    asked = []

    def resolve(ref, progress=None):
        asked.append(ref)
        return model_ref.ResolvedModel(str(cached), ref)

    monkeypatch.setattr(model_ref, "resolve_model", resolve)
    settings = _compose_test().stack_settings("smollm2-135m-instruct")
    assert asked == ["smollm2-135m-instruct"]
    assert (settings.model, settings.models_dir, settings.mesh) == (
        "/models/smollm2-135m-instruct",
        tmp_path,
        "smollm2-135m-instruct",
    )


def test_stack_settings_refuse_a_checkpoint_folder_others_cannot_list(tmp_path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    model.chmod(0o700)
    with pytest.raises(host.HostError, match=r"m/ not readable"):
        _compose_test().stack_settings(str(model))


def test_the_busiest_decode_worker_is_the_one_killed() -> None:
    rows = [
        {"worker_id": "decode-a", "load": {"num_running": 0, "num_waiting": 0}, "leases": 0},
        {"worker_id": "decode-b", "load": {"num_running": 2, "num_waiting": 1}, "leases": 1},
    ]
    logs = {"c1": ["decode-a"], "c2": ["decode-old", "decode-b"]}
    assert checks.busiest(rows, logs) == "c2"
    with pytest.raises(AssertionError, match="decode-b"):
        checks.busiest(rows, {"c1": ["decode-a"]})
