"""One docker-compose.yml project for ``make compose-test``: its settings (a project name of its
own, free host ports, fresh NATS passwords, the mesh's auth config, the model), the compose
commands run on it (v1 or v2 alike) and what Docker holds of it, found by the compose labels
both versions put on containers, networks and volumes (v1 names containers ``p_svc_1``, v2
``p-svc-1``; the labels are the same)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from compose_host import ROOT, HostError, log, run

PROJECT_LABEL = "com.docker.compose.project"
SERVICE_LABEL = "com.docker.compose.service"
KVMESH_SERVICES = ("kv-registry", "router", "prefill", "decode", "draft", "kv-store")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class StackSettings:
    """What the project runs: ``model`` as the containers name it (kvmesh-tiny or
    /models/<dir>), ``models_dir`` the host folder mounted at /models, ``mesh`` its name."""

    project: str
    model: str
    models_dir: Path
    mesh: str
    base_image: str
    scale: dict[str, int] = field(default_factory=lambda: {"prefill": 2, "decode": 2})


def compose_env(
    settings: StackSettings, passwords: dict[str, str], ports: dict[str, int], auth_conf: Path
) -> dict[str, str]:
    """The variables docker-compose.yml reads, for this project (on top of no KVMESH_* from the
    caller's environment: a stray one would change the stack under test)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    env |= passwords
    env |= {
        "COMPOSE_PROJECT_NAME": settings.project,
        "KVMESH_BASE_IMAGE": settings.base_image,
        "KVMESH_MODEL": settings.model,
        "KVMESH_MODELS_DIR": str(settings.models_dir),
        "KVMESH_MESH": settings.mesh,
        "KVMESH_NATS_AUTH_CONF": str(auth_conf),
        "KVMESH_NATS_PORT": str(ports["nats"]),
        "KVMESH_ROUTER_BIND": "127.0.0.1",
        "KVMESH_ROUTER_PORT": str(ports["router"]),
        "KVMESH_PROMETHEUS_PORT": str(ports["prometheus"]),
    }
    return env


def parse_env_file(text: str) -> dict[str, str]:
    """``KEY=value`` lines (``kvmesh nats-config --env-file``'s output)."""
    pairs = (line.split("=", 1) for line in text.splitlines() if "=" in line)
    return {k.strip(): v.strip() for k, v in pairs if not k.lstrip().startswith("#")}


class Stack:
    """The compose project: ``up``, ``down``, and its containers, networks and volumes."""

    def __init__(self, compose: list[str], settings: StackSettings, workdir: Path) -> None:
        self.compose_argv = compose
        self.settings = settings
        self.ports = {name: free_port() for name in ("nats", "router", "prometheus")}
        env_file = workdir / "stack.env"
        kvmesh = [str(ROOT / ".venv" / "bin" / "kvmesh")]
        run([*kvmesh, "nats-config", "--env-file", str(env_file)], 60)
        self.passwords = parse_env_file(env_file.read_text())
        self.auth_conf = workdir / "nats-auth.conf"
        conf = run([*kvmesh, "nats-config", "--mesh", settings.mesh], 60).stdout
        self.auth_conf.write_text(conf)
        self.auth_conf.chmod(0o644)  # read by the NATS container's user
        self.env = compose_env(settings, self.passwords, self.ports, self.auth_conf)
        self.env_file = env_file  # passed with --env-file: a checkout's own .env is not read

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['router']}"

    @property
    def nats_url(self) -> str:
        return f"nats://127.0.0.1:{self.ports['nats']}"

    @property
    def prometheus_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['prometheus']}"

    def compose(self, *args: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
        argv = [
            *self.compose_argv,
            "--project-name",
            self.settings.project,
            "--file",
            str(ROOT / "docker-compose.yml"),
            "--env-file",
            str(self.env_file),
            *args,
        ]
        return run(argv, timeout_s, env=self.env, cwd=ROOT)

    def up(self) -> None:
        scale = [f"--scale={svc}={n}" for svc, n in self.settings.scale.items()]
        self.compose("up", "--detach", "--no-build", *scale, timeout_s=900)

    def down(self) -> None:
        self.compose("down", "--volumes", "--remove-orphans", "--timeout", "20", timeout_s=300)

    def logs(self, path: Path) -> None:
        """Every container's log into ``path`` (for a failed check)."""
        try:
            path.write_text(
                self.compose("logs", "--no-color", "--timestamps", timeout_s=120).stdout
            )
        except HostError as exc:
            path.write_text(str(exc))

    # --- what Docker holds of the project ---------------------------------------------------

    def _filter(self) -> list[str]:
        return ["--filter", f"label={PROJECT_LABEL}={self.settings.project}"]

    def containers(self, service: str | None = None, *, running: bool = True) -> list[str]:
        """Container ids of the project (of ``service``), oldest first."""
        argv = ["docker", "ps", "--quiet", "--no-trunc", *self._filter()]
        if service is not None:
            argv += ["--filter", f"label={SERVICE_LABEL}={service}"]
        if not running:
            argv.append("--all")
        ids = run(argv, 60).stdout.split()
        return list(reversed(ids))  # docker ps lists newest first

    def inspect(self, container: str) -> dict:
        return json.loads(run(["docker", "inspect", container], 60).stdout)[0]

    def health(self, container: str) -> str:
        state = self.inspect(container)["State"]
        return state.get("Health", {}).get("Status", state["Status"])

    def wait_healthy(self, container: str, timeout_s: float) -> float:
        """Seconds until ``container``'s healthcheck passes; HostError after ``timeout_s``."""
        start = time.monotonic()
        while (status := self.health(container)) != "healthy":
            if time.monotonic() - start > timeout_s:
                raise HostError(f"container {container[:12]} still {status} after {timeout_s:g} s")
            time.sleep(1.0)
        return time.monotonic() - start

    def leftovers(self) -> dict[str, list[str]]:
        """The project's containers (any state), networks and volumes that still exist."""
        found = {"containers": self.containers(running=False)}
        for kind in ("network", "volume"):
            out = run(["docker", kind, "ls", "--quiet", *self._filter()], 60).stdout
            found[f"{kind}s"] = out.split()
        return found


def log_step(name: str, start: float) -> float:
    took = time.monotonic() - start
    log(f"{name}: {took:.0f} s")
    return took
