"""Every message kvmesh sends over NATS, each defined once as a frozen msgspec Struct.

Messages are small: token ids, block ids and addresses, never KV bytes. The Struct is the schema:
``encode_message`` writes it as JSON, ``decode_message(data, Type)`` validates JSON against it
(types, required fields, no unknown fields, the bounds in its ``Meta``) and raises
``MessageError`` naming the type and the field when a peer sends something malformed. Why msgspec
and not pydantic: docs/schema.md.
"""

from __future__ import annotations

import functools
import re
from typing import Annotated, TypeVar

import msgspec
from kvmesh.shared.kv.descriptor import TransportDescriptor
from kvmesh.shared.text.sampling import SamplingOptions, TokenLogprobs


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Base of every NATS message: immutable, and refused on decode if it carries a field the
    receiver does not know (a peer of another version, or a typo)."""


M = TypeVar("M", bound=Message)


class MessageError(ValueError):
    """A NATS message that does not decode into the expected message type."""


# --- placement (router -> kv-registry -> decode) -----------------------------------------------


class PlaceRequest(Message):
    """Ask the registry for a decode worker and reserved blocks for one request."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingOptions
    local_prefill: bool  # the decode worker prefills the prompt itself
    lease_ms: int = 30_000
    # model_spec() of the router's model: only decode workers advertising the same one may take
    # the request ("" places on any, as before this field)
    model_spec: str = ""
    # the instance of the router that holds the request (its heartbeats'): when the registry
    # announces that router gone, decode and prefill drop its requests ("" never)
    router: str = ""


class ReserveRequest(Message):
    """Registry -> chosen decode worker: reserve blocks (or accept a local-prefill request)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingOptions
    local_prefill: bool
    lease_id: str
    lease_ms: int
    router: str = ""  # PlaceRequest.router: the request ends if that router is gone


class DecodeRankTarget(Message):
    """Where one tensor-parallel decode rank (1..TP-1) holds a reservation's blocks, for the
    prefill rank(s) writing that rank's KV heads (docs/tp.md): the key of the window it opened
    over the blocks for this lease alone, their addresses in its region, and its transport
    descriptor. The blocks are the same ids on every rank; rank 0's are the message's own fields."""

    rkey: int
    block_addrs: tuple[int, ...]
    descriptor: TransportDescriptor


class ReserveReply(Message):
    """Decode worker -> registry: the blocks it reserved (or why it could not)."""

    ok: bool
    worker_id: str
    block_ids: tuple[int, ...] = ()
    error: str = ""
    # The key of the window the decode worker opened over exactly these blocks, for this lease
    # alone (closed when the lease ends); 0 for local prefill, which writes nothing remotely.
    rkey: int = 0
    # Where those blocks are in its registered region (the prefill's write targets). A memory
    # address travels only in the messages of one lease, beside its window key (this reply,
    # the PlaceReply, the PrefillJob), never in a broadcast advert (issue 40).
    block_addrs: tuple[int, ...] = ()
    # a tensor-parallel decode worker's ranks 1..TP-1 (rank 0's are the fields above); empty at
    # TP1
    ranks: tuple[DecodeRankTarget, ...] = ()


class PlaceReply(Message):
    """Where the prefill must write: the decode worker's descriptor, the lease's window key and
    the block addresses."""

    ok: bool
    request_id: str
    worker_id: str = ""
    lease_id: str = ""
    descriptor: TransportDescriptor | None = None  # None unless ok
    rkey: int = 0
    block_ids: tuple[int, ...] = ()
    block_addrs: tuple[int, ...] = ()
    block_bytes: int = 0
    error: str = ""
    retry_after_s: float = 0.0  # > 0: overloaded, try again later (HTTP 429/503)
    # The registry placed a remote-prefill request where its prefix is cached (or readable from a
    # kv-store) and had the decode worker prefill the short suffix past it itself: no prefill job
    # is to be published.
    local_prefill: bool = False
    cached_tokens: int = 0  # prompt tokens the registry expects the worker's prefix cache to hold
    ranks: tuple[DecodeRankTarget, ...] = ()  # ReserveReply.ranks: a TP decode worker's others


# --- prefill ----------------------------------------------------------------------------------


class PrefillJob(Message):
    """Router -> prefill queue group: compute this prompt's KV into these remote blocks."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingOptions
    decode_worker_id: str
    lease_id: str
    descriptor: TransportDescriptor
    rkey: int
    block_addrs: tuple[int, ...]
    block_bytes: int
    enqueued_at: float  # unix time the router published the job
    router: str = ""  # PlaceRequest.router: the job is dropped if that router is gone
    # PlaceReply.ranks: a tensor-parallel decode worker's ranks 1..TP-1, each holding its share
    # of the KV heads (descriptor, rkey, block_addrs above are rank 0's); empty at TP1
    ranks: tuple[DecodeRankTarget, ...] = ()


class PrefillDone(Message):
    """Prefill -> decode worker: every write of the request has been issued and completed."""

    request_id: str
    lease_id: str
    ok: bool
    first_token: int = -1
    # the decode worker admits once it has counted this many immediates (a tensor-parallel one:
    # each of its ranks, every rank taking as many writes of a job)
    num_writes: int = 0
    error: str = ""
    # The lease's window key from the job: only the holder of the job knows it, so the decode
    # worker ignores an announcement without it.
    rkey: int = 0
    # To the decode worker: the draft worker that received the prompt's draft KV through the
    # data plane ("" if none did); the decode worker sends that worker the first DraftContext.
    draft_worker_id: str = ""
    first_logprobs: TokenLogprobs | None = None  # the first token's, when the options ask
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # of prompt tokens 1.., when they ask


class PrefillReport(Message):
    """Prefill -> router: where the time went (seconds)."""

    request_id: str
    worker_id: str
    queue_s: float
    compute_s: float
    transfer_s: float
    exposed_transfer_s: float  # transfer time not hidden behind compute
    num_chunks: int


# --- tokens and cancellation ------------------------------------------------------------------


class TokenEvent(Message):
    """Decode -> router: new tokens of one request; the last one has finish_reason set."""

    request_id: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str = ""
    # of token_ids, how many were draft tokens the decode worker verified and accepted
    num_accepted_drafts: Annotated[int, msgspec.Meta(ge=0)] = 0
    # Only on a request's first event, where the decode worker's time went before it (seconds):
    # wait_s: a local prefill, accepted to its first chunk computed; a remote one, its prefill
    # heard done to admitted (the step in flight). prefill_s: a local prefill's first chunk to
    # its first token (the steps it shared with other sequences included); 0 for a remote one.
    wait_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    prefill_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    # with SamplingOptions.logprobs: one per token of token_ids
    logprobs: tuple[TokenLogprobs, ...] = ()
    # which of the request's SamplingOptions.n choices; num_output_tokens and finish_reason are
    # that choice's (the request ends when each choice has finished)
    index: Annotated[int, msgspec.Meta(ge=0)] = 0
    # with SamplingOptions.prompt_logprobs, on choice 0's first event: of prompt tokens 1..
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()


class Abort(Message):
    """Router (or decode worker) -> everyone: stop working on this request."""

    request_id: str
    reason: str = "client disconnected"
    # The router took the prefill job off the queue before any worker took it: nothing will
    # ever write the reserved blocks, so the decode worker may free them at once.
    job_withdrawn: bool = False


class PrefillStarted(Message):
    """Prefill -> router (request subject) and decode worker: this worker took the job. The router
    retries the request elsewhere if this worker dies before the first token; the decode worker
    knows whose writes to expect, so it can free the blocks at once when that writer is gone."""

    request_id: str
    lease_id: str
    worker_id: str


class WorkerGone(Message):
    """kv-registry -> everyone: a worker stopped heartbeating (dead, hung or cut off)."""

    worker_id: str
    role: str
    last_seen_s: float  # seconds between its last message and the drop
    # the gone process's WorkerHeartbeat.instance ("" if it sent none): a router's requests
    # carry it (PlaceRequest.router), and decode and prefill drop them
    instance: str = ""


class LeaseRenew(Message):
    """Lease holder -> decode worker (and registry): still waiting for this prefill; keep the
    blocks ``lease_ms`` more. A lease ends when its holder stops renewing, not when work is slow."""

    request_id: str
    lease_id: str
    lease_ms: int


class LeaseCancel(Message):
    """Registry -> decode worker: a reservation it asked for under ``lease_id`` was never handed
    to anyone (the reply did not come in time, so the request went elsewhere): free its blocks,
    or refuse the reservation if it has not arrived yet."""

    request_id: str
    lease_id: str
    reason: str = "no reserve reply in time"


# --- resuming a stream through another router (docs/faults.md) -------------------------------


class StreamLookup(Message):
    """Router -> every decode worker (request; the router gathers the replies): which of you
    holds the stream of the client request ``request_id``?"""

    request_id: str


class StreamHolder(Message):
    """Decode worker -> router: ``wire_id``, the latest attempt of the looked-up request that
    this worker logged ("" for none; ``expired``: it had one and forgot it, its grace over)."""

    worker_id: str
    wire_id: str = ""
    expired: bool = False


class StreamResume(Message):
    """Router -> the decode worker holding a stream (request/reply): its events so far. The
    router's instance ``router`` serves the stream from now on: the stream is no longer its
    old router's (whose death would abort it)."""

    wire_id: str
    router: str
    num_prompt_tokens: Annotated[int, msgspec.Meta(ge=1)]  # of the client's request


class StreamReplay(Message):
    """Decode worker -> router: the stream's TokenEvents from its first token, in order (a
    migrated attempt's earlier output in ``prior_token_ids``); ``error`` says why it cannot be
    resumed (then no events)."""

    events: tuple[TokenEvent, ...] = ()
    prior_token_ids: tuple[int, ...] = ()
    error: str = ""


# --- speculative decoding (decode <-> draft) -------------------------------------------------


class DraftContext(Message):
    """Decode worker -> draft workers: the tokens of one decoding sequence from position
    ``start`` on. ``start`` 0 carries the whole context (prompt + output); later messages carry
    only what was appended since the last one. A draft worker that does not hold the tokens
    before ``start`` answers with ``DraftProposal(need_context=True)``."""

    request_id: str
    decode_worker_id: str
    start: Annotated[int, msgspec.Meta(ge=0)]
    token_ids: tuple[int, ...]
    num_prompt_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    # How the decode worker fared with this draft worker's proposals since the last message:
    # draft tokens on the verified paths, and how many of them it accepted.
    num_verified: Annotated[int, msgspec.Meta(ge=0)] = 0
    num_accepted: Annotated[int, msgspec.Meta(ge=0)] = 0


class DraftProposal(Message):
    """Draft worker -> the sequence's decode worker: a tree of draft tokens that continues the
    sequence when it has exactly ``position`` tokens (stale otherwise, and dropped).
    ``parents[i]`` is the index of node i's parent, -1 for the sequence's last token; a chain
    is ``parents == (-1, 0, 1, ...)``. A tree may reach ``depth`` plus a few tokens deeper
    (lookahead): by the time it arrives the sequence may have grown by tokens that lie on one
    of its paths, and the subtree below them is then still a valid proposal (``depth`` deep at
    most: the decode worker cuts the rest)."""

    request_id: str
    draft_worker_id: str
    position: Annotated[int, msgspec.Meta(ge=1)]
    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    need_context: bool = False  # the draft worker lost the sequence: send it from start 0
    depth: Annotated[int, msgspec.Meta(ge=0)] = 0  # verify at most this deep (0: no limit)


class DraftForget(Message):
    """Decode worker -> the draft worker that holds a sequence: it finished or was aborted."""

    request_id: str


class DraftKvReserve(Message):
    """Prefill -> any early-exit or model draft worker (request, queue group ``draft``):
    reserve blocks for the prompt's full blocks of draft KV, to be written by this prefill
    worker."""

    request_id: str
    lease_id: str
    prompt_ids: tuple[int, ...]
    kv_spec: str  # the prefill worker's KV layout (kv_spec_fingerprint): the draft's target's
    lease_ms: Annotated[int, msgspec.Meta(ge=1)]
    # the KV layout of the draft model the prefill worker runs beside its target (--draft-model;
    # kv_spec_fingerprint): a model draft worker reserves only for its own; "" runs none
    draft_kv_spec: str = ""


class DraftKvReserveReply(Message):
    """Draft worker -> prefill: where to write the first ``num_layers`` layers of each full
    prompt block (early exit) or, with ``whole_blocks``, the prefill's draft model's whole
    blocks (model), into a window over exactly these blocks (key ``rkey``); or why not."""

    ok: bool
    worker_id: str
    descriptor: TransportDescriptor | None = None  # None unless ok
    rkey: int = 0
    block_addrs: tuple[int, ...] = ()
    block_bytes: int = 0
    num_layers: int = 0
    error: str = ""
    whole_blocks: bool = False  # a model draft worker's: blocks of the draft model's layout


# --- workers, registry, admin -----------------------------------------------------------------


class WorkerHeartbeat(Message):
    """Every worker -> registry and routers, periodically: alive, and how busy."""

    worker_id: str
    role: (
        str  # "prefill" | "decode" | "colocated" | "router" | "kv-registry" | "draft" | "kv-store"
    )
    # "ready" | "draining" | "starting" (a decode worker that reached NATS and is loading its
    # model: not placeable yet, but coming; routers wait for it rather than refuse)
    state: str
    num_running: int = 0
    num_waiting: int = 0
    started_at: float = 0.0
    sent_at: float = 0.0
    # a router's: unique to its process (a restart under the same worker id is another
    # instance); the requests it places carry it (PlaceRequest.router)
    instance: str = ""
    # seconds between its heartbeats, when it says (0: unsaid): the registry drops it only
    # after missing that many of them, from its first heartbeat on (a router's death drops its
    # requests, so a router slower than the registry's interval must not be counted dead)
    interval_s: float = 0.0
    # a prefill worker's tensor-parallel degree: its rank processes, one worker (docs/tp.md)
    tp: Annotated[int, msgspec.Meta(ge=1)] = 1


class DecodeAdvert(Message):
    """Decode -> registry, on start and every heartbeat: how to reach it and what it has free."""

    worker_id: str
    mode: str  # "disagg" | "colocated"
    # TransportDescriptor.public(): no region keys (kept only on rdma NICs without memory windows);
    # None for a colocated worker, which takes no remote writes
    descriptor: TransportDescriptor | None
    # no memory address (issue 40: it was base_addr): a reservation's reply carries its blocks'
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
    # it reads a local prefill's missing prefix blocks from a kv-store first (--use-kv-store with
    # a transport and prefix caching): placement counts what the store holds as within its reach
    reads_kv_store: bool = False
    # its tensor-parallel degree: TP ranks, each holding 1/tp of the KV heads (block_bytes is one
    # rank's block); a reservation's reply names every rank's blocks (ReserveReply.ranks)
    tp: Annotated[int, msgspec.Meta(ge=1)] = 1


# --- prefix cache events (decode -> kv-registry) --------------------------------------------
# Block hashes are shared/kv/prefix_hash.py's chain, rooted in the worker's KV layout: the registry
# indexes which worker holds which prefix and places requests where their prefix is cached.

MAX_CACHE_EVENT_HASHES = 16_384  # per message: a digest of a larger cache sends its newest ones


class KvCacheEvents(Message):
    """Decode -> registry, batched every ``--cache-events-interval-s``: block hashes that entered
    (``stored``) or left (``removed``) the worker's prefix cache since its previous message.
    ``seq`` counts this worker's event and digest messages from 1 (per process, see ``epoch``):
    a registry that sees a gap knows it missed changes and waits for the next digest."""

    worker_id: str
    epoch: str  # the worker's process incarnation: a restarted worker starts a new sequence
    seq: Annotated[int, msgspec.Meta(ge=1)]
    stored: Annotated[tuple[int, ...], msgspec.Meta(max_length=MAX_CACHE_EVENT_HASHES)] = ()
    removed: Annotated[tuple[int, ...], msgspec.Meta(max_length=MAX_CACHE_EVENT_HASHES)] = ()


class KvCacheDigest(Message):
    """Decode -> registry, every ``--cache-digest-interval-s`` and whenever an event batch
    overflowed: the hashes the worker's prefix cache holds now (the newest
    MAX_CACHE_EVENT_HASHES when it holds more). It replaces what the registry knew of the worker;
    events with a higher ``seq`` follow it."""

    worker_id: str
    epoch: str
    seq: Annotated[int, msgspec.Meta(ge=1)]
    hashes: Annotated[tuple[int, ...], msgspec.Meta(max_length=MAX_CACHE_EVENT_HASHES)] = ()
    num_cached_blocks: Annotated[int, msgspec.Meta(ge=0)] = 0  # all of them, sent or not


# --- KV store (decode/prefill <-> kv-store; docs/kv_store.md) -------------------------------
# Blocks are named by the prefix hash chain rooted in the KV layout (``kv_spec``); a store holds
# one layout and refuses requests naming another. Bytes move one-sided on the data plane, through
# a window per put or get; these messages carry hashes, addresses and window keys only.

MAX_STORE_BLOCKS = 16_384  # hashes per put or get


class StorePut(Message):
    """Writer -> store: reserve slots for these blocks (the ones it does not hold yet)."""

    client_id: str
    kv_spec: str
    block_hashes: Annotated[
        tuple[int, ...], msgspec.Meta(min_length=1, max_length=MAX_STORE_BLOCKS)
    ]
    lease_ms: Annotated[int, msgspec.Meta(ge=1)] = 30_000


class StorePutReply(Message):
    """Store -> writer: ``present`` are stored already; write ``write_hashes[i]`` at
    ``block_addrs[i]`` and its header at ``header_addrs[i]`` with window key ``rkey``, then
    commit. Hashes in neither list found no room."""

    ok: bool
    store_id: str
    put_id: str = ""
    rkey: int = 0
    present: tuple[int, ...] = ()
    write_hashes: tuple[int, ...] = ()
    block_addrs: tuple[int, ...] = ()
    header_addrs: tuple[int, ...] = ()
    block_bytes: int = 0
    error: str = ""
    retry_after_s: float = 0.0  # > 0: full of pinned blocks right now


class StoreCommit(Message):
    """Writer -> store: every write of the put has returned; check and index the blocks.
    ``rkey`` is the put's window key (only its writer knows it)."""

    put_id: str
    rkey: int


class StoreCommitReply(Message):
    ok: bool
    committed: tuple[int, ...] = ()
    rejected: tuple[int, ...] = ()  # bad header or bytes: freed, never served
    error: str = ""


class StoreGet(Message):
    """Reader -> store: pin the longest leading run of these blocks that is stored."""

    client_id: str
    kv_spec: str
    block_hashes: Annotated[
        tuple[int, ...], msgspec.Meta(min_length=1, max_length=MAX_STORE_BLOCKS)
    ]
    lease_ms: Annotated[int, msgspec.Meta(ge=1)] = 30_000


class StoreGetReply(Message):
    """Store -> reader: read ``block_hashes[i]`` from ``block_addrs[i]`` and its header from
    ``header_addrs[i]`` with read-window key ``rkey``, verify, then release. No hashes: a miss."""

    ok: bool
    store_id: str
    get_id: str = ""
    rkey: int = 0
    block_hashes: tuple[int, ...] = ()
    block_addrs: tuple[int, ...] = ()
    header_addrs: tuple[int, ...] = ()
    block_bytes: int = 0
    error: str = ""


class StoreRelease(Message):
    """Reader -> store: done reading; the window closes and the pins drop."""

    get_id: str
    rkey: int


class StoreAck(Message):
    ok: bool
    error: str = ""


class StoreAdvert(Message):
    """Store -> registry (and clients), every heartbeat: how to reach it, what it holds."""

    store_id: str
    epoch: str  # this process's incarnation: a restarted store is empty
    descriptor: TransportDescriptor  # .public(): no region keys
    kv_spec: str
    block_bytes: int
    block_size: int
    total_blocks: int
    used_blocks: int
    pinned_blocks: int
    hits: int
    misses: int
    evictions: int
    bytes_written: int
    bytes_read: int
    refused_accesses: int
    state: str  # "ready" | "draining"
    sent_at: float
    # the disk tier (--disk-path; all 0 without one): slots, blocks held, gets' blocks found
    # there (of ``hits``), blocks dropped from it to make room
    disk_total_blocks: int = 0
    disk_used_blocks: int = 0
    disk_hits: int = 0
    disk_evictions: int = 0


class StoreSolicit(Message):
    """A store reader that starts (a prefill or decode worker reading or writing stores, the
    kv-registry) -> every kv-store: advertise yourself now, not at your next heartbeat."""

    sender: str  # the worker id that asks (for the logs)


class WorkerControl(Message):
    """Admin -> one worker: stop taking work, or take it again."""

    action: str  # "drain" | "resume"


class LogLevel(Message):
    """Admin -> every worker: the log level from now on."""

    level: str


# --- codec ------------------------------------------------------------------------------------

# --- admin (kvmesh admin -> kv-registry, request/reply on kvmesh.<mesh>.admin.*) -------------
# A request body is a JSON object ({} for status and workers); a reply is one of these or
# AdminFailure ({"error": ...}). `kvmesh admin` prints the reply's JSON as it came.


class Part(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A part of a message (a row of a table), never sent alone; decoded as strictly."""


class AdminWorker(Message):
    """``admin.drain`` / ``admin.resume``: the worker to drain or resume."""

    worker: str


class AdminLogLevel(Message):
    """``admin.log_level``: the level every service of the mesh logs at from now on."""

    level: str


class AdminFailure(Message):
    """What the registry answers to an admin request it cannot carry out."""

    error: str


class DecodeStatusRow(Part):
    """A decode (or colocated) worker as the registry sees it: its pool, cache and leases."""

    worker_id: str
    role: str  # "decode" or "colocated"
    state: str
    total_blocks: int
    free_blocks: int  # as the worker last advertised
    free_blocks_estimate: int  # less what the registry reserved since
    running: int
    waiting: int
    leases: int
    cached_blocks: int
    cache_synced: bool
    reads_kv_store: bool
    refused_accesses: int
    stray_immediates: int
    forged_announcements: int
    kv_spec: str
    model_spec: str
    last_seen_s: float


class WorkerRow(Part):
    """Any known worker, one row: who, what role, its state and load, when last heard."""

    worker_id: str
    role: str
    state: str
    running: int
    waiting: int
    last_seen_s: float
    tp: int = 1  # its tensor-parallel degree (a prefill's heartbeat, a decode's advert say it)


class LeaseCounts(Part):
    active: int
    granted: int
    completed: int
    expired: int
    dropped: int


class StoreStatusRow(Part):
    """A kv-store as its adverts describe it, with what the registry indexed of it."""

    store_id: str
    state: str
    total_blocks: int
    used_blocks: int
    pinned_blocks: int
    capacity_bytes: int
    used_bytes: int
    hits: int
    misses: int
    hit_rate: float
    evictions: int
    disk_total_blocks: int
    disk_used_blocks: int
    disk_capacity_bytes: int
    disk_used_bytes: int
    disk_hits: int
    disk_evictions: int
    bytes_written: int
    bytes_read: int
    refused_accesses: int
    indexed_blocks: int
    index_synced: bool
    kv_spec: str
    epoch: str  # a new one each time the store starts
    last_seen_s: float


class RegistryInfo(Part):
    worker_id: str
    mesh: str
    uptime_s: float
    worker_timeout_s: float


class QueueStatus(Part, omit_defaults=True):
    """The prefill queue: jobs waiting and workers pulling (depth -1: JetStream did not
    answer); ``note`` says why when the queue is missing or unreadable."""

    depth: int
    workers: int
    note: str = ""


class AdminStatus(Message):
    """``admin.status``: the whole mesh as the registry sees it."""

    decode: tuple[DecodeStatusRow, ...]
    workers: tuple[WorkerRow, ...]
    leases: LeaseCounts
    stores: tuple[StoreStatusRow, ...]
    registry: RegistryInfo
    prefill_queue: QueueStatus
    # optional services (kv-store, draft) dropped for silence and not back: the mesh serves
    # without them, e.g. "kv-store (kv-store-0 silent)"
    degraded: tuple[str, ...] = ()


class AdminWorkers(Message):
    """``admin.workers``: every known worker."""

    workers: tuple[WorkerRow, ...]


class AdminControlled(Message, omit_defaults=True):
    """``admin.drain`` / ``admin.resume`` done: the worker took it (``state``: what it
    reported, when it did)."""

    ok: bool
    worker: str
    action: str
    state: str = ""


class AdminLogLevelSet(Message):
    """``admin.log_level`` done: the level was broadcast."""

    ok: bool
    level: str


_ENCODER = msgspec.json.Encoder()


def encode_message(msg: Message) -> bytes:
    """``msg`` as JSON bytes."""
    assert isinstance(msg, Message), type(msg)
    return _ENCODER.encode(msg)


def decode_message(data: bytes, cls: type[M]) -> M:
    """Validate ``data`` against ``cls`` and build it; MessageError says what is wrong, where."""
    try:
        return _decoder(cls).decode(data)
    except msgspec.ValidationError as exc:
        raise MessageError(_explain(cls.__name__, str(exc))) from None
    except msgspec.DecodeError as exc:
        raise MessageError(f"{cls.__name__}: body is not JSON ({exc})") from None


@functools.cache
def _decoder(cls: type[M]) -> msgspec.json.Decoder[M]:
    return msgspec.json.Decoder(cls)


_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_MISSING = re.compile(r"^Object missing required field `(?P<name>.*)`$", re.S)
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<name>.*)`$", re.S)


def _explain(type_name: str, error: str) -> str:
    """msgspec's ``Expected `int`, got `str` - at `$.token_ids[1]``` as
    ``TokenEvent.token_ids[1]: expected int, got str``."""
    parts = _AT.match(error)
    assert parts is not None
    what, path = parts["what"], parts["path"] or ""
    if m := _MISSING.match(what):
        what = f"missing field {m['name']!r}"
    elif m := _UNKNOWN.match(what):
        what = f"unknown field {m['name']!r}"
    else:
        what = (what[:1].lower() + what[1:]).replace("`", "")
    return f"{type_name}{path}: {what}"
