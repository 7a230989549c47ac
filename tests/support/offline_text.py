"""What the mesh must stream: greedy text of kvmesh-tiny computed offline, in this process."""

from __future__ import annotations


def offline_texts(prompts: list[list[int]], max_tokens: int, num_blocks: int = 4096) -> list[str]:
    """Greedy completions of ``prompts`` (EOS ignored), turned into text as the router does."""
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine
    from kvmesh.shared.model.loader import load_model
    from kvmesh.shared.text.detokenize import TextStream
    from kvmesh.shared.text.sampling import SamplingOptions

    model, tokenizer = load_model("kvmesh-tiny")
    engine = LLMEngine(model, tokenizer, EngineConfig(num_blocks=num_blocks))
    params = SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    texts = []
    for prompt, ids in zip(prompts, engine.generate(prompts, params), strict=True):
        text = TextStream(tokenizer, prompt)
        text.add(ids)
        text.finish()
        texts.append(text.text)
    return texts
