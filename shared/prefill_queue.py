"""The prefill work queue: a JetStream work-queue stream that prefill workers pull from.

Why pull: with a core NATS queue group the server pushes each job to some member at once, so a
busy worker's client buffer fills with jobs while a peer sits idle. Here the router publishes
into the stream (``publish_job``) and each prefill worker fetches one job only when it has a free
slot (``PrefillJobQueue.next``), so whoever has room takes the next job, in arrival order. The
stream lives in memory: a job is worth nothing once its router has given up (its lease, renewed
by that router, keeps the decode blocks only while the router waits). On a NATS cluster the
stream has three replicas (``stream_replicas``), so the queue outlives the loss of one server;
one made while the cluster was forming has one, and is scaled up once it can have three.

A job is acknowledged once its worker has announced it (``PrefillStarted``, to the router and
the decode worker), before any KV is written. A worker that dies between taking a job and that
announcement leaves the job unacknowledged, and JetStream hands it to another worker after
``ACK_WAIT_S``. One that dies after it leaves its request to the router, which hears the
registry's ``WorkerGone`` and runs it again; the job is never redelivered (a redelivery would
rewrite chunks the decode worker already counted).
"""

from __future__ import annotations

import asyncio
import contextlib

import nats.errors
import nats.js.errors
from kvmesh.shared.subjects import Subjects
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import api

DURABLE = "prefill"
MAX_AGE_S = 600.0  # a job nobody took in 10 minutes has been given up by its router
ACK_WAIT_S = 5.0  # a job taken and not acknowledged within this goes to another worker
REPLICA_CHECK_S = 10.0  # how often a worker tries to scale an under-replicated queue up


CLUSTER_REPLICAS = 3  # on a NATS cluster: the queue survives the loss of any one server


def stream_config(s: Subjects, replicas: int = 1) -> api.StreamConfig:
    """The mesh's own stream (``KVMESH_PREFILL_<mesh>``) over its own jobs subject."""
    return api.StreamConfig(
        name=s.PREFILL_STREAM,
        subjects=[s.PREFILL_JOBS],
        retention=api.RetentionPolicy.WORK_QUEUE,
        storage=api.StorageType.MEMORY,
        max_age=MAX_AGE_S,
        num_replicas=replicas,
    )


def stream_replicas(nc: Client) -> list[int]:
    """Replica counts to try, best first: R3 on a cluster (the queue outlives one member; a
    cluster of two falls back to R1), R1 on a lone server."""
    clustered = bool(nc._server_info.get("cluster"))  # the INFO a clustered server sends
    return [CLUSTER_REPLICAS, 1] if clustered else [1]


class PrefillQueueError(RuntimeError):
    """The NATS server cannot hold the prefill queue (JetStream off, or a conflicting stream)."""


async def ensure_stream(nc: Client, s: Subjects) -> bool:
    """Create the stream if it does not exist (idempotent; router and prefill both call it).
    True when the stream has the replicas it should have here; False when it has fewer.

    A cluster still forming (a member not yet joined, JetStream not yet placed on all three)
    cannot place three replicas, and the stream is made with one so that jobs flow at once.
    Each later call scales such a stream up to ``CLUSTER_REPLICAS`` once the cluster can hold
    them (its jobs are kept); ``PrefillJobQueue`` calls it every ``REPLICA_CHECK_S`` until then.
    """
    js = nc.jetstream()
    wanted = stream_replicas(nc)
    try:
        info = await js.stream_info(s.PREFILL_STREAM)
    except nats.js.errors.NotFoundError:
        pass
    except (nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError) as exc:
        raise PrefillQueueError(
            "the NATS server has JetStream disabled; kvmesh's prefill queue needs it "
            "(start nats-server with -js, as `kvmesh up` and docker-compose do)"
        ) from exc
    else:
        return await _scale_up(nc, s, info, wanted[0])
    for replicas in wanted:
        try:
            await js.add_stream(stream_config(s, replicas))
            return replicas == wanted[0]
        except nats.js.errors.BadRequestError as exc:  # created concurrently, or too few peers
            with contextlib.suppress(nats.js.errors.NotFoundError):
                return await _scale_up(nc, s, await js.stream_info(s.PREFILL_STREAM), wanted[0])
            error = exc
        except nats.js.errors.ServiceUnavailableError as exc:  # JetStream (cluster) not ready
            error = exc
    raise PrefillQueueError(f"cannot create JetStream stream {s.PREFILL_STREAM}: {error}")


async def _scale_up(nc: Client, s: Subjects, info: api.StreamInfo, wanted: int) -> bool:
    """Raise an existing stream's replicas to ``wanted``; False while the cluster cannot place
    them ("no suitable peers for placement", no JetStream leader yet: tried again later)."""
    if int(info.config.num_replicas or 1) >= wanted:
        return True
    try:
        await nc.jetstream().update_stream(stream_config(s, wanted))
    except (
        nats.js.errors.BadRequestError,
        nats.js.errors.ServiceUnavailableError,
        nats.errors.TimeoutError,
    ):
        return False
    return True


async def publish_job(
    nc: Client,
    s: Subjects,
    data: bytes,
    *,
    msg_id: str | None = None,
    timeout_s: float = 5.0,
    retry_for_s: float = 30.0,
) -> int:
    """Append an encoded PrefillJob to the queue; its sequence number in the stream. Raises
    nats errors, or PrefillQueueError when the server cannot hold the queue at all, when it is
    not stored within ``retry_for_s``.

    "No response from stream" means nothing answered for it: the stream is missing (the NATS
    server restarted with an empty store: it is created again) or, on a cluster, it has no
    leader for the moment (a partition healing, a member restarting: the replicas elect one,
    which takes nats-server 4-9 s of silence before a vote, 5 s here on a quiet box and more
    than 10 s on a loaded one, longer again on a split vote). A leader that lost its quorum does not answer at all (a timeout). All
    three are retried with backoff until ``retry_for_s``, each try waiting at most
    ``timeout_s``. ``msg_id`` (one per attempt of a request) goes out as ``Nats-Msg-Id``, so a
    job that was stored although its answer was lost is not stored twice by the retry: the
    stream answers with the first copy's sequence number."""
    js = nc.jetstream()
    headers = {"Nats-Msg-Id": msg_id} if msg_id else None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + retry_for_s
    pause = 0.05
    queue_error: PrefillQueueError | None = None
    while True:
        wait_s = min(timeout_s, max(1.0, deadline - loop.time()))
        try:
            ack = await js.publish(
                s.PREFILL_JOBS, data, timeout=wait_s, stream=s.PREFILL_STREAM, headers=headers
            )
            return int(ack.seq)
        except (
            nats.js.errors.NoStreamResponseError,
            nats.js.errors.ServiceUnavailableError,
            nats.errors.TimeoutError,
        ):
            if loop.time() + pause > deadline:
                if queue_error is not None:  # says why, e.g. JetStream is off: raise that
                    raise queue_error from None
                raise
        try:
            await ensure_stream(nc, s)
            queue_error = None
        except PrefillQueueError as exc:
            queue_error = exc
        except (nats.errors.Error, nats.js.errors.Error):
            pass
        await asyncio.sleep(min(pause, max(0.0, deadline - loop.time())))
        pause = min(2 * pause, 1.0)


async def withdraw_job(nc: Client, s: Subjects, seq: int) -> bool:
    """Take a job off the queue if no worker has taken it yet. True: it is gone and no worker
    will ever compute it; False: a worker took it first (or the queue is unreachable)."""
    try:
        return bool(await nc.jetstream().delete_msg(s.PREFILL_STREAM, seq))
    except (nats.errors.Error, nats.js.errors.Error):
        return False


async def queue_depth(nc: Client, s: Subjects) -> int:
    """Jobs waiting in the queue for a prefill worker."""
    info = await nc.jetstream().stream_info(s.PREFILL_STREAM)
    return int(info.state.messages)


async def queue_status(nc: Client, s: Subjects) -> dict[str, int | str]:
    """What ``kvmesh admin status`` shows: waiting jobs and pulling workers (or why not)."""
    try:
        info = await nc.jetstream().stream_info(s.PREFILL_STREAM)
    except nats.js.errors.NotFoundError:
        return {"depth": 0, "workers": 0, "note": "no prefill queue yet (no router or prefill)"}
    except (nats.errors.Error, nats.js.errors.Error) as exc:
        return {"depth": -1, "workers": 0, "note": f"JetStream unavailable: {exc}"}
    return {"depth": int(info.state.messages), "workers": int(info.state.consumer_count)}


class PrefillJobQueue:
    """A prefill worker's pull subscription: ``next()`` takes one job, ``ack()`` confirms it once
    the job is announced (until then JetStream gives it to another worker after ``ack_wait_s``,
    ``ACK_WAIT_S`` by default; every worker of a mesh pulls through one consumer, so they must
    agree on it)."""

    def __init__(
        self,
        nc: Client,
        s: Subjects,
        *,
        ack_wait_s: float = ACK_WAIT_S,
        replica_check_s: float = REPLICA_CHECK_S,
    ) -> None:
        assert ack_wait_s > 0, ack_wait_s
        assert replica_check_s > 0, replica_check_s
        self._nc = nc
        self._subjects = s
        self._ack_wait_s = ack_wait_s
        self._replica_check_s = replica_check_s
        self._replicated = False  # the stream has all its replicas (ensure_stream said so)
        self._next_replica_check = 0.0
        self._sub = None

    async def __aenter__(self) -> PrefillJobQueue:
        await self._subscribe()
        return self

    async def _subscribe(self) -> None:
        """Make the stream and the consumer if they are missing and pull through the consumer;
        ``self._sub`` is set only once that worked (a NATS error leaves it None)."""
        await self._ensure_stream()
        config = api.ConsumerConfig(
            ack_policy=api.AckPolicy.EXPLICIT, max_ack_pending=-1, ack_wait=self._ack_wait_s
        )
        self._sub = await self._nc.jetstream().pull_subscribe(
            self._subjects.PREFILL_JOBS,
            durable=DURABLE,
            stream=self._subjects.PREFILL_STREAM,
            config=config,
        )

    async def _ensure_stream(self) -> None:
        self._replicated = await ensure_stream(self._nc, self._subjects)
        self._next_replica_check = asyncio.get_running_loop().time() + self._replica_check_s

    async def _unsubscribe(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None and not self._nc.is_closed:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    async def __aexit__(self, *exc: object) -> None:
        await self._unsubscribe()

    async def next(self, timeout_s: float = 1.0) -> Msg | None:
        """The next job, not yet acknowledged; None when none came within ``timeout_s``.

        A NATS error (JetStream unavailable, a server cut off from its cluster) is raised for
        the caller to try again; a subscription lost on the way is made again first."""
        if self._sub is None:  # lost below and not yet made again
            await self._subscribe()
            assert self._sub is not None
        elif not self._replicated and asyncio.get_running_loop().time() >= self._next_replica_check:
            await self._ensure_stream()  # made while the cluster was forming: scale it up
        try:
            [msg] = await self._sub.fetch(1, timeout=timeout_s)
        except nats.errors.TimeoutError:
            return None
        except (nats.js.errors.ServiceUnavailableError, nats.js.errors.NotFoundError):
            # the stream or our consumer is gone (the NATS server restarted with an empty
            # store), or JetStream is unavailable on our server: make them again, and pull from
            # the new ones from now on. Until that works the next call tries again: an
            # unsubscribed pull subscription would time out on every fetch, silently, forever.
            await self._unsubscribe()
            await self._subscribe()
            return None
        return msg

    @staticmethod
    async def ack(msg: Msg) -> None:
        """Confirm ``msg``'s job: no other worker can get it now."""
        await msg.ack_sync(timeout=5.0)
