"""KV write planning (services/prefill/kv_writes.py) and tensor-parallel resharding end to end.

Planning: entries, offsets, coalescing and refusals, checked on byte offsets and by applying the
entries with a plain memcpy. End to end: prefill ranks in separate processes write through the real
shm and tcp transports into decode pools guarded on both sides; the decode ranks end up holding
exactly their head slice of the unsharded KV (TP 2->1, 1->2; block size 4 -> 8 through staging).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
from typing import Any

import msgspec
import pytest
import torch
from kvmesh.kernels.kv_pack import reshard_plan
from kvmesh.services.decode.pending import PendingTable
from kvmesh.services.prefill.kv_writes import (
    KVDestination,
    KVLayoutError,
    KVWritePlan,
    PackStep,
    plan_kv_writes,
    rank_block_slices,
    run_packs,
    staging_bytes,
)
from kvmesh.services.prefill.plan import ChunkPlanner
from kvmesh.shared.bus.messages.prefill_jobs import PrefillDone
from kvmesh.shared.kv.head_shards import KVHeadShards
from kvmesh.shared.kv.imm import imm_slot, pack_imm, unpack_imm
from kvmesh.shared.kv.kv_cache import KVCacheSpec, KVPool
from kvmesh.shared.transport import (
    Access,
    LocalAccessError,
    MemoryRegion,
    Transport,
    TransportConfig,
    TransportDescriptor,
    WriteEntry,
    create_transport,
)
from support.transport_wire import remote

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(
    not INTERPRET, reason="packing CPU pools runs the Triton kernel under TRITON_INTERPRET=1"
)
GUARD = 0xAB
HEADS = 4  # total KV heads
CTX = mp.get_context("spawn")
CONFIG = {"tcp_lanes": 2, "tcp_slice_bytes": 4096, "tcp_window": 4}


def _spec(heads: int, block_size: int = 4, dtype: torch.dtype = torch.float32) -> KVCacheSpec:
    return KVCacheSpec(
        num_layers=2, num_kv_heads=heads, head_dim=8, block_size=block_size, dtype=dtype
    )


def _full_kv(
    seed: int, num_blocks: int, block_size: int, dtype: torch.dtype, heads: int = HEADS
) -> torch.Tensor:
    """The unsharded KV of ``num_blocks`` prefill blocks: (n, heads, L, 2, block_size, D)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn((num_blocks, heads, 2, 2, block_size, 8), generator=g).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()])


class Source:
    """A prefill rank's pool inside a larger registered buffer (the pool starts at ``lead``)."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, lead: int = 256, rkey: int = 7) -> None:
        self.mem = torch.zeros(lead + num_blocks * spec.block_bytes, dtype=torch.uint8)
        self.pool = KVPool(spec, num_blocks, buffer=self.mem[lead:])
        self.region = MemoryRegion(self.mem.data_ptr(), self.mem.numel(), rkey)
        self.lead = lead


class Decode:
    """A decode rank's pool with one guard block on either side, over ``mem``."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, mem: torch.Tensor | None = None) -> None:
        bb = spec.block_bytes
        self.mem = torch.empty((num_blocks + 2) * bb, dtype=torch.uint8) if mem is None else mem
        self.mem.fill_(GUARD)
        self.pool = KVPool(spec, num_blocks, buffer=self.mem[bb : bb + num_blocks * bb])
        self.pool.raw.zero_()
        self.bb = bb

    def guards_intact(self) -> bool:
        return bool((self.mem[: self.bb] == GUARD).all() and (self.mem[-self.bb :] == GUARD).all())

    def destination(self, rkey: int, block_ids: list[int]) -> KVDestination:
        addrs = tuple(self.pool.block_addr(b) for b in block_ids)
        return KVDestination(self.pool.spec, rkey, addrs)


def _apply(plan: KVWritePlan, local: dict[int, torch.Tensor], decodes: list[Decode]) -> None:
    """Carry out ``plan`` with memcpy, as a transport would: entry bytes land at remote_addr."""
    for rank, entries in enumerate(plan.writes):
        pool = decodes[rank].pool
        for e in entries:
            start = e.remote_addr - pool.base_addr
            assert 0 <= start <= pool.nbytes - e.length, "entry outside the decode pool"
            src = local[e.local.rkey][e.local_offset : e.local_offset + e.length]
            pool.raw[start : start + e.length] = src


def _shards(full: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """Each rank's heads of ``full`` (KVHeadShards: replicated over more ranks than heads,
    uneven runs when the ranks do not divide them)."""
    shards = KVHeadShards(full.shape[1], tp)
    return [full[:, slice(*shards.heads(r))] for r in range(tp)]


# --- planning: same layout, straight from the pool ------------------------------------------


def test_same_tp_writes_whole_blocks_and_coalesces_adjacent_runs():
    spec = _spec(HEADS)
    bb = spec.block_bytes
    src, dec = Source(spec, 8), Decode(spec, 10)

    plan = plan_kv_writes(src.pool, src.region, [2, 3, 7, 4], [dec.destination(9, [5, 6, 0, 1])])

    base = dec.pool.base_addr
    assert plan.packs == () and plan.staging is None
    assert plan.writes == (
        (
            WriteEntry(src.region, src.lead + 2 * bb, base + 5 * bb, 9, 2 * bb),
            WriteEntry(src.region, src.lead + 7 * bb, base, 9, bb),
            WriteEntry(src.region, src.lead + 4 * bb, base + bb, 9, bb),
        ),
    )
    assert plan.num_bytes == 4 * bb and plan.num_entries == 3


def test_tp_2_to_1_writes_each_block_as_one_head_slice_at_its_head_offset():
    src_spec, dst_spec = _spec(2), _spec(HEADS)
    hb = dst_spec.head_bytes
    assert src_spec.head_bytes == hb and src_spec.block_bytes == 2 * hb
    src, dec = Source(src_spec, 4), Decode(dst_spec, 4)

    plan = plan_kv_writes(
        src.pool, src.region, [0, 1], [dec.destination(5, [2, 3])], src_rank=1, src_tp=2
    )

    # rank 1 holds global heads 2, 3: its whole block lands at 2 * head_bytes in the decode block;
    # the source blocks are adjacent but the destination spans are not, so no coalescing
    base = dec.pool.base_addr
    assert plan.writes == (
        (
            WriteEntry(src.region, src.lead, base + 2 * dst_spec.block_bytes + 2 * hb, 5, 2 * hb),
            WriteEntry(
                src.region, src.lead + 2 * hb, base + 3 * dst_spec.block_bytes + 2 * hb, 5, 2 * hb
            ),
        ),
    )


def test_tp_1_to_2_sends_each_decode_rank_its_head_span_of_every_block():
    src_spec, dst_spec = _spec(HEADS), _spec(2)
    hb = src_spec.head_bytes
    src = Source(src_spec, 3)
    decs = [Decode(dst_spec, 3), Decode(dst_spec, 3)]

    plan = plan_kv_writes(
        src.pool,
        src.region,
        [1, 2],
        [decs[0].destination(11, [0, 1]), decs[1].destination(12, [2, 0])],
    )

    bb, dbb = src_spec.block_bytes, dst_spec.block_bytes
    b0, b1 = decs[0].pool.base_addr, decs[1].pool.base_addr
    # rank 0: heads 0-1 of block 1 then of block 2 -- adjacent remotely but not locally
    assert plan.writes[0] == (
        WriteEntry(src.region, src.lead + bb, b0, 11, 2 * hb),
        WriteEntry(src.region, src.lead + 2 * bb, b0 + dbb, 11, 2 * hb),
    )
    assert plan.writes[1] == (
        WriteEntry(src.region, src.lead + bb + 2 * hb, b1 + 2 * dbb, 12, 2 * hb),
        WriteEntry(src.region, src.lead + 2 * bb + 2 * hb, b1, 12, 2 * hb),
    )


def test_tp_4_to_2_leaves_the_other_decode_rank_without_entries():
    src, decs = Source(_spec(1), 2), [Decode(_spec(2), 2), Decode(_spec(2), 2)]
    dests = [decs[0].destination(1, [0, 1]), decs[1].destination(2, [0, 1])]
    hb = _spec(1).head_bytes

    plans = [
        plan_kv_writes(src.pool, src.region, [0, 1], dests, src_rank=r, src_tp=4) for r in range(4)
    ]

    assert [[len(w) for w in p.writes] for p in plans] == [[2, 0], [2, 0], [0, 2], [0, 2]]
    # rank 1 holds global head 1: head offset 1 in decode rank 0
    assert plans[1].writes[0][0].remote_addr == decs[0].pool.base_addr + hb
    assert plans[3].writes[1][1].remote_addr == decs[1].pool.base_addr + decs[1].bb + hb


# (KV heads, prefill TP, decode TP): 4 heads even or replicated; 3 heads (SmolLM2's) split
# unevenly: TP2 holds 2 + 1, TP6 replicates each twice
TP_PAIRS = [(4, 1, 1), (4, 2, 1), (4, 4, 2), (4, 1, 2), (4, 2, 4), (4, 1, 4), (4, 8, 1)]
TP_PAIRS += [(4, 1, 8), (4, 8, 2), (4, 2, 8), (3, 2, 1), (3, 1, 2), (3, 2, 3), (3, 3, 2), (3, 2, 6)]


@pytest.mark.parametrize(("heads", "src_tp", "dst_tp"), TP_PAIRS)
def test_applied_entries_rebuild_every_decode_shard_and_spare_the_rest(heads, src_tp, dst_tp):
    """TP 8 over 4 heads holds each head on two ranks: the first sends it, into every replica.
    An uneven split's ranks hold pools of different block sizes; each gets its own slice."""
    src_ids, dst_ids = [3, 0, 1, 5], [2, 3, 6, 0]
    full = _full_kv(src_tp * 10 + dst_tp, 6, 4, torch.float32, heads)
    src_shards, dst_shards = KVHeadShards(heads, src_tp), KVHeadShards(heads, dst_tp)
    sources = []
    for rank, shard in enumerate(_shards(full, src_tp)):
        s = Source(_spec(src_shards.num_heads(rank)), 6, rkey=100 + rank)
        s.pool.tensor.copy_(shard)
        sources.append(s)
    decs = [Decode(_spec(dst_shards.num_heads(r)), 8) for r in range(dst_tp)]
    dests = [d.destination(200 + r, dst_ids) for r, d in enumerate(decs)]

    head_bytes = _spec(1).head_bytes
    for rank, s in enumerate(sources):
        plan = plan_kv_writes(
            s.pool, s.region, src_ids, dests, src_rank=rank, src_tp=src_tp, num_kv_heads=heads
        )
        assert all(e.local == s.region for w in plan.writes for e in w)  # no staging copy
        # a rank sends its head slice of every block once per decode rank holding it, or nothing
        held = src_shards.num_heads(rank)
        sent = held * dst_shards.replicas if src_shards.is_writer(rank) else 0
        assert plan.num_bytes == len(src_ids) * sent * head_bytes
        _apply(plan, {s.region.rkey: s.mem}, decs)

    for d, shard in zip(decs, _shards(full, dst_tp), strict=True):
        assert torch.equal(_bits(d.pool.tensor[dst_ids]), _bits(shard[src_ids]))
        assert not d.pool.tensor[[1, 4, 5, 7]].any()
        assert d.guards_intact()


@pytest.mark.parametrize(
    ("heads", "src_tp", "dst_tp"),
    [(4, 2, 1), (4, 1, 2), (4, 4, 2), (4, 8, 2), (3, 2, 1), (3, 1, 2), (3, 2, 3)],
)
def test_chunk_planners_of_every_prefill_rank_fill_every_decode_rank_with_its_heads(
    heads, src_tp, dst_tp
):
    """The product's chunk planner (services/prefill/plan.py) given each rank's slices: two
    chunks of a 3-block prompt land as the unsharded KV, each rank sending its head slice, and
    each decode rank's write lease (the decode worker's PendingTable) is ready once every
    writer's write of every chunk has landed and one announcement says how many. 3 heads at TP2
    are 2 + 1: spans of different lengths, into decode blocks of different sizes."""
    src_ids, dst_ids = [4, 1, 2], [5, 0, 3]
    full = _full_kv(7 * src_tp + dst_tp, 6, 4, torch.float32, heads)
    src_shards, dst_shards = KVHeadShards(heads, src_tp), KVHeadShards(heads, dst_tp)
    decs = [Decode(_spec(dst_shards.num_heads(r)), 6) for r in range(dst_tp)]
    leases = [PendingTable() for _ in decs]
    for table, dec in zip(leases, decs, strict=True):
        table.add("r", "lease", imm_slot(dec.pool.block_addr(dst_ids[0]), dec.bb), (5,), 1e9)
    announced: dict[int, int] = {}
    for rank, shard in enumerate(_shards(full, src_tp)):
        spec = _spec(src_shards.num_heads(rank))
        pool = KVPool(spec, 6)
        pool.tensor.copy_(shard)
        slices = rank_block_slices(spec, src_shards, dst_shards, rank)
        # its head slice of a block, once per decode rank holding it; nothing from a replica
        sent = spec.block_bytes * dst_shards.replicas if src_shards.is_writer(rank) else 0
        assert sum(r.block_slice[2] for r in slices) == sent
        for rank_slice in slices:
            dec = decs[rank_slice.dst_rank]
            addrs = tuple(dec.pool.block_addr(b) for b in dst_ids)
            planner = ChunkPlanner(10, 4, spec.block_bytes, addrs, dec.bb, rank_slice)
            writes = (planner.plan(0, 8, (4, 1), False), planner.plan(1, 10, (2,), True))
            length = rank_slice.block_slice[2]
            assert [w.num_bytes for w in writes] == [2 * length, length]
            for write in writes:
                for span in write.spans:
                    start = span.remote_addr - dec.pool.base_addr
                    chunk = pool.raw[span.local_offset : span.local_offset + span.length]
                    dec.pool.raw[start : start + span.length] = chunk
                assert leases[rank_slice.dst_rank].on_immediate(*unpack_imm(write.imm)) is None
            announced[rank_slice.dst_rank] = planner.num_writes  # the same from every writer
    for table, num_writes in zip(leases, [announced[d] for d in range(dst_tp)], strict=True):
        done = PrefillDone("r", "lease", ok=True, first_token=1, num_writes=num_writes)
        verdict = table.on_done(done)
        assert verdict is not None and verdict.ok, verdict
    for d, shard in zip(decs, _shards(full, dst_tp), strict=True):
        assert torch.equal(_bits(d.pool.tensor[dst_ids]), _bits(shard[src_ids]))
        assert not d.pool.tensor[[1, 2, 4]].any() and d.guards_intact()


def test_empty_block_list_plans_no_entries():
    src, dec = Source(_spec(HEADS), 2), Decode(_spec(HEADS), 2)
    plan = plan_kv_writes(src.pool, src.region, [], [dec.destination(1, [])])
    assert plan.writes == ((),) and plan.num_bytes == 0


# --- planning: different block size, through staging ----------------------------------------


def test_block_size_change_packs_each_head_piece_into_staging_and_writes_from_it():
    src_spec, dst_spec = _spec(HEADS, block_size=4), _spec(2, block_size=8)
    src = Source(src_spec, 6)
    decs = [Decode(dst_spec, 4), Decode(dst_spec, 4)]
    dests = [decs[0].destination(1, [3, 1]), decs[1].destination(2, [0, 1])]
    need = staging_bytes(src_spec, 3, dests)
    hb8 = dst_spec.head_bytes  # one head of a decode block
    assert need == 2 * 2 * 2 * hb8  # 2 decode blocks x 2 pieces x 2 heads
    staging = MemoryRegion(0x7000_0000, need + 64, rkey=33)

    plan = plan_kv_writes(
        src.pool, src.region, [5, 0, 2], dests, staging=staging, staging_offset=32
    )

    assert plan.packs == (
        PackStep((5, 0, 2), (0, 2), 8, 32, 4 * hb8),
        PackStep((5, 0, 2), (2, 4), 8, 32 + 4 * hb8, 4 * hb8),
    )
    dbb = dst_spec.block_bytes
    b0, b1 = decs[0].pool.base_addr, decs[1].pool.base_addr
    assert plan.writes == (
        (
            WriteEntry(staging, 32, b0 + 3 * dbb, 1, 2 * hb8),
            WriteEntry(staging, 32 + 2 * hb8, b0 + dbb, 1, 2 * hb8),
        ),
        (WriteEntry(staging, 32 + 4 * hb8, b1, 2, 4 * hb8),),  # adjacent on both sides: merged
    )


def test_block_size_change_needs_a_big_enough_staging_region():
    src_spec, dst_spec = _spec(HEADS, block_size=8), _spec(HEADS, block_size=4)
    src, dec = Source(src_spec, 2), Decode(dst_spec, 4)
    dests = [dec.destination(1, [0, 1, 2, 3])]
    need = staging_bytes(src_spec, 2, dests)
    assert need == 2 * src_spec.block_bytes

    with pytest.raises(KVLayoutError, match=f"staging region of {need} bytes"):
        plan_kv_writes(src.pool, src.region, [0, 1], dests)
    small = MemoryRegion(0x1000, need, rkey=3)
    with pytest.raises(LocalAccessError, match=f"needs {need} bytes from offset 4"):
        plan_kv_writes(src.pool, src.region, [0, 1], dests, staging=small, staging_offset=4)
    with pytest.raises(ValueError, match="multiple of 4"):
        plan_kv_writes(src.pool, src.region, [0, 1], dests, staging=small, staging_offset=2)
    assert staging_bytes(src_spec, 2, [Decode(src_spec, 2).destination(1, [0, 1])]) == 0


@needs_interpreter
@pytest.mark.parametrize(
    ("src_bs", "dst_bs", "src_tp", "dst_tp", "heads"),
    [(4, 8, 2, 1, 4), (8, 4, 1, 2, 4), (4, 16, 1, 1, 4), (4, 8, 2, 1, 3), (8, 4, 1, 2, 3)],
)
def test_regrouped_writes_carry_the_token_run_into_decode_blocks(
    src_bs, dst_bs, src_tp, dst_tp, heads
):
    """3 heads: TP2's ranks hold 2 and 1, packed into staging pieces of those sizes."""
    dtype = torch.bfloat16
    src_ids = [4, 1, 2]
    num_tokens = len(src_ids) * src_bs
    n_dst = -(-num_tokens // dst_bs)
    dst_ids = [5, 0, 3, 2, 7, 6][:n_dst]
    full = _full_kv(src_bs + dst_bs, 5, src_bs, dtype, heads)
    src_shards, dst_shards = KVHeadShards(heads, src_tp), KVHeadShards(heads, dst_tp)
    decs = [Decode(_spec(dst_shards.num_heads(r), dst_bs, dtype), 8) for r in range(dst_tp)]
    dests = [d.destination(50 + r, dst_ids) for r, d in enumerate(decs)]

    for rank, shard in enumerate(_shards(full, src_tp)):
        s = Source(_spec(src_shards.num_heads(rank), src_bs, dtype), 5)
        s.pool.tensor.copy_(shard)
        kw = {"src_rank": rank, "src_tp": src_tp, "num_kv_heads": heads}
        need = staging_bytes(s.pool.spec, len(src_ids), dests, **kw)
        assert need == n_dst * src_shards.num_heads(rank) * decs[0].pool.spec.head_bytes
        mem = torch.full((need,), 0x5A, dtype=torch.uint8)
        region = MemoryRegion(mem.data_ptr(), need, rkey=9)
        plan = plan_kv_writes(s.pool, s.region, src_ids, dests, staging=region, **kw)
        run_packs(plan, s.pool, mem)
        _apply(plan, {9: mem}, decs)

    run = torch.cat(list(full[src_ids]), dim=3)  # (heads, L, 2, num_tokens, D)
    for d, shard in zip(decs, _shards(run.unsqueeze(0), dst_tp), strict=True):
        got = torch.cat(list(d.pool.tensor[dst_ids]), dim=3)
        assert torch.equal(_bits(got[:, :, :, :num_tokens]), _bits(shard[0]))
        assert not got[:, :, :, num_tokens:].any()  # a short last block goes with a zero tail
        assert not d.pool.tensor[[b for b in range(8) if b not in dst_ids]].any()
        assert d.guards_intact()


@needs_interpreter
def test_run_packs_refuses_memory_that_is_not_the_staging_region():
    src_spec, dst_spec = _spec(HEADS, block_size=4), _spec(HEADS, block_size=8)
    src, dec = Source(src_spec, 2), Decode(dst_spec, 1)
    dests = [dec.destination(1, [0])]
    mem = torch.zeros(staging_bytes(src_spec, 2, dests), dtype=torch.uint8)
    region = MemoryRegion(mem.data_ptr(), mem.numel(), rkey=2)
    plan = plan_kv_writes(src.pool, src.region, [0, 1], dests, staging=region)

    with pytest.raises(LocalAccessError, match="not the memory of the plan's staging region"):
        run_packs(plan, src.pool, mem.clone())
    with pytest.raises(ValueError, match="flat contiguous uint8"):
        run_packs(plan, src.pool, mem.view(torch.int32))


# --- planning: refusals -----------------------------------------------------------------------


def _plan_args(**overrides: Any) -> dict[str, Any]:
    src, dec = Source(_spec(2), 4), Decode(_spec(HEADS), 4)
    args = {
        "pool": src.pool,
        "pool_region": src.region,
        "block_ids": [0, 1],
        "destinations": [dec.destination(1, [2, 3])],
        "src_rank": 0,
        "src_tp": 2,
    }
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        (
            {
                "destinations": [
                    Decode(_spec(HEADS, dtype=torch.bfloat16), 2).destination(1, [0, 1])
                ]
            },
            KVLayoutError,
            "same KV dtype",
        ),
        (
            {"destinations": [KVDestination(KVCacheSpec(2, HEADS, 16, 4), 1, (0, 1))]},
            KVLayoutError,
            "not serve the same model",
        ),
        (
            {"destinations": [KVDestination(KVCacheSpec(3, HEADS, 8, 4), 1, (0, 1))]},
            KVLayoutError,
            "not serve the same model",
        ),
        (
            {"src_tp": 1},
            KVLayoutError,
            "decode rank 0 of TP 1 holds 2 of the model's 2 KV heads, but its KV layout has 4",
        ),
        (  # 3 heads at TP2 are 2 + 1: a second decode rank laid out as the first is refused
            {
                "src_tp": 1,
                "num_kv_heads": 3,
                "pool": KVPool(_spec(3), 4),
                "destinations": [KVDestination(_spec(2), 1, (0, 1))] * 2,
            },
            KVLayoutError,
            "decode rank 1 of TP 2 holds 1 of the model's 3 KV heads, but its KV layout has 2",
        ),
        (
            {
                "destinations": [
                    KVDestination(_spec(2), 1, (0, 1)),
                    KVDestination(_spec(2, block_size=8), 2, (0,)),
                ],
            },
            KVLayoutError,
            "decode TP ranks disagree",
        ),
        ({"destinations": []}, ValueError, "one KVDestination per decode TP rank"),
        ({"src_rank": 2}, ValueError, r"src_rank must be in \[0, src_tp=2\)"),
        ({"block_ids": [0, 4]}, ValueError, r"source block ids \[4\] are outside"),
        ({"block_ids": [0]}, ValueError, "fill 1 destination blocks .* gave 2 block addresses"),
        (
            {"pool_region": MemoryRegion(0x1000, 64, rkey=5)},
            LocalAccessError,
            "not inside its registered region",
        ),
    ],
)
def test_plan_refuses_layouts_and_arguments_it_cannot_bridge(overrides, error, match):
    with pytest.raises(error, match=match):
        plan_kv_writes(**_plan_args(**overrides))


# --- end to end through the real transports ---------------------------------------------------

E2E_DTYPE = torch.bfloat16
E2E_SRC_IDS = [1, 2, 5]  # of 6 prefill blocks
E2E_DST_BLOCKS = 8  # per decode rank


def _e2e_dst_ids(src_bs: int, dst_bs: int) -> list[int]:
    return [3, 4, 0, 6][: -(-len(E2E_SRC_IDS) * src_bs // dst_bs)]


def prefill_rank_main(
    backend: str, rank: int, src_tp: int, src_bs: int, seed: int, dests: list[dict], out: Any
) -> None:
    """One prefill rank: hold heads of the seeded unsharded KV, plan, pack if needed, write to
    every decode rank (one endpoint each) with imm (rank, 0)."""
    try:
        asyncio.run(_prefill_rank(backend, rank, src_tp, src_bs, seed, dests))
        out.put(("done", rank, ""))
    except BaseException as exc:
        out.put(("error", rank, repr(exc)))
        raise


async def _prefill_rank(
    backend: str, rank: int, src_tp: int, src_bs: int, seed: int, dests: list[dict]
) -> None:
    async with create_transport(backend, TransportConfig(**CONFIG)) as tx:
        spec = _spec(HEADS // src_tp, src_bs, E2E_DTYPE)
        pool = KVPool(spec, 6, buffer=tx.allocate(6 * spec.block_bytes))
        pool.tensor.copy_(_shards(_full_kv(seed, 6, src_bs, E2E_DTYPE), src_tp)[rank])
        pool_region = tx.register(pool.raw)
        peers = [msgspec.json.decode(d["peer"], type=TransportDescriptor) for d in dests]
        dst_spec = _spec(HEADS // len(dests), dests[0]["block_size"], E2E_DTYPE)
        destinations = [KVDestination(dst_spec, d["rkey"], tuple(d["addrs"])) for d in dests]
        need = staging_bytes(spec, len(E2E_SRC_IDS), destinations, src_rank=rank, src_tp=src_tp)
        staging_mem = tx.allocate(need) if need else None
        staging = tx.register(staging_mem) if staging_mem is not None else None
        plan = plan_kv_writes(
            pool,
            pool_region,
            E2E_SRC_IDS,
            destinations,
            src_rank=rank,
            src_tp=src_tp,
            staging=staging,
        )
        if staging_mem is not None:
            run_packs(plan, pool, staging_mem)

        async def write(peer: TransportDescriptor, entries: tuple[WriteEntry, ...]) -> None:
            async with await tx.connect(peer) as ep:
                await ep.write(entries, pack_imm(rank, 0))

        # one batched write per decode rank holding some of this rank's heads, concurrently
        await asyncio.gather(*(write(p, e) for p, e in zip(peers, plan.writes, strict=True) if e))


async def _run_prefill_ranks(
    backend: str, src_tp: int, src_bs: int, seed: int, dests: list[dict]
) -> list[Any]:
    out = CTX.Queue()
    procs = [
        CTX.Process(target=prefill_rank_main, args=(backend, r, src_tp, src_bs, seed, dests, out))
        for r in range(src_tp)
    ]
    for p in procs:
        p.start()
    try:
        return [await asyncio.to_thread(out.get, True, 120) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def _decode_rank(rx: Transport, dst_tp: int, dst_bs: int) -> tuple[Decode, MemoryRegion]:
    spec = _spec(HEADS // dst_tp, dst_bs, E2E_DTYPE)
    dec = Decode(spec, E2E_DST_BLOCKS, mem=rx.allocate((E2E_DST_BLOCKS + 2) * spec.block_bytes))
    return dec, remote(rx, rx.register(dec.pool.raw, Access.REMOTE_WRITE))


async def _reshard_end_to_end(
    backend: str, src_tp: int, dst_tp: int, src_bs: int = 4, dst_bs: int = 4
) -> None:
    seed = 17 * src_tp + dst_tp + src_bs
    dst_ids = _e2e_dst_ids(src_bs, dst_bs)
    cfg = TransportConfig(**CONFIG)
    async with contextlib.AsyncExitStack() as stack:
        receivers = [
            await stack.enter_async_context(create_transport(backend, cfg)) for _ in range(dst_tp)
        ]
        ranks = [_decode_rank(rx, dst_tp, dst_bs) for rx in receivers]
        dests = [
            {
                "peer": msgspec.json.encode(rx.descriptor()),  # as over NATS
                "rkey": region.rkey,
                "addrs": [dec.pool.block_addr(b) for b in dst_ids],
                "block_size": dst_bs,
            }
            for rx, (dec, region) in zip(receivers, ranks, strict=True)
        ]
        results = await _run_prefill_ranks(backend, src_tp, src_bs, seed, dests)
        assert sorted(results) == [("done", r, "") for r in range(src_tp)]

        # each decode rank gets one completion from every prefill rank holding some of its heads
        plan = reshard_plan(HEADS, src_tp, dst_tp)
        for d, rx in enumerate(receivers):
            senders = [r for r, pieces in enumerate(plan) if any(p.dst_rank == d for p in pieces)]
            imms = [(await asyncio.wait_for(rx.completion_queue.get(), 30)).imm for _ in senders]
            assert sorted(imms) == [pack_imm(r, 0) for r in senders]
            assert rx.completion_queue.get_nowait() is None
            assert rx.stats().refused == 0

        full = _full_kv(seed, 6, src_bs, E2E_DTYPE)
        num_tokens = len(E2E_SRC_IDS) * src_bs
        run = torch.cat(list(full[E2E_SRC_IDS]), dim=3).unsqueeze(0)  # (1, HEADS, L, 2, tokens, D)
        for (dec, _), shard in zip(ranks, _shards(run, dst_tp), strict=True):
            got = torch.cat(list(dec.pool.tensor[dst_ids]), dim=3)
            assert torch.equal(_bits(got[:, :, :, :num_tokens]), _bits(shard[0]))
            assert not got[:, :, :, num_tokens:].any()
            untouched = [b for b in range(E2E_DST_BLOCKS) if b not in dst_ids]
            assert not dec.pool.tensor[untouched].any()
            assert dec.guards_intact()


@pytest.mark.parametrize("backend", ["shm", "tcp"])
async def test_two_prefill_ranks_reshard_into_one_decode_pool(backend: str) -> None:
    await _reshard_end_to_end(backend, src_tp=2, dst_tp=1)


@pytest.mark.parametrize("backend", ["shm", "tcp"])
async def test_one_prefill_rank_reshards_into_two_decode_pools(backend: str) -> None:
    await _reshard_end_to_end(backend, src_tp=1, dst_tp=2)


@needs_interpreter
@pytest.mark.parametrize("backend", ["shm", "tcp"])
async def test_two_prefill_ranks_regroup_blocks_of_4_into_decode_blocks_of_8(backend: str) -> None:
    await _reshard_end_to_end(backend, src_tp=2, dst_tp=1, src_bs=4, dst_bs=8)
