"""What a mesh must answer: greedy completions of a model computed offline, in this process, with
the same engine the workers run. The mesh tests and ``loadgen/fault_drill.py`` compare what the
mesh streamed with these."""

from __future__ import annotations

from collections.abc import Callable

# Tokens per engine step. Greedy ids do not depend on how prompts are chunked (the workers chunk
# by 64 tokens and give these ids); a step's fixed cost does, so the references take big steps:
# 200 prompts of up to 900 tokens on kvmesh-tiny, 47 s at the engine's 2048, 29 s at 8192.
BATCH_TOKENS = 8192


def offline_greedy(
    prompts: list[list[int]],
    max_tokens: int,
    num_blocks: int = 4096,
    *,
    model: str = "kvmesh-tiny",
    ignore_eos: bool = False,
    device: str = "cpu",
) -> list[list[int]]:
    """Greedy token ids of each prompt's completion (on ``device``: the engine and the model)."""
    return _generate(prompts, max_tokens, model, num_blocks, ignore_eos, device)[1]


def offline_greedy_each(
    max_tokens: int,
    num_blocks: int = 256,
    *,
    model: str = "kvmesh-tiny",
    ignore_eos: bool = False,
) -> Callable[[list[int]], list[int]]:
    """A function that gives the greedy token ids of one prompt's completion at a time, from one
    engine with prefix caching off (each prompt computed whole): for tests that ask a mesh one
    prompt after another, a later one perhaps holding an earlier one's answer."""
    engine = _engine(model, num_blocks, "cpu", enable_prefix_caching=False)
    params = _greedy(max_tokens, ignore_eos)
    return lambda prompt: engine.generate([prompt], params)[0]


def offline_texts(
    prompts: list[list[int]],
    max_tokens: int,
    num_blocks: int = 4096,
    *,
    model: str = "kvmesh-tiny",
) -> list[str]:
    """Greedy completions (EOS ignored), turned into text as the router does."""
    from kvmesh.shared.text.detokenize import TextStream

    tokenizer, completions = _generate(prompts, max_tokens, model, num_blocks, True, "cpu")
    texts = []
    for prompt, ids in zip(prompts, completions, strict=True):
        text = TextStream(tokenizer, prompt)
        text.add(ids)
        text.finish()
        texts.append(text.text)
    return texts


def _generate(prompts, max_tokens, model, num_blocks, ignore_eos, device):
    engine = _engine(model, num_blocks, device)
    return engine.tokenizer, engine.generate(prompts, _greedy(max_tokens, ignore_eos))


def _engine(model, num_blocks, device, *, enable_prefix_caching=True):
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine
    from kvmesh.shared.model.loader import load_model

    model_, tokenizer = load_model(model, device=device)
    config = EngineConfig(
        num_blocks=num_blocks,
        device=device,
        enable_prefix_caching=enable_prefix_caching,
        max_num_batched_tokens=BATCH_TOKENS,
    )
    return LLMEngine(model_, tokenizer, config)


def _greedy(max_tokens, ignore_eos):
    from kvmesh.shared.text.sampling import SamplingOptions

    return SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
