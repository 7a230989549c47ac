"""What an fp8 KV cache costs in accuracy: greedy agreement and logit error against float32 KV.

``kvmesh model kv-accuracy MODEL`` runs the fixture prompts (``FIXTURE_PROMPTS``) through two
offline engines that differ only in ``kv_cache_dtype`` and reports, per prompt:

* ``agreed_tokens``: how many greedy tokens the fp8 engine produces before its first one that
  differs from the float32 engine's (the real decode path: the C or Triton kernels as served);
* the logit error along the float32 trajectory (teacher-forced: both engines score the same
  prompt + float32 output in one forward pass, the fp8 one reading its K/V back from fp8
  blocks): max and mean absolute difference over every vocabulary entry of every output
  position, and how often the two argmaxes agree (``top1_agreement``; unlike greedy agreement,
  one early flip does not end it). ``logit_std``, the float32 logits' standard deviation over
  the vocabulary, is the yardstick for the error: a seeded model's logits are small.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

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


@dataclass(frozen=True, slots=True)
class PromptAccuracy:
    prompt_tokens: int
    agreed_tokens: int  # greedy tokens equal to float32 KV's before the first difference
    top1_agreement: float  # teacher-forced: fraction of positions whose argmax agrees
    max_logit_error: float
    mean_logit_error: float
    logit_std: float  # the float32 logits' spread over the vocabulary (mean over positions)


@dataclass(frozen=True, slots=True)
class KVAccuracyReport:
    model: str
    kv_cache_dtype: str
    max_tokens: int
    prompts: tuple[PromptAccuracy, ...]

    @property
    def min_agreed_tokens(self) -> int:
        return min(p.agreed_tokens for p in self.prompts)

    @property
    def num_fully_agreed(self) -> int:
        return sum(p.agreed_tokens == self.max_tokens for p in self.prompts)

    @property
    def max_logit_error(self) -> float:
        return max(p.max_logit_error for p in self.prompts)

    @property
    def mean_logit_error(self) -> float:
        return sum(p.mean_logit_error for p in self.prompts) / len(self.prompts)

    @property
    def logit_std(self) -> float:
        return sum(p.logit_std for p in self.prompts) / len(self.prompts)

    def to_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "min_agreed_tokens": self.min_agreed_tokens,
            "num_fully_agreed": self.num_fully_agreed,
            "max_logit_error": self.max_logit_error,
            "mean_logit_error": self.mean_logit_error,
            "logit_std": self.logit_std,
        }

    def table(self) -> str:
        lines = [
            f"{self.model}: {self.kv_cache_dtype} KV against float32 KV, {self.max_tokens} greedy "
            "tokens per prompt",
            f"{'prompt':>6} {'tokens':>6} {'agreed':>7} {'top-1':>6} {'max err':>8} "
            f"{'mean err':>9} {'logit std':>9}",
        ]
        for i, p in enumerate(self.prompts):
            lines.append(
                f"{i:>6} {p.prompt_tokens:>6} {p.agreed_tokens:>7} {p.top1_agreement:>6.3f} "
                f"{p.max_logit_error:>8.4f} {p.mean_logit_error:>9.5f} {p.logit_std:>9.4f}"
            )
        lines.append(
            f"greedy agreement: {self.num_fully_agreed}/{len(self.prompts)} prompts all "
            f"{self.max_tokens} tokens, the least {self.min_agreed_tokens}; logit error max "
            f"{self.max_logit_error:.4f}, mean {self.mean_logit_error:.5f} (logit std "
            f"{self.logit_std:.4f})"
        )
        return "\n".join(lines)


def measure(
    model: Any,
    prompts: list[list[int]],
    max_tokens: int,
    *,
    model_name: str = "",
    kv_cache_dtype: str = "fp8_e4m3",
    block_size: int = 16,
) -> KVAccuracyReport:
    """Compare engines with ``kv_cache_dtype`` and float32 ("auto" on a float32 model) KV."""
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine
    from kvmesh.shared.sampling import SamplingOptions

    longest = max(len(p) for p in prompts) + max_tokens
    num_blocks = len(prompts) * (-(-longest // block_size) + 1) + 8

    def engine(dtype: str) -> LLMEngine:
        config = EngineConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=False,
            kv_cache_dtype=dtype,
        )
        return LLMEngine(model, None, config)

    params = SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ref_engine, test_engine = engine("auto"), engine(kv_cache_dtype)
    ref_out = ref_engine.generate(prompts, params)
    test_out = test_engine.generate(prompts, params)
    results = []
    for prompt, ref, got in zip(prompts, ref_out, test_out, strict=True):
        agreed = next(
            (i for i, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b), len(ref)
        )
        tokens = prompt + ref[:-1]
        ref_logits = teacher_forced_logits(ref_engine, tokens, len(ref))
        test_logits = teacher_forced_logits(test_engine, tokens, len(ref))
        err = (test_logits - ref_logits).abs()
        top1 = (test_logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()
        results.append(
            PromptAccuracy(
                prompt_tokens=len(prompt),
                agreed_tokens=agreed,
                top1_agreement=float(top1),
                max_logit_error=float(err.max()),
                mean_logit_error=float(err.mean()),
                logit_std=float(ref_logits.std(-1).mean()),
            )
        )
    return KVAccuracyReport(model_name, kv_cache_dtype, max_tokens, tuple(results))


def teacher_forced_logits(engine: Any, token_ids: list[int], num_logits: int) -> torch.Tensor:
    """(num_logits, vocab) float32 logits of the last ``num_logits`` positions of ``token_ids``,
    all in one forward pass through ``engine``'s KV pool (blocks taken and given back)."""
    from kvmesh.shared.engine.sequence import Sequence
    from kvmesh.shared.sampling import SamplingOptions

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
        help="greedy agreement and logit error of fp8 KV against float32 KV on fixture prompts",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", help="a checkpoint directory or kvmesh-tiny")
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument("--kv-cache-dtype", default="fp8_e4m3", choices=["fp8_e4m3"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import torch
    from kvmesh.shared.model.loader import load_model

    if args.max_tokens <= 0:
        raise SystemExit("kvmesh model kv-accuracy: --max-tokens must be positive")
    model, tokenizer = load_model(args.model, torch.float32)
    prompts = [tokenizer.encode(text, add_special_tokens=True) for text in FIXTURE_PROMPTS]
    report = measure(
        model,
        prompts,
        args.max_tokens,
        model_name=args.model,
        kv_cache_dtype=args.kv_cache_dtype,
        block_size=args.block_size,
    )
    print(json.dumps(report.to_json(), indent=2) if args.json else report.table())
    return 0
