"""Every attention path over 8-bit KV (torch, the C kernels, Triton) against the torch reference,
for each 8-bit format: fp8 e4m3 with a power-of-two scale per (block, KV head) tile, and int8
with a scale per 32 rotated values of each token. The formats' own layout and store rules are in
test_kv_fp8.py and test_kv_int8.py."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from kvmesh.kernels.cpu_ops import decode_plan, load_cpu_ops
from kvmesh.kernels.paged_attention import paged_decode_attention, paged_tree_attention
from kvmesh.kernels.paged_attention_ref import paged_decode_attention_ref, paged_tree_attention_ref
from kvmesh.shared.kv import kv_int8, kv_quant
from kvmesh.shared.kv.kv_cache import KVCacheSpec, KVPool
from kvmesh.shared.model.attention import AttentionMetadata, paged_attention
from kvmesh.shared.model.rope import apply_rope

H_KV, H_Q, D, BS = 2, 4, 64, 4
TABLES = torch.tensor([[1, 2, 3, 0], [4, 5, 6, 7], [8, 9, 10, 11]])
CONTEXT = torch.tensor([9, 16, 5])


def gaussian(n: int, generator: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(n, H_KV, D, generator=generator)


def with_outliers(n: int, generator: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """(n, H_KV, D) values with a few large channels, as trained models' keys have."""
    x = gaussian(n, generator, scale)
    x[:, :, 5] *= 30.0
    x[:, :, 40] *= -12.0
    return x


def exact_to_1e5(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert (out - ref).abs().max() < 1e-5


def float_order(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal but for float32 sums in another order; values reach ~200 (the outlier channels)."""
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@dataclass(frozen=True)
class Format:
    name: str
    dtype: torch.dtype
    store: Callable[..., None]  # (data, scales, values, blocks, offsets)
    values: Callable[..., torch.Tensor]  # what a test pool is filled with
    close: Callable[[torch.Tensor, torch.Tensor], None]


FORMATS = [
    Format("fp8_e4m3", torch.float8_e4m3fn, kv_quant.store, gaussian, exact_to_1e5),
    Format("int8", torch.int8, kv_int8.store, with_outliers, float_order),
]


@pytest.fixture(params=FORMATS, ids=lambda f: f.name)
def fmt(request) -> Format:
    return request.param


def filled_pool(fmt: Format, num_layers: int = 2) -> KVPool:
    """A pool whose layer 1 holds CONTEXT - 1 tokens of each sequence of TABLES."""
    pool = KVPool(KVCacheSpec(num_layers, H_KV, D, BS, fmt.dtype), 12)
    k, v = pool.layer(1)
    k_scales, v_scales = pool.layer_scales(1)
    for b in range(3):
        n = int(CONTEXT[b]) - 1
        pos = torch.arange(n)
        g = torch.Generator().manual_seed(b)
        blocks, offsets = TABLES[b][pos // BS], pos % BS
        fmt.store(k, k_scales, fmt.values(n, g), blocks, offsets)
        fmt.store(v, v_scales, fmt.values(n, g, 2.0), blocks, offsets)
    return pool


def decode_meta() -> AttentionMetadata:
    pos = CONTEXT - 1
    return AttentionMetadata(
        slot_mapping=TABLES[torch.arange(3), pos // BS] * BS + pos % BS,
        query_lens=[1, 1, 1],
        context_lens=CONTEXT,
        block_tables=TABLES,
        block_size=BS,
    )


def layer_and_query(fmt: Format, seed: int):
    """filled_pool's layer 1 (K, V, their scales), a decode step's query drawn from a generator
    seeded ``seed``, and that generator."""
    pool = filled_pool(fmt)
    k, v = pool.layer(1)
    g = torch.Generator().manual_seed(seed)
    return k, v, pool.layer_scales(1), torch.randn(3, H_Q, D, generator=g), g


def test_torch_decode_attention_matches_reference(fmt):
    k, v, scales, q, g = layer_and_query(fmt, seed=4)
    new_k, new_v = torch.randn(3, H_KV, D, generator=g), torch.randn(3, H_KV, D, generator=g)
    out = paged_attention(q, new_k, new_v, k, v, decode_meta(), 0.125, scales)
    ref = paged_decode_attention_ref(q, k, v, TABLES, CONTEXT, 0.125, kv_scales=scales)
    fmt.close(out, ref)


def test_torch_prefill_reads_its_own_blocks_back(fmt):
    """A whole fresh prompt attends over its K/V as stored (quantized), as a later chunk would."""
    pool = KVPool(KVCacheSpec(1, H_KV, D, BS, fmt.dtype), 4)
    k_cache, v_cache = pool.layer(0)
    scales = pool.layer_scales(0)
    T = 10
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (H_Q, H_KV, H_KV))
    table = torch.tensor([[1, 2, 3]])
    meta = AttentionMetadata(
        slot_mapping=table[0][torch.arange(T) // BS] * BS + torch.arange(T) % BS,
        query_lens=[T],
        context_lens=torch.tensor([T]),
        block_tables=table,
        block_size=BS,
    )
    out = paged_attention(q, k, v, k_cache, v_cache, meta, 0.125, scales)
    bits = torch.tensor([(1 << (r + 1)) - 1 for r in range(T)])  # causal
    ref = paged_tree_attention_ref(
        q, k_cache, v_cache, table, torch.tensor([T]), [T], bits, 0.125, kv_scales=scales
    )
    fmt.close(out, ref)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="Triton runs under TRITON_INTERPRET=1 or on CUDA",
)
def test_triton_decode_and_tree_attention_match_reference(fmt):
    k, v, scales, q, g = layer_and_query(fmt, seed=6)
    out = paged_decode_attention(q, k, v, TABLES, CONTEXT, 0.125, kv_scales=scales)
    ref = paged_decode_attention_ref(q, k, v, TABLES, CONTEXT, 0.125, kv_scales=scales)
    fmt.close(out, ref)
    lens = [2, 3, 1]
    qt = torch.randn(sum(lens), H_Q, D, generator=g)
    bits = torch.tensor([1, 3, 1, 3, 5, 1])  # trees: a root then children
    out = paged_tree_attention(qt, k, v, TABLES, CONTEXT, lens, bits, 0.125, kv_scales=scales)
    ref = paged_tree_attention_ref(qt, k, v, TABLES, CONTEXT, lens, bits, 0.125, kv_scales=scales)
    fmt.close(out, ref)


@pytest.mark.parametrize("threads", [1, 3])
def test_c_decode_attention_matches_torch_and_stores_the_same_bits(fmt, threads):
    ops = load_cpu_ops()
    if ops is None:
        pytest.skip("no C compiler")
    base = filled_pool(fmt)
    c_pool, torch_pool = (KVPool(base.spec, base.num_blocks) for _ in range(2))
    c_pool.raw.copy_(base.raw)
    torch_pool.raw.copy_(base.raw)
    g = torch.Generator().manual_seed(9)
    qkv = 3 * torch.randn(3, H_Q + 2 * H_KV, D, generator=g)
    qkv[1, H_Q, 7] *= 40  # an outlier channel in sequence 1's new key (fp8: its tile's scale grows)
    angle = 6 * torch.rand(3, 1, D // 2, generator=g)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([-angle.sin(), angle.sin()], -1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        k, v = c_pool.layer(1)
        plan = decode_plan(CONTEXT, TABLES.shape[1], BS, H_Q // H_KV, quant_head_dim=D)
        out = ops.decode_attention(
            qkv.clone(), cos, sin, k, v, TABLES, CONTEXT, H_Q, 0.125, plan, c_pool.layer_scales(1)
        )
    finally:
        torch.set_num_threads(before)
    qk = apply_rope(qkv[:, : H_Q + H_KV], cos, sin)
    k, v = torch_pool.layer(1)
    ref = paged_attention(
        qk[:, :H_Q],
        qk[:, H_Q:],
        qkv[:, H_Q + H_KV :],
        k,
        v,
        decode_meta(),
        0.125,
        torch_pool.layer_scales(1),
    )
    assert torch.equal(c_pool.raw, torch_pool.raw)
    fmt.close(out, ref)


def test_triton_refuses_an_fp8_cache_without_scales():
    k, v = filled_pool(FORMATS[0]).layer(1)
    with pytest.raises(TypeError, match="int8 with kv_scales"):
        paged_decode_attention(torch.randn(3, H_Q, D), k, v, TABLES, CONTEXT, 0.125)


def test_triton_refuses_int8_scales_of_the_wrong_shape():
    k, v = filled_pool(FORMATS[1]).layer(1)
    wrong = (torch.ones(12, H_KV), torch.ones(12, H_KV))  # fp8's shape
    with pytest.raises(ValueError, match="kv_scales must be"):
        paged_decode_attention(torch.randn(3, H_Q, D), k, v, TABLES, CONTEXT, 0.125, wrong)
