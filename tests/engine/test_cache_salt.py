"""Cache salts (issue 40, #7): a guessed 2.5k-token document of another tenant came back in 28 ms
against 500 ms for an unseen one, and /v1/kvmesh/timings listed every tenant's requests. A
request's ``cache_salt`` (vLLM's, OpenAI's ``prompt_cache_key``, or the router's per-API-key
salt) now roots its prefix hash chain: in the decode worker's block manager, in the
kv-registry's prefix reach and in the kv-store's keys, requests share blocks only within a salt."""

from __future__ import annotations

import contextlib

import aiohttp
import pytest
from kvmesh.services.kv_registry.prefix_reach import prefix_reach
from kvmesh.services.router.config import RouterConfig
from kvmesh.services.router.service import serve_router
from kvmesh.services.router.tenants import Tenants, cache_salt, tenant_name
from kvmesh.shared.bus.messages.codec import decode_message, encode_message
from kvmesh.shared.bus.messages.placement import PlaceRequest
from kvmesh.shared.engine.block_manager import BlockManager
from kvmesh.shared.engine.sequence import Sequence
from kvmesh.shared.kv.prefix_hash import (
    layout_root,
    prefix_block_hashes,
    request_root,
    reusable_prefix_hashes,
    salted_root,
)
from kvmesh.shared.text.sampling import SamplingOptions
from support.adverts import idle_advert
from support.router_fake_mesh import FakeMesh

BS = 4
TOKENS = list(range(40))
KV_SPEC = "tiny-layout"


def test_prefix_hashes_differ_with_a_salt_and_match_without():
    root = layout_root(KV_SPEC)
    plain = prefix_block_hashes(TOKENS, BS, root)
    assert salted_root(root, "") == root  # unsalted requests keep today's names
    assert prefix_block_hashes(TOKENS, BS, salted_root(root, "")) == plain
    a = prefix_block_hashes(TOKENS, BS, salted_root(root, "tenant-a"))
    a_again = prefix_block_hashes(TOKENS, BS, request_root(KV_SPEC, "tenant-a"))
    b = prefix_block_hashes(TOKENS, BS, salted_root(root, "tenant-b"))
    assert a == a_again
    assert not set(a) & set(plain) and not set(a) & set(b)


def _computed(bm: BlockManager, rid: str, salt: str) -> Sequence:
    seq = Sequence(rid, list(TOKENS), SamplingOptions(temperature=0, cache_salt=salt))
    bm.allocate(seq)
    seq.num_computed_tokens = len(seq)
    bm.commit(seq)
    return seq


@pytest.mark.parametrize(("first", "second", "hits"), [("a", "a", 36), ("a", "b", 0), ("a", "", 0)])
def test_block_manager_shares_cached_blocks_only_within_a_salt(first, second, hits):
    bm = BlockManager(64, BS, root_hash=layout_root(KV_SPEC))
    _computed(bm, "r1", first)
    seq = Sequence("r2", list(TOKENS), SamplingOptions(temperature=0, cache_salt=second))
    bm.allocate(seq)
    assert seq.num_computed_tokens == hits
    bm.check_invariants()


class _Index:
    """A kv-registry prefix index holding one worker's blocks (``matched_blocks``' contract)."""

    def __init__(self, held: set[int]) -> None:
        self.held = held

    def matched_blocks(self, worker_id: str, chain: list[int]) -> int:
        n = 0
        while n < len(chain) and chain[n] in self.held:
            n += 1
        return n


def test_registry_prefix_reach_finds_a_workers_blocks_only_with_their_salt():
    bm = BlockManager(64, BS, root_hash=layout_root(KV_SPEC))
    _computed(bm, "r1", "tenant-a")
    index = _Index(set(bm.hash_to_block))
    advert = idle_advert(
        "decode-0", None, block_bytes=64, block_size=BS, kv_spec=KV_SPEC,
        total_blocks=64,
    )  # fmt: skip

    def reach(salt: str) -> int:
        found = prefix_reach(
            [advert], TOKENS, index, None, use_cache=True, use_stores=False, cache_salt=salt
        )
        return len(found["decode-0"].own)

    assert reach("tenant-a") == (len(TOKENS) - 1) // BS
    assert reach("tenant-b") == 0 and reach("") == 0
    # the kv-store is keyed by the same chain: a salted put's keys are the salted hashes
    assert set(reusable_prefix_hashes(TOKENS, BS, request_root(KV_SPEC, "tenant-a"))) <= index.held


def test_cache_salt_rides_the_place_request_and_is_bounded():
    place = PlaceRequest("r", (1, 2, 3), SamplingOptions(cache_salt="s"), local_prefill=False)
    assert decode_message(encode_message(place), PlaceRequest).sampling.cache_salt == "s"
    assert SamplingOptions().cache_salt == ""
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingOptions(cache_salt="x" * 257)


def test_cache_salt_of_several_parts_is_a_digest_no_part_can_forge():
    assert cache_salt("", "", "") == ""
    assert cache_salt("", "mine", "") == "mine"  # vLLM's meaning: equal salts share
    assert cache_salt("tenant", "", "") == "tenant"
    both = cache_salt("tenant-a", "x", "")
    assert both != "x" and both == cache_salt("tenant-a", "x", "")
    assert both != cache_salt("tenant-b", "x", "") != cache_salt("tenant-a", "", "x")
    # another tenant cannot reach tenant-a's salt by sending it as its own cache_salt
    assert cache_salt("tenant-b", "tenant-a", "") != "tenant-a"


def test_tenants_identify_each_key_and_the_admin():
    tenants = Tenants(["k1", "k2"], admin_key="root")
    one, two, admin = (tenants.identify(f"Bearer {k}") for k in ("k1", "k2", "root"))
    assert one is not None and two is not None and admin is not None
    assert one.name == tenant_name("k1") != two.name and "k1" not in one.name
    assert admin.is_admin and not one.is_admin
    assert tenants.identify("Bearer k3") is None and tenants.identify("") is None
    assert tenants.num_keys == 3 and not tenants.is_open
    assert Tenants([]).identify("").is_admin  # an open router: one tenant


@contextlib.asynccontextmanager
async def _router(nats_url: str, **config):
    config = RouterConfig(nats_url=nats_url, host="127.0.0.1", port=0, **config)
    mesh = FakeMesh(nats_url)
    async with mesh.running(), serve_router(config) as running:
        yield mesh, running


async def _complete(session: aiohttp.ClientSession, url: str, key: str, **fields) -> dict:
    body = {"model": "kvmesh-tiny", "prompt": [1, 2, 3], "max_tokens": 2, **fields}
    headers = {"Authorization": f"Bearer {key}"}
    async with session.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def test_two_tenants_identical_prompts_get_different_salts_and_one_tenant_the_same(
    nats_server,
):
    async with (
        _router(nats_server, api_keys="key-a,key-b") as (mesh, router),
        aiohttp.ClientSession() as session,
    ):
        for key in ("key-a", "key-a", "key-b"):
            await _complete(session, router.url, key)
        await _complete(session, router.url, "key-a", cache_salt="doc")
        await _complete(session, router.url, "key-b", cache_salt="doc")
        await _complete(session, router.url, "key-a", prompt_cache_key="doc")
    salts = [p.sampling.cache_salt for p in mesh.places]
    assert salts[0] == salts[1] == tenant_name("key-a")  # the same tenant shares its blocks
    assert salts[2] == tenant_name("key-b") != salts[0]  # another tenant never does
    assert salts[3] != salts[4] and not {salts[3], salts[4]} & {"doc", *salts[:3]}
    assert salts[5] not in salts[:5]  # prompt_cache_key salts as cache_salt does


async def test_cache_salt_from_the_body_is_honoured_with_one_api_key(nats_server):
    async with (
        _router(nats_server, api_key="only") as (mesh, router),
        aiohttp.ClientSession() as session,
    ):
        await _complete(session, router.url, "only")
        await _complete(session, router.url, "only", cache_salt="doc")
        await _complete(session, router.url, "only", prompt_cache_key="doc")
    assert [p.sampling.cache_salt for p in mesh.places] == ["", "doc", "doc"]
    assert router.router.salts_by_api_key is False  # one key: one tenant, no salt by default


async def test_timings_show_only_the_callers_requests_without_the_admin_key(nats_server):
    async with (
        _router(nats_server, api_keys="key-a,key-b", admin_api_key="root") as (_, router),
        aiohttp.ClientSession() as session,
    ):
        a = await _complete(session, router.url, "key-a")
        b = await _complete(session, router.url, "key-b")

        async def timings(key: str) -> tuple[int, list[str]]:
            headers = {"Authorization": f"Bearer {key}"}
            async with session.get(f"{router.url}/v1/kvmesh/timings", headers=headers) as resp:
                body = await resp.json()
                ids = [r["request_id"] for r in body.get("requests", [])]
                return resp.status, ids

        assert await timings("key-a") == (200, [a["id"]])
        assert await timings("key-b") == (200, [b["id"]])
        assert await timings("root") == (200, [a["id"], b["id"]])
        assert (await timings("nobody"))[0] == 401
