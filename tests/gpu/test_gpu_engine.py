"""The engine on CUDA (Triton decode kernels, torch prefill) against transformers on CUDA on the
same weights: the fixture checkpoints (Llama with llama3 rope scaling, Qwen2 with biases and tied
embeddings, Mistral with MQA) and a seeded model of Llama-3.2-1B's shape (hidden 2048, 16 layers,
32 heads, 8 KV heads, 32k vocabulary; drawn from a seed, no download).

float32: greedy tokens equal, token for token (each engine token is transformers' argmax after
the prompt and the engine's earlier tokens). bfloat16: the two stacks round differently, so a
near-tie between the top two logits may go either way; each engine token is checked against
transformers run teacher-forced over the engine's own output: it must be transformers' argmax or
within ``BF16_LOGIT_TOL`` of its top logit, and most must be the argmax exactly.

``gpu``-marked: skipped without CUDA; `make gpu-check` runs them. Never yet run on real hardware
(docs/gpu.md).
"""

from __future__ import annotations

import pytest
import torch
from kvmesh.shared.engine.config import EngineConfig
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.text.sampling import SamplingOptions
from support.hf_fixtures import (
    load_hf_reference,
    make_llama_checkpoint,
    make_mistral_checkpoint,
    make_qwen2_checkpoint,
)

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
BF16_LOGIT_TOL = 0.25  # bf16 logits of these models differ by a few hundredths between stacks
MIN_EXACT_FRACTION = 0.9
CHECKPOINTS = {
    "llama": make_llama_checkpoint,
    "qwen2": make_qwen2_checkpoint,
    "mistral": make_mistral_checkpoint,
}


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def _engine_greedy(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    config = EngineConfig(num_blocks=512, device=DEVICE, max_num_seqs=len(prompts))
    engine = LLMEngine(model, None, config)
    # decode steps take the Triton kernel on CUDA
    assert engine.runner.use_triton == (torch.device(DEVICE).type == "cuda")
    params = SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return engine.generate(prompts, params)


@torch.inference_mode()
def _check_teacher_forced(
    hf, prompt: list[int], tokens: list[int], tol: float = BF16_LOGIT_TOL
) -> int:
    """Each engine token against transformers' logits after the prompt and the engine's earlier
    tokens (one forward over them all: transformers' own greedy ``generate`` with its KV cache
    strays from its full forward on these fixtures past llama3 rope scaling's original length,
    so the full forward is the reference); returns how many are transformers' argmax exactly."""
    ids = torch.tensor([prompt + tokens], device=DEVICE)
    logits = hf(ids).logits[0, len(prompt) - 1 : -1].float()  # (len(tokens), vocab)
    top = logits.max(-1).values
    mine = logits.gather(1, torch.tensor(tokens, device=DEVICE)[:, None])[:, 0]
    gap = (top - mine).tolist()
    assert max(gap) <= tol, f"engine tokens fall {gap} below transformers' top logit"
    return sum(g == 0 for g in gap)


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_engine_float32_greedy_equals_transformers_on_cuda(tmp_path, name):
    from kvmesh.shared.model.loader import load_model

    path = CHECKPOINTS[name](tmp_path)
    model, _ = load_model(str(path), torch.float32, DEVICE)
    hf = load_hf_reference(path).to(DEVICE)
    prompts = _prompts(model.config.vocab_size, [5, 17, 33, 70], seed=1)

    got = _engine_greedy(model, prompts, 24)

    for prompt, tokens in zip(prompts, got, strict=True):
        assert _check_teacher_forced(hf, prompt, tokens, tol=0.0) == len(tokens) == 24


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_engine_bf16_greedy_agrees_with_transformers_on_cuda(tmp_path, name):
    from kvmesh.shared.model.loader import load_model

    path = CHECKPOINTS[name](tmp_path)
    model, _ = load_model(str(path), torch.bfloat16, DEVICE)
    hf = load_hf_reference(path, torch.bfloat16).to(DEVICE)
    prompts = _prompts(model.config.vocab_size, [5, 17, 33, 70], seed=2)

    got = _engine_greedy(model, prompts, 24)

    exact = sum(_check_teacher_forced(hf, p, t) for p, t in zip(prompts, got, strict=True))
    assert exact >= MIN_EXACT_FRACTION * sum(map(len, got))


@pytest.fixture(scope="module")
def llama_1b_shape():
    """(kvmesh model, transformers model) of the seeded Llama-3.2-1B-shaped model in bf16."""
    from kvmesh.loadgen.realistic_model import realistic_config, seeded_models

    models = seeded_models(realistic_config(dtype=torch.bfloat16), seed=0, device=DEVICE)
    yield models
    del models
    torch.cuda.empty_cache()


def test_engine_bf16_greedy_agrees_with_transformers_on_llama_1b_shape(llama_1b_shape):
    model, hf = llama_1b_shape
    assert model.config.hidden_size == 2048 and model.config.num_hidden_layers == 16
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (32, 8)
    prompts = _prompts(model.config.vocab_size, [7, 64, 200, 513], seed=3)

    got = _engine_greedy(model, prompts, 32)

    exact = sum(_check_teacher_forced(hf, p, t) for p, t in zip(prompts, got, strict=True))
    assert exact >= MIN_EXACT_FRACTION * sum(map(len, got))
