"""The mesh's prefill queue (the JetStream stream and its durable consumer): make it, and check it.

``ensure_queue`` makes what is missing, scales the stream up on a cluster and puts back a stream
or consumer that differs from kvmesh's config. It needs a NATS user that may create and update
them: ``admin`` (``kvmesh up`` at start, ``kvmesh admin prefill-queue`` for compose and an
operator's server) or anybody on a server that asks for no credentials. No runtime role may
(docs/security.md): a user that can create or update the stream can give it subjects and a
``republish`` rule, and the server would copy any message of the account to that user's inbox.

``inspect_queue`` only reads (the stream's and the consumer's INFO): the prefill-queue keeper
(``kvmesh serve prefill-queue``) watches the queue with it and says when it is missing or not
as kvmesh makes it. ``queue_problems`` is the comparison, pure."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import nats.errors
import nats.js.errors
from kvmesh.shared.bus.prefill_job_stream import (
    ACK_WAIT_S,
    CLUSTER_REPLICAS,
    DURABLE,
    JetStreamUnavailableError,
    PrefillQueueError,
    consumer_config,
    stream_config,
)
from kvmesh.shared.config.subjects import Subjects
from nats.aio.client import Client
from nats.js import api

STREAM_MISSING, CONSUMER_MISSING = "stream missing", "consumer missing"


@dataclass(frozen=True, slots=True)
class QueueState:
    """What one ``ensure_queue`` or ``inspect_queue`` found (and did)."""

    made: tuple[str, ...]  # "stream", "consumer": made (or put back) by this call
    replicas: int  # the stream's replicas now; 0: no stream
    wanted_replicas: int  # CLUSTER_REPLICAS on a cluster, 1 on a lone server
    depth: int  # jobs waiting
    problems: tuple[str, ...] = ()  # how it differs from kvmesh's config (queue_problems)

    @property
    def is_replicated(self) -> bool:
        return self.replicas >= self.wanted_replicas


def stream_replicas(nc: Client) -> list[int]:
    """Replica counts to try, best first: R3 on a cluster (the queue outlives one member; a
    cluster of two falls back to R1), R1 on a lone server."""
    clustered = bool(nc._server_info.get("cluster"))  # the INFO a clustered server sends
    return [CLUSTER_REPLICAS, 1] if clustered else [1]


def queue_problems(
    s: Subjects, stream: api.StreamConfig | None, consumer: api.ConsumerConfig | None
) -> tuple[str, ...]:
    """How the stream's and the consumer's config differ from what kvmesh makes, in what matters
    for who reads the jobs: other subjects, a copy of them elsewhere (republish, a transform,
    sources, a mirror), a push consumer (a deliver subject), another filter. Empty: as made."""
    if stream is None:
        return (STREAM_MISSING, CONSUMER_MISSING)  # a consumer lives in its stream
    want = stream_config(s)
    found = []
    if list(stream.subjects or ()) != want.subjects:
        found.append(f"stream subjects {stream.subjects} (not {want.subjects})")
    if stream.republish is not None:
        found.append(f"stream republishes to {stream.republish.dest!r}")
    for name in ("subject_transform", "mirror", "sources"):
        if getattr(stream, name):
            found.append(f"stream has a {name}")
    if stream.retention != want.retention:
        found.append(f"stream retention {stream.retention} (not {want.retention})")
    if stream.storage != want.storage:
        found.append(f"stream storage {stream.storage} (not {want.storage})")
    if consumer is None:
        return (*found, CONSUMER_MISSING)
    if consumer.deliver_subject:
        found.append(f"consumer delivers to {consumer.deliver_subject!r} (a push consumer)")
    if consumer.filter_subject != s.PREFILL_JOBS or consumer.filter_subjects:
        found.append(f"consumer filter {consumer.filter_subject or consumer.filter_subjects}")
    if consumer.ack_policy != api.AckPolicy.EXPLICIT:
        found.append(f"consumer ack policy {consumer.ack_policy}")
    return tuple(found)


async def inspect_queue(nc: Client, s: Subjects) -> QueueState:
    """The queue as it is, read with INFO only (the keeper's rights). Raises
    JetStreamUnavailableError when no JetStream answers, nats errors when NATS is unreachable."""
    js = nc.jetstream()
    stream = await _stream_info(nc, s)
    consumer = None
    if stream is not None:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            consumer = await js.consumer_info(s.PREFILL_STREAM, DURABLE)
    return QueueState(
        made=(),
        replicas=int(stream.config.num_replicas or 1) if stream is not None else 0,
        wanted_replicas=stream_replicas(nc)[0],
        depth=int(stream.state.messages) if stream is not None else 0,
        problems=queue_problems(
            s,
            stream.config if stream is not None else None,
            consumer.config if consumer is not None else None,
        ),
    )


async def ensure_queue(nc: Client, s: Subjects, ack_wait_s: float = ACK_WAIT_S) -> QueueState:
    """Make the stream and the consumer if they are missing, put back one that differs from
    kvmesh's config, scale the stream up to ``CLUSTER_REPLICAS`` on a cluster that can place them
    (a stream made while the cluster was forming has one, so that jobs flow at once; its jobs are
    kept). Needs ``admin`` (or an open server). Raises PrefillQueueError when the server has no
    JetStream or refuses the stream, nats errors when it is unreachable."""
    made: list[str] = []
    js = nc.jetstream()
    info = await _stream_info(nc, s)
    if info is None:
        info = await _make_stream(nc, s)
        made.append("stream")
    elif _stream_drifted(s, info.config):  # subjects, republish, ...: the admin's update
        info = await js.update_stream(stream_config(s, int(info.config.num_replicas or 1)))
        made.append("stream")
    info = await _scale_up(nc, s, info, stream_replicas(nc)[0])
    consumer = None
    with contextlib.suppress(nats.js.errors.NotFoundError):
        consumer = await js.consumer_info(s.PREFILL_STREAM, DURABLE)
    if consumer is not None and queue_problems(s, info.config, consumer.config):
        await js.delete_consumer(s.PREFILL_STREAM, DURABLE)  # a push consumer stays one
        consumer = None
    if consumer is None:
        await js.add_consumer(s.PREFILL_STREAM, config=consumer_config(s, ack_wait_s))
        made.append("consumer")
    return QueueState(
        made=tuple(made),
        replicas=int(info.config.num_replicas or 1),
        wanted_replicas=stream_replicas(nc)[0],
        depth=int(info.state.messages),
        problems=(await inspect_queue(nc, s)).problems,
    )


def _stream_drifted(s: Subjects, config: api.StreamConfig) -> bool:
    """What an update can put back (storage and retention it cannot: those stay problems)."""
    copies = (config.republish, config.subject_transform, config.mirror, config.sources)
    return list(config.subjects or ()) != [s.PREFILL_JOBS] or any(copies)


async def _stream_info(nc: Client, s: Subjects) -> api.StreamInfo | None:
    try:
        return await nc.jetstream().stream_info(s.PREFILL_STREAM)
    except nats.js.errors.NotFoundError:
        return None
    except (nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError) as exc:
        raise JetStreamUnavailableError(
            "the NATS server has JetStream disabled; kvmesh's prefill queue needs it "
            "(start nats-server with -js, as `kvmesh up` and docker-compose do)"
        ) from exc


async def _make_stream(nc: Client, s: Subjects) -> api.StreamInfo:
    js = nc.jetstream()
    error: Exception | None = None
    for replicas in stream_replicas(nc):
        try:
            return await js.add_stream(stream_config(s, replicas))
        except nats.js.errors.BadRequestError as exc:  # made concurrently, or too few peers
            with contextlib.suppress(nats.js.errors.NotFoundError):
                return await js.stream_info(s.PREFILL_STREAM)
            error = exc
        except nats.js.errors.ServiceUnavailableError as exc:  # JetStream (cluster) not ready
            error = exc
    raise PrefillQueueError(f"cannot create JetStream stream {s.PREFILL_STREAM}: {error}")


async def _scale_up(nc: Client, s: Subjects, info: api.StreamInfo, wanted: int) -> api.StreamInfo:
    """The stream with ``wanted`` replicas, or as it was while the cluster cannot place them
    ("no suitable peers for placement", no JetStream leader yet: tried again next call)."""
    if int(info.config.num_replicas or 1) >= wanted:
        return info
    try:
        return await nc.jetstream().update_stream(stream_config(s, wanted))
    except (
        nats.js.errors.BadRequestError,
        nats.js.errors.ServiceUnavailableError,
        nats.errors.TimeoutError,
    ):
        return info
