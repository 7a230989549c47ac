"""Workers' presence and control: heartbeats, a decode worker's advert, a worker gone, and
what admin sends a worker (drain/resume, log level)."""

from __future__ import annotations

from typing import Annotated

import msgspec
from kvmesh.shared.bus.messages.codec import Message
from kvmesh.shared.kv.descriptor import TransportDescriptor


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


class WorkerGone(Message):
    """kv-registry -> everyone: a worker stopped heartbeating (dead, hung or cut off)."""

    worker_id: str
    role: str
    last_seen_s: float  # seconds between its last message and the drop
    # the gone process's WorkerHeartbeat.instance ("" if it sent none): a router's requests
    # carry it (PlaceRequest.router), and decode and prefill drop them
    instance: str = ""


class WorkerControl(Message):
    """Admin -> one worker: stop taking work, or take it again."""

    action: str  # "drain" | "resume"


class LogLevel(Message):
    """Admin -> every worker: the log level from now on."""

    level: str
