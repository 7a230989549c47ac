"""Grammars compiled off the decode worker's event loop (issue 40): a schema whose compile runs
past ``grammar_compile_timeout_s`` fails that request only, while another request on the same
worker completes and the heartbeat's ``load()`` answers; a spec that failed is refused again
without compiling; a compile that only waited behind others is refused as busy, not remembered."""

from __future__ import annotations

import asyncio
import time

import pytest
from kvmesh.services.decode.worker import DecodeWorker
from kvmesh.shared.bus.messages.placement import ReserveRequest
from kvmesh.shared.bus.messages.token_streams import TokenEvent
from kvmesh.shared.engine.grammar_compile import GrammarCompiles
from kvmesh.shared.text.sampling import SamplingOptions
from kvmesh.shared.text.structured_output import StructuredOutputError, StructuredOutputs

SLOW = StructuredOutputs(regex="[0-9]{2}")  # its compile is made slow below
FAST = StructuredOutputs(choice=("yes", "no"))
BROKEN = StructuredOutputs(regex="[a-")


def slow_worker(tiny, timeout_s: float, slow_s: float) -> DecodeWorker:
    """A colocated worker whose compile of SLOW sleeps ``slow_s`` first (in its thread)."""
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine

    engine = LLMEngine(*tiny, EngineConfig(num_blocks=64))
    book = engine.grammars
    compile_now = book.compile

    def compile_slowly(spec):
        worker.compiled.append(spec)
        if spec == SLOW:
            time.sleep(slow_s)
        return compile_now(spec)

    book.compile = compile_slowly
    worker = DecodeWorker(
        engine,
        worker_id="d0",
        base_addr=engine.kv_pool.base_addr,
        colocated=True,
        grammar_compile_timeout_s=timeout_s,
    )
    worker.compiled = []  # the specs compiles were started for
    return worker


def request(rid: str, spec: StructuredOutputs | None, max_tokens: int = 6):
    opts = SamplingOptions(max_tokens=max_tokens, temperature=0.0, structured_outputs=spec)
    return ReserveRequest(rid, (1, 2, 3, 4), opts, True, "L" + rid, 1000)


async def drive(worker: DecodeWorker, timeout_s: float = 20.0) -> dict[str, list]:
    """Every request's events until the worker is idle; waits for work as the service does."""
    events: dict[str, list] = {}
    deadline = time.monotonic() + timeout_s
    while not worker.is_idle:
        assert time.monotonic() < deadline, "the worker was still busy"
        for event in [*await worker.admit(), *await worker.step()]:
            events.setdefault(event.request_id, []).append(event)
        if not worker.has_unfinished and not worker.is_idle:
            await asyncio.wait_for(worker.wait_for_work(), timeout_s)  # a compile to end
    return events


def final(events: list) -> TokenEvent:
    assert events[-1].finish_reason is not None
    return events[-1]


async def test_a_compile_past_the_limit_fails_that_request_only_while_another_completes(tiny):
    worker = slow_worker(tiny, timeout_s=0.3, slow_s=2.0)
    for rid, spec in (("slow", SLOW), ("plain", None), ("fast", FAST)):
        assert (await worker.reserve(request(rid, spec))).ok
    await worker.admit()  # the compiles start in their threads; this returns at once
    load, _ = await asyncio.wait_for(worker.load(), 0.2)  # the heartbeat is not held
    assert load.num_waiting >= 1  # the slow one, accepted, waits for its grammar
    events = await drive(worker)
    slow = final(events["slow"])
    assert slow.finish_reason == "error" and "--grammar-compile-timeout-s" in slow.error
    assert final(events["plain"]).finish_reason == "length"
    assert final(events["fast"]).finish_reason == "stop", final(events["fast"]).error
    text = bytes(t for e in events["fast"] for t in e.token_ids if t < 256).decode()
    assert text in ("yes", "no")
    worker.close()


async def test_a_spec_that_failed_is_refused_again_without_compiling(tiny):
    worker = slow_worker(tiny, timeout_s=0.3, slow_s=1.0)
    for rid, spec in (("slow", SLOW), ("broken", BROKEN)):
        assert (await worker.reserve(request(rid, spec))).ok
    first = await drive(worker)
    assert sorted(map(str, worker.compiled)) == sorted(map(str, (SLOW, BROKEN)))
    for rid, spec in (("slow-again", SLOW), ("broken-again", BROKEN)):
        assert (await worker.reserve(request(rid, spec))).ok
    again = await drive(worker)
    assert len(worker.compiled) == 2  # neither was compiled again
    assert final(again["slow-again"]).error.endswith(final(first["slow"]).error.split(": ", 1)[1])
    assert "Unclosed '['" in final(again["broken-again"]).error
    worker.close()


def test_a_compile_that_only_waited_behind_another_is_busy_and_not_remembered(tiny):
    from kvmesh.shared.engine.grammar import GrammarBook

    model, tok = tiny
    book = GrammarBook(tok, model.config.vocab_size, frozenset(model.config.eos_token_ids))
    compile_now = book.compile
    book.compile = lambda spec: (time.sleep(1.0) if spec == SLOW else None, compile_now(spec))[1]
    compiles = GrammarCompiles(book, 0.2, lambda: None, max_threads=1)
    compiles.start(SLOW)
    time.sleep(0.05)  # SLOW holds the only thread
    compiles.start(FAST)
    assert not compiles.ready(FAST) and not compiles.ready(SLOW)
    time.sleep(0.3)
    with pytest.raises(StructuredOutputError, match="busy"):
        compiles.ready(FAST)
    with pytest.raises(StructuredOutputError, match=r"took over 0\.2 s"):
        compiles.ready(SLOW)
    assert book.failure(FAST) is None and book.failure(SLOW) is not None
    time.sleep(0.9)  # SLOW's thread is free again: FAST compiles when asked anew
    compiles.start(FAST)
    deadline = time.monotonic() + 5
    while not compiles.ready(FAST):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert book.is_compiled(FAST)
    compiles.close()
