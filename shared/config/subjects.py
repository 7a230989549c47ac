"""Every NATS subject kvmesh uses, in one place (table in docs/mesh.md).

A mesh has a name; all of its subjects live under ``kvmesh.<mesh>.`` and its prefill queue is its
own JetStream stream, so two meshes on one NATS server never hear each other. ``Subjects(mesh)``
is handed to each service by its shell (nothing here is a module global), so one process can
talk to two meshes (the tests do). Worker ids need only be unique within a mesh.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePath

ROOT = "kvmesh"
MAX_MESH_LEN = 64
_MESH_RE = re.compile(r"[A-Za-z0-9_-]+")
MESH_CHARS = "letters, digits, '-' and '_'"
DEFAULT_MESH = "kvmesh-tiny"
DRAFT_QUEUE_GROUP = "draft"  # the queue group draft workers consume Subjects.DRAFT_CONTEXT in  # mesh_from_model of the built-in model, the default --model


def check_mesh(mesh: str) -> None:
    """A mesh name is one NATS subject token, part of a JetStream stream name and of a file name:
    ``[A-Za-z0-9_-]``, 1 to 64 characters. ValueError says what to fix."""
    if not isinstance(mesh, str) or not _MESH_RE.fullmatch(mesh) or len(mesh) > MAX_MESH_LEN:
        raise ValueError(
            f"mesh name {mesh!r} is not valid: use 1 to {MAX_MESH_LEN} {MESH_CHARS} "
            "(it names NATS subjects, a JetStream stream and a state file)"
        )


def mesh_from_model(model: str) -> str:
    """The default mesh name of a model: ``kvmesh-tiny`` for the built-in model, a checkpoint
    directory's base name otherwise, with every character outside [A-Za-z0-9_-] made '-'."""
    base = PurePath(model.rstrip("/\\") or model).name or model
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", base).strip("-")[:MAX_MESH_LEN]
    return name or ROOT


@dataclass(frozen=True, slots=True)
class Subjects:
    """The subjects of mesh ``mesh``. Attribute names match docs/mesh.md's table."""

    mesh: str

    def __post_init__(self) -> None:
        check_mesh(self.mesh)

    @property
    def prefix(self) -> str:
        return f"{ROOT}.{self.mesh}"

    # router -> kv-registry (request/reply): PlaceRequest -> PlaceReply
    @property
    def REGISTRY_PLACE(self) -> str:
        return f"{self.prefix}.registry.place"

    # decode -> kv-registry (publish, every heartbeat): DecodeAdvert
    @property
    def REGISTRY_ADVERTISE(self) -> str:
        return f"{self.prefix}.registry.advertise"

    # decode -> kv-registry (publish, batched): KvCacheEvents, its prefix cache's changes
    @property
    def REGISTRY_KV_EVENTS(self) -> str:
        return f"{self.prefix}.registry.kv_events"

    # decode -> kv-registry (publish, periodic): KvCacheDigest, its whole prefix cache
    @property
    def REGISTRY_KV_DIGEST(self) -> str:
        return f"{self.prefix}.registry.kv_digest"

    # kv-store -> kv-registry and store clients (publish, every heartbeat): StoreAdvert
    @property
    def REGISTRY_STORE_ADVERTISE(self) -> str:
        return f"{self.prefix}.registry.store_advertise"

    # store readers -> every kv-store (publish, once as each starts): StoreSolicit; each store
    # answers with its StoreAdvert on REGISTRY_STORE_ADVERTISE at once
    @property
    def REGISTRY_STORE_SOLICIT(self) -> str:
        return f"{self.prefix}.registry.store_solicit"

    # kv-store -> kv-registry (publish, batched): KvCacheEvents, the changes to the
    # block hashes it holds (worker_id = the store's id); a subject of its own, so that a store
    # cannot speak for a decode worker's cache
    @property
    def REGISTRY_STORE_KV_EVENTS(self) -> str:
        return f"{self.prefix}.registry.store_kv_events"

    # kv-store -> kv-registry (publish, periodic): KvCacheDigest, every hash it holds
    @property
    def REGISTRY_STORE_KV_DIGEST(self) -> str:
        return f"{self.prefix}.registry.store_kv_digest"

    # every worker -> anyone (publish): WorkerHeartbeat; subscribe with HEARTBEAT_ALL
    @property
    def HEARTBEAT_ALL(self) -> str:
        return f"{self.prefix}.heartbeat.>"

    # prefill jobs, stored in the JetStream work queue and pulled (shared/bus/prefill_job_stream.py)
    @property
    def PREFILL_JOBS(self) -> str:
        return f"{self.prefix}.prefill.jobs"

    # the JetStream stream that holds PREFILL_JOBS (a stream name, not a subject)
    @property
    def PREFILL_STREAM(self) -> str:
        return f"KVMESH_PREFILL_{self.mesh}"

    # kv-registry -> everyone (publish): WorkerGone, when a worker is dropped for silence
    @property
    def REGISTRY_WORKER_GONE(self) -> str:
        return f"{self.prefix}.registry.worker_gone"

    # broadcast to every worker: Abort
    @property
    def ABORT(self) -> str:
        return f"{self.prefix}.abort"

    # admin requests (JSON bodies, `nats req` works): answered by the kv-registry
    @property
    def ADMIN_STATUS(self) -> str:
        return f"{self.prefix}.admin.status"

    @property
    def ADMIN_WORKERS(self) -> str:
        return f"{self.prefix}.admin.workers"

    @property
    def ADMIN_DRAIN(self) -> str:
        return f"{self.prefix}.admin.drain"

    @property
    def ADMIN_RESUME(self) -> str:
        return f"{self.prefix}.admin.resume"

    @property
    def ADMIN_LOG_LEVEL(self) -> str:
        return f"{self.prefix}.admin.log_level"

    # registry -> every service (publish): LogLevel
    @property
    def CONTROL_LOG_LEVEL(self) -> str:
        return f"{self.prefix}.control.log_level"

    @property
    def DECODE_LEASE_RENEW_ALL(self) -> str:
        return f"{self.prefix}.decode.*.lease_renew"

    # decode -> draft queue group (publish): DraftContext of a sequence no draft worker holds
    @property
    def DRAFT_CONTEXT(self) -> str:
        return f"{self.prefix}.draft.context"

    def draft_context(self, worker_id: str) -> str:
        """decode -> the draft worker holding a sequence (publish): DraftContext deltas."""
        return f"{self.prefix}.draft.{worker_id}.context"

    def draft_forget(self, worker_id: str) -> str:
        """decode -> the draft worker holding a sequence (publish): DraftForget."""
        return f"{self.prefix}.draft.{worker_id}.forget"

    # prefill -> early-exit draft queue group (request/reply): DraftKvReserve -> DraftKvReserveReply
    @property
    def DRAFT_KV_RESERVE(self) -> str:
        return f"{self.prefix}.draft.kv_reserve"

    def draft_kv_done(self, worker_id: str) -> str:
        """prefill -> the draft worker that reserved a prompt's draft KV (publish): PrefillDone."""
        return f"{self.prefix}.draft.{worker_id}.kv_done"

    def draft_status(self, worker_id: str) -> str:
        """admin -> one draft worker (request/reply micro endpoint): its acceptance figures."""
        return f"{self.prefix}.draft.{worker_id}.status"

    def decode_draft(self, worker_id: str) -> str:
        """draft -> decode worker (publish): DraftProposal."""
        return f"{self.prefix}.decode.{worker_id}.draft"

    # router -> every decode worker (request, replies gathered): StreamLookup -> StreamHolder
    @property
    def STREAM_LOOKUP(self) -> str:
        return f"{self.prefix}.stream.lookup"

    def decode_stream_resume(self, worker_id: str) -> str:
        """router -> decode worker (request/reply): StreamResume -> StreamReplay."""
        return f"{self.prefix}.decode.{worker_id}.stream_resume"

    def heartbeat(self, role: str, worker_id: str) -> str:
        return f"{self.prefix}.heartbeat.{role}.{worker_id}"

    def decode_reserve(self, worker_id: str) -> str:
        """kv-registry -> decode worker (request/reply): ReserveRequest -> ReserveReply."""
        return f"{self.prefix}.decode.{worker_id}.reserve"

    def decode_prefill_done(self, worker_id: str) -> str:
        """prefill -> decode worker (publish): PrefillDone."""
        return f"{self.prefix}.decode.{worker_id}.prefill_done"

    def decode_prefill_started(self, worker_id: str) -> str:
        """prefill -> decode worker (publish): PrefillStarted."""
        return f"{self.prefix}.decode.{worker_id}.prefill_started"

    def decode_lease_cancel(self, worker_id: str) -> str:
        """kv-registry -> decode worker (publish): LeaseCancel of a reservation it gave up on."""
        return f"{self.prefix}.decode.{worker_id}.lease_cancel"

    def decode_lease_renew(self, worker_id: str) -> str:
        """router (the lease holder) -> decode worker and kv-registry (publish): LeaseRenew."""
        return f"{self.prefix}.decode.{worker_id}.lease_renew"

    def store_put(self, store_id: str) -> str:
        """writer -> kv-store (request/reply): StorePut -> StorePutReply."""
        return f"{self.prefix}.store.{store_id}.put"

    def store_commit(self, store_id: str) -> str:
        """writer -> kv-store (request/reply): StoreCommit -> StoreCommitReply."""
        return f"{self.prefix}.store.{store_id}.commit"

    def store_get(self, store_id: str) -> str:
        """reader -> kv-store (request/reply): StoreGet -> StoreGetReply."""
        return f"{self.prefix}.store.{store_id}.get"

    def store_release(self, store_id: str) -> str:
        """reader -> kv-store (request/reply): StoreRelease -> StoreAck."""
        return f"{self.prefix}.store.{store_id}.release"

    def worker_control(self, worker_id: str) -> str:
        """kv-registry -> one worker (request/reply): WorkerControl (drain / resume)."""
        return f"{self.prefix}.worker.{worker_id}.control"

    def request_events(self, request_id: str) -> str:
        """Everything about one request flows here; the router subscribes to request_events_all."""
        return f"{self.prefix}.request.{request_id}"

    def request_tokens(self, request_id: str) -> str:
        """decode -> router (publish): TokenEvent."""
        return f"{self.request_events(request_id)}.tokens"

    def request_prefill_report(self, request_id: str) -> str:
        """prefill -> router (publish): PrefillReport."""
        return f"{self.request_events(request_id)}.prefill"

    def request_prefill_started(self, request_id: str) -> str:
        """prefill -> router (publish): PrefillStarted."""
        return f"{self.request_events(request_id)}.prefill_started"

    def request_worker_gone(self, request_id: str) -> str:
        """router -> itself (publish): WorkerGone, delivered into the request's own event stream."""
        return f"{self.request_events(request_id)}.worker_gone"

    def request_events_all(self, request_id: str) -> str:
        return f"{self.request_events(request_id)}.>"
