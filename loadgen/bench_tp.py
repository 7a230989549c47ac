"""``kvmesh bench tp``: prefill at TP N (N processes, one core and one thread each) against TP1
with N threads on the same cores (docs/tp.md).

The issue's question: does tensor parallelism cut a prompt's prefill time on CPU cores, where
every layer pays two all-reduces (gloo over loopback TCP) that threads sharing memory do not?
TP1 on one thread is measured too, as the unit both are compared with. Each prefills the same
prompt of ``--prompt-len`` tokens with the same engine (one chunk),
``--repeats`` times after a warm-up; each figure is the best wall time (rank 0 times the TP
runs, the ranks starting each together after a barrier). On a machine shared with other work
the figures move with the neighbours: the ratio of two runs made back to back is what to read.
The first token of TP N must equal TP1's (checked).

Default model: a seeded checkpoint of the load issue's 23M shape (hidden 512, 8 layers, 8 heads,
2 KV heads), written to a temp folder; ``--model`` takes kvmesh-tiny or a checkpoint folder.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import tempfile
import time
from pathlib import Path
from typing import Any


def register_tp(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "tp", help="prefill at TP N (N processes, a core each) vs TP1 with N threads"
    )
    p.add_argument("--model", default=None, help="kvmesh-tiny or a checkpoint folder")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_tp)
    return p


def run_tp(args: argparse.Namespace) -> int:
    if args.tp < 2 or args.repeats < 1 or args.prompt_len < 1:
        raise SystemExit("kvmesh bench tp: --tp must be at least 2, --repeats and --prompt-len 1+")
    cores = sorted(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or _seeded_model(tmp)
        one = _run_ranks(model, 1, 1, args.prompt_len, args.repeats, cores[:1])
        tp1 = _run_ranks(model, 1, args.tp, args.prompt_len, args.repeats, cores)
        tpn = _run_ranks(model, args.tp, 1, args.prompt_len, args.repeats, cores)
    name = model if args.model else "seeded-23m"
    result = tp_report(name, args.tp, args.prompt_len, one, tp1, tpn)
    print(json.dumps(result, indent=2) if args.json else format_report(result))
    return 0 if result["same_first_token"] else 1


def tp_report(
    model: str,
    tp: int,
    prompt_len: int,
    one: dict[str, Any],
    tp1: dict[str, Any],
    tpn: dict[str, Any],
) -> dict[str, Any]:
    """The bench's figures from the runs' results (``best_s``, ``first_token``): TP1 on one
    thread (the unit), TP1 on ``tp`` threads, TP ``tp``."""
    return {
        "model": model,
        "prompt_len": prompt_len,
        "tp": tp,
        "tp1_threads": tp,
        "one_thread_prefill_s": one["best_s"],
        "tp1_prefill_s": tp1["best_s"],
        "tp_prefill_s": tpn["best_s"],
        "speedup": tp1["best_s"] / tpn["best_s"],
        "speedup_over_one_thread": one["best_s"] / tpn["best_s"],
        "same_first_token": one["first_token"] == tp1["first_token"] == tpn["first_token"],
    }


def format_report(r: dict[str, Any]) -> str:
    tp = r["tp"]
    rows = [
        ("TP1, 1 thread", r["one_thread_prefill_s"]),
        (f"TP1, {r['tp1_threads']} threads", r["tp1_prefill_s"]),
        (f"TP{tp}, {tp} processes x 1 thread", r["tp_prefill_s"]),
    ]
    lines = [f"prefill of {r['prompt_len']} tokens ({r['model']}), best of the repeats:"]
    lines += [f"  {name:32} {seconds * 1e3:9.1f} ms" for name, seconds in rows]
    same = "the same" if r["same_first_token"] else "DIFFERS"
    lines.append(
        f"  TP{tp} against TP1 on {tp} threads: x{r['speedup']:.2f}, against one thread: "
        f"x{r['speedup_over_one_thread']:.2f}; first token {same}"
    )
    return "\n".join(lines)


def _seeded_model(tmp: str) -> str:
    from kvmesh.shared.model.seeded import SeededShape, write_seeded_checkpoint

    path = Path(tmp) / "seeded-23m"
    write_seeded_checkpoint(path, SeededShape(), seed=1)
    return str(path)


def _run_ranks(
    model: str, tp: int, threads: int, prompt_len: int, repeats: int, cores: list[int]
) -> dict[str, Any]:
    """Run ``tp`` rank processes (each ``threads`` threads, on its own cores) and return rank
    0's result."""
    from kvmesh.shared.config.ports import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    per_rank = max(1, len(cores) // tp)
    procs = []
    for rank in range(tp):
        own = cores[rank * per_rank : (rank + 1) * per_rank] or cores[rank % len(cores) :][:1]
        args = (model, rank, tp, threads, port, prompt_len, repeats, own, queue)
        procs.append(ctx.Process(target=_rank_main, args=args, daemon=True))
    for p in procs:
        p.start()
    try:
        result = queue.get(timeout=600)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return result


def _rank_main(
    model_path: str,
    rank: int,
    tp: int,
    threads: int,
    port: int,
    prompt_len: int,
    repeats: int,
    cores: list[int],
    queue: Any,
) -> None:
    import random

    import torch
    import torch.distributed as dist
    from kvmesh.shared.engine.llm_engine import EngineConfig, LLMEngine
    from kvmesh.shared.model.loader import load_model
    from kvmesh.shared.model.tensor_parallel import shard_model
    from kvmesh.shared.text.sampling import SamplingOptions

    os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads)
    model, _ = load_model(model_path, torch.float32)
    if tp > 1:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp
        )
        shard_model(model)
    config = EngineConfig(max_num_batched_tokens=max(2048, prompt_len), enable_prefix_caching=False)
    engine = LLMEngine(model, None, config)
    vocab = model.config.vocab_size
    prompt = [random.Random(0).randrange(vocab) for _ in range(prompt_len)]
    params = SamplingOptions(max_tokens=1, temperature=0, ignore_eos=True)
    times = []
    first_token = None
    for i in range(repeats + 1):  # the first is a warm-up
        if tp > 1:
            dist.barrier()
        t0 = time.perf_counter()
        (tokens,) = engine.generate([prompt], params)
        if i:
            times.append(time.perf_counter() - t0)
        first_token = tokens[0]
    if rank == 0:
        queue.put({"best_s": min(times), "first_token": first_token})
    if tp > 1:
        dist.destroy_process_group()
