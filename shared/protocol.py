"""Every message kvmesh sends over NATS: frozen dataclasses and one codec (orjson).

Messages are small: token ids, block ids and addresses, never KV bytes. ``encode`` turns a
message into bytes; ``decode(data, Type)`` validates and rebuilds it, raising ProtocolError with
a message naming the type and the field when a peer sends something malformed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson

T = TypeVar("T")


class ProtocolError(ValueError):
    """A NATS message that does not decode into the expected type."""


# --- sampling ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """Wire form of the engine's SamplingParams."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


# --- placement (router -> kv-registry -> decode) -----------------------------------------------


@dataclass(frozen=True, slots=True)
class PlaceRequest:
    """Ask the registry for a decode worker and reserved blocks for one request."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingOptions
    local_prefill: bool  # the decode worker prefills the prompt itself
    lease_ms: int = 30_000
    # model_spec() of the router's model: only decode workers advertising the same one may take
    # the request ("" places on any, as before this field)
    model_spec: str = ""


@dataclass(frozen=True, slots=True)
class ReserveRequest:
    """Registry -> chosen decode worker: reserve blocks (or accept a local-prefill request)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingOptions
    local_prefill: bool
    lease_id: str
    lease_ms: int


@dataclass(frozen=True, slots=True)
class ReserveReply:
    ok: bool
    worker_id: str
    block_ids: tuple[int, ...] = ()
    error: str = ""
    # The key of the window the decode worker opened over exactly these blocks, for this lease
    # alone (closed when the lease ends); 0 for local prefill, which writes nothing remotely.
    rkey: int = 0


@dataclass(frozen=True, slots=True)
class PlaceReply:
    """Where the prefill must write: the decode worker's descriptor, the lease's window key and
    the block addresses."""

    ok: bool
    request_id: str
    worker_id: str = ""
    lease_id: str = ""
    descriptor: dict[str, Any] = field(default_factory=dict)  # transport PeerDescriptor.to_dict()
    rkey: int = 0
    block_ids: tuple[int, ...] = ()
    block_addrs: tuple[int, ...] = ()
    block_bytes: int = 0
    error: str = ""
    retry_after_s: float = 0.0  # > 0: overloaded, try again later (HTTP 429/503)


# --- prefill ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PrefillJob:
    """Router -> prefill queue group: compute this prompt's KV into these remote blocks."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingOptions
    decode_worker_id: str
    lease_id: str
    descriptor: dict[str, Any]
    rkey: int
    block_addrs: tuple[int, ...]
    block_bytes: int
    enqueued_at: float  # unix time the router published the job


def model_spec(model_config: Any) -> str:
    """What a router and a decode worker must agree on to serve one model: its KV layout per
    token (layers, KV heads, head size) and a digest of its architecture, vocabulary and special
    tokens. Independent of the weights' dtype, the block size and where the checkpoint lies, so
    the router (which reads only config.json) computes the same string as the decode workers."""
    fields = {
        f.name: getattr(model_config, f.name)
        for f in dataclasses.fields(model_config)
        if f.name not in _NOT_MODEL_IDENTITY
    }
    digest = hashlib.blake2b(repr(sorted(fields.items())).encode(), digest_size=4).hexdigest()
    mc = model_config
    layout = f"L{mc.num_hidden_layers}-H{mc.num_key_value_heads}-D{mc.head_dim}"
    return f"{layout}:model-{digest}"


# ModelConfig fields that say how a model is stored or loaded, not which model it is
_NOT_MODEL_IDENTITY = frozenset({"dtype", "source", "extra"})


def kv_spec_fingerprint(spec: Any, model_config: Any) -> str:
    """``DecodeAdvert.kv_spec``: the KV layout (``KVCacheSpec.fingerprint()``) plus a digest of
    the model config. Prefill and decode exchange blocks only when these strings are equal."""
    digest = hashlib.blake2b(repr(model_config).encode(), digest_size=4).hexdigest()
    return f"{spec.fingerprint()}:model-{digest}"


@dataclass(frozen=True, slots=True)
class PrefillDone:
    """Prefill -> decode worker: every write of the request has been issued and completed."""

    request_id: str
    lease_id: str
    ok: bool
    first_token: int = -1
    num_writes: int = 0  # the decode worker admits once it has counted this many immediates
    error: str = ""
    # The lease's window key from the job: only the holder of the job knows it, so the decode
    # worker ignores an announcement without it.
    rkey: int = 0


@dataclass(frozen=True, slots=True)
class PrefillReport:
    """Prefill -> router: where the time went (seconds)."""

    request_id: str
    worker_id: str
    queue_s: float
    compute_s: float
    transfer_s: float
    exposed_transfer_s: float  # transfer time not hidden behind compute
    num_chunks: int


# --- tokens and cancellation ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """Decode -> router: new tokens of one request; the last one has finish_reason set."""

    request_id: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str = ""


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str
    reason: str = "client disconnected"
    # The router took the prefill job off the queue before any worker took it: nothing will
    # ever write the reserved blocks, so the decode worker may free them at once.
    job_withdrawn: bool = False


@dataclass(frozen=True, slots=True)
class PrefillStarted:
    """Prefill -> router (request subject) and decode worker: this worker took the job. The router
    retries the request elsewhere if this worker dies before the first token; the decode worker
    knows whose writes to expect, so it can free the blocks at once when that writer is gone."""

    request_id: str
    lease_id: str
    worker_id: str


@dataclass(frozen=True, slots=True)
class WorkerGone:
    """kv-registry -> everyone: a worker stopped heartbeating (dead, hung or cut off)."""

    worker_id: str
    role: str
    last_seen_s: float  # seconds between its last message and the drop


@dataclass(frozen=True, slots=True)
class LeaseRenew:
    """Lease holder -> decode worker (and registry): still waiting for this prefill; keep the
    blocks ``lease_ms`` more. A lease ends when its holder stops renewing, not when work is slow."""

    request_id: str
    lease_id: str
    lease_ms: int


# --- workers, registry, admin -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkerHeartbeat:
    worker_id: str
    role: str  # "prefill" | "decode" | "colocated" | "router" | "kv-registry" | "draft"
    state: str  # "ready" | "draining"
    num_running: int = 0
    num_waiting: int = 0
    started_at: float = 0.0
    sent_at: float = 0.0


@dataclass(frozen=True, slots=True)
class DecodeAdvert:
    """Decode -> registry, on start and every heartbeat: how to reach it and what it has free."""

    worker_id: str
    mode: str  # "disagg" | "colocated"
    # PeerDescriptor.public(): no region keys (kept only on rdma NICs without memory windows)
    descriptor: dict[str, Any]
    base_addr: int
    block_bytes: int
    block_size: int
    kv_spec: str  # KVCacheSpec fingerprint: prefill and decode must match
    total_blocks: int
    free_blocks: int
    free_block_ranges: tuple[tuple[int, int], ...]  # [start, end) runs of free block ids
    num_running: int
    num_waiting: int
    state: str  # "ready" | "draining"
    sent_at: float
    refused_accesses: int = 0  # one-sided writes/reads its transport refused (rkey, bounds, ...)
    stray_immediates: int = 0  # immediates that named no live reservation (late or forged)
    forged_announcements: int = 0  # PrefillDones without their lease's window key
    model_spec: str = ""  # model_spec() of the model it serves: routers of that model place here


@dataclass(frozen=True, slots=True)
class WorkerControl:
    action: str  # "drain" | "resume"


@dataclass(frozen=True, slots=True)
class LogLevel:
    level: str


# --- codec ------------------------------------------------------------------------------------


def encode(msg: Any) -> bytes:
    assert dataclasses.is_dataclass(msg), type(msg)
    return orjson.dumps(msg)


def decode(data: bytes, cls: type[T]) -> T:
    try:
        raw = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"{cls.__name__}: body is not JSON ({exc})") from None
    return _build(cls, raw, cls.__name__)


def _build(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected an object, got {type(value).__name__}")
        hints = typing.get_type_hints(tp)
        kwargs = {}
        for f in dataclasses.fields(tp):
            if f.name in value:
                kwargs[f.name] = _build(hints[f.name], value[f.name], f"{where}.{f.name}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ProtocolError(f"{where}: missing field {f.name!r}")
        unknown = set(value) - {f.name for f in dataclasses.fields(tp)}
        if unknown:
            raise ProtocolError(f"{where}: unknown fields {sorted(unknown)}")
        return tp(**kwargs)
    if origin in (types.UnionType, typing.Union):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _build(arg, value, where)
            except ProtocolError:
                continue
        raise ProtocolError(f"{where}: {value!r} matches none of {tp}")
    if origin is tuple:
        if not isinstance(value, list):
            raise ProtocolError(f"{where}: expected a list, got {type(value).__name__}")
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_build(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
        if len(args) != len(value):
            raise ProtocolError(f"{where}: expected {len(args)} items, got {len(value)}")
        return tuple(
            _build(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True))
        )
    if origin is dict:
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected an object, got {type(value).__name__}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ProtocolError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp in (int, str, bool):
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            raise ProtocolError(f"{where}: expected {tp.__name__}, got {value!r}")
        return value
    if tp is Any:
        return value
    raise AssertionError(f"unsupported type {tp} at {where}")
