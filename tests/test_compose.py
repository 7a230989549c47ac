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
    """The services that run this repository's image (not NATS, Prometheus or Grafana)."""
    return {
        name: svc
        for name, svc in compose()["services"].items()
        if svc.get("image") == "kvmesh:latest"
    }


def interpolate(value: str) -> str:
    """Compose's ``${VAR:-default}`` with nothing set: the default."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(value))


def test_compose_runs_every_mesh_service() -> None:
    services = compose()["services"]
    assert {"nats", "kv-registry", "router", "prefill", "decode", "draft", "kv-store"} <= set(
        services
    )
    serves = sorted(svc["command"][2] for svc in kvmesh_services().values())
    assert serves == [
        "decode",
        "draft",
        "kv-registry",
        "kv-store",
        "prefill",
        "prefill-queue",  # makes the JetStream queue: no worker role may (docs/security.md)
        "router",
    ]


def test_decode_sends_contexts_to_the_compose_draft_service() -> None:
    services = kvmesh_services()
    assert services["decode"]["environment"]["KVMESH_SPECULATIVE"] == "true"
    assert interpolate(services["draft"]["environment"]["KVMESH_METHOD"]) == "ngram"


@pytest.mark.parametrize(
    "name", ["kv-registry", "router", "prefill", "decode", "draft", "kv-store", "prefill-queue"]
)
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


# --- metrics: Prometheus and Grafana ----------------------------------------------------------


def metrics_port(name: str) -> int:
    """Where a compose service serves /metrics: the router on its API port, the others on their
    own metrics port (on every interface of their container, so Prometheus reaches it)."""
    env = kvmesh_services()[name]["environment"]
    if name == "router":
        return int(env["KVMESH_PORT"])
    assert env["KVMESH_METRICS_HOST"] == "0.0.0.0", f"{name}: metrics only on its loopback"
    return int(env["KVMESH_METRICS_PORT"])


def test_prometheus_scrapes_every_service_on_its_metrics_port() -> None:
    """Each scrape job names a compose service by DNS (every replica of a scaled pool) and the
    port that service's config serves metrics on."""
    config = yaml.safe_load((REPO / "deploy" / "prometheus.yml").read_text())
    targets: dict[str, int] = {}
    for job in config["scrape_configs"]:
        assert job.get("metrics_path", "/metrics") == "/metrics", job["job_name"]
        for sd in job["dns_sd_configs"]:
            assert sd["type"] == "A"
            for name in sd["names"]:
                targets[name] = sd["port"]
    assert targets == {name: metrics_port(name) for name in kvmesh_services()}


@pytest.mark.parametrize(
    "name", ["kv-registry", "prefill", "decode", "draft", "kv-store", "prefill-queue"]
)
def test_worker_metrics_ports_are_config_keys_and_stay_unpublished(name: str) -> None:
    svc = kvmesh_services()[name]
    env = {k: interpolate(v) for k, v in svc["environment"].items()}
    args = build_parser().parse_args(svc["command"][1:])
    _, config, _ = build_service_config(name, args.service_args, env=env)
    assert (config.metrics_host, config.metrics_port) == ("0.0.0.0", metrics_port(name))
    assert "ports" not in svc  # the compose network only: --scale keeps working


def test_prometheus_and_grafana_load_the_repositorys_config_on_the_host_loopback() -> None:
    services = compose()["services"]
    prometheus, grafana = services["prometheus"], services["grafana"]
    assert "./deploy/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prometheus["volumes"]
    assert "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro" in grafana["volumes"]
    assert "./deploy/grafana/dashboards:/var/lib/grafana/dashboards:ro" in grafana["volumes"]
    for svc in (prometheus, grafana):
        assert all(str(p).startswith("127.0.0.1:") for p in svc["ports"])
    datasources = yaml.safe_load(
        (REPO / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text()
    )["datasources"]
    assert [d["url"] for d in datasources] == ["http://prometheus:9090"]
    providers = yaml.safe_load(
        (REPO / "deploy/grafana/provisioning/dashboards/kvmesh.yml").read_text()
    )["providers"]
    assert [p["options"]["path"] for p in providers] == ["/var/lib/grafana/dashboards"]
