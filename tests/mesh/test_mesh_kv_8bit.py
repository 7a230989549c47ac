"""8-bit KV (int8 and fp8 e4m3) through a real disaggregated mesh (kvmesh-tiny, nats-server,
registry, router, prefill and decode processes, shm data plane).

* 8-bit on both sides: the blocks (scales inside) move as they are; greedy output equals the
  offline engine with that KV dtype token for token, and the prefill's byte counter shows the
  8-bit block bytes (a quarter of float32's plus the scales) per block.
* 8-bit on the decode side only: the prefill worker converts each chunk into the decode's layout
  before writing (services/prefill/convert.py); greedy output equals the same hand-off done
  offline (float32 prefill, blocks converted, 8-bit decode), and the bytes are again 8-bit's.
"""

from __future__ import annotations

import math

import pytest
import torch
from kvmesh.kernels.kv_convert import pack_converted
from kvmesh.loadgen import prom_text
from kvmesh.shared.engine.config import EngineConfig
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.kv.kv_cache import KVCacheSpec
from kvmesh.shared.text.sampling import SamplingOptions
from support.mesh_checks import check_blocks_returned, check_equals_offline, load

from kvmesh.testing.mesh import launched, mesh_config, random_prompts

pytestmark = pytest.mark.slow

CHUNK_TOKENS = 32
BLOCK_SIZE = 16
ENV = {
    "KVMESH_CHUNK_TOKENS": str(CHUNK_TOKENS),
    "KVMESH_BLOCK_SIZE": str(BLOCK_SIZE),
    "KVMESH_NUM_BLOCKS": "1024",
}
PROMPTS = random_prompts(12, 40, 150, seed=11)
MAX_TOKENS = 12
GREEDY = SamplingOptions(max_tokens=MAX_TOKENS, temperature=0.0)


def offline(tiny, kv_cache_dtype: str) -> list[list[int]]:
    model, tokenizer = tiny
    config = EngineConfig(num_blocks=1024, kv_cache_dtype=kv_cache_dtype)
    return LLMEngine(model, tokenizer, config).generate(PROMPTS, GREEDY)


def converted_handoff_offline(tiny, kv_cache_dtype: str) -> list[list[int]]:
    """What the mesh does with a float32 prefill and an 8-bit decode, in this process: prefill in
    chunks of CHUNK_TOKENS, each chunk's blocks converted (as KVMirror.convert does) into
    reserved 8-bit blocks, then decoded together."""
    model, tokenizer = tiny
    prefill = LLMEngine(
        model, tokenizer, EngineConfig(num_blocks=1024, max_num_batched_tokens=CHUNK_TOKENS)
    )
    decode = LLMEngine(
        model, tokenizer, EngineConfig(num_blocks=1024, kv_cache_dtype=kv_cache_dtype)
    )
    heads = prefill.kv_pool.spec.num_kv_heads
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(PROMPTS):
        rid = f"r{i}"
        reserved = decode.reserve_blocks(len(prompt))
        chunks = []
        prefill.add_request(rid, prompt, GREEDY, prefill_only=True, on_chunk=chunks.append)
        while prefill.has_unfinished():
            prefill.step()
        done = 0
        for chunk in chunks:
            ids = list(chunk.block_ids)
            first = math.ceil(chunk.end_token / BLOCK_SIZE) - len(ids)
            converted = pack_converted(
                prefill.kv_pool.tensor,
                None,
                ids,
                0,
                heads,
                decode.kv_pool.spec.dtype,
                num_tokens=chunk.end_token - first * BLOCK_SIZE,
            )
            for j, block in enumerate(reserved[done : done + len(ids)]):
                decode.kv_pool.block_bytes_view(block).copy_(converted[j])
            done += len(ids)
        prefill.release(rid)
        decode.admit_prefilled(rid, prompt, reserved, chunks[-1].first_token, GREEDY)
        tokens[rid] = [chunks[-1].first_token]
    while decode.has_unfinished():
        for out in decode.step():
            tokens[out.request_id] += out.new_token_ids
    return [tokens[f"r{i}"] for i in range(len(PROMPTS))]


@pytest.fixture(
    scope="module",
    params=[("int8", False), ("int8", True), ("fp8_e4m3", False), ("fp8_e4m3", True)],
    ids=["int8-both", "int8-decode-only", "fp8-both", "fp8-decode-only"],
)
def kv8_mesh(request):
    """(mesh, KV dtype, decode_only): that 8-bit KV on both sides, or on the decode side only."""
    kv_cache_dtype, decode_only = request.param
    config = mesh_config(
        mode="disagg",
        transport="shm",
        local_prefill_threshold=0,
        kv_cache_dtype="auto" if decode_only else kv_cache_dtype,
        decode_kv_cache_dtype=kv_cache_dtype,
    )
    with launched(config, ENV) as mesh:
        yield mesh, kv_cache_dtype, decode_only


def kv_bytes_written(mesh) -> float:
    return prom_text.scrape(mesh.metrics_urls["prefill-0"])["kvmesh_prefill_kv_bytes_written_total"]


def block_bytes(tiny, dtype: torch.dtype) -> int:
    """Bytes of one kvmesh-tiny block in ``dtype``."""
    mc = tiny[0].config
    shape = (mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, BLOCK_SIZE)
    return KVCacheSpec(*shape, dtype).block_bytes


async def test_disagg_mesh_with_8bit_kv_serves_as_offline(tiny, kv8_mesh):
    mesh, kv_cache_dtype, decode_only = kv8_mesh
    if decode_only:
        expected = converted_handoff_offline(tiny, kv_cache_dtype)
    else:
        expected = offline(tiny, kv_cache_dtype)
    replies, tap = await load(mesh, PROMPTS, MAX_TOKENS, linger_s=0.1)
    check_equals_offline(replies, tap, expected)
    for reply in replies:
        assert tap.reports[reply["id"]].num_chunks >= 2  # prefilled remotely, in chunks
    await check_blocks_returned(mesh)
    dtype = EngineConfig(kv_cache_dtype=kv_cache_dtype).kv_dtype(torch.float32)
    kv8, fp32 = block_bytes(tiny, dtype), block_bytes(tiny, torch.float32)
    num_blocks = sum(math.ceil(len(p) / BLOCK_SIZE) for p in PROMPTS)
    assert kv_bytes_written(mesh) == num_blocks * kv8  # every block once, in the 8-bit format
    # a quarter of float32's, plus the scales: one float per (layer, K/V) for fp8, per 32 values
    # of each token for int8
    assert kv8 * 4 <= fp32 * (36 / 32 if kv_cache_dtype == "int8" else 1.01)
