"""What an 8-bit KV cache costs in accuracy: greedy agreement and logit error against the model
dtype's KV, for every 8-bit format (``--kv-cache-dtype int8`` and ``fp8_e4m3``).

``kvmesh model kv-accuracy MODEL`` runs the fixture prompts (``FIXTURE_PROMPTS``) through offline
engines that differ only in ``kv_cache_dtype`` (the model's own dtype is the reference: named,
since "auto" is float16 over weights kept quantized) and
reports, per format and prompt:

* ``agreed_tokens``: how many greedy tokens the 8-bit engine produces before its first one that
  differs from the reference's (the real decode path: the C or Triton kernels as served); over
  all prompts, ``token_agreement`` is the share of generated tokens so agreed (a token after the
  first difference never counts, even where it happens to match);
* the logit error along the reference trajectory (teacher-forced: both engines score the same
  prompt + reference output in one forward pass, the 8-bit one reading its K/V back from its
  blocks): max and mean absolute difference over every vocabulary entry of every output
  position, and how often the two argmaxes agree (``top1_agreement``; unlike greedy agreement,
  one early flip does not end it). ``logit_std``, the reference logits' standard deviation over
  the vocabulary, is the yardstick for the error: a seeded model's logits are small.

and the answers to short factual questions (``FACT_QUESTIONS``, through the model's chat template
when it has one): each answer, greedy up to an end-of-sequence token, must be the reference's.

Two more figures say what a greedy difference means: ``flip_gap``, the reference's own margin
(top-1 minus top-2 logit) at a prompt's first differing token, and the same measurement of a
16-bit KV cache (``bf16``: the model's float32 weights with a bfloat16 KV pool, what vLLM keeps
for a bf16 model) as a yardstick: a difference where the reference itself is within rounding
of a tie is one any lossy KV format may show.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvmesh.loadgen.kv_accuracy_report import (
    FactAnswer,
    KVAccuracyReport,
    PromptAccuracy,
    agreed_prefix,
)

if TYPE_CHECKING:  # `kvmesh model` registers this command: building the CLI must not import torch
    import torch

# Varied English text: lengths from under one block to several blocks of 16 tokens (byte-level
# tokenizers make a character a token or so).
FIXTURE_PROMPTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time, in a kingdom by the sea, there lived a princess who",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Disaggregated serving splits prefill and decode onto different workers, so that",
    "Q: What is the capital of France?\nA:",
    "The KV cache holds the keys and values of every token a sequence has seen; quantizing "
    "it to eight bits halves or quarters its bytes, and the question is what that costs.",
    "1, 2, 3, 5, 8, 13, 21, 34, 55,",
    "In the beginning God created the heaven and the earth. And the earth was without form, and "
    "void; and darkness was upon the face of the deep. And the Spirit of God moved upon the "
    "face of the waters. And God said, Let there be light: and there was light.",
)


# Short factual questions whose answers must not change (asked through the chat template).
FACT_QUESTIONS = (
    "What is the capital of France?",
    "What is 2 + 2?",
    "Who wrote Romeo and Juliet?",
    "How many days are in a week?",
    "What is the chemical symbol for gold?",
    "What is the largest planet in the solar system?",
    "What color is the sky on a clear day?",
    "What is the boiling point of water in degrees Celsius?",
)
EIGHT_BIT_FORMATS = ("int8", "fp8_e4m3")
YARDSTICK = "bf16"  # a 16-bit KV pool (EngineConfig.dtype), measured alike
FORMATS = (*EIGHT_BIT_FORMATS, YARDSTICK)
FACT_MAX_TOKENS = 32


def measure(
    model: Any,
    prompts: list[list[int]],
    max_tokens: int,
    *,
    model_name: str = "",
    kv_cache_dtype: str = "int8",
    block_size: int = 16,
) -> KVAccuracyReport:
    """Compare an engine with ``kv_cache_dtype`` against the model dtype's ("auto") KV."""
    return measure_formats(
        model, prompts, max_tokens, (kv_cache_dtype,), model_name=model_name, block_size=block_size
    )[0]


def measure_formats(
    model: Any,
    prompts: list[list[int]],
    max_tokens: int,
    kv_cache_dtypes: Sequence[str] = EIGHT_BIT_FORMATS,
    *,
    facts: Sequence[list[int]] = (),
    stop_token_ids: Sequence[int] = (),
    model_name: str = "",
    block_size: int = 16,
) -> tuple[KVAccuracyReport, ...]:
    """One report per format of ``kv_cache_dtypes`` (an 8-bit ``kv_cache_dtype`` or ``bf16``, a
    bfloat16 KV pool), each against the same reference run: the fixture ``prompts``
    (``max_tokens`` greedy tokens each) and the ``facts`` prompts (greedy up to one of
    ``stop_token_ids``, at most ``FACT_MAX_TOKENS``)."""
    import torch
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine
    from kvmesh.shared.text.sampling import SamplingOptions

    longest = max(len(p) for p in [*prompts, *facts]) + max(max_tokens, FACT_MAX_TOKENS)
    num_blocks = max(len(prompts), len(facts)) * (-(-longest // block_size) + 1) + 8

    # the reference's KV in the model's own dtype (float32, bfloat16 or float16), not "auto",
    # which is float16 over weights kept as stored
    own = str(model.config.torch_dtype).removeprefix("torch.")

    def engine(dtype: str) -> LLMEngine:
        is_yardstick = dtype == YARDSTICK
        config = EngineConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=False,
            dtype=torch.bfloat16 if is_yardstick else None,
            kv_cache_dtype="auto" if is_yardstick else own if dtype == "auto" else dtype,
        )
        return LLMEngine(model, None, config)

    params = SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    fact_params = SamplingOptions(
        max_tokens=FACT_MAX_TOKENS, temperature=0.0, stop_token_ids=tuple(stop_token_ids)
    )
    ref_engine = engine("auto")
    ref_out = ref_engine.generate(prompts, params)
    ref_facts = ref_engine.generate(list(facts), fact_params) if facts else []
    ref_logits = [
        teacher_forced_logits(ref_engine, prompt + ref[:-1], len(ref))
        for prompt, ref in zip(prompts, ref_out, strict=True)
    ]
    reports = []
    for dtype in kv_cache_dtypes:
        test_engine = engine(dtype)
        test_out = test_engine.generate(prompts, params)
        results = []
        for prompt, ref, got, want in zip(prompts, ref_out, test_out, ref_logits, strict=True):
            agreed = agreed_prefix(ref, got)
            top1 = max_err = mean_err = None
            if dtype != YARDSTICK:
                logits = teacher_forced_logits(test_engine, prompt + ref[:-1], len(ref))
                err = (logits - want).abs()
                top1 = float((logits.argmax(-1) == want.argmax(-1)).float().mean())
                max_err, mean_err = float(err.max()), float(err.mean())
            margin = None
            if agreed < len(ref):  # the reference's own top-2 gap where the tokens part
                top2 = want[agreed].topk(2).values
                margin = float(top2[0] - top2[1])
            results.append(
                PromptAccuracy(
                    prompt_tokens=len(prompt),
                    agreed_tokens=agreed,
                    top1_agreement=top1,
                    max_logit_error=max_err,
                    mean_logit_error=mean_err,
                    logit_std=float(want.std(-1).mean()),
                    flip_gap=margin,
                )
            )
        answers = test_engine.generate(list(facts), fact_params) if facts else []
        fact_results = tuple(
            FactAnswer(len(q), tuple(ref), tuple(got))
            for q, ref, got in zip(facts, ref_facts, answers, strict=True)
        )
        reports.append(
            KVAccuracyReport(model_name, dtype, max_tokens, tuple(results), fact_results)
        )
    return tuple(reports)


def fact_prompts(tokenizer: Any) -> list[list[int]]:
    """``FACT_QUESTIONS`` as prompts: through the chat template when the tokenizer has one,
    else as ``Q: ...\nA:`` text."""
    if getattr(tokenizer, "chat_template", None):
        return [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in FACT_QUESTIONS]
    return [tokenizer.encode(f"Q: {q}\nA:", add_special_tokens=True) for q in FACT_QUESTIONS]


def teacher_forced_logits(engine: Any, token_ids: list[int], num_logits: int) -> torch.Tensor:
    """(num_logits, vocab) float32 logits of the last ``num_logits`` positions of ``token_ids``,
    all in one forward pass through ``engine``'s KV pool (blocks taken and given back)."""
    from kvmesh.shared.engine.sequence import Sequence
    from kvmesh.shared.text.sampling import SamplingOptions

    seq = Sequence("kv-accuracy", list(token_ids), SamplingOptions(max_tokens=1, temperature=0.0))
    engine.block_manager.allocate(seq)
    try:
        assert seq.num_computed_tokens == 0, "the engine must not have prefix caching on"
        return engine.runner.execute([seq], [len(seq)], [num_logits])
    finally:
        engine.block_manager.deallocate(seq)


def register_kv_accuracy(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "kv-accuracy",
        help="greedy agreement, logit error and factual answers of each 8-bit KV format against "
        "the model dtype's KV",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "model",
        help="as kvmesh up's --model: a fetchable model (from the cache), a .gguf file, a "
        "checkpoint directory or kvmesh-tiny",
    )
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        default=list(FORMATS),
        choices=list(FORMATS),
        help="the formats to measure: the 8-bit ones and bf16, a 16-bit KV pool as a "
        "yardstick (default: all)",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--llama-cpp",
        action="store_true",
        help="also measure llama.cpp's q8_0 KV against its f32 KV on the same prompts (the "
        "checkpoint converted to an f32 GGUF; needs `make bench-deps`)",
    )
    p.add_argument("--json", action="store_true", help="print the reports as JSON")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import torch
    from kvmesh.shared.model.loader import load_model

    if args.max_tokens <= 0:
        raise SystemExit("kvmesh model kv-accuracy: --max-tokens must be positive")
    if args.llama_cpp and not Path(args.model).is_dir():
        raise SystemExit(
            f"kvmesh model kv-accuracy: --llama-cpp converts a checkpoint directory; "
            f"{args.model!r} is not one"
        )
    if args.llama_cpp:  # before the minutes of measuring, not after
        from kvmesh.loadgen import llamacpp_runner

        try:
            llamacpp_runner.require(llamacpp_runner.converter_path(), "--llama-cpp")
        except llamacpp_runner.LlamaCppMissingError as exc:
            raise SystemExit(f"kvmesh model kv-accuracy: {exc}") from None
    from kvmesh.shared.model.model_ref import model_path

    model, tokenizer = load_model(model_path(args.model, "kvmesh model kv-accuracy"), torch.float32)
    prompts = [tokenizer.encode(text, add_special_tokens=True) for text in FIXTURE_PROMPTS]
    facts = fact_prompts(tokenizer)
    stop_token_ids = sorted(tokenizer.eos_token_ids)
    reports = measure_formats(
        model,
        prompts,
        args.max_tokens,
        args.kv_cache_dtype,
        facts=facts,
        stop_token_ids=stop_token_ids,
        model_name=args.model,
        block_size=args.block_size,
    )
    llama = None
    if args.llama_cpp:
        from kvmesh.loadgen.kv_accuracy_llamacpp import measure_llama_cpp

        llama = measure_llama_cpp(
            Path(args.model),
            prompts,
            args.max_tokens,
            facts=facts,
            stop_token_ids=stop_token_ids,
            threads=torch.get_num_threads(),
        )
    if args.json:
        out: dict[str, Any] = {"model": args.model, "reports": [r.to_json() for r in reports]}
        if llama is not None:
            out["llama_cpp"] = llama.to_json()
        print(json.dumps(out, indent=2))
        return 0
    for report in reports:
        print(report.table(tokenizer.decode) + "\n")
    for report in reports:
        print(report.summary())
    if llama is not None:
        print(llama.summary())
    return 0
