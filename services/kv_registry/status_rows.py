"""What the registry's admin status and workers subjects show of its state (``RegistryState``
``.status`` and ``.workers``): a row per decode worker with its pool, cache and leases, a row
per known worker of any role, and the lease counters (typed: shared/bus/messages/admin.py's
messages)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvmesh.shared.bus.messages.admin import DecodeStatusRow, LeaseCounts, WorkerRow

if TYPE_CHECKING:
    from kvmesh.services.kv_registry.core import RegistryState


@dataclass(frozen=True, slots=True)
class RegistryRows:
    """The registry's own part of ``AdminStatus``."""

    decode: tuple[DecodeStatusRow, ...]
    workers: tuple[WorkerRow, ...]
    leases: LeaseCounts


def registry_status(state: RegistryState, now: float) -> RegistryRows:
    leases_by_worker: dict[str, int] = {}
    for lease in state.leases.values():
        leases_by_worker[lease.worker_id] = leases_by_worker.get(lease.worker_id, 0) + 1
    decode = tuple(
        DecodeStatusRow(
            worker_id=w.worker_id,
            role=w.role,
            state=w.state,
            total_blocks=w.advert.total_blocks,
            free_blocks=w.advert.free_blocks,
            free_blocks_estimate=w.free_blocks,
            running=w.advert.num_running,
            waiting=w.advert.num_waiting,
            leases=leases_by_worker.get(w.worker_id, 0),
            cached_blocks=state.prefix_index.num_blocks(w.worker_id),
            cache_synced=state.prefix_index.is_synced(w.worker_id),
            reads_kv_store=w.advert.reads_kv_store,
            refused_accesses=w.advert.refused_accesses,
            stray_immediates=w.advert.stray_immediates,
            forged_announcements=w.advert.forged_announcements,
            kv_spec=w.advert.kv_spec,
            model_spec=w.advert.model_spec,
            last_seen_s=round(now - w.last_seen, 3),
        )
        for w in sorted(state.decode.values(), key=lambda w: w.worker_id)
    )
    counters = state.counters
    leases = LeaseCounts(
        active=len(state.leases),
        granted=counters.granted,
        completed=counters.completed,
        expired=counters.expired,
        dropped=counters.dropped,
    )
    return RegistryRows(decode, worker_rows(state, now), leases)


def worker_rows(state: RegistryState, now: float) -> tuple[WorkerRow, ...]:
    """Every known worker, decode ones included, one row each."""
    rows = [
        WorkerRow(
            worker_id=w.worker_id,
            role=w.role,
            state=w.state,
            running=w.advert.num_running,
            waiting=w.advert.num_waiting,
            last_seen_s=round(now - w.last_seen, 3),
            tp=w.advert.tp,
        )
        for w in state.decode.values()
    ]
    rows += [
        WorkerRow(
            worker_id=p.heartbeat.worker_id,
            role=p.heartbeat.role,
            state=p.heartbeat.state,
            running=p.heartbeat.num_running,
            waiting=p.heartbeat.num_waiting,
            last_seen_s=round(now - p.last_seen, 3),
            tp=p.heartbeat.tp,
        )
        for p in state.peers.values()
    ]
    return tuple(sorted(rows, key=lambda r: (r.role, r.worker_id)))


__all__ = ["RegistryRows", "registry_status", "worker_rows"]
