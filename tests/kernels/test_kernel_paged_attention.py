"""Paged decode attention kernel vs its torch reference and vs the engine's torch path.

Runs on CPU under TRITON_INTERPRET=1 (set by `make test`), or on CUDA.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from kvmesh.kernels.paged_attention import paged_decode_attention
from kvmesh.kernels.paged_attention_ref import paged_decode_attention_ref
from kvmesh.shared.kv.kv_cache import KVCacheSpec, KVPool
from kvmesh.shared.model.attention import AttentionMetadata, paged_attention

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(
    not INTERPRET and not torch.cuda.is_available(),
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
ATOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _random_pool(spec: KVCacheSpec, num_blocks: int, seed: int) -> KVPool:
    gen = torch.Generator().manual_seed(seed)
    pool = KVPool(spec, num_blocks, device=DEVICE)
    pool.tensor.copy_(torch.randn(pool.tensor.shape, generator=gen).to(spec.dtype))
    return pool


def _block_tables(context_lens: list[int], block_size: int, num_blocks: int, seed: int):
    """Distinct, shuffled blocks per sequence; unused entries padded with 0."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in context_lens]
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(context_lens), max(need) + 1, dtype=torch.int64)
    start = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[start : start + n]
        start += n
    return tables.to(DEVICE), torch.tensor(context_lens, dtype=torch.int64, device=DEVICE)


CASES = [
    # (H_q, H_kv, head_dim, block_size, context_lens, dtype)
    (3, 3, 16, 4, [5], torch.float32),
    (6, 3, 16, 4, [1, 9, 16], torch.float32),
    (8, 2, 32, 8, [7, 13], torch.bfloat16),
    (5, 5, 12, 3, [2, 10, 4, 8], torch.float16),
    (4, 1, 16, 4, [11, 3], torch.float16),
    (10, 5, 8, 16, [17, 30], torch.bfloat16),
    (8, 4, 64, 16, [1, 15, 16, 17, 33, 40, 2, 31], torch.float32),
    (4, 2, 64, 16, [48, 5, 19], torch.bfloat16),
]


@pytest.mark.parametrize(("H_q", "H_kv", "D", "block_size", "context_lens", "dtype"), CASES)
def test_kernel_matches_reference_on_strided_pool_layer(
    H_q, H_kv, D, block_size, context_lens, dtype
):
    spec = KVCacheSpec(
        num_layers=2, num_kv_heads=H_kv, head_dim=D, block_size=block_size, dtype=dtype
    )
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 2
    pool = _random_pool(spec, num_blocks, seed=H_q * 100 + D)
    k_cache, v_cache = pool.layer(1)
    assert not k_cache.is_contiguous()
    tables, lens = _block_tables(context_lens, block_size, num_blocks, seed=1)
    q = torch.randn(len(context_lens), H_q, D, generator=torch.Generator().manual_seed(2)).to(
        dtype=dtype, device=DEVICE
    )
    scale = 1 / math.sqrt(D)

    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, scale)

    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=ATOL[dtype], rtol=ATOL[dtype])


@pytest.mark.parametrize(
    ("H_q", "H_kv", "block_size", "context_lens", "dtype"),
    [
        (4, 4, 4, [6], torch.float32),
        (6, 3, 4, [3, 12, 9], torch.float32),
        (12, 3, 8, [8, 21], torch.bfloat16),
        (7, 7, 4, [1, 5, 2], torch.float16),
    ],
)
def test_kernel_matches_engine_torch_path_for_decode_batch(
    H_q, H_kv, block_size, context_lens, dtype
):
    D = 16
    spec = KVCacheSpec(
        num_layers=3, num_kv_heads=H_kv, head_dim=D, block_size=block_size, dtype=dtype
    )
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 3
    pool = _random_pool(spec, num_blocks, seed=7)
    k_cache, v_cache = pool.layer(2)
    tables, lens = _block_tables(context_lens, block_size, num_blocks, seed=3)
    B = len(context_lens)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(B, H_q, D, generator=gen).to(dtype=dtype, device=DEVICE)
    k_new = torch.randn(B, H_kv, D, generator=gen).to(dtype=dtype, device=DEVICE)
    v_new = torch.randn(B, H_kv, D, generator=gen).to(dtype=dtype, device=DEVICE)
    last = lens - 1  # the decoded token sits at the last position of each context
    slots = (
        tables.gather(1, (last // block_size)[:, None]).squeeze(1) * block_size + last % block_size
    )

    def run(use_triton: bool) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=slots,
            query_lens=[1] * B,
            context_lens=lens,
            block_tables=tables,
            block_size=block_size,
            use_triton=use_triton,
        )
        return paged_attention(q, k_new, v_new, k_cache, v_cache, meta, 1 / math.sqrt(D))

    expected = run(use_triton=False)
    got = run(use_triton=True)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 1 / math.sqrt(D))

    torch.testing.assert_close(got.float(), expected.float(), atol=ATOL[dtype], rtol=ATOL[dtype])
    torch.testing.assert_close(ref.float(), expected.float(), atol=ATOL[dtype], rtol=ATOL[dtype])
    # the new token was written and is attended to: dropping it changes the answer
    shorter = paged_decode_attention_ref(q, k_cache, v_cache, tables, (lens - 1).clamp(min=1), 1.0)
    assert not torch.allclose(shorter[lens > 1].float(), got[lens > 1].float(), atol=1e-3)


def test_kernel_accepts_strided_q_int32_tables_and_unused_negative_padding():
    spec = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=16, block_size=4)
    pool = _random_pool(spec, 6, seed=11)
    k_cache, v_cache = pool.layer(0)
    qkv = torch.randn(2, 4 + 2 + 2, 16, device=DEVICE)  # fused projection output
    q = qkv[:, :4]
    assert not q.is_contiguous()
    tables = torch.tensor([[2, 5, -1], [0, -1, -1]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([6, 3], dtype=torch.int32, device=DEVICE)

    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.25)

    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def _valid_inputs():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
    pool = KVPool(spec, 4, device=DEVICE)
    k_cache, v_cache = pool.layer(0)
    q = torch.zeros(2, 4, 8, device=DEVICE)
    tables = torch.tensor([[0, 1], [2, 3]], device=DEVICE)
    lens = torch.tensor([5, 8], device=DEVICE)
    return q, k_cache, v_cache, tables, lens


@pytest.mark.parametrize(
    ("mutate", "error", "match"),
    [
        (lambda a: (a[0][:, :3], *a[1:]), ValueError, "multiple of KV heads"),
        (lambda a: (a[0][:, :, :4], *a[1:]), ValueError, "head_dim"),
        (lambda a: (a[0].unsqueeze(0), *a[1:]), ValueError, r"q must be \(B, H_q, D\)"),
        (
            lambda a: (a[0].transpose(1, 2).contiguous().transpose(1, 2), *a[1:]),
            ValueError,
            "unit stride",
        ),
        (lambda a: (a[0], a[1].transpose(1, 2), *a[2:]), ValueError, "both be"),
        (lambda a: (a[0].double(), *a[1:]), TypeError, "must be one of"),
        (lambda a: (a[0], a[1], a[2].half(), *a[3:]), TypeError, "v_cache is"),
        (lambda a: (*a[:3], a[3].float(), a[4]), TypeError, "int32/int64"),
        (lambda a: (*a[:3], a[3][:1], a[4]), ValueError, "block_tables must be"),
        (lambda a: (*a[:4], a[4][:1]), ValueError, "context_lens must be"),
        (
            lambda a: (*a[:4], a[4].new_tensor([5, 9])),
            ValueError,
            r"context_lens must lie in \[1, 8\]",
        ),
        (lambda a: (*a[:4], a[4].new_tensor([0, 8])), ValueError, "context_lens must lie"),
        (lambda a: (*a[:3], a[3].new_tensor([[0, 4], [2, 3]]), a[4]), ValueError, "outside"),
        (lambda a: (*a[:3], a[3].new_tensor([[0, 1], [-1, 3]]), a[4]), ValueError, "outside"),
    ],
)
def test_wrapper_rejects_bad_inputs(mutate, error, match):
    with pytest.raises(error, match=match):
        paged_decode_attention(*mutate(_valid_inputs()), 1.0)
