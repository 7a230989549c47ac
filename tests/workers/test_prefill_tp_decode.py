"""A prefill job for a tensor-parallel decode worker (docs/tp.md): the job names every decode
rank's blocks (rank 0's in its own fields, the others' in ``PrefillJob.ranks``), and the prefill
worker writes each rank its own KV heads of every chunk, straight into that rank's blocks.

In one process over a real tcp transport (no NATS): a TP1 prefill worker writes a prompt into
two "decode ranks" (two regions of half blocks) and, for reference, into whole blocks; each rank's
blocks hold exactly its half of the whole blocks. The pure parts: which ranks a TP prefill
leader writes to, the hand-off its followers get, the checks of a job against a TP advert."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import msgspec
import pytest
from kvmesh.services.prefill.adverts import UnvouchedJobError, check_job_against_advert
from kvmesh.services.prefill.kv_writes import job_rank_slices
from kvmesh.services.prefill.tp_group import TPWrites
from kvmesh.shared.bus.messages.placement import DecodeRankTarget
from kvmesh.shared.bus.messages.prefill_jobs import PrefillJob
from kvmesh.shared.engine.tp_ranks import group_backend, rank_device
from kvmesh.shared.kv.descriptor import TcpBackend, TransportDescriptor
from kvmesh.shared.kv.kv_cache import KVCacheSpec
from kvmesh.shared.text.sampling import SamplingOptions
from support.adverts import idle_advert, with_fields
from support.prefill_rig import prefill_job, prefill_rig, tp2_job

PROMPT = list(range(3, 67))  # 64 tokens: 4 whole blocks of 16, chunks of 32 at most
BLOCKS = [4, 9, 2, 6]


async def test_a_tp1_prefill_writes_each_tp2_decode_rank_its_heads(tiny) -> None:
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine
    from kvmesh.shared.transport import Access
    from support.transport_wire import remote as remote_key

    engine = LLMEngine(*tiny, EngineConfig(num_blocks=32, max_num_batched_tokens=32))
    spec = engine.kv_pool.spec
    assert spec.num_kv_heads == 2
    half = spec.block_bytes // 2
    async with prefill_rig(engine, kv_spec="s", remote_blocks=16) as (worker, side, region, mem):
        mem.zero_()
        ranks = []
        for _ in range(2):  # the decode worker's two ranks: each a pool of half blocks
            memory = side.allocate(16 * half)
            memory.zero_()
            ranks.append((remote_key(side, side.register(memory, Access.REMOTE_WRITE)), memory))
        addrs = [tuple(r.addr + b * half for b in BLOCKS) for r, _ in ranks]
        to_rank1 = (ranks[1][0].rkey, addrs[1], None)
        job = tp2_job(worker, side, ranks[0][0], spec, PROMPT, ranks[0][0].rkey, addrs[0], to_rank1)
        result = await worker.prefill(job)
        assert result is not None and result.done.ok and result.report is not None, result
        # several chunks, and each decode rank counts one write a chunk
        assert result.report.num_chunks > 1
        assert result.done.num_writes == result.report.num_chunks
        # the reference: the same prompt into whole blocks (its prefix cached now: same KV)
        ref = await worker.prefill(prefill_job(worker, "ref", PROMPT, region, BLOCKS))
        assert ref is not None and ref.done.ok
        assert result.done.first_token == ref.done.first_token
        for rank, (_, memory) in enumerate(ranks):
            for b in BLOCKS:
                whole = mem[b * spec.block_bytes : (b + 1) * spec.block_bytes]
                mine = memory[b * half : (b + 1) * half]
                assert bool(mine.any()), (rank, b)
                assert bool((mine == whole[rank * half : (rank + 1) * half]).all()), (rank, b)
            untouched = [b for b in range(16) if b not in BLOCKS]
            assert not any(bool(memory[b * half : (b + 1) * half].any()) for b in untouched)

        missing = msgspec.structs.replace(job, request_id="no-rank1", ranks=())
        refused = await worker.prefill(missing)
        assert refused is not None and not refused.done.ok
        assert "names 1 ranks' blocks but decode worker 'd1' runs at TP 2" in refused.done.error


async def test_a_tp1_prefill_writes_an_uneven_tp2_decode_each_rank_its_heads() -> None:
    """3 KV heads (SmolLM2-135M's count) at decode TP2: rank 0's blocks hold heads 0-1, rank
    1's head 2, a block a third of rank 0's (``DecodeRankTarget.block_bytes``); each gets its
    span of every whole block, and the writes' immediates name each rank's own slot."""
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine
    from kvmesh.shared.kv.imm import imm_slot, unpack_imm
    from kvmesh.shared.transport import Access
    from support.tp_ranks import uneven_model
    from support.transport_wire import remote as remote_key

    engine = LLMEngine(uneven_model(), None, EngineConfig(num_blocks=32, max_num_batched_tokens=32))
    spec = engine.kv_pool.spec
    assert spec.num_kv_heads == 3
    head = spec.head_bytes
    sizes = (2 * head, head)  # rank 0: heads 0-1, rank 1: head 2
    async with prefill_rig(engine, kv_spec="s", remote_blocks=16) as (worker, side, region, mem):
        mem.zero_()
        ranks = []
        for size in sizes:
            memory = side.allocate(16 * size)
            memory.zero_()
            ranks.append((remote_key(side, side.register(memory, Access.REMOTE_WRITE)), memory))
        addrs = [
            tuple(r.addr + b * size for b in BLOCKS)
            for (r, _), size in zip(ranks, sizes, strict=True)
        ]
        to_rank1 = (ranks[1][0].rkey, addrs[1], None)
        job = tp2_job(
            worker, side, ranks[0][0], spec, PROMPT, ranks[0][0].rkey, addrs[0], to_rank1, sizes
        )
        assert job.block_bytes == sizes[0] and job.ranks[0].block_bytes == sizes[1]
        result = await worker.prefill(job)
        assert result is not None and result.done.ok and result.report is not None, result
        n = result.done.num_writes  # a write a chunk to each rank
        completions = await asyncio.wait_for(_take(side, 2 * n), 60)
        by_slot: dict[int, int] = {}
        for c in completions:
            slot = unpack_imm(c.imm)[0]
            by_slot[slot] = by_slot.get(slot, 0) + c.num_bytes
        # each rank's writes name its own slot, and bring its heads' bytes of every block
        assert by_slot == {
            imm_slot(a[0], size): len(BLOCKS) * size for a, size in zip(addrs, sizes, strict=True)
        }
        ref = await worker.prefill(prefill_job(worker, "ref", PROMPT, region, BLOCKS))
        assert ref is not None and ref.done.ok
        starts = (0, 2 * head)
        for (_, memory), size, start in zip(ranks, sizes, starts, strict=True):
            for b in BLOCKS:
                whole = mem[b * spec.block_bytes : (b + 1) * spec.block_bytes]
                mine = memory[b * size : (b + 1) * size]
                assert bool(mine.any()) and bool((mine == whole[start : start + size]).all())
            untouched = [b for b in range(16) if b not in BLOCKS]
            assert not any(bool(memory[b * size : (b + 1) * size].any()) for b in untouched)


async def _take(transport: Any, n: int) -> list[Any]:
    out = []
    async for completion in transport.completions():
        out.append(completion)
        if len(out) == n:
            break
    return out


SPEC = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=8, block_size=16)


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "dst_ranks"),
    [(1, 2, [0, 1]), (2, 1, [0]), (2, 2, [0]), (1, 1, [0])],
)
def test_prefill_rank0_writes_decode_rank0_first_and_every_rank_its_heads_need(
    prefill_tp, decode_tp, dst_ranks
) -> None:
    num_kv_heads = 2
    spec = dataclasses.replace(SPEC, num_kv_heads=num_kv_heads // prefill_tp)
    slices = job_rank_slices(spec, num_kv_heads, prefill_tp, decode_tp)
    assert [s.dst_rank for s in slices] == dst_ranks
    bytes_per_rank = spec.head_bytes * num_kv_heads // max(prefill_tp, decode_tp)
    assert all(s.block_slice[2] == bytes_per_rank for s in slices)


def test_the_followers_hand_off_names_every_decode_rank_in_order() -> None:
    d0 = TransportDescriptor("d0", "h", (TcpBackend("127.0.0.1", 1, "ab" * 32),))
    d1 = TransportDescriptor("d0.rank1", "h", (TcpBackend("127.0.0.1", 2, "ab" * 32),))
    job = PrefillJob(
        "r", (1,), SamplingOptions(), "d0", "L", d0, 7, (64,), 32, 0.0,
        ranks=(DecodeRankTarget(8, (96,), d1),),
    )  # fmt: skip
    hand_off = TPWrites.note(job)
    assert [t.rkey for t in hand_off.targets] == [7, 8]
    assert [t.block_addrs for t in hand_off.targets] == [(64,), (96,)]
    assert msgspec.json.decode(hand_off.targets[1].descriptor, type=TransportDescriptor) == d1
    assert {t.block_bytes for t in hand_off.targets} == {32}
    # an uneven split's rank 1 says its own block size
    uneven = msgspec.structs.replace(job, ranks=(DecodeRankTarget(8, (96,), d1, 16),))
    assert [t.block_bytes for t in TPWrites.note(uneven).targets] == [32, 16]


def test_a_job_must_name_as_many_ranks_as_the_advert_says_each_with_its_blocks() -> None:
    d0 = TransportDescriptor("d0", "h", (TcpBackend("127.0.0.1", 1, "ab" * 32),))
    tp2 = idle_advert("d0", d0, block_bytes=32, block_size=16, kv_spec="s", total_blocks=4)
    tp2 = with_fields(tp2, tp=2)
    job = PrefillJob(
        "r", (1,), SamplingOptions(), "d0", "L", d0, 7, (64, 96), 32, 0.0,
        ranks=(DecodeRankTarget(8, (0, 32), d0),),
    )  # fmt: skip
    check_job_against_advert(job, tp2, "s")
    with pytest.raises(UnvouchedJobError, match=r"names 1 ranks' blocks but .* runs at TP 2"):
        check_job_against_advert(msgspec.structs.replace(job, ranks=()), tp2, "s")
    short = msgspec.structs.replace(job, ranks=(DecodeRankTarget(8, (0,), d0),))
    with pytest.raises(
        UnvouchedJobError, match="names 2 blocks but 1 on rank 1 of decode worker 'd0'"
    ):
        check_job_against_advert(short, tp2, "s")
    far = msgspec.structs.replace(job, ranks=(DecodeRankTarget(8, (0, 32 * 9), d0),))
    with pytest.raises(
        UnvouchedJobError, match="is not a block of rank 1 of decode worker 'd0''s pool"
    ):
        check_job_against_advert(far, tp2, "s")
    # an uneven split's rank 1 of 16-byte blocks: its blocks 16 bytes apart, at most rank 0's
    uneven = msgspec.structs.replace(job, ranks=(DecodeRankTarget(8, (0, 16), d0, 16),))
    check_job_against_advert(uneven, tp2, "s")
    big = msgspec.structs.replace(job, ranks=(DecodeRankTarget(8, (0, 64), d0, 64),))
    with pytest.raises(UnvouchedJobError, match="64-byte blocks, more than rank 0's 32"):
        check_job_against_advert(big, tp2, "s")


def test_the_ranks_of_a_cuda_worker_use_one_gpu_each_in_an_nccl_group():
    """kvmesh serve prefill|decode --tp N --device cuda: rank r on its own GPU, NCCL between them
    (tests/gpu/test_gpu_tp.py runs it on two GPUs)."""
    assert [rank_device("cuda", r) for r in range(2)] == ["cuda:0", "cuda:1"]
    assert rank_device("cuda:2", 1) == "cuda:3" and rank_device("cpu", 1) == "cpu"
    assert group_backend("cuda:1") == "nccl" and group_backend("cpu") == "gloo"
