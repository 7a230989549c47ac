"""The Triton kernels compiled for a CUDA GPU (not interpreted) against their torch references on
the same GPU, at the engine's shapes and at Llama-3.2-1B's (32 query heads, 8 KV heads, head_dim
64, block 16, contexts of thousands of tokens): paged decode attention and tree / prefill-chunk
attention for every cache dtype (int8 and fp8 with scales), KV pack / scatter for every dtype, block-size
regroup and TP reshard.

``gpu``-marked: skipped without CUDA ("no CUDA device"); `make gpu-check` runs them. Never yet run
on real hardware (docs/gpu.md).
"""

from __future__ import annotations

import math

import pytest
import torch
from kvmesh.shared.kv.kv_cache import KVCacheSpec, KVPool

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
ATOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float8_e4m3fn: 2e-3}
KV_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int8]


def _pool(
    layers: int, heads: int, dim: int, block: int, dtype: torch.dtype, blocks: int, seed: int
):
    """A KV pool on the GPU with random contents; an int8 or fp8 pool gets random power-of-two
    scales."""
    spec = KVCacheSpec(
        num_layers=layers, num_kv_heads=heads, head_dim=dim, block_size=block, dtype=dtype
    )
    pool = KVPool(spec, blocks, device=DEVICE)
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(pool.tensor.shape, generator=gen)
    if dtype == torch.int8:
        values = (values * 3).round()  # small ints: values as fp8 pools hold
    pool.tensor.copy_(values.to(dtype))
    if pool.scales is not None:
        exps = torch.randint(-3, 3, pool.scales.shape, generator=gen).float()
        pool.scales.copy_(torch.exp2(exps))
    return pool


def _tables(context_lens: list[int], block: int, num_blocks: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block) for n in context_lens]
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(context_lens), max(need), dtype=torch.int64)
    start = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[start : start + n]
        start += n
    return tables.to(DEVICE), torch.tensor(context_lens, dtype=torch.int64, device=DEVICE)


def _q_dtype(kv_dtype: torch.dtype) -> torch.dtype:
    return torch.bfloat16 if kv_dtype in (torch.float8_e4m3fn, torch.int8) else kv_dtype


# --- paged decode attention ----------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize(
    ("H_q", "H_kv", "D", "block", "context_lens"),
    [
        (32, 8, 64, 16, [1, 17, 255, 2048]),  # Llama-3.2-1B heads
        (32, 8, 128, 16, [4096, 33, 700]),  # Llama-3-8B heads
        (8, 2, 64, 32, [5, 64, 1000, 31, 2, 511, 77, 1]),
        (14, 2, 64, 16, [100, 3]),  # Qwen2-0.5B heads (a group of 7: padded inside the kernel)
    ],
)
def test_decode_kernel_matches_reference_on_cuda(H_q, H_kv, D, block, context_lens, kv_dtype):
    from kvmesh.kernels.paged_attention import paged_decode_attention
    from kvmesh.kernels.paged_attention_ref import paged_decode_attention_ref

    num_blocks = sum(-(-n // block) for n in context_lens) + 3
    pool = _pool(2, H_kv, D, block, kv_dtype, num_blocks, seed=H_q + D)
    k_cache, v_cache = pool.layer(1)
    scales = pool.layer_scales(1)
    tables, lens = _tables(context_lens, block, num_blocks, seed=1)
    q_dtype = _q_dtype(kv_dtype)
    q = torch.randn(len(context_lens), H_q, D, generator=torch.Generator().manual_seed(2))
    q = q.to(q_dtype).to(DEVICE)
    scale = 1 / math.sqrt(D)

    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, kv_scales=scales)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, scale, kv_scales=scales)

    assert out.device.type == torch.device(DEVICE).type and out.dtype == q_dtype
    tol = ATOL[q_dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_decode_kernel_matches_sdpa_on_unpaged_data_on_cuda():
    """What the benchmark compares against (SDPA on the same K/V gathered unpaged) agrees."""
    from kvmesh.kernels.paged_attention import paged_decode_attention

    B, H_q, H_kv, D, block, n = 32, 32, 8, 64, 16, 1000
    num_blocks = B * -(-n // block)
    pool = _pool(1, H_kv, D, block, torch.bfloat16, num_blocks, seed=5)
    k_cache, v_cache = pool.layer(0)
    tables, lens = _tables([n] * B, block, num_blocks, seed=6)
    q = torch.randn(B, H_q, D, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    q = q.to(DEVICE)
    keys = k_cache[tables].flatten(1, 2)[:, :n].transpose(1, 2)
    values = v_cache[tables].flatten(1, 2)[:, :n].transpose(1, 2)

    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, D**-0.5)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None], keys, values, scale=D**-0.5, enable_gqa=True
    )[:, :, 0]

    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


# --- tree / prefill-chunk attention --------------------------------------------------------------


def _tree_bits(query_lens: list[int], seed: int) -> torch.Tensor:
    """Per row, the new tokens it sees: a random tree for odd sequences (each node's parent an
    earlier node), causal rows (a prefill chunk) for even ones."""
    gen = torch.Generator().manual_seed(seed)
    bits: list[int] = []
    for i, n in enumerate(query_lens):
        rows = [1]
        for r in range(1, n):
            if i % 2 == 0:
                rows.append(rows[-1] | (1 << r))
            else:
                parent = int(torch.randint(0, r, (1,), generator=gen))
                rows.append(rows[parent] | (1 << r))
        bits += [v - (1 << 64) if v >= 1 << 63 else v for v in rows]
    return torch.tensor(bits, dtype=torch.int64, device=DEVICE)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize(
    ("H_q", "H_kv", "D", "block", "query_lens", "context_lens"),
    [
        (32, 8, 64, 16, [64, 9, 1, 33], [64, 300, 2049, 40]),
        (8, 2, 128, 16, [17, 64], [1500, 64]),
    ],
)
def test_tree_kernel_matches_reference_on_cuda(
    H_q, H_kv, D, block, query_lens, context_lens, kv_dtype
):
    from kvmesh.kernels.paged_attention import paged_tree_attention
    from kvmesh.kernels.paged_attention_ref import paged_tree_attention_ref

    num_blocks = sum(-(-n // block) for n in context_lens) + 2
    pool = _pool(1, H_kv, D, block, kv_dtype, num_blocks, seed=D)
    k_cache, v_cache = pool.layer(0)
    scales = pool.layer_scales(0)
    tables, lens = _tables(context_lens, block, num_blocks, seed=3)
    q_dtype = _q_dtype(kv_dtype)
    q = torch.randn(sum(query_lens), H_q, D, generator=torch.Generator().manual_seed(4))
    q = q.to(q_dtype).to(DEVICE)
    bits = _tree_bits(query_lens, seed=5)
    args = (k_cache, v_cache, tables, lens, query_lens, bits, D**-0.5)

    out = paged_tree_attention(q, *args, kv_scales=scales)
    ref = paged_tree_attention_ref(q, *args, kv_scales=scales)

    tol = ATOL[q_dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


# --- KV pack / scatter ---------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize(
    ("head_start", "head_end", "staging_block"), [(0, 8, None), (0, 4, None), (4, 8, 32), (2, 6, 8)]
)
def test_pack_and_scatter_match_reference_on_cuda(dtype, head_start, head_end, staging_block):
    from kvmesh.kernels.kv_pack import (
        pack_blocks,
        pack_blocks_ref,
        scatter_blocks,
        scatter_blocks_ref,
    )

    pool = _pool(16, 8, 64, 16, dtype, 96, seed=11)
    ids = torch.randperm(96, generator=torch.Generator().manual_seed(12))[:40].to(DEVICE)

    staging = pack_blocks(pool.tensor, ids, head_start, head_end, block_size=staging_block)
    ref = pack_blocks_ref(pool.tensor, ids, head_start, head_end, block_size=staging_block)
    assert staging.device.type == torch.device(DEVICE).type
    assert torch.equal(_bits(staging), _bits(ref))

    if staging_block is not None:
        return  # regrouped staging scatters into the other block size: next test
    target = _pool(16, 8, 64, 16, dtype, 96, seed=13)
    expected = target.tensor.clone()
    dst_ids = torch.randperm(96, generator=torch.Generator().manual_seed(14))[:40].to(DEVICE)
    scatter_blocks(staging, target.tensor, dst_ids, head_start)
    scatter_blocks_ref(staging, expected, dst_ids, head_start)
    assert torch.equal(_bits(target.tensor), _bits(expected))


@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize(
    ("heads", "src_tp", "dst_tp"), [(8, 1, 2), (8, 2, 1), (8, 4, 2), (8, 2, 8)]
)
def test_reshard_through_pack_and_scatter_on_cuda(dtype, heads, src_tp, dst_tp):
    """Every source rank packs its pieces, every destination rank scatters them, block sizes 16
    -> 32: each destination shard holds exactly its heads of the source tokens."""
    from kvmesh.kernels.kv_pack import pack_blocks, reshard_plan, scatter_blocks

    layers, dim, block, n = 4, 64, 16, 6
    full = _pool(layers, heads, dim, block, dtype, n, seed=21).tensor  # the unsharded truth
    src_heads, dst_heads = heads // src_tp, heads // dst_tp
    sources = [full[:, r * src_heads : (r + 1) * src_heads].contiguous() for r in range(src_tp)]
    dst_block = 2 * block
    m = n * block // dst_block
    dests = [
        torch.zeros((m, dst_heads, layers, 2, dst_block, dim), dtype=dtype, device=DEVICE)
        for _ in range(dst_tp)
    ]
    ids = torch.arange(n, device=DEVICE)
    for r, pieces in enumerate(reshard_plan(heads, src_tp, dst_tp)):
        for piece in pieces:
            staging = pack_blocks(sources[r], ids, *piece.src_heads, block_size=dst_block)
            scatter_blocks(
                staging,
                dests[piece.dst_rank],
                torch.arange(m, device=DEVICE),
                piece.dst_head_offset,
            )
    run = full.permute(1, 2, 3, 0, 4, 5).reshape(heads, layers, 2, n * block, dim)
    for r, dest in enumerate(dests):
        got = dest.permute(1, 2, 3, 0, 4, 5).reshape(dst_heads, layers, 2, m * dst_block, dim)
        assert torch.equal(_bits(got), _bits(run[r * dst_heads : (r + 1) * dst_heads]))
