import torch
from kvmesh.shared.kv.kv_cache import KVCacheSpec, KVPool
from kvmesh.shared.model.attention import AttentionMetadata, paged_attention


def _reference(q, k, v, scale):
    """Causal attention of the last len(q) positions over all of k/v; q (L, Hq, D), k (S, Hkv, D)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    L, S = q.shape[0], k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = torch.arange(S - L, S)[:, None]
    scores = scores.masked_fill(torch.arange(S)[None] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


SCALE = 8**-0.5


def _layer_caches(seed: int, num_kv_heads: int, num_blocks: int) -> tuple[torch.Tensor, ...]:
    """After seeding torch with ``seed``: the K and V caches of a fresh one-layer pool (head_dim
    8, blocks of 4 tokens)."""
    torch.manual_seed(seed)
    spec = KVCacheSpec(num_layers=1, num_kv_heads=num_kv_heads, head_dim=8, block_size=4)
    return KVPool(spec, num_blocks).layer(0)


def _store_earlier(k_cache, v_cache, table: torch.Tensor, keys, values) -> None:
    """Store one sequence's earlier tokens (``keys``, ``values``: (n, 2, 8)) through its block
    ``table`` (1 x blocks), by a prefill of them with random queries."""
    n = keys.shape[0]
    slots = torch.stack([table[0, p // 4] * 4 + p % 4 for p in range(n)])
    meta = AttentionMetadata(slots, [n], torch.tensor([n]), table, 4)
    paged_attention(torch.randn(n, 4, 8), keys, values, k_cache, v_cache, meta, SCALE)


def test_mixed_batch_of_prefill_and_continuation_matches_reference():
    k_cache, v_cache = _layer_caches(0, num_kv_heads=2, num_blocks=16)
    # seq B already holds 3 tokens in blocks 5, 6
    kb, vb = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    tables = torch.tensor([[1, 2, 0], [5, 6, 0]])
    first = AttentionMetadata(torch.tensor([20, 21, 22]), [3], torch.tensor([3]), tables[1:], 4)
    paged_attention(torch.randn(3, 4, 8), kb, vb, k_cache, v_cache, first, SCALE)
    # now: seq A prefills 5 tokens (blocks 1, 2), seq B adds 2 tokens (slots 23, 24)
    q, k, v = torch.randn(7, 4, 8), torch.randn(7, 2, 8), torch.randn(7, 2, 8)
    slots = torch.tensor([4, 5, 6, 7, 8, 23, 24])
    meta = AttentionMetadata(slots, [5, 2], torch.tensor([5, 5]), tables, 4)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, SCALE)
    torch.testing.assert_close(out[:5], _reference(q[:5], k[:5], v[:5], SCALE))
    expected_b = _reference(q[5:], torch.cat([kb, k[5:]]), torch.cat([vb, v[5:]]), SCALE)
    torch.testing.assert_close(out[5:], expected_b)


def test_single_prompt_fast_path_equals_paged_path():
    torch.manual_seed(1)
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4)
    q, k, v = torch.randn(10, 2, 8), torch.randn(10, 1, 8), torch.randn(10, 1, 8)
    tables = torch.tensor([[0, 1, 2]])
    outs = []
    for ctx_len in (10, 11):  # 11: one earlier token forces the paged path
        pool = KVPool(spec, 4)
        kc, vc = pool.layer(0)
        slots = torch.arange(ctx_len - 10, ctx_len)
        meta = AttentionMetadata(slots, [10], torch.tensor([ctx_len]), tables, 4)
        if ctx_len == 11:
            kc[0, 0] = 0.0  # an earlier token with zero key and value
        outs.append(paged_attention(q, k, v, kc, vc, meta, 0.5))
    torch.testing.assert_close(outs[0], _reference(q, k, v, 0.5))
    ref_with_prefix = _reference(
        q, torch.cat([torch.zeros(1, 1, 8), k]), torch.cat([torch.zeros(1, 1, 8), v]), 0.5
    )
    torch.testing.assert_close(outs[1], ref_with_prefix)


def test_decode_batch_with_unequal_contexts_matches_reference():
    k_cache, v_cache = _layer_caches(2, num_kv_heads=2, num_blocks=16)
    # Earlier tokens: seq 0 has 6 in blocks 7, 3; seq 1 has 1 in block 9; seq 2 has 9 in 2, 5, 11.
    tables = torch.tensor([[7, 3, 0], [9, 0, 0], [2, 5, 11]])
    past = [6, 1, 9]
    hist_k = [torch.randn(n, 2, 8) for n in past]
    hist_v = [torch.randn(n, 2, 8) for n in past]
    for i in range(len(past)):
        _store_earlier(k_cache, v_cache, tables[i : i + 1], hist_k[i], hist_v[i])
    # One new token each (GQA: 4 query heads over 2 KV heads).
    q, k, v = torch.randn(3, 4, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    slots = torch.stack([tables[i, n // 4] * 4 + n % 4 for i, n in enumerate(past)])
    ctx = torch.tensor(past) + 1
    meta = AttentionMetadata(slots, [1, 1, 1], ctx, tables, 4)
    assert meta.is_decode_only and meta.torch_plan().mask is not None
    out = paged_attention(q, k, v, k_cache, v_cache, meta, SCALE)
    for i in range(3):
        keys, values = torch.cat([hist_k[i], k[i : i + 1]]), torch.cat([hist_v[i], v[i : i + 1]])
        torch.testing.assert_close(out[i : i + 1], _reference(q[i : i + 1], keys, values, SCALE))


def test_decode_batch_with_equal_contexts_needs_no_mask():
    k_cache, v_cache = _layer_caches(3, num_kv_heads=1, num_blocks=8)
    tables = torch.tensor([[4, 1], [0, 6]])
    hist_k, hist_v = torch.randn(2, 5, 1, 8), torch.randn(2, 5, 1, 8)
    k_cache[tables[:, :1].flatten()] = hist_k[:, :4]
    v_cache[tables[:, :1].flatten()] = hist_v[:, :4]
    k_cache[tables[:, 1], 0] = hist_k[:, 4]
    v_cache[tables[:, 1], 0] = hist_v[:, 4]
    q, k, v = torch.randn(2, 3, 8), torch.randn(2, 1, 8), torch.randn(2, 1, 8)
    meta = AttentionMetadata(tables[:, 1] * 4 + 1, [1, 1], torch.tensor([6, 6]), tables, 4)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, 0.5)
    assert meta.torch_plan().mask is None
    for i in range(2):
        keys, values = torch.cat([hist_k[i], k[i : i + 1]]), torch.cat([hist_v[i], v[i : i + 1]])
        torch.testing.assert_close(out[i : i + 1], _reference(q[i : i + 1], keys, values, 0.5))


def test_decodes_beside_a_prefill_chunk_are_split_not_padded_and_match_reference():
    k_cache, v_cache = _layer_caches(3, num_kv_heads=2, num_blocks=32)
    # decodes d0 (5 earlier tokens, blocks 1-2) and d1 (2 earlier, block 3), a fresh 6-token
    # prompt p (blocks 4-5), another decode d2 (9 earlier, blocks 6-8): queries 1, 1, 6, 1
    earlier = {0: (5, [1, 2]), 1: (2, [3]), 3: (9, [6, 7, 8])}
    tables = torch.tensor([[1, 2, 0], [3, 0, 0], [4, 5, 0], [6, 7, 8]])
    history = {}
    for i, (n, _) in earlier.items():
        kh, vh = torch.randn(n, 2, 8), torch.randn(n, 2, 8)
        _store_earlier(k_cache, v_cache, tables[i : i + 1], kh, vh)
        history[i] = (kh, vh)
    q_lens = [1, 1, 6, 1]
    ctx = [6, 3, 6, 10]
    q, k, v = torch.randn(9, 4, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    slots = [
        tables[0, 1] * 4 + 1,
        tables[1, 0] * 4 + 2,
        *(tables[2, t // 4] * 4 + t % 4 for t in range(6)),
    ]
    slots.append(tables[3, 2] * 4 + 1)
    meta = AttentionMetadata(torch.tensor(slots), q_lens, torch.tensor(ctx), tables, 4)
    assert meta.is_mixed
    out = paged_attention(q, k, v, k_cache, v_cache, meta, SCALE)
    [rows, decodes], *chunks = meta.parts()
    assert rows.tolist() == [0, 1, 8] and decodes.query_lens == [1, 1, 1]
    assert [c[1].query_lens for c in chunks] == [[6]]  # the chunk alone: no padded queries
    starts = [0, 1, 2, 8]
    for i, start in enumerate(starts):
        n = q_lens[i]
        kh, vh = history.get(i, (torch.zeros(0, 2, 8), torch.zeros(0, 2, 8)))
        keys, values = torch.cat([kh, k[start : start + n]]), torch.cat([vh, v[start : start + n]])
        expected = _reference(q[start : start + n], keys, values, SCALE)
        torch.testing.assert_close(out[start : start + n], expected)
