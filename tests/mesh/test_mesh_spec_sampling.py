"""Speculative decoding keeps the target's distribution when sampling, end to end: real
nats-server, kv-registry, router, prefill and decode processes (kvmesh-tiny, decode
``--speculative``).

The draft side is a stand-in draft worker in the test process (``ScriptedDrafter``): it speaks
the draft protocol over NATS with the draft role's credentials like ``kvmesh serve draft``, and
answers every context at once with a chain the test chooses: the target's likeliest
continuation (drafts accepted and rejected), or its least likely token again and again (a
deliberately biased drafter, mostly rejected). Decode is paced (a step every 20 ms), so the
answer to each context is in hand for the next step.

Many seeded requests (seeds 0..N-1) of one fixed prompt at temperature 0.3 with top-k 2: the
tokens at output positions 2 and 3 (where drafts are verified), grouped by the tokens before
them, are held by a chi-square test to the target's exact conditional distributions, computed
offline from the model's logits: the distribution without drafts. Seeded
requests give the same tokens whatever the drafts (checked against a drafter that proposes
nothing), so a run is reproducible and the test's outcome does not depend on timing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import aiohttp
import pytest
import torch
from kvmesh.loadgen.bench_spec import spec_counters, spec_mesh
from kvmesh.shared.bus.messages.codec import decode_message, encode_message
from kvmesh.shared.bus.messages.drafts import DraftContext, DraftProposal
from kvmesh.shared.bus.nats_connect import connect_nats, flush_to_server
from kvmesh.shared.config.subjects import DRAFT_QUEUE_GROUP, Subjects
from kvmesh.shared.engine.sampler import apply_top_k_top_p
from support.stats import chi2_sf

from kvmesh.testing.mesh import MeshTap, complete

pytestmark = pytest.mark.slow

PROMPT = list(b"Passage: the block cache holds the draft token; verify the draft.\n")
TEMPERATURE, TOP_K = 0.3, 2
# output 0 comes from prefill and 1 from decode's first step; after it the context reaches the
# drafter, and the next step verifies drafts for outputs 2 and 3 (room for 2: the last output
# is never drafted)
MAX_TOKENS = 5
POSITIONS = (2, 3)
NUM_SAMPLES = 480
K = 4
DRAFTER_ID = "draft-scripted"
ENV = {
    "KVMESH_CHUNK_TOKENS": "32",
    "KVMESH_BLOCK_SIZE": "16",
    "KVMESH_NUM_BLOCKS": "1024",
    "KVMESH_SPECULATIVE": "1",  # decode workers send contexts; no draft worker is started
    "KVMESH_MIN_STEP_INTERVAL_MS": "20",
}

Proposer = Callable[[Sequence[int]], tuple[int, ...]]  # outputs so far -> a draft chain


class ScriptedDrafter:
    """A draft worker stand-in: takes contexts from the draft queue group (and its own
    subject once pinned) and answers each at once with ``proposer(outputs so far)`` as a chain;
    a delta for a sequence it does not hold is answered ``need_context``."""

    def __init__(self, proposer: Proposer) -> None:
        self.proposer = proposer
        self.contexts: dict[str, list[int]] = {}
        self.num_prompt: dict[str, int] = {}

    @contextlib.asynccontextmanager
    async def running(self, mesh: Any) -> AsyncIterator[ScriptedDrafter]:
        subjects = Subjects(mesh.config.subjects.mesh)
        auth = mesh.credentials.auth("draft")
        async with connect_nats(mesh.config.nats_url, DRAFTER_ID, auth=auth) as nc:

            async def on_context(msg: Any) -> None:
                ctx = decode_message(msg.data, DraftContext)
                held = self.contexts.get(ctx.request_id)
                if ctx.start == 0:
                    held = self.contexts[ctx.request_id] = list(ctx.token_ids)
                    self.num_prompt[ctx.request_id] = ctx.num_prompt_tokens
                elif held is None or len(held) != ctx.start:
                    answer = DraftProposal(
                        ctx.request_id, DRAFTER_ID, max(ctx.start, 1), need_context=True
                    )
                    await nc.publish(
                        subjects.decode_draft(ctx.decode_worker_id),
                        encode_message(answer),
                    )
                    return
                else:
                    held += ctx.token_ids
                chain = self.proposer(held[self.num_prompt[ctx.request_id] :])
                answer = DraftProposal(
                    ctx.request_id,
                    DRAFTER_ID,
                    len(held),
                    tokens=chain,
                    parents=tuple(range(-1, len(chain) - 1)),
                    depth=len(chain),
                )
                await nc.publish(
                    subjects.decode_draft(ctx.decode_worker_id), encode_message(answer)
                )

            await nc.subscribe(subjects.DRAFT_CONTEXT, queue=DRAFT_QUEUE_GROUP, cb=on_context)
            await nc.subscribe(subjects.draft_context(DRAFTER_ID), cb=on_context)
            await flush_to_server(nc)
            yield self


class TargetTable:
    """The target's exact next-token distribution (temperature, top-k) after ``PROMPT`` and
    each output prefix over the top-k tokens, up to ``MAX_TOKENS - 1`` tokens long."""

    def __init__(self, model) -> None:
        self.probs: dict[tuple[int, ...], dict[int, float]] = {}
        frontier: list[tuple[int, ...]] = [()]
        for _ in range(MAX_TOKENS):
            logits = last_logits(model, [PROMPT + list(prefix) for prefix in frontier])
            logits = apply_top_k_top_p(
                logits / TEMPERATURE,
                torch.full((len(frontier),), TOP_K),
                torch.ones(len(frontier)),
            )
            nxt = []
            for prefix, probs in zip(frontier, logits.softmax(-1), strict=True):
                support = probs.nonzero().flatten().tolist()
                self.probs[prefix] = {t: float(probs[t]) for t in support}
                nxt += [(*prefix, t) for t in support]
            frontier = nxt

    def _chain(self, outputs: Sequence[int], pick: Callable) -> tuple[int, ...]:
        chain: list[int] = []
        prefix = tuple(outputs)
        while prefix in self.probs and len(chain) < K:
            dist = self.probs[prefix]
            chain.append(pick(dist, key=dist.__getitem__))
            prefix = (*prefix, chain[-1])
        return tuple(chain)

    def likeliest(self, outputs: Sequence[int]) -> tuple[int, ...]:
        """The target's most likely continuation of ``outputs``, as far as the table reaches."""
        return self._chain(outputs, max)

    def unlikeliest(self, outputs: Sequence[int]) -> tuple[int, ...]:
        """The least likely token the target may pick, again and again: a drafter biased
        toward what the target rarely says."""
        return self._chain(outputs, min)


def last_logits(model: Any, seqs: list[list[int]]) -> torch.Tensor:
    """(len(seqs), vocab) logits after each of ``seqs`` (all one length), one forward pass over
    a fresh paged cache."""
    from kvmesh.shared.kv.kv_cache import KVPool
    from kvmesh.shared.model.attention import AttentionMetadata
    from kvmesh.shared.model.llama import kv_cache_spec

    n, bs = len(seqs[0]), 16
    per_seq = -(-n // bs)
    pool = KVPool(kv_cache_spec(model.config, block_size=bs), per_seq * len(seqs))
    tables = torch.arange(per_seq * len(seqs)).view(len(seqs), per_seq)
    positions = torch.arange(n).repeat(len(seqs))
    rows = torch.arange(len(seqs)).repeat_interleave(n)
    meta = AttentionMetadata(
        slot_mapping=tables[rows, positions // bs] * bs + positions % bs,
        query_lens=[n] * len(seqs),
        context_lens=torch.full((len(seqs),), n),
        block_tables=tables,
        block_size=bs,
    )
    with torch.inference_mode():
        hidden = model(torch.tensor(seqs).flatten(), positions, pool, meta)
        return model.compute_logits(hidden.view(len(seqs), n, -1)[:, -1])


@pytest.fixture(scope="module")
def table(tiny) -> TargetTable:
    return TargetTable(tiny[0])


@pytest.fixture(scope="module")
def mesh():
    with spec_mesh(None, "shm", env=ENV) as launcher:
        yield launcher


async def sample(mesh: Any, seeds: Sequence[int]) -> dict[int, list[int]]:
    """The output tokens of one seeded request per seed (read off the token subjects)."""
    limit = asyncio.Semaphore(48)

    async def one(session: aiohttp.ClientSession, seed: int) -> dict:
        async with limit:
            return await complete(
                session,
                mesh.url,
                PROMPT,
                MAX_TOKENS,
                temperature=TEMPERATURE,
                top_k=TOP_K,
                seed=seed,
                ignore_eos=True,
            )

    async with (
        MeshTap(mesh.config.nats_url, mesh.nats_auth) as tap,
        aiohttp.ClientSession() as session,
    ):
        replies = await asyncio.gather(*(one(session, s) for s in seeds))
        answers = [await tap.wait_answered(reply["id"]) for reply in replies]
    return {s: tokens for s, (_, tokens) in zip(seeds, answers, strict=True)}


def chi_square_p(table: TargetTable, outputs: Sequence[list[int]], position: int) -> float:
    """p-value of the tokens at output ``position`` against the target's distribution there:
    samples grouped by the tokens before them, each group against the conditional distribution
    after its prefix; a group counts when each of its cells expects at least 5 samples (the
    chi-square approximation's rule of thumb)."""
    groups: dict[tuple[int, ...], Counter] = defaultdict(Counter)
    for tokens in outputs:
        assert len(tokens) == MAX_TOKENS, tokens
        groups[tuple(tokens[:position])][tokens[position]] += 1
    stat, df = 0.0, 0
    for prefix, counts in groups.items():
        dist = table.probs[prefix]
        assert set(counts) <= set(dist), (prefix, counts, dist)  # never outside the top-k
        n = sum(counts.values())
        if n * min(dist.values()) >= 5:
            stat += sum((counts[t] - n * p) ** 2 / (n * p) for t, p in dist.items())
            df += len(dist) - 1
    assert df >= 2, ("too few samples per group", dict(groups))
    return chi2_sf(stat, df)


def run(mesh: Any, proposer: Proposer, seeds: Sequence[int]) -> tuple[dict, dict[str, float]]:
    """Seeded samples with ``proposer`` drafting, and the decode worker's counters' change."""

    async def scenario() -> dict[int, list[int]]:
        async with ScriptedDrafter(proposer).running(mesh):
            return await sample(mesh, seeds)

    before = spec_counters(mesh)
    outputs = asyncio.run(scenario())
    after = spec_counters(mesh)
    return outputs, {k: after[k] - before[k] for k in after}


def check_seeded_outputs_do_not_depend_on_drafts(mesh: Any, outputs: dict[int, list[int]]):
    seeds = sorted(outputs)[:24]
    plain, counters = run(mesh, lambda _: (), seeds)  # proposes nothing: plain decode steps
    assert counters["verify_steps"] == 0, counters
    assert {s: outputs[s] for s in seeds} == plain


def test_sampled_tokens_with_drafts_follow_the_target_distribution(mesh, table):
    outputs, counters = run(mesh, table.likeliest, range(NUM_SAMPLES))
    # drafts were verified for (nearly) every request, and both kept and rejected
    assert counters["tokens_per_step_count"] >= NUM_SAMPLES // 2, counters
    assert 0 < counters["accepted"] < counters["positions"], counters
    for position in POSITIONS:
        assert chi_square_p(table, list(outputs.values()), position) > 0.01, position
    check_seeded_outputs_do_not_depend_on_drafts(mesh, outputs)


def test_a_drafter_biased_toward_unlikely_tokens_does_not_bias_the_samples(mesh, table):
    outputs, counters = run(mesh, table.unlikeliest, range(NUM_SAMPLES))
    assert counters["tokens_per_step_count"] >= NUM_SAMPLES // 2, counters
    assert counters["positions"] > counters["accepted"] > 0, counters
    for position in POSITIONS:
        assert chi_square_p(table, list(outputs.values()), position) > 0.01, position
    check_seeded_outputs_do_not_depend_on_drafts(mesh, outputs)
