"""The kv-store's NATS shell around StoreWorker (the pool and its requests, which knows no NATS;
docs/kv_store.md).

In (``Subjects(mesh)``): StorePut / StoreCommit / StoreGet / StoreRelease on ``store_*(id)``
(micro endpoints), each decoded here and handed to the worker (a put with the role its reply
goes to, ``requester_role``); StoreSolicit on REGISTRY_STORE_SOLICIT and WorkerGone on
REGISTRY_WORKER_GONE; WorkerControl on ``worker_control(id)`` (``kvmesh admin drain|resume``:
drained, it refuses new puts and still serves gets, and advertises "draining" so readers put
elsewhere). Out: StoreAdvert on REGISTRY_STORE_ADVERTISE, a WorkerHeartbeat every
``heartbeat_s`` and the hashes held on REGISTRY_STORE_KV_EVENTS / REGISTRY_STORE_KV_DIGEST
(held_reports.py). The shell runs the loops: lease expiry every ``lease_check_s`` and the
transport's completions, both handed to the worker, and the held reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import nats.errors
from kvmesh.services.kv_store.config import StoreConfig
from kvmesh.services.kv_store.disk_file import DiskFile, check_disk_dir
from kvmesh.services.kv_store.held_reports import HeldReporter, change_mark, held_hashes
from kvmesh.services.kv_store.layout import store_layout
from kvmesh.services.kv_store.metrics import StoreMetrics
from kvmesh.services.kv_store.worker import StoreWorker
from kvmesh.shared.bus.messages.cache_events import KvCacheDigest, KvCacheEvents
from kvmesh.shared.bus.messages.codec import Message, encode_message
from kvmesh.shared.bus.messages.kv_store import (
    StoreAdvert,
    StoreCommit,
    StoreGet,
    StoreLoad,
    StorePut,
    StoreReach,
    StoreRelease,
    StoreSolicit,
)
from kvmesh.shared.bus.messages.workers import WorkerGone, WorkerHeartbeat, WorkerLoad
from kvmesh.shared.bus.nats_connect import connect_nats
from kvmesh.shared.bus.nats_request import read_request
from kvmesh.shared.bus.service_lifetime import serve_until_signal
from kvmesh.shared.bus.store_solicit import SolicitLimiter
from kvmesh.shared.bus.worker_presence import new_worker_id, publish_every
from kvmesh.shared.bus.worker_shell import WorkerShell, serve_worker
from kvmesh.shared.bus.worker_state import WorkerState
from kvmesh.shared.config.service_errors import ServiceStartError
from kvmesh.shared.kv.kv_block_header import HEADER_BYTES
from kvmesh.shared.obs import logs
from kvmesh.shared.transport import TransportConfig, create_transport
from nats.aio.client import Client
from nats.micro.request import Request

log = logs.get_logger(__name__)

ROLE = "kv-store"


class StoreService:
    """Wires one StoreWorker to NATS: its endpoints, adverts, heartbeats and held reports."""

    def __init__(self, config: StoreConfig, nc: Client, worker: StoreWorker) -> None:
        self.config = config
        self.nc = nc
        self.worker = worker
        self.transport = worker.transport
        self.role = ROLE
        self.store_id = self.worker_id = worker.store_id
        self.epoch = secrets.token_hex(8)
        self.reach = StoreReach(
            descriptor=self.transport.descriptor().public(),
            kv_spec=worker.kv_spec,
            block_bytes=worker.block_bytes,
            block_size=config.block_size,
            epoch=self.epoch,
        )
        self.held = HeldReporter(self.store_id, self.epoch)  # what it holds, for the registry
        self.started_at = time.time()
        self.metrics = StoreMetrics(worker.core, self.transport.stats, worker.block_bytes)
        self.metrics_port: int | None = None
        self.solicits = SolicitLimiter()

    # --- loops -----------------------------------------------------------------------------------

    async def lease_loop(self) -> None:
        """Every ``lease_check_s``: the worker drops the puts and gets whose lease ran out."""
        while True:
            self.worker.expire_leases(time.monotonic())
            await asyncio.sleep(self.config.lease_check_s)

    async def completion_loop(self) -> None:
        """The transport's completions (writes landed in the pool), handed to the worker."""
        async for completion in self.transport.completions():
            self.worker.on_completion(completion)

    async def held_loop(self) -> None:
        """Tell the kv-registry which hashes this store holds (held_reports.py): the changes
        every ``cache_events_interval_s`` when something moved, everything every
        ``cache_digest_interval_s``."""
        subjects = self.config.subjects
        last_digest = -math.inf
        last_mark: tuple[int, ...] | None = None
        while True:
            now = time.monotonic()
            mark = change_mark(self.worker.core)
            msg: KvCacheEvents | KvCacheDigest | None = None
            if now - last_digest >= self.config.cache_digest_interval_s:
                msg = self.held.digest(held_hashes(self.worker.core))
            elif mark != last_mark:
                msg = self.held.events(held_hashes(self.worker.core))
            last_mark = mark
            if isinstance(msg, KvCacheDigest):
                last_digest = now
            if msg is not None:
                subject = (
                    subjects.REGISTRY_STORE_KV_DIGEST
                    if isinstance(msg, KvCacheDigest)
                    else subjects.REGISTRY_STORE_KV_EVENTS
                )
                try:
                    await self.nc.publish(subject, encode_message(msg))
                except nats.errors.Error as exc:  # the registry sees the gap in seq
                    log.debug("held report not sent", error=str(exc))
            await asyncio.sleep(self.config.cache_events_interval_s)

    async def on_worker_gone(self, gone: WorkerGone) -> None:
        """The kv-registry dropped a worker: the worker evicts every block it put."""
        self.worker.on_worker_gone(gone)

    async def on_control(self, action: str) -> None:
        """``kvmesh admin drain|resume <store>``: drained, no new put (readers see "draining" in
        its advert, sent now, and put into another store); gets are still served."""
        self.worker.is_draining = action == "drain"
        log.warning(f"worker control: {action}", store_id=self.store_id)
        await self._advertise_now()

    async def _advertise_now(self) -> None:
        try:
            await self.nc.publish(
                self.config.subjects.REGISTRY_STORE_ADVERTISE, encode_message(self.advert())
            )
        except nats.errors.Error as exc:  # its heartbeat's advert comes anyway
            log.debug("advert not sent", error=str(exc))

    async def on_solicit(self, solicit: StoreSolicit) -> None:
        """A store reader started: advertise now (at most once per ``SolicitLimiter``
        interval), not at the next heartbeat."""
        if not self.solicits.answer():
            log.debug("store solicit not answered again so soon", sender=solicit.sender)
            return
        await self._advertise_now()

    def advert(self) -> StoreAdvert:
        stats = self.transport.stats()
        core = self.worker.core
        c, disk = core.counters, core.disk
        load = StoreLoad(
            state=WorkerState.of(self.worker.is_draining),
            total_blocks=core.num_blocks,
            used_blocks=core.num_used,
            pinned_blocks=core.num_pinned,
            hits=c.hits,
            misses=c.misses,
            evictions=c.evictions,
            bytes_written=stats.bytes,
            bytes_read=stats.read_bytes,
            refused_accesses=stats.refused,
            disk_total_blocks=disk.num_slots if disk else 0,
            disk_used_blocks=disk.num_used if disk else 0,
            disk_hits=c.disk_hits,
            disk_evictions=disk.num_evictions if disk else 0,
        )
        return StoreAdvert(self.store_id, self.reach, load, time.time())

    def heartbeat(self) -> WorkerHeartbeat:
        return WorkerHeartbeat(
            worker_id=self.worker_id,
            role=self.role,
            load=WorkerLoad(
                WorkerState.of(self.worker.is_draining),
                num_running=self.worker.num_running,
            ),
            started_at=self.started_at,
            sent_at=time.time(),
        )

    # --- endpoints -------------------------------------------------------------------------------

    def endpoint(
        self,
        cls: type[Any],
        handle: Callable[..., Message | Awaitable[Message]],
        *,
        with_role: bool = False,
    ) -> Callable[[Request], Awaitable[None]]:
        """A micro endpoint: decode ``cls`` (400 when malformed), answer ``handle``'s reply
        (``with_role``: ``handle(body, requester_role(reply subject))``)."""

        async def on_request(req: Request) -> None:
            body = await read_request(req, cls)
            if body is None:
                return
            # nats.micro's Request keeps the reply subject on its message only
            role = requester_role(req._msg.reply or "") if with_role else None
            reply = handle(body) if role is None else handle(body, role)
            if asyncio.iscoroutine(reply):
                reply = await reply
            try:
                await req.respond(encode_message(reply))
            except nats.errors.Error as exc:  # the client gave up; the lease frees its slots
                log.warning("store reply not sent", error=str(exc))

        return on_request


@contextlib.asynccontextmanager
async def store_service(config: StoreConfig) -> AsyncIterator[StoreService]:
    """Pool allocated and registered, connected, answering; everything stops on exit."""
    store_id = config.worker_id or new_worker_id(ROLE)
    spec, kv_spec = store_layout(
        config.model, config.dtype, config.block_size, config.kv_cache_dtype
    )
    num_blocks = config.resolve_num_blocks(spec.block_bytes)
    num_disk_slots = config.resolve_disk_slots(spec.block_bytes + HEADER_BYTES)
    disk_dir = check_disk_dir(config.disk_path) if config.disk_path is not None else None
    bind_host, advertise_host = config.transport_hosts()
    tconf = TransportConfig(peer_id=store_id, tcp_host=bind_host, tcp_advertise_host=advertise_host)
    subjects = config.subjects
    async with contextlib.AsyncExitStack() as stack:
        disk = None
        if disk_dir is not None:
            # A directory refused for who owns it stops the start (the operator's to fix); a
            # file that cannot be made there (a full filesystem, a quota) does not: the store
            # serves from host memory and says so, rather than fail every restart (issue 43).
            try:
                disk = await asyncio.to_thread(
                    DiskFile.create, disk_dir, num_disk_slots, spec.block_bytes
                )
            except ServiceStartError as exc:
                log.warning(
                    "no disk tier: serving from host memory only (free space under "
                    "--disk-path, or lower --disk-capacity-gb, and restart the store)",
                    error=str(exc),
                )
                num_disk_slots = 0
            else:
                stack.callback(disk.close)
                log.info("disk tier", file=disk.name, slots=num_disk_slots, unlinked=True)
        transport = await stack.enter_async_context(create_transport(config.transport, tconf))
        nc = await stack.enter_async_context(
            connect_nats(config.nats_url, store_id, security=config.nats_security)
        )
        memory = transport.allocate(num_blocks * (spec.block_bytes + HEADER_BYTES))
        worker = StoreWorker(
            config, transport, memory, store_id, num_blocks, spec.block_bytes, kv_spec, disk
        )
        service = StoreService(config, nc, worker)
        shell = WorkerShell(
            service,
            ready="kv-store ready",
            control=service.on_control,
            endpoints=(
                (
                    "put",
                    subjects.store_put(store_id),
                    service.endpoint(StorePut, worker.put, with_role=True),
                ),
                (
                    "commit",
                    subjects.store_commit(store_id),
                    service.endpoint(StoreCommit, worker.commit),
                ),
                ("get", subjects.store_get(store_id), service.endpoint(StoreGet, worker.get)),
                (
                    "release",
                    subjects.store_release(store_id),
                    service.endpoint(StoreRelease, worker.release),
                ),
            ),
            routes=(
                (subjects.REGISTRY_STORE_SOLICIT, StoreSolicit, service.on_solicit),
                (subjects.REGISTRY_WORKER_GONE, WorkerGone, service.on_worker_gone),
            ),
            loops=(service.lease_loop, service.completion_loop, service.held_loop),
            # Advertised only once its endpoints answer: a reader that saw the advert finds them.
            after_ready=(
                lambda: publish_every(
                    nc, subjects.REGISTRY_STORE_ADVERTISE, service.advert, config.heartbeat_s
                ),
            ),
            ready_fields={
                "transport": transport.name,
                "num_blocks": num_blocks,
                "disk_blocks": num_disk_slots,
                "block_bytes": spec.block_bytes,
                "kv_spec": kv_spec,
            },
        )
        async with serve_worker(nc, subjects, shell, log) as service.metrics_port:
            yield service


def requester_role(reply: str) -> str:
    """The NATS role a request's reply goes to: its inbox is ``_INBOX_<role>.…``, and only
    that role's user may read it (``shared/bus/nats_auth.py``); "" for a plain ``_INBOX.`` (a mesh
    without credentials has no roles)."""
    head = reply.split(".", 1)[0]
    return head.removeprefix("_INBOX_") if head.startswith("_INBOX_") else ""


async def run_store(config: StoreConfig) -> None:
    async with store_service(config):
        await serve_until_signal()


__all__ = ["ROLE", "StoreService", "requester_role", "run_store", "store_service"]
