"""A prefill job's grammar compiles off the prefill worker's event loop and engine lock (issue 40):
while a slow schema compiles, another job on the same worker runs to its end; the slow one then
completes under its grammar, and one past ``grammar_compile_timeout_s`` fails alone."""

from __future__ import annotations

import asyncio
import threading

import msgspec
from kvmesh.shared.text.structured_output import StructuredOutputs
from support.prefill_rig import prefill_job, prefill_rig

SLOW = StructuredOutputs(choice=("yes", "no"))  # its compile waits for the test below
PROMPT = [(7 * i) % 250 + 1 for i in range(40)]


def held_engine(tiny):
    """An engine whose compile of SLOW waits until ``release`` is set (in its thread);
    ``started`` is set once it began."""
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine

    engine = LLMEngine(*tiny, EngineConfig(num_blocks=64, max_num_batched_tokens=32))
    book = engine.grammars
    compile_now = book.compile
    started, release = threading.Event(), threading.Event()

    def compile_held(spec):
        if spec == SLOW:
            started.set()
            release.wait(60)
        return compile_now(spec)

    book.compile = compile_held
    return engine, started, release


def job(worker, rid, region, blocks, spec=None):
    msg = prefill_job(worker, rid, PROMPT, region, blocks)
    if spec is None:
        return msg
    sampling = msgspec.structs.replace(msg.sampling, structured_outputs=spec)
    return msgspec.structs.replace(msg, sampling=sampling)


async def test_a_slow_grammar_does_not_stall_another_job(tiny) -> None:
    engine, started, release = held_engine(tiny)
    async with prefill_rig(engine, kv_spec="spec-a") as (worker, _decode, region, _remote):
        slow = asyncio.create_task(worker.prefill(job(worker, "slow", region, [0, 1, 2], SLOW)))
        await asyncio.to_thread(started.wait, 60)  # its compile runs, held
        plain = await worker.prefill(job(worker, "plain", region, [3, 4, 5]))
        assert plain.done.ok and plain.done.first_token >= 0
        assert not slow.done()  # still waiting for its grammar, the lock free all along
        release.set()
        result = await asyncio.wait_for(slow, 60)
        assert result.done.ok
        assert engine.tokenizer.decode([result.done.first_token]) in "yesno"  # its grammar's
        worker.close()


async def test_a_grammar_past_the_limit_fails_its_job_alone(tiny) -> None:
    engine, _started, release = held_engine(tiny)
    async with prefill_rig(engine, kv_spec="spec-a", grammar_compile_timeout_s=0.2) as rig:
        worker, _decode, region, _remote = rig
        slow = await worker.prefill(job(worker, "slow", region, [0, 1, 2], SLOW))
        assert not slow.done.ok and "--grammar-compile-timeout-s" in slow.done.error
        again = await worker.prefill(job(worker, "again", region, [0, 1, 2], SLOW))
        assert not again.done.ok and "took over" in again.done.error  # remembered, not compiled
        release.set()
        plain = await worker.prefill(job(worker, "plain", region, [3, 4, 5]))
        assert plain.done.ok
        worker.close()
