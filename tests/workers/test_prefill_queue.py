"""The prefill work queue on JetStream: jobs wait in the stream until a worker with room pulls.
The stream and its consumer are made by admin (services/prefill_queue/keeper.py: ensure_queue;
on these open servers any client may), never by a publisher or a worker; the keeper watches."""

from __future__ import annotations

import asyncio
import contextlib
import time

import nats.errors
import nats.js.api
import nats.js.errors
import pytest
from kvmesh.services.prefill_queue.keeper import ensure_queue
from kvmesh.shared.bus.nats_connect import connect_nats
from kvmesh.shared.bus.prefill_job_stream import PrefillJobQueue, publish_job, queue_depth
from kvmesh.shared.config.subjects import Subjects

S = Subjects("test")


async def test_jobs_wait_in_the_queue_until_a_worker_pulls_them(nats_server):
    async with connect_nats(nats_server, "router") as router, connect_nats(nats_server, "p") as p:
        state = await ensure_queue(router, S)
        assert state.made == ("stream", "consumer")
        assert (await ensure_queue(router, S)).made == ()  # idempotent
        for i in range(3):
            await publish_job(router, S, f"job-{i}".encode())
        assert await queue_depth(router, S) == 3
        async with PrefillJobQueue(p, S) as queue:
            first = await queue.next(timeout_s=2.0)
            assert first is not None and first.data == b"job-0"
            assert await queue_depth(router, S) == 3  # taken, not yet confirmed
            await queue.ack(first)
            assert await queue_depth(router, S) == 2  # acknowledged jobs leave the stream
            rest = [await queue.next(timeout_s=2.0) for _ in range(2)]
            assert [m.data for m in rest] == [b"job-1", b"job-2"]
            for msg in rest:
                await queue.ack(msg)
            assert await queue.next(timeout_s=0.2) is None


async def test_each_job_goes_to_exactly_one_of_several_workers(nats_server):
    async with (
        connect_nats(nats_server, "router") as router,
        connect_nats(nats_server, "p0") as p0,
        connect_nats(nats_server, "p1") as p1,
        PrefillJobQueue(p0, S) as q0,
        PrefillJobQueue(p1, S) as q1,
    ):
        await ensure_queue(router, S)
        for i in range(10):
            await publish_job(router, S, str(i).encode())

        async def drain(queue):
            got = []
            while (msg := await queue.next(timeout_s=0.3)) is not None:
                await queue.ack(msg)
                got.append(int(msg.data))
                await asyncio.sleep(0.01)
            return got

        a, b = await asyncio.gather(drain(q0), drain(q1))
    assert sorted(a + b) == list(range(10))
    assert a and b  # both pulled: a worker takes a job only when it asks for one


async def test_a_worker_that_does_not_pull_leaves_jobs_to_its_peer(nats_server):
    async with (
        connect_nats(nats_server, "router") as router,
        connect_nats(nats_server, "busy") as busy_nc,
        connect_nats(nats_server, "idle") as idle_nc,
        PrefillJobQueue(busy_nc, S),  # subscribed, but busy: never asks
        PrefillJobQueue(idle_nc, S) as idle,
    ):
        await ensure_queue(router, S)
        for i in range(4):
            await publish_job(router, S, str(i).encode())
        got = [int((await idle.next(timeout_s=2.0)).data) for _ in range(4)]
    assert got == [0, 1, 2, 3]


async def test_a_job_taken_and_never_acknowledged_goes_to_another_worker(nats_server):
    """A worker that dies between taking a job and announcing it: the job is not lost."""
    ack_wait_s = 1.0  # the mechanism is JetStream's whatever the wait; shorter than ACK_WAIT_S

    async with connect_nats(nats_server, "router") as router, connect_nats(nats_server, "p1") as p1:
        await ensure_queue(router, S, ack_wait_s=ack_wait_s)  # the consumer's, for every worker
        await publish_job(router, S, b"job")
        async with (
            connect_nats(nats_server, "p0") as p0,
            PrefillJobQueue(p0, S) as q0,
        ):
            taken = await q0.next(timeout_s=2.0)
            assert taken is not None and taken.data == b"job"
            taken_at = time.monotonic()
        # p0 is gone without acknowledging; after the ack wait the job is offered again
        async with PrefillJobQueue(p1, S) as q1:
            again = await q1.next(timeout_s=ack_wait_s + 5)
            assert again is not None and again.data == b"job"
            assert time.monotonic() - taken_at >= ack_wait_s * 0.9  # not before the ack wait
            await q1.ack(again)
            assert await q1.next(timeout_s=ack_wait_s + 1) is None  # confirmed: gone for good


async def test_publish_without_jetstream_says_how_to_fix_it():
    from kvmesh.shared.bus.nats_server import NatsServer
    from kvmesh.shared.bus.prefill_job_stream import PrefillQueueError

    async with NatsServer(jetstream=False) as server, connect_nats(server.url, "r") as nc:
        with pytest.raises(PrefillQueueError, match="-js"):
            await ensure_queue(nc, S)


async def test_the_keeper_waits_for_jetstream_before_it_gives_up():
    """A cluster's JetStream answers "unavailable" until its members elect a leader: the keeper
    tries again for a while, and only then says that the server has no JetStream."""
    from kvmesh.services.prefill_queue.metrics import QueueKeeperMetrics
    from kvmesh.services.prefill_queue.service import keep_queue
    from kvmesh.shared.bus.nats_server import NatsServer
    from kvmesh.shared.bus.prefill_job_stream import PrefillQueueError

    async with NatsServer(jetstream=False) as server, connect_nats(server.url, "k") as nc:
        started = time.monotonic()
        with pytest.raises(PrefillQueueError, match="-js"):
            await asyncio.wait_for(
                keep_queue(
                    nc,
                    S,
                    QueueKeeperMetrics(),
                    check_s=0.2,
                    ack_wait_s=5.0,
                    may_make=True,
                    jetstream_wait_s=1.0,
                ),
                timeout=10,
            )
        assert time.monotonic() - started >= 1.0  # not at the first "unavailable"


async def test_queue_status_counts_waiting_jobs_and_pulling_workers(nats_server):
    from kvmesh.shared.bus.messages.admin import QueueStatus
    from kvmesh.shared.bus.prefill_job_stream import queue_status

    async with connect_nats(nats_server, "r") as nc, connect_nats(nats_server, "p") as p:
        assert "kvmesh admin prefill-queue" in (await queue_status(nc, S)).note
        await ensure_queue(nc, S)
        await publish_job(nc, S, b"a")
        await publish_job(nc, S, b"b")
        async with PrefillJobQueue(p, S):
            assert await queue_status(nc, S) == QueueStatus(depth=2, workers=1)


async def test_a_job_can_be_withdrawn_only_before_a_worker_takes_it(nats_server):
    from kvmesh.shared.bus.prefill_job_stream import withdraw_job

    async with connect_nats(nats_server, "r") as nc, connect_nats(nats_server, "p") as p:
        await ensure_queue(nc, S)
        first = await publish_job(nc, S, b"a")
        second = await publish_job(nc, S, b"b")
        assert await withdraw_job(nc, S, second)
        async with PrefillJobQueue(p, S) as queue:
            taken = await queue.next(timeout_s=2.0)
            assert taken.data == b"a"
            await queue.ack(taken)
            assert await queue.next(timeout_s=0.2) is None  # b is gone for good
        assert not await withdraw_job(nc, S, first)  # taken and confirmed: too late
        assert await queue_depth(nc, S) == 0


async def test_the_queue_outlives_a_nats_restart_with_its_store():
    """The stream is on disk: a server restarted with its store (as kvmesh up restarts its own)
    still has the stream, its consumer and a job nobody took, with nobody making anything
    again (no runtime role may); the worker's pulls bind to the consumer again."""
    from kvmesh.shared.bus.nats_server import NatsServer

    server = NatsServer()
    await asyncio.to_thread(server.start)
    try:
        async with (
            connect_nats(server.url, "r", reconnect_time_wait_s=0.1) as router,
            connect_nats(server.url, "p", reconnect_time_wait_s=0.1) as p,
        ):
            await ensure_queue(router, S)
            async with PrefillJobQueue(p, S) as queue:
                await publish_job(router, S, b"before")
                await queue.ack(await queue.next(timeout_s=2.0))
                await publish_job(router, S, b"kept")
                server._proc.kill()  # a crash: no clean shutdown
                await asyncio.to_thread(server._proc.wait)
                await asyncio.to_thread(server.restart)
                for _ in range(100):  # every client reconnects
                    if router.is_connected and p.is_connected:
                        break
                    await asyncio.sleep(0.05)
                await publish_job(router, S, b"after", retry_for_s=10.0)
                got = []
                for _ in range(10):  # a pull may find its old subscription gone and bind again
                    with contextlib.suppress(nats.errors.Error):
                        if (msg := await queue.next(timeout_s=1.0)) is not None:
                            await queue.ack(msg)
                            got.append(msg.data)
                    if len(got) == 2:
                        break
                assert got == [b"kept", b"after"]
    finally:
        server.stop()


async def test_the_keeper_with_credentials_only_watches_and_reports_the_queue(tmp_path):
    """On a server that asks for credentials the keeper makes nothing (its user may only read
    INFO; a create would be a logged violation): it reports the queue missing, then as admin
    made it, then admin's republish rule as a problem."""
    from kvmesh.services.prefill_queue.metrics import QueueKeeperMetrics
    from kvmesh.services.prefill_queue.service import keep_queue, may_make_queue
    from kvmesh.shared.bus.nats_auth import MeshCredentials
    from kvmesh.shared.bus.nats_server import NatsServer
    from kvmesh.shared.bus.prefill_job_stream import stream_config

    creds = MeshCredentials.generate()
    metrics = QueueKeeperMetrics()

    def problems() -> float:
        return metrics.registry.get_sample_value("kvmesh_prefill_queue_problems")

    async def until(predicate) -> None:
        for _ in range(100):
            if predicate():
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the keeper did not report it")

    async with (
        NatsServer(authorization=creds.server_config(S)) as server,
        connect_nats(server.url, "k", auth=creds.auth("prefill-queue")) as nc,
        connect_nats(server.url, "admin", auth=creds.auth("admin")) as admin,
    ):
        assert not may_make_queue(nc)
        task = asyncio.ensure_future(
            keep_queue(nc, S, metrics, check_s=0.05, ack_wait_s=5.0, may_make=False)
        )
        try:
            await until(lambda: problems() == 2)  # stream and consumer missing
            with pytest.raises(nats.js.errors.NotFoundError):
                await admin.jetstream().stream_info(S.PREFILL_STREAM)  # the keeper made none
            await ensure_queue(admin, S)
            await until(lambda: problems() == 0)
            rule = stream_config(S)
            rule.republish = nats.js.api.RePublish(src=">", dest="_INBOX_admin.copy.>")
            await admin.jetstream().update_stream(rule)
            await until(lambda: problems() == 1)
            assert (await ensure_queue(admin, S)).made == ("stream",)  # admin puts it back
            await until(lambda: problems() == 0)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        assert server.permission_violations() == []


async def test_the_keeper_makes_the_queue_only_on_a_server_without_credentials(nats_server):
    from kvmesh.services.prefill_queue.service import may_make_queue

    async with connect_nats(nats_server, "k") as nc:
        assert may_make_queue(nc)


def test_queue_problems_name_extra_subjects_a_republish_and_a_push_consumer():
    from kvmesh.services.prefill_queue.keeper import queue_problems
    from kvmesh.shared.bus.prefill_job_stream import consumer_config, stream_config

    stream, consumer = stream_config(S), consumer_config(S)
    assert queue_problems(S, stream, consumer) == ()
    assert queue_problems(S, None, None) == ("stream missing", "consumer missing")
    assert queue_problems(S, stream, None) == ("consumer missing",)
    stream.subjects = [S.PREFILL_JOBS, S.REGISTRY_ADVERTISE]
    stream.republish = nats.js.api.RePublish(src=">", dest="_INBOX_prefill-queue.x")
    consumer.deliver_subject = "kvmesh.test.admin.drain"
    found = queue_problems(S, stream, consumer)
    assert len(found) == 3, found
    assert "_INBOX_prefill-queue.x" in found[1] and "kvmesh.test.admin.drain" in found[2]


async def test_making_the_queue_as_a_role_says_it_needs_admin():
    from kvmesh.shared.bus.nats_auth import MeshCredentials
    from kvmesh.shared.bus.nats_server import NatsServer
    from kvmesh.shared.bus.prefill_job_stream import PrefillQueueError

    from kvmesh.commands.queue_setup import make_prefill_queue

    creds = MeshCredentials.generate()
    async with NatsServer(authorization=creds.server_config(S)) as server:
        with pytest.raises(PrefillQueueError, match="needs the admin user"):
            await make_prefill_queue(server.url, S.mesh, auth=creds.auth("prefill-queue"))
        state = await make_prefill_queue(server.url, S.mesh, auth=creds.auth("admin"))
        assert state.made == ("stream", "consumer") and state.problems == ()


async def test_a_worker_started_before_the_queue_waits_for_it(nats_server):
    async with connect_nats(nats_server, "p") as p, PrefillJobQueue(p, S) as queue:
        with pytest.raises(nats.js.errors.NotFoundError):
            await queue.next(timeout_s=0.2)  # the pull loop says so once and tries again
        async with connect_nats(nats_server, "keeper") as keeper:
            await ensure_queue(keeper, S)
            await publish_job(keeper, S, b"job")
        got = await queue.next(timeout_s=2.0)
        assert got is not None and got.data == b"job"


async def test_each_mesh_has_its_own_queue_on_a_shared_server(nats_server):
    """Two meshes on one NATS: each stream holds its own mesh's jobs; a worker of one never
    pulls the other's."""
    a, b = Subjects("mesh-a"), Subjects("mesh-b")
    async with connect_nats(nats_server, "r") as router, connect_nats(nats_server, "p") as p:
        await ensure_queue(router, a)
        await ensure_queue(router, b)
        await publish_job(router, a, b"for-a")
        await publish_job(router, b, b"for-b")
        assert await queue_depth(router, a) == await queue_depth(router, b) == 1
        async with PrefillJobQueue(p, b) as queue_b:
            got = await queue_b.next(timeout_s=2.0)
            assert got is not None and got.data == b"for-b"
            await queue_b.ack(got)
            assert await queue_b.next(timeout_s=0.3) is None
        assert await queue_depth(router, a) == 1  # mesh a's job is still waiting for mesh a
        assert a.PREFILL_STREAM != b.PREFILL_STREAM


async def test_a_retried_publish_of_one_attempt_stores_its_job_once(nats_server):
    """The router publishes each attempt's job with its id as Nats-Msg-Id: a retry after a lost
    answer gets the first copy's sequence number and no second job."""
    async with connect_nats(nats_server, "router") as router:
        await ensure_queue(router, S)
        first = await publish_job(router, S, b"job", msg_id="req-1-a0")
        again = await publish_job(router, S, b"job", msg_id="req-1-a0")
        other = await publish_job(router, S, b"job", msg_id="req-1-r1")  # the next attempt
        assert again == first and other == first + 1
        assert await queue_depth(router, S) == 2


async def test_publish_to_a_server_without_jetstream_gives_up_saying_how_to_fix_it():
    from kvmesh.shared.bus.nats_server import NatsServer
    from kvmesh.shared.bus.prefill_job_stream import PrefillQueueError

    async with NatsServer(jetstream=False) as server, connect_nats(server.url, "r") as nc:
        with pytest.raises(PrefillQueueError, match="-js"):
            await publish_job(nc, S, b"job", retry_for_s=0.3)


async def test_a_failed_resubscribe_is_tried_again_not_left_dead(nats_server, monkeypatch):
    """JetStream unavailable on the worker's server (e.g. one cut off from its cluster): the
    fetch fails, and so does binding again. The next pulls must bind again; pulling through the
    old, unsubscribed one times out silently forever."""
    import nats.js.errors

    async with (
        connect_nats(nats_server, "router") as router,
        connect_nats(nats_server, "p") as p,
    ):
        await ensure_queue(router, S)
        async with PrefillJobQueue(p, S) as queue:
            unavailable = nats.js.errors.ServiceUnavailableError(code=503, description="test")
            real_fetch = queue._sub.fetch
            monkeypatch.setattr(queue._sub, "fetch", _failing_once(real_fetch, unavailable))
            js = p.jetstream()
            real_info = type(js).consumer_info
            infos = iter([unavailable])

            async def consumer_info(self, *args, **kwargs):
                if (exc := next(infos, None)) is not None:
                    raise exc
                return await real_info(self, *args, **kwargs)

            monkeypatch.setattr(type(js), "consumer_info", consumer_info)
            assert await queue.next(timeout_s=0.5) is None  # the fetch failed: unbound
            with pytest.raises(nats.js.errors.ServiceUnavailableError):
                await queue.next(timeout_s=0.5)  # binding again fails too
            await publish_job(router, S, b"after")
            got = None
            for _ in range(3):
                if (got := await queue.next(timeout_s=1.0)) is not None:
                    break
            assert got is not None and got.data == b"after"
            await queue.ack(got)


def _failing_once(call, exc):
    failures = iter([exc])

    async def wrapped(*args, **kwargs):
        if (failure := next(failures, None)) is not None:
            raise failure
        return await call(*args, **kwargs)

    return wrapped
