"""KV pack/scatter kernels vs their torch references, and TP resharding through them.

Runs on CPU under TRITON_INTERPRET=1 (set by `make test`), or on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from kvmesh.kernels.kv_pack import (
    ReshardPiece,
    pack_blocks,
    pack_blocks_ref,
    reshard_plan,
    scatter_blocks,
    scatter_blocks_ref,
    staging_shape,
)
from kvmesh.shared.kv.kv_cache import KVCacheSpec, KVPool
from support.triton_device import DEVICE, needs_triton

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Same-width integer view, so comparisons are bitwise (fp8 has no ==; NaN != NaN)."""
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype).to(DEVICE)


def _pool(num_blocks: int, num_heads: int, dtype: torch.dtype) -> KVPool:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=num_heads, head_dim=8, block_size=4, dtype=dtype)
    return KVPool(spec, num_blocks, device=DEVICE)


# --- reshard_plan (pure) ---------------------------------------------------------------------


def test_reshard_plan_identity_sends_everything_to_same_rank():
    assert reshard_plan(4, 2, 2) == [
        [ReshardPiece(0, (0, 2), 0)],
        [ReshardPiece(1, (0, 2), 0)],
    ]


def test_reshard_plan_splits_one_source_rank_over_decode_ranks():
    assert reshard_plan(6, 1, 2) == [[ReshardPiece(0, (0, 3), 0), ReshardPiece(1, (3, 6), 0)]]


def test_reshard_plan_merges_source_ranks_into_one_decode_rank():
    assert reshard_plan(4, 4, 2) == [
        [ReshardPiece(0, (0, 1), 0)],
        [ReshardPiece(0, (0, 1), 1)],
        [ReshardPiece(1, (0, 1), 0)],
        [ReshardPiece(1, (0, 1), 1)],
    ]


def test_reshard_plan_handles_unaligned_ranges():
    # heads 0-2 | 3-5 on the source, 0-1 | 2-3 | 4-5 on the destination
    assert reshard_plan(6, 2, 3) == [
        [ReshardPiece(0, (0, 2), 0), ReshardPiece(1, (2, 3), 0)],
        [ReshardPiece(1, (0, 1), 1), ReshardPiece(2, (1, 3), 0)],
    ]


@pytest.mark.parametrize(
    ("heads", "src_tp", "dst_tp"), [(8, 4, 2), (8, 2, 8), (12, 3, 4), (5, 1, 5)]
)
def test_reshard_plan_covers_every_head_exactly_once(heads, src_tp, dst_tp):
    seen = []
    for src_rank, pieces in enumerate(reshard_plan(heads, src_tp, dst_tp)):
        for p in pieces:
            lo, hi = p.src_heads
            assert 0 <= lo < hi <= heads // src_tp
            assert 0 <= p.dst_head_offset <= heads // dst_tp - (hi - lo)
            src_global = range(src_rank * heads // src_tp + lo, src_rank * heads // src_tp + hi)
            dst_global = range(
                p.dst_rank * heads // dst_tp + p.dst_head_offset,
                p.dst_rank * heads // dst_tp + p.dst_head_offset + hi - lo,
            )
            assert src_global == dst_global
            seen.extend(src_global)
    assert sorted(seen) == list(range(heads))


@pytest.mark.parametrize(
    ("heads", "src_tp", "dst_tp"), [(3, 2, 1), (6, 1, 4), (2, 4, 1), (0, 1, 1), (4, 0, 1)]
)
def test_reshard_plan_rejects_heads_that_do_not_divide(heads, src_tp, dst_tp):
    with pytest.raises(ValueError):
        reshard_plan(heads, src_tp, dst_tp)


# --- pack / scatter kernels --------------------------------------------------------------------


def _tokens(pool: torch.Tensor, block_ids: list[int], heads: slice) -> torch.Tensor:
    """The token run of the listed blocks, by plain indexing: (h, L, 2, n * block_size, D)."""
    return torch.cat([pool[b, heads] for b in block_ids], dim=3)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "head_start", "head_end"), [(3, 0, 3), (5, 1, 4)])
def test_pack_matches_reference(dtype, num_heads, head_start, head_end):
    pool = _pool(6, num_heads, dtype)
    pool.tensor.copy_(_random(pool.tensor.shape, dtype, seed=num_heads))
    ids = [4, 0, 5]

    staging = pack_blocks(pool.tensor, ids, head_start, head_end)

    assert staging.shape == (3, head_end - head_start, 2, 2, 4, 8) and staging.dtype == dtype
    assert staging.is_contiguous()
    ref = pack_blocks_ref(pool.tensor, ids, head_start, head_end)
    assert torch.equal(_bits(staging), _bits(ref))
    # a head range of a head-major block is one contiguous span: staging block i == that span
    # (an fp8 pool keeps its scales at the end of each head's span: the data before them)
    data = pool.spec.head_bytes - pool.spec.scale_bytes
    for i, b in enumerate(ids):
        off, length = pool.head_span(b, head_start, head_end)
        span = pool.raw[off : off + length].view(head_end - head_start, -1)[:, :data]
        assert torch.equal(staging[i].reshape(-1).view(torch.uint8), span.reshape(-1))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_matches_reference_and_leaves_other_heads_and_blocks(dtype):
    pool = _pool(5, 5, dtype)
    pool.tensor.copy_(_random(pool.tensor.shape, dtype, seed=1))
    expected = pool.tensor.clone()
    staging = _random((2, 3, 2, 2, 4, 8), dtype, seed=2)
    ids = torch.tensor([3, 1], dtype=torch.int32, device=DEVICE)

    scatter_blocks(staging, pool.tensor, ids, head_start=2)
    scatter_blocks_ref(staging, expected, ids, head_start=2)

    assert torch.equal(_bits(pool.tensor), _bits(expected))
    assert torch.equal(_bits(pool.tensor[3, 2:]), _bits(staging[0]))
    assert torch.equal(_bits(pool.tensor[1, 2:]), _bits(staging[1]))


@needs_triton
def test_pack_into_out_buffer_and_scatter_round_trip_through_bytes():
    src, dst = _pool(4, 3, torch.bfloat16), _pool(4, 3, torch.bfloat16)
    src.tensor.copy_(_random(src.tensor.shape, torch.bfloat16, seed=3))
    out = torch.empty((2, 2, 2, 2, 4, 8), dtype=torch.bfloat16, device=DEVICE)

    staging = pack_blocks(src.tensor, [2, 3], 1, 3, out=out)
    wire = staging.view(torch.uint8).clone()  # what a transport would carry
    scatter_blocks(wire.view(torch.bfloat16), dst.tensor, [0, 1], 1)

    assert staging.data_ptr() == out.data_ptr()
    assert torch.equal(_bits(dst.tensor[:2, 1:3]), _bits(src.tensor[2:, 1:3]))
    assert not _bits(dst.tensor[:2, 0]).any() and not _bits(dst.tensor[2:]).any()


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize(("num_src_blocks", "staging_bs"), [(4, 8), (3, 8), (3, 2), (2, 16)])
def test_pack_regroups_tokens_into_another_block_size(dtype, num_src_blocks, staging_bs):
    """Pool blocks of 4 tokens -> staging blocks of 2, 8 or 16: the token run is the same, a
    last staging block the run does not fill is zero in its tail."""
    pool = _pool(6, 3, dtype)
    pool.tensor.copy_(_random(pool.tensor.shape, dtype, seed=staging_bs + num_src_blocks))
    ids = [5, 1, 3, 0][:num_src_blocks]
    num_tokens = 4 * num_src_blocks

    staging = pack_blocks(pool.tensor, ids, 1, 3, block_size=staging_bs)

    m = -(-num_tokens // staging_bs)
    assert staging.shape == (m, 2, 2, 2, staging_bs, 8)
    assert staging.shape == staging_shape(pool.tensor, num_src_blocks, 2, staging_bs)
    run = torch.cat(list(staging), dim=3)  # (2, L, 2, m * staging_bs, D)
    assert torch.equal(
        _bits(run[:, :, :, :num_tokens]), _bits(_tokens(pool.tensor, ids, slice(1, 3)))
    )
    assert not _bits(run[:, :, :, num_tokens:]).any()
    ref = pack_blocks_ref(pool.tensor, ids, 1, 3, block_size=staging_bs)
    assert torch.equal(_bits(staging), _bits(ref))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize(
    ("staging_blocks", "staging_bs", "pool_bs"), [(3, 4, 8), (1, 8, 2), (1, 8, 8)]
)
def test_scatter_regroups_tokens_and_spares_the_rest_of_a_partial_block(
    dtype, staging_blocks, staging_bs, pool_bs
):
    spec = KVCacheSpec(num_layers=2, num_kv_heads=3, head_dim=8, block_size=pool_bs, dtype=dtype)
    pool = KVPool(spec, 8, device=DEVICE)
    pool.tensor.copy_(_random(pool.tensor.shape, dtype, seed=pool_bs))
    before = pool.tensor.clone()
    expected = pool.tensor.clone()
    staging = _random((staging_blocks, 2, 2, 2, staging_bs, 8), dtype, seed=staging_bs)
    num_tokens = staging_blocks * staging_bs
    ids = [6, 2, 4, 0][: -(-num_tokens // pool_bs)]

    scatter_blocks(staging, pool.tensor, ids, head_start=1)
    scatter_blocks_ref(staging, expected, ids, head_start=1)

    assert torch.equal(_bits(pool.tensor), _bits(expected))
    run = torch.cat(list(staging), dim=3)
    got = _tokens(pool.tensor, ids, slice(1, 3))
    assert torch.equal(_bits(got[:, :, :, :num_tokens]), _bits(run))
    assert torch.equal(
        _bits(got[:, :, :, num_tokens:]),
        _bits(_tokens(before, ids, slice(1, 3))[:, :, :, num_tokens:]),
    )
    assert torch.equal(_bits(pool.tensor[:, 0]), _bits(before[:, 0]))
    others = [b for b in range(8) if b not in ids]
    assert torch.equal(_bits(pool.tensor[others]), _bits(before[others]))


@needs_triton
def test_pack_with_many_tiles_per_block_matches_reference():
    """A block larger than one program's tile (several row and element tiles per block)."""
    spec = KVCacheSpec(
        num_layers=3, num_kv_heads=4, head_dim=96, block_size=64, dtype=torch.float16
    )
    pool = KVPool(spec, 3, device=DEVICE)
    pool.tensor.copy_(_random(pool.tensor.shape, torch.float16, seed=7))

    staging = pack_blocks(pool.tensor, [2, 0], 1, 4, block_size=32)

    assert torch.equal(_bits(staging), _bits(pack_blocks_ref(pool.tensor, [2, 0], 1, 4, 32)))
    back = KVPool(spec, 3, device=DEVICE)
    scatter_blocks(staging, back.tensor, [1, 2], 1)
    assert torch.equal(_bits(back.tensor[[1, 2], 1:]), _bits(pool.tensor[[2, 0], 1:]))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("heads", "src_tp", "dst_tp"), [(3, 1, 1), (6, 2, 1), (4, 4, 2), (10, 1, 2), (5, 1, 1)]
)
def test_reshard_through_pack_and_scatter_rebuilds_destination_shards(dtype, heads, src_tp, dst_tp):
    """Source ranks hold their head slice of the same blocks; after every rank sends its pieces,
    each destination rank holds exactly its head slice of the unsharded KV, in its own blocks."""
    num_blocks = 6
    full = _random((num_blocks, heads, 2, 2, 4, 8), dtype, seed=heads * 10 + src_tp)
    src_ids, dst_ids = [3, 0, 5], [1, 4, 2]
    src_heads, dst_heads = heads // src_tp, heads // dst_tp
    src_pools = [_pool(num_blocks, src_heads, dtype) for _ in range(src_tp)]
    for rank, pool in enumerate(src_pools):
        pool.tensor.copy_(full[:, rank * src_heads : (rank + 1) * src_heads])
    dst_pools = [_pool(num_blocks, dst_heads, dtype) for _ in range(dst_tp)]

    for src_rank, pieces in enumerate(reshard_plan(heads, src_tp, dst_tp)):
        for piece in pieces:
            staging = pack_blocks(src_pools[src_rank].tensor, src_ids, *piece.src_heads)
            scatter_blocks(
                staging, dst_pools[piece.dst_rank].tensor, dst_ids, piece.dst_head_offset
            )

    for rank, pool in enumerate(dst_pools):
        want = full[src_ids][:, rank * dst_heads : (rank + 1) * dst_heads]
        assert torch.equal(_bits(pool.tensor[dst_ids]), _bits(want))
        untouched = [b for b in range(num_blocks) if b not in dst_ids]
        assert not _bits(pool.tensor[untouched]).any()


@needs_triton
def test_empty_block_list_packs_to_empty_staging():
    pool = _pool(3, 2, torch.float32)
    staging = pack_blocks(pool.tensor, [], 0, 2)
    assert staging.shape == (0, 2, 2, 2, 4, 8)
    scatter_blocks(staging, pool.tensor, [], 0)
    assert not pool.tensor.any()


def _bad_pack(**overrides):
    args = {
        "pool": _pool(4, 3, torch.float16).tensor,
        "block_ids": [0, 3],
        "head_start": 0,
        "head_end": 2,
    }
    args.update(overrides)
    return pack_blocks(**args)


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"block_ids": [0, 4]}, ValueError, r"block ids must lie in \[0, 4\)"),
        ({"block_ids": [-1]}, ValueError, "block ids must lie"),
        ({"block_ids": torch.tensor([[0, 1]])}, ValueError, "1-D int32/int64"),
        ({"block_ids": torch.tensor([0.0])}, ValueError, "1-D int32/int64"),
        ({"head_start": 2, "head_end": 2}, ValueError, "head range"),
        ({"head_start": 1, "head_end": 4}, ValueError, "head range"),
        ({"head_start": -1, "head_end": 1}, ValueError, "head range"),
        ({"block_size": 0}, ValueError, "block_size must be positive"),
        ({"pool": torch.zeros(4, 3, 2, 4, 8)}, ValueError, "pool must be"),
        ({"pool": torch.zeros(4, 3, 2, 3, 4, 8)}, ValueError, "pool must be"),
        ({"pool": torch.zeros(4, 3, 2, 2, 8, 4).transpose(4, 5)}, ValueError, "unit stride"),
        ({"pool": torch.zeros(4, 3, 2, 2, 4, 8, dtype=torch.bool)}, TypeError, "dtype"),
        ({"out": torch.empty(2, 3, 2, 2, 4, 8, dtype=torch.float16)}, ValueError, "shape"),
        ({"out": torch.empty(2, 2, 2, 2, 4, 8, dtype=torch.float32)}, TypeError, "staging is"),
        (
            {"out": torch.empty(2, 2, 2, 2, 4, 8, dtype=torch.float16), "block_size": 8},
            ValueError,
            r"shape \(1, 2, 2, 2, 8, 8\)",
        ),
        (
            {"out": torch.empty(2, 2, 2, 2, 8, 4, dtype=torch.float16).transpose(4, 5)},
            ValueError,
            "contiguous",
        ),
    ],
)
def test_pack_rejects_bad_inputs(overrides, error, match):
    if "out" in overrides:
        overrides["out"] = overrides["out"].to(DEVICE)
    with pytest.raises(error, match=match):
        _bad_pack(**overrides)


@pytest.mark.parametrize(
    ("staging_shape", "block_ids", "head_start", "match"),
    [
        ((2, 2, 2, 2, 4, 8), [1, 1], 0, "distinct"),
        ((2, 2, 2, 2, 4, 8), [1, 2], 2, "head range"),
        ((2, 2, 2, 2, 4, 8), [1], 0, "fill 2 pool blocks of 4, but 1 block ids"),
        ((3, 2, 2, 2, 2, 8), [1], 0, "fill 2 pool blocks"),
        ((2, 2, 2, 2, 4, 4), [1, 2], 0, "shape"),
        ((2, 2, 3, 2, 4, 8), [1, 2], 0, "shape"),
        ((2, 2, 2, 2, 4), [1, 2], 0, "staging must be"),
        ((2, 2, 2, 3, 4, 8), [1, 2], 0, "staging must be"),
    ],
)
def test_scatter_rejects_bad_inputs(staging_shape, block_ids, head_start, match):
    pool = _pool(4, 3, torch.float32)
    with pytest.raises(ValueError, match=match):
        scatter_blocks(
            torch.zeros(staging_shape, device=DEVICE), pool.tensor, block_ids, head_start
        )
