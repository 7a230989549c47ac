"""``kvmesh bench engine``'s table: tok/s of every system, kvmesh's ratios against each, the
bytes a decode step reads and the memory each model adds."""

from __future__ import annotations


def print_table(results: dict) -> None:
    """The human-readable form: tok/s of every system, then kvmesh's ratios against each."""
    config = results["config"]
    reference = config["reference"]
    systems = [s for s in ("kvmesh", reference, "llama.cpp") if s in results]
    threads = config["threads"]
    kernels = "C kernels" if config["cpu_kernels"] else "pure torch"
    match = f"greedy tokens match {reference}: {config['greedy_outputs_match']}"
    if config["greedy_outputs_match_llama_cpp"] is not None:
        match += f", llama.cpp: {config['greedy_outputs_match_llama_cpp']}"
        match += f" (llama.cpp weights: {config['llama_weights']}, KV cache: "
        match += f"{config['llama_kv_cache']})"
    print(
        f"model {config['model']} (weights {config['weights']}), {threads} "
        f"thread{'s' if threads > 1 else ''}, {config['clock']} clock, kvmesh on {kernels}; {match}"
    )
    against = [(reference, results["ratios"])]
    if "ratios_llama_cpp" in results:
        against.append(("llama.cpp", results["ratios_llama_cpp"]))
    header = "".join(f"{s:>16}" for s in systems)
    header += "".join(f"{'vs ' + name:>17}" for name, _ in against)
    print(f"{'tok/s':26}{header}")

    def row(label: str, values: list, ratios: list) -> None:
        cells = "".join(f"{'-' if v is None else v:>16}" for v in values)
        cells += "".join(f"{'-' if r is None else r:>17}" for r in ratios)
        print(f"{label:26}{cells}")

    row(
        f"prefill ({config['prompt_len']} tokens)",
        [results[s]["prefill_tok_s"] for s in systems],
        [r["prefill"] for _, r in against],
    )
    for b in results["kvmesh"]["decode_tok_s"]:
        row(
            f"decode batch {b}",
            [results[s]["decode_tok_s"].get(b) for s in systems],
            [r["decode"].get(b) for _, r in against],
        )
    band = results.get("bandwidth")
    if band:
        print(
            f"bytes a decode step reads per token (MB) and GB/s at that rate; memcpy "
            f"{band['memcpy_gb_s']} GB/s (read + write) in this run"
        )
        for s in systems:
            if s not in band:
                continue
            cells = ", ".join(
                f"batch {b}: {v['mb_per_token']} MB, {v['gb_s']} GB/s "
                f"({v['of_memcpy']:.0%} of memcpy)"
                for b, v in band[s]["decode"].items()
            )
            print(f"  {s} (KV {band[s]['kv_dtype']}): {cells}")
    memory = results.get("memory_mb")
    if memory:
        kv_mb = memory["kvmesh"]
        row(
            "memory added (RSS MB)",
            [memory.get(s) for s in systems],
            [round(kv_mb / memory[name], 2) if name in memory else None for name, _ in against],
        )
