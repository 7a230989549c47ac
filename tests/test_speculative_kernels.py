"""Tree-masked paged attention: the Triton kernel (CUDA or TRITON_INTERPRET=1) against the
torch reference and against the engine's torch path."""

import os

import pytest
import torch
from kvmesh.shared.engine.attention import AttentionMetadata, paged_attention
from kvmesh.shared.engine.draft_tree import DraftTree

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
    from kvmesh.kernels.paged_attention import paged_tree_attention, paged_tree_attention_ref

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
