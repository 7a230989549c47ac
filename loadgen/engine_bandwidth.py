"""The bytes a decode step moves and how close it comes to the memory-bandwidth limit, for
``kvmesh bench engine``: each weight the step reads once (the LM head's included) plus the KV of
every sequence's context, per token and as GB/s at the measured rate, beside ``memcpy``'s
bandwidth measured in the same run on the same threads and clock."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

MEMCPY_BYTES = 256 << 20


def decode_weight_bytes(model: Any) -> int:
    """Bytes of the weights one decode step reads: every decoder layer's linear weights as kept
    (stored blocks, or float), and the LM head's (the embedding table where they are tied),
    each tensor once."""
    import torch
    from kvmesh.shared.model.quant_layers import QuantEmbedding, QuantLinear

    def tensors(m: Any) -> list:
        if isinstance(m, QuantLinear | QuantEmbedding):
            return [p.data for p in getattr(m.qweight, "parts", (m.qweight,))]
        return [m.weight]

    linears = [m for m in model.layers.modules() if isinstance(m, QuantLinear | torch.nn.Linear)]
    head = getattr(model, "output", None) or model.tok_embeddings  # tied: the embedding table
    seen = {t.data_ptr(): t.nbytes for m in (*linears, head) for t in tensors(m)}
    return sum(seen.values())


def decode_bytes(weight_bytes: int, kv_token_bytes: float, batch: int, context: float) -> float:
    """Bytes a decode step of ``batch`` sequences at ``context`` tokens each reads: the weights
    once, and every sequence's K and V (``kv_token_bytes`` a token, all layers)."""
    return weight_bytes + batch * context * kv_token_bytes


def memcpy_gb_s(
    clock: Callable[[], float] = time.perf_counter, repeats: int = 5, num_bytes: int = MEMCPY_BYTES
) -> float:
    """memcpy bandwidth on torch's threads: a copy of ``num_bytes`` (past every cache), bytes
    read plus bytes written per second, best of ``repeats``, timed by ``clock`` (the run's: on a
    shared machine the CPU clock keeps other processes' time out of it, as for the steps)."""
    import torch

    src = torch.ones(num_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats + 1):  # the first copy faults the destination's pages in
        t0 = clock()
        dst.copy_(src)
        best = min(best, clock() - t0)
    return round(2 * num_bytes / best / 1e9, 1)


def bandwidth(
    results: dict, runners: dict[str, Any], context: float, memcpy: float
) -> dict[str, dict]:
    """Per system with known bytes (kvmesh and its float32 reference): per batch size the MB a
    decode step reads per token and the GB/s that is at the measured rate, and its share of
    ``memcpy`` (GB/s)."""
    out: dict[str, dict] = {}
    for name, r in runners.items():
        if not hasattr(r, "weight_bytes"):
            continue
        spec = r.engine.kv_pool.spec
        kv_token = spec.block_bytes / spec.block_size
        rows = {}
        for b, tok_s in results[name]["decode_tok_s"].items():
            step = decode_bytes(r.weight_bytes, kv_token, int(b), context)
            gb_s = step / int(b) * tok_s / 1e9
            rows[b] = {
                "mb_per_token": round(step / int(b) / 1e6, 1),
                "gb_s": round(gb_s, 1),
                "of_memcpy": round(gb_s / memcpy, 2),
            }
        out[name] = {"kv_dtype": str(spec.dtype).removeprefix("torch."), "decode": rows}
    return out
