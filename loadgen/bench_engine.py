"""``kvmesh bench engine``: kvmesh's LLMEngine vs transformers' ``generate`` on the same weights
(or, for weights kept as stored, vs kvmesh's own float32 path), and llama.cpp.

Both run in this process with ``torch.set_num_threads(--threads)`` (1 by default), on the same
random prompts, producing the same number of tokens (EOS ignored by both). For kvmesh-tiny the
weights are exported to a Hugging Face directory in a temp folder so transformers loads the
identical tensors.

- prefill tok/s: prompt of ``--prompt-len`` tokens (2048), time to the first token.
- decode tok/s at batch B: B prompts of ``--decode-prompt-len`` tokens, N new tokens each; every
  decode step is timed (kvmesh: each ``step()``; transformers: between consecutive calls of a
  logits processor, i.e. one full generation step), prefill excluded. B / median step time.

Times are CPU time of the benchmarking thread by default (``--clock wall`` for elapsed time): on
a machine shared with other work, wall time mostly measures the neighbours. Runs alternate
between the two systems after a warm-up: prefill takes the best of ``--repeats``,
decode the median over all steps of all repeats, so bursts of load from other processes hit both
alike and move neither figure much.

kvmesh decodes float32 on the CPU through the C kernels of ``kernels/`` (each decoder layer of a
decode step one call, ``cpu_layer.c``) when the machine can build them; ``--no-cpu-kernels``
measures its pure-torch path instead.

``--against llama.cpp`` adds llama.cpp (``loadgen/llamacpp_runner.py``) on the same checkpoint
converted to GGUF in the dtype kvmesh runs, with the same threads, prompts and lengths: prefill
and batch-1 decode against it (llama.cpp's Python binding decodes one sequence), every batch
size against transformers, and llama.cpp's greedy tokens compared with kvmesh's.
``--llama-weights q8_0`` or ``FILE.gguf`` runs llama.cpp in the formats its users run instead
(8-bit blocks, or a quantized file as downloaded) while kvmesh runs its float32 checkpoint.
llama.cpp decodes a batch above one as llama-server's parallel slots do: one ``llama_decode``
of one token per sequence a step (``llamacpp_runner.BatchedDecode``).

Weights as stored (a checkpoint that keeps Q8_0/Q4_0/Q4_1 blocks, such as the fetched SmolLM2
or a ``.gguf`` given as ``--model``): transformers cannot read them, so the reference measured in
the same run is kvmesh's engine on the same checkpoint dequantized to float32 (``kvmesh-float32``
in the results), and ``--llama-weights same`` is the GGUF the checkpoint was imported from (kept
beside it by ``kvmesh model fetch``). ``--memory`` adds the resident memory each system's model
adds to a fresh process (``engine_rss.py``).

``--kv-cache-dtype`` sets kvmesh's KV pool as the workers' flag does (the reference keeps its
model's dtype): ``float16`` is llama.cpp's default KV type. Every run also reports the bytes a
decode step moves (``decode_bytes``: each weight the step reads once, the LM head's included, plus
the KV of every sequence's context at the middle of the timed steps) per token and as GB/s at the
measured step time, beside ``memcpy``'s bandwidth measured in the same run on the same threads
(``memcpy_gb_s``: a copy of 256 MiB, bytes read plus bytes written per second, best of 5, on
the run's clock): how close decode comes to the memory-bandwidth limit.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path
from typing import Any

from kvmesh.loadgen.engine_bandwidth import bandwidth, memcpy_gb_s
from kvmesh.loadgen.engine_measure import CLOCKS, measure, ratios
from kvmesh.loadgen.engine_runners import HFRunner, KvmeshRunner, export_tiny_to_hf, stored_formats
from kvmesh.loadgen.engine_table import print_table

AGAINST = ("transformers", "llama.cpp")
# the engine's KV_CACHE_DTYPES (shared/engine/config.py imports torch: not at parser building)
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3", "float16", "bfloat16", "float32")


def register_engine(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "engine", help="prefill/decode tokens/s: kvmesh vs transformers generate (and llama.cpp)"
    )
    p.add_argument(
        "--model",
        default="kvmesh-tiny",
        help="kvmesh-tiny, a checkpoint dir, a fetchable model or a .gguf file",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--decode-prompt-len", type=int, default=64)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of both engines (and of kvmesh's C decode attention); more than one "
        "needs --clock wall",
    )
    p.add_argument(
        "--against",
        choices=AGAINST,
        default="transformers",
        help="llama.cpp: also run llama.cpp (llama-cpp-python, `make bench-deps`) on the "
        "checkpoint converted to GGUF (or --llama-weights FILE); the reference (transformers, "
        "or kvmesh's float32 path for weights kept as stored) always runs",
    )
    p.add_argument(
        "--gguf-converter",
        default=None,
        help="llama.cpp's convert_hf_to_gguf.py with its conversion/ and gguf-py/ folders "
        "(default: $KVMESH_LLAMA_CPP_CONVERTER, else where `make bench-deps` puts it)",
    )
    p.add_argument(
        "--llama-kv-cache",
        choices=("same", "f16"),
        default="same",
        help="llama.cpp's KV cache type: same (kvmesh's dtype, equal precision; default) or f16 "
        "(llama.cpp's own default, fewer bytes: the faster llama.cpp on most CPUs)",
    )
    p.add_argument(
        "--llama-weights",
        default="same",
        metavar="same|q8_0|FILE.gguf",
        help="llama.cpp's weights: same (converted to kvmesh's dtype: like for like; default; "
        "for weights kept as stored, the GGUF they were imported from), "
        "q8_0 (converted to llama.cpp's 8-bit blocks), or a GGUF file run as it is (e.g. the "
        "Q4_1 file `kvmesh model fetch` keeps beside the checkpoint it imported); kvmesh runs "
        "--model in its own dtype",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="kvmesh's KV cache dtype, as the workers' flag: auto (the model's; float16 for "
        "weights kept quantized), float16 or "
        "bfloat16 (half of float32's bytes: llama.cpp's default is f16), int8, fp8_e4m3, float32",
    )
    p.add_argument(
        "--no-cpu-kernels",
        dest="cpu_kernels",
        action="store_false",
        help="run kvmesh on its pure-torch path, without the C decode kernels of kernels/cpu_ops.c",
    )
    p.add_argument(
        "--memory",
        action="store_true",
        help="also measure the RSS each system's model adds to a fresh process (engine_rss.py)",
    )
    p.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="cpu",
        help="cpu: CPU time of the process (default; immune to other processes competing "
        "for the cores); wall: elapsed time",
    )
    p.set_defaults(func=run)
    return p


def _source_gguf(checkpoint: Path) -> Path | None:
    """The GGUF file a checkpoint was imported from, where it is kept beside it."""
    try:
        source = json.loads((checkpoint / "kvmesh-import.json").read_text())["source"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    path = checkpoint / Path(source).name
    return path if path.is_file() else None


def _llama_weights(
    choice: str, hf_path: Path, tmp: Path, dtype: Any, converter: Path, stored: bool = False
) -> Path:
    """The GGUF llama.cpp runs for ``--llama-weights`` (``stored``: kvmesh runs a checkpoint of
    weights as stored, which llama.cpp's converter cannot read: ``same`` is its source GGUF)."""
    from kvmesh.loadgen import llamacpp_runner

    if stored and choice in ("same", "q8_0"):
        source = _source_gguf(hf_path)
        if choice == "q8_0" or source is None:
            raise SystemExit(
                f"kvmesh bench engine: --llama-weights {choice}: {hf_path} keeps its weights as "
                "stored (quantized), which llama.cpp's converter cannot read"
                + ("" if source else ", and its source GGUF is not beside it")
                + "; pass --llama-weights FILE.gguf"
            )
        return source
    if choice == "same":
        return llamacpp_runner.convert(hf_path, tmp / "model.gguf", dtype, converter)
    if choice == "q8_0":
        return llamacpp_runner.convert(hf_path, tmp / "model.gguf", dtype, converter, "q8_0")
    path = Path(choice)
    if path.suffix != ".gguf" or not path.is_file():
        raise SystemExit(
            f"kvmesh bench engine: --llama-weights {choice!r}: not same, q8_0 or a .gguf file"
        )
    return path


def run(args: argparse.Namespace) -> int:
    import torch

    if args.threads < 1:
        raise SystemExit(f"kvmesh bench engine: --threads must be >= 1, got {args.threads}")
    if args.threads > 1 and args.clock == "cpu":
        raise SystemExit(
            "kvmesh bench engine: --threads > 1 needs --clock wall (the cpu clock adds up the "
            "CPU time of every thread, not the time a step takes)"
        )
    if args.memory and args.model == "kvmesh-tiny":
        raise SystemExit("kvmesh bench engine: --memory measures a checkpoint, not kvmesh-tiny")
    with_llama_cpp = args.against == "llama.cpp"
    if with_llama_cpp:
        from kvmesh.loadgen import llamacpp_runner

        converter = llamacpp_runner.converter_path(args.gguf_converter)
        try:
            llamacpp_runner.require(converter)
        except llamacpp_runner.LlamaCppMissingError as exc:
            raise SystemExit(f"kvmesh bench engine: {exc}") from None
    from kvmesh.shared.model import load_model
    from kvmesh.shared.model.model_ref import model_path

    args.model = model_path(args.model, "kvmesh bench engine")
    torch.set_num_threads(args.threads)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    rng = random.Random(0)
    loaded = load_model(args.model)
    formats = stored_formats(loaded[0])
    with tempfile.TemporaryDirectory() as tmp:
        hf_path = (
            export_tiny_to_hf(Path(tmp) / "hf") if args.model == "kvmesh-tiny" else Path(args.model)
        )
        vocab = loaded[0].config.vocab_size
        max_pos = loaded[0].config.max_position_embeddings
        prompt_len = min(args.prompt_len, max_pos - 1)
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        decode_prompts = {
            b: [[rng.randrange(vocab) for _ in range(args.decode_prompt_len)] for _ in range(b)]
            for b in batch_sizes
        }
        in_flight = max(
            prompt_len, max(batch_sizes) * (args.decode_prompt_len + args.decode_tokens)
        )
        kv = KvmeshRunner(
            args.model,
            in_flight,
            args.cpu_kernels,
            loaded=loaded,
            kv_cache_dtype=args.kv_cache_dtype,
        )
        del loaded
        if formats:  # transformers cannot read blocks: kvmesh on the same weights in float32
            reference = "kvmesh-float32"
            ref: Any = KvmeshRunner(args.model, in_flight, args.cpu_kernels, dequantize=True)
        else:
            reference, ref = "transformers", HFRunner(hf_path)
        check = decode_prompts[batch_sizes[0]]
        outputs_match = kv.generate(check, 16) == ref.generate(check, 16)
        runners: dict[str, Any] = {"kvmesh": kv, reference: ref}
        llama_match = gguf = None
        if with_llama_cpp:
            gguf = _llama_weights(
                args.llama_weights, hf_path, Path(tmp), kv.dtype, converter, bool(formats)
            )
            n_ctx = max(prompt_len, args.decode_prompt_len + args.decode_tokens) + 16
            llama_kv = torch.float16 if args.llama_kv_cache == "f16" else kv.dtype
            llama = llamacpp_runner.LlamaCppRunner(
                gguf,
                args.threads,
                n_ctx,
                llama_kv,
                max_batch=max(batch_sizes),
                batch_ctx=args.decode_prompt_len + args.decode_tokens + 16,
            )
            runners["llama.cpp"] = llama
            llama_match = kv.generate(check[:1], 16) == llama.generate(check[:1], 16)
        results = measure(
            runners, prompt, decode_prompts, args.decode_tokens, args.repeats, CLOCKS[args.clock]
        )
        memcpy = memcpy_gb_s(CLOCKS[args.clock])
        context = args.decode_prompt_len + args.decode_tokens / 2
        results["bandwidth"] = {
            "memcpy_gb_s": memcpy,
            **bandwidth(results, runners, context, memcpy),
        }
        if args.memory:
            results["memory_mb"] = _memory(args.model, reference, gguf)
    k = results["kvmesh"]
    results["ratios"] = ratios(k, results[reference])
    if with_llama_cpp:
        results["ratios_llama_cpp"] = ratios(k, results["llama.cpp"])
    results["config"] = {
        "model": args.model,
        "reference": reference,
        "weights": "as stored: " + "+".join(formats) if formats else str(kv.dtype),
        "threads": args.threads,
        "clock": args.clock,
        "against": args.against,
        "prompt_len": prompt_len,
        "decode_prompt_len": args.decode_prompt_len,
        "decode_tokens": args.decode_tokens,
        "dtype": str(kv.dtype).removeprefix("torch."),
        "kv_cache_dtype": results["bandwidth"]["kvmesh"]["kv_dtype"],
        "greedy_outputs_match": outputs_match,
        "greedy_outputs_match_llama_cpp": llama_match,
        "llama_kv_cache": args.llama_kv_cache if with_llama_cpp else None,
        "llama_weights": args.llama_weights if with_llama_cpp else None,
        "cpu_kernels": kv.engine.runner.cpu_ops is not None,
    }
    if args.json:
        print(json.dumps(results))
        return 0
    print_table(results)
    return 0


def _memory(model: str, reference: str, gguf: Path | None) -> dict[str, float]:
    """RSS (MB) each system's model adds to a fresh process (``engine_rss.measure``)."""
    from kvmesh.loadgen import engine_rss

    systems = {"kvmesh": ("kvmesh", model)}
    if reference == "kvmesh-float32":
        systems[reference] = ("kvmesh-float32", model)
    if gguf is not None:
        systems["llama.cpp"] = ("llama.cpp", str(gguf))
    return {name: engine_rss.measure(*how)["added_mb"] for name, how in systems.items()}
