"""Admin: ``kvmesh admin`` -> kv-registry, request/reply on ``kvmesh.<mesh>.admin.*``.

A request body is a JSON object ({} for status and workers); a reply is one of these or
``AdminFailure`` ({"error": ...}). ``kvmesh admin`` prints the reply's JSON as it came."""

from __future__ import annotations

from kvmesh.shared.bus.messages.codec import Message, Part


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
