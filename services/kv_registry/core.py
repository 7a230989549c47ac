"""The registry's state: its workers, their liveness and their leases (pure, synchronous, clock
passed in).

The decode workers own their free lists and enforce their leases; the registry keeps a soft view
(the latest DecodeAdvert of each worker, corrected for the reservations granted since), picks a
worker for each PlaceRequest, and tracks leases for status and expiry. Everything here can be
rebuilt from the workers' periodic adverts, which is what a restarted registry does. The table's
entries are worker_views.py's; what admin shows of the state, status_rows.py's; which worker
takes a prompt, placement_policy.py's (its weights are fields here).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kvmesh.services.kv_registry import placement_policy
from kvmesh.services.kv_registry.placement_policy import Candidate, Refusal
from kvmesh.services.kv_registry.prefix_index import PrefixIndex
from kvmesh.services.kv_registry.status_rows import RegistryRows, registry_status, worker_rows
from kvmesh.services.kv_registry.stores import StoreTable
from kvmesh.services.kv_registry.worker_views import DecodeWorkerView, PeerWorker, seen
from kvmesh.shared.bus.hearing import Hearing
from kvmesh.shared.bus.messages.admin import WorkerRow
from kvmesh.shared.bus.messages.cache_events import KvCacheDigest, KvCacheEvents
from kvmesh.shared.bus.messages.placement import DecodeRankTarget, PlaceReply, PlaceRequest
from kvmesh.shared.bus.messages.workers import DecodeAdvert, WorkerHeartbeat
from kvmesh.shared.bus.worker_state import WorkerState


@dataclass(frozen=True, slots=True)
class Lease:
    lease_id: str
    request_id: str
    worker_id: str
    block_ids: tuple[int, ...]
    granted_at: float
    expires_at: float
    router: str = ""  # the instance of the router that holds it (PlaceRequest.router)


@dataclass(slots=True)
class LeaseCounters:
    granted: int = 0
    completed: int = 0
    expired: int = 0
    dropped: int = 0  # their worker died


@dataclass(slots=True)
class RegistryState:
    """``worker_timeout_s`` = missed heartbeats x the expected interval; a worker observed to
    publish more slowly gets missed heartbeats x its own interval instead. Silence counts only
    while the registry is connected (``hearing``): a NATS outage kills nobody."""

    worker_timeout_s: float
    missed_heartbeats: int = 3
    retry_after_s: float = 0.5
    kv_spec: str = ""  # "" accepts any layout
    decode: dict[str, DecodeWorkerView] = field(default_factory=dict)
    peers: dict[str, PeerWorker] = field(default_factory=dict)
    leases: dict[str, Lease] = field(default_factory=dict)
    counters: LeaseCounters = field(default_factory=LeaseCounters)
    # worker id -> last seen, for workers dropped recently: if one comes back, the gap teaches
    # the registry its interval (else a worker slower than 1/missed of the timeout would flap)
    dropped_at: dict[str, float] = field(default_factory=dict)
    # prefix-aware placement (placement_policy.py): prefix_weight 0 turns it off
    prefix_weight: float = 1.0
    store_block_weight: float = 0.5  # a block to read from a store, per cached block (0: off)
    load_weight: float = 4.0
    local_max_suffix_tokens: int = 512
    prefix_index: PrefixIndex = field(default_factory=PrefixIndex)
    stores: StoreTable | None = None  # the kv-stores and what they hold (stores.py)
    hearing: Hearing = field(default_factory=Hearing)  # the registry's link to NATS

    # --- what the workers tell us ---------------------------------------------------------------

    def observe_advert(self, advert: DecodeAdvert, now: float) -> bool:
        """Record a worker's advert; returns True for a worker not known before."""
        worker = self.decode.get(advert.worker_id)
        if worker is None:
            self.peers.pop(advert.worker_id, None)  # its heartbeat may have come first
            self.decode[advert.worker_id] = DecodeWorkerView(
                advert=advert, last_seen=now, interval_s=self._returning(advert.worker_id, now)
            )
            return True
        worker.advert = advert
        seen(worker, now, self.hearing)
        worker.reserved_since_advert = 0  # the advert counts every reservation replied before it
        if advert.load.state == WorkerState.READY:
            worker.is_draining = False  # the worker says it resumed (or never drained)
        return False

    def observe_heartbeat(self, heartbeat: WorkerHeartbeat, now: float) -> str | None:
        """Record a heartbeat. Returns the role of the worker it replaces when it comes from a
        new process under a known id (restarted before its silence was noticed): the old one is
        dropped now, as if it had timed out, and the caller announces it gone (its requests move
        at once instead of waiting for tokens that will never come)."""
        replaced = self._replaced_by(heartbeat)
        if replaced is not None:
            self._drop(heartbeat.worker_id)
        worker = self.decode.get(heartbeat.worker_id)
        if worker is not None:
            worker.started_at = heartbeat.started_at
            seen(worker, now, self.hearing)
            return replaced
        peer = self.peers.get(heartbeat.worker_id)
        if peer is None:
            self.peers[heartbeat.worker_id] = PeerWorker(
                heartbeat=heartbeat,
                last_seen=now,
                interval_s=self._returning(heartbeat.worker_id, now),
            )
        else:
            peer.heartbeat = heartbeat
            seen(peer, now, self.hearing)
        return replaced

    def _replaced_by(self, heartbeat: WorkerHeartbeat) -> str | None:
        """The known worker's role if ``heartbeat`` is another process's under its id."""
        if not heartbeat.started_at:
            return None
        worker = self.decode.get(heartbeat.worker_id)
        if worker is not None:
            known, role = worker.started_at, worker.role
        elif (peer := self.peers.get(heartbeat.worker_id)) is not None:
            known, role = peer.heartbeat.started_at, peer.heartbeat.role
        else:
            return None
        return role if known and known != heartbeat.started_at else None

    def observe_cache_events(self, msg: KvCacheEvents) -> bool:
        """A decode worker's prefix cache changes; False (ignored) for a worker not known by
        its adverts (it resyncs with its next digest once it is)."""
        return self.prefix_index.apply_from(self.decode, msg)

    def observe_cache_digest(self, msg: KvCacheDigest) -> bool:
        """A decode worker's whole prefix cache; False (ignored) for an unknown worker."""
        return self.prefix_index.apply_from(self.decode, msg)

    def mark_draining(self, worker_id: str, is_draining: bool) -> bool:
        """Admin drain/resume: stop (or restart) placing on the worker now. False if unknown."""
        worker = self.decode.get(worker_id)
        if worker is None:
            return False
        worker.is_draining = is_draining
        return True

    def expire(self, now: float) -> tuple[list[str], list[Lease]]:
        """Drop workers silent for longer than worker_timeout_s and leases past their TTL.

        Returns (dropped worker ids, expired leases)."""
        dead = [w for w, d in self.decode.items() if not self.is_alive(d, now)]
        dead += [w for w, p in self.peers.items() if not self.is_alive(p, now)]
        for worker_id in dead:
            self._drop(worker_id)
        for worker_id, last_seen in list(self.dropped_at.items()):
            if now - last_seen > 10 * self.worker_timeout_s:
                del self.dropped_at[worker_id]
        expired: list[Lease] = []
        for lease in list(self.leases.values()):
            if lease.expires_at <= now:
                del self.leases[lease.lease_id]
                self.counters.expired += 1
                expired.append(lease)
        return dead, expired

    def _drop(self, worker_id: str) -> None:
        """Forget a dead worker: its entry, what it had cached, its leases (a router's: the
        leases it held, which the decode workers free when they hear it gone)."""
        entry = self.decode.pop(worker_id, None) or self.peers.pop(worker_id)
        self.dropped_at[worker_id] = entry.last_seen
        self.prefix_index.drop_worker(worker_id)
        instance = entry.heartbeat.instance if isinstance(entry, PeerWorker) else ""
        for lease in list(self.leases.values()):
            if lease.worker_id == worker_id or (instance and lease.router == instance):
                del self.leases[lease.lease_id]
                self.counters.dropped += 1

    def instance_of(self, worker_id: str) -> str:
        """The instance a worker's heartbeats carry (a router's; "" for others or unknown)."""
        peer = self.peers.get(worker_id)
        return peer.heartbeat.instance if peer is not None else ""

    def _returning(self, worker_id: str, now: float) -> float:
        last_seen = self.dropped_at.pop(worker_id, None)
        return 0.0 if last_seen is None else now - last_seen

    def timeout_of(self, entry: DecodeWorkerView | PeerWorker) -> float:
        interval = entry.interval_s
        if isinstance(entry, PeerWorker):  # the interval its heartbeats say, if they do
            interval = max(interval, entry.heartbeat.interval_s)
        return max(self.worker_timeout_s, self.missed_heartbeats * interval)

    def is_alive(self, entry: DecodeWorkerView | PeerWorker, now: float) -> bool:
        return self.hearing.silence(entry.last_seen, now) <= self.timeout_of(entry)

    def starting(self, now: float) -> list[str]:
        """Decode (or colocated) workers that heartbeat "starting": they reached NATS and load
        their model; placeable once their first advert comes (never dropped meanwhile)."""
        return sorted(
            w
            for w, p in self.peers.items()
            if p.heartbeat.role in ("decode", "colocated")
            and p.heartbeat.load.state == WorkerState.STARTING
            and self.is_alive(p, now)
        )

    # --- placement ------------------------------------------------------------------------------

    def choose(
        self,
        request: PlaceRequest,
        now: float,
        exclude: frozenset[str] = frozenset(),
        held_tokens: int = 0,
    ) -> Candidate | Refusal:
        """Pick a decode worker for ``request`` and count the reservation as in flight there
        (placement_policy.py); ``held_tokens``: an older placement waiting for room needs this
        many tokens' blocks. The caller must follow up with ``grant`` or ``release_inflight``."""
        return placement_policy.choose(self, request, now, exclude, held_tokens)

    def release_inflight(self, candidate: Candidate) -> None:
        """The reservation failed (refused, timed out): forget it."""
        worker = self.decode.get(candidate.worker_id)
        if worker is not None:
            worker.inflight_blocks = max(0, worker.inflight_blocks - candidate.num_blocks)
            worker.num_inflight = max(0, worker.num_inflight - 1)

    def grant(
        self,
        candidate: Candidate,
        request: PlaceRequest,
        lease_id: str,
        block_ids: tuple[int, ...],
        now: float,
        rkey: int = 0,
        block_addrs: tuple[int, ...] = (),
        ranks: tuple[DecodeRankTarget, ...] = (),
    ) -> PlaceReply:
        """The worker reserved ``block_ids`` (at ``block_addrs`` in its region) under a window
        with key ``rkey``: record the lease, build the reply. ``ranks``: a tensor-parallel
        worker's other ranks' windows over the same blocks (ReserveReply.ranks)."""
        self.release_inflight(candidate)
        worker = self.decode.get(candidate.worker_id)
        if worker is None:  # dropped while we waited; its reply still stands
            return PlaceReply(
                ok=False,
                request_id=request.request_id,
                error=f"decode worker {candidate.worker_id} vanished during placement",
                retry_after_s=self.retry_after_s,
            )
        advert = worker.advert
        if not candidate.is_local_prefill(request) and len(ranks) != advert.reach.tp - 1:
            return PlaceReply(
                ok=False,
                request_id=request.request_id,
                error=(
                    f"decode worker {candidate.worker_id} advertises TP {advert.reach.tp} but its "
                    f"reservation names {len(ranks) + 1} ranks' blocks"
                ),
                retry_after_s=self.retry_after_s,
            )
        worker.reserved_since_advert += len(block_ids)
        if not candidate.is_local_prefill(request):  # local: no remote writes, no lease to watch
            self.leases[lease_id] = Lease(
                lease_id=lease_id,
                request_id=request.request_id,
                worker_id=worker.worker_id,
                block_ids=block_ids,
                granted_at=now,
                expires_at=now + request.lease_ms / 1000.0,
                router=request.router,
            )
            self.counters.granted += 1
        return PlaceReply(
            ok=True,
            request_id=request.request_id,
            worker_id=worker.worker_id,
            lease_id=lease_id,
            descriptor=advert.reach.descriptor,
            rkey=rkey,
            block_ids=block_ids,
            block_addrs=block_addrs,
            block_bytes=advert.reach.block_bytes,
            local_prefill=candidate.prefill_here,
            cached_tokens=candidate.cached_tokens,
            ranks=ranks,
        )

    def renew_lease(self, lease_id: str, request_id: str, expires_at: float) -> bool:
        """Its holder renewed the lease: it now ends at ``expires_at`` (never earlier)."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.request_id != request_id:
            return False
        if expires_at > lease.expires_at:
            self.leases[lease_id] = dataclasses.replace(lease, expires_at=expires_at)
        return True

    def complete_lease(self, lease_id: str) -> Lease | None:
        """The prefill finished (PrefillDone seen): the lease is over."""
        lease = self.leases.pop(lease_id, None)
        if lease is not None:
            self.counters.completed += 1
        return lease

    # --- views (admin) --------------------------------------------------------------------------

    def status(self, now: float) -> RegistryRows:
        """The admin status: a row per decode worker, every worker's row, the lease counters."""
        return registry_status(self, now)

    def workers(self, now: float) -> tuple[WorkerRow, ...]:
        """Every known worker, decode ones included, one row each."""
        return worker_rows(self, now)
