"""No message kills a service: every subject some role reads (generated from ``Subjects`` and the
roles' permissions, tests/support/nats_fuzz.py) gets one message of every protocol type (its own among
them), each cut short, an empty body, junk, 10,000 nested brackets and a body as large as the
server carries, each without a reply subject and with one, and every typed one again (a replay),
published with the credentials of a role that may publish there, into a real mesh (`kvmesh up`:
kv-registry, decode, prefill, an n-gram draft worker, a kv-store and the router, one user per
role). Afterwards every process still runs, a request is served, and the refusals were counted.

Before shared/bus/message_guard.py a ReserveRequest without a reply subject raised "no reply subject
set" out of the decode worker's task group and the process exited."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest
from kvmesh.loadgen import prom_text
from kvmesh.shared.bus.nats_connect import connect_nats
from support.nats_fuzz import bodies, targets

from kvmesh.testing.mesh import complete, launched, mesh_config

pytestmark = pytest.mark.slow

WORKERS = ["kv-registry-0", "decode-0", "prefill-0", "draft-0", "kv-store-0", "router-0"]
ENV = {"KVMESH_BLOCK_SIZE": "16"}


@pytest.fixture(scope="module")
def mesh():
    config = mesh_config(
        mode="disagg",
        transport="tcp",
        draft="ngram",
        kv_store=1,
        kv_store_capacity_gb=0.05,
        log_level="error",
        startup_timeout_s=240.0,
    )
    with launched(config, ENV) as launcher:
        yield launcher


async def _drop(msg) -> None:
    """An answer to a fuzz message: read, and nothing to do with it."""


async def fuzz(mesh) -> dict[str, int]:
    """Send everything; the number of messages sent per publishing role."""
    s = mesh.config.subjects
    plan = targets(s, WORKERS)
    assert {s.decode_reserve("decode-0"), s.REGISTRY_PLACE, s.PREFILL_JOBS} <= {t for t, *_ in plan}
    assert {s.store_put("kv-store-0"), s.DRAFT_KV_RESERVE} <= {t for t, *_ in plan}
    sent: dict[str, int] = {}
    rng = random.Random(27)
    oversized_for: set[tuple[str, ...]] = set()  # once per set of readers: 1 MiB each
    for role in sorted({p for _, p, _ in plan}):
        auth = mesh.credentials.auth(role)
        async with connect_nats(mesh.nats_url, f"fuzz-{role}", auth=auth) as nc:
            inbox = f"{auth.inbox_prefix}.fuzz"
            # answers land here and are dropped: a subscription nothing reads kept its
            # connection's drain waiting out its 5 s limit (30 s of the fuzz's 33 s)
            await nc.subscribe(f"{inbox}.>", cb=_drop)
            n = 0
            for subject, _, readers in (t for t in plan if t[1] == role):
                for kind, data in bodies(rng, nc.max_payload):
                    if kind == "oversized":
                        if tuple(readers) in oversized_for:
                            continue
                        oversized_for.add(tuple(readers))
                    replays = 2 if kind.startswith("type:") else 1
                    for _ in range(replays):
                        await nc.publish(subject, data)
                        await nc.publish(subject, data, reply=f"{inbox}.{n}")
                        n += 2
                    if n % 200 < 4:
                        await nc.flush()
            await nc.flush()
            sent[role] = n
    return sent


def refused(url: str) -> float:
    samples = prom_text.scrape(url)
    return sum(v for k, v in samples.items() if k.endswith("_nats_refused_total"))


async def serve_one(mesh) -> dict:
    async with aiohttp.ClientSession() as session:
        return await complete(session, mesh.url, list(range(5, 45)), 4, ignore_eos=True)


def test_no_message_on_any_subject_kills_a_service_and_the_mesh_serves_after(mesh):
    body = asyncio.run(serve_one(mesh))  # the mesh serves before
    assert body["usage"]["completion_tokens"] == 4
    sent = asyncio.run(fuzz(mesh))
    print(f"\nfuzz messages sent, by publishing role: {sent}")
    assert sum(sent.values()) > 5_000
    asyncio.run(asyncio.sleep(3.0))  # let every service read its backlog
    assert mesh.dead() == [], f"services exited: {mesh.dead()}"
    body = asyncio.run(serve_one(mesh))
    assert body["usage"]["completion_tokens"] == 4
    assert mesh.dead() == []
    # each worker counted what it refused (its metrics port); none took a message for granted
    for name in ("decode-0", "prefill-0", "kv-registry-0", "kv-store-0", "draft-0", "router-0"):
        assert refused(mesh.metrics_urls[name]) > 0, name
