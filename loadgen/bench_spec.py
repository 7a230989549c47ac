"""``kvmesh bench spec``: output tokens/s of the mesh with speculative decoding against the same
mesh without drafts, in one run.

For each drafting configuration (method, K, tree) a local mesh (``kvmesh up``'s Launcher with
``--draft``) serves ``batch`` concurrent greedy requests at each batch size, and a mesh without
drafts serves the same requests first and again last: the baseline is the faster of its two
runs, so that a box whose load drops while the drafted meshes run does not flatter them. Acceptance and tokens per verify step come
from the decode worker's own counters (``kvmesh_decode_spec_*``), read before and after each
load. Two rates per load: ``tok_s``, every output token over the whole load (the prompts' prefill
included), and ``decode_tok_s``, the tokens after each request's first over the time from the
first first-token to the last end (``decode_phase``): what drafting speeds up, without the
prefill that drafting does not touch. ``--workload`` (loadgen/spec_workloads.py): ``quote`` (the
default) quotes a long passage and asks for it again, as plain text: prompt lookup (n-gram) can
propose what the output repeats (kvmesh-tiny's random weights copy only when their greedy output
loops); on a trained model, ``chat`` (questions, answers of new text) and ``copy`` (answers that
copy from the prompt: repeat a text, edit code) in its chat template, stopping at EOS.

Also the harness of tests/mesh/test_mesh_spec.py: ``spec_mesh`` (a local mesh with draft workers)
and ``spec_counters`` (the decode worker's speculative counters).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvmesh.loadgen.spec_workloads import WORKLOADS

from kvmesh.testing.mesh import launched

MODEL = "kvmesh-tiny"
SPEC_COUNTERS = {
    "positions": "kvmesh_decode_spec_draft_tokens",
    "nodes": "kvmesh_decode_spec_draft_nodes",
    "accepted": "kvmesh_decode_spec_accepted_tokens",
    "verify_steps": "kvmesh_decode_spec_verify_step_seconds_count",
    "tokens_per_step_sum": "kvmesh_decode_spec_tokens_per_step_sum",
    "tokens_per_step_count": "kvmesh_decode_spec_tokens_per_step_count",
}


@dataclass(frozen=True, slots=True)
class DraftSetup:
    """One drafting configuration of ``kvmesh up --draft``."""

    method: str
    k: int = 4
    tree: tuple[int, ...] = ()
    exit_layer: int = 1
    draft_model: str | None = None


@contextlib.contextmanager
def spec_mesh(
    draft: DraftSetup | None,
    transport: str = "shm",
    *,
    model: str = MODEL,
    env: Mapping[str, str] | None = None,
    local_prefill_threshold: int = 0,
    startup_timeout_s: float = 180.0,
    log_level: str = "warning",
    cores: int | None = None,
) -> Iterator[Any]:
    """A disaggregated local mesh (one prefill, one decode, the router; one draft worker with
    ``draft``) on a fresh nats-server, in child processes; yields the Launcher. ``env``: KVMESH_*
    settings every service inherits. Synchronous (use it from sync fixtures)."""
    from kvmesh.testing.mesh import mesh_config

    config = mesh_config(
        model=model,
        mode="disagg",
        transport=transport,
        local_prefill_threshold=local_prefill_threshold,
        log_level=log_level,
        startup_timeout_s=startup_timeout_s,
        cores=cores,
        draft=draft.method if draft else None,
        num_speculative_tokens=draft.k if draft else 4,
        draft_tree=draft.tree if draft else (),
        draft_exit_layer=draft.exit_layer if draft else 1,
        draft_model=draft.draft_model if draft else None,
    )
    with launched(config, env) as launcher:
        yield launcher


def spec_counters(launcher: Any, worker: str = "decode-0") -> dict[str, float]:
    """The decode worker's speculative counters, read off its /metrics."""
    from kvmesh.loadgen import prom_text

    values = prom_text.scrape(launcher.metrics_urls[worker], timeout_s=5)
    return {
        key: values.get(name, values.get(name + "_total", 0.0))
        for key, name in SPEC_COUNTERS.items()
    }


def decode_phase(records: Sequence[Any]) -> tuple[int, float]:
    """(tokens, seconds) of a load's decode phase: the output tokens after each request's first,
    over the time from the earliest first token to the latest end."""
    starts = [r.chunk_times[0] for r in records]
    return sum(r.num_output_tokens - 1 for r in records), max(r.end_s for r in records) - min(
        starts
    )


async def _load(
    url: str,
    prompts: list[list[int]],
    max_tokens: int,
    model: str = MODEL,
    ignore_eos: bool = True,
) -> tuple[int, float, int, float]:
    """All prompts at once (greedy, streamed) to ``model``; returns (output tokens, seconds,
    decode-phase tokens, decode-phase seconds)."""
    import aiohttp
    from kvmesh.loadgen.sse_client import SseEndpoint, send_request
    from kvmesh.loadgen.workload import WorkloadPrompt

    endpoint = SseEndpoint(url, model, ignore_eos=ignore_eos)
    async with aiohttp.ClientSession() as session:
        origin = time.perf_counter()
        records = await asyncio.gather(
            *(
                send_request(
                    session,
                    endpoint,
                    WorkloadPrompt(tuple(p), max_tokens),
                    origin=origin,
                    timeout_s=600,
                )
                for p in prompts
            )
        )
        seconds = time.perf_counter() - origin
    failed = [r for r in records if not r.is_ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0].error}: {failed[0].detail}")
    return (sum(r.num_output_tokens for r in records), seconds, *decode_phase(records))


@dataclass(frozen=True, slots=True)
class Workload:
    """What every mesh of one run serves: ``--workload``'s prompts of the model's tokenizer."""

    name: str
    tokenizer: Any
    max_tokens: int
    passage_len: int

    @property
    def ignore_eos(self) -> bool:
        # quote: as many tokens as asked (the seeded figures); chat and copy: the real answers
        return self.name == "quote"

    def prompts(self, num: int, seed: int) -> list[list[int]]:
        from kvmesh.loadgen.spec_workloads import workload_prompts

        return workload_prompts(self.name, self.tokenizer, num, self.passage_len, seed)


def measure(launcher: Any, batches: list[int], workload: Workload) -> dict[int, dict[str, float]]:
    """Per batch size: tok/s and the speculative counters' change over its load."""
    out = {}
    model = launcher.config.model
    eos = workload.ignore_eos
    asyncio.run(_load(launcher.url, workload.prompts(1, seed=99), 4, model, eos))  # warm-up
    for batch in batches:
        before = spec_counters(launcher)
        prompts = workload.prompts(batch, seed=batch)
        tokens, seconds, decode_tokens, decode_seconds = asyncio.run(
            _load(launcher.url, prompts, workload.max_tokens, model, eos)
        )
        after = spec_counters(launcher)
        delta = {k: after[k] - before[k] for k in after}
        out[batch] = {"tok_s": tokens / seconds, "decode_tok_s": decode_tokens / decode_seconds}
        out[batch].update(delta)
    return out


def draft_setups(
    methods: str,
    k: int,
    tree: str,
    tree_methods: str,
    exit_layer: int,
    draft_model: str | None = None,
) -> list[DraftSetup]:
    """The drafting configurations of ``--methods`` (chains of K), each method of
    ``--tree-methods`` also as ``--tree`` (K: its depth). ``draft_model``: the checkpoint of
    ``model`` (the target itself when None: every draft is then the target's own greedy token,
    so a verify step must give K + 1 tokens, a check of the accounting)."""
    widths = tuple(int(w) for w in tree.split(",")) if tree else ()
    setups = []
    for method in methods.split(","):
        extra = {
            "exit_layer": exit_layer,
            "draft_model": draft_model if method == "model" else None,
        }
        setups.append(DraftSetup(method, k, **extra))
        if widths and method in tree_methods.split(","):
            setups.append(DraftSetup(method, len(widths), widths, **extra))
    return setups


def run(args: argparse.Namespace) -> int:
    from kvmesh.shared.model.model_ref import model_path

    args.model = model_path(args.model, "kvmesh bench spec")
    batches = [int(b) for b in args.batches.split(",")]
    setups = draft_setups(
        args.methods,
        args.k,
        args.tree,
        args.tree_methods,
        args.exit_layer,
        draft_model=args.draft_model or args.model,
    )
    env = {"KVMESH_NUM_BLOCKS": "2048"}
    if args.min_step_interval_ms:  # every mesh, the baselines too
        env["KVMESH_MIN_STEP_INTERVAL_MS"] = str(args.min_step_interval_ms)
    from kvmesh.shared.model.checkpoint_info import load_config_and_tokenizer

    _, tokenizer = load_config_and_tokenizer(args.model)
    measure_args = (batches, Workload(args.workload, tokenizer, args.max_tokens, args.passage_len))
    with spec_mesh(None, args.transport, model=args.model, env=env) as mesh:
        first = measure(mesh, *measure_args)
    drafted = []
    for setup in setups:
        with spec_mesh(setup, args.transport, model=args.model, env=env) as mesh:
            drafted.append((setup, measure(mesh, *measure_args)))
    with spec_mesh(None, args.transport, model=args.model, env=env) as mesh:
        last = measure(mesh, *measure_args)
    baseline = {b: max(first[b], last[b], key=lambda row: row["tok_s"]) for b in batches}
    decode_baseline = {b: max(first[b]["decode_tok_s"], last[b]["decode_tok_s"]) for b in batches}
    results = []
    for setup, got in drafted:
        for batch in batches:
            row = got[batch]
            results.append(
                {
                    "method": setup.method,
                    "k": setup.k,
                    "tree": ",".join(map(str, setup.tree)),
                    "batch": batch,
                    "acceptance": round(row["accepted"] / row["positions"], 4)
                    if row["positions"]
                    else None,
                    "tokens_per_step": round(
                        row["tokens_per_step_sum"] / row["tokens_per_step_count"], 3
                    )
                    if row["tokens_per_step_count"]
                    else None,
                    "tok_s": round(row["tok_s"], 1),
                    "baseline_tok_s": round(baseline[batch]["tok_s"], 1),
                    "speedup": round(row["tok_s"] / baseline[batch]["tok_s"], 3),
                    "decode_tok_s": round(row["decode_tok_s"], 1),
                    "baseline_decode_tok_s": round(decode_baseline[batch], 1),
                    "decode_speedup": round(row["decode_tok_s"] / decode_baseline[batch], 3),
                }
            )
    report = {
        "model": args.model,
        "workload": args.workload,
        "transport": args.transport,
        "baseline_runs_tok_s": {
            b: [round(first[b]["tok_s"], 1), round(last[b]["tok_s"], 1)] for b in batches
        },
        "results": results,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        cols = ("method", "k", "tree", "batch", "acceptance", "tokens_per_step", "tok_s")
        cols += ("baseline_tok_s", "speedup", "decode_tok_s", "decode_speedup")
        print("  ".join(cols))
        for r in results:
            print("  ".join(str(r[c]) for c in cols))
    sys.stdout.flush()
    return 0


def register_spec(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "spec", help="speculative decoding: mesh tokens/s with each draft method vs without"
    )
    p.add_argument(
        "--model",
        default=MODEL,
        help="kvmesh-tiny, a checkpoint dir, a fetchable model or a .gguf file",
    )
    p.add_argument("--transport", default="shm", choices=("auto", "shm", "tcp"))
    p.add_argument("--methods", default="ngram,early-exit", help="comma-separated draft methods")
    p.add_argument("--k", type=int, default=4, help="draft tokens per proposal")
    p.add_argument(
        "--tree", default="2,2,1,1", help="--tree-methods also as this tree ('' to skip)"
    )
    p.add_argument(
        "--tree-methods",
        default="ngram",
        help="comma-separated methods of --methods also run with --tree (e.g. ngram,early-exit)",
    )
    p.add_argument("--exit-layer", type=int, default=1)
    p.add_argument(
        "--draft-model",
        default=None,
        help="--methods model: the draft checkpoint (default: the target itself, whose drafts "
        "are all accepted: K + 1 tokens per verify step)",
    )
    p.add_argument(
        "--min-step-interval-ms",
        type=float,
        default=0.0,
        help="pace every decode worker's steps (baselines too), as a bigger target's would "
        "take: a draft model as costly as the target itself keeps up only then",
    )
    p.add_argument("--batches", default="1,8")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--passage-len", type=int, default=600, help="quote: characters of the passage")
    p.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="quote",
        help="quote: a random-word passage to repeat, plain text, EOS ignored (the seeded "
        "figures); chat: questions in the chat template; copy: answers that copy from the prompt "
        "(repeat a text, edit code); chat and copy stop at EOS (loadgen/spec_workloads.py)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)
    return p
