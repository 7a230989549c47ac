"""Every NATS subject kvmesh uses, in one place (table in docs/mesh.md)."""

from __future__ import annotations

PREFIX = "kvmesh"

# router -> kv-registry (request/reply): PlaceRequest -> PlaceReply
REGISTRY_PLACE = f"{PREFIX}.registry.place"
# decode -> kv-registry (publish, every heartbeat): DecodeAdvert
REGISTRY_ADVERTISE = f"{PREFIX}.registry.advertise"
# every worker -> anyone (publish): WorkerHeartbeat; subscribe with HEARTBEAT_ALL
HEARTBEAT_ALL = f"{PREFIX}.heartbeat.>"
# prefill jobs, stored in the JetStream work queue and pulled (shared/prefill_queue.py): PrefillJob
PREFILL_JOBS = f"{PREFIX}.prefill.jobs"
# kv-registry -> everyone (publish): WorkerGone, when a worker is dropped for silence
REGISTRY_WORKER_GONE = f"{PREFIX}.registry.worker_gone"
# broadcast to every worker: Abort
ABORT = f"{PREFIX}.abort"
# admin requests (JSON bodies, `nats req` works): answered by the kv-registry
ADMIN_STATUS = f"{PREFIX}.admin.status"
ADMIN_WORKERS = f"{PREFIX}.admin.workers"
ADMIN_DRAIN = f"{PREFIX}.admin.drain"
ADMIN_RESUME = f"{PREFIX}.admin.resume"
ADMIN_LOG_LEVEL = f"{PREFIX}.admin.log_level"
# registry -> every service (publish): LogLevel
CONTROL_LOG_LEVEL = f"{PREFIX}.control.log_level"


def heartbeat(role: str, worker_id: str) -> str:
    return f"{PREFIX}.heartbeat.{role}.{worker_id}"


def decode_reserve(worker_id: str) -> str:
    """kv-registry -> decode worker (request/reply): ReserveRequest -> ReserveReply."""
    return f"{PREFIX}.decode.{worker_id}.reserve"


def decode_prefill_done(worker_id: str) -> str:
    """prefill -> decode worker (publish): PrefillDone."""
    return f"{PREFIX}.decode.{worker_id}.prefill_done"


def decode_prefill_started(worker_id: str) -> str:
    """prefill -> decode worker (publish): PrefillStarted."""
    return f"{PREFIX}.decode.{worker_id}.prefill_started"


def decode_lease_renew(worker_id: str) -> str:
    """router (the lease holder) -> decode worker and kv-registry (publish): LeaseRenew."""
    return f"{PREFIX}.decode.{worker_id}.lease_renew"


DECODE_LEASE_RENEW_ALL = f"{PREFIX}.decode.*.lease_renew"


def worker_control(worker_id: str) -> str:
    """kv-registry -> one worker (request/reply): WorkerControl (drain / resume)."""
    return f"{PREFIX}.worker.{worker_id}.control"


def request_events(request_id: str) -> str:
    """Everything about one request flows here; the router subscribes to request_events_all."""
    return f"{PREFIX}.request.{request_id}"


def request_tokens(request_id: str) -> str:
    """decode -> router (publish): TokenEvent."""
    return f"{request_events(request_id)}.tokens"


def request_prefill_report(request_id: str) -> str:
    """prefill -> router (publish): PrefillReport."""
    return f"{request_events(request_id)}.prefill"


def request_prefill_started(request_id: str) -> str:
    """prefill -> router (publish): PrefillStarted."""
    return f"{request_events(request_id)}.prefill_started"


def request_worker_gone(request_id: str) -> str:
    """router -> itself (publish): WorkerGone, delivered into the request's own event stream."""
    return f"{request_events(request_id)}.worker_gone"


def request_events_all(request_id: str) -> str:
    return f"{request_events(request_id)}.>"
