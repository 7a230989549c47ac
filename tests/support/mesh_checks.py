"""What the end-to-end mesh tests check, written once: the offline engine's greedy tokens to
compare with, a batch of completions sent through the router and read off the token subjects
(under every wire id the router gave a request: a retry on a loaded box is not a wrong answer),
outputs equal to the offline engine's token for token, and every decode block returned; and
what the kv-store mesh tests share: their environment and prompts sent one at a time."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp

from kvmesh.testing.mesh import MeshTap, complete, mesh_config, wait_blocks_returned


async def load(
    mesh: Any, prompts: list[list[int]], max_tokens: int, *, linger_s: float = 0.0
) -> tuple[list[dict], MeshTap]:
    """Send every prompt at once through ``mesh``'s router; returns the replies and the tap that
    heard each request finish. ``linger_s``: listen that much longer (for messages published
    after a request's last token, e.g. PrefillReports)."""
    async with (
        MeshTap(mesh.config.nats_url, mesh.nats_auth) as tap,
        aiohttp.ClientSession() as session,
    ):
        replies = await asyncio.gather(
            *(complete(session, mesh.url, p, max_tokens) for p in prompts)
        )
        for reply in replies:
            await tap.wait_answered(reply["id"])
        if linger_s:
            await asyncio.sleep(linger_s)
    return replies, tap


def check_equals_offline(replies: list[dict], tap: MeshTap, offline: list[list[int]]) -> None:
    """Each request's tokens (as its token subject carried them) are the offline engine's, and
    its reply's usage and finish reason agree with them."""
    answers = [tap.answer(r["id"]) for r in replies]
    got = [tokens for _, tokens in answers]
    mismatched = [i for i, (g, o) in enumerate(zip(got, offline, strict=True)) if g != o]
    assert not mismatched, f"requests {mismatched} differ from the offline engine"
    for reply, (final, tokens) in zip(replies, answers, strict=True):
        assert reply["usage"]["completion_tokens"] == len(tokens)
        assert reply["choices"][0]["finish_reason"] == final.finish_reason


@contextlib.asynccontextmanager
async def one_by_one(
    mesh: Any, max_tokens: int
) -> AsyncIterator[tuple[Any, Callable[..., Awaitable[list[int]]]]]:
    """``(admin, ask)`` for a test that sends ``mesh`` one prompt at a time: the registry's admin
    client, and ``await ask(prompt, remote=...)``, which sends one greedy request (EOS ignored),
    waits for its end, checks that a prefill worker prefilled it (``remote``) or not (no
    PrefillDone: a local prefill) and returns its tokens."""
    from kvmesh.shared.bus.admin_client import admin_client

    async with (
        admin_client(mesh.config.nats_url, auth=mesh.nats_auth) as admin,
        MeshTap(mesh.config.nats_url, mesh.nats_auth) as tap,
        aiohttp.ClientSession() as session,
    ):

        async def ask(prompt: list[int], *, remote: bool) -> list[int]:
            body = await complete(session, mesh.url, prompt, max_tokens, ignore_eos=True)
            await tap.wait_finished(body["id"])
            assert (body["id"] in tap.prefill_done) == remote, body["id"]
            return tap.tokens[body["id"]]

        yield admin, ask


async def check_blocks_returned(mesh: Any) -> None:
    """Every decode worker has all its blocks free again, and every role kept to its NATS
    permissions."""
    rows = await wait_blocks_returned(mesh.config.nats_url, mesh.nats_auth)
    assert rows, "no decode worker in the admin status"
    for row in rows:
        assert row.pool.free_blocks == row.pool.total_blocks, row
    assert mesh.nats_violations() == []


async def store_advertised_since_ready(mesh) -> None:
    """A barrier: the registry heard a store advert sent after the mesh was ready, so the decode
    worker (subscribed before it was ready) has heard it too and knows where to swap to."""
    from kvmesh.shared.bus.admin_client import admin_client

    loop = asyncio.get_running_loop()
    ready = loop.time()
    async with admin_client(mesh.config.nats_url, auth=mesh.nats_auth) as admin:
        await poll_status(
            admin,
            lambda s: any(r.last_seen_s < loop.time() - ready - 0.05 for r in s.stores[:1]),
            "a store advert since the mesh was ready",
        )


async def poll_status(admin: Any, ready: Any, what: str, timeout_s: float = 30.0) -> Any:
    """The registry's admin status once ``ready(status)`` holds (a barrier, polled every 0.1 s);
    fails naming ``what`` after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        status = await admin.status()
        if ready(status):
            return status
        assert loop.time() < deadline, f"timed out waiting for {what}: {status}"
        await asyncio.sleep(0.1)


def scrape(url: str) -> dict[str, float]:
    """A service's /metrics, parsed (``name{labels}`` -> value)."""
    from kvmesh.loadgen import prom_text

    return prom_text.scrape(url)


TINY_BLOCK_BYTES = 64 << 10  # kvmesh-tiny, 16-token blocks, float32
# the environment of a store mesh whose decode and prefill workers have 256 blocks each
STORE_MESH_ENV = {
    "KVMESH_BLOCK_SIZE": "16",
    "KVMESH_KV_CACHE_BYTES": str(256 * TINY_BLOCK_BYTES),
    "KVMESH_CHUNK_TOKENS": "64",
}


def store_mesh_config(*, prefill: int, decode: int, local_prefill_threshold: int = 0) -> Any:
    """A disaggregated mesh over shm with one kv-store of 64 MiB (a few hundred kvmesh-tiny
    blocks: the store tests fill and evict it); ``local_prefill_threshold`` 0 sends every prompt
    to a prefill worker."""
    return mesh_config(
        mode="disagg",
        transport="shm",
        local_prefill_threshold=local_prefill_threshold,
        prefill=prefill,
        decode=decode,
        kv_store=1,
        kv_store_capacity_gb=0.0625,
    )
