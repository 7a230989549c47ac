"""Prefix-aware placement in the registry's pure core: the score, free-block feasibility first,
the switch to a local prefill of a short uncached suffix, the lease it then does not take, and
the index following the workers (events only from known workers, dropped with them)."""

from __future__ import annotations

from kvmesh.services.kv_registry.core import RegistryState
from kvmesh.services.kv_registry.placement_policy import Candidate
from kvmesh.shared.bus.messages.cache_events import KvCacheDigest, KvCacheEvents
from kvmesh.shared.bus.messages.placement import PlaceRequest
from kvmesh.shared.kv.prefix_hash import layout_root, prefix_block_hashes
from kvmesh.shared.text.sampling import SamplingOptions
from test_registry_core import BLOCK_SIZE, advert

KV_SPEC = "4x2x64:bs16:float32"  # what advert() says
PREFIX = list(range(1000, 1000 + 6 * BLOCK_SIZE))  # 6 blocks shared by the prompts below


def prompt(suffix_len: int, seed: int = 0) -> tuple[int, ...]:
    return tuple(PREFIX + [seed * 100 + i for i in range(suffix_len)])


def place(prompt_ids: tuple[int, ...], *, local: bool = False) -> PlaceRequest:
    return PlaceRequest(
        request_id="r1",
        prompt_ids=prompt_ids,
        sampling=SamplingOptions(),
        local_prefill=local,
        lease_ms=2_000,
    )


def holds(registry: RegistryState, worker_id: str, tokens: list[int], seq: int = 1) -> None:
    """``worker_id`` reports (a digest) that its cache holds every full block of ``tokens``."""
    hashes = prefix_block_hashes(tokens, BLOCK_SIZE, layout_root(KV_SPEC))
    assert registry.observe_cache_digest(KvCacheDigest(worker_id, "e", seq, tuple(hashes)))


def registry_of(*workers: str, **kw: object) -> RegistryState:
    registry = RegistryState(worker_timeout_s=3.0, **kw)  # type: ignore[arg-type]
    for w in workers:
        registry.observe_advert(advert(w), now=0.0)
    return registry


def test_request_goes_where_its_prefix_is_cached_and_prefills_only_the_suffix_there() -> None:
    registry = registry_of("a", "b")
    holds(registry, "b", PREFIX)
    choice = registry.choose(place(prompt(20)), now=0.0)
    # 116 tokens: 8 blocks reserved; 6 cached; 20 left, under local_max_suffix_tokens
    assert choice == Candidate("b", 8, 6, 96, prefill_here=True)
    reply = registry.grant(choice, place(prompt(20)), "L1", (), now=0.0)
    assert reply.ok and reply.local_prefill and reply.cached_tokens == 96
    assert not registry.leases  # a local prefill writes nothing remotely: no lease


def test_long_uncached_suffix_is_still_prefilled_remotely_on_the_holder() -> None:
    registry = registry_of("a", "b", local_max_suffix_tokens=16)
    holds(registry, "b", PREFIX)
    choice = registry.choose(place(prompt(20)), now=0.0)
    assert isinstance(choice, Candidate)
    assert (choice.worker_id, choice.num_cached_blocks, choice.prefill_here) == ("b", 6, False)
    reply = registry.grant(choice, place(prompt(20)), "L1", (1, 2), now=0.0)
    assert not reply.local_prefill and "L1" in registry.leases


def test_load_outweighs_a_small_cached_prefix() -> None:
    """score = prefix_weight * cached - load_weight * load: 6 cached blocks (6) against two more
    requests running (8) loses."""
    registry = registry_of("a")
    registry.observe_advert(advert("b", num_running=2), now=0.0)
    holds(registry, "b", PREFIX)
    assert registry.choose(place(prompt(20)), now=0.0) == Candidate("a", 8)
    registry.release_inflight(Candidate("a", 8))
    registry.observe_advert(advert("b", num_running=1), now=0.0)  # 6 - 4 > 0: b wins
    choice = registry.choose(place(prompt(20)), now=0.0)
    assert isinstance(choice, Candidate) and choice.worker_id == "b"


def test_a_holder_without_room_for_the_prompt_is_not_chosen() -> None:
    registry = registry_of("a")
    registry.observe_advert(advert("b", free_blocks=4), now=0.0)  # the prompt needs 8
    holds(registry, "b", PREFIX)
    assert registry.choose(place(prompt(20)), now=0.0) == Candidate("a", 8)


def test_prefix_weight_zero_turns_prefix_placement_off() -> None:
    registry = registry_of("a", "b", prefix_weight=0.0)
    holds(registry, "b", PREFIX)
    assert registry.choose(place(prompt(20)), now=0.0) == Candidate("a", 8)


def test_only_leading_blocks_count_and_the_last_token_block_never_does() -> None:
    registry = registry_of("a", "b")
    holds(registry, "b", PREFIX[BLOCK_SIZE:])  # every block but the first: not a prefix
    assert registry.choose(place(prompt(20)), now=0.0) == Candidate("a", 8)
    registry.release_inflight(Candidate("a", 8))
    holds(registry, "b", PREFIX, seq=2)
    # exactly the cached prefix as the prompt: its last block holds the last token, so 5 count
    choice = registry.choose(place(tuple(PREFIX)), now=0.0)
    assert choice == Candidate("b", 6, 5, 80, prefill_here=True)


def test_another_kv_layout_never_matches_the_same_tokens() -> None:
    registry = registry_of("a")
    registry.observe_advert(advert("b", kv_spec="32x8x128:bs16:bfloat16"), now=0.0)
    holds(registry, "b", PREFIX)  # hashed under KV_SPEC, not b's layout
    choice = registry.choose(place(prompt(20)), now=0.0)
    assert isinstance(choice, Candidate) and choice.num_cached_blocks == 0


def test_a_router_asked_local_prefill_is_kept_and_not_reported_as_switched() -> None:
    registry = registry_of("a", "b")
    holds(registry, "b", PREFIX)
    choice = registry.choose(place(prompt(20), local=True), now=0.0)
    assert choice == Candidate("b", 8, 6, 96, prefill_here=False)
    reply = registry.grant(choice, place(prompt(20), local=True), "L1", (), now=0.0)
    assert not reply.local_prefill and reply.cached_tokens == 96 and not registry.leases


def test_events_from_an_unknown_worker_are_ignored_and_a_dropped_worker_is_forgotten() -> None:
    registry = registry_of("a")
    hashes = tuple(prefix_block_hashes(PREFIX, BLOCK_SIZE, layout_root(KV_SPEC)))
    assert not registry.observe_cache_events(KvCacheEvents("ghost", "e", 1, hashes))
    assert registry.observe_cache_events(KvCacheEvents("a", "e", 1, hashes))
    assert registry.status(now=0.0).decode[0].cached_blocks == 6
    registry.expire(now=100.0)  # "a" went silent
    assert len(registry.prefix_index) == 0
