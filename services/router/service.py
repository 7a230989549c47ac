"""The router's shell: connect to NATS, subscribe the dispatcher to the mesh's adverts,
heartbeats and WorkerGone (typed, through the MessageGuard), announce itself, serve HTTP
(``Router``: app.py); ``run`` until a signal, then stop within the grace period."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from kvmesh.services.router.app import Router, build_app
from kvmesh.services.router.config import RouterConfig
from kvmesh.services.router.dispatch import OPTIONAL_ROLES
from kvmesh.services.router.http_server import serve_http
from kvmesh.services.router.model_info import load_model_info
from kvmesh.shared.bus.hearing import Hearing
from kvmesh.shared.bus.message_guard import guard_of
from kvmesh.shared.bus.messages.workers import DecodeAdvert, WorkerGone, WorkerHeartbeat, WorkerLoad
from kvmesh.shared.bus.nats_connect import connect_nats
from kvmesh.shared.bus.nats_subscribe import subscriptions
from kvmesh.shared.bus.service_lifetime import serve_until_signal
from kvmesh.shared.bus.worker_presence import new_worker_id, worker_presence
from kvmesh.shared.bus.worker_state import WorkerState
from kvmesh.shared.obs import logs

log = logs.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class RunningRouter:
    router: Router
    port: int
    worker_id: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@asynccontextmanager
async def serve_router(config: RouterConfig) -> AsyncIterator[RunningRouter]:
    """The router, connected to NATS and serving HTTP, for the duration of the block."""
    model = load_model_info(config.model, config.model_id, config.max_model_len)
    worker_id = config.worker_id or new_worker_id("router")
    started_at = time.time()
    subjects = config.subjects
    hearing = Hearing(connected_since=time.monotonic())
    async with connect_nats(
        config.nats_url, worker_id, security=config.nats_security, hearing=hearing
    ) as nc:
        # the prefill queue is made by its keeper (kvmesh serve prefill-queue), not the router
        router = Router(config=config, model=model, nc=nc, subjects=subjects, hearing=hearing)
        # lives as long as the connection (drained on exit)
        guard_of(nc).count_into(router.metrics.nats_refused)
        dispatcher = router.dispatcher

        def heartbeat() -> WorkerHeartbeat:
            return WorkerHeartbeat(
                worker_id=worker_id,
                role="router",
                load=WorkerLoad(WorkerState.READY, num_running=router.num_in_flight),
                started_at=started_at,
                sent_at=time.time(),
                instance=dispatcher.instance,  # its requests carry it; they die with it
                interval_s=config.heartbeat_s,  # the registry waits for this many missed
            )

        async with (
            subscriptions(
                nc,
                (subjects.REGISTRY_WORKER_GONE, WorkerGone, dispatcher.on_worker_gone),
                (subjects.REGISTRY_ADVERTISE, DecodeAdvert, dispatcher.on_advert),
                *(
                    (subjects.heartbeat(role, "*"), WorkerHeartbeat, dispatcher.on_heartbeat)
                    for role in ("prefill", "decode", "colocated", "kv-registry", *OPTIONAL_ROLES)
                ),
            ),
            worker_presence(
                nc,
                subjects,
                role="router",
                worker_id=worker_id,
                heartbeat=heartbeat,
                interval_s=config.heartbeat_s,
                stall_limit_s=config.stall_limit_s,
                metadata={"model": model.name},
            ),
            serve_http(
                build_app(router),
                config.host,
                config.port,
                router.connections,
                reuse_port=config.reuse_port,
            ) as port,
        ):
            log.info(
                "router serving",
                worker_id=worker_id,
                mesh=subjects.mesh,
                model=model.name,
                port=port,
                mode=config.mode,
                # max_model_len is logged once the decode workers' pools are heard (dispatch.py)
                model_context=model.max_model_len,
            )
            try:
                yield RunningRouter(router=router, port=port, worker_id=worker_id)
            finally:
                # before the HTTP server closes: streams in flight end with an error event
                await router.stop(config.shutdown_grace_s)


async def run(config: RouterConfig) -> None:
    """Serve until SIGTERM/SIGINT, then stop within ``config.shutdown_grace_s`` (and a moment
    to end what is left; see services/router/shutdown.py)."""
    async with serve_router(config):
        await serve_until_signal()
