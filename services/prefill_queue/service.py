"""The prefill-queue keeper's asyncio shell: connect as user ``prefill-queue``, make the queue,
check it every ``heartbeat_s`` and make again what a NATS restart lost, serve metrics."""

from __future__ import annotations

import asyncio
import time

import nats.errors
import nats.js.errors
from kvmesh.services.prefill_queue.config import QueueKeeperConfig
from kvmesh.services.prefill_queue.keeper import QueueState, ensure_queue
from kvmesh.services.prefill_queue.metrics import QueueKeeperMetrics
from kvmesh.shared.bus.message_guard import guard_of
from kvmesh.shared.bus.nats_service import (
    background,
    connect_nats,
    new_worker_id,
    serve_until_signal,
)
from kvmesh.shared.bus.prefill_queue import JetStreamUnavailableError
from kvmesh.shared.bus.subjects import Subjects
from kvmesh.shared.obs import logs
from kvmesh.shared.obs.metrics_exporter import serve_metrics
from nats.aio.client import Client

log = logs.get_logger(__name__)

# How long no JetStream may answer before the keeper gives up: a NATS cluster's members answer
# "JetStream unavailable" until they elect a meta leader (seconds after they connect).
JETSTREAM_WAIT_S = 30.0


async def keep_queue(
    nc: Client,
    s: Subjects,
    metrics: QueueKeeperMetrics,
    *,
    check_s: float,
    ack_wait_s: float,
    jetstream_wait_s: float = JETSTREAM_WAIT_S,
) -> None:
    """Ensure the queue now and every ``check_s`` (a task body). No JetStream for
    ``jetstream_wait_s`` in a row is fatal (PrefillQueueError: `kvmesh serve` says so in one
    line): a server started without -js, not a cluster whose JetStream is still electing its
    leader; a NATS error is retried at the next check."""
    last: QueueState | None = None
    unavailable_since: float | None = None
    while True:
        try:
            state = await ensure_queue(nc, s, ack_wait_s)
        except JetStreamUnavailableError as exc:
            now = time.monotonic()
            unavailable_since = now if unavailable_since is None else unavailable_since
            if now - unavailable_since >= jetstream_wait_s:
                raise
            log.debug("no JetStream answers yet; retrying", error=str(exc.__cause__ or exc))
        except (nats.errors.Error, nats.js.errors.Error) as exc:
            log.debug("prefill queue check failed; retrying", error=str(exc) or type(exc).__name__)
        else:
            unavailable_since = None
            for what in state.made:
                metrics.made.labels(what).inc()
            metrics.depth.set(state.depth)
            metrics.replicas.set(state.replicas)
            if state.made and last is not None:
                log.warning(
                    "made the prefill queue again (the NATS server lost it)", made=state.made
                )
            if last is None or state.replicas != last.replicas:
                log.info(
                    "prefill queue ready",
                    stream=s.PREFILL_STREAM,
                    replicas=state.replicas,
                    wanted_replicas=state.wanted_replicas,
                )
            last = state
        await asyncio.sleep(check_s)


async def run_keeper(config: QueueKeeperConfig) -> None:
    worker_id = config.worker_id or new_worker_id("prefill-queue")
    subjects = config.subjects
    metrics = QueueKeeperMetrics()
    async with (
        connect_nats(config.nats_url, worker_id, security=config.nats_security) as nc,
        serve_metrics(metrics.registry, config.metrics_host, config.metrics_port) as port,
        background(
            keep_queue(
                nc,
                subjects,
                metrics,
                check_s=config.heartbeat_s,
                ack_wait_s=config.ack_wait_s,
            )
        ),
    ):
        guard_of(nc).count_into(metrics.nats_refused)  # it reads nothing but API replies
        log.info("prefill-queue keeper running", worker_id=worker_id, metrics_port=port)
        await serve_until_signal()
