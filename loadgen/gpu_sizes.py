"""How big each benchmark of ``make gpu-check`` (``gpu_bench.py``) runs: ``GPU_SIZES`` are the
issue's, ``DRY_SIZES`` run the same code on the CPU at tiny sizes (Triton under
``TRITON_INTERPRET=1``), which checks the code paths only and says nothing about a GPU."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True, slots=True)
class BenchSizes:
    """How big each benchmark runs. ``GPU_SIZES`` are the issue's; ``DRY_SIZES`` only exercise
    the code on a CPU."""

    dtype: torch.dtype
    # kv pack/scatter: a pool of pool_blocks blocks, pack_blocks of them (scattered), half the heads
    pool_blocks: int
    pack_blocks: int
    kv_heads: int
    layers: int
    block_size: int
    head_dim: int
    # paged decode attention
    attention_batches: tuple[int, ...]
    attention_heads: int  # query heads (kv_heads KV heads)
    attention_context: int
    # engine decode
    engine_batches: tuple[int, ...]
    engine_prompt_len: int
    engine_new_tokens: int
    model: dict[str, int]  # the seeded model's shape (realistic_config's arguments)
    # quantized matmul: a (out, in) weight in each format, x of each row count
    quant_shape: tuple[int, int]
    quant_formats: tuple[str, ...]
    quant_rows: tuple[int, ...]
    iters: int  # timed repetitions of a kernel


GPU_SIZES = BenchSizes(
    dtype=torch.bfloat16,
    pool_blocks=2048,
    pack_blocks=512,
    kv_heads=8,
    layers=16,
    block_size=16,
    head_dim=64,
    attention_batches=(1, 32, 128),
    attention_heads=32,
    attention_context=2048,
    engine_batches=(1, 64),
    engine_prompt_len=128,
    engine_new_tokens=128,
    model=dict(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, vocab_size=32000),
    quant_shape=(16384, 2048),  # Llama-3.2-1B's gate and up projections
    quant_formats=("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"),
    quant_rows=(1, 8, 512),
    iters=20,
)

DRY_SIZES = BenchSizes(
    dtype=torch.float32,
    pool_blocks=8,
    pack_blocks=4,
    kv_heads=2,
    layers=2,
    block_size=4,
    head_dim=8,
    attention_batches=(1, 2),
    attention_heads=4,
    attention_context=12,
    engine_batches=(1, 2),
    engine_prompt_len=8,
    engine_new_tokens=4,
    model=dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=300),
    quant_shape=(64, 256),
    quant_formats=("Q4_1", "Q4_K"),
    quant_rows=(1,),
    iters=2,
)
