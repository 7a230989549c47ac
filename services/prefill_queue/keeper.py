"""Make the mesh's prefill queue (the JetStream stream and its durable consumer) and keep it:
the prefill-queue keeper's JetStream calls, the only ones in kvmesh that create or change a
stream or a consumer (docs/security.md). Idempotent: each call makes what is missing and scales
an under-replicated stream up, and says what it did."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import nats.errors
import nats.js.errors
from kvmesh.shared.bus.prefill_queue import (
    ACK_WAIT_S,
    CLUSTER_REPLICAS,
    DURABLE,
    JetStreamUnavailableError,
    PrefillQueueError,
    consumer_config,
    stream_config,
)
from kvmesh.shared.bus.subjects import Subjects
from nats.aio.client import Client
from nats.js import api


@dataclass(frozen=True, slots=True)
class QueueState:
    """What one ``ensure_queue`` found and did."""

    made: tuple[str, ...]  # "stream", "consumer": made by this call
    replicas: int  # the stream's replicas now
    wanted_replicas: int  # CLUSTER_REPLICAS on a cluster, 1 on a lone server
    depth: int  # jobs waiting

    @property
    def is_replicated(self) -> bool:
        return self.replicas >= self.wanted_replicas


def stream_replicas(nc: Client) -> list[int]:
    """Replica counts to try, best first: R3 on a cluster (the queue outlives one member; a
    cluster of two falls back to R1), R1 on a lone server."""
    clustered = bool(nc._server_info.get("cluster"))  # the INFO a clustered server sends
    return [CLUSTER_REPLICAS, 1] if clustered else [1]


async def ensure_queue(nc: Client, s: Subjects, ack_wait_s: float = ACK_WAIT_S) -> QueueState:
    """Make the stream and the consumer if they are missing; scale the stream up to
    ``CLUSTER_REPLICAS`` on a cluster that can place them (a stream made while the cluster was
    forming has one, so that jobs flow at once; its jobs are kept). Raises PrefillQueueError
    when the server has no JetStream or refuses the stream, nats errors when it is unreachable."""
    made: list[str] = []
    info = await _stream(nc, s, made)
    info = await _scale_up(nc, s, info, stream_replicas(nc)[0])
    js = nc.jetstream()
    try:
        await js.consumer_info(s.PREFILL_STREAM, DURABLE)
    except nats.js.errors.NotFoundError:
        await js.add_consumer(s.PREFILL_STREAM, config=consumer_config(s, ack_wait_s))
        made.append("consumer")
    return QueueState(
        made=tuple(made),
        replicas=int(info.config.num_replicas or 1),
        wanted_replicas=stream_replicas(nc)[0],
        depth=int(info.state.messages),
    )


async def _stream(nc: Client, s: Subjects, made: list[str]) -> api.StreamInfo:
    js = nc.jetstream()
    try:
        return await js.stream_info(s.PREFILL_STREAM)
    except nats.js.errors.NotFoundError:
        pass
    except (nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError) as exc:
        raise JetStreamUnavailableError(
            "the NATS server has JetStream disabled; kvmesh's prefill queue needs it "
            "(start nats-server with -js, as `kvmesh up` and docker-compose do)"
        ) from exc
    error: Exception | None = None
    for replicas in stream_replicas(nc):
        try:
            info = await js.add_stream(stream_config(s, replicas))
            made.append("stream")
            return info
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
