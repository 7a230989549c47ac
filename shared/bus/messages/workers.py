"""Workers' presence and control: heartbeats, a decode worker's advert, a worker gone, and
what admin sends a worker (drain/resume, log level)."""

from __future__ import annotations

from typing import Annotated

import msgspec
from kvmesh.shared.bus.messages.codec import Message, Part
from kvmesh.shared.bus.worker_state import WorkerState
from kvmesh.shared.kv.descriptor import TransportDescriptor


class WorkerLoad(Part):
    """How busy a worker is: its state and its requests. Its heartbeats carry it (every role),
    a decode worker's adverts too, and the admin tables show it as it came."""

    # ready, draining, or starting (a decode worker that reached NATS and is loading its
    # model: not placeable yet, but coming; routers wait for it rather than refuse)
    state: WorkerState
    num_running: int = 0
    # a decode worker's: in the engine's queue, reserved for a prefill, or accepted not yet queued
    num_waiting: int = 0


class BlockPool(Part):
    """A decode worker's KV pool at one moment: what it advertises and the admin table shows."""

    total_blocks: int
    free_blocks: int
    # [start, end) runs of free block ids (the advert's; the admin table leaves them out)
    free_block_ranges: tuple[tuple[int, int], ...] = ()


class DecodeReach(Part):
    """How prefill workers and routers reach a decode worker and what it serves (fixed at
    start)."""

    # TransportDescriptor.public(): no region keys (kept only on rdma NICs without memory windows);
    # None for a colocated worker, which takes no remote writes
    descriptor: TransportDescriptor | None
    # no memory address (issue 40: it was base_addr): a reservation's reply carries its blocks'
    block_bytes: int
    block_size: int
    kv_spec: str  # KVCacheSpec fingerprint: prefill and decode must match; it roots prefix hashes
    model_spec: str = ""  # model_spec() of the model it serves: routers of that model place here
    # it reads a local prefill's missing prefix blocks from a kv-store first (--use-kv-store with
    # a transport and prefix caching): placement counts what the store holds as within its reach
    reads_kv_store: bool = False
    # its tensor-parallel degree: TP ranks, each holding 1/tp of the KV heads (block_bytes is one
    # rank's block); a reservation's reply names every rank's blocks (ReserveReply.ranks)
    tp: Annotated[int, msgspec.Meta(ge=1)] = 1


class DataPlaneRefusals(Part):
    """What a decode worker's data plane turned away, counted since it started."""

    refused_accesses: int = 0  # one-sided writes/reads its transport refused (rkey, bounds, ...)
    stray_immediates: int = 0  # immediates that named no live reservation (late or forged)
    forged_announcements: int = 0  # PrefillDones without their lease's window key


class WorkerHeartbeat(Message):
    """Every worker -> registry and routers, periodically: alive, and how busy."""

    worker_id: str
    role: (
        str  # "prefill" | "decode" | "colocated" | "router" | "kv-registry" | "draft" | "kv-store"
    )
    load: WorkerLoad
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
    """Decode -> registry, on start and every heartbeat: how to reach it, how busy it is and
    what it has free."""

    worker_id: str
    mode: str  # "disagg" | "colocated"
    reach: DecodeReach
    load: WorkerLoad
    pool: BlockPool
    sent_at: float
    refusals: DataPlaneRefusals = msgspec.field(default_factory=DataPlaneRefusals)


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
