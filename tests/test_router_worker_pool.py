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
