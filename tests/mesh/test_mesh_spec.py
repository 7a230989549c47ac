"""Speculative decoding end to end: real nats-server, kv-registry, router, prefill, decode and
draft processes (kvmesh-tiny).

16 concurrent greedy requests through the router; each request's tokens (read off its NATS token
subject) must equal the offline engine's without drafts, token for token, for n-gram and early
exit drafts, K 1 and 4 and a tree, over shm (and n-gram over tcp); the decode worker's
counters show that drafts were verified, and the replies' usage counts the accepted ones. The
early-exit mesh then hands over to a second draft worker drafting trees (K 4, 2,2,2,1): four
of the prompts again, the same output, and trees verified with their siblings. On the
early-exit mesh, long prompts' draft KV reaches the draft worker from the prefill worker through
the data plane (its metrics: every full prompt block received, less computed than the prompts),
with the output unchanged. A
draft model equal to the target has every draft accepted and K + 1 tokens per full verify step
(from the decode worker's /metrics), and long prompts' draft KV comes from the prefill worker's
own run of the draft model; kill -9 of that draft worker mid-stream changes no stream.
`kvmesh admin drain` of the draft worker stops its drafting of new sequences (output unchanged),
`resume` starts it again. Bad draft settings stop `kvmesh serve draft` at start-up with one
line.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import aiohttp
import msgspec
import pytest
from kvmesh.loadgen.bench_spec import DraftSetup, spec_counters, spec_mesh
from kvmesh.shared.bus.admin_client import admin_client
from support.mesh_checks import check_blocks_returned, check_equals_offline, load

from kvmesh.commands.admin import render_status
from kvmesh.testing.mesh import MeshTap, complete, random_prompts
from kvmesh.testing.offline import offline_greedy

pytestmark = pytest.mark.slow

ENV = {"KVMESH_CHUNK_TOKENS": "32", "KVMESH_BLOCK_SIZE": "16", "KVMESH_NUM_BLOCKS": "1024"}
# Half the prompts repeat a phrase, so prompt lookup finds something to propose.
PROMPTS = [p * 3 if i % 2 else p for i, p in enumerate(random_prompts(16, 20, 60, seed=11))]
MAX_TOKENS = 24
# Long prompts for early exit: their draft KV comes from the prefill worker (data plane).
LONG_PROMPTS = random_prompts(4, 520, 600, seed=12)
LONG_MAX_TOKENS = 16


@pytest.fixture(scope="module")
def offline_tokens() -> list[list[int]]:
    return offline_greedy(PROMPTS, MAX_TOKENS)


# early exit as a tree takes over the early-exit chain's mesh as a second draft worker
EARLY_EXIT_TREE = DraftSetup("early-exit", k=4, tree=(2, 2, 2, 1), exit_layer=2)


@pytest.mark.parametrize(
    ("transport", "setup"),
    [
        # each mesh costs ~20 s of the suite: early exit at K=4 is the kill test's setup below
        ("shm", DraftSetup("ngram", k=1)),
        ("shm", DraftSetup("ngram", k=4, tree=(2, 2, 1, 1))),
        ("shm", DraftSetup("early-exit", k=1, exit_layer=2)),  # then + EARLY_EXIT_TREE
        ("tcp", DraftSetup("ngram", k=4)),
    ],
    ids=lambda v: v if isinstance(v, str) else f"{v.method}-k{v.k}-{'x'.join(map(str, v.tree))}",
)
def test_greedy_output_with_drafts_equals_output_without(transport, setup, offline_tokens):
    env = dict(ENV)
    second = EARLY_EXIT_TREE if setup.method == "early-exit" else None
    if setup.method == "early-exit":
        # kvmesh-tiny's step takes a few ms, less than a model draft takes: paced like a big
        # target's step (100 ms: a tree for a few sequences on a loaded box), the drafts arrive
        # in time (back to back they mostly arrive late, are stale unless their first tokens
        # were right, and decode goes on without them)
        env["KVMESH_MIN_STEP_INTERVAL_MS"] = "100"
    long_offline = (
        offline_greedy(LONG_PROMPTS, LONG_MAX_TOKENS) if setup.method == "early-exit" else []
    )
    with spec_mesh(setup, transport, env=env) as mesh:

        async def scenario() -> tuple[dict, int]:
            replies, tap = await load(mesh, PROMPTS, MAX_TOKENS)
            check_equals_offline(replies, tap, offline_tokens)
            if long_offline:
                await _check_long_prompts_draft_kv_from_the_data_plane(mesh, long_offline)
            if transport == "tcp":
                await _check_drain_and_resume(mesh, offline_tokens)
            async with admin_client(mesh.config.nats_url, auth=mesh.nats_auth) as admin:
                status = {
                    **msgspec.to_builtins(await admin.status()),
                    "draft": await admin.draft_workers(),
                }
            if second is not None:
                status["draft"] += await _check_trees_from_a_second_draft_worker(
                    mesh, second, env, offline_tokens
                )
            await check_blocks_returned(mesh)
            return status, sum(_accepted_in_usage(r) for r in replies)

        status, accepted_in_usage = asyncio.run(scenario())
        counters = spec_counters(mesh)
    # kvmesh admin status shows the draft workers and their acceptance
    setups = [setup] if second is None else [setup, second]
    rows = {r["worker_id"]: r for r in status["draft"]}
    assert sorted(rows) == [f"draft-{i}" for i in range(len(setups))], rows
    for row, s in zip((rows[w] for w in sorted(rows)), setups, strict=True):
        assert row["method"] == s.method and row["k"] == s.k, row
        assert row["tree"] == ",".join(map(str, s.tree)), row
        assert row["verified_tokens"] > 0 and 0 <= row["acceptance"] <= 1, row
        assert row["worker_id"] in render_status(status)
    assert counters["verify_steps"] > 0 and counters["positions"] > 0, counters
    if not setup.tree and second is None:  # a chain's nodes are its positions
        assert counters["nodes"] == counters["positions"], counters
    if setup.method == "early-exit":  # the first layers of the same model agree sometimes
        assert counters["accepted"] > 0, counters
    # usage counts the accepted drafts the clients got (a stop token may cut a verified path)
    assert accepted_in_usage <= counters["accepted"], (accepted_in_usage, counters)
    assert (accepted_in_usage > 0) == (counters["accepted"] > 0), (accepted_in_usage, counters)


async def _check_long_prompts_draft_kv_from_the_data_plane(
    mesh, offline, prompts=LONG_PROMPTS
) -> None:
    """The long prompts' full blocks reach the draft worker (early exit or model) from the
    prefill worker and are never computed there: its drafter computes less than the prompts
    (without the data plane each first draft alone computes its whole prompt), and the output
    is unchanged."""
    before = _draft_metrics(mesh)
    replies, tap = await load(mesh, prompts, LONG_MAX_TOKENS)
    check_equals_offline(replies, tap, offline)
    after = _draft_metrics(mesh)
    received = after["prompt_tokens_received"] - before["prompt_tokens_received"]
    computed = after["context_tokens_computed"] - before["context_tokens_computed"]
    assert received == sum(len(p) // 16 * 16 for p in prompts), (before, after)
    assert 0 < computed < sum(len(p) for p in prompts), (before, after)
    # (short prompts may end before their reservation's reply is in: released, counted)
    assert after["prompt_kv_refused"] == before["prompt_kv_refused"], (before, after)


def _draft_metrics(mesh) -> dict[str, float]:
    """draft-0's counters (``kvmesh up`` is ready only once every service's /metrics listens)."""
    from kvmesh.loadgen import prom_text

    values = prom_text.scrape(mesh.metrics_urls["draft-0"], timeout_s=5)
    names = ("prompt_tokens_received", "context_tokens_computed", "prompt_kv_refused")
    return {name: values.get(f"kvmesh_draft_{name}_total", 0.0) for name in names}


async def _check_trees_from_a_second_draft_worker(
    mesh, setup: DraftSetup, env: dict[str, str], offline
) -> list[dict]:
    """draft-1, drafting ``setup`` (early exit as a tree), takes over from draft-0 (kvmesh up
    starts draft workers of one setting; the mesh stops this one too): draft-0 stops once
    draft-1 serves, so every sequence of the next load is drafted by draft-1, and the output
    is the same. Returns draft-1's row of kvmesh admin status."""
    from kvmesh.shared.config.ports import free_port

    from kvmesh.commands.up_plan import ChildSpec

    spec, first = mesh.children["draft-0"]
    argv = list(spec.argv)
    for flag, value in (
        ("--worker-id", "draft-1"),
        ("--num-speculative-tokens", str(setup.k)),
        ("--exit-layer", str(setup.exit_layer)),
        ("--metrics-port", str(free_port())),
    ):
        argv[argv.index(flag) + 1] = value
    # no lookahead: a verify step then waits for a fresh tree (else, the drafts accepted, it
    # verifies the chain below the old tree's likeliest path, and the siblings are passed by)
    argv += ["--tree", ",".join(map(str, setup.tree)), "--lookahead", "0"]
    with pytest.MonkeyPatch.context() as patch:  # the settings the mesh's children started with
        for key, value in env.items():
            patch.setenv(key, value)
        mesh._spawn(ChildSpec("draft-1", "draft", tuple(argv)))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    async with admin_client(mesh.config.nats_url, auth=mesh.nats_auth) as admin:
        while "draft-1" not in {r["worker_id"] for r in await admin.draft_workers()}:
            assert loop.time() < deadline, "draft-1 did not start within 60 s"
            await asyncio.sleep(0.2)
        first.terminate()
        await asyncio.to_thread(first.wait, 30)
        # four of the prompts: drafting their trees takes the draft worker about a decode step
        # on a loaded box, so proposals arrive while their branches still apply (for 16
        # sequences it takes several steps: only the chains below the tokens added meanwhile)
        before = spec_counters(mesh)
        replies, tap = await load(mesh, PROMPTS[0::4], MAX_TOKENS)
        check_equals_offline(replies, tap, offline[0::4])
        after = spec_counters(mesh)
        nodes, positions = (after[k] - before[k] for k in ("nodes", "positions"))
        assert nodes > positions > 0, (before, after)  # trees verified with their siblings
        return [r for r in await admin.draft_workers() if r["worker_id"] == "draft-1"]


async def _check_drain_and_resume(mesh, offline) -> None:
    """`kvmesh admin drain draft-0`: the only draft worker takes no new sequence, so the next
    load is decoded plainly (no verify step) with the same output; `resume`: drafted again."""
    async with admin_client(mesh.config.nats_url, auth=mesh.nats_auth) as admin:
        drained = await admin.drain("draft-0")
        assert drained.state == "draining", drained
        assert [r["state"] for r in await admin.draft_workers()] == ["draining"]
        before = spec_counters(mesh)
        replies, tap = await load(mesh, PROMPTS[1::4], MAX_TOKENS)
        check_equals_offline(replies, tap, offline[1::4])
        assert spec_counters(mesh)["verify_steps"] == before["verify_steps"]
        resumed = await admin.resume("draft-0")
        assert resumed.state == "ready", resumed
        replies, tap = await load(mesh, PROMPTS[1::4], MAX_TOKENS)
        check_equals_offline(replies, tap, offline[1::4])
        assert spec_counters(mesh)["verify_steps"] > before["verify_steps"]


def _accepted_in_usage(reply: dict) -> int:
    details = reply["usage"].get("completion_tokens_details") or {}
    return details.get("accepted_prediction_tokens", 0)


def _tokens_per_step_buckets(mesh) -> dict[float, float]:
    """The decode worker's histogram of tokens per verify step: upper bound -> count."""
    from kvmesh.loadgen import prom_text

    text = prom_text.fetch(mesh.metrics_urls["decode-0"], timeout_s=5)
    return {
        float(sample.labels["le"]): sample.value
        for sample in prom_text.samples(text)
        if sample.name == "kvmesh_decode_spec_tokens_per_step_bucket"
    }


def test_draft_model_equal_to_the_target_has_every_draft_accepted_until_killed_mid_stream():
    # --method model with the target's own checkpoint at K=4: every draft verified before the
    # kill is accepted and each verify step gives its drafts + 1 tokens, K + 1 for a full
    # proposal (read off the decode worker's /metrics); after kill -9 of the draft worker half
    # way through, every stream completes unchanged. ignore_eos: every request runs to
    # max_tokens, so no stop token cuts a verified path short. Before that, two long prompts:
    # the prefill worker runs the draft model too (kvmesh up --draft model) and writes its
    # blocks to the draft worker, which computes only their tails.
    long_tokens = 96
    k = 4
    offline = offline_greedy(PROMPTS, long_tokens, ignore_eos=True)
    long_prompts = LONG_PROMPTS[:2]
    long_offline = offline_greedy(long_prompts, LONG_MAX_TOKENS)
    # paced: the draft model is the target itself, so topping a chain up takes K + 1 of its
    # steps; a step of 100 ms gives its proposals time to arrive on a loaded box
    env = {**ENV, "KVMESH_MIN_STEP_INTERVAL_MS": "100"}
    setup = DraftSetup("model", k=k, draft_model="kvmesh-tiny")
    with spec_mesh(setup, "shm", env=env) as mesh:
        _, draft = mesh.children["draft-0"]

        async def scenario() -> None:
            await _check_long_prompts_draft_kv_from_the_data_plane(mesh, long_offline, long_prompts)
            async with (
                MeshTap(mesh.config.nats_url, mesh.nats_auth) as tap,
                aiohttp.ClientSession() as session,
            ):
                load = asyncio.gather(
                    *(complete(session, mesh.url, p, long_tokens, ignore_eos=True) for p in PROMPTS)
                )
                task = asyncio.ensure_future(load)
                while sum(len(t) for t in tap.tokens.values()) < len(PROMPTS) * long_tokens // 2:
                    assert not task.done()
                    await asyncio.sleep(0.01)
                os.kill(draft.pid, signal.SIGKILL)  # mid-stream
                replies = await task
                for reply in replies:
                    await tap.wait_finished(reply["id"])
            check_equals_offline(replies, tap, offline)
            await check_blocks_returned(mesh)

        asyncio.run(scenario())
        assert draft.wait(10) == -signal.SIGKILL
        counters = spec_counters(mesh)
        buckets = _tokens_per_step_buckets(mesh)
    assert counters["accepted"] == counters["positions"] > 0, counters
    steps = counters["tokens_per_step_count"]
    assert counters["tokens_per_step_sum"] == counters["accepted"] + steps, counters
    # proposals that arrive late are verified below the tokens added since: fewer than K
    assert buckets[k + 1.0] == steps and buckets[float(k)] < steps, buckets


def _serve_draft(*flags: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVMESH_NATS_URL": "nats://127.0.0.1:1"}  # never reached
    return subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "serve", "draft", *flags],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--num-speculative-tokens", "0"), "num_speculative_tokens must be in [1, 16]"),
        (("--num-speculative-tokens", "40"), "num_speculative_tokens must be in [1, 16]"),
        (("--num-speculative-tokens", "3", "--tree", "8,8,8"), "the limit is 63"),
        (("--num-speculative-tokens", "2", "--tree", "2,2,2"), "has 3 depths"),
        (("--method", "model"), "needs --draft-model"),
        (("--method", "early-exit", "--exit-layer", "4"), "exit after 1 to 3"),
    ],
)
def test_bad_draft_settings_stop_the_service_with_one_line(flags, message):
    proc = _serve_draft(*flags)
    assert proc.returncode in (1, 2), proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "kvmesh serve draft" in line]
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_draft_model_with_another_vocabulary_is_refused_at_start_up(tmp_path):
    from support.small_models import write_small_seeded

    other = write_small_seeded(tmp_path / "other-vocab")
    proc = _serve_draft("--method", "model", "--draft-model", other)
    assert proc.returncode == 1, proc.stderr
    [line] = [line for line in proc.stderr.splitlines() if "kvmesh serve draft" in line]
    assert "does not share the vocabulary" in line and "Traceback" not in proc.stderr
