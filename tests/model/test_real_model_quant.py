"""The real default model (SmolLM2-135M-Instruct, Q4_1 with Q8_0 embeddings) served as stored:
the weights stay in their GGUF blocks (about the file's size in memory) and the C kernels
multiply int8-quantized activations by them. Held to kvmesh's float32 path on the dequantized
weights: greedy decoding agrees until float32 itself hesitates (its top-2 margin under 0.05
logits), and teacher-forced, the top-1 token agrees almost everywhere."""

from __future__ import annotations

import pytest
from test_real_model import GGUF, real_model  # noqa: F401  (the fixture)

PROMPT = "<|im_start|>user\nWrite a short story about a lighthouse keeper.<|im_end|>\n<|im_start|>assistant\n"
NEW_TOKENS = 160
BACKENDS = {}  # id(model) -> the CpuBackend installed on it


@pytest.fixture(scope="module")
def models(real_model):  # noqa: F811
    from kvmesh.kernels.cpu_ops import load_cpu_ops
    from kvmesh.shared.model.backend import CpuBackend
    from kvmesh.shared.model.loader import load_model

    ops = load_cpu_ops()
    if ops is None:
        pytest.skip("no C compiler for the CPU kernels")
    stored, tokenizer = load_model(str(real_model))
    floats, _ = load_model(str(real_model), dequantize=True)
    for model in (stored, floats):
        BACKENDS[id(model)] = CpuBackend(ops)
        BACKENDS[id(model)].install(model)
    return stored, floats, tokenizer


def _pool(model, num_tokens: int):
    from kvmesh.shared.kv.kv_cache import KVPool
    from kvmesh.shared.model.llama import kv_cache_spec
    from support.hf_fixtures import BLOCK_SIZE

    num_blocks = -(-num_tokens // BLOCK_SIZE)
    return KVPool(kv_cache_spec(model.config, BLOCK_SIZE), num_blocks), list(range(num_blocks))


def test_stored_weights_take_about_the_files_bytes(real_model, models) -> None:  # noqa: F811
    from kvmesh.shared.model.quant_layers import QuantEmbedding, QuantLinear

    stored, _, _ = models
    quant = [m for m in stored.modules() if isinstance(m, (QuantLinear, QuantEmbedding))]
    formats = {m.qweight.format for m in quant}
    assert formats == {"Q4_1", "Q8_0"}
    total = sum(m.qweight.nbytes for m in quant if isinstance(m, QuantEmbedding))
    total += sum(m.qweight.nbytes for m in stored.modules() if isinstance(m, QuantLinear))
    total -= stored.tok_embeddings.head.qweight.nbytes  # the tied head shares the embeddings
    total += sum(p.numel() * p.element_size() for p in stored.parameters())
    assert total <= (real_model / GGUF).stat().st_size * 1.02


def _float32_answer(floats, tokenizer):
    """Float32's greedy answer to PROMPT on ``floats`` (a model's weights dequantized), and its
    logits at each of the answer's positions (teacher forcing): what a stored format is held to."""
    from support.hf_fixtures import greedy_generate, prefill_logits

    prompt = tokenizer.encode(PROMPT)
    pool = _pool(floats, len(prompt) + NEW_TOKENS)
    expected = greedy_generate(floats, prompt, NEW_TOKENS, *pool, BACKENDS[id(floats)])
    ids = prompt + expected
    logits = prefill_logits(floats, ids, *_pool(floats, len(ids)))[len(prompt) - 1 : -1]
    return prompt, expected, logits


@pytest.fixture(scope="module")
def float32_answer(models):
    """The shipped file's float32 answer (its Q4_1 weights dequantized)."""
    _, floats, tokenizer = models
    return _float32_answer(floats, tokenizer)


@pytest.fixture(scope="module")
def q8_0(real_model):  # noqa: F811
    """The same model with every Q4_1 matrix requantized to Q8_0 (dequantized, then quantized
    again, as ``llama-quantize --allow-requantize`` makes a Q8_0 file from this one; the token
    embeddings are Q8_0 already): the 8-bit format, without a second file to ship. With it, its
    float32 answer: the same module tree with every weight the Q8_0 values dequantized (the
    engine ``--dequantize`` makes of that file), so the two differ only by the kernels' int8
    activations and the order of their float sums, not by the weights."""
    from kvmesh.kernels.cpu_ops import load_cpu_ops
    from kvmesh.shared.model.backend import CpuBackend
    from kvmesh.shared.model.loader import load_model
    from kvmesh.shared.model.quant import dequantize, quantize
    from kvmesh.shared.model.quant_layers import QuantLinear

    model, tokenizer = load_model(str(real_model))
    floats, _ = load_model(str(real_model), dequantize=True)
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear) and module.qweight.format != "Q8_0":
            module.qweight = quantize(dequantize(module.qweight), "Q8_0")
            floats.get_submodule(name).weight.copy_(dequantize(module.qweight))
    for m in (model, floats):
        BACKENDS[id(m)] = CpuBackend(load_cpu_ops())
        BACKENDS[id(m)].install(m)
    return model, _float32_answer(floats, tokenizer)


@pytest.mark.parametrize(
    ("fmt", "least_agreement"),
    # issue 41: at least 99% for 8-bit, reported for 4-bit. Measured: Q4_1 1.0; Q8_0 1.0
    # against its own float32 (held to the Q4_1 file's float32 instead, 0.975: the requantized
    # weights miss four of its near-ties, margins 0.014-0.026, with float activations as well)
    [("Q4_1", 0.95), ("Q8_0", 0.99)],
)
def test_greedy_agrees_with_float32_until_it_hesitates(
    fmt, least_agreement, request, models
) -> None:
    from support.hf_fixtures import greedy_generate, prefill_logits

    stored, _, tokenizer = models
    if fmt == "Q4_1":  # each format's model and reference built for its case only
        model, (prompt, expected, logits) = stored, request.getfixturevalue("float32_answer")
    else:
        model, (prompt, expected, logits) = request.getfixturevalue("q8_0")
    pool = _pool(model, len(prompt) + NEW_TOKENS)
    got = greedy_generate(model, prompt, NEW_TOKENS, *pool, BACKENDS[id(model)])
    top2 = logits.topk(2, -1).values
    hesitant = (top2[:, 0] - top2[:, 1] < 0.05).nonzero()
    until = int(hesitant[0]) if hesitant.numel() else NEW_TOKENS
    assert got[:until] == expected[:until]
    # teacher-forced on float32's answer: the top-1 tokens agree
    ids = prompt + expected
    ours = prefill_logits(model, ids, *_pool(model, len(ids)))[len(prompt) - 1 : -1]
    same = ours.argmax(-1) == logits.argmax(-1)
    agreement = same.float().mean().item()
    if fmt == "Q8_0":  # 8-bit: every position where float32 is sure (margin >= 0.05) agrees
        assert same[top2[:, 0] - top2[:, 1] >= 0.05].all()
    diverged = next(
        (i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b), NEW_TOKENS
    )
    print(f"{fmt}: teacher-forced top-1 agreement {agreement:.4f}; greedy equal for {diverged}")
    assert agreement >= least_agreement
    assert "lighthouse" in tokenizer.decode(got).lower()


def test_the_readmes_question_gets_float32s_answer_on_the_kernels(models) -> None:
    """Through the engine (decode on the quantized kernels): the README's first request, greedy,
    answers as float32 does. One int8 pass in the prompt's layers and the LM head flipped its
    first token (a 0.08-logit margin) to "L'Étoile, la Cité, ..." (issue 41)."""
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine
    from kvmesh.shared.text.sampling import SamplingOptions

    stored, floats, tokenizer = models
    ids = tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    answers = []
    for model in (floats, stored):
        engine = LLMEngine(model, tokenizer, EngineConfig(num_blocks=64))
        answers.append(engine.generate([ids], SamplingOptions(temperature=0.0, max_tokens=16))[0])
    assert answers[1] == answers[0]
    assert tokenizer.decode(answers[1]).startswith("The capital of France is Paris.")


def test_fused_decode_layers_give_the_module_paths_tokens(models) -> None:
    """Decode on the stored weights runs each layer in one C call (``kv_decode_layer_quant``):
    greedy, its tokens are those of the same weights run module by module (bit for bit the same
    arithmetic)."""
    from kvmesh.kernels.cpu_ops import QuantDecodeLayerWeights
    from kvmesh.shared.model.backend import CpuBackend
    from kvmesh.shared.model.cpu_modules import FusedDecodeBlock
    from support.hf_fixtures import greedy_generate

    stored, _, tokenizer = models
    prompt = tokenizer.encode(PROMPT)
    assert all(isinstance(lay, FusedDecodeBlock) for lay in stored.layers)
    assert all(isinstance(lay.weights, QuantDecodeLayerWeights) for lay in stored.layers)
    backend = BACKENDS[id(stored)]
    fused = greedy_generate(stored, prompt, 48, *_pool(stored, len(prompt) + 48), backend)
    per_module_backend = CpuBackend(backend.cpu_ops, fuse_layers=False)
    per_module_backend.install(stored)
    try:
        per_module = greedy_generate(
            stored, prompt, 48, *_pool(stored, len(prompt) + 48), per_module_backend
        )
    finally:
        backend.install(stored)
    assert fused == per_module
