"""The systems ``kvmesh bench engine`` runs side by side, each with ``generate`` (greedy tokens)
and ``decode_step_times`` (every decode step timed, prefill not): kvmesh's LLMEngine
(``KvmeshRunner``) and transformers' ``generate`` (``HFRunner``) on the same weights, kvmesh-tiny
exported to a Hugging Face directory for it (``export_tiny_to_hf``). llama.cpp's runner is in
``llamacpp_runner.py``."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvmesh.loadgen.engine_bandwidth import decode_weight_bytes


def export_tiny_to_hf(directory: Path) -> Path:
    """Write kvmesh-tiny as a transformers Llama checkpoint (identical weights) with its byte-level
    tokenizer (llama.cpp's converter needs one)."""
    from kvmesh.shared.model.seeded import write_hf_weights, write_tokenizer
    from kvmesh.shared.model.tiny import (
        TINY_CHAT_TEMPLATE,
        TINY_SPECIALS,
        tiny_config,
        tiny_state_dict,
    )

    directory.mkdir(parents=True, exist_ok=True)
    write_hf_weights(directory, tiny_config(), tiny_state_dict())
    write_tokenizer(directory, TINY_SPECIALS, "<|bos|>", "<|end|>", TINY_CHAT_TEMPLATE)
    return directory


class KvmeshRunner:
    """kvmesh's engine on ``model_name`` (``dequantize``: weights kept as stored made float), or
    on a model already ``loaded`` (model, tokenizer)."""

    def __init__(
        self,
        model_name: str,
        max_tokens_in_flight: int,
        cpu_kernels: bool = True,
        dequantize: bool = False,
        loaded: tuple[Any, Any] | None = None,
        kv_cache_dtype: str = "auto",
    ) -> None:
        from kvmesh.shared.engine.config import EngineConfig
        from kvmesh.shared.engine.llm_engine import LLMEngine
        from kvmesh.shared.model import load_model

        model, tok = loaded or load_model(model_name, dequantize=dequantize)
        self.dtype = model.config.torch_dtype
        self.formats = stored_formats(model)
        self.engine = LLMEngine(
            model,
            tok,
            # No prefix caching: every repeat must compute its prompt, as transformers does.
            EngineConfig(
                num_blocks=max_tokens_in_flight // 16 + 64,
                max_num_seqs=256,
                max_num_batched_tokens=4096,
                enable_prefix_caching=False,
                cpu_kernels=cpu_kernels,
                kv_cache_dtype=kv_cache_dtype,
            ),
        )
        self.weight_bytes = decode_weight_bytes(model)

    def generate(self, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
        from kvmesh.shared.text.sampling import SamplingOptions

        params = SamplingOptions(max_tokens=num_tokens, temperature=0, ignore_eos=True)
        return self.engine.generate(prompts, params)

    def decode_step_times(
        self, prompts: list[list[int]], num_tokens: int, clock: Callable[[], float]
    ) -> list[float]:
        from kvmesh.shared.text.sampling import SamplingOptions

        params = SamplingOptions(max_tokens=num_tokens, temperature=0, ignore_eos=True)
        engine = self.engine
        for i, prompt in enumerate(prompts):
            engine.add_request(f"bench-{i}", prompt, params)
        num_first = 0
        while num_first < len(prompts):  # prefill, not timed
            num_first += sum(1 for o in engine.step() if o.num_output_tokens == 1)
        times = []
        while engine.has_unfinished():
            t0 = clock()
            engine.step()
            times.append(clock() - t0)
        return times


def stored_formats(model: Any) -> list[str]:
    """The block formats ``model``'s weights are kept in (empty: all float)."""
    from kvmesh.shared.model.quant_layers import QuantEmbedding, QuantLinear

    kinds = (QuantLinear, QuantEmbedding)
    return sorted({m.qweight.format for m in model.modules() if isinstance(m, kinds)})


class HFRunner:
    def __init__(self, path: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None  # generate exactly max_new_tokens

    def generate(
        self, prompts: list[list[int]], num_tokens: int, logits_processor: list | None = None
    ) -> list[list[int]]:
        ids = self.torch.tensor(prompts)
        with self.torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=self.torch.ones_like(ids),
                max_new_tokens=num_tokens,
                do_sample=False,
                pad_token_id=0,
                logits_processor=logits_processor,
            )
        return out[:, ids.shape[1] :].tolist()

    def decode_step_times(
        self, prompts: list[list[int]], num_tokens: int, clock: Callable[[], float]
    ) -> list[float]:
        stamps: list[float] = []

        def stamp(input_ids: Any, scores: Any) -> Any:  # called once per generation step
            stamps.append(clock())
            return scores

        self.generate(prompts, num_tokens, [stamp])
        return [b - a for a, b in itertools.pairwise(stamps)]
