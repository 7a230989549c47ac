"""A prefill worker writing to a decode worker of another KV dtype (real tcp transport, no NATS):
each chunk is converted into the decode's layout and written from the mirror; the bytes that
land are exactly the conversion of the KV an engine computes, and the byte counter counts the
decode's bytes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kvmesh.kernels.kv_convert import pack_converted
from kvmesh.shared.model.identity import kv_spec_fingerprint
from kvmesh.shared.text.sampling import SamplingOptions
from support.prefill_rig import prefill_job, prefill_rig

FP8 = torch.float8_e4m3fn
PROMPT = [(7 * i) % 250 + 1 for i in range(60)]  # 4 blocks: chunks of 32 + 16 + 12 tokens
TARGETS = [9, 3, 4, 10]


def _engine(tiny, kv_cache_dtype: str, **kw):
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine

    return LLMEngine(*tiny, EngineConfig(num_blocks=64, kv_cache_dtype=kv_cache_dtype, **kw))


def _converting_prefill(tiny, prefill_dtype: str, decode_spec):
    """A prefill worker with a ``prefill_dtype`` KV pool writing into 16 blocks of a decode
    worker whose KV layout is ``decode_spec``."""
    engine = _engine(tiny, prefill_dtype, max_num_batched_tokens=32)
    return prefill_rig(
        engine,
        kv_spec=kv_spec_fingerprint(engine.kv_pool.spec, tiny[0].config),
        decode_spec=decode_spec,
        decode_kv_spec=kv_spec_fingerprint(decode_spec, tiny[0].config),
        remote_blocks=16,
    )


@pytest.mark.parametrize(
    ("prefill_dtype", "decode_dtype"),
    [("auto", FP8), ("fp8_e4m3", None), ("auto", torch.int8), ("int8", None), ("int8", FP8)],
)
async def test_prefill_converts_each_chunk_for_a_decode_worker_of_another_kv_dtype(
    tiny, prefill_dtype, decode_dtype
):
    reference = _engine(tiny, prefill_dtype, max_num_batched_tokens=32)  # the worker's chunks
    decode_spec = dataclasses.replace(reference.kv_pool.spec, dtype=decode_dtype or torch.float32)
    async with _converting_prefill(tiny, prefill_dtype, decode_spec) as (worker, _, region, remote):
        bb = decode_spec.block_bytes
        result = await worker.prefill(
            prefill_job(worker, "r", PROMPT, region, TARGETS, block_bytes=bb)
        )
        assert result.done.ok and result.done.num_writes == 3, result.done.error
        assert worker.metrics.kv_bytes_written._value.get() == len(TARGETS) * bb
        got = remote.clone().view(-1, bb)

    chunks = []
    greedy = SamplingOptions(temperature=0.0)
    reference.add_request("x", PROMPT, greedy, prefill_only=True, on_chunk=chunks.append)
    while reference.has_unfinished():
        reference.step()
    blocks = [b for c in chunks for b in c.block_ids]
    pool = reference.kv_pool
    heads = pool.spec.num_kv_heads
    expected = pack_converted(
        pool.tensor, pool.scales, blocks, 0, heads, decode_spec.dtype, num_tokens=len(PROMPT)
    )
    for target, want in zip(TARGETS, expected, strict=True):
        assert torch.equal(got[target], want)
