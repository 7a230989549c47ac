"""``kvmesh up``: the whole mesh on this machine, one process per service.

Starts nats-server when nothing answers at --nats-url, then the kv-registry, N prefill and M
decode (or M colocated) workers and the router, each as ``python -m kvmesh.cli serve ...`` in its
own session (process group), so a terminal's Ctrl-C reaches only the launcher, which then stops
them in order: router, prefill, decode, registry, NATS — SIGTERM, SIGKILL after --stop-timeout-s.
Children also get SIGTERM from the kernel if the launcher itself dies (PR_SET_PDEATHSIG).

Two meshes on one machine: each has a name (--mesh, default from the model) and its own
subjects. Left at its default --nats-url, a second ``kvmesh up`` whose port 4222 holds another
mesh's nats-server starts one of its own on a free port; ``kvmesh admin --mesh NAME`` finds it
through the state file each launcher keeps (shared/mesh_state.py). The same mesh twice on one
NATS, or a taken HTTP port, is refused in one line.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO, Literal

from kvmesh.commands.cpu_plan import SPARE, CpuPlan, plan_cpus
from kvmesh.commands.nats_supervisor import NatsSupervisor
from kvmesh.commands.restarts import RestartPolicy
from kvmesh.commands.up_model import DEFAULT_MODEL, ModelChoiceError, resolve_up_model
from kvmesh.shared.mesh_state import MeshState, remove_state, running_meshes, write_state
from kvmesh.shared.nats_auth import (
    ADMIN,
    PASSWORD_FILE_ENV,
    USER_ENV,
    MeshCredentials,
    NatsAuth,
    auth_from_env,
)
from kvmesh.shared.nats_options import (
    NatsClientConfig,
    NatsSecurity,
    redact_url,
    strip_credentials,
    url_has_credentials,
)
from kvmesh.shared.service_config import (
    DEFAULT_NATS_URL,
    ConfigError,
    add_config_arguments,
    config_from_args,
    option,
)
from kvmesh.shared.subjects import mesh_from_model

# stop order: earlier tiers first (router stops taking requests before its backends go)
TIERS = ("router", "prefill", "decode", "draft", "kv-store", "kv-registry")


@dataclass(frozen=True, slots=True)
class UpConfig(NatsClientConfig):
    """``nats_url`` (inherited): the NATS server; started here if none answers. Left at its
    default, a server there that another ``kvmesh up``'s mesh owns is not joined: this mesh gets
    a nats-server of its own on a free port."""

    model: str = option(
        DEFAULT_MODEL,
        help="a checkpoint directory, a fetchable model (fetched and imported into the cache "
        "once: kvmesh model fetch), a .gguf file (imported into the cache once) or kvmesh-tiny",
    )
    served_model_name: str | None = option(
        None,
        help="the model id clients send (default: the fetchable name, the .gguf file's stem, or "
        "--model)",
    )
    mode: Literal["disagg", "colocated"] = option(
        "disagg", help="disagg: prefill and decode pools; colocated: the unified baseline"
    )
    prefill: int = option(1, help="prefill workers (disagg mode)")
    decode: int = option(1, help="decode workers (colocated workers in colocated mode)")
    transport: Literal["auto", "shm", "tcp", "rdma"] = option("auto", help="KV data plane")
    port: int = option(8000, help="router HTTP port (0: a free one)")
    host: str = option("127.0.0.1", help="address the router listens on (0.0.0.0: every interface)")
    local_prefill_threshold: int | None = option(
        None, help="prompts shorter than this are prefilled on the decode worker (router default)"
    )
    device: str = option("cpu", help="torch device of prefill and decode workers")
    cores: int | None = option(
        None,
        help="CPU cores the workers share (default: the cores this process may run on), shared "
        "out by --cpu-sharing (disagg) or all to the colocated workers",
    )
    decode_pacing_ms: float = option(
        0.0,
        help="disagg: decode workers start a step at most this often (their "
        "--min-step-interval-ms; 0: back to back). Near the inter-token target, it leaves "
        "decode's idle share of shared cores to prefill",
    )
    cpu_sharing: Literal["auto", "priority", "partition", "partition-spare", "equal"] = option(
        "auto",
        help="disagg on the CPU: how prefill and decode share the cores: priority (decode "
        "first, prefill at SCHED_IDLE on every core), partition (each pool pinned to cores of "
        "its own; partition-spare: the last of several prefill workers at SCHED_IDLE on any "
        "core), equal (same priority); auto: the better of the measured ones for this machine "
        "(kvmesh up prints its choice and why; docs/load.md)",
    )
    prefill_nice: int = option(
        0,
        help="disagg: prefill workers run this much nicer (0-19, their session too) instead of "
        "at SCHED_IDLE: --cpu-sharing priority with a nice level",
    )
    kv_cache_bytes: int | None = option(
        None, help="KV pool bytes per prefill/decode worker (their default: 256 MiB)"
    )
    kv_cache_dtype: Literal["auto", "int8", "fp8_e4m3"] = option(
        "auto",
        help="KV cache dtype of every prefill and decode worker: auto (the model's), int8 (the "
        "recommended 8-bit format: a scale per 32 values of each token) or fp8_e4m3 (float8 with "
        "per-(block, KV head) scales; docs/kv_cache.md)",
    )
    decode_kv_cache_dtype: Literal["auto", "int8", "fp8_e4m3"] | None = option(
        None,
        help="decode workers' KV cache dtype where it differs from --kv-cache-dtype (e.g. int8 "
        "decode pools behind model-dtype prefill: the prefill writes convert)",
    )
    log_level: Literal["debug", "info", "warning", "error", "critical"] = option(
        "info", help="log level of every service"
    )
    log_format: Literal["console", "json"] = option("console", help="log format of every service")
    startup_timeout_s: float = option(600.0, help="seconds to wait for every service to be ready")
    max_restarts: int = option(
        5,
        help="once the mesh is up, a service that dies is restarted (after 1, 2, 4 ... 30 s); "
        "more deaths than this within 5 minutes stop the mesh (0: stop at the first death)",
    )
    stop_timeout_s: float = option(15.0, help="seconds between SIGTERM and SIGKILL on shutdown")
    draft: Literal["ngram", "early-exit", "model"] | None = option(
        None,
        help="speculative decoding: start draft workers with this method (kvmesh serve draft "
        "--method) and decode workers with --speculative; none: no drafts",
    )
    draft_workers: int = option(1, help="draft workers (with --draft)")
    num_speculative_tokens: int = option(4, help="draft tokens per proposal (with --draft)")
    draft_tree: tuple[int, ...] = option(
        (), help="draft tree branching per depth, e.g. 2,2,1 (any --draft; absent: a chain)"
    )
    draft_exit_layer: int = option(1, help="early-exit: layers of the target the draft runs")
    draft_model: str | None = option(
        None,
        help="model: the draft checkpoint directory (draft workers draft with it; prefill "
        "workers run it too, for the prompts' draft KV: --draft-kv --draft-model)",
    )
    kv_store: int = option(
        0,
        help="kv-store memory nodes to start (kvmesh serve kv-store; prefill workers read prompt "
        "prefixes from them and write computed ones to them; docs/kv_store.md)",
    )
    kv_store_capacity_gb: float = option(1.0, help="host memory of each kv-store (GiB)")
    kv_store_disk_path: str | None = option(
        None,
        help="directory for every kv-store's disk tier (their --disk-path): each store creates "
        "its own file there (a fresh name per process, unlinked at once), so one directory "
        "serves several",
    )
    kv_store_disk_capacity_gb: float | None = option(
        None, help="size of each kv-store's disk tier in GiB (--disk-capacity-gb)"
    )
    nats_insecure: bool = option(
        False,
        help="use a NATS server already at --nats-url even though it lets anyone connect without "
        "credentials (refused by default: whoever runs it reads every prompt; docs/security.md)",
    )

    def __post_init__(self) -> None:
        self.check_nats_options(mesh_from_model(self.model))
        if self.served_model_name == "":
            raise ValueError("served_model_name must not be empty (leave it unset for --model)")
        if self.draft is not None:
            from kvmesh.services.draft.shape import TreeShape

            TreeShape.parse(self.num_speculative_tokens, self.draft_tree)  # ValueError: one line
            if self.draft_workers < 1:
                raise ValueError(f"draft_workers must be >= 1, got {self.draft_workers}")
            if self.draft == "model" and not self.draft_model:
                raise ValueError("--draft model needs --draft-model PATH")
        if self.decode < 1:
            raise ValueError(f"decode must be >= 1, got {self.decode}")
        if self.kv_store < 0:
            raise ValueError(f"kv_store must be >= 0, got {self.kv_store}")
        if not self.kv_store_capacity_gb > 0:
            raise ValueError(
                f"kv_store_capacity_gb must be positive, got {self.kv_store_capacity_gb}"
            )
        if (self.kv_store_disk_path is None) != (self.kv_store_disk_capacity_gb is None):
            raise ValueError(
                "a kv-store disk tier needs both kv_store_disk_path and kv_store_disk_capacity_gb"
            )
        if self.kv_store_disk_path is not None and not self.kv_store:
            raise ValueError("kv_store_disk_path needs kv-stores (kv_store >= 1)")
        if self.kv_store_disk_capacity_gb is not None and not self.kv_store_disk_capacity_gb > 0:
            raise ValueError(
                f"kv_store_disk_capacity_gb must be positive, got {self.kv_store_disk_capacity_gb}"
            )
        if self.prefill < 0 or (self.mode == "disagg" and self.prefill < 1):
            raise ValueError(f"prefill must be >= 1 in disagg mode, got {self.prefill}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.cores is not None and self.cores < 1:
            raise ValueError(f"cores must be >= 1, got {self.cores}")
        if not 0 <= self.prefill_nice <= 19:
            raise ValueError(f"prefill_nice must be in [0, 19], got {self.prefill_nice}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.decode_pacing_ms < 0:
            raise ValueError(f"decode_pacing_ms must be >= 0, got {self.decode_pacing_ms}")
        for name in ("startup_timeout_s", "stop_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


class LaunchError(RuntimeError):
    """A service exited or did not become ready; the message says which and how to look."""


@dataclass(frozen=True, slots=True)
class ChildSpec:
    name: str  # worker id, e.g. "decode-0"
    tier: str  # one of TIERS
    argv: tuple[str, ...]  # after `kvmesh`
    env: tuple[tuple[str, str], ...] = ()  # set for this child unless our environment sets it


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_plan(config: UpConfig) -> CpuPlan:
    """How the workers share the cores (``cpu_plan.py``): the first ``--cores`` of those this
    process may run on."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        allowed = list(range(os.cpu_count() or 1))
    cores = config.cores or len(allowed)
    cpus = frozenset(allowed[:cores]) if cores <= len(allowed) else frozenset(range(cores))
    return plan_cpus(
        cpus,
        mode=config.mode,
        device=config.device,
        decode_workers=config.decode,
        prefill_workers=max(1, config.prefill),
        sharing=config.cpu_sharing,
        prefill_nice=config.prefill_nice,
        pinnable=cores <= len(allowed),
    )


def split_cores(config: UpConfig) -> dict[str, int]:
    """Torch threads per worker of each role: ``{"decode": n, "prefill": m}`` (or colocated),
    as ``cpu_plan`` shares the cores out (``cpu_plan.py``); both modes use the same cores, so
    they compare on equal hardware."""
    cores = config.cores or available_cores()
    # Draft workers (when asked for) run a small model or none: a quarter of the cores.
    draft = {"draft": max(1, cores // 4 // config.draft_workers)} if config.draft else {}
    return {**cpu_plan(config).threads(), **draft}


def plan(config: UpConfig, nats_url: str, port: int) -> list[ChildSpec]:
    """The ``kvmesh serve ...`` command of every service, in start order."""
    threads = split_cores(config)
    roles = cpu_plan(config).roles
    assert config.mesh is not None
    common: tuple[str, ...] = ("--mesh", config.mesh)
    if not url_has_credentials(nats_url):  # else it reaches them in KVMESH_NATS_URL (ps shows argv)
        common += ("--nats-url", nats_url)
    for flag, path in (
        ("--nats-creds", config.nats_creds),
        ("--nats-tls-ca", config.nats_tls_ca),
        ("--nats-tls-cert", config.nats_tls_cert),
        ("--nats-tls-key", config.nats_tls_key),
    ):
        if path is not None:
            common += (flag, str(Path(path).resolve()))
    common += ("--log-level", config.log_level, "--log-format", config.log_format)
    engine = ("--model", config.model, "--device", config.device, "--transport", config.transport)
    if config.kv_cache_bytes is not None:
        engine += ("--kv-cache-bytes", str(config.kv_cache_bytes))
    prefill_kv = ("--kv-cache-dtype", config.kv_cache_dtype)
    decode_kv = ("--kv-cache-dtype", config.decode_kv_cache_dtype or config.kv_cache_dtype)
    worker = lambda name: ("--worker-id", name, *common)
    specs = [
        ChildSpec(
            "kv-registry-0", "kv-registry", ("serve", "kv-registry", *worker("kv-registry-0"))
        )
    ]
    if config.mode == "disagg":  # the one user that may make the JetStream queue
        name = "prefill-queue-0"
        specs.insert(0, ChildSpec(name, "kv-registry", ("serve", "prefill-queue", *worker(name))))
    decode_service = "colocated" if config.mode == "colocated" else "decode"
    decode_threads = roles[decode_service].flags()
    if config.mode == "disagg" and config.decode_pacing_ms:
        decode_threads += ("--min-step-interval-ms", str(config.decode_pacing_ms))
    if config.draft:
        decode_threads += ("--speculative",)
    # e.g. decode workers that share their cores with a lower-priority prefill pool: their
    # OpenMP threads wait for work asleep, not spinning on cores prefill could use
    decode_env = roles[decode_service].env
    for i in range(config.decode):
        name = f"{decode_service}-{i}"
        argv = ("serve", decode_service, *worker(name), *engine, *decode_kv, *decode_threads)
        specs.append(ChildSpec(name, "decode", argv, decode_env))
    if config.mode == "disagg":
        for i in range(config.prefill):
            name = f"prefill-{i}"
            spare = SPARE in roles and i == config.prefill - 1  # cpu_plan.py: the spare one
            prefill_threads = roles[SPARE if spare else "prefill"].flags()
            argv = ("serve", "prefill", *worker(name), *engine, *prefill_kv, *prefill_threads)
            if config.draft == "early-exit":  # the draft workers take the prompts' draft KV
                argv += ("--draft-kv",)
            if config.draft == "model":  # ... computed here by the draft workers' checkpoint
                assert config.draft_model is not None
                argv += ("--draft-kv", "--draft-model", config.draft_model)
            specs.append(ChildSpec(name, "prefill", argv))
    if config.draft:
        specs += draft_specs(config, worker, threads["draft"])
    for i in range(config.kv_store):
        name = f"kv-store-{i}"
        argv = ("serve", "kv-store", *worker(name), "--model", config.model)
        argv += ("--transport", config.transport)
        argv += ("--capacity-gb", f"{config.kv_store_capacity_gb:g}")
        if config.kv_store_disk_path is not None:  # absolute, as the TLS paths are
            argv += ("--disk-path", str(Path(config.kv_store_disk_path).expanduser().resolve()))
            argv += ("--disk-capacity-gb", f"{config.kv_store_disk_capacity_gb:g}")
        if config.kv_cache_dtype != "auto":  # the store's blocks are the workers' blocks
            argv += ("--kv-cache-dtype", config.kv_cache_dtype)
        specs.append(ChildSpec(name, "kv-store", argv))
    router = ("serve", "router", *worker("router-0"), "--model", config.model, "--port", str(port))
    router += ("--host", config.host)
    if config.served_model_name is not None:
        router += ("--served-model-name", config.served_model_name)
    router += ("--mode", config.mode)
    if config.local_prefill_threshold is not None:
        router += ("--local-prefill-threshold", str(config.local_prefill_threshold))
    specs.append(ChildSpec("router-0", "router", router))
    return specs


def draft_specs(config: UpConfig, worker, threads: int) -> list[ChildSpec]:
    """The ``kvmesh serve draft`` workers of ``--draft``."""
    assert config.draft is not None
    argv = ("--model", config.model, "--device", config.device, "--method", config.draft)
    argv += ("--num-speculative-tokens", str(config.num_speculative_tokens))
    argv += ("--threads", str(threads))
    if config.draft_tree:
        argv += ("--tree", ",".join(map(str, config.draft_tree)))
    if config.draft in ("early-exit", "model"):  # prompt KV from prefill workers
        argv += ("--transport", config.transport)
    if config.draft == "early-exit":
        argv += ("--exit-layer", str(config.draft_exit_layer))
    if config.draft == "model":
        assert config.draft_model is not None
        argv += ("--draft-model", config.draft_model)
    names = [f"draft-{i}" for i in range(config.draft_workers)]
    return [ChildSpec(n, "draft", ("serve", "draft", *worker(n), *argv)) for n in names]


def with_metrics_ports(specs: list[ChildSpec], ports: dict[str, int]) -> list[ChildSpec]:
    """Each spec named in ``ports`` serving its metrics there (the router serves them on its API
    port and is left as it is)."""
    return [
        replace(spec, argv=(*spec.argv, "--metrics-port", str(ports[spec.name])))
        if spec.name in ports
        else spec
        for spec in specs
    ]


EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_FREE_PORT = 10_000  # free_port's picks start here (below: well-known services)


def ephemeral_port_range(path: Path = EPHEMERAL_PORTS) -> tuple[int, int]:
    """The kernel's range for outgoing connections' and port-0 binds' local ports (Linux's
    default where it cannot be read)."""
    try:
        low, high = (int(x) for x in path.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def free_port(rng: random.Random | None = None, path: Path = EPHEMERAL_PORTS) -> int:
    """A local port free now, for a child that binds it later (a worker's metrics, the
    router, NATS). Picked below the kernel's ephemeral range where there is room: a port-0 bind
    would hand out an ephemeral port, which any outgoing connection (the workers' NATS
    clients start meanwhile) may take before the child binds it (a child of `kvmesh up` once
    exited on "address already in use" for its metrics port). Outside that range only another
    explicit bind can take it. Falls back to a port-0 bind."""
    low, _ = ephemeral_port_range(path)
    rng = rng or random.SystemRandom()
    if low - LOWEST_FREE_PORT >= 1000:
        for _ in range(64):
            port = rng.randrange(LOWEST_FREE_PORT, low)
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Launcher:
    def __init__(self, config: UpConfig, log: BinaryIO | None = None) -> None:
        self.config = config
        self.log = log  # where the services' output goes (None: this process's stderr)
        self.nats_url = config.nats_url  # where the mesh's NATS is (set by start)
        self.port = config.port or free_port()
        self.children: dict[str, tuple[ChildSpec, subprocess.Popen[bytes]]] = {}
        self.nats = None  # NatsServer we started, if any
        # One NATS user per role on a server we start (shared/nats_auth.py); on a server we
        # found, whatever credentials the environment holds.
        self.credentials: MeshCredentials | None = None
        self.nats_auth: NatsAuth | None = auth_from_env()  # this process's own client (admin)
        self.admin_password_file: Path | None = None
        self._envs: dict[str, dict[str, str]] = {}  # child name -> environment it started with
        self.state: MeshState | None = None  # what this launcher recorded (shared/mesh_state.py)
        self.metrics_urls: dict[str, str] = {}  # service name -> its /metrics (set by start)

    @property
    def mesh(self) -> str:
        assert self.config.mesh is not None
        return self.config.mesh

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "") else self.config.host
        return f"http://{host}:{self.port}"

    def start(self) -> None:
        from kvmesh.shared.nats_server import nats_is_reachable
        from kvmesh.shared.nats_vetting import NatsVettingError, vet_nats_url

        url = self.config.nats_url
        if url == DEFAULT_NATS_URL:
            url = self._default_nats_url()
        if not nats_is_reachable(url):
            self._start_nats(url)
        else:
            try:  # a server anybody can log in to is anybody's (shared/nats_vetting.py)
                vet_nats_url(url, insecure=self.config.nats_insecure)
            except NatsVettingError as exc:
                raise LaunchError(str(exc)) from None
            self._check_mesh_absent(url)
        specs = plan(self.config, self.nats_url, self.port)
        ports = {s.name: free_port() for s in specs if s.tier != "router"}  # kept across restarts
        self.metrics_urls = {
            s.name: f"{self.url}/metrics"
            if s.tier == "router"
            else f"http://127.0.0.1:{ports[s.name]}/metrics"
            for s in specs
        }
        self.state = MeshState(
            mesh=self.mesh,
            nats_url=strip_credentials(self.nats_url),
            pid=os.getpid(),
            router_url=self.url,
            admin_password_file=str(self.admin_password_file or ""),
            metrics_urls=self.metrics_urls,
        )
        write_state(self.state)
        for spec in with_metrics_ports(specs, ports):
            self._spawn(spec)

    def _default_nats_url(self) -> str:
        """The NATS URL of a launcher left at the default: the default, unless the server there
        belongs to another ``kvmesh up``'s mesh, then a free port of our own. The same mesh
        already up on this machine is refused."""
        meshes = running_meshes()
        same = [m for m in meshes if m.mesh == self.mesh]
        if same:
            other = same[0]
            raise LaunchError(
                f"mesh {self.mesh!r} is already up on this machine (kvmesh up pid {other.pid}, "
                f"{other.router_url}, NATS {other.nats_url}); give this one another --mesh, or "
                "stop that one first"
            )
        owner = next((m for m in meshes if m.nats_url == DEFAULT_NATS_URL), None)
        if owner is None:
            return DEFAULT_NATS_URL
        url = f"nats://127.0.0.1:{free_port()}"
        print(
            f"kvmesh up: {DEFAULT_NATS_URL} is the nats-server of mesh {owner.mesh!r} (kvmesh up "
            f"pid {owner.pid}); mesh {self.mesh!r} gets its own at {url} (kvmesh admin "
            f"--mesh {self.mesh} finds it)",
            file=sys.stderr,
        )
        return url

    def _start_nats(self, url: str) -> None:
        from kvmesh.shared.nats_server import NatsServer, parse_nats_url

        if not url.startswith("nats://") or url_has_credentials(url):
            raise LaunchError(
                f"nothing answers at {redact_url(url)}, and kvmesh up starts a nats-server only "
                "for a plain nats://HOST:PORT URL (credentials and TLS are the operator's "
                "server's); start that server first, or give a nats:// URL"
            )
        host, nats_port = parse_nats_url(url)
        self.credentials = MeshCredentials.generate()
        self.nats = NatsServer(
            nats_port,
            host=host,
            authorization=self.credentials.server_config(self.config.subjects),
        )
        self.nats.start()
        self.nats_url = self.nats.url
        self.nats_auth = self.credentials.auth(ADMIN)
        self.admin_password_file = self.nats.state_dir / "admin.password"
        fd = os.open(self.admin_password_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.nats_auth.password)
        print(
            f"kvmesh up: started nats-server at {self.nats.url} for mesh {self.mesh!r}, one "
            f"user per role; for kvmesh admin: export {USER_ENV}={ADMIN} "
            f"{PASSWORD_FILE_ENV}={self.admin_password_file} (kvmesh admin --mesh {self.mesh} "
            "finds both by itself)",
            file=sys.stderr,
        )

    def _check_mesh_absent(self, url: str) -> None:
        """Join the NATS at ``url`` unless this mesh already runs there: its workers would count
        as ours, and ours would take its requests. Other meshes there are no concern."""
        from kvmesh.shared.nats_service import NatsUnavailableError

        self.nats_url = url
        try:
            others = _run_sync(
                workers_on(
                    url, auth=self.nats_auth, mesh=self.mesh, security=self.config.nats_security
                )
            )
        except NatsUnavailableError as exc:  # e.g. a server of another mesh, with its own users
            raise LaunchError(
                f"cannot join the NATS server at {redact_url(url)}: {exc}; or give this mesh a "
                "nats-server of its own: --nats-url nats://127.0.0.1:PORT with a free PORT"
            ) from None
        if others:
            raise LaunchError(
                f"mesh {self.mesh!r} is already running on {redact_url(url)} (workers: "
                f"{', '.join(sorted(others)[:6])}{', ...' if len(others) > 6 else ''}); start "
                f"this one as another mesh (--mesh NAME), or on its own NATS (e.g. --nats-url "
                "nats://127.0.0.1:4223; it is started here if nothing answers), or stop the "
                "other one first"
            )

    def _spawn(self, spec: ChildSpec) -> None:
        """Start ``spec``'s process; a restart gets the environment of the first start."""
        from kvmesh.shared.nats_server import die_with_parent

        argv = [sys.executable, "-m", "kvmesh.cli", *spec.argv]
        env = self._envs.get(spec.name)
        if env is None:
            env = dict(os.environ)  # ours (an external server's credentials, if any)
            if self.credentials is not None:
                env.update(self.credentials.auth(spec.argv[1]).env())
            if url_has_credentials(self.nats_url):  # not in argv: ps would show them
                env["KVMESH_NATS_URL"] = self.nats_url
            for key, value in spec.env:
                env.setdefault(key, value)
            self._envs[spec.name] = env
        proc = subprocess.Popen(
            argv,
            start_new_session=True,
            preexec_fn=die_with_parent,
            env=env,
            stdout=self.log,
            stderr=self.log,
        )
        self.children[spec.name] = (spec, proc)

    def dead(self) -> list[tuple[ChildSpec, int]]:
        """Children that exited, with their exit codes."""
        return [
            (spec, proc.returncode)
            for spec, proc in self.children.values()
            if proc.poll() is not None
        ]

    def check_alive(self) -> None:
        if self.nats is not None and (code := self.nats.exit_code()) is not None:
            raise LaunchError(f"the nats-server at {self.nats.url} exited with code {code}")
        for spec, code in self.dead():
            raise LaunchError(
                f"{spec.name} exited with code {code}; its log is above "
                f"(rerun it alone: kvmesh {' '.join(spec.argv)})"
            )

    async def supervise(self, policy: RestartPolicy, poll_s: float = 0.5) -> None:
        """Restart children that die, with backoff, until one dies too often (LaunchError)."""
        pending: dict[str, float] = {}  # name -> monotonic time to restart it at
        nats = NatsSupervisor(self.nats, policy) if self.nats is not None else None
        while True:
            now = time.monotonic()
            if nats is not None:
                nats.check(now)  # the nats-server we started, restarted like a service
            for spec, code in self.dead():
                if spec.name in pending:
                    continue
                delay = policy.on_exit(spec.name, now)
                if delay is None:
                    raise LaunchError(
                        f"{spec.name} exited with code {code}, {policy.restarts(spec.name)} "
                        f"times within {policy.window_s:g} s; stopping the mesh (its log is "
                        f"above; rerun it alone: kvmesh {' '.join(spec.argv)})"
                    )
                print(
                    f"kvmesh up: {spec.name} exited with code {code}; restarting it in "
                    f"{delay:g} s (death {policy.restarts(spec.name)} of at most "
                    f"{policy.max_restarts} in {policy.window_s:g} s)",
                    file=sys.stderr,
                    flush=True,
                )
                pending[spec.name] = now + delay
            for name, at in list(pending.items()):
                if now >= at:
                    del pending[name]
                    self._spawn(self.children[name][0])
                    print(f"kvmesh up: restarted {name}", file=sys.stderr, flush=True)
            await asyncio.sleep(poll_s)

    async def wait_ready(self) -> None:
        """Router /health OK and the registry sees every decode (and prefill) worker."""
        from kvmesh.shared.admin_client import AdminError, admin_client

        deadline = time.monotonic() + self.config.startup_timeout_s
        num_prefill = self.config.prefill if self.config.mode == "disagg" else 0
        num_draft = self.config.draft_workers if self.config.draft else 0
        waiting_for = "NATS"
        async with admin_client(
            self.nats_url,
            timeout_s=2.0,
            auth=self.nats_auth,
            mesh=self.mesh,
            security=self.config.nats_security,
        ) as admin:
            while time.monotonic() < deadline:
                self.check_alive()
                try:
                    status = await admin.status()
                except AdminError:
                    waiting_for = "the kv-registry"
                else:
                    num_decode = len(status["decode"])
                    prefills = [w for w in status["workers"] if w["role"] == "prefill"]
                    if num_decode < self.config.decode:
                        waiting_for = f"decode workers ({num_decode}/{self.config.decode})"
                    elif len(prefills) < num_prefill:
                        waiting_for = f"prefill workers ({len(prefills)}/{num_prefill})"
                    elif (
                        n := sum(1 for w in status["workers"] if w["role"] == "draft")
                    ) < num_draft:
                        waiting_for = f"draft workers ({n}/{num_draft})"
                    elif (n := len(status.get("stores", []))) < self.config.kv_store:
                        waiting_for = f"kv-stores ({n}/{self.config.kv_store})"
                    elif "note" in status.get("prefill_queue", {}) and num_prefill:
                        waiting_for = "the prefill queue (prefill-queue-0)"
                    elif not await asyncio.to_thread(self._router_healthy):
                        waiting_for = "the router"
                    else:
                        return
                await asyncio.sleep(0.25)
        raise LaunchError(
            f"the mesh was not ready within {self.config.startup_timeout_s:g}s: waiting for "
            f"{waiting_for} (raise --startup-timeout-s for big models)"
        )

    def nats_violations(self) -> list[str]:
        """What the nats-server we started refused a role (empty: every role kept to its
        permissions, or the server is not ours)."""
        return self.nats.permission_violations() if self.nats is not None else []

    def _router_healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2.0) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> None:
        """Stop tier by tier: SIGTERM each process group, SIGKILL what outlives the timeout."""
        for tier in TIERS:
            procs = [p for spec, p in self.children.values() if spec.tier == tier]
            for proc in procs:
                _signal_group(proc, signal.SIGTERM)
            deadline = time.monotonic() + self.config.stop_timeout_s
            for proc in procs:
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    _signal_group(proc, signal.SIGKILL)
                    proc.wait()
                _signal_group(proc, signal.SIGKILL)  # leftovers of the group (helpers)
        self.children.clear()
        if self.nats is not None:
            self.nats.stop()
            self.nats = None
        if self.state is not None:
            remove_state(self.state)
            self.state = None


async def workers_on(
    nats_url: str,
    listen_s: float = 1.2,
    auth: NatsAuth | None = None,
    *,
    mesh: str,
    security: NatsSecurity | None = None,
) -> set[str]:
    """Worker ids of mesh ``mesh`` heard on ``nats_url``: its registry's list, or heartbeats
    for ``listen_s``."""
    from kvmesh.shared.admin_client import AdminError, admin_client
    from kvmesh.shared.protocol import MessageError, WorkerHeartbeat, decode_message

    async with admin_client(
        nats_url, timeout_s=2.0, auth=auth, mesh=mesh, security=security
    ) as admin:
        try:
            return {w["worker_id"] for w in await admin.workers()}
        except AdminError:  # no registry: listen for heartbeats instead
            pass
        heard: set[str] = set()

        async def on_beat(msg) -> None:
            with contextlib.suppress(MessageError):
                heard.add(decode_message(msg.data, WorkerHeartbeat).worker_id)

        sub = await admin.nc.subscribe(admin.subjects.HEARTBEAT_ALL, cb=on_beat)
        await asyncio.sleep(listen_s)
        await sub.unsubscribe()
        return heard


def _run_sync(coro):
    """Run a coroutine to completion from sync code, also when called inside an event loop."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)  # start_new_session: pgid == pid


async def run_up(launcher: Launcher) -> int:
    from kvmesh.shared.nats_service import serve_until_signal

    stop = asyncio.Event()

    async def watch() -> None:
        if launcher.config.max_restarts > 0:
            await launcher.supervise(RestartPolicy(max_restarts=launcher.config.max_restarts))
        while True:  # no restarts: the first death stops the mesh
            launcher.check_alive()
            await asyncio.sleep(0.5)

    async def ready_then_watch() -> None:
        await launcher.wait_ready()
        print(
            f"kvmesh is up: {launcher.url}/v1 (mesh {launcher.mesh}, mode "
            f"{launcher.config.mode}, {launcher.config.decode} decode, "
            f"{launcher.config.prefill if launcher.config.mode == 'disagg' else 0} prefill, "
            + (
                f"{launcher.config.draft_workers} draft ({launcher.config.draft}), "
                if launcher.config.draft
                else ""
            )
            + f"NATS {redact_url(launcher.nats_url)}); Ctrl-C stops it",
            flush=True,
        )
        threads = ", ".join(f"{role} {n}" for role, n in split_cores(launcher.config).items())
        print(f"kvmesh up: torch threads per worker: {threads}", flush=True)
        print(f"kvmesh up: {cpu_plan(launcher.config).describe()}", flush=True)
        metrics = ", ".join(f"{name} {url}" for name, url in launcher.metrics_urls.items())
        print(f"kvmesh up: metrics: {metrics}", flush=True)
        await watch()

    task = asyncio.create_task(ready_then_watch())
    task.add_done_callback(lambda _: stop.set())
    if await serve_until_signal(stop) is not None:
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task  # raises LaunchError when a service died or never got ready
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "up",
        allow_abbrev=False,
        help="run the whole mesh locally (NATS, kv-registry, prefill, decode, router)",
        description=(__doc__ or "").strip().splitlines()[0],
    )
    add_config_arguments(parser, UpConfig)
    parser.set_defaults(func=_up)


def _up(args: argparse.Namespace) -> int:
    from kvmesh.shared.nats_server import NatsServerError
    from kvmesh.shared.service_errors import ServiceStartError, check_can_listen

    try:
        config = config_from_args(UpConfig, args)
    except ConfigError as exc:
        print(f"kvmesh up: {exc}", file=sys.stderr)
        return 2
    try:
        check_can_listen(config.host, config.port)  # before anything starts
        config = resolve_up_model(config)  # may fetch or import it (once per machine)
    except (ServiceStartError, ModelChoiceError) as exc:
        print(f"kvmesh up: {exc}", file=sys.stderr)
        return 1
    launcher = Launcher(config)
    signal.signal(signal.SIGTERM, _interrupt)  # while starting: SIGTERM acts like Ctrl-C
    try:
        launcher.start()
        return asyncio.run(run_up(launcher))
    except (LaunchError, NatsServerError) as exc:
        print(f"kvmesh up: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        # the shutdown is bounded by --stop-timeout-s per tier; do not let a second signal cut it
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("kvmesh up: stopping", file=sys.stderr)
        launcher.stop()
        print("kvmesh up: stopped", file=sys.stderr)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
