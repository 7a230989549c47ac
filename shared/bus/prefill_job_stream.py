"""The prefill work queue: a JetStream work-queue stream that prefill workers pull from.

Why pull: with a core NATS queue group the server pushes each job to some member at once, so a
busy worker's client buffer fills with jobs while a peer sits idle. Here the router publishes
into the stream (``publish_job``) and each prefill worker fetches one job only when it has a free
slot (``PrefillJobQueue.next``), so whoever has room takes the next job, in arrival order. The
stream is kept on disk (JetStream file storage, in the server's store directory), so a NATS server
that restarts (``kvmesh up`` restarts its own with the same store; compose keeps it on a volume)
still has it and its consumer: nothing has to make them again at run time. Old jobs it keeps are
harmless: a job whose router gave up is refused at its first write (its lease ended), and
``MAX_AGE_S`` drops it. On a NATS cluster the stream has three replicas, so the queue outlives
the loss of one server.

Who may do what (shared/bus/nats_auth.py, docs/security.md): no runtime role may create, change
or delete the stream or its consumer: one that could would give the stream subjects and a
``republish`` rule, and the server would copy any message of the mesh to it. ``admin`` makes them
(``kvmesh up`` at start, ``kvmesh admin prefill-queue`` for compose and an operator's server;
services/prefill_queue/keeper.py); the prefill-queue keeper only reads their INFO and says when
they are missing or changed. The router may publish jobs and withdraw one (``withdraw_job``);
prefill workers may read the consumer, pull and acknowledge; the kv-registry may read the
stream's state (``queue_status``).

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
from kvmesh.shared.bus.messages.admin import QueueStatus
from kvmesh.shared.config.subjects import Subjects
from kvmesh.shared.obs import logs
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import api
from nats.js.client import JetStreamContext

log = logs.get_logger(__name__)

DURABLE = "prefill"
MAX_AGE_S = 600.0  # a job nobody took in 10 minutes has been given up by its router
ACK_WAIT_S = 5.0  # a job taken and not acknowledged within this goes to another worker
CLUSTER_REPLICAS = 3  # on a NATS cluster: the queue survives the loss of any one server


def stream_config(s: Subjects, replicas: int = 1) -> api.StreamConfig:
    """The mesh's own stream (``KVMESH_PREFILL_<mesh>``) over its own jobs subject."""
    return api.StreamConfig(
        name=s.PREFILL_STREAM,
        subjects=[s.PREFILL_JOBS],
        retention=api.RetentionPolicy.WORK_QUEUE,
        storage=api.StorageType.FILE,  # survives a NATS restart
        max_age=MAX_AGE_S,
        num_replicas=replicas,
    )


def consumer_config(s: Subjects, ack_wait_s: float = ACK_WAIT_S) -> api.ConsumerConfig:
    """The one durable pull consumer every prefill worker of the mesh takes jobs through."""
    return api.ConsumerConfig(
        name=DURABLE,
        durable_name=DURABLE,
        filter_subject=s.PREFILL_JOBS,
        ack_policy=api.AckPolicy.EXPLICIT,
        max_ack_pending=-1,
        ack_wait=ack_wait_s,
    )


class PrefillQueueError(RuntimeError):
    """The NATS server cannot hold the prefill queue (JetStream off, or a conflicting stream)."""


class JetStreamUnavailableError(PrefillQueueError):
    """No JetStream answers: off on this server, or a cluster whose JetStream is not up yet."""


MISSING = (
    "the prefill queue {stream} is missing: the NATS user admin makes it (kvmesh up does at "
    "start; compose and an operator's server: `kvmesh admin prefill-queue`; on a server without "
    "credentials, `kvmesh serve prefill-queue`); no role may create streams or consumers, "
    "docs/security.md"
)


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
    PrefillQueueError (no stream answered: it says who makes it) or nats errors when it is not
    stored within ``retry_for_s``.

    "No response from stream" means nothing answered for it: the stream is missing (the NATS
    server lost its store: ``kvmesh admin prefill-queue`` makes it again; it is never made
    here) or, on a cluster, it has no
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
    while True:
        wait_s = min(timeout_s, max(1.0, deadline - loop.time()))
        try:
            ack = await js.publish(
                s.PREFILL_JOBS, data, timeout=wait_s, stream=s.PREFILL_STREAM, headers=headers
            )
            return int(ack.seq)
        except nats.js.errors.NoStreamResponseError:
            if loop.time() + pause > deadline:
                raise PrefillQueueError(
                    f"no prefill queue took the job within {retry_for_s:g}s: "
                    + MISSING.format(stream=s.PREFILL_STREAM)
                    + ", and needs a NATS server with JetStream (-js)"
                ) from None
        except (nats.js.errors.ServiceUnavailableError, nats.errors.TimeoutError):
            if loop.time() + pause > deadline:
                raise
        await asyncio.sleep(min(pause, max(0.0, deadline - loop.time())))
        pause = min(2 * pause, 1.0)


async def withdraw_job(nc: Client, s: Subjects, seq: int) -> bool:
    """Take a job off the queue if no worker has taken it yet. True: it is gone and no worker
    will ever compute it; False: a worker took it first (or the queue is unreachable).

    The router holds ``$JS.API.STREAM.MSG.DELETE`` of its mesh's stream for this, and nothing
    else of the stream's API: it can delete a job it did not publish (another router's), which
    withdraws that request before a worker took it, as the ``Abort`` the router role may
    already publish for any request does; the stream holds nothing but jobs."""
    try:
        return bool(await nc.jetstream().delete_msg(s.PREFILL_STREAM, seq))
    except (nats.errors.Error, nats.js.errors.Error):
        return False


async def queue_depth(nc: Client, s: Subjects) -> int:
    """Jobs waiting in the queue for a prefill worker."""
    info = await nc.jetstream().stream_info(s.PREFILL_STREAM)
    return int(info.state.messages)


async def queue_status(nc: Client, s: Subjects) -> QueueStatus:
    """What ``kvmesh admin status`` shows: waiting jobs and pulling workers (or why not)."""
    try:
        info = await nc.jetstream().stream_info(s.PREFILL_STREAM)
    except nats.js.errors.NotFoundError:
        return QueueStatus(0, 0, note=MISSING.format(stream=s.PREFILL_STREAM))
    except (nats.errors.Error, nats.js.errors.Error) as exc:
        return QueueStatus(-1, 0, note=f"JetStream unavailable: {exc}")
    return QueueStatus(int(info.state.messages), int(info.state.consumer_count))


class PrefillJobQueue:
    """A prefill worker's pull subscription: ``next()`` takes one job, ``ack()`` confirms it once
    the job is announced (until then JetStream gives it to another worker after the consumer's
    ack wait). It binds to the mesh's durable consumer and never makes or changes it: ``admin``
    does (services/prefill_queue/keeper.py), and a worker waits for it. What the
    worker's NATS user needs is the consumer's INFO and MSG.NEXT and acks (shared/bus/nats_auth.py)."""

    def __init__(self, nc: Client, s: Subjects) -> None:
        self._nc = nc
        self._subjects = s
        self._sub: JetStreamContext.PullSubscription | None = None
        self._waiting = False  # said once that the queue is missing

    async def __aenter__(self) -> PrefillJobQueue:
        with contextlib.suppress(nats.errors.Error):  # missing: next() tries again
            await self._subscribe()
        return self

    async def _subscribe(self) -> None:
        """Bind to the consumer if it exists; ``self._sub`` is set only once that worked (a
        NATS error, or a missing queue, leaves it None and is raised)."""
        js = self._nc.jetstream()
        s = self._subjects
        try:
            await js.consumer_info(s.PREFILL_STREAM, DURABLE)
        except nats.js.errors.NotFoundError:
            if not self._waiting:
                log.warning(
                    "waiting for the prefill queue", why=MISSING.format(stream=s.PREFILL_STREAM)
                )
            self._waiting = True
            raise
        if self._waiting:
            log.info("the prefill queue is there")
            self._waiting = False
        self._sub = await js.pull_subscribe_bind(durable=DURABLE, stream=s.PREFILL_STREAM)

    async def _unsubscribe(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None and not self._nc.is_closed:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    async def __aexit__(self, *exc: object) -> None:
        await self._unsubscribe()

    async def next(self, timeout_s: float = 1.0) -> Msg | None:
        """The next job, not yet acknowledged; None when none came within ``timeout_s``.

        A NATS error (JetStream unavailable, a server cut off from its cluster, the queue not
        there yet) is raised for the caller to try again; a subscription lost on the way is
        made again first."""
        if self._sub is None:  # lost below, or the queue was not there yet
            await self._subscribe()
            assert self._sub is not None
        try:
            [msg] = await self._sub.fetch(1, timeout=timeout_s)
        except nats.errors.TimeoutError:
            return None
        except (nats.js.errors.ServiceUnavailableError, nats.js.errors.NotFoundError):
            # the stream or our consumer is gone (the NATS server lost its store and admin
            # made them again), or JetStream is unavailable on our server: bind to the new ones
            # from the next call. An unbound pull subscription would
            # time out on every fetch, silently, forever.
            await self._unsubscribe()
            return None
        return msg

    @staticmethod
    async def ack(msg: Msg) -> None:
        """Confirm ``msg``'s job: no other worker can get it now."""
        await msg.ack_sync(timeout=5.0)
