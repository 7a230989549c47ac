"""The kv-registry's NATS shell around ``core.RegistryState``: what the workers publish, the
expiry of silent workers and leases, and the wiring of placement (placement.py) and the admin
subjects (admin.py).

In (its mesh's ``Subjects``): DecodeAdvert on REGISTRY_ADVERTISE, KvCacheEvents and
KvCacheDigest on REGISTRY_KV_EVENTS / REGISTRY_KV_DIGEST (the prefix index), WorkerHeartbeat on
HEARTBEAT_ALL, PrefillDone on ``decode_prefill_done(*)`` (ends a lease), PlaceRequest on
REGISTRY_PLACE and the admin subjects.
Out: ReserveRequest to ``decode_reserve(worker)``, WorkerControl to ``worker_control(worker)``,
LogLevel on CONTROL_LOG_LEVEL. Admin bodies are plain JSON; errors are ``{"error": "..."}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import nats.errors
from kvmesh.services.kv_registry.admin import AdminHandler, RegistryAdmin
from kvmesh.services.kv_registry.config import RegistryConfig
from kvmesh.services.kv_registry.core import RegistryState
from kvmesh.services.kv_registry.metrics import RegistryMetrics
from kvmesh.services.kv_registry.placement import Placement
from kvmesh.services.kv_registry.prefix_index import PrefixIndex
from kvmesh.services.kv_registry.stores import StoreTable
from kvmesh.shared.bus.hearing import Hearing
from kvmesh.shared.bus.message_guard import guard_of
from kvmesh.shared.bus.messages.cache_events import KvCacheDigest, KvCacheEvents
from kvmesh.shared.bus.messages.codec import encode_message
from kvmesh.shared.bus.messages.kv_store import StoreAdvert
from kvmesh.shared.bus.messages.placement import LeaseRenew
from kvmesh.shared.bus.messages.prefill_jobs import PrefillDone
from kvmesh.shared.bus.messages.workers import DecodeAdvert, WorkerGone, WorkerHeartbeat, WorkerLoad
from kvmesh.shared.bus.nats_connect import connect_nats
from kvmesh.shared.bus.service_lifetime import serve_until_signal
from kvmesh.shared.bus.store_solicit import store_adverts_solicited
from kvmesh.shared.bus.worker_presence import new_worker_id
from kvmesh.shared.bus.worker_shell import WorkerShell, serve_worker
from kvmesh.shared.bus.worker_state import WorkerState
from kvmesh.shared.config.subjects import Subjects
from kvmesh.shared.obs import logs
from nats.aio.client import Client
from nats.micro.request import Request

log = logs.get_logger(__name__)

ROLE = "kv-registry"
OPTIONAL_ROLES = ("kv-store", "draft")  # services the mesh serves without


class RegistryService:
    def __init__(
        self,
        config: RegistryConfig,
        nc: Client,
        tg: asyncio.TaskGroup,
        worker_id: str,
        subjects: Subjects,
        clock: Callable[[], float] = time.monotonic,
        hearing: Hearing | None = None,
    ) -> None:
        """``hearing``: the connection's outages (connect_nats tells it), so that none of them
        counts as the workers' silence."""
        self.config = config
        self.nc = nc
        self.subjects = subjects
        self.tg = tg
        self.role = ROLE
        self.worker_id = worker_id
        self.clock = clock
        self.started_at = time.time()
        self.core = RegistryState(
            worker_timeout_s=config.worker_timeout_s,
            missed_heartbeats=config.missed_heartbeats,
            retry_after_s=config.retry_after_s,
            kv_spec=config.kv_spec,
            prefix_weight=config.prefix_weight,
            store_block_weight=config.store_block_weight,
            load_weight=config.load_weight,
            local_max_suffix_tokens=config.local_max_suffix_tokens,
            prefix_index=PrefixIndex(config.max_cached_blocks_per_worker),
            hearing=hearing or Hearing(),
        )
        self.stores = StoreTable(
            config.worker_timeout_s,
            prefixes=PrefixIndex(config.max_cached_blocks_per_worker),
            hearing=self.core.hearing,
        )
        self.core.stores = self.stores  # placement counts the prefix blocks stores hold
        self.metrics = RegistryMetrics(self.core)
        self.metrics_port: int | None = None  # bound by registry_service (None: no endpoint)
        self.placement = Placement(config, nc, subjects, self.core, self.metrics, clock)
        self.admin = RegistryAdmin(
            config, nc, subjects, self.core, worker_id, self.started_at, clock, self.stores
        )

    def heartbeat(self) -> WorkerHeartbeat:
        return WorkerHeartbeat(
            worker_id=self.worker_id,
            role=self.role,
            load=WorkerLoad(WorkerState.READY, num_running=len(self.core.leases)),
            started_at=self.started_at,
            sent_at=time.time(),
        )

    # --- what the workers publish ---------------------------------------------------------------

    async def on_advert(self, advert: DecodeAdvert) -> None:
        if self.core.observe_advert(advert, self.clock()):
            log.info(
                "decode worker joined",
                worker_id=advert.worker_id,
                mode=advert.mode,
                total_blocks=advert.pool.total_blocks,
                free_blocks=advert.pool.free_blocks,
            )

    async def on_store_advert(self, advert: StoreAdvert) -> None:
        if self.stores.observe(advert, self.clock()):
            log.info(
                "kv-store joined",
                store_id=advert.store_id,
                total_blocks=advert.load.total_blocks,
                used_blocks=advert.load.used_blocks,
            )

    async def on_cache_events(self, msg: KvCacheEvents) -> None:
        self.core.observe_cache_events(msg)

    async def on_cache_digest(self, msg: KvCacheDigest) -> None:
        self.core.observe_cache_digest(msg)

    async def on_store_events(self, msg: KvCacheEvents) -> None:
        self.stores.observe_events(msg)

    async def on_store_digest(self, msg: KvCacheDigest) -> None:
        self.stores.observe_digest(msg)

    async def on_heartbeat(self, heartbeat: WorkerHeartbeat) -> None:
        self.admin.silent_optional.pop(heartbeat.worker_id, None)  # back
        now = self.clock()
        instance = self.core.instance_of(heartbeat.worker_id)  # the old process's, if replaced
        replaced = self.core.observe_heartbeat(heartbeat, now)
        if heartbeat.role == "kv-store":
            self.stores.heard(heartbeat.worker_id, now)
        if replaced is not None:
            log.warning(
                "worker dropped: restarted (a new process heartbeats under its id)",
                worker_id=heartbeat.worker_id,
            )
            await self._announce_gone(WorkerGone(heartbeat.worker_id, replaced, 0.0, instance))

    async def on_prefill_done(self, done: PrefillDone) -> None:
        self.core.complete_lease(done.lease_id)

    async def on_lease_renew(self, renew: LeaseRenew) -> None:
        expires_at = self.clock() + renew.lease_ms / 1000.0
        self.core.renew_lease(renew.lease_id, renew.request_id, expires_at)

    async def expiry_loop(self) -> None:
        interval = min(0.5, self.config.heartbeat_s / 2)
        while True:
            now = self.clock()
            before = {row.worker_id: row for row in self.core.workers(now)}
            instances = {w: self.core.instance_of(w) for w in before}  # routers'
            dropped, expired = self.core.expire(now)
            for store_id in self.stores.expire(now):
                log.warning("kv-store dropped: no advert", store_id=store_id)
            for worker_id in dropped:
                log.warning("worker dropped: no heartbeat or advert", worker_id=worker_id)
                row = before.get(worker_id)
                role, last_seen_s = (row.role, row.last_seen_s) if row is not None else ("?", 0.0)
                if role in OPTIONAL_ROLES:  # the mesh serves on without it: degraded
                    self.admin.silent_optional[worker_id] = role
                gone = WorkerGone(worker_id, role, last_seen_s, instances.get(worker_id, ""))
                await self._announce_gone(gone)
            for lease in expired:
                log.info(
                    "lease expired (the decode worker frees its blocks)",
                    lease_id=lease.lease_id,
                    request_id=lease.request_id,
                    worker_id=lease.worker_id,
                )
            await asyncio.sleep(interval)

    async def _announce_gone(self, gone: WorkerGone) -> None:
        try:  # requests on it fail or move now, not at their timeouts
            await self.nc.publish(self.subjects.REGISTRY_WORKER_GONE, encode_message(gone))
        except nats.errors.Error as exc:
            log.warning("could not announce a dropped worker", error=str(exc))

    # --- requests --------------------------------------------------------------------------------

    async def on_place(self, req: Request) -> None:
        # Reservations wait on decode workers: answer each in its own task so one slow worker
        # does not hold up the endpoint.
        self._spawn(self.placement.answer(req), req.subject)

    def admin_endpoint(self, handle: AdminHandler) -> Callable[[Request], Awaitable[None]]:
        """The micro endpoint handler of one admin subject: each request in its own task."""

        async def on_request(req: Request) -> None:
            self._spawn(self.admin.answer(req, handle), req.subject)

        return on_request

    def _spawn(self, coro: Coroutine[Any, Any, None], subject: str) -> None:
        """A request task never takes the registry down (shared/bus/message_guard.py)."""
        guard_of(self.nc).spawn(self.tg, coro, subject)


@contextlib.asynccontextmanager
async def registry_service(config: RegistryConfig) -> AsyncIterator[RegistryService]:
    """Connected, subscribed and answering; stops everything on exit."""
    worker_id = config.worker_id or new_worker_id(ROLE)
    subjects = config.subjects
    hearing = Hearing(connected_since=time.monotonic())
    async with (
        connect_nats(
            config.nats_url, worker_id, security=config.nats_security, hearing=hearing
        ) as nc,
        asyncio.TaskGroup() as tg,
    ):
        service = RegistryService(config, nc, tg, worker_id, subjects, hearing=hearing)
        expiry = tg.create_task(service.expiry_loop())
        try:
            shell = WorkerShell(
                service,
                ready="kv-registry ready",
                endpoints=(
                    ("place", subjects.REGISTRY_PLACE, service.on_place),
                    *(
                        (subject.rsplit(".", 1)[-1], subject, service.admin_endpoint(handle))
                        for subject, handle in service.admin.handlers().items()
                    ),
                ),
                routes=(
                    (subjects.REGISTRY_ADVERTISE, DecodeAdvert, service.on_advert),
                    (subjects.HEARTBEAT_ALL, WorkerHeartbeat, service.on_heartbeat),
                    (subjects.decode_prefill_done("*"), PrefillDone, service.on_prefill_done),
                    (subjects.DECODE_LEASE_RENEW_ALL, LeaseRenew, service.on_lease_renew),
                    (subjects.REGISTRY_KV_EVENTS, KvCacheEvents, service.on_cache_events),
                    (subjects.REGISTRY_KV_DIGEST, KvCacheDigest, service.on_cache_digest),
                    (subjects.REGISTRY_STORE_ADVERTISE, StoreAdvert, service.on_store_advert),
                    (subjects.REGISTRY_STORE_KV_EVENTS, KvCacheEvents, service.on_store_events),
                    (subjects.REGISTRY_STORE_KV_DIGEST, KvCacheDigest, service.on_store_digest),
                ),
                contexts=(store_adverts_solicited(nc, subjects, worker_id),),
                ready_fields={"nats_url": config.safe_nats_url},
            )
            async with serve_worker(nc, subjects, shell, log) as service.metrics_port:
                yield service
        finally:
            expiry.cancel()


async def run_registry(config: RegistryConfig) -> None:
    async with registry_service(config):
        await serve_until_signal()
