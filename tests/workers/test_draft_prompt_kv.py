"""Prompt KV through the data plane for early-exit and model drafts: the draft worker's lease
table (pure), the prefill's draft write plans (pure), and both ends in one process over a real
tcp transport (no NATS): a prefill worker writes a prompt's first layers (early exit) or its
own draft model's blocks (model) into a draft worker's reserved blocks, the draft worker adopts
them, and its next draft computes only the tail."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import pytest
import torch
from kvmesh.services.draft.prompt_kv import PromptKvError, PromptKvTable
from kvmesh.services.prefill.draft_kv import DraftBlockPlanner, DraftKvPlanner
from kvmesh.services.prefill.draft_writes import DraftKv
from kvmesh.services.prefill.metrics import PrefillMetrics
from kvmesh.services.prefill.plan import PlanError
from kvmesh.services.prefill.worker import PrefillWorker
from kvmesh.shared.bus.messages.drafts import DraftKvReserve, DraftKvReserveReply
from kvmesh.shared.bus.messages.prefill_jobs import PrefillDone
from kvmesh.shared.kv.imm import imm_slot, unpack_imm
from kvmesh.shared.transport.base import Access, MemoryWindow
from support.prefill_rig import prefill_job, ready_advert


def _window(rkey: int = 5, enforced: bool = True) -> MemoryWindow:
    return MemoryWindow(rkey, 1, ((0, 64),), Access.REMOTE_WRITE, enforced)


def _done(num_writes: int, ok: bool = True, rkey: int = 5, lease: str = "L") -> PrefillDone:
    return PrefillDone("r", lease, ok, num_writes=num_writes, rkey=rkey)


# ---- PromptKvTable --------------------------------------------------------------------------


@pytest.mark.parametrize("done_first", [True, False])
def test_lease_is_ready_once_the_done_and_every_write_are_in_either_order(done_first):
    table = PromptKvTable()
    table.add("r", "L", 3, (7, 8), deadline=10.0, token_ids=tuple(range(32)), window=_window())
    if done_first:
        assert table.on_done(_done(2)) is None
    assert table.on_immediate(3, 0, frozenset({5})) is None
    verdict = table.on_immediate(3, 1, frozenset({5}))
    if not done_first:
        assert verdict is None
        verdict = table.on_done(_done(2))
    assert verdict is not None and verdict.ok and verdict.lease.block_ids == (7, 8)
    assert len(table) == 0


def test_writes_without_the_window_key_and_forged_dones_are_ignored():
    table = PromptKvTable()
    table.add("r", "L", 3, (7,), deadline=10.0, token_ids=tuple(range(16)), window=_window())
    assert table.on_immediate(3, 0, frozenset({99})) is None  # another key
    assert table.on_immediate(4, 0, frozenset({5})) is None  # no lease in that slot
    assert table.num_stray_immediates == 2
    assert table.on_done(_done(1, rkey=6)) is None  # without the window key
    assert table.on_done(_done(1, lease="other")) is None
    assert table.on_immediate(3, 0, frozenset({5})) is None
    verdict = table.on_done(_done(1))
    assert verdict is not None and verdict.ok


def test_a_write_twice_a_failed_done_or_too_many_writes_fail_the_lease():
    table = PromptKvTable()
    table.add("a", "L", 1, (1,), deadline=10.0, token_ids=tuple(range(16)))
    table.on_immediate(1, 0)
    verdict = table.on_immediate(1, 0)
    assert verdict is not None and not verdict.ok and "twice" in verdict.error
    table.add("r", "L", 2, (2,), deadline=10.0, token_ids=tuple(range(16)))
    verdict = table.on_done(_done(1, ok=False))
    assert verdict is not None and not verdict.ok and verdict.release
    table.add("r", "L", 2, (2,), deadline=10.0, token_ids=tuple(range(16)))
    table.on_immediate(2, 0)
    table.on_immediate(2, 1)
    verdict = table.on_done(_done(1))
    assert verdict is not None and not verdict.ok and "2 arrived" in verdict.error
    assert len(table) == 0


def test_duplicate_request_or_busy_slot_is_refused():
    table = PromptKvTable()
    table.add("r", "L", 1, (1,), deadline=10.0, token_ids=tuple(range(16)))
    with pytest.raises(PromptKvError, match="already holds"):
        table.add("r", "L", 2, (2,), deadline=10.0, token_ids=tuple(range(16)))
    with pytest.raises(PromptKvError, match="slot 1"):
        table.add("q", "L", 1, (2,), deadline=10.0, token_ids=tuple(range(16)))


def test_expired_lease_frees_at_once_under_an_enforced_window_else_after_quarantine():
    table = PromptKvTable(quarantine_s=5.0)
    table.add("a", "L", 1, (1,), deadline=1.0, token_ids=tuple(range(16)), window=_window(5))
    table.add("r", "L", 2, (2,), deadline=1.0, token_ids=tuple(range(16)), window=_window(6, False))
    verdicts = {v.lease.request_id: v for v in table.expire(now=1.5)}
    assert not verdicts["a"].ok and verdicts["a"].release  # no write can land any more
    assert not verdicts["r"].ok and not verdicts["r"].release  # a late write still could
    assert table.on_immediate(2, 0, None) is None
    verdict = table.on_done(_done(2, rkey=6))  # one announced write is still on its way
    assert verdict is None
    [verdict] = table.expire(now=7.0)  # the quarantine ends
    assert verdict.release and not verdict.ok and len(table) == 0


# ---- DraftKvPlanner -------------------------------------------------------------------------

L, H, BS, D, SIZE = 4, 2, 16, 8, 4  # layers, KV heads, block size, head dim, float32
HEAD = 2 * L * BS * D * SIZE  # bytes of one head of a target block
BLOCK = H * HEAD
DRAFT_HEAD = 2 * 2 * BS * D * SIZE  # two layers


def _reply(num_blocks: int, num_layers: int = 2, block_bytes: int = H * DRAFT_HEAD, **kw):
    addrs = tuple((1 << 20) + i * block_bytes for i in range(num_blocks))
    return DraftKvReserveReply(
        True, "dr0", rkey=9, block_addrs=addrs, block_bytes=block_bytes, num_layers=num_layers, **kw
    )


def test_draft_write_is_each_heads_first_layers_of_the_full_blocks():
    reply = _reply(3)
    planner = DraftKvPlanner(reply, 3 * BS + 5, BS, L, H, BLOCK)
    write = planner.plan((10, 4))
    assert write is not None and unpack_imm(write.imm) == (
        imm_slot(reply.block_addrs[0], H * DRAFT_HEAD),
        0,
    )
    assert [(s.local_offset, s.remote_addr, s.length) for s in write.spans] == [
        (10 * BLOCK, reply.block_addrs[0], DRAFT_HEAD),
        (10 * BLOCK + HEAD, reply.block_addrs[0] + DRAFT_HEAD, DRAFT_HEAD),
        (4 * BLOCK, reply.block_addrs[1], DRAFT_HEAD),
        (4 * BLOCK + HEAD, reply.block_addrs[1] + DRAFT_HEAD, DRAFT_HEAD),
    ]
    assert not planner.is_complete
    write = planner.plan((6, 2))  # the last chunk: a full block, then the partial one (skipped)
    assert write is not None and unpack_imm(write.imm)[1] == 1 and len(write.spans) == H
    assert write.spans[0].remote_addr == reply.block_addrs[2] and planner.is_complete
    assert planner.plan(()) is None and planner.num_writes_planned == 2


def test_draft_plan_refuses_a_reply_that_does_not_fit_this_worker():
    with pytest.raises(PlanError, match="runs 1 to 3"):
        DraftKvPlanner(_reply(2, num_layers=4), 2 * BS, BS, L, H, BLOCK)
    with pytest.raises(PlanError, match="2 draft blocks reserved for a prompt of 3"):
        DraftKvPlanner(_reply(2), 3 * BS, BS, L, H, BLOCK)
    with pytest.raises(PlanError, match="blocks are 100 bytes"):
        DraftKvPlanner(_reply(2, block_bytes=100), 2 * BS, BS, L, H, BLOCK)
    with pytest.raises(PlanError, match="full"):
        DraftKvPlanner(DraftKvReserveReply(False, "dr0", error="full"), 2 * BS, BS, L, H, BLOCK)
    with pytest.raises(PlanError, match="whole blocks"):
        DraftKvPlanner(_reply(2, whole_blocks=True), 2 * BS, BS, L, H, BLOCK)


# ---- DraftBlockPlanner (model drafters: the prefill's draft engine's whole blocks) -------------

DRAFT_BLOCK = 2 * DRAFT_HEAD  # the draft model's block: 2 heads of 2 layers


def test_model_draft_write_is_each_full_block_whole_and_skips_the_partial_one():
    reply = _reply(3, block_bytes=DRAFT_BLOCK, whole_blocks=True)
    planner = DraftBlockPlanner(reply, 3 * BS + 5, BS, DRAFT_BLOCK)
    write = planner.plan((10, 4))
    assert write is not None
    assert unpack_imm(write.imm) == (imm_slot(reply.block_addrs[0], DRAFT_BLOCK), 0)
    assert [(s.local_offset, s.remote_addr, s.length) for s in write.spans] == [
        (10 * DRAFT_BLOCK, reply.block_addrs[0], DRAFT_BLOCK),
        (4 * DRAFT_BLOCK, reply.block_addrs[1], DRAFT_BLOCK),
    ]
    assert not planner.is_complete
    write = planner.plan((6, 2))  # the last chunk: a full block, then the partial one (skipped)
    assert write is not None and unpack_imm(write.imm)[1] == 1
    assert [(s.local_offset, s.remote_addr) for s in write.spans] == [
        (6 * DRAFT_BLOCK, reply.block_addrs[2])
    ]
    assert planner.is_complete and planner.num_writes_planned == 2
    assert planner.plan(()) is None and planner.num_writes_planned == 2


def test_model_draft_plan_of_chunks_so_far_then_each_covers_every_block_once():
    """A reply taken with a later chunk plans the blocks so far in one write, then each chunk's."""
    reply = _reply(4, block_bytes=DRAFT_BLOCK, whole_blocks=True)
    planner = DraftBlockPlanner(reply, 4 * BS, BS, DRAFT_BLOCK)
    first = planner.plan((3, 9, 5))
    second = planner.plan((1,))
    remote = [s.remote_addr for w in (first, second) for s in w.spans]
    assert remote == list(reply.block_addrs) and planner.is_complete


def test_model_draft_plan_refuses_a_reply_that_does_not_fit_this_workers_draft_model():
    with pytest.raises(PlanError, match="early exit"):
        DraftBlockPlanner(_reply(2, block_bytes=DRAFT_BLOCK), 2 * BS, BS, DRAFT_BLOCK)
    with pytest.raises(PlanError, match="2 draft blocks reserved for a prompt of 3"):
        DraftBlockPlanner(
            _reply(2, block_bytes=DRAFT_BLOCK, whole_blocks=True), 3 * BS, BS, DRAFT_BLOCK
        )
    with pytest.raises(PlanError, match="draft model's are 100"):
        DraftBlockPlanner(_reply(2, block_bytes=DRAFT_BLOCK, whole_blocks=True), 2 * BS, BS, 100)
    with pytest.raises(PlanError, match="full"):
        DraftBlockPlanner(DraftKvReserveReply(False, "dr0", error="full"), 2 * BS, BS, 100)


# ---- prefill worker -> draft worker, in one process -----------------------------------------


@pytest.fixture(scope="module")
def small_draft():
    """Makes a draft model that is not the target but shares its tokenizer: kvmesh-tiny's
    shape with 2 layers and weights of another seed (a fresh copy per call)."""
    from kvmesh.shared.model.loader import build_model
    from kvmesh.shared.model.tiny import tiny_config, tiny_state_dict, tiny_tokenizer

    config = dataclasses.replace(tiny_config(), num_hidden_layers=2, source="tiny-draft")
    weights = tiny_state_dict(config, seed=7)
    return lambda: (
        build_model(config, weights.__getitem__, weights.keys(), "tiny-draft"),
        tiny_tokenizer(),
    )


def _model_drafter(small_draft, allocate=None):
    """A model drafter (chains of 5) as build_drafter makes one, over a fresh draft model."""
    from kvmesh.services.draft.drafters import EngineDrafter
    from kvmesh.services.draft.prompt_kv_receiver import pool_bytes
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine

    model, tokenizer = small_draft()
    econf = EngineConfig(num_blocks=64, enable_prefix_caching=True, reserve_output_tokens=0)
    buffer = allocate(pool_bytes(model, econf)) if allocate is not None else None
    return EngineDrafter(LLMEngine(model, tokenizer, econf, kv_buffer=buffer), 5)


def _draft_config(**kw):
    from kvmesh.services.draft.config import DraftConfig

    return DraftConfig(method="early-exit", exit_layer=2, num_blocks=64, **kw)


@contextlib.asynccontextmanager
async def _mesh_in_process(tiny, small_draft=None):
    """A prefill worker, a decode-side region it writes the job into, and an early-exit draft
    worker's receiver, over tcp transports. With ``small_draft``: the prefill worker runs that
    draft model beside the target and the draft worker is a model drafter of it."""
    from kvmesh.services.draft.drafters import build_drafter
    from kvmesh.services.draft.metrics import DraftMetrics
    from kvmesh.services.draft.prompt_kv_receiver import PromptKvReceiver, target_kv_spec
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine
    from kvmesh.shared.model.identity import kv_spec_fingerprint
    from kvmesh.shared.transport import Access, TransportConfig, create_transport
    from kvmesh.shared.transport.endpoint_cache import EndpointCache
    from support.transport_wire import remote as remote_key

    model, tokenizer = tiny
    engine = LLMEngine(model, tokenizer, EngineConfig(num_blocks=64, max_num_batched_tokens=32))
    spec = engine.kv_pool.spec
    kv_spec = kv_spec_fingerprint(spec, model.config)
    async with (
        create_transport("tcp", TransportConfig(peer_id="decode")) as decode_side,
        create_transport("tcp", TransportConfig(peer_id="draft")) as draft_side,
        create_transport("tcp", TransportConfig(peer_id="prefill")) as prefill_side,
        EndpointCache(prefill_side) as endpoints,
    ):
        remote = decode_side.allocate(64 * spec.block_bytes)
        # as a decode worker's lease window would, over the whole pool
        region = remote_key(decode_side, decode_side.register(remote, Access.REMOTE_WRITE))
        draft_engine = draft_region = None
        if small_draft is not None:  # the prefill's own draft engine: the same chunk budget
            draft_engine = LLMEngine(
                *small_draft(), EngineConfig(num_blocks=64, max_num_batched_tokens=32)
            )
            draft_region = prefill_side.register(draft_engine.kv_pool.raw)
        source = prefill_side.register(engine.kv_pool.raw)
        metrics, lock = PrefillMetrics(), asyncio.Lock()
        draft_kv = DraftKv(engine, source, endpoints, metrics, lock, draft_engine, draft_region)
        worker = PrefillWorker(
            engine,
            source,
            endpoints,
            worker_id="p0",
            kv_spec=kv_spec,
            advert_wait_s=0.2,
            metrics=metrics,
            hooks=[draft_kv],
            lock=lock,
        )
        peer = decode_side.descriptor()
        worker.adverts.note(ready_advert(peer, region, spec, kv_spec))
        if small_draft is None:
            drafter = build_drafter(_draft_config(), draft_side.allocate)
            pool_kv_spec = target_kv_spec(drafter.engine, model.config.num_hidden_layers)
            assert pool_kv_spec == kv_spec  # the draft's target is this very model
        else:
            drafter = _model_drafter(small_draft, draft_side.allocate)
            pool_kv_spec = drafter.engine.kv_spec
            assert (
                pool_kv_spec == _draft_kv(worker).draft_kv_spec != kv_spec
            )  # the same draft model
        receiver = PromptKvReceiver(
            drafter.engine,
            draft_side,
            draft_side.register(drafter.engine.kv_pool.raw, Access.REMOTE_WRITE),
            asyncio.Lock(),
            worker_id="dr0",
            kv_spec=pool_kv_spec,
            metrics=DraftMetrics(),
            whole_blocks=small_draft is not None,
        )
        loop = asyncio.create_task(worker.run())
        try:
            yield worker, region, receiver, drafter, draft_side
        finally:
            loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop


def _blocks(prompt) -> range:
    """The blocks a prompt fills, from block 0 (16-token blocks)."""
    return range(-(-len(prompt) // 16))


def _draft_kv(worker: PrefillWorker) -> DraftKv:
    [hook] = worker.hooks
    assert isinstance(hook, DraftKv)
    return hook


async def _prefill(worker: PrefillWorker, job, reservation):
    """A job whose draft-KV reservation is ``reservation`` (a future), as the service runs it."""
    assert _draft_kv(worker).expect(job, reservation)
    return await worker.prefill(job)


def _sample(receiver, name: str) -> float | None:
    return receiver.metrics.registry.get_sample_value(f"kvmesh_draft_{name}")


def _done_future(value):
    future = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


async def test_prefill_writes_the_draft_kv_and_the_next_draft_computes_only_the_tail(tiny):
    from kvmesh.services.draft.core import DraftSnapshot
    from kvmesh.services.draft.drafters import build_drafter

    prompt = [(7 * i) % 250 + 1 for i in range(100)]  # 6 full blocks + 4 tokens, 4 chunks
    async with _mesh_in_process(tiny) as (worker, region, receiver, drafter, draft_side):
        bm = drafter.engine.block_manager
        req = DraftKvReserve("r", "Lr", tuple(prompt), receiver.kv_spec, 10_000)
        reply = await receiver.reserve(req)
        assert reply.ok and len(reply.block_addrs) == 6 and reply.num_layers == 2
        assert bm.num_free_blocks == 64 - 6
        result = await _prefill(
            worker, prefill_job(worker, "r", prompt, region, _blocks(prompt)), _done_future(reply)
        )
        assert result.done.ok and result.done.draft_worker_id == "dr0"
        draft_worker_id, done = result.draft_done
        assert draft_worker_id == "dr0" and done.ok and done.rkey == reply.rkey
        assert done.num_writes == 3  # chunks of 32 tokens; the last (4 tokens) has no full block
        for _ in range(done.num_writes):
            await receiver.on_completion(await draft_side.completion_queue.get())
        await receiver.on_done(done)
        assert _sample(receiver, "prompt_tokens_received_total") == 96
        assert bm.num_free_blocks == 64 and len(bm.hash_to_block) == 6  # cached, evictable
        context = (*prompt, result.done.first_token)
        [tree] = drafter.propose([DraftSnapshot("r", "d0", context, len(prompt))])
        assert drafter.num_computed_tokens == len(context) - 96  # the tail only

    reference = build_drafter(_draft_config())  # computes the whole prompt itself
    assert reference.propose([DraftSnapshot("r", "d0", context, len(prompt))]) == [tree]
    assert reference.num_computed_tokens == len(context)


async def test_refused_or_late_reservation_leaves_the_job_without_draft_writes(tiny):
    prompt = [(5 * i) % 250 + 1 for i in range(40)]
    async with _mesh_in_process(tiny) as (worker, region, receiver, _, _):
        req = DraftKvReserve("r", "Lr", tuple(prompt), "another-layout", 10_000)
        reply = await receiver.reserve(req)
        assert not reply.ok and "is not this draft's target's" in reply.error
        result = await _prefill(
            worker, prefill_job(worker, "r", prompt, region, _blocks(prompt)), _done_future(reply)
        )
        assert result.done.ok and result.done.draft_worker_id == "" and result.draft_done is None
        late = asyncio.get_running_loop().create_future()  # never answered during the job
        result = await _prefill(
            worker, prefill_job(worker, "q", prompt, region, _blocks(prompt)), late
        )
        assert result.done.ok and result.done.draft_worker_id == "" and result.draft_done is None
        late.cancel()


async def test_expired_reservation_returns_the_draft_blocks(tiny):
    prompt = [(5 * i) % 250 + 1 for i in range(40)]
    async with _mesh_in_process(tiny) as (_, _, receiver, drafter, _):
        bm = drafter.engine.block_manager
        reply = await receiver.reserve(
            DraftKvReserve("r", "Lr", tuple(prompt), receiver.kv_spec, 1)
        )
        assert reply.ok and bm.num_free_blocks == 62
        await asyncio.sleep(0.01)
        await receiver.expire()  # tcp windows are enforced: the blocks come back at once
        assert bm.num_free_blocks == 64 and not bm.hash_to_block
        assert _sample(receiver, "prompt_kv_refused_total") == 1


async def test_prefill_runs_the_draft_model_and_the_model_drafters_next_draft_computes_the_tail(
    tiny, small_draft
):
    from kvmesh.services.draft.core import DraftSnapshot

    prompt = [(7 * i) % 250 + 1 for i in range(100)]  # 6 full blocks + 4 tokens, 4 chunks
    async with _mesh_in_process(tiny, small_draft) as (
        worker,
        region,
        receiver,
        drafter,
        draft_side,
    ):
        bm = drafter.engine.block_manager
        req = DraftKvReserve(
            "r",
            "Lr",
            tuple(prompt),
            worker.kv_spec,
            10_000,
            draft_kv_spec=_draft_kv(worker).draft_kv_spec,
        )
        reply = await receiver.reserve(req)
        assert reply.ok and reply.whole_blocks and len(reply.block_addrs) == 6
        assert reply.block_bytes == _draft_kv(worker).draft_engine.kv_pool.spec.block_bytes
        result = await _prefill(
            worker, prefill_job(worker, "r", prompt, region, _blocks(prompt)), _done_future(reply)
        )
        assert result.done.ok and result.done.draft_worker_id == "dr0"
        draft_worker_id, done = result.draft_done
        assert draft_worker_id == "dr0" and done.ok and done.rkey == reply.rkey
        assert done.num_writes == 3  # the draft engine's chunks of 32 tokens, as the target's
        for _ in range(done.num_writes):
            await receiver.on_completion(await draft_side.completion_queue.get())
        await receiver.on_done(done)
        assert _sample(receiver, "prompt_tokens_received_total") == 96
        assert bm.num_free_blocks == 64 and len(bm.hash_to_block) == 6  # cached, evictable
        prefill_draft = _draft_kv(worker).draft_engine
        assert not prefill_draft.seqs and prefill_draft.block_manager.num_free_blocks == 64
        steps = worker.metrics.registry.get_sample_value(
            "kvmesh_prefill_draft_compute_seconds_count"
        )
        assert steps is not None and steps >= 4  # the draft engine's steps, timed
        context = (*prompt, result.done.first_token)
        [tree] = drafter.propose([DraftSnapshot("r", "d0", context, len(prompt))])
        assert drafter.num_computed_tokens == len(context) - 96  # the tail only

    reference = _model_drafter(small_draft)  # computes the whole prompt itself
    assert reference.propose([DraftSnapshot("r", "d0", context, len(prompt))]) == [tree]
    assert reference.num_computed_tokens == len(context) and len(tree[0]) == 5


async def test_model_drafter_refuses_a_prefill_without_its_draft_model_and_the_job_goes_on(
    tiny, small_draft
):
    prompt = [(5 * i) % 250 + 1 for i in range(70)]
    async with _mesh_in_process(tiny, small_draft) as (worker, region, receiver, _, _):
        for draft_kv_spec, error in (("", "runs no draft model"), ("other", "is not this draft")):
            req = DraftKvReserve(
                "r", "Lr", tuple(prompt), worker.kv_spec, 10_000, draft_kv_spec=draft_kv_spec
            )
            reply = await receiver.reserve(req)
            assert not reply.ok and error in reply.error
        assert _sample(receiver, "prompt_kv_refused_total") == 2
        # a refusal ends the prefill's draft compute; the target's job is as without it
        result = await _prefill(
            worker, prefill_job(worker, "r", prompt, region, _blocks(prompt)), _done_future(reply)
        )
        assert result.done.ok and result.done.draft_worker_id == "" and result.draft_done is None
        assert not _draft_kv(worker).draft_engine.seqs
        # no answer at all by the draft's last chunk: the same
        late = asyncio.get_running_loop().create_future()
        result = await _prefill(
            worker, prefill_job(worker, "q", prompt, region, _blocks(prompt)), late
        )
        assert (
            result.done.ok and result.draft_done is None and not _draft_kv(worker).draft_engine.seqs
        )
        late.cancel()


def test_prefill_draft_model_with_another_vocabulary_stops_the_worker_at_start_up(tmp_path):
    from kvmesh.services.prefill.config import PrefillConfig
    from kvmesh.services.prefill.draft_engine import load_draft_engine
    from kvmesh.shared.config.service_errors import ServiceStartError
    from kvmesh.shared.model.loader import load_config_and_tokenizer
    from support.small_models import write_small_seeded

    other = write_small_seeded(tmp_path / "other-vocab")
    config = PrefillConfig(draft_kv=True, draft_model=other)
    with pytest.raises(ServiceStartError, match="does not share the vocabulary"):
        load_draft_engine(config, load_config_and_tokenizer("kvmesh-tiny")[1])
    with pytest.raises(ValueError, match="needs --draft-kv"):
        PrefillConfig(draft_model=other)


def test_draft_block_bytes_hold_the_targets_first_layers(tiny):
    """The layout the plan relies on: a draft pool block is the target block's first layers of
    each head (kv_cache.py: head-major blocks)."""
    from kvmesh.shared.kv.kv_cache import KVCacheSpec, KVPool

    target = KVPool(KVCacheSpec(L, H, D, BS, torch.float32), 2)
    target.tensor.copy_(torch.randn_like(target.tensor))
    draft = KVPool(KVCacheSpec(2, H, D, BS, torch.float32), 2)
    write = DraftKvPlanner(_reply(1), BS, BS, L, H, BLOCK).plan((1,))
    base = 1 << 20
    for span in write.spans:
        dst = span.remote_addr - base
        draft.raw[dst : dst + span.length] = target.raw[
            span.local_offset : span.local_offset + span.length
        ]
    assert torch.equal(draft.tensor[0], target.tensor[1][:, :2])
