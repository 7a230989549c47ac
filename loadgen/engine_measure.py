"""How ``kvmesh bench engine`` times its systems: after a warm-up the systems alternate, so that
load from other processes hits all alike; prefill tok/s the best of the repeats, decode tok/s
at each batch size the batch over the median step of all repeats; and kvmesh's ratios."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

# cpu: the process's CPU time, which counts llama.cpp's compute wherever its library runs it
CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.process_time, "wall": time.perf_counter}


def _best_pair(
    fns: dict[str, Callable[[], Any]], repeats: int, clock: Callable[[], float]
) -> dict[str, float]:
    """Best time of each fn over ``repeats`` runs after one warm-up; the fns alternate so
    that load from other processes hits both alike."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = clock()
            fn()
            best[name] = min(best[name], clock() - t0)
    return best


def measure(
    runners: dict[str, Any],
    prompt: list[int],
    decode_prompts: dict[int, list[list[int]]],
    n: int,
    repeats: int,
    clock: Callable[[], float],
) -> dict[str, dict]:
    prefill = _best_pair(
        {k: lambda r=r: r.generate([prompt], 1) for k, r in runners.items()}, repeats, clock
    )
    results: dict[str, dict] = {
        k: {"prefill_tok_s": round(len(prompt) / prefill[k], 1), "decode_tok_s": {}}
        for k in runners
    }
    for b, ps in decode_prompts.items():
        # llama.cpp's binding decodes one sequence: it runs the batch sizes it has
        able = {k: r for k, r in runners.items() if getattr(r, "max_batch", b) >= b}
        steps: dict[str, list[float]] = {k: [] for k in able}
        for rep in range(repeats + 1):
            for k, r in able.items():
                times = r.decode_step_times(ps, n, clock)
                assert len(times) == n - 1, (k, len(times))
                if rep:  # the first round is the warm-up
                    steps[k] += times
        for k in able:
            results[k]["decode_tok_s"][str(b)] = round(b / statistics.median(steps[k]), 1)
    return results


def ratios(a: dict, b: dict) -> dict:
    """a's tok/s over b's: prefill, and decode at the batch sizes both ran."""
    return {
        "prefill": round(a["prefill_tok_s"] / b["prefill_tok_s"], 2),
        "decode": {
            k: round(v / b["decode_tok_s"][k], 2)
            for k, v in a["decode_tok_s"].items()
            if k in b["decode_tok_s"]
        },
    }
