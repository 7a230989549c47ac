"""What a decode worker reports of itself: its load (``WorkerLoad``, taken between steps) and
how to reach it (``DecodeReach``, fixed at start). The service builds its DecodeAdvert and
heartbeats from the two, and the load gauges of its metrics follow the adverts."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvmesh.shared.kv.descriptor import TransportDescriptor


def free_block_ranges(free_ids: Iterable[int]) -> tuple[tuple[int, int], ...]:
    """Sorted ``[start, end)`` runs of the given block ids."""
    runs: list[list[int]] = []
    for b in sorted(free_ids):
        if runs and runs[-1][1] == b:
            runs[-1][1] = b + 1
        else:
            runs.append([b, b + 1])
    return tuple((s, e) for s, e in runs)


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """The KV pool and the queue of a decode worker at one moment."""

    total_blocks: int
    free_blocks: int
    free_block_ranges: tuple[tuple[int, int], ...]  # [start, end) runs of free block ids
    num_running: int
    num_waiting: int  # in the engine's queue, reserved for a prefill, or accepted not yet queued
    state: str  # "ready" | "draining"

    @classmethod
    def idle(cls) -> WorkerLoad:
        """Before the first measurement: nothing running, nothing known of the pool."""
        return cls(0, 0, (), 0, 0, "ready")


@dataclass(frozen=True, slots=True)
class DecodeReach:
    """How prefill workers and routers reach a decode worker and what it serves."""

    descriptor: TransportDescriptor | None  # None: colocated, no remote writes
    block_bytes: int
    block_size: int
    kv_spec: str  # kv_spec_fingerprint(); it also roots the prefix hashes
    model_spec: str
    # the registry may have it read a prefix from a kv-store: its reads feature's advert field
    # (local_reads.py) says so
    reads_kv_store: bool = False
