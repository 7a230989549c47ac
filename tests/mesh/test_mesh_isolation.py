"""Two meshes on one NATS server, each a whole disaggregated mesh in real processes: the built-in
kvmesh-tiny (mesh ``kvmesh-tiny``) and a seeded checkpoint of another shape (mesh
``other-model``), with the same worker ids (kv-registry-0, decode-0, prefill-0, router-0).

Both serve at once; every greedy reply equals its own model's offline engine token for token,
no token, prefill job, report or admin answer of one mesh appears on the other's subjects, each
mesh's admin lists only its own workers, and a registry refuses a placement for another model.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from kvmesh.shared.bus.nats_server import NatsServer
from support.small_models import write_small_seeded

from kvmesh.testing.mesh import MeshTap, complete, local_mesh, random_prompts, wait_blocks_returned
from kvmesh.testing.offline import offline_greedy

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ENV = {"KVMESH_CHUNK_TOKENS": "32", "KVMESH_BLOCK_SIZE": "16", "KVMESH_NUM_BLOCKS": "256"}
PROMPTS = random_prompts(6, 20, 90, seed=11)
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_small_seeded(tmp_path_factory.mktemp("models") / "other-model")


@pytest.fixture(scope="module")
def two_meshes(other_model: str):
    server = NatsServer()  # open: both meshes' services connect to it
    with (
        server,
        local_mesh("disagg", "tcp", nats_url=server.url, env=ENV, nats_insecure=True) as tiny,
        local_mesh(
            "disagg", "tcp", model=other_model, nats_url=server.url, env=ENV, nats_insecure=True
        ) as other,
    ):
        yield server.url, tiny, other


async def _serve(mesh, model: str, tap: MeshTap) -> list[dict]:
    async with aiohttp.ClientSession() as session:
        replies = await asyncio.gather(
            *(complete(session, mesh.url, p, MAX_TOKENS, model=model) for p in PROMPTS)
        )
    for reply in replies:
        await tap.wait_finished(reply["id"])
    return replies


async def test_two_meshes_on_one_nats_each_serve_their_own_model(two_meshes, other_model):
    url, tiny, other = two_meshes
    assert (tiny.mesh, other.mesh) == ("kvmesh-tiny", "other-model")
    expected = {
        "kvmesh-tiny": offline_greedy(PROMPTS, MAX_TOKENS),
        "other-model": offline_greedy(PROMPTS, MAX_TOKENS, model=other_model),
    }
    assert expected["kvmesh-tiny"] != expected["other-model"]  # the models tell apart
    async with (
        MeshTap(url, mesh="kvmesh-tiny") as tiny_tap,
        MeshTap(url, mesh="other-model") as other_tap,
    ):
        tiny_replies, other_replies = await asyncio.gather(
            _serve(tiny, "kvmesh-tiny", tiny_tap), _serve(other, other_model, other_tap)
        )
        await asyncio.sleep(0.2)  # PrefillReports follow the last token
    for replies, tap, mine, theirs in (
        (tiny_replies, tiny_tap, "kvmesh-tiny", other_tap),
        (other_replies, other_tap, "other-model", tiny_tap),
    ):
        ids = {r["id"] for r in replies}
        assert [tap.tokens[r["id"]] for r in replies] == expected[mine]
        assert set(tap.tokens) == set(tap.reports) == ids  # each prefilled by its mesh's worker
        assert not ids & (set(theirs.tokens) | set(theirs.reports) | set(theirs.prefill_done))
    for mesh in (tiny, other):
        rows = await wait_blocks_returned(url, mesh=mesh.mesh)
        assert [r.worker_id for r in rows] == ["decode-0"]
        assert all(r.pool.free_blocks == r.pool.total_blocks for r in rows)


async def test_admin_addresses_one_mesh_and_registry_refuses_another_model(two_meshes):
    from kvmesh.shared.bus.admin_client import admin_client
    from kvmesh.shared.bus.messages.codec import decode_message, encode_message
    from kvmesh.shared.bus.messages.placement import PlaceReply, PlaceRequest
    from kvmesh.shared.bus.nats_connect import connect_nats
    from kvmesh.shared.config.subjects import Subjects
    from kvmesh.shared.text.sampling import SamplingOptions

    url = two_meshes[0]
    out = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "admin", "status", "--json", "--nats-url", url],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "KVMESH_MESH": "other-model"},
    )
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert status["registry"]["mesh"] == "other-model"
    workers = {(w["worker_id"], w["role"]) for w in status["workers"]}
    assert {("decode-0", "decode"), ("prefill-0", "prefill"), ("router-0", "router")} <= workers
    assert len(status["workers"]) == 4  # its own four, not the other mesh's namesakes
    async with admin_client(url, mesh="kvmesh-tiny") as admin:
        [tiny_decode] = (await admin.status()).decode
    [other_decode] = status["decode"]  # the JSON `kvmesh admin status --json` printed
    assert tiny_decode.reach.model_spec != other_decode["reach"]["model_spec"]

    # a router of the other model asking the kvmesh-tiny mesh's registry: refused, with why
    place = PlaceRequest(
        request_id="stray-1",
        prompt_ids=(1, 2, 3),
        sampling=SamplingOptions(max_tokens=2),
        local_prefill=True,
        model_spec=other_decode["reach"]["model_spec"],
    )
    async with connect_nats(url, "stray-router") as nc:
        msg = await nc.request(
            Subjects("kvmesh-tiny").REGISTRY_PLACE, encode_message(place), timeout=5
        )
    reply = decode_message(msg.data, PlaceReply)
    assert not reply.ok and reply.retry_after_s == 0
    assert "decode-0 serves another model or KV layout" in reply.error
