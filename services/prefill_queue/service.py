"""The prefill-queue keeper's asyncio shell: connect as user ``prefill-queue``, check the queue
every ``heartbeat_s`` and say when it is missing or not as kvmesh makes it, serve metrics.

It makes nothing where the server asks for credentials: its user may only read the queue's INFO
(docs/security.md); ``admin`` makes the queue. On a server that asks for none (tests, a
``--nats-insecure`` mesh), where any client may create anything, it makes the queue itself."""

from __future__ import annotations

import asyncio
import time

import nats.errors
import nats.js.errors
from kvmesh.services.prefill_queue.config import QueueKeeperConfig
from kvmesh.services.prefill_queue.keeper import QueueState, ensure_queue, inspect_queue
from kvmesh.services.prefill_queue.metrics import QueueKeeperMetrics
from kvmesh.shared.bus.message_guard import guard_of
from kvmesh.shared.bus.nats_connect import connect_nats
from kvmesh.shared.bus.prefill_job_stream import MISSING, JetStreamUnavailableError
from kvmesh.shared.bus.service_lifetime import background, serve_until_signal
from kvmesh.shared.bus.worker_presence import new_worker_id
from kvmesh.shared.config.subjects import Subjects
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
    may_make: bool,
    jetstream_wait_s: float = JETSTREAM_WAIT_S,
) -> None:
    """Check the queue now and every ``check_s`` (a task body); ``may_make``: make what is
    missing too (an open server only). No JetStream for ``jetstream_wait_s`` in a row is fatal
    (PrefillQueueError: `kvmesh serve` says so in one line): a server started without -js, not
    a cluster whose JetStream is still electing its leader; a NATS error is retried at the next
    check."""
    last: QueueState | None = None
    unavailable_since: float | None = None
    while True:
        try:
            if may_make:
                state = await ensure_queue(nc, s, ack_wait_s)
            else:
                state = await inspect_queue(nc, s)
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
            _report(s, metrics, state, last)
            last = state
        await asyncio.sleep(check_s)


def _report(
    s: Subjects, metrics: QueueKeeperMetrics, state: QueueState, last: QueueState | None
) -> None:
    """Metrics every check; a log line when something changed."""
    for what in state.made:
        metrics.made.labels(what).inc()
    metrics.depth.set(state.depth)
    metrics.replicas.set(state.replicas)
    metrics.problems.set(len(state.problems))
    if state.made and last is not None:
        log.warning("made the prefill queue again (the NATS server lost it)", made=state.made)
    if last is not None and state.problems == last.problems:
        if state.replicas != last.replicas and not state.problems:
            log.info("prefill queue replicas changed", replicas=state.replicas)
        return
    if not state.problems:
        log.info(
            "prefill queue ready",
            stream=s.PREFILL_STREAM,
            replicas=state.replicas,
            wanted_replicas=state.wanted_replicas,
        )
    elif state.replicas == 0:
        log.warning("waiting for the prefill queue", why=MISSING.format(stream=s.PREFILL_STREAM))
    else:  # changed by a user that may (admin), or a server this keeper cannot vouch for
        log.error(
            "the prefill queue is not as kvmesh makes it; `kvmesh admin prefill-queue` puts it "
            "back",
            stream=s.PREFILL_STREAM,
            problems=list(state.problems),
        )


def may_make_queue(nc: Client) -> bool:
    """Whether the keeper makes the queue: only where the server asks for no credentials (the
    INFO line every server sends), where any client may create anything anyway. Elsewhere its
    user may only read the queue's INFO, and a create would be a logged permission violation."""
    return not nc._server_info.get("auth_required")


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
                may_make=may_make_queue(nc),
            )
        ),
    ):
        guard_of(nc).count_into(metrics.nats_refused)  # it reads nothing but API replies
        log.info("prefill-queue keeper running", worker_id=worker_id, metrics_port=port)
        await serve_until_signal()
