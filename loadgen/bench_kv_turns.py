"""``kvmesh bench kv --multi-turn``: multi-turn chat TTFT with the kv-store and prefix routing,
against without, the same workload on two real local meshes in one run.

The workload (``loadgen/multi_turn.py``): ``--conversations`` chats sharing one system prompt of
``--system-len`` tokens, ``--turns`` turns each; every turn resends the whole history (system
prompt, earlier user messages and the model's earlier answers, token for token) plus a new user
message. Turns go in waves: turn t of every conversation is sent at the arrival offsets of the
load generator's process (``--arrival``, ``--request-rate``, ``--burstiness``, as ``kvmesh bench
serve``), once every conversation has its answer to turn t - 1.

The two meshes (disagg, ``--prefill-workers`` prefill and ``--decode-workers`` decode workers,
one at a time on the same cores, each warmed up by one unrelated request first):

- ``store``: ``kvmesh up --kv-store 1``: prefill workers read prefix blocks their own cache lacks
  from the store and put what they computed; decode workers put every finished request's blocks
  (prompt and answer). The kv-registry's prefix-aware placement is on (its defaults): a request
  goes to the decode worker whose prefix cache holds most of its prompt and, when at most
  ``--local-max-suffix-tokens`` (512) are left uncached there, that worker computes only them
  (a local prefill; no prefill job).
- ``plain`` ("without"): no kv-store process, and the registry's prefix-aware placement off
  (``--prefix-weight 0``: placement by load only, so never a local prefill of a cached prefix).
  Each engine keeps its own prefix cache (a prefill worker still reuses the system prompt and
  the earlier prompts it computed itself). ``--baseline no-reuse`` also turns every engine's
  prefix cache off (``--no-enable-prefix-caching``): every prompt is computed whole.
  ``--baseline routing`` is the fair one for the store itself: no kv-store process, but the
  registry's prefix-aware placement and every prefix cache on, as the store mesh has them, so
  the ratio is what the store adds to local prefix reuse.

Per turn and over turns >= 3: client TTFT p50/p99 (streamed, first token chunk) and the prompt
tokens computed, from the workers' ``/metrics`` read before and after each wave: the prefill
workers' ``kvmesh_prefill_prompt_tokens_total`` minus ``kvmesh_prefill_prefix_hit_tokens_total``
(cache and store hits; ``kvmesh_prefill_store_hit_tokens_total`` says how many came from the
store), plus, for the requests no prefill worker announced (local prefills: the mesh tap sees no
PrefillDone), their prompt tokens (the decode workers' ``kvmesh_decode_local_prompt_tokens_total``
where they count it, else as sent) minus the decode workers'
``kvmesh_decode_prefix_cache_hit_tokens_total`` (``kvmesh_decode_store_hit_tokens_total`` of them
read from the store). The figure of merit is plain / store TTFT p50
over turns >= 3 (issue #14: >= 3). Answers are compared between the two runs (greedy, so equal
unless a numeric difference between paths flipped a token).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import random
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvmesh.loadgen.bench_kv_meshes import Variant, started_meshes, variants
from kvmesh.loadgen.bench_kv_turns_report import FROM_TURN, format_report, report
from kvmesh.loadgen.multi_turn import (
    Conversation,
    MultiTurnSpec,
    TurnCounters,
    build_conversations,
    turn_figures,
)
from kvmesh.loadgen.serve_metrics import RequestRecord


@dataclass(slots=True)
class VariantRun:
    """What one mesh did: per turn, the records (conversation order) and the counters."""

    variant: Variant
    records: list[list[RequestRecord]] = field(default_factory=list)
    counters: list[TurnCounters] = field(default_factory=list)
    answers: list[list[tuple[int, ...] | None]] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        turns = []
        for t, (recs, counters) in enumerate(zip(self.records, self.counters, strict=True)):
            turns.append({"turn": t + 1, **turn_figures(recs, counters)})
        late = range(FROM_TURN - 1, len(self.records))
        late_records = [r for t in late for r in self.records[t]]
        late_counters = sum((self.counters[t] for t in late), TurnCounters())
        return {
            "mesh": self.variant.description,
            "env": dict(self.variant.env),
            "kv_store": self.variant.kv_store,
            "seconds": round(self.seconds, 2),
            "turns": turns,
            f"turns_{FROM_TURN}_on": turn_figures(late_records, late_counters)
            if late_records
            else None,
        }


# ---- one mesh -------------------------------------------------------------------------------


def scrape(url: str, timeout_s: float = 10.0) -> dict[str, float]:
    from kvmesh.loadgen import prom_text

    return prom_text.scrape(url, timeout_s=timeout_s)


def scrape_workers(metrics_urls: Mapping[str, str]) -> dict[str, dict[str, float]]:
    """Every prefill and decode worker's samples, by service name."""
    return {
        name: scrape(url)
        for name, url in metrics_urls.items()
        if name.startswith(("prefill-", "decode-"))
    }


def answer_of(tap: Any, response_id: str) -> tuple[int, ...] | None:
    """The output tokens the mesh tap saw for a request: under its id, or under the id of the
    router's retry (``<id>-r<n>``, only ever before the first token) that finished."""
    for rid in (response_id, *(k for k in tap.finished if k.startswith(f"{response_id}-r"))):
        if rid in tap.finished:
            return tuple(tap.tokens[rid])
    return None


async def drive(
    mesh: Any,
    conversations: list[Conversation],
    offsets: Sequence[float],
    run: VariantRun,
    *,
    model: str,
    timeout_s: float,
    on_turn: Any = None,
) -> None:
    """Every turn of every conversation through ``mesh``, wave by wave (module docstring)."""
    from kvmesh.loadgen.sse_client import SseEndpoint, run_requests, send_request
    from kvmesh.loadgen.workload import WorkloadPrompt

    from kvmesh.testing.mesh import MeshTap

    endpoint = SseEndpoint(mesh.url, model=model, ignore_eos=True)
    turns = len(conversations[0].user_messages)
    async with MeshTap(mesh.config.nats_url, mesh.nats_auth, mesh=mesh.mesh) as tap:
        import aiohttp

        warm = WorkloadPrompt(tuple(random.Random(7).randrange(200) for _ in range(64)), 4)
        async with aiohttp.ClientSession() as session:  # connects prefill to decode, loads code
            record = await send_request(
                session, endpoint, warm, origin=time.perf_counter(), timeout_s=timeout_s
            )
        if not record.is_ok:
            raise RuntimeError(f"the warm-up request failed: {record.error}: {record.detail}")
        started = time.perf_counter()
        for turn in range(turns):
            alive = [c for c in conversations if c.is_alive]
            prompts = [c.prompt(turn) for c in alive]
            before = await asyncio.to_thread(scrape_workers, mesh.metrics_urls)
            records, _ = await run_requests(
                endpoint, prompts, list(offsets[: len(alive)]), timeout_s=timeout_s
            )
            answers: list[tuple[int, ...] | None] = []
            local_requests = local_tokens = 0
            for conv, record in zip(alive, records, strict=True):
                answer = None
                if record.is_ok and record.response_id:
                    rid = record.response_id
                    with contextlib.suppress(TimeoutError):  # not seen: the conversation ends
                        await tap.wait_finished(rid, timeout_s=30.0)
                    answer = answer_of(tap, rid)
                    if not any(k.startswith(rid) for k in tap.prefill_done):
                        local_requests += 1
                        local_tokens += record.prompt_len
                if answer is None:
                    conv.failed_at = turn
                else:
                    conv.answers.append(answer)
                answers.append(answer)
            after = await asyncio.to_thread(scrape_workers, mesh.metrics_urls)
            run.records.append(records)
            run.answers.append(answers)
            run.counters.append(
                TurnCounters.between(
                    before, after, local_requests=local_requests, local_prompt_tokens=local_tokens
                )
            )
            if on_turn is not None:
                on_turn(run, turn)
        run.seconds = time.perf_counter() - started


def run_variant(
    mesh: Any,
    variant: Variant,
    conversations: list[Conversation],
    offsets: Sequence[float],
    args: argparse.Namespace,
) -> VariantRun:
    """The whole workload through ``mesh`` (``variant``'s)."""
    run = VariantRun(variant)

    def progress(run: VariantRun, turn: int) -> None:
        if not args.json:
            fig = turn_figures(run.records[turn], run.counters[turn])
            print(
                f"  {variant.name} turn {turn + 1}: TTFT p50 {fig['ttft_p50_s']} s, "
                f"computed {fig['computed_tokens']} of {fig['prompt_tokens']} prompt tokens, "
                f"{fig['failed']} failed",
                file=sys.stderr,
            )

    asyncio.run(
        drive(
            mesh,
            conversations,
            offsets,
            run,
            model=args.model,
            timeout_s=args.timeout_s,
            on_turn=progress,
        )
    )
    return run


# ---- the command ----------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--multi-turn (module docstring of loadgen/bench_kv_turns.py)")
    g.add_argument(
        "--multi-turn",
        action="store_true",
        help="multi-turn chat TTFT and computed prefill tokens, store + prefix routing vs without",
    )
    g.add_argument(
        "--model",
        default="kvmesh-tiny",
        help="kvmesh-tiny, a checkpoint dir, a fetchable model or a .gguf file",
    )
    g.add_argument("--conversations", type=int, default=16, help="chats sharing the system prompt")
    g.add_argument("--turns", type=int, default=8, help="turns of each conversation")
    g.add_argument("--system-len", type=int, default=2048, help="shared system prompt tokens")
    g.add_argument("--user-len", type=int, default=64, help="tokens of each new user message")
    g.add_argument("--answer-len", type=int, default=128, help="tokens of each answer")
    g.add_argument("--arrival", choices=("poisson", "gamma", "constant"), default="poisson")
    g.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="conversations per second within a wave (inf: all at once)",
    )
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma arrivals only")
    g.add_argument(
        "--baseline",
        choices=("no-store", "routing", "no-reuse"),
        default="no-store",
        help="what the plain mesh turns off (module docstring)",
    )
    g.add_argument(
        "--local-max-suffix-tokens",
        type=int,
        default=None,
        help="the store mesh's kv-registry: hand a request to the decode worker holding its "
        "prefix when at most this many tokens are left (default: the registry's, 512; 0: never, "
        "prefill workers compute the rest after reading the store)",
    )
    g.add_argument("--transport", choices=("auto", "shm", "tcp", "rdma"), default="auto")
    g.add_argument("--prefill-workers", type=int, default=1)
    g.add_argument("--decode-workers", type=int, default=1)
    g.add_argument("--prefill-nice", type=int, default=0)
    g.add_argument("--decode-pacing-ms", type=float, default=0.0)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=None,
        help="KV pool bytes of each prefill and decode worker (their default: 256 MiB)",
    )
    g.add_argument("--kv-store-capacity-gb", type=float, default=1.0)
    g.add_argument("--timeout-s", type=float, default=600.0, help="per request")
    g.add_argument("--startup-timeout-s", type=float, default=300.0)


def load_tokenizer(model: str) -> Any:
    from kvmesh.shared.model.checkpoint_info import load_config_and_tokenizer

    return load_config_and_tokenizer(model)[1]


def run(args: argparse.Namespace) -> int:
    from kvmesh.loadgen.arrivals import ArrivalProcess, arrival_times
    from kvmesh.shared.model.model_ref import model_path

    args.model = model_path(args.model, "kvmesh bench kv")

    try:
        spec = MultiTurnSpec(
            args.conversations,
            args.turns,
            args.system_len,
            args.user_len,
            args.answer_len,
            args.seed,
        )
        process = ArrivalProcess(args.arrival, args.request_rate, args.burstiness)
    except ValueError as exc:
        print(f"kvmesh bench kv --multi-turn: {exc}", file=sys.stderr)
        return 2
    offsets = arrival_times(process, spec.conversations, random.Random(f"{args.seed}:arrivals"))
    runs = []
    both = variants(args.baseline, args.local_max_suffix_tokens)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        loading = pool.submit(load_tokenizer, args.model)  # while the meshes start
        with started_meshes(both, args) as meshes:
            tokenizer = loading.result()
            for variant, mesh in zip(both, meshes, strict=True):
                if not args.json:
                    print(
                        f"kvmesh bench kv: {variant.name}: {variant.description}", file=sys.stderr
                    )
                conversations = build_conversations(spec, tokenizer)  # the same: same seed
                runs.append(run_variant(mesh, variant, conversations, offsets, args))
    result = report(spec, args, runs)
    if args.json:
        print(json.dumps(result))
    else:
        print(format_report(result))
    failed = sum(t["failed"] for r in result["runs"].values() for t in r["turns"])
    return 1 if failed else 0
