"""RouterConfig: every knob of the router, from flags and KVMESH_* env (kvmesh.shared.config.service_config)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from kvmesh.shared.config.service_config import check_at_least, check_positive, option
from kvmesh.shared.config.subjects import mesh_from_model
from kvmesh.shared.config.worker_config import ServiceConfig
from kvmesh.shared.text.schema_limits import SchemaLimits

# descriptors the router keeps for what is not an HTTP connection (NATS, the model's files, the
# listener, logs) when the open-file limit caps --max-connections
FD_RESERVE = 128
MAX_CONNECTIONS = 2048  # --max-connections' default


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """What one HTTP client may hold of the router (services/router/http_limits.py); the flags
    and their defaults are RouterConfig's."""

    header_timeout_s: float
    body_timeout_s: float
    max_connections_per_client: int
    max_connections: int = MAX_CONNECTIONS

    def __post_init__(self) -> None:
        check_positive(self, "header_timeout_s", "body_timeout_s")
        check_at_least(self, 1, "max_connections_per_client", "max_connections")

    def within_open_files(self, open_file_limit: int) -> HttpLimits:
        """These limits with ``max_connections`` lowered to leave ``FD_RESERVE`` descriptors of
        ``open_file_limit`` to everything else (NATS, files, the listener)."""
        room = max(1, open_file_limit - FD_RESERVE)
        return dataclasses.replace(self, max_connections=min(self.max_connections, room))


@dataclass(frozen=True, slots=True)
class RouterConfig(ServiceConfig):
    host: str = option(
        "127.0.0.1",
        help="HTTP listen address of the API and /metrics (0.0.0.0: every interface, to serve "
        "other hosts and let a Prometheus elsewhere scrape it)",
    )
    port: int = option(8000, help="HTTP port (0 picks a free one)")
    reuse_port: bool = option(
        False,
        help="bind the port with SO_REUSEPORT, so that several routers of this user serve one "
        "port and the kernel spreads new connections over the live ones (kvmesh up --routers)",
    )
    model: str = option("kvmesh-tiny", help="model name or local HF checkpoint directory")
    served_model_name: str | None = option(
        None, help="model id clients send and /v1/models lists (default: --model)"
    )
    max_model_len: int | None = option(
        None, help="context length (default: the model's max_position_embeddings)"
    )
    mode: Literal["disagg", "colocated"] = option(
        "disagg", help="disagg: remote prefill for long prompts; colocated: decode prefills all"
    )
    local_prefill_threshold: int = option(
        64, help="prompts shorter than this many tokens are prefilled by the decode worker"
    )
    lease_ms: int = option(
        30_000,
        help="lease on the reserved decode blocks (ms); the router renews it every third of it "
        "until the first token, so it runs out only when the router is gone",
    )
    place_timeout_s: float = option(
        5.0,
        help="how long to wait for the kv-registry to place; with no answer by then (it died "
        "holding the request) the placement is asked again, of the next registry",
    )
    first_token_timeout_s: float = option(
        300.0, help="how long to wait for a request's first token (covers queueing and prefill)"
    )
    token_timeout_s: float = option(30.0, help="how long to wait for each next token")
    max_concurrent_requests: int = option(
        1024,
        help="requests accepted at once (served or waiting in the admission queue for room on "
        "the mesh); more are refused with 429 and Retry-After",
    )
    worker_liveness_s: float = option(
        3.0,
        help="a worker silent this long counts as gone: with no prefill worker, long prompts are "
        "prefilled on the decode worker; with no decode worker, /health and requests are 503",
    )
    max_retries: int = option(
        2,
        help="times a request is run again when a worker it depends on dies: before its first "
        "token it starts over; after it, the stream migrates to another decode worker, with the "
        "prompt plus the output so far as the new prompt (0: fail at once)",
    )
    api_key: str | None = option(
        None,
        help="require 'Authorization: Bearer <key>' on the /v1 routes (as OpenAI and vLLM do); "
        "prefer KVMESH_API_KEY to the flag, which other local users can read in ps",
        secret=True,
    )
    api_keys: str | None = option(
        None,
        help="more API keys, comma-separated, each a tenant (with --api-key, --api-keys-file); "
        "prefer KVMESH_API_KEYS to the flag",
        secret=True,
    )
    api_keys_file: str | None = option(
        None, help="a file of API keys, one a line (# starts a comment), each a tenant"
    )
    admin_api_key: str | None = option(
        None,
        help="an API key that also sees every tenant's /v1/kvmesh/timings (other keys see "
        "their own requests only); prefer KVMESH_ADMIN_API_KEY",
        secret=True,
    )
    salt_by_api_key: bool | None = option(
        None,
        help="salt each request's cached prompt blocks by its API key, so tenants never share "
        "them (nor time each other's prompts); default: on with several API keys",
    )
    max_body_mb: float = option(
        8.0,
        help="largest request body accepted (MiB; a prompt of a million token ids is ~7 MiB); a "
        "larger one is a JSON 413, refused from its Content-Length before it is read",
    )
    header_timeout_s: float = option(
        10.0,
        help="a request's headers must arrive within this many seconds (of the connection's "
        "start, or of the answer before on a kept-alive one); the connection is closed after",
    )
    body_timeout_s: float = option(
        30.0, help="a request's body must arrive within this many seconds (a 408 after it)"
    )
    max_connections_per_client: int = option(
        64, help="connections one client address may hold open at once; more are closed at once"
    )
    max_connections: int = option(
        MAX_CONNECTIONS,
        help="HTTP connections the router holds in all (at most the open-file limit less 128); "
        "a new one over it closes the oldest connection waiting for a request, or is closed",
    )
    shutdown_grace_s: float = option(
        5.0,
        help="on SIGTERM/SIGINT: new requests get 503 at once, and those in flight may finish "
        "for this long; then streams still running end with an SSE error event and [DONE], "
        "other requests with a 503, their mesh work is aborted, and the router exits",
    )
    client_send_buffer_kb: int = option(
        256,
        help="bytes of a stream the router holds for a client that reads slower than the mesh "
        "writes (KiB, besides the socket's own buffers); a client past it is cut off and its "
        "request aborted",
    )
    client_write_timeout_s: float = option(
        10.0,
        help="a stream whose client takes no bytes for this long (its socket is full) is cut off "
        "and its request aborted",
    )
    tool_call_parser: Literal["auto", "hermes", "llama3_json"] = option(
        "auto",
        help="how a chat answer's tool calls are read when tool_choice is auto: hermes "
        '(<tool_call>{json}</tool_call>) or llama3_json ({"name", "parameters"} objects); '
        "auto: the one the model's chat template writes, else hermes",
    )
    max_schema_depth: int = option(
        64,
        help="a structured output's JSON schema may nest objects and arrays this deep at most "
        "(grammar build time grows about as its cube); deeper is a 400",
    )
    max_schema_nodes: int = option(
        4096, help="objects and arrays a structured output's JSON schema may hold in all"
    )
    max_schema_branches: int = option(
        512, help="anyOf/oneOf/allOf entries a structured output's JSON schema may hold in all"
    )
    max_schema_refs: int = option(128, help="$ref a structured output's JSON schema may hold")
    max_regex_chars: int = option(
        1000,
        help="longest regex of a structured output (guided_regex, or a schema's pattern or "
        "patternProperties key)",
    )
    worker_id: str | None = option(
        None, help="this router's id in heartbeats and $SRV (default: generated)"
    )
    heartbeat_s: float = option(2.0, help="seconds between heartbeats")

    def http_limits(self) -> HttpLimits:
        return HttpLimits(
            self.header_timeout_s,
            self.body_timeout_s,
            self.max_connections_per_client,
            self.max_connections,
        )

    def schema_limits(self) -> SchemaLimits:
        return SchemaLimits(
            self.max_schema_depth,
            self.max_schema_nodes,
            self.max_schema_branches,
            self.max_schema_refs,
            self.max_regex_chars,
        )

    def __post_init__(self) -> None:
        ServiceConfig.__post_init__(self)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not self.model:
            raise ValueError("model must name a model or a checkpoint directory")
        self.http_limits()  # ValueError names the bad limit
        self.schema_limits()
        for name in ("api_key", "admin_api_key"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise ValueError(f"{name} must not be empty (leave it unset for no key)")
        if self.api_keys is not None and not all(k.strip() for k in self.api_keys.split(",")):
            raise ValueError("api_keys must be non-empty keys separated by commas")
        if self.served_model_name == "":
            raise ValueError("served_model_name must not be empty (leave it unset for --model)")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.local_prefill_threshold < 0:
            raise ValueError(
                f"local_prefill_threshold must be >= 0 (0: always prefill remotely), "
                f"got {self.local_prefill_threshold}"
            )
        check_at_least(self, 0, "shutdown_grace_s", "max_retries")
        check_at_least(self, 1, "lease_ms", "max_concurrent_requests", "client_send_buffer_kb")
        check_positive(
            self,
            "place_timeout_s",
            "first_token_timeout_s",
            "token_timeout_s",
            "worker_liveness_s",
            "max_body_mb",
            "client_write_timeout_s",
        )

    def read_api_keys(self) -> list[str]:
        """Every tenant key: --api-key, --api-keys and the lines of --api-keys-file (read now;
        OSError names the file). The admin key is apart."""
        keys = [self.api_key] if self.api_key else []
        keys += [k.strip() for k in (self.api_keys or "").split(",") if k.strip()]
        if self.api_keys_file:
            with open(self.api_keys_file, encoding="utf-8") as f:
                lines = (line.split("#", 1)[0].strip() for line in f)
                keys += [line for line in lines if line]
        return keys

    def default_mesh(self) -> str:
        return mesh_from_model(self.model)

    @property
    def model_id(self) -> str:
        """The name clients use for the model."""
        return self.served_model_name or self.model
