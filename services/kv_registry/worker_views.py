"""The workers as the registry sees them: a decode (or colocated) worker by its adverts
(``DecodeWorkerView``: estimated free blocks, load, draining), any other by its heartbeats
(``PeerWorker``), and how each one's publish interval is learned (``seen``), which is what
decides when its silence means it is dead (``RegistryState.timeout_of``)."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.shared.bus.hearing import Hearing
from kvmesh.shared.bus.messages.workers import DecodeAdvert, WorkerHeartbeat
from kvmesh.shared.bus.worker_state import WorkerState


@dataclass(slots=True)
class DecodeWorkerView:
    """A decode (or colocated) worker as the registry sees it."""

    advert: DecodeAdvert
    last_seen: float  # registry clock
    interval_s: float = 0.0  # the worker's observed publish interval (slowly decaying max gap)
    reserved_since_advert: int = 0  # blocks granted after the advert was received
    inflight_blocks: int = 0  # blocks asked for, reply not in yet
    num_inflight: int = 0
    is_draining: bool = False  # set by admin drain before the worker's next advert says so
    started_at: float = 0.0  # its heartbeats' started_at: another one is a restarted process

    @property
    def worker_id(self) -> str:
        return self.advert.worker_id

    @property
    def role(self) -> str:
        """What its rows and heartbeats call it: "colocated" or "decode"."""
        return "colocated" if self.advert.mode == "colocated" else "decode"

    @property
    def state(self) -> WorkerState:
        return WorkerState.DRAINING if self.is_draining else self.advert.load.state

    @property
    def free_blocks(self) -> int:
        """Estimated free blocks: advertised, less what was handed out since (never < 0)."""
        return max(
            0, self.advert.pool.free_blocks - self.reserved_since_advert - self.inflight_blocks
        )

    @property
    def load(self) -> int:
        return self.advert.load.num_running + self.advert.load.num_waiting + self.num_inflight


@dataclass(slots=True)
class PeerWorker:
    """Any worker known only by its heartbeats (prefill, router, draft, ...)."""

    heartbeat: WorkerHeartbeat
    last_seen: float
    interval_s: float = 0.0


def seen(entry: DecodeWorkerView | PeerWorker, now: float, hearing: Hearing) -> None:
    """Refresh last-seen and learn the worker's interval: a router heartbeating every 2 s must not
    be declared dead by a registry that expects 1 s. A gap the registry could not hear (a NATS
    outage) teaches nothing: only the part since the reconnect counts."""
    entry.interval_s = max(hearing.silence(entry.last_seen, now), 0.9 * entry.interval_s)
    entry.last_seen = now


__all__ = ["DecodeWorkerView", "PeerWorker", "seen"]
