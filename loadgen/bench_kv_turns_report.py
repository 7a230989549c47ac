"""``kvmesh bench kv --multi-turn``'s report: the plain and store meshes' figures per turn and
over the later turns, their ratios, and whether their answers agree (JSON and a table)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvmesh.loadgen.multi_turn import MultiTurnSpec, ratio

if TYPE_CHECKING:
    from kvmesh.loadgen.bench_kv_turns import VariantRun

FROM_TURN = 3  # the figures are over turns >= 3 (1-based)


def report(spec: MultiTurnSpec, args: argparse.Namespace, runs: list[VariantRun]) -> dict[str, Any]:
    plain, store = runs
    by_name = {r.variant.name: r.to_dict() for r in runs}
    late = f"turns_{FROM_TURN}_on"
    p, s = by_name["plain"][late] or {}, by_name["store"][late] or {}
    pairs = [
        (a, b)
        for turn_a, turn_b in zip(plain.answers, store.answers, strict=False)
        for a, b in zip(turn_a, turn_b, strict=False)
        if a is not None and b is not None
    ]
    return {
        "workload": {
            "model": args.model,
            "conversations": spec.conversations,
            "turns": spec.turns,
            "system_len": spec.system_len,
            "user_len": spec.user_len,
            "answer_len": spec.answer_len,
            "max_prompt_len": spec.max_prompt_len,
            "arrival": args.arrival,
            "request_rate": "inf" if args.request_rate == float("inf") else args.request_rate,
            "burstiness": args.burstiness,
            "seed": args.seed,
            "transport": args.transport,
            "prefill_workers": args.prefill_workers,
            "decode_workers": args.decode_workers,
            "baseline": args.baseline,
            "local_max_suffix_tokens": args.local_max_suffix_tokens,
        },
        "runs": by_name,
        f"ttft_p50_plain_over_store_{late}": ratio(p.get("ttft_p50_s"), s.get("ttft_p50_s")),
        f"ttft_p99_plain_over_store_{late}": ratio(p.get("ttft_p99_s"), s.get("ttft_p99_s")),
        f"computed_tokens_plain_over_store_{late}": ratio(
            p.get("computed_tokens"), s.get("computed_tokens")
        ),
        "answers_compared": len(pairs),
        "answers_equal": sum(1 for a, b in pairs if a == b),
    }


def format_report(result: Mapping[str, Any]) -> str:
    w = result["workload"]
    lines = [
        f"{w['conversations']} conversations x {w['turns']} turns, system prompt {w['system_len']}"
        f", user {w['user_len']}, answer {w['answer_len']} tokens ({w['model']}, "
        f"{w['arrival']} @ {w['request_rate']} conv/s per wave)",
        f"{'turn':>5} {'mesh':<6} {'TTFT p50':>9} {'TTFT p99':>9} {'prompt tok':>11} "
        f"{'computed':>9} {'store hit':>9} {'local':>6} {'failed':>6}",
    ]
    late = f"turns_{FROM_TURN}_on"

    def row(label: str, name: str, fig: Mapping[str, Any]) -> str:
        s = lambda v: "-" if v is None else f"{v:.3f}"
        store_hits = fig["prefill"]["store_hit_tokens"] + fig["local_prefill"]["store_hit_tokens"]
        return (
            f"{label:>5} {name:<6} {s(fig['ttft_p50_s']):>9} {s(fig['ttft_p99_s']):>9} "
            f"{fig['prompt_tokens']:>11} {fig['computed_tokens']:>9} "
            f"{store_hits:>9} {fig['local_prefill']['requests']:>6} "
            f"{fig['failed']:>6}"
        )

    runs = result["runs"]
    for t in range(w["turns"]):
        for name in ("plain", "store"):
            turns = runs[name]["turns"]
            if t < len(turns):
                lines.append(row(str(t + 1), name, turns[t]))
    for name in ("plain", "store"):
        if runs[name][late]:
            lines.append(row(f">={FROM_TURN}", name, runs[name][late]))
    lines.append(
        f"plain / store over turns >= {FROM_TURN}: TTFT p50 "
        f"{result[f'ttft_p50_plain_over_store_{late}']}x (goal >= 3), p99 "
        f"{result[f'ttft_p99_plain_over_store_{late}']}x, computed tokens "
        f"{result[f'computed_tokens_plain_over_store_{late}']}x; answers equal "
        f"{result['answers_equal']} of {result['answers_compared']}"
    )
    return "\n".join(lines)
