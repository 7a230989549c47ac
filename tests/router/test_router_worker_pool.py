"""WorkerPool: the router's view of which workers of a role are alive and ready (pure)."""

from __future__ import annotations

from kvmesh.services.router.worker_pool import WorkerPool


def test_pool_is_unknown_until_the_router_has_listened_one_window():
    pool = WorkerPool(liveness_s=3.0, started_at=100.0)
    assert not pool.is_known(101.0)  # too early to say nobody is there
    assert pool.is_known(103.5) and pool.num_alive(103.5) == 0


def test_workers_count_while_their_heartbeats_are_fresh():
    pool = WorkerPool(liveness_s=3.0, started_at=0.0)
    pool.on_heartbeat("p0", "ready", 10.0)
    pool.on_heartbeat("p1", "ready", 11.0)
    assert pool.num_alive(12.0) == 2 and pool.num_ready(12.0) == 2
    assert pool.num_alive(13.5) == 1  # p0 silent for 3.5 s
    assert pool.num_ready(14.5) == 0


def test_draining_workers_are_alive_but_not_ready_and_gone_ones_are_neither():
    pool = WorkerPool(liveness_s=3.0, started_at=0.0)
    pool.on_heartbeat("p0", "ready", 10.0)
    pool.on_heartbeat("p1", "ready", 10.0)
    pool.on_heartbeat("p0", "draining", 10.5)
    pool.on_gone("p1")
    assert pool.num_alive(11.0) == 1 and pool.num_ready(11.0) == 0


def test_an_outage_kills_nobody_and_silence_counts_again_from_the_reconnect():
    from kvmesh.shared.bus.hearing import Hearing

    hearing = Hearing(connected_since=0.0)
    pool = WorkerPool(liveness_s=3.0, started_at=0.0, hearing=hearing)
    pool.on_heartbeat("d0", "ready", 10.0)
    hearing.on_disconnected(10.5)  # NATS goes for 10 s
    assert pool.num_ready(20.0) == 1
    hearing.on_reconnected(20.5)
    assert pool.num_ready(23.0) == 1  # 2.5 s heard since the reconnect: not gone yet
    assert not pool.is_known(21.0) and pool.is_known(23.6)
    assert pool.num_alive(23.6) == 0  # a whole window of silence heard: gone
