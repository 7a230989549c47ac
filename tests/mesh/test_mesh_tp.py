"""Meshes whose workers run tensor-parallel (docs/tp.md): two rank processes that appear as one
worker. `kvmesh up --prefill-tp 2`: each prefill rank writes its own KV head of every chunk to
the TP1 decode worker (speculating with the draft service: `--draft ngram`, its drafts never
waited for, so whether any is verified is up to timing); `kvmesh up --prefill-tp 2
--decode-tp 2`: each prefill rank writes the decode rank holding its head, and the decode worker
admits a request once both ranks' writes are in, its ranks then decoding together. Either way the greedy answers are TP1's offline ones (in
2 -> 2 a structured output's too, its grammar on every rank of both workers), every block comes
back, and killing the follower rank takes the whole worker down: in 2 -> 1 mid-prefill (the
request then answered as TP1 by its retry), in 2 -> 2 idle. (1 -> 2 is the same decode side
with one prefill writing both ranks: tests/workers/test_decode_tp.py and tests/workers/test_prefill_tp_decode.py
run it worker to worker, tests/model/test_tensor_parallel.py engine to engine.) Last, a
colocated worker's TP2 rank group without NATS: TP1's answers, the follower gone with it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
from pathlib import Path

import aiohttp
import pytest

from kvmesh.testing.mesh import MeshTap, complete, launched, mesh_config, wait_blocks_returned
from kvmesh.testing.offline import offline_greedy

pytestmark = pytest.mark.slow

# chunks of 32 tokens: a 70-token prompt is three writes from each rank
ENV = {"KVMESH_CHUNK_TOKENS": "32", "KVMESH_BLOCK_SIZE": "16", "KVMESH_NUM_BLOCKS": "512"}
PROMPTS = [list(range(40, 110)), [7, 260, 65, 66, 67, 200, 9, 30, 31, 32] * 3]
MAX_TOKENS = 6
REGEX = "[0-9]{3}-[a-z]{2}"  # a structured output's grammar (guided_regex)
REGEX_PROMPT = [11, 250, 90, 12, 13, 70, 71, 72] * 3  # no prefix cached: prefilled remotely
KILL_PROMPT = [5, 180, 33, 34, 35, 120, 8] * 6  # asked as a rank dies: no prefix of it cached


def _follower_pids(pid: int) -> list[int]:
    """A TP worker's rank processes: its children started by multiprocessing's spawn."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    return [c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


async def _ask(launcher, regex: bool = False) -> list[list[int]]:
    """Each prompt's tokens, as its token subject carried them; each prefilled remotely.
    ``regex``: REGEX_PROMPT's completion under REGEX too (greedy, to its end)."""
    async with (
        MeshTap(launcher.config.nats_url, launcher.nats_auth) as tap,
        aiohttp.ClientSession() as session,
    ):
        asks = [{"max_tokens": MAX_TOKENS, "ignore_eos": True} for _ in PROMPTS]
        prompts = [*PROMPTS, REGEX_PROMPT] if regex else PROMPTS
        asks += [{"max_tokens": 16, "guided_regex": REGEX}] if regex else []
        tokens = []
        for prompt, ask in zip(prompts, asks, strict=True):
            body = await complete(session, launcher.url, prompt, **ask)
            await tap.wait_finished(body["id"])
            assert body["id"] in tap.prefill_done, body["id"]
            tokens.append(tap.tokens[body["id"]])
            if "guided_regex" in ask:
                assert re.fullmatch(REGEX, body["choices"][0]["text"]), body
    return tokens


def _offline_regex(tiny) -> list[int]:
    """TP1's greedy tokens of REGEX_PROMPT under REGEX."""
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine
    from kvmesh.shared.text.sampling import SamplingOptions
    from kvmesh.shared.text.structured_output import StructuredOutputs

    engine = LLMEngine(*tiny, EngineConfig(num_blocks=64))
    spec = StructuredOutputs(regex=REGEX)
    params = SamplingOptions(max_tokens=16, temperature=0.0, structured_outputs=spec)
    return engine.generate([REGEX_PROMPT], params)[0]


def _serves_as_tp1(launcher, expected, regex: bool) -> None:
    """The mesh answers as TP1 and returns every block."""
    assert asyncio.run(_ask(launcher, regex=regex)) == expected
    rows = asyncio.run(wait_blocks_returned(launcher.config.nats_url, launcher.nats_auth))
    assert rows and all(row.pool.free_blocks == row.pool.total_blocks for row in rows), rows


async def _kill_mid_prefill(launcher, follower: int, expected: list[int]) -> None:
    """With ``follower`` stopped, ask KILL_PROMPT; once the leader announced that it took the
    job (``PrefillStarted``: acknowledged, never redelivered; its prefill cannot end, the
    follower being in none of its collectives) kill the follower. The router runs the request
    again (the prefill worker gone: the decode worker prefills it, no other being ready), and it
    is answered with TP1's tokens."""
    async with (
        MeshTap(launcher.config.nats_url, launcher.nats_auth) as tap,
        aiohttp.ClientSession() as session,
    ):
        ask = complete(session, launcher.url, KILL_PROMPT, MAX_TOKENS, ignore_eos=True)
        asked = asyncio.create_task(ask)
        started = await tap.wait_started()
        os.kill(follower, signal.SIGKILL)
        body = await asked
        _, tokens = await tap.wait_answered(body["id"])
    assert started.worker_id.startswith("prefill"), started
    assert started.request_id == body["id"]  # its first attempt: the job the group held
    assert tap.attempts(body["id"])[-1] != body["id"]  # answered by a retry
    assert body["id"] not in tap.prefill_done  # the dead group announced nothing of its job
    assert tokens == expected


def test_prefill_tp2_serves_tp1_answers_and_a_rank_killed_mid_prefill_takes_it_down():
    """The mesh answers as TP1; then the follower rank is stopped, the leader takes a job and
    the follower is killed: the leader exits non-zero, the request is answered as TP1, and every
    decode block comes back (no lease of the job left on the decode worker)."""
    *expected, after_kill = offline_greedy([*PROMPTS, KILL_PROMPT], MAX_TOKENS, ignore_eos=True)
    config = mesh_config(
        prefill_tp=2, draft="ngram", transport="shm", max_restarts=0, local_prefill_threshold=0
    )  # beside the draft service: the TP1 decode worker speculates
    with launched(config, ENV) as launcher:
        _serves_as_tp1(launcher, expected, regex=False)
        _, leader = launcher.children["prefill-0"]
        (follower,) = _follower_pids(leader.pid)
        os.kill(follower, signal.SIGSTOP)  # the leader's next collective waits on it
        try:
            asyncio.run(_kill_mid_prefill(launcher, follower, after_kill))
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(follower, signal.SIGKILL)
        assert leader.wait(timeout=30) != 0  # the leader noticed and went down
        rows = asyncio.run(wait_blocks_returned(launcher.config.nats_url, launcher.nats_auth))
        # the decode worker freed the job's blocks on hearing the group gone: its lease is over
        assert rows and all(row.pool.free_blocks == row.pool.total_blocks for row in rows), rows


def test_prefill_tp2_to_decode_tp2_serves_tp1_answers_and_goes_down_with_a_rank(tiny):
    """The mesh answers as TP1; then the decode worker's follower is killed, idle, and its
    leader notices and goes down."""
    expected = [*offline_greedy(PROMPTS, MAX_TOKENS, ignore_eos=True), _offline_regex(tiny)]
    config = mesh_config(
        prefill_tp=2, decode_tp=2, transport="shm", max_restarts=0, local_prefill_threshold=0
    )
    with launched(config, ENV) as launcher:
        _serves_as_tp1(launcher, expected, regex=True)
        _, leader = launcher.children["decode-0"]
        (follower,) = _follower_pids(leader.pid)
        os.kill(follower, signal.SIGKILL)
        assert leader.wait(timeout=30) != 0  # the leader noticed and went down


async def test_a_colocated_worker_at_tp2_answers_as_tp1_and_its_follower_ends_with_it():
    """``kvmesh serve colocated --tp 2``'s rank group as its serving process makes it, here as
    the leader, without NATS (a colocated mesh was checked by hand, docs/tp.md): the follower
    process spawned and ready, its engine replaying the leader's calls; TP1's greedy tokens,
    and the follower exits cleanly once the leader closes the group."""
    import torch
    import torch.distributed as dist
    from kvmesh.services.decode.compose import build_engine
    from kvmesh.services.decode.config import DecodeConfig
    from kvmesh.services.decode.tp_group import DecodeRanks, tp_config
    from kvmesh.shared.engine.outputs import collect_tokens
    from kvmesh.shared.model.loader import load_model
    from kvmesh.shared.text.sampling import SamplingOptions
    from support.tp_ranks import MAX_TOKENS, POOL_BYTES, PROMPTS, run_engine, tiny_model

    expected = run_engine(tiny_model(None))["tokens"]  # TP1's
    config = tp_config(
        DecodeConfig(
            mode="colocated", tp=2, threads=1, kv_cache_bytes=POOL_BYTES, max_num_batched_tokens=16
        )
    )
    model, tokenizer = load_model(config.model, torch.float32)
    cpus, threads = os.sched_getaffinity(0), torch.get_num_threads()  # the leader's changes them
    try:
        ranks = await DecodeRanks.start(config, "colocated-tp-test", model)
        try:
            engine = ranks.lead(build_engine(config, model, tokenizer, None))
            params = SamplingOptions(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
            ids = [f"c{i}" for i in range(len(PROMPTS))]
            for request_id, prompt in zip(ids, PROMPTS, strict=True):
                engine.add_request(request_id, prompt, params)
            tokens = collect_tokens(engine.step, ids)
        finally:
            await ranks.aclose()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(threads)
    assert tokens == expected
    assert [p.exitcode for p in ranks.ranks.processes] == [0]
