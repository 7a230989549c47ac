"""llama.cpp's q8_0 KV cache measured as ``kvmesh model kv-accuracy`` measures kvmesh's 8-bit
formats (``--llama-cpp``): the comparison beside them.

Like for like: llama.cpp runs the same checkpoint, converted to an f32 GGUF by its own converter
(``loadgen/llamacpp_runner.py``): the weights kvmesh runs, in the same precision. Its q8_0 KV (K
and V as 32 int8 values and one f16 scale per block of 32, with flash attention, which a quantized
V needs) is compared with its own f32 KV (flash attention too, so that the KV type is the only
difference), on the same token ids, by the same measures: greedy tokens before the first
difference over the fixture prompts, and the factual answers. Each engine is measured against its
own f32 reference; the two references are not compared with each other (their sums run in other
orders, so a near tie may break either way).
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from kvmesh.loadgen import llamacpp_runner
from kvmesh.loadgen.kv_accuracy import FACT_MAX_TOKENS
from kvmesh.loadgen.kv_accuracy_report import FactAnswer, agreed_prefix


@dataclass(frozen=True, slots=True)
class GreedyAgreement:
    """llama.cpp's ``kv_type`` KV against its f32 KV: per prompt, greedy tokens before the first
    difference; per factual question, both answers."""

    kv_type: str
    max_tokens: int
    agreed_tokens: tuple[int, ...]
    facts: tuple[FactAnswer, ...]

    @property
    def token_agreement(self) -> float:
        return sum(self.agreed_tokens) / (self.max_tokens * len(self.agreed_tokens))

    @property
    def num_facts_changed(self) -> int:
        return sum(not f.is_same for f in self.facts)

    def summary(self) -> str:
        full = sum(a == self.max_tokens for a in self.agreed_tokens)
        return (
            f"llama.cpp {self.kv_type} (against its f32 KV): {self.token_agreement:.1%} of greedy "
            f"tokens agree ({full}/{len(self.agreed_tokens)} prompts all {self.max_tokens}, the "
            f"least {min(self.agreed_tokens)}); factual answers changed: "
            f"{self.num_facts_changed}/{len(self.facts)}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "token_agreement": self.token_agreement,
            "num_facts_changed": self.num_facts_changed,
        }


def measure_llama_cpp(
    checkpoint: Path,
    prompts: list[list[int]],
    max_tokens: int,
    *,
    facts: Sequence[list[int]],
    stop_token_ids: Sequence[int],
    threads: int,
    kv_type: str = "q8_0",
) -> GreedyAgreement:
    """Convert ``checkpoint`` (an HF directory) to an f32 GGUF and compare llama.cpp's
    ``kv_type`` KV with its f32 KV on ``prompts`` and ``facts`` (as ``measure_formats`` does)."""
    converter = llamacpp_runner.converter_path()
    llamacpp_runner.require(converter)
    n_ctx = max(len(p) for p in [*prompts, *facts]) + max(max_tokens, FACT_MAX_TOKENS) + 8
    outputs = []
    with tempfile.TemporaryDirectory(prefix="kvmesh-kv-accuracy-") as tmp:
        gguf = llamacpp_runner.convert(
            checkpoint, Path(tmp) / "model-f32.gguf", torch.float32, converter
        )
        for kv in (torch.float32, kv_type):
            runner = llamacpp_runner.LlamaCppRunner(gguf, threads, n_ctx, kv, flash_attn=True)
            outputs.append(
                (
                    runner.generate(prompts, max_tokens),
                    runner.generate(list(facts), FACT_MAX_TOKENS, set(stop_token_ids)),
                )
            )
            del runner  # one model in memory at a time
    (ref, ref_facts), (got, got_facts) = outputs
    return GreedyAgreement(
        kv_type,
        max_tokens,
        tuple(agreed_prefix(a, b) for a, b in zip(ref, got, strict=True)),
        tuple(
            FactAnswer(len(q), tuple(a), tuple(b))
            for q, a, b in zip(facts, ref_facts, got_facts, strict=True)
        ),
    )
