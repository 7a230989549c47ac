"""Admin: ``kvmesh admin`` -> kv-registry, request/reply on ``kvmesh.<mesh>.admin.*``.

A request body is a JSON object ({} for status and workers); a reply is one of these or
``AdminFailure`` ({"error": ...}). ``kvmesh admin`` prints the reply's JSON as it came."""

from __future__ import annotations

from kvmesh.shared.bus.messages.codec import Message, Part
from kvmesh.shared.bus.messages.kv_store import StoreLoad, StoreReach
from kvmesh.shared.bus.messages.workers import BlockPool, DataPlaneRefusals, DecodeReach, WorkerLoad


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
    """A decode (or colocated) worker as the registry sees it: its advert's parts (its load with
    the registry's state: draining once admin drained it; its pool without the free ranges), and
    what the registry adds: estimated free blocks, leases, the cache it indexed."""

    worker_id: str
    role: str  # "decode" or "colocated"
    load: WorkerLoad
    pool: BlockPool  # as the worker last advertised
    free_blocks_estimate: int  # less what the registry reserved since
    leases: int
    cached_blocks: int
    cache_synced: bool
    reach: DecodeReach
    refusals: DataPlaneRefusals
    last_seen_s: float


class WorkerRow(Part):
    """Any known worker, one row: who, what role, its load (state included), when last heard."""

    worker_id: str
    role: str
    load: WorkerLoad
    last_seen_s: float
    tp: int = 1  # its tensor-parallel degree (a prefill's heartbeat, a decode's advert say it)


class LeaseCounts(Part):
    active: int
    granted: int
    completed: int
    expired: int
    dropped: int


class StoreStatusRow(Part):
    """A kv-store as its adverts describe it (their parts as they came), what that comes to in
    bytes, and what the registry indexed of it."""

    store_id: str
    load: StoreLoad
    reach: StoreReach
    capacity_bytes: int
    used_bytes: int
    disk_capacity_bytes: int
    disk_used_bytes: int
    hit_rate: float  # blocks served / blocks asked for
    indexed_blocks: int
    index_synced: bool
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
