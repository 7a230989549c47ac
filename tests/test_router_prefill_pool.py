"""PrefillPool: the router's view of which prefill workers are alive (pure, clock passed in)."""

from __future__ import annotations

from services.router.prefill_pool import PrefillPool


def test_pool_is_assumed_present_until_the_router_has_listened_one_window():
    pool = PrefillPool(liveness_s=3.0, started_at=100.0)
    assert pool.has_workers(101.0)  # too early to know
    assert not pool.has_workers(103.5)  # listened 3.5 s, heard nobody


def test_workers_count_while_their_heartbeats_are_fresh():
    pool = PrefillPool(liveness_s=3.0, started_at=0.0)
    pool.on_heartbeat("p0", "ready", 10.0)
    pool.on_heartbeat("p1", "ready", 11.0)
    assert pool.num_alive(12.0) == 2 and pool.has_workers(12.0)
    assert pool.num_alive(13.5) == 1  # p0 silent for 3.5 s
    assert not pool.has_workers(14.5)


def test_draining_and_gone_workers_take_no_jobs():
    pool = PrefillPool(liveness_s=3.0, started_at=0.0)
    pool.on_heartbeat("p0", "ready", 10.0)
    pool.on_heartbeat("p1", "ready", 10.0)
    pool.on_heartbeat("p0", "draining", 10.5)
    pool.on_gone("p1")
    assert pool.num_alive(11.0) == 0 and not pool.has_workers(11.0)
