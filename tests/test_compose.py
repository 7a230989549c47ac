"""docker-compose.yml checked without a Docker engine: every command is a real ``kvmesh`` entry
point and every KVMESH_* variable is a key the service's config reads."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from kvmesh.shared.nats_auth import PASSWORD_ENV, USER_ENV, authorization_block, password_variable

from kvmesh.cli import build_parser
from kvmesh.commands.serve import build_service_config, service_env_keys

yaml = pytest.importorskip("yaml")  # PyYAML (dev dependency via transformers)

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "docker-compose.yml"


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def kvmesh_services() -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in compose()["services"].items() if name != "nats"}


def interpolate(value: str) -> str:
    """Compose's ``${VAR:-default}`` with nothing set: the default."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(value))


def test_compose_runs_every_mesh_service() -> None:
    services = compose()["services"]
    assert {"nats", "kv-registry", "router", "prefill", "decode"} <= set(services)
    serves = sorted(svc["command"][2] for svc in kvmesh_services().values())
    assert serves == ["decode", "kv-registry", "prefill", "router"]


@pytest.mark.parametrize("name", ["kv-registry", "router", "prefill", "decode"])
def test_command_is_a_kvmesh_entry_point_with_valid_env(name: str) -> None:
    svc = kvmesh_services()[name]
    command = svc["command"]
    assert command[0] == "kvmesh", f"{name}: command must run the kvmesh entry point"
    args = build_parser().parse_args(command[1:])
    assert args.command == "serve" and args.service == name
    env = {k: interpolate(v) for k, v in svc.get("environment", {}).items()}
    known = service_env_keys(name) | {USER_ENV, PASSWORD_ENV}  # credentials: shared/nats_auth.py
    unknown = sorted(k for k in env if k.startswith("KVMESH_") and k not in known)
    assert unknown == [], f"{name}: {unknown} are not config keys of `kvmesh serve {name}`"
    _, config, log_config = build_service_config(name, args.service_args, env=env)
    assert config.nats_url == "nats://nats:4222"  # the compose network's NATS, not localhost
    assert log_config.log_format == "json"


@pytest.mark.parametrize("name", ["prefill", "decode"])
def test_worker_pools_scale(name: str) -> None:
    svc = kvmesh_services()[name]
    assert "container_name" not in svc and "ports" not in svc, f"{name} must scale with --scale"
    assert "build" in svc or "image" in svc


def test_data_plane_crosses_containers() -> None:
    services = kvmesh_services()
    for name in ("prefill", "decode"):
        assert services[name]["environment"]["KVMESH_TRANSPORT"] == "tcp"  # no shared memory
    assert services["decode"]["environment"]["KVMESH_TCP_HOST"] == "0.0.0.0"


def test_nats_runs_the_official_image_with_jetstream() -> None:
    nats = compose()["services"]["nats"]
    assert nats["image"].split(":")[0] == "nats"
    assert "-js" in nats["command"]


def test_router_is_published_and_health_checked() -> None:
    router = kvmesh_services()["router"]
    assert "8000:8000" in router["ports"]
    assert "/health" in " ".join(router["healthcheck"]["test"])


def test_dockerfile_installs_cpu_torch_then_the_project() -> None:
    text = (REPO / "Dockerfile").read_text()
    assert text.startswith("#") and "FROM python:3.11-slim" in text
    torch_at = text.index("download.pytorch.org/whl/cpu torch")
    assert torch_at < text.index("pip install .")


def test_mesh_doc_lists_every_subject() -> None:
    from kvmesh.shared.subjects import Subjects

    doc = (REPO / "docs" / "mesh.md").read_text()
    names = [n for n in dir(Subjects) if not n.startswith("_") and n not in ("mesh", "prefix")]
    missing = [n for n in names if f"`{n}" not in doc]
    assert missing == [], f"docs/mesh.md does not describe {missing}"


def test_nats_is_published_on_the_host_loopback_only() -> None:
    ports = compose()["services"]["nats"].get("ports", [])
    assert ports and all(str(p).startswith("127.0.0.1:") for p in ports)


def test_nats_requires_a_user_per_role_with_the_generated_permissions() -> None:
    """deploy/nats-auth.conf is `kvmesh nats-config`'s output (no drift from the code), the NATS
    container loads it, and each service logs in as its own role."""
    from kvmesh.shared.subjects import DEFAULT_MESH, Subjects

    conf = (REPO / "deploy" / "nats-auth.conf").read_text()
    assert conf == authorization_block(Subjects(DEFAULT_MESH))
    nats = compose()["services"]["nats"]
    assert nats["command"][:2] == ["-c", "/etc/nats/nats-auth.conf"]
    assert "./deploy/nats-auth.conf:/etc/nats/nats-auth.conf:ro" in nats["volumes"]
    for name, svc in kvmesh_services().items():
        env = svc["environment"]
        assert env[USER_ENV] == name
        assert env[PASSWORD_ENV].startswith("${" + password_variable(name) + ":?")
        assert password_variable(name) in nats["environment"]
