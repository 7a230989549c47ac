import asyncio

import pytest
import torch
from kvmesh.services.prefill.job_hooks import JobHook
from kvmesh.services.prefill.plan import (
    ChunkPlanner,
    KVSpecMismatchError,
    PlanError,
    PrefillTimeline,
    WriteSpan,
)
from kvmesh.shared.bus.messages.prefill_jobs import PrefillDone
from kvmesh.shared.kv.imm import imm_slot, unpack_imm
from support.prefill_rig import prefill_job, prefill_rig, ready_advert

BS, BB = 16, 1024  # block size in tokens, block bytes
BASE = 0x10_0000


def _remote(block_ids):
    return tuple(BASE + b * BB for b in block_ids)


def test_chunks_map_prompt_blocks_in_order_and_merge_adjacent_runs():
    # 70 tokens -> 5 blocks; decode reserved blocks 3,4,5,9,10
    planner = ChunkPlanner(70, BS, BB, _remote([3, 4, 5, 9, 10]), BB)
    w0 = planner.plan(0, 32, (7, 8), is_last=False)
    assert w0.spans == (WriteSpan(7 * BB, BASE + 3 * BB, 2 * BB),)
    w1 = planner.plan(1, 64, (2, 9), is_last=False)  # local not adjacent: two spans
    assert w1.spans == (WriteSpan(2 * BB, BASE + 5 * BB, BB), WriteSpan(9 * BB, BASE + 9 * BB, BB))
    w2 = planner.plan(2, 70, (10,), is_last=True)  # the partial last block goes whole
    assert w2.spans == (WriteSpan(10 * BB, BASE + 10 * BB, BB),) and w2.is_last
    assert [w.num_bytes for w in (w0, w1, w2)] == [2 * BB, 2 * BB, BB]


def test_immediate_carries_slot_of_first_reserved_block_and_chunk():
    planner = ChunkPlanner(40, BS, BB, _remote([6, 7, 8]), BB)
    planner.plan(0, 32, (0, 1), is_last=False)
    write = planner.plan(1, 40, (2,), is_last=True)
    assert unpack_imm(write.imm) == (imm_slot(BASE + 6 * BB, BB), 1)


def test_block_size_mismatch_is_a_kv_spec_error():
    with pytest.raises(KVSpecMismatchError, match="same model, dtype and block size"):
        ChunkPlanner(16, BS, BB, _remote([0]), 2 * BB)


def test_wrong_number_of_reserved_blocks_is_refused():
    with pytest.raises(PlanError, match=r"3 blocks of 16.*2 decode blocks"):
        ChunkPlanner(33, BS, BB, _remote([0, 1]), BB)


def test_out_of_order_or_inconsistent_chunks_are_refused():
    planner = ChunkPlanner(64, BS, BB, _remote([0, 1, 2, 3]), BB)
    with pytest.raises(PlanError, match="expected 0"):
        planner.plan(1, 32, (0, 1), is_last=False)
    with pytest.raises(PlanError, match="brings 1 blocks"):
        planner.plan(0, 32, (0,), is_last=False)
    planner.plan(0, 32, (0, 1), is_last=False)
    with pytest.raises(PlanError, match="prompt has 64"):
        planner.plan(1, 48, (2,), is_last=True)


def test_prefix_hit_first_chunk_may_cover_more_blocks():
    planner = ChunkPlanner(64, BS, BB, _remote([0, 1, 2, 3]), BB)
    write = planner.plan(0, 48, (5, 6, 7), is_last=False)
    assert write.num_bytes == 3 * BB
    assert planner.plan(1, 64, (1,), is_last=True).num_bytes == BB


def test_timeline_exposed_transfer_is_what_outlasts_compute():
    tl = PrefillTimeline(enqueued_at=10.0, started_at=10.5)
    tl.on_forward(1.0)  # chunk 0: 10.5 .. 11.5
    tl.on_write(11.5, 11.8)  # hidden behind chunk 1
    tl.on_forward(1.0)  # chunk 1: 11.5 .. 12.5
    tl.on_compute_done(12.5)
    tl.on_write(12.5, 12.75)
    t = tl.timing()
    assert t.queue_s == pytest.approx(0.5)
    assert t.compute_s == pytest.approx(2.0)
    assert t.transfer_s == pytest.approx(0.55)
    assert t.exposed_transfer_s == pytest.approx(0.25)
    assert t.num_chunks == 2


def test_timeline_counts_slow_earlier_write_as_exposed():
    tl = PrefillTimeline(enqueued_at=0.0, started_at=0.0)
    tl.on_forward(1.0)
    tl.on_write(1.0, 3.0)  # outlasts the next forward pass
    tl.on_forward(1.0)
    tl.on_compute_done(2.0)
    tl.on_write(2.0, 2.1)
    assert tl.timing().exposed_transfer_s == pytest.approx(1.0)


def test_timeline_queue_time_is_never_negative():
    # clocks of two hosts may disagree a little
    assert PrefillTimeline(enqueued_at=5.0, started_at=4.9).timing().queue_s == 0.0


# ---- PrefillWorker: engine + real tcp transport into a "decode" region, no NATS --------------


def _prefill_setup(tiny, num_remote_blocks=64, hooks=(), lock=None):
    """(worker, decode transport, region, memory): a prefill worker on kvmesh-tiny writing into
    ``num_remote_blocks`` decode blocks."""
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine

    engine = LLMEngine(*tiny, EngineConfig(num_blocks=64, max_num_batched_tokens=32))
    return prefill_rig(
        engine, kv_spec="spec-a", remote_blocks=num_remote_blocks, hooks=hooks, lock=lock
    )


async def test_prefill_worker_writes_each_chunk_into_the_reserved_blocks(tiny):
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine
    from kvmesh.shared.text.sampling import SamplingOptions

    prompt = [(7 * i) % 250 + 1 for i in range(60)]  # 4 blocks, chunks of 32 + 16 + 12 tokens
    targets = [9, 3, 4, 10]
    async with _prefill_setup(tiny) as (worker, decode_side, region, remote):
        bb = worker.block_bytes
        result = await worker.prefill(prefill_job(worker, "r", prompt, region, targets))
        done, report = result.done, result.report
        assert done.ok and done.num_writes == 3 and done.first_token >= 0
        assert done.request_id == "r" and done.lease_id == "Lr" and done.rkey == region.rkey
        assert report.num_chunks == 3 and report.transfer_s > 0 and report.compute_s > 0
        completions = [await decode_side.completion_queue.get() for _ in range(3)]
        slot = imm_slot(region.addr + targets[0] * bb, bb)
        assert sorted(unpack_imm(c.imm) for c in completions) == [(slot, 0), (slot, 1), (slot, 2)]
        assert not worker.engine.seqs and worker.engine.block_manager.num_free_blocks == 64
        remote = remote.clone()  # transport memory goes away with the transport

    # the KV the decode worker got is the KV an engine computes for the prompt
    ref = LLMEngine(*tiny, EngineConfig(num_blocks=8))
    chunks = []
    ref.add_request(
        "x", prompt, SamplingOptions(temperature=0.0), prefill_only=True, on_chunk=chunks.append
    )
    while ref.has_unfinished():
        ref.step()
    ref_blocks = [b for c in chunks for b in c.block_ids]
    shape = ref.kv_pool.spec.block_shape()  # (L, 2, block_size, H_kv, D)
    got = remote.view(ref.kv_pool.spec.dtype).view(-1, *shape)
    for i, (target, source) in enumerate(zip(targets, ref_blocks, strict=True)):
        valid = min(16, len(prompt) - 16 * i)
        assert torch.allclose(
            got[target][:, :, :valid], ref.kv_pool.tensor[source][:, :, :valid], atol=1e-4
        )


async def test_prefill_worker_refuses_decode_worker_with_other_kv_spec(tiny):
    async with _prefill_setup(tiny) as (worker, _, region, _):
        spec = worker.engine.kv_pool.spec
        descriptor = worker.adverts.get("d0").reach.descriptor
        worker.adverts.note(ready_advert(descriptor, region, spec, "spec-b"))
        job = prefill_job(worker, "r", range(1, 20), region, [0, 1])
        result = await worker.prefill(job)
        done = result.done
        assert not done.ok and "KV spec mismatch" in done.error and done.num_writes == 0
        assert result.report is None  # refused before it started: the router hears nothing


async def test_prefill_worker_stops_between_chunks_on_abort(tiny):
    prompt = [(3 * i) % 250 + 1 for i in range(640)]  # 20 chunks
    async with _prefill_setup(tiny) as (worker, decode_side, region, _):
        job = asyncio.create_task(
            worker.prefill(prefill_job(worker, "r", prompt, region, range(40)))
        )
        await decode_side.completion_queue.get()  # the first chunk has landed
        await worker.abort("r", "client disconnected")
        done = (await asyncio.wait_for(job, 30)).done
        assert not done.ok and "client disconnected" in done.error
        assert 1 <= done.num_writes < 20
        assert not worker.engine.seqs and worker.engine.block_manager.num_free_blocks == 64


async def test_prefill_worker_answers_a_job_aborted_before_it_arrived(tiny):
    async with _prefill_setup(tiny) as (worker, _, region, _):
        await worker.abort("r", "client disconnected")
        job = prefill_job(worker, "r", range(1, 40), region, [0, 1, 2])
        done = (await worker.prefill(job)).done
        assert not done.ok and "aborted before prefill started" in done.error


def test_prefill_config_from_env_and_its_checks():
    from kvmesh.services.prefill.config import PrefillConfig
    from kvmesh.shared.config.service_config import ConfigError, config_from_args

    config = config_from_args(
        PrefillConfig, None, {"KVMESH_CHUNK_TOKENS": "32", "KVMESH_TRANSPORT": "shm"}
    )
    assert (config.chunk_tokens, config.transport) == (32, "shm")
    with pytest.raises(ConfigError, match="at least one block"):
        config_from_args(PrefillConfig, None, {"KVMESH_CHUNK_TOKENS": "8"})
    with pytest.raises(ConfigError, match="--transport rdma"):
        config_from_args(
            PrefillConfig, None, {"KVMESH_DEVICE": "cuda:0", "KVMESH_TRANSPORT": "shm"}
        )


async def test_prefill_worker_returns_nothing_for_a_duplicate_of_a_job_in_hand(tiny):
    prompt = [(5 * i) % 250 + 1 for i in range(640)]  # 20 chunks: still running when re-sent
    async with _prefill_setup(tiny) as (worker, decode_side, region, _):
        job = prefill_job(worker, "r", prompt, region, range(40))
        started = worker.started(job)
        assert (started.request_id, started.lease_id, started.worker_id) == ("r", "Lr", "p0")
        first = asyncio.create_task(worker.prefill(job))
        await decode_side.completion_queue.get()  # the first chunk has landed: the job is in hand
        assert await worker.prefill(job) is None  # a redelivery: nothing to announce
        await worker.abort("r", "test over")
        done = (await asyncio.wait_for(first, 30)).done
        assert not done.ok and "test over" in done.error
        assert worker.num_jobs == 0 and worker.engine.block_manager.num_free_blocks == 64


class _RecordingHook(JobHook):
    """A feature added to the prefill worker the way job_hooks.py says: its own class and the
    composition (here the test's), no edit of worker.py. It records each call (and, for the
    two the worker makes under the engine lock, that the lock is held), and announces to a
    worker of its own at the end."""

    def __init__(self, lock: asyncio.Lock) -> None:
        self.lock = lock
        self.calls: list[str] = []
        self.steps = 0

    def _note(self, name: str, *, locked: bool = False) -> None:
        assert self.lock.locked() or not locked, f"{name}: the engine lock is not held"
        self.calls.append(name)

    def on_received(self, msg):
        self._note("received")

    async def prepare(self, job):
        self._note("prepare")
        assert not self.lock.locked()  # free to wait on I/O

    def before_add(self, job):
        self._note("before add", locked=True)

    def admit(self, job, prompt):
        self._note("admit", locked=True)  # with the prompt in the engine

    def has_work(self):
        return False

    async def step(self):
        self.steps += 1  # after each target step

    def start(self, job, tg):
        self._note("start")

    async def on_chunk(self, job, chunk, tg):
        self._note(f"chunk {chunk.chunk_index}")

    async def on_computed(self, job):
        self._note("computed")

    async def on_stop(self, job):
        self._note("stop")

    def on_end(self, job):
        self._note("end", locked=True)  # with the job's blocks released

    def finish(self, msg, job, ok, error):
        self._note(f"finish ok={ok}")
        return ("w-1", PrefillDone(msg.request_id, msg.lease_id, ok, rkey=7))


async def test_a_job_hook_sees_each_jobs_life_in_order_and_its_announcement_comes_back(tiny):
    lock = asyncio.Lock()
    hook = _RecordingHook(lock)
    prompt = [(7 * i) % 250 + 1 for i in range(60)]  # chunks of 32 + 16 + 12 tokens
    async with _prefill_setup(tiny, hooks=[hook], lock=lock) as (worker, _, region, _):
        result = await worker.prefill(prefill_job(worker, "r", prompt, region, range(4)))
    assert result.done.ok
    assert hook.calls == [
        "received",
        "prepare",
        "before add",
        "admit",
        "start",
        "chunk 0",
        "chunk 1",
        "chunk 2",
        "computed",
        "end",
        "finish ok=True",
    ]
    assert hook.steps >= 3  # once after each target step
    worker_id, announced = result.draft_done
    assert worker_id == "w-1" and announced.request_id == "r" and announced.rkey == 7


async def test_a_job_hook_hears_a_stopped_job_and_a_refused_one(tiny):
    lock = asyncio.Lock()
    hook = _RecordingHook(lock)
    prompt = [(5 * i) % 250 + 1 for i in range(60)]
    async with _prefill_setup(tiny, hooks=[hook], lock=lock) as (worker, _, region, _):
        job = prefill_job(worker, "r", prompt, region, range(4))
        running = asyncio.create_task(worker.prefill(job))
        while "start" not in hook.calls:
            await asyncio.sleep(0)
        await worker.abort("r", "the client went away")
        result = await running
        assert not result.done.ok and "client went away" in result.done.error
        assert "stop" in hook.calls and hook.calls[-2:] == ["end", "finish ok=False"]
        hook.calls.clear()
        unknown = prefill_job(worker, "q", prompt, region, range(4), descriptor="nobody")
        refused = await worker.prefill(unknown)  # a decode worker it has no advert of
        assert not refused.done.ok and hook.calls == ["received", "finish ok=False"]
