"""Tree-masked paged attention: the Triton kernel (CUDA or TRITON_INTERPRET=1) against the
torch reference and against the engine's torch path; the C decode kernels verifying random
trees as one-query rows (TreeRows) against the torch path's tree mask."""

import os
import random

import pytest
import torch
from kvmesh.shared.engine.draft_tree import DraftTree
from kvmesh.shared.model.attention import AttentionMetadata, paged_attention

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    not (INTERPRET or torch.cuda.is_available()),
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1",
)

BLOCK_SIZE, H_Q, H_KV, D, NUM_BLOCKS = 4, 4, 2, 16, 24


def tree_mask(tree: DraftTree) -> torch.Tensor:
    n = len(tree) + 1
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[:, 0] = True
    for j, bits in enumerate(tree.ancestor_masks()):
        for a in range(len(tree)):
            mask[1 + j, 1 + a] = bool((bits >> a) & 1)
    return mask


def batch(use_triton: bool, seed: int = 0):
    """Three sequences: a tree of 5 nodes, a plain decode, a chain of 3; contexts cross blocks."""
    g = torch.Generator().manual_seed(seed)
    trees = {0: DraftTree((1, 2, 3, 4, 5), (-1, -1, 0, 0, 1)), 2: DraftTree.chain([7, 8, 9])}
    query_lens = [6, 1, 4]
    context_lens = [13, 9, 7]
    tables = [[3, 7, 1, 20], [5, 0, 9, 0], [11, 2, 0, 0]]
    slots = []
    for table, c, n in zip(tables, context_lens, query_lens, strict=True):
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(c - n, c)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=DEVICE),
        query_lens=query_lens,
        context_lens=torch.tensor(context_lens, device=DEVICE),
        block_tables=torch.tensor(tables, device=DEVICE),
        block_size=BLOCK_SIZE,
        use_triton=use_triton,
        tree_masks={i: tree_mask(t) for i, t in trees.items()},
    )
    T = sum(query_lens)
    # head-major blocks, as the pool lays them out: (2, blocks, H_kv, block_size, D) seen as
    # (blocks, block_size, H_kv, D)
    cache = torch.randn(2, NUM_BLOCKS, H_KV, BLOCK_SIZE, D, generator=g).to(DEVICE).transpose(2, 3)
    q = torch.randn(T, H_Q, D, generator=g).to(DEVICE)
    k = torch.randn(T, H_KV, D, generator=g).to(DEVICE)
    v = torch.randn(T, H_KV, D, generator=g).to(DEVICE)
    return q, k, v, cache[0], cache[1], meta


def test_torch_path_tree_rows_see_only_context_and_ancestors():
    q, k, v, k_cache, v_cache, meta = batch(use_triton=False)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, 0.25)
    # node 3 of the tree (row 4 of sequence 0) sees the 7 earlier tokens, the last token, 0, 3
    c, n = 13, 6
    keys = torch.cat([k_cache[[3, 7, 1, 20]].flatten(0, 1)[: c - n], k[[0, 1, 4]]])
    values = torch.cat([v_cache[[3, 7, 1, 20]].flatten(0, 1)[: c - n], v[[0, 1, 4]]])
    keys, values = keys.repeat_interleave(2, dim=1), values.repeat_interleave(2, dim=1)
    probs = (torch.einsum("hd,nhd->hn", q[4], keys) * 0.25).softmax(-1)
    torch.testing.assert_close(out[4], torch.einsum("hn,nhd->hd", probs, values))


@needs_triton
def test_triton_tree_kernel_matches_reference_and_torch_path():
    from kvmesh.kernels.paged_attention import paged_tree_attention
    from kvmesh.kernels.paged_attention_ref import paged_tree_attention_ref

    q, k, v, k_cache, v_cache, meta = batch(use_triton=False)
    expected = paged_attention(q, k, v, k_cache, v_cache, meta, 0.25)  # torch path, writes KV
    bits = meta.tree_bits()
    args = (k_cache, v_cache, meta.block_tables, meta.context_lens, meta.query_lens, bits, 0.25)
    ref = paged_tree_attention_ref(q, *args)
    got = paged_tree_attention(q, *args)
    torch.testing.assert_close(ref, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    _, _, _, k2, v2, meta_t = batch(use_triton=True)
    routed = paged_attention(q, k, v, k2, v2, meta_t, 0.25)  # through the Triton route
    torch.testing.assert_close(routed, expected, rtol=1e-4, atol=1e-5)


def test_tree_bits_are_causal_without_a_tree_and_ancestors_with_one():
    meta = batch(use_triton=False)[-1]
    bits = meta.tree_bits().tolist()
    assert bits[:6] == [0b1, 0b11, 0b101, 0b1011, 0b10011, 0b100101]
    assert bits[6] == 0b1
    assert bits[7:] == [0b1, 0b11, 0b111, 0b1111]


def random_tree(rng: random.Random, num_nodes: int) -> DraftTree:
    parents = tuple(rng.randrange(-1, i) for i in range(num_nodes))
    return DraftTree(tuple(rng.randrange(256) for _ in parents), parents)


@pytest.mark.parametrize(
    ("head_dim", "block_size", "kv_dtype"),
    [
        (64, 16, torch.float32),
        (48, 8, torch.float32),  # 48: a head size not specialised
        (64, 16, torch.float8_e4m3fn),
        (64, 16, torch.int8),
        (64, 16, torch.float16),  # a half cache: its tail gathered as half elements
        (48, 8, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("threads", [1, 3])
def test_c_decode_kernels_verify_random_trees_as_the_tree_mask_does(
    head_dim, block_size, kv_dtype, threads
):
    from kvmesh.kernels.cpu_ops import decode_plan, load_cpu_ops
    from kvmesh.shared.engine.model_runner import _one_query_rows
    from kvmesh.shared.kv.kv_cache import KVCacheSpec, KVPool
    from kvmesh.shared.model.rope import apply_rope

    ops = load_cpu_ops()
    assert ops is not None, "gcc is part of the test machine; the C kernels must build"
    fp8 = kv_dtype == torch.float8_e4m3fn
    rng = random.Random(head_dim + block_size + fp8)
    g = torch.Generator().manual_seed(rng.randrange(1000))
    h_q, h_kv, bs = 4, 2, block_size
    # a sequence per case: random trees (one of 63 nodes), a plain decode, a chain; the last
    # tokens at and around block edges
    trees = {
        0: random_tree(rng, 9),
        2: DraftTree.chain([1, 2, 3]),
        3: random_tree(rng, 63),
        4: random_tree(rng, 5),
    }
    lasts = [bs - 1, 2 * bs, 37, 3 * bs - 2, 5]
    num_new = [len(trees[i]) + 1 if i in trees else 1 for i in range(len(lasts))]
    ctx = [last + n for last, n in zip(lasts, num_new, strict=True)]
    width = max(-(-c // bs) for c in ctx)
    spec = KVCacheSpec(
        num_layers=2,
        num_kv_heads=h_kv,
        head_dim=head_dim,
        block_size=bs,
        dtype=kv_dtype,
    )
    pool = KVPool(spec, len(lasts) * width + 2)
    layer = 1
    k_cache, v_cache = pool.layer(layer)
    scales = pool.layer_scales(layer)
    ids = torch.randperm(pool.num_blocks, generator=g)[: len(lasts) * width]
    tables = ids.view(len(lasts), width).tolist()
    # the earlier context of each sequence, stored as the engine stores it
    earlier = [(i, p) for i, last in enumerate(lasts) for p in range(last)]
    earlier_slots = torch.tensor([tables[i][p // bs] * bs + p % bs for i, p in earlier])
    old = AttentionMetadata(earlier_slots, [len(earlier)], torch.tensor([1]), ids[None], bs)
    from kvmesh.shared.model.attention import write_kv

    kv = torch.randn(2, len(earlier), h_kv, head_dim, generator=g)
    write_kv(k_cache, v_cache, kv[0], kv[1], old, scales)
    ref_pool = KVPool(spec, pool.num_blocks)
    ref_pool.tensor.copy_(pool.tensor)
    if pool.scales is not None:
        ref_pool.scales.copy_(pool.scales)
    # the step's new tokens: each sequence's last token, then its tree's nodes in order
    T = sum(num_new)
    qkv = torch.randn(T, h_q + 2 * h_kv, head_dim, generator=g)
    angles = torch.rand(T, 1, head_dim // 2, generator=g) * 6
    cos = torch.cat([angles.cos()] * 2, -1)
    sin = torch.cat([-angles.sin(), angles.sin()], -1)
    scale = head_dim**-0.5

    # reference: the torch path with each tree's mask (nodes in the slots after the last token)
    qk = apply_rope(qkv[:, : h_q + h_kv], cos, sin)
    slots = [
        tables[i][p // bs] * bs + p % bs for i, c in enumerate(ctx) for p in range(lasts[i], c)
    ]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_lens=num_new,
        context_lens=torch.tensor(ctx),
        block_tables=torch.tensor(tables),
        block_size=bs,
        tree_masks={i: tree_mask(t) for i, t in trees.items()},
    )
    ref_scales = ref_pool.layer_scales(layer)
    expected = paged_attention(
        qk[:, :h_q],
        qk[:, h_q:],
        qkv[:, h_q + h_kv :],
        *ref_pool.layer(layer),
        meta,
        scale,
        ref_scales,
    )

    # the C kernels: one query row per new token, trees read through TreeRows
    query_lens, row_ctx, row_tables, _, tree_rows = _one_query_rows(trees, num_new, ctx, tables, {})
    assert query_lens == [1] * T and tree_rows is not None
    row_ctx_t = torch.tensor(row_ctx)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        plan = decode_plan(
            row_ctx_t,
            width,
            bs,
            h_q // h_kv,
            quant_head_dim=head_dim if kv_dtype in (torch.float8_e4m3fn, torch.int8) else 0,
            tree_rows=tree_rows,
            head_dim=head_dim,
        )
        out = ops.decode_attention(
            qkv,
            cos,
            sin,
            k_cache,
            v_cache,
            torch.tensor(row_tables),
            row_ctx_t,
            h_q,
            scale,
            plan,
            scales,
        )
    finally:
        torch.set_num_threads(saved)
    # a half cache: both paths compute in float32 on the same stored halves
    tol = {torch.int8: 1e-4, torch.float8_e4m3fn: 2e-2}.get(kv_dtype, 2e-5)
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)
    if not fp8:  # every new key and value (and int8 scales) in its node's slot, as torch stores it
        assert torch.equal(pool.raw, ref_pool.raw)
