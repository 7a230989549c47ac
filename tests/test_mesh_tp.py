"""Meshes whose workers run tensor-parallel (docs/tp.md): two rank processes that appear as one
worker. `kvmesh up --prefill-tp 2`: each prefill rank writes its own KV head of every chunk to
the TP1 decode worker; `kvmesh up --decode-tp 2`: the TP1 prefill worker writes each decode rank
its head, and the decode worker admits a request once both ranks' writes are in, its ranks then
decoding together. Either way the greedy answers are TP1's offline ones, every block comes
back, and killing the follower rank takes the whole worker down. (2 -> 2 is the same decode
side with one writer a rank: tests/test_tensor_parallel.py hands a prompt over at 2 -> 2.)"""

from __future__ import annotations

import asyncio
import os
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


def _follower_pids(pid: int) -> list[int]:
    """A TP worker's rank processes: its children started by multiprocessing's spawn."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    return [c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


async def _ask(launcher) -> list[list[int]]:
    """Each prompt's tokens, as its token subject carried them; each prefilled remotely."""
    async with (
        MeshTap(launcher.config.nats_url, launcher.nats_auth) as tap,
        aiohttp.ClientSession() as session,
    ):
        tokens = []
        for prompt in PROMPTS:
            body = await complete(session, launcher.url, prompt, MAX_TOKENS, ignore_eos=True)
            await tap.wait_finished(body["id"])
            assert body["id"] in tap.prefill_done, body["id"]
            tokens.append(tap.tokens[body["id"]])
    return tokens


def test_prefill_tp2_serves_tp1_answers_and_goes_down_with_a_rank():
    expected = offline_greedy(PROMPTS, MAX_TOKENS, ignore_eos=True)
    config = mesh_config(prefill_tp=2, transport="shm", max_restarts=0, local_prefill_threshold=0)
    with launched(config, ENV) as launcher:
        assert asyncio.run(_ask(launcher)) == expected
        rows = asyncio.run(wait_blocks_returned(launcher.config.nats_url, launcher.nats_auth))
        assert rows and all(row.pool.free_blocks == row.pool.total_blocks for row in rows), rows

        _, prefill = launcher.children["prefill-0"]
        (follower,) = _follower_pids(prefill.pid)
        os.kill(follower, signal.SIGKILL)
        assert prefill.wait(timeout=30) != 0  # the leader noticed and went down


def test_decode_tp2_serves_tp1_answers_and_goes_down_with_a_rank():
    expected = offline_greedy(PROMPTS, MAX_TOKENS, ignore_eos=True)
    config = mesh_config(decode_tp=2, transport="shm", max_restarts=0, local_prefill_threshold=0)
    with launched(config, ENV) as launcher:
        assert asyncio.run(_ask(launcher)) == expected
        rows = asyncio.run(wait_blocks_returned(launcher.config.nats_url, launcher.nats_auth))
        assert rows and all(row.pool.free_blocks == row.pool.total_blocks for row in rows), rows

        _, decode = launcher.children["decode-0"]
        (follower,) = _follower_pids(decode.pid)
        os.kill(follower, signal.SIGKILL)
        assert decode.wait(timeout=30) != 0  # the leader noticed and went down
