"""A decode worker that is restarting is coming back, not gone (issue 43 #2): pure parts.

The registry keeps a worker that heartbeats ``starting`` (not placeable, not dropped) and says
so in its refusal; the router's decode pool remembers a worker announced gone when it was last
heard, and a request with no decode worker alive waits while one was heard lately or one is
starting, instead of a 503 at once. The mesh test is tests/mesh/test_mesh_member_deaths.py.
"""

from __future__ import annotations

from kvmesh.services.kv_registry.core import RegistryState
from kvmesh.services.kv_registry.placement_policy import Candidate, Refusal
from kvmesh.services.router.errors import OverloadedError, ServiceUnavailableError
from kvmesh.services.router.recovery import (
    DECODE_RESTART_S,
    no_decode_worker,
    stop_waiting_for_room,
)
from kvmesh.services.router.worker_pool import WorkerPool
from kvmesh.shared.bus.messages.placement import PlaceRequest
from kvmesh.shared.bus.messages.workers import DecodeAdvert, WorkerHeartbeat, WorkerLoad
from kvmesh.shared.text.sampling import SamplingOptions
from support.adverts import idle_advert, with_fields


def advert(worker_id: str) -> DecodeAdvert:
    return idle_advert(
        worker_id, None, block_bytes=4096, block_size=16, kv_spec="k", total_blocks=64
    )


def _place() -> PlaceRequest:
    return PlaceRequest("r1", tuple(range(16)), SamplingOptions(), local_prefill=True)


def test_a_starting_decode_worker_is_kept_unplaceable_and_named_until_its_advert():
    registry = RegistryState(worker_timeout_s=3.0, retry_after_s=0.5)
    beat = WorkerHeartbeat(
        worker_id="d0", role="decode", load=WorkerLoad("starting"), started_at=50.0
    )
    for now in (0.0, 2.0, 4.0, 6.0):  # loading its model for longer than the drop time
        assert registry.observe_heartbeat(beat, now) is None
        assert registry.expire(now + 0.5) == ([], [])  # heartbeating: never dropped
    refusal = registry.choose(_place(), now=6.5)
    assert isinstance(refusal, Refusal) and refusal.reason == "no_workers"
    assert refusal.retry_after_s == 0.5  # a wait, not a final answer
    assert "starting" in refusal.error and "d0" in refusal.error
    assert registry.starting(6.5) == ["d0"]
    registry.observe_advert(advert("d0"), now=7.0)  # loaded: its first advert
    assert isinstance(registry.choose(_place(), now=7.0), Candidate)
    assert registry.starting(7.0) == []
    # the same process's ready heartbeats do not count as a restart
    assert registry.observe_heartbeat(with_fields(beat, state="ready"), 7.5) is None


def test_a_starting_heartbeat_under_a_dead_workers_id_drops_the_dead_one_at_once():
    registry = RegistryState(worker_timeout_s=3.0, retry_after_s=0.5)
    registry.observe_advert(advert("d0"), now=0.0)
    registry.observe_heartbeat(
        WorkerHeartbeat(worker_id="d0", role="decode", load=WorkerLoad("ready"), started_at=10.0),
        0.0,
    )
    replacement = WorkerHeartbeat(
        worker_id="d0", role="decode", load=WorkerLoad("starting"), started_at=11.0
    )
    assert registry.observe_heartbeat(replacement, now=1.2) == "decode"  # announced gone
    assert "d0" not in registry.decode and registry.starting(1.2) == ["d0"]


def test_the_router_pool_remembers_when_a_gone_worker_was_last_heard():
    pool = WorkerPool(liveness_s=3.0, started_at=0.0)
    pool.on_heartbeat("d0", "ready", 10.0)
    pool.on_gone("d0")
    assert pool.num_alive(10.5) == 0 and pool.silent(10.5) == []  # gone is gone
    assert pool.seen_within(10.5, 5.0) and not pool.seen_within(16.0, 5.0)
    pool.on_heartbeat("d0", "starting", 12.0)  # its replacement reached NATS
    assert pool.num_alive(12.5) == 1 and pool.num_ready(12.5) == 0
    assert pool.starting(12.5) == ["d0"]
    pool.on_heartbeat("d0", "ready", 13.0)
    assert pool.starting(13.0) == [] and pool.num_ready(13.0) == 1


def test_no_decode_alive_waits_for_one_heard_lately_or_starting_and_fails_after():
    pool = WorkerPool(liveness_s=3.0, started_at=0.0)
    assert no_decode_worker(pool, 5.0)  # never heard one: a 503 at once, as before
    pool.on_heartbeat("d0", "ready", 10.0)
    pool.on_gone("d0")  # killed: kvmesh up restarts it
    assert not no_decode_worker(pool, 11.0)
    assert not no_decode_worker(pool, 10.0 + DECODE_RESTART_S - 0.1)
    assert no_decode_worker(pool, 10.0 + DECODE_RESTART_S + 0.1)  # it never came back
    late = 10.0 + DECODE_RESTART_S + 5
    pool.on_heartbeat("d0", "starting", late)  # a slow model load: waited for while it beats
    assert not no_decode_worker(pool, late + 2.0)
    overloaded = OverloadedError("no live decode workers registered yet", retry_after_s=0.5)
    waiting = dict(left_s=30.0, request_id="r1", first_token_timeout_s=60.0)
    assert stop_waiting_for_room(overloaded, no_decode_alive=False, **waiting) is None
    error = stop_waiting_for_room(overloaded, no_decode_alive=True, **waiting)
    assert isinstance(error, ServiceUnavailableError)
    assert "no decode worker is alive" in error.message


def test_the_pool_remembers_a_bounded_number_of_gone_workers():
    from kvmesh.services.router.worker_pool import MAX_GONE

    pool = WorkerPool(liveness_s=3.0, started_at=0.0)
    for i in range(MAX_GONE + 5):
        pool.on_heartbeat(f"d{i}", "ready", float(i))
        pool.on_gone(f"d{i}")
    assert len(pool._gone) == MAX_GONE and "d0" not in pool._gone
    assert pool.seen_within(MAX_GONE + 4.5, 1.0)  # the newest are kept
