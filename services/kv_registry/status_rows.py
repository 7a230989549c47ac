"""What the registry's admin status and workers subjects show of its state (``RegistryState``
``.status`` and ``.workers``): a row per decode worker with its pool, cache and leases, a row
per known worker of any role, and the lease counters (typed: shared/bus/messages/admin.py's
messages)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
from kvmesh.shared.bus.messages.admin import DecodeStatusRow, LeaseCounts, WorkerRow
from kvmesh.shared.bus.messages.workers import WorkerLoad

if TYPE_CHECKING:
    from kvmesh.services.kv_registry.core import RegistryState
    from kvmesh.services.kv_registry.worker_views import DecodeWorkerView


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
            load=_load_of(w),
            pool=msgspec.structs.replace(w.advert.pool, free_block_ranges=()),
            free_blocks_estimate=w.free_blocks,
            leases=leases_by_worker.get(w.worker_id, 0),
            cached_blocks=state.prefix_index.num_blocks(w.worker_id),
            cache_synced=state.prefix_index.is_synced(w.worker_id),
            reach=w.advert.reach,
            refusals=w.advert.refusals,
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
        WorkerRow(w.worker_id, w.role, _load_of(w), round(now - w.last_seen, 3), w.advert.reach.tp)
        for w in state.decode.values()
    ]
    rows += [
        WorkerRow(
            p.heartbeat.worker_id,
            p.heartbeat.role,
            p.heartbeat.load,
            round(now - p.last_seen, 3),
            p.heartbeat.tp,
        )
        for p in state.peers.values()
    ]
    return tuple(sorted(rows, key=lambda r: (r.role, r.worker_id)))


def _load_of(worker: DecodeWorkerView) -> WorkerLoad:
    """A decode worker's advertised load, its state the registry's (draining once admin drained
    it, before the worker's next advert says so)."""
    return msgspec.structs.replace(worker.advert.load, state=worker.state)


__all__ = ["RegistryRows", "registry_status", "worker_rows"]
