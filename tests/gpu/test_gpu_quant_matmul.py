"""The quantized matmul (kernels/quant_matmul.py) compiled for a CUDA GPU against its torch
reference at real shapes (Llama-3.2-1B's projections; one row, a few, a prefill chunk), and the
engine on CUDA serving a checkpoint with its weights kept as stored (the synthetic GGUF of
tests/support/gguf_fixtures.py: F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K tensors) through the
Triton modules, giving the greedy tokens of the same checkpoint dequantized (the float path).

``gpu``-marked: skipped without CUDA; `make gpu-check` runs them. Never yet run on real hardware
(docs/gpu.md).
"""

from __future__ import annotations

import pytest
import torch
from kvmesh.shared.model.quant import K_FORMATS, dequantize, quantize
from support.kquant import random_k

pytestmark = pytest.mark.gpu

DEVICE = "cuda"


@pytest.mark.parametrize("format", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K", "BF16"])
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_reference_on_cuda_at_real_shapes(format, rows, dtype):
    from kvmesh.kernels.quant_matmul import quant_dequantize, quant_matmul, quant_matmul_ref

    out_features, in_features = 2048 + 40, 2048  # a masked last tile of outputs
    if format in K_FORMATS:
        weight = random_k(format, out_features, in_features, seed=rows).to(DEVICE)
    else:
        g = torch.Generator().manual_seed(rows)
        floats = torch.randn(out_features, in_features, generator=g) * 0.05
        weight = quantize(floats, format).to(DEVICE)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1))
    x = x.to(DEVICE, dtype)

    y = quant_matmul(x, weight)

    ref = quant_matmul_ref(x, weight).float()
    tol = 1e-4 if dtype == torch.float32 else 3e-2 * ref.abs().max().item()
    torch.testing.assert_close(y.float(), ref, rtol=0, atol=tol)
    assert torch.equal(quant_dequantize(weight, torch.float32), dequantize(weight))


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    from kvmesh.shared.model.gguf_import import import_gguf
    from support.gguf_fixtures import write_gguf

    root = tmp_path_factory.mktemp("gguf")
    write_gguf(root / "synthetic.gguf")
    import_gguf(root / "synthetic.gguf", root / "stored")
    return root / "stored"


def _greedy(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine
    from kvmesh.shared.text.sampling import SamplingOptions

    # float32 KV on both sides ("auto" is float16 over weights kept as stored): the test holds
    # the kernels' sums, not the KV's rounding, to the float path's
    config = EngineConfig(
        num_blocks=256, device=DEVICE, max_num_seqs=len(prompts), kv_cache_dtype="float32"
    )
    engine = LLMEngine(model, None, config)
    params = SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return engine.generate(prompts, params)


def test_engine_on_cuda_with_weights_as_stored_gives_the_float_paths_tokens(stored):
    """float32 on both sides over the same values; only the order of the sums differs (the
    kernel's tiles against cuBLAS), far below the synthetic model's logit margins."""
    from kvmesh.shared.model.loader import load_model
    from kvmesh.shared.model.triton_modules import TritonQuantLinear

    model, _ = load_model(str(stored), torch.float32, DEVICE)
    float_model, _ = load_model(str(stored), torch.float32, DEVICE, dequantize=True)
    g = torch.Generator().manual_seed(3)
    vocab = model.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 17, 40)]

    tokens = _greedy(model, prompts, 16)

    assert any(type(m) is TritonQuantLinear for m in model.modules())  # installed on CUDA
    assert tokens == _greedy(float_model, prompts, 16)
