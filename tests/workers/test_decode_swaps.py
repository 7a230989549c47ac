"""Swapping preempted sequences out to a kv-store and back (services/decode/swaps.py): the pure
parts, and an engine with a tiny pool driven as the decode worker drives it, against an
in-process store that copies blocks (the data plane's part is the mesh test's,
tests/mesh/test_mesh_swap.py): outputs equal a roomy engine's, and the counts say where the KV of
swapped blocks came from."""

from __future__ import annotations

import asyncio

import pytest
from kvmesh.services.decode.metrics import DecodeMetrics
from kvmesh.services.decode.swaps import SwapIn, Swaps, stored_run
from support.fake_stores import FakeStore, OneStore

BS = 16


def test_stored_run_is_the_leading_run_present_or_committed():
    assert stored_run([1, 2, 3, 4], present=[1], committed=[2, 4]) == 2
    assert stored_run([1, 2, 3], present=[], committed=[2, 3]) == 0
    assert stored_run([1, 2], present=[2, 1], committed=[]) == 2


def test_swap_in_counts_cached_then_read_then_recomputed():
    assert SwapIn.of(5, 2, 2, BS) == SwapIn(2 * BS, 2 * BS, 1 * BS)
    assert SwapIn.of(3, 4, 1, BS) == SwapIn(3 * BS, 0, 0)  # more cached than swapped
    assert SwapIn.of(3, 1, 5, BS) == SwapIn(BS, 2 * BS, 0)


def engine_of(tiny, num_blocks: int):
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine

    model, tokenizer = tiny
    return LLMEngine(model, tokenizer, EngineConfig(num_blocks=num_blocks, block_size=BS))


PROMPTS = [[(7 * i + 3 * j) % 200 + 1 for j in range(20 + 9 * i)] for i in range(3)]
MAX_TOKENS = 32
NUM_BLOCKS = 7  # 3 prompts of 2-3 blocks growing by 2: preemptions


async def drive(engine, swaps: Swaps) -> dict[str, list[int]]:
    """The decode worker's loop: swap-ins between steps, swap-outs right after a step."""
    from kvmesh.shared.text.sampling import SamplingOptions

    params = SamplingOptions(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    lock = swaps.lock
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    while engine.has_unfinished():
        async with lock:
            plan = swaps.plan_swap_in()
        if plan is not None:
            await swaps.swap_in(*plan)
        async with lock:
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
            swaps.swap_out_preempted()
        await asyncio.sleep(0)
    await swaps.aclose()
    return tokens


@pytest.fixture(scope="module")
def roomy(tiny) -> dict[str, list[int]]:
    from kvmesh.shared.text.sampling import SamplingOptions

    params = SamplingOptions(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = engine_of(tiny, 256).generate(PROMPTS, params)
    return {f"r{i}": out for i, out in enumerate(outs)}


def swaps_of(engine, store) -> tuple[Swaps, DecodeMetrics]:
    metrics = DecodeMetrics()
    return Swaps(engine, store, OneStore(), engine.kv_spec, metrics, asyncio.Lock()), metrics


def counts(metrics: DecodeMetrics) -> dict[str, float]:
    return {
        s.name + "".join(f"{{{v}}}" for v in s.labels.values()): s.value
        for m in metrics.registry.collect()
        for s in m.samples
        if s.name.startswith("kvmesh_decode_swap") and s.name.endswith("_total")
    }


def test_preempted_sequences_swap_out_and_read_back_what_the_pool_lost(tiny, roomy):
    engine = engine_of(tiny, NUM_BLOCKS)
    store = FakeStore(engine.kv_pool.raw, engine.kv_pool.spec.block_bytes)
    swaps, metrics = swaps_of(engine, store)
    assert asyncio.run(drive(engine, swaps)) == roomy
    c = counts(metrics)
    assert engine.scheduler.num_preemptions > 0
    assert c["kvmesh_decode_swap_outs_total"] == engine.scheduler.num_preemptions
    assert c["kvmesh_decode_swap_ins_total"] == engine.scheduler.num_preemptions
    assert c["kvmesh_decode_swap_in_tokens_total{read}"] == store.num_read * BS > 0
    assert swaps.swapped == {}
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS  # every pin dropped


def test_failed_swap_outs_recompute_and_lose_no_request(tiny, roomy):
    engine = engine_of(tiny, NUM_BLOCKS)
    store = FakeStore(engine.kv_pool.raw, engine.kv_pool.spec.block_bytes, fail_puts=True)
    swaps, metrics = swaps_of(engine, store)
    assert asyncio.run(drive(engine, swaps)) == roomy
    c = counts(metrics)
    assert c["kvmesh_decode_swap_out_failures_total"] >= 1
    assert c["kvmesh_decode_swap_in_tokens_total{read}"] == 0 and store.num_read == 0
    assert c["kvmesh_decode_swap_in_tokens_total{recomputed}"] > 0
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS
