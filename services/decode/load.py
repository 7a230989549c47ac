"""What a decode worker reports of itself, measured between steps: its load (``WorkerLoad``)
and its pool (``BlockPool``), the wire's own parts (shared/bus/messages/workers.py). Its
heartbeats carry the load, its DecodeAdverts both with its ``DecodeReach``, and the load gauges
of its metrics follow the adverts."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvmesh.shared.bus.messages.workers import BlockPool, WorkerLoad
from kvmesh.shared.bus.worker_state import WorkerState

if TYPE_CHECKING:
    from kvmesh.shared.engine.llm_engine import LLMEngine

# before the first measurement: nothing running, nothing known of the pool
IDLE = (WorkerLoad(WorkerState.READY), BlockPool(0, 0))


def free_block_ranges(free_ids: Iterable[int]) -> tuple[tuple[int, int], ...]:
    """Sorted ``[start, end)`` runs of the given block ids."""
    runs: list[list[int]] = []
    for b in sorted(free_ids):
        if runs and runs[-1][1] == b:
            runs[-1][1] = b + 1
        else:
            runs.append([b, b + 1])
    return tuple((s, e) for s, e in runs)


def measure(
    engine: LLMEngine, num_outside: int, state: WorkerState
) -> tuple[WorkerLoad, BlockPool]:
    """``engine``'s queue and pool now (between steps: a step mutates the free list), plus
    ``num_outside`` requests accepted but not in its queue yet."""
    bm, scheduler = engine.block_manager, engine.scheduler
    load = WorkerLoad(state, len(scheduler.running), len(scheduler.waiting) + num_outside)
    return load, BlockPool(bm.num_total_blocks, bm.num_free_blocks, free_block_ranges(bm.free))
