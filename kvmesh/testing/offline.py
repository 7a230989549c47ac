"""What a mesh must answer: greedy completions of a model computed offline, in this process, with
the same engine the workers run. The mesh tests and ``loadgen/fault_drill.py`` compare what the
mesh streamed with these."""

from __future__ import annotations


def offline_greedy(
    prompts: list[list[int]],
    max_tokens: int,
    num_blocks: int = 4096,
    *,
    model: str = "kvmesh-tiny",
    ignore_eos: bool = False,
) -> list[list[int]]:
    """Greedy token ids of each prompt's completion."""
    return _generate(prompts, max_tokens, model, num_blocks, ignore_eos)[1]


def offline_texts(
    prompts: list[list[int]],
    max_tokens: int,
    num_blocks: int = 4096,
    *,
    model: str = "kvmesh-tiny",
) -> list[str]:
    """Greedy completions (EOS ignored), turned into text as the router does."""
    from kvmesh.shared.text.detokenize import TextStream

    tokenizer, completions = _generate(prompts, max_tokens, model, num_blocks, True)
    texts = []
    for prompt, ids in zip(prompts, completions, strict=True):
        text = TextStream(tokenizer, prompt)
        text.add(ids)
        text.finish()
        texts.append(text.text)
    return texts


def _generate(prompts, max_tokens, model, num_blocks, ignore_eos):
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine
    from kvmesh.shared.model.loader import load_model
    from kvmesh.shared.text.sampling import SamplingOptions

    model_, tokenizer = load_model(model)
    engine = LLMEngine(model_, tokenizer, EngineConfig(num_blocks=num_blocks))
    params = SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    return tokenizer, engine.generate(prompts, params)
