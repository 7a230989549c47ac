"""Tensor-parallel engine runs for tests/test_tensor_parallel.py: the cases, one engine run each
(TP1 in the test's process, TP2 and TP4 in rank processes that share one gloo world of 4)."""

from __future__ import annotations

import os
from typing import Any

PROMPTS = [list(range(60, 100)), [7, 260, 65, 66, 67, 200, 9]]  # 40 tokens (chunked), 7
MAX_TOKENS = 6
NUM_BLOCKS = 16
WORLD = 4


def tiny_model(quant: str | None) -> Any:
    """kvmesh-tiny in float32, or with every linear layer and the embeddings kept as ``quant``."""
    import torch
    from kvmesh.shared.model.loader import load_model
    from kvmesh.shared.model.quant import quantize
    from kvmesh.shared.model.quant_layers import use_quant_weights

    model, _ = load_model("kvmesh-tiny", torch.float32)
    if quant is not None:
        names = [n for n, p in model.named_parameters() if p.dim() == 2]
        weights = {n: quantize(model.get_parameter(n).detach(), quant) for n in names}
        use_quant_weights(model, weights)
    return model


def run_engine(model: Any) -> dict[str, Any]:
    """Greedy tokens of PROMPTS through one engine (a long prompt prefilled in chunks while the
    short one decodes), and the engine's KV pool afterwards: (blocks, heads held, L, 2, bs, D)."""
    from kvmesh.shared.engine.llm_engine import EngineConfig, LLMEngine
    from kvmesh.shared.text.sampling import SamplingOptions

    config = EngineConfig(
        block_size=16, num_blocks=NUM_BLOCKS, max_num_batched_tokens=16, enable_prefix_caching=False
    )
    engine = LLMEngine(model, None, config)
    params = SamplingOptions(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    tokens = engine.generate(PROMPTS, params)
    return {
        "tokens": tokens,
        "kv": engine.kv_pool.tensor.clone(),
        "block_bytes": engine.kv_pool.spec.block_bytes,
    }


def rank_main(rank: int, port: int, queue: Any) -> None:
    """One rank of the world of 4: TP4 over all (kvmesh-tiny has 2 KV heads: each replicated on
    two ranks), then TP2 in pairs: ranks 0-1 on the float32 model, 2-3 on its Q8_0 twin."""
    import torch
    import torch.distributed as dist
    from kvmesh.shared.model.tensor_parallel import shard_model

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    try:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        results: dict[str, Any] = {}
        model = tiny_model(None)
        layout = shard_model(model)
        results["tp4"] = run_engine(model) | {"kv_heads": layout.kv_heads}
        quant = None if rank < 2 else "Q8_0"
        model = tiny_model(quant)
        layout = shard_model(model, pairs[rank // 2])
        case = "tp2" if quant is None else "tp2_q8"
        results[case] = run_engine(model) | {"kv_heads": layout.kv_heads}
        queue.put((rank, results))
    finally:
        dist.destroy_process_group()
