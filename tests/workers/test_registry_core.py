from __future__ import annotations

import msgspec
import pytest
from kvmesh.services.kv_registry.core import RegistryState
from kvmesh.services.kv_registry.placement_policy import Candidate, Refusal
from kvmesh.shared.bus.messages.placement import DecodeRankTarget, PlaceRequest
from kvmesh.shared.bus.messages.workers import DecodeAdvert, WorkerHeartbeat, WorkerLoad
from kvmesh.shared.kv.descriptor import TcpBackend, TransportDescriptor
from kvmesh.shared.text.sampling import SamplingOptions
from support.adverts import idle_advert, with_fields

SECRET = "ab" * 32  # a tcp descriptor's lane secret (64 hex digits)

BLOCK_BYTES = 4096
BLOCK_SIZE = 16


def advert(worker_id: str, **kw: object) -> DecodeAdvert:
    idle = idle_advert(
        worker_id,
        TransportDescriptor(worker_id, "h", (TcpBackend("127.0.0.1", 1234, SECRET),)),
        block_bytes=BLOCK_BYTES,
        block_size=BLOCK_SIZE,
        kv_spec="4x2x64:bs16:float32",
        total_blocks=100,
    )
    return with_fields(idle, **kw)


def place(num_tokens: int, *, local: bool = False, request_id: str = "r1") -> PlaceRequest:
    return PlaceRequest(
        request_id=request_id,
        prompt_ids=tuple(range(num_tokens)),
        sampling=SamplingOptions(),
        local_prefill=local,
        lease_ms=2_000,
    )


@pytest.fixture
def registry() -> RegistryState:
    return RegistryState(worker_timeout_s=3.0, retry_after_s=0.5)


def test_choose_prefers_lowest_load_among_workers_with_room(registry: RegistryState) -> None:
    registry.observe_advert(advert("busy", num_running=5), now=0.0)
    registry.observe_advert(advert("idle", num_running=1), now=0.0)
    registry.observe_advert(advert("full", free_blocks=1, num_running=0), now=0.0)
    choice = registry.choose(place(40), now=1.0)  # 3 blocks: "full" has no room
    assert choice == Candidate("idle", 3)


def test_choose_breaks_load_ties_by_free_blocks(registry: RegistryState) -> None:
    registry.observe_advert(advert("a", free_blocks=10), now=0.0)
    registry.observe_advert(advert("b", free_blocks=50), now=0.0)
    assert registry.choose(place(16), now=0.0) == Candidate("b", 1)


def test_choose_skips_draining_dead_and_mismatched_workers() -> None:
    registry = RegistryState(worker_timeout_s=3.0, kv_spec="4x2x64:bs16:float32")
    registry.observe_advert(advert("draining", state="draining"), now=10.0)
    registry.observe_advert(advert("dead"), now=0.0)
    registry.observe_advert(advert("other-model", kv_spec="32x8x128:bs16:bfloat16"), now=10.0)
    registry.observe_advert(advert("colocated", mode="colocated"), now=10.0)
    registry.observe_advert(advert("good", num_running=50), now=10.0)
    assert registry.choose(place(10), now=10.0) == Candidate("good", 1)
    # a colocated worker takes a local-prefill request
    assert registry.choose(place(10, local=True), now=10.0, exclude=frozenset({"good"})) == (
        Candidate("colocated", 1)
    )


MODEL_A = "L2-H2-D32:model-aaaa0001"
MODEL_B = "L2-H2-D32:model-bbbb0002"


def test_choose_places_only_on_workers_serving_the_routers_model(registry: RegistryState) -> None:
    registry.observe_advert(advert("other", model_spec=MODEL_B), now=0.0)  # idle, but not ours
    registry.observe_advert(advert("mine", model_spec=MODEL_A, num_running=9), now=0.0)
    registry.observe_advert(advert("silent"), now=0.0)  # advertises no model: not ours either
    request = msgspec.structs.replace(place(16), model_spec=MODEL_A)
    assert registry.choose(request, now=0.0) == Candidate("mine", 1)


def test_refusal_names_the_model_when_only_other_models_serve(registry: RegistryState) -> None:
    registry.observe_advert(advert("other", model_spec=MODEL_B), now=0.0)
    request = msgspec.structs.replace(place(16), model_spec=MODEL_A)
    refusal = registry.choose(request, now=0.0)
    assert isinstance(refusal, Refusal)
    assert refusal.retry_after_s == 0.0  # waiting does not help: nobody serves this model
    assert "other serves another model or KV layout" in refusal.error
    assert MODEL_A in refusal.error and MODEL_B in refusal.error
    assert registry.decode["other"].inflight_blocks == 0  # nothing was counted as reserved


def test_request_without_model_spec_places_on_any_model(registry: RegistryState) -> None:
    registry.observe_advert(advert("other", model_spec=MODEL_B), now=0.0)
    assert registry.choose(place(16), now=0.0) == Candidate("other", 1)


def test_refusal_when_every_worker_is_full_asks_to_retry(registry: RegistryState) -> None:
    registry.observe_advert(advert("a", free_blocks=2), now=0.0)
    refusal = registry.choose(place(48), now=0.0)
    assert isinstance(refusal, Refusal)
    assert refusal.retry_after_s == 0.5 and "full" in refusal.error


def test_refusal_for_a_prompt_larger_than_any_pool_is_final(registry: RegistryState) -> None:
    registry.observe_advert(advert("a", total_blocks=4, free_blocks=4), now=0.0)
    refusal = registry.choose(place(100), now=0.0)
    assert isinstance(refusal, Refusal)
    assert refusal.retry_after_s == 0.0 and "exceeds" in refusal.error


def test_refusal_without_workers_asks_to_retry(registry: RegistryState) -> None:
    refusal = registry.choose(place(1), now=0.0)
    assert isinstance(refusal, Refusal) and refusal.retry_after_s > 0
    assert "no live decode workers" in refusal.error


def test_inflight_and_granted_blocks_count_until_the_next_advert(registry: RegistryState) -> None:
    registry.observe_advert(advert("a", free_blocks=5), now=0.0)
    first = registry.choose(place(48, request_id="r1"), now=0.0)  # 3 blocks in flight
    assert first == Candidate("a", 3)
    assert isinstance(registry.choose(place(48, request_id="r2"), now=0.0), Refusal)
    reply = registry.grant(first, place(48, request_id="r1"), "lease-1", (0, 1, 2), now=0.0)
    assert registry.decode["a"].free_blocks == 2
    # the next advert already counts those three blocks: the estimate follows it
    registry.observe_advert(advert("a", free_blocks=2), now=0.5)
    assert registry.decode["a"].free_blocks == 2
    assert reply.ok and reply.lease_id == "lease-1"


def test_release_inflight_returns_the_estimate(registry: RegistryState) -> None:
    registry.observe_advert(advert("a", free_blocks=3), now=0.0)
    choice = registry.choose(place(48), now=0.0)
    assert isinstance(choice, Candidate)
    registry.release_inflight(choice)
    assert registry.decode["a"].free_blocks == 3 and registry.decode["a"].load == 0


def test_grant_passes_on_the_reservations_block_addresses(registry: RegistryState) -> None:
    registry.observe_advert(advert("a"), now=0.0)
    choice = registry.choose(place(20), now=0.0)
    assert isinstance(choice, Candidate)
    addrs = (1000 + 5 * BLOCK_BYTES, 1000 + 9 * BLOCK_BYTES)  # the decode worker's reply's
    reply = registry.grant(choice, place(20), "L", (5, 9), now=0.0, rkey=77, block_addrs=addrs)
    assert reply.block_addrs == addrs
    assert reply.block_bytes == BLOCK_BYTES and reply.rkey == 77  # the reservation's window
    assert reply.descriptor.peer_id == "a" and reply.worker_id == "a"


def test_grant_passes_on_a_tp_decode_workers_other_ranks_and_refuses_a_short_list(
    registry: RegistryState,
) -> None:
    registry.observe_advert(advert("a", tp=2), now=0.0)
    rank1 = DecodeRankTarget(
        78, (64, 96), TransportDescriptor("a.rank1", "h", (TcpBackend("127.0.0.1", 1235, SECRET),))
    )
    choice = registry.choose(place(20), now=0.0)
    assert isinstance(choice, Candidate)
    reply = registry.grant(choice, place(20), "L", (5, 9), 0.0, 77, (10, 20), ranks=(rank1,))
    assert reply.ok and reply.ranks == (rank1,) and reply.rkey == 77
    choice = registry.choose(place(20, request_id="r2"), now=0.0)
    assert isinstance(choice, Candidate)
    reply = registry.grant(choice, place(20, request_id="r2"), "L2", (6, 8), 0.0, 79, (30, 40))
    assert not reply.ok and "advertises TP 2 but its reservation names 1 ranks" in reply.error
    assert "L2" not in registry.leases


def test_lease_expires_after_ttl_and_completed_lease_does_not(registry: RegistryState) -> None:
    registry.observe_advert(advert("a"), now=0.0)
    for rid, lease in (("r1", "L1"), ("r2", "L2")):
        choice = registry.choose(place(16, request_id=rid), now=0.0)
        assert isinstance(choice, Candidate)
        registry.grant(choice, place(16, request_id=rid), lease, (0,), now=0.0)
    assert registry.complete_lease("L1") is not None
    registry.observe_advert(advert("a"), now=1.9)
    assert registry.expire(now=1.9) == ([], [])
    dropped, expired = registry.expire(now=2.0)  # lease_ms=2000
    assert dropped == [] and [lease.lease_id for lease in expired] == ["L2"]
    assert registry.counters.completed == 1 and registry.counters.expired == 1
    assert registry.leases == {}


def test_local_prefill_grants_no_lease(registry: RegistryState) -> None:
    registry.observe_advert(advert("a"), now=0.0)
    choice = registry.choose(place(16, local=True), now=0.0)
    assert isinstance(choice, Candidate)
    reply = registry.grant(choice, place(16, local=True), "L", (), now=0.0)
    assert reply.ok and registry.leases == {} and registry.counters.granted == 0


def test_silent_worker_is_dropped_with_its_leases(registry: RegistryState) -> None:
    registry.observe_advert(advert("a"), now=0.0)
    registry.observe_heartbeat(
        WorkerHeartbeat(worker_id="p1", role="prefill", load=WorkerLoad("ready")), now=0.0
    )
    choice = registry.choose(place(16), now=0.0)
    assert isinstance(choice, Candidate)
    registry.grant(choice, msgspec.structs.replace(place(16), lease_ms=60_000), "L", (0,), now=0.0)
    registry.observe_heartbeat(
        WorkerHeartbeat(worker_id="a", role="decode", load=WorkerLoad("ready")), 2.5
    )
    assert registry.expire(now=3.1) == (["p1"], [])  # the decode heartbeat kept "a" alive
    assert registry.expire(now=5.6) == ([], [])  # "a" was seen after 2.5 s: 3 x 2.5 s grace
    dropped, expired = registry.expire(now=10.1)
    assert dropped == ["a"] and expired == []
    assert registry.leases == {} and registry.counters.dropped == 1
    assert isinstance(registry.choose(place(16), now=10.1), Refusal)


def test_a_worker_restarted_under_its_id_before_its_silence_counts_is_dropped_at_once(
    registry: RegistryState,
) -> None:
    """kill -9 and a restart within the heartbeat timeout: the new process's first heartbeat
    (another started_at) drops the old one with its leases, so its requests move now instead of
    waiting for tokens from a dead process."""
    beat = WorkerHeartbeat(worker_id="a", role="decode", load=WorkerLoad("ready"), started_at=100.0)
    registry.observe_advert(advert("a"), now=0.0)
    assert registry.observe_heartbeat(beat, now=0.0) is None
    assert registry.observe_heartbeat(beat, now=1.0) is None  # the same process
    choice = registry.choose(place(16), now=1.0)
    assert isinstance(choice, Candidate)
    registry.grant(choice, msgspec.structs.replace(place(16), lease_ms=60_000), "L", (0,), now=1.0)
    restarted = msgspec.structs.replace(beat, started_at=101.5)
    assert registry.observe_heartbeat(restarted, now=1.6) == "decode"
    assert registry.leases == {} and registry.counters.dropped == 1
    assert "a" not in registry.decode  # placeable again once its advert comes
    registry.observe_advert(advert("a"), now=1.7)
    assert isinstance(registry.choose(place(16), now=1.7), Candidate)
    assert registry.observe_heartbeat(restarted, now=2.0) is None
    # a prefill worker too; a heartbeat without started_at (an old worker) never counts as one
    prefill = WorkerHeartbeat(
        worker_id="p", role="prefill", load=WorkerLoad("ready"), started_at=5.0
    )
    registry.observe_heartbeat(prefill, now=2.0)
    assert registry.observe_heartbeat(prefill, now=2.5) is None
    again = msgspec.structs.replace(prefill, started_at=6.0)
    assert registry.observe_heartbeat(again, now=3.0) == "prefill"
    assert registry.observe_heartbeat(msgspec.structs.replace(again, started_at=0.0), 3.5) is None


def test_mark_draining_stops_placement_until_the_worker_says_ready(registry: RegistryState) -> None:
    registry.observe_advert(advert("a"), now=0.0)
    assert registry.mark_draining("a", True)
    assert not registry.mark_draining("nobody", True)
    refusal = registry.choose(place(16), now=0.0)
    assert isinstance(refusal, Refusal) and "draining" in refusal.error
    registry.observe_advert(advert("a", state="ready"), now=0.1)
    assert registry.choose(place(16), now=0.1) == Candidate("a", 1)


def test_status_lists_decode_pools_and_peers(registry: RegistryState) -> None:
    registry.observe_advert(advert("d1", free_blocks=40, num_running=3), now=0.0)
    registry.observe_advert(advert("d2", tp=2), now=0.0)
    registry.observe_heartbeat(
        WorkerHeartbeat(
            worker_id="p1", role="prefill", load=WorkerLoad("ready", num_running=1), tp=4
        ),
        now=0.0,
    )
    status = registry.status(now=1.0)
    d1, _ = sorted(status.decode, key=lambda row: row.worker_id)
    assert (d1.worker_id, d1.pool.total_blocks, d1.pool.free_blocks) == ("d1", 100, 40)
    assert d1.pool.free_block_ranges == ()  # the advert's runs stay out of the table
    assert d1.load == WorkerLoad("ready", num_running=3) and d1.last_seen_s == 1.0
    roles = {(w.worker_id, w.role, w.tp) for w in status.workers}
    assert roles == {("d1", "decode", 1), ("d2", "decode", 2), ("p1", "prefill", 4)}
    assert status.leases.active == 0


def test_worker_heartbeating_slower_than_expected_is_not_dropped(registry: RegistryState) -> None:
    beat = WorkerHeartbeat(worker_id="router-0", role="router", load=WorkerLoad("ready"))
    for now in (0.0, 5.0, 10.0):  # every 5 s against an expected 1 s (timeout 3 s)
        registry.observe_heartbeat(beat, now=now)
        assert registry.expire(now=now) == ([], [])
    assert registry.expire(now=24.0) == ([], [])  # 3 missed intervals of ~5 s: still alive
    assert registry.expire(now=26.0) == (["router-0"], [])


def test_worker_slower_than_the_timeout_stops_flapping_once_it_returns() -> None:
    registry = RegistryState(worker_timeout_s=0.6)  # e.g. heartbeat_s 0.2 x 3 missed
    beat = WorkerHeartbeat(worker_id="router-0", role="router", load=WorkerLoad("ready"))
    registry.observe_heartbeat(beat, now=0.0)
    assert registry.expire(now=1.0) == (["router-0"], [])  # its 2 s interval is not known yet
    registry.observe_heartbeat(beat, now=2.0)  # back: the 2 s gap is learned
    for now in (3.0, 4.0, 5.9):
        assert registry.expire(now=now) == ([], [])
    assert registry.expire(now=8.1) == (["router-0"], [])  # 3 x 2 s of silence


def test_a_nats_outage_drops_nobody_and_teaches_no_interval() -> None:
    from kvmesh.services.kv_registry.stores import StoreTable
    from kvmesh.shared.bus.hearing import Hearing

    hearing = Hearing(connected_since=0.0)
    registry = RegistryState(worker_timeout_s=3.0, hearing=hearing)
    stores = StoreTable(3.0, hearing=hearing)
    registry.observe_advert(advert("a"), now=1.0)
    registry.observe_advert(advert("b"), now=1.0)
    hearing.on_disconnected(1.0)  # the nats-server restarts: 10 s without a message
    assert registry.expire(now=11.0) == ([], [])
    assert stores.expire(now=11.0) == []
    hearing.on_reconnected(11.0)
    assert registry.expire(now=13.9) == ([], [])  # 2.9 s heard since the reconnect
    registry.observe_advert(advert("a"), now=12.0)  # "a" is back; "b" died in the outage
    assert registry.expire(now=14.1) == (["b"], [])  # a whole timeout of silence since then
    # the outage is no interval of "a"'s: it is dropped 3 s after it falls silent, not 30 s
    assert registry.expire(now=14.9) == ([], [])
    assert registry.expire(now=15.1) == (["a"], [])
