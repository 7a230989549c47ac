"""Tensor parallelism in the engine (shared/model/tensor_parallel.py, docs/tp.md).

Four rank processes share one gloo world, spawned once for the module: TP4 over all of them
(kvmesh-tiny's 2 KV heads each replicated on two ranks), then TP2 in two pairs, one on the
float32 model and one on its Q8_0 twin (weights as stored, sharded by rows and by whole blocks).
Each run's greedy tokens must be TP1's, and each rank's KV pool must hold exactly its heads of
TP1's pool. Then a prompt is handed from prefill to decode across TP degrees (every pair of
{1, 2, 4}^2, and 2 -> 1, 1 -> 2 in int8) through the shm transport, each prefill rank writing
its own heads with the product's planners, and a colocated worker's ranks (the leader's engine
calls replayed) answer at TP2 and TP4.
The same for a seeded model of SmolLM2-135M's 9 heads and 3 KV heads, which TP2 splits unevenly
(2 + 1 GQA groups).
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
from typing import Any

import pytest
import torch
from kvmesh.shared.config.ports import free_port
from kvmesh.shared.kv.head_shards import HeadPiece, KVHeadShards, reshard_pieces
from kvmesh.shared.model.quant import quantize
from kvmesh.shared.model.quant_layers import QuantLinear
from kvmesh.shared.model.tensor_parallel import TPLayout, TPShardError, _columns
from support import tp_ranks

HEAD_BYTES = 2 * 4 * 16 * 64 * 4  # kvmesh-tiny: K and V, 4 layers, 16 tokens, head_dim 64, float32
INT8_HEAD_BYTES = 2 * 4 * 16 * 64 + 2 * 4 * 16 * 2 * 4  # int8 values, then a float32 per 32
UNEVEN_HEAD_BYTES = 2 * 2 * 16 * 32 * 4  # tp_ranks.uneven_model: 2 layers, head_dim 32


@pytest.fixture(scope="module")
def rank_results() -> dict[int, dict[str, Any]]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=tp_ranks.rank_main, args=(rank, port, queue), daemon=True)
        for rank in range(tp_ranks.WORLD)
    ]
    for p in procs:
        p.start()
    try:
        results = {r: pickle.loads(data) for r, data in (queue.get(timeout=300) for _ in procs)}
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0] * tp_ranks.WORLD
    return results


@pytest.fixture(scope="module")
def tp1() -> dict[str | None, dict[str, Any]]:
    torch.set_num_threads(1)
    runs = {quant: tp_ranks.run_engine(tp_ranks.tiny_model(quant)) for quant in (None, "Q8_0")}
    return runs | {"int8": tp_ranks.run_engine(tp_ranks.tiny_model(None), kv_cache_dtype="int8")}


@pytest.fixture(scope="module")
def tp1_uneven() -> dict[str, Any]:
    torch.set_num_threads(1)
    return tp_ranks.run_engine(tp_ranks.uneven_model())


def _check_ranks(
    runs: list[dict[str, Any]], reference: dict[str, Any], num_kv_heads: int = 2
) -> None:
    full_kv = reference["kv"]  # (blocks, 2 heads, L, 2, bs, D)
    for run in runs:
        assert run["tokens"] == reference["tokens"]
        h0, h1 = run["kv_heads"]
        assert run["block_bytes"] * num_kv_heads == reference["block_bytes"] * (h1 - h0)
        assert run["kv"].shape[1] == h1 - h0
        # a 16-bit pool (Q8_0 weights' "auto" KV) rounds values the ranks' sums leave a hair
        # apart to neighbouring float16s now and then: one of its steps (2^-10 relative) is allowed
        rtol = 2**-10 if full_kv.dtype == torch.float16 else 1e-4
        torch.testing.assert_close(run["kv"], full_kv[:, h0:h1], atol=2e-4, rtol=rtol)


def test_tp4_with_replicated_kv_heads_decodes_as_tp1(rank_results, tp1):
    runs = [rank_results[r]["tp4"] for r in range(4)]
    assert [run["kv_heads"] for run in runs] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    _check_ranks(runs, tp1[None])


def test_tp2_decodes_as_tp1(rank_results, tp1):
    runs = [rank_results[r]["tp2"] for r in (0, 1)]
    assert [run["kv_heads"] for run in runs] == [(0, 1), (1, 2)]
    _check_ranks(runs, tp1[None])


def test_tp2_of_weights_kept_as_q8_0_decodes_as_tp1(rank_results, tp1):
    _check_ranks([rank_results[r]["tp2_q8"] for r in (2, 3)], tp1["Q8_0"])


def test_a_decode_ranks_pool_holds_its_heads_of_the_tp1_pools_blocks(rank_results):
    """``kvmesh serve decode --kv-cache-bytes N`` at TP1: N bytes of whole blocks; each rank of
    a TP worker allocates and holds its heads of as many blocks (TP2: half; TP4 over 2 KV heads:
    a replica of one, half)."""
    tp1 = tp_ranks.decode_pool(tp_ranks.tiny_model(None))
    assert tp1 == {"allocated": [4 << 20], "num_blocks": 64, "nbytes": 4 << 20}
    # the Q8_0 twin's TP1 pool: its own KV dtype's blocks ("auto": float16 over stored weights)
    tp1_q8 = tp_ranks.decode_pool(tp_ranks.tiny_model("Q8_0"))
    assert tp1_q8["allocated"] == [4 << 20] == [tp1_q8["nbytes"]]
    for case, ranks, whole in (
        ("tp4", range(4), tp1),
        ("tp2", (0, 1), tp1),
        ("tp2_q8", (2, 3), tp1_q8),
    ):
        half = whole | {"allocated": [whole["nbytes"] // 2], "nbytes": whole["nbytes"] // 2}
        assert [rank_results[r][f"{case}_decode_pool"] for r in ranks] == [half] * len(ranks)


def test_tp2_prefill_hands_its_heads_to_a_tp1_decode_that_decodes_as_tp1(rank_results, tp1):
    """Each prefill rank writes its head of every block (32 KiB a block, one head of tiny's two)
    into the one decode pool: a distinct immediate per chunk from each, then greedy as TP1."""
    decode = rank_results[2]["handoff_2_to_1"]
    assert decode["tokens"] == tp1[None]["tokens"][0]
    assert decode["senders"] == [0, 1] and len(decode["imms"]) == 3 * 2
    assert len(set(decode["imms"])) == 6  # (slot, chunk * 2 + writer): each write counts
    for rank in (0, 1):
        prefill = rank_results[rank]["handoff_2_to_1"]
        assert prefill == {"sent": 3 * HEAD_BYTES, "kv_heads_held": 1}  # 3 blocks, 1 head each


def test_tp1_prefill_sends_each_tp2_decode_rank_its_head(rank_results, tp1):
    for rank in (0, 1):
        decode = rank_results[rank]["handoff_1_to_2"]
        assert decode["tokens"] == tp1[None]["tokens"][0]
        assert decode["senders"] == [0] and len(decode["imms"]) == 3
    assert rank_results[2]["handoff_1_to_2"] == {"sent": 2 * 3 * HEAD_BYTES, "kv_heads_held": 2}


def test_tp2_prefill_writes_each_tp2_decode_rank_its_head_from_the_rank_holding_it(
    rank_results, tp1
):
    """Prefill ranks 0, 1 (the leader and a PrefillFollower) to decode ranks 2, 3: rank r's head
    goes to decode rank r alone, one writer each."""
    for rank in (2, 3):
        decode = rank_results[rank]["handoff_2_to_2"]
        assert decode["tokens"] == tp1[None]["tokens"][0]
        assert decode["senders"] == [rank - 2] and len(decode["imms"]) == 3
    for rank in (0, 1):
        assert rank_results[rank]["handoff_2_to_2"] == {"sent": 3 * HEAD_BYTES, "kv_heads_held": 1}


def _held(tp: int, rank: int) -> set[int]:
    """kvmesh-tiny's KV heads (of 2) a rank holds at TP 1, 2 or 4 (TP4: each on two ranks)."""
    return {0, 1} if tp == 1 else {rank * 2 // tp}


@pytest.mark.parametrize(("tp_p", "tp_d"), tp_ranks.GRID)
def test_every_prefill_tp_to_decode_tp_of_1_2_4_hands_off_and_decodes_as_tp1(
    rank_results, tp1, tp_p, tp_d
):
    """The rest of {1, 2, 4}^2 (2 -> 1, 1 -> 2, 2 -> 2 above), a process holding a prefill rank
    and a decode rank where the sides overlap: each decode rank receives exactly its heads of
    every block, each from the first prefill rank holding it (a replica writes nothing), with a
    distinct immediate per chunk and writer, then decodes TP1's tokens."""
    prefill, decode = tp_ranks.grid_ranks(tp_p, tp_d)
    runs = {r: rank_results[r][f"grid_{tp_p}_to_{tp_d}"] for r in range(4)}
    writers = [p for p in range(tp_p) if tp_p < 4 or p % 2 == 0]  # TP4: 1 and 3 hold replicas
    for d, r in enumerate(decode):
        run = runs[r]
        assert run["tokens"] == tp1[None]["tokens"][0]
        assert run["received"] == 3 * HEAD_BYTES * len(_held(tp_d, d))  # 3 blocks
        senders = [p for p in writers if _held(tp_p, p) & _held(tp_d, d)]
        assert run["senders"] == senders
        assert len(set(run["imms"])) == len(run["imms"]) == 3 * len(senders)  # 3 chunks
    for p, r in enumerate(prefill):
        heads = [len(_held(tp_p, p) & _held(tp_d, d)) for d in range(tp_d)]
        assert runs[r]["sent"] == (3 * HEAD_BYTES * sum(heads) if p in writers else 0)
        assert runs[r]["kv_heads_held"] == len(_held(tp_p, p))


def test_int8_kv_hands_off_2_to_1_and_1_to_2_each_head_with_its_scales_as_tp1(rank_results, tp1):
    """int8 pools on both sides (``--kv-cache-dtype int8`` with ``--prefill-tp``/``--decode-tp``):
    a head's span carries its scales, so a rank's slice of a block is still one span; the
    decode ranks give TP1's tokens over int8 KV."""
    expected = tp1["int8"]["tokens"][0]
    assert rank_results[2]["int8_2_to_1"]["tokens"] == expected
    for rank in (0, 1):
        assert rank_results[rank]["int8_2_to_1"] == {
            "sent": 3 * INT8_HEAD_BYTES,
            "kv_heads_held": 1,
        }
        decode = rank_results[rank]["int8_1_to_2"]
        assert decode["tokens"] == expected and decode["received"] == 3 * INT8_HEAD_BYTES
    assert rank_results[2]["int8_2_to_1"]["received"] == 2 * 3 * INT8_HEAD_BYTES


def test_a_colocated_worker_at_tp2_and_tp4_decodes_as_tp1(rank_results, tp1):
    """``kvmesh serve colocated --tp N``'s ranks (engines built as the worker's, the leader's
    calls replayed by each follower): both prompts as TP1, at TP4 and in either TP2 pair."""
    expected = tp1[None]["tokens"]
    assert rank_results[0]["colocated_tp4"] == expected
    assert rank_results[0]["colocated_tp2"] == rank_results[2]["colocated_tp2"] == expected
    assert [rank_results[r]["colocated_tp2"] for r in (1, 3)] == [None, None]  # followers


def test_uneven_tp2_of_9_heads_holds_whole_gqa_groups_and_decodes_as_tp1(rank_results, tp1_uneven):
    """9 heads, 3 KV heads at TP2 (both pairs of the world): rank 0 holds KV heads 0-1 with
    query heads 0-5, rank 1 KV head 2 with query heads 6-8; TP1's tokens, each its heads' KV."""
    runs = [rank_results[r]["uneven"] for r in range(4)]
    assert [run["kv_heads"] for run in runs] == [(0, 2), (2, 3)] * 2
    _check_ranks(runs, tp1_uneven, num_kv_heads=3)


def test_uneven_decode_ranks_hold_as_many_blocks_each_its_heads_bytes(rank_results):
    tp1 = tp_ranks.decode_pool(tp_ranks.uneven_model())
    blocks, nbytes = tp1["num_blocks"], tp1["nbytes"]
    for rank, held in ((0, 2), (1, 1), (2, 2), (3, 1)):
        pool = rank_results[rank]["uneven_decode_pool"]
        assert pool["num_blocks"] == blocks and pool["nbytes"] * 3 == nbytes * held


def test_uneven_tp2_prefill_hands_each_rank_its_heads_to_a_tp1_decode(rank_results, tp1_uneven):
    """2 -> 1: prefill rank 0 writes 2 heads of every block, rank 1 one head at head offset 2."""
    decode = rank_results[2]["uneven_2_to_1"]
    assert decode["tokens"] == tp1_uneven["tokens"][0]
    assert decode["senders"] == [0, 1] and len(set(decode["imms"])) == 3 * 2
    assert rank_results[0]["uneven_2_to_1"] == {
        "sent": 3 * 2 * UNEVEN_HEAD_BYTES,
        "kv_heads_held": 2,
    }
    assert rank_results[1]["uneven_2_to_1"] == {"sent": 3 * UNEVEN_HEAD_BYTES, "kv_heads_held": 1}


def test_tp1_prefill_hands_an_uneven_tp2_decode_each_rank_its_heads(rank_results, tp1_uneven):
    """1 -> 2: decode rank 0's blocks hold 2 heads, rank 1's one: spans of different lengths."""
    for rank in (0, 1):
        decode = rank_results[rank]["uneven_1_to_2"]
        assert decode["tokens"] == tp1_uneven["tokens"][0]
        assert decode["senders"] == [0] and len(decode["imms"]) == 3
    assert rank_results[2]["uneven_1_to_2"] == {
        "sent": 3 * 3 * UNEVEN_HEAD_BYTES,
        "kv_heads_held": 3,
    }


def test_tp_layout_splits_by_whole_gqa_groups_as_evenly_as_they_allow():
    assert [KVHeadShards(3, 2).heads(r) for r in range(2)] == [(0, 2), (2, 3)]
    assert [KVHeadShards(5, 3).heads(r) for r in range(3)] == [(0, 2), (2, 4), (4, 5)]
    assert [TPLayout(2, r, 9, 3).q_heads for r in range(2)] == [(0, 6), (6, 9)]
    assert [TPLayout(3, r, 9, 3).q_heads for r in range(3)] == [(0, 3), (3, 6), (6, 9)]
    # replicated (fewer KV heads than ranks): an equal share of the group's query heads
    assert [TPLayout(4, r, 8, 2).q_heads for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # 3 heads 2 -> 1 and 1 -> 2: one span a rank, of the length of its heads
    src, dst = KVHeadShards(3, 2), KVHeadShards(3, 1)
    assert [reshard_pieces(src, dst, r) for r in range(2)] == [
        [HeadPiece(0, (0, 2), 0)],
        [HeadPiece(0, (0, 1), 2)],
    ]
    assert reshard_pieces(dst, src, 0) == [HeadPiece(0, (0, 2), 0), HeadPiece(1, (2, 3), 0)]


def test_tp_layout_refuses_head_counts_it_cannot_split():
    with pytest.raises(TPShardError, match="6 attention heads do not split over TP 4"):
        TPLayout(4, 0, num_heads=6, num_kv_heads=2)
    with pytest.raises(TPShardError, match="3 KV heads cannot be split over TP 4"):
        TPLayout(4, 0, num_heads=9, num_kv_heads=3)
    with pytest.raises(TPShardError, match="9 attention heads do not split over TP 6"):
        TPLayout(6, 0, num_heads=9, num_kv_heads=3)


def test_row_parallel_split_inside_a_quant_block_is_refused_naming_dequantize():
    layer = QuantLinear(quantize(torch.randn(8, 64), "Q4_0"), None)
    with pytest.raises(TPShardError, match="--dequantize"):
        _columns(layer, 16, 48, "w_down")
    local, _ = _columns(layer, 32, 64, "w_down")
    x = torch.randn(3, 64)
    torch.testing.assert_close(local(x[:, 32:]), x[:, 32:] @ _dequant_cols(layer, 32, 64).T)


def _dequant_cols(layer: QuantLinear, start: int, end: int) -> torch.Tensor:
    from kvmesh.shared.model.quant import dequantize

    return dequantize(layer.qweight)[:, start:end]


def test_kv_head_shards_replicate_heads_over_more_ranks_than_heads():
    shards = KVHeadShards(2, 8)
    assert [shards.heads(r) for r in range(8)] == [(0, 1)] * 4 + [(1, 2)] * 4
    assert [r for r in range(8) if shards.is_writer(r)] == [0, 4]
    assert KVHeadShards(8, 2).heads(1) == (4, 8)


def test_reshard_pieces_send_each_head_once_to_every_rank_holding_it():
    # 2 heads: TP4 (replicated) -> TP1: ranks 0 and 2 send, 1 and 3 hold copies
    src, dst = KVHeadShards(2, 4), KVHeadShards(2, 1)
    assert [reshard_pieces(src, dst, r) for r in range(4)] == [
        [HeadPiece(0, (0, 1), 0)],
        [],
        [HeadPiece(0, (0, 1), 1)],
        [],
    ]
    # TP1 -> TP4: the one rank sends head 0 to ranks 0, 1 and head 1 to ranks 2, 3
    assert reshard_pieces(dst, src, 0) == [
        HeadPiece(0, (0, 1), 0),
        HeadPiece(1, (0, 1), 0),
        HeadPiece(2, (1, 2), 0),
        HeadPiece(3, (1, 2), 0),
    ]
    # 8 heads, TP2 -> TP4: rank 1 (heads 4-7) feeds ranks 2 and 3
    assert reshard_pieces(KVHeadShards(8, 2), KVHeadShards(8, 4), 1) == [
        HeadPiece(2, (0, 2), 0),
        HeadPiece(3, (2, 4), 0),
    ]
    with pytest.raises(ValueError, match="not the same model"):
        reshard_pieces(KVHeadShards(2, 1), KVHeadShards(4, 1), 0)


def test_prefill_tp_refuses_what_one_rank_would_write():
    from kvmesh.services.prefill.config import PrefillConfig

    from kvmesh.commands.up_config import UpConfig

    with pytest.raises(ValueError, match="--tp > 1 runs without --draft-kv"):
        PrefillConfig(tp=2, draft_kv=True)
    with pytest.raises(ValueError, match="--prefill-tp > 1 needs --mode disagg"):
        UpConfig(prefill_tp=2, mode="colocated")
    with pytest.raises(ValueError, match="prefill_tp"):
        UpConfig(prefill_tp=0)


def test_tp_ranks_split_the_workers_cpus_and_threads_when_there_are_enough():
    from kvmesh.shared.engine.tp_ranks import cpu_shares, rank_threads

    assert cpu_shares([0, 1, 2, 3], 2) == [[0, 1], [2, 3]]
    assert cpu_shares([4, 5, 6], 3) == [[4], [5], [6]]
    assert cpu_shares([0], 2) == [[0], [0]]
    assert rank_threads(4, 4, 2) == 2  # --threads 4 at TP2: two a rank
    assert rank_threads(None, 6, 3) == 2  # default: one a CPU, shared out
    assert rank_threads(1, 1, 2) == 1  # never none


async def test_leader_announces_a_job_once_every_follower_reported_its_writes():
    from kvmesh.services.prefill.tp_follower import RankReport
    from kvmesh.services.prefill.tp_group import RankReports

    reports = RankReports(num_followers=2)
    reports.expect("a")
    reports.on_report(RankReport(1, "a"))
    reports.on_report(RankReport(2, "a"))
    assert await reports.wait("a", 5) == ""
    reports.expect("b")
    reports.on_report(RankReport(2, "b", "rank 2's KV write of chunk 0 failed: gone"))
    assert await reports.wait("b", 5) == "rank 2's KV write of chunk 0 failed: gone"
    reports.expect("c")
    reports.on_report(RankReport(1, "c"))
    assert await reports.wait("c", 0.05) == (
        "no word on the KV writes of tensor-parallel ranks [2] in 0.05 s"
    )
    reports.on_report(RankReport(1, "c"))  # a job no longer in hand: dropped
    with pytest.raises(KeyError):
        await reports.wait("c", 0.05)
