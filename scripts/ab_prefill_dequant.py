"""Prefill with the C dequantizer (kernels/cpu_dequant.c) against torch's, in one process.

    python scripts/ab_prefill_dequant.py MODEL [--threads N] [--prompt-len 1024] [--runs 5]

MODEL: a checkpoint with weights kept as stored (``smollm2-135m-instruct``, or one of
``scripts/make_gguf_variants.py``'s). The two take turns on the same engine and prompts of the
same length (one run each per round), so drift on a shared box falls on both; it prints each
one's median and range and the ratio. The clock is the process's CPU time at 1 thread, wall
time at more (OpenMP workers spin between calls). Issue 41; the figures are in docs/models.md.
"""

from __future__ import annotations

import argparse
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)

    import torch
    from kvmesh.kernels.cpu_bindings import CpuOps
    from kvmesh.shared.engine.llm_engine import EngineConfig, LLMEngine
    from kvmesh.shared.model.loader import load_model
    from kvmesh.shared.model.quant import dequantize
    from kvmesh.shared.text.sampling import SamplingOptions

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    engine = LLMEngine(model, tokenizer, EngineConfig(enable_prefix_caching=False))
    params = SamplingOptions(max_tokens=1, temperature=0, ignore_eos=True)
    generator = torch.Generator().manual_seed(0)
    clock = time.process_time if args.threads == 1 else time.perf_counter
    in_c = CpuOps.dequantize

    def prefill(n: int) -> float:
        prompt = torch.randint(100, 40000, (n,), generator=generator).tolist()
        start = clock()
        engine.generate([prompt], params)
        return clock() - start

    prefill(256)  # warm-up: the kernels built, the pools touched
    times: dict[str, list[float]] = {"C": [], "torch": []}
    try:
        for _ in range(args.runs):
            for name in times:
                CpuOps.dequantize = in_c if name == "C" else (lambda self, w: dequantize(w))
                times[name].append(prefill(args.prompt_len))
    finally:
        CpuOps.dequantize = in_c
    medians = {}
    for name, values in times.items():
        values.sort()
        medians[name] = values[len(values) // 2]
        print(
            f"{name:>5} dequantizer: {args.prompt_len / medians[name]:.0f} tok/s "
            f"(median {medians[name]:.3f} s, range {values[0]:.3f}-{values[-1]:.3f} s)"
        )
    print(f"C against torch: {medians['torch'] / medians['C']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
