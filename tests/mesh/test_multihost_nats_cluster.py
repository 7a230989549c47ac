"""A NATS cluster on loopback (no namespaces needed): three nats-servers joined by routes, a
client given every member's URL reconnects to another when its own goes, and the prefill queue is
a three-replica stream that keeps its jobs through the loss of one server."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import pytest
from kvmesh.services.prefill_queue.keeper import ensure_queue
from kvmesh.shared.bus import prefill_job_stream
from kvmesh.shared.bus.nats_connect import connect_nats
from kvmesh.shared.bus.nats_server import ClusterSpec, NatsServer
from kvmesh.shared.config.nats_options import redact_url, split_nats_urls
from kvmesh.shared.config.ports import free_port
from kvmesh.shared.config.subjects import Subjects


def test_cluster_spec_refuses_a_bad_route():
    with pytest.raises(ValueError, match="not a route"):
        ClusterSpec("kvmesh", "n1", 6222, ("http://a:1",))
    with pytest.raises(ValueError, match="server name"):
        ClusterSpec("kvmesh", "bad name", 6222)


def test_several_urls_split_and_redact_each():
    url = "nats://alice:secret@10.0.0.1:4222, nats://10.0.0.2:4222"
    assert split_nats_urls(url) == ["nats://alice:secret@10.0.0.1:4222", "nats://10.0.0.2:4222"]
    assert redact_url(url) == "nats://alice:***@10.0.0.1:4222,nats://10.0.0.2:4222"


@contextlib.contextmanager
def cluster(size: int = 3, started: int | None = None) -> Iterator[list[NatsServer]]:
    """``size`` members routed to each other; the first ``started`` (all by default) running,
    the others for the test to start."""
    route_ports = [free_port() for _ in range(size)]
    servers = []
    try:
        for i in range(size):
            routes = tuple(
                f"nats-route://127.0.0.1:{p}" for j, p in enumerate(route_ports) if j != i
            )
            spec = ClusterSpec("kvmesh-test", f"n{i}", route_ports[i], routes)
            servers.append(NatsServer(free_port(), cluster=spec))
            if started is None or i < started:
                servers[-1].start()
        yield servers
    finally:
        for server in servers:
            server.stop()


async def _until(predicate, timeout_s: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            if await predicate():
                return
        except Exception:
            if asyncio.get_running_loop().time() > deadline:
                raise
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.2)


async def test_client_reconnects_to_another_member_and_the_queue_keeps_its_jobs():
    subjects = Subjects("cluster-test")
    with cluster() as servers:
        urls = ",".join(s.url for s in servers)
        async with connect_nats(urls, "test-client") as nc:
            # all three replicas, once the cluster can place them (a stream made while it was
            # still forming has one, and is scaled up: see the test below)
            await _until(lambda: _replicated(nc, subjects))
            await prefill_job_stream.publish_job(nc, subjects, b"job-1")
            connected = nc.connected_url.port
            [own] = [s for s in servers if s.port == connected]
            own.stop()
            await _until(lambda: _reconnected_elsewhere(nc, connected))
            # the stream kept its job (two of three replicas remain: a quorum)
            await _until(lambda: _depth_is(nc, subjects, 1))
            await prefill_job_stream.publish_job(nc, subjects, b"job-2")
            await _until(lambda: _depth_is(nc, subjects, 2))


async def test_a_queue_made_while_the_cluster_forms_is_scaled_up_and_keeps_its_jobs():
    """Two of three members up: the queue cannot have three replicas and is made with one, so
    jobs flow at once. When the third joins, the keeper (the one user that may change the
    stream; services/prefill_queue/) scales it to three on its next check, and the job
    published before is still there."""
    subjects = Subjects("cluster-test")
    with cluster(started=2) as servers:
        async with (
            connect_nats(servers[0].url, "prefill-queue") as keeper,
            connect_nats(servers[0].url, "prefill") as nc,
        ):
            await _until(lambda: _stream_ready(keeper, subjects), timeout_s=60.0)
            assert not (await ensure_queue(keeper, subjects)).is_replicated
            await prefill_job_stream.publish_job(nc, subjects, b"job-1")
            async with prefill_job_stream.PrefillJobQueue(nc, subjects) as queue:
                assert await _replicas(nc, subjects) == 1
                servers[2].start()

                async def scaled_up() -> bool:
                    await ensure_queue(keeper, subjects)  # the keeper's check
                    msg = await queue.next(timeout_s=0.2)
                    if msg is not None:  # taken, not acknowledged: it stays in the stream
                        assert msg.data == b"job-1"
                    return await _replicas(nc, subjects) == prefill_job_stream.CLUSTER_REPLICAS

                await _until(scaled_up, timeout_s=60.0)
            await _until(lambda: _depth_is(nc, subjects, 1))
            assert (await ensure_queue(keeper, subjects)).is_replicated


async def _replicas(nc, subjects) -> int:
    info = await nc.jetstream().stream_info(subjects.PREFILL_STREAM)
    return int(info.config.num_replicas)


async def _reconnected_elsewhere(nc, port: int) -> bool:
    return nc.is_connected and nc.connected_url.port != port


async def _replicated(nc, subjects) -> bool:
    """The queue exists with all its replicas, a leader and both followers current."""
    if not (await ensure_queue(nc, subjects)).is_replicated:
        return False
    info = await nc.jetstream().stream_info(subjects.PREFILL_STREAM)
    followers = info.cluster.replicas or [] if info.cluster else []
    assert info.config.num_replicas == prefill_job_stream.CLUSTER_REPLICAS
    return bool(
        info.cluster
        and info.cluster.leader
        and len(followers) == prefill_job_stream.CLUSTER_REPLICAS - 1
        and all(r.current and not r.offline for r in followers)
    )


async def _stream_ready(nc, subjects) -> bool:
    await ensure_queue(nc, subjects)
    return True


async def _depth_is(nc, subjects, depth: int) -> bool:
    return await prefill_job_stream.queue_depth(nc, subjects) == depth


async def test_a_job_published_while_the_queue_elects_a_leader_is_stored_once():
    """The queue's leader dies: until the two others elect one, nothing answers for the stream
    (what a router saw while a healed partition re-elected). publish_job retries until there is
    a leader, and a retry of the same attempt stores its job once."""
    subjects = Subjects("cluster-test")
    with cluster() as servers:
        async with connect_nats(servers[0].url, "probe") as nc:
            await _until(lambda: _replicated(nc, subjects))
            leader = (await nc.jetstream().stream_info(subjects.PREFILL_STREAM)).cluster.leader
        [dying] = [s for s in servers if s.cluster.server_name == leader]
        [other, *_] = [s for s in servers if s is not dying]
        async with connect_nats(other.url, "router") as nc:
            dying.stop()
            # an election takes 5 s on a quiet box, more than 10 s on a loaded one: a router
            # retries for until its first-token deadline (300 s by default)
            seq = await prefill_job_stream.publish_job(
                nc, subjects, b"job", msg_id="req-1", retry_for_s=60.0
            )
            again = await prefill_job_stream.publish_job(nc, subjects, b"job", msg_id="req-1")
            assert again == seq
            await _until(lambda: _depth_is(nc, subjects, 1))
