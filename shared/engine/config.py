"""EngineConfig: the knobs of one LLMEngine, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from kvmesh.shared.kv.kv_cache import KVCacheSpec

if TYPE_CHECKING:
    from kvmesh.shared.config.worker_config import EngineWorkerConfig

DEFAULT_KV_CACHE_BYTES = 256 * 1024 * 1024
# "auto": the KV pool has the model's dtype (or EngineConfig.dtype), float16 where that is float32
# and the weights are kept quantized (llama.cpp's f16 default; EngineConfig.kv_dtype); "int8":
# int8 with a scale per 32 values of each token (the recommended 8-bit format); "fp8_e4m3":
# float8 e4m3 with per-(block, KV head) scales (docs/kv_cache.md); "float16", "bfloat16": a 16-bit
# pool beside a model computing in float32 (half its KV bytes; the CPU decode kernels read it
# directly); "float32": a float32 pool whatever the weights (auto's old choice for them)
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3", "float16", "bfloat16", "float32")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """``num_blocks`` sizes the KV pool directly; otherwise ``kv_cache_bytes`` (default 256 MiB)
    is divided by the block size in bytes. ``max_model_len`` defaults to the model's
    ``max_position_embeddings``. ``dtype`` is the KV cache dtype (default: the model's).
    ``cpu_kernels``: see kernels/cpu_ops.py. ``kv_cache_dtype``: "auto" keeps the KV pool in
    ``dtype``, or float16 where that is float32 and the model's weights are kept as stored
    (``kv_dtype``); "int8" stores it as int8 with a float32 scale per 32 values of each token (1.125
    bytes a value); "fp8_e4m3" as float8 e4m3 with per-(block, KV head) scales (docs/kv_cache.md),
    a quarter of float32's bytes, half of bf16's."""

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    device: str = "cpu"
    dtype: torch.dtype | None = None
    seed: int | None = None  # noise for unseeded sampling
    # float32 decode on the CPU through the C kernels of kernels/cpu_ops.c, when a C compiler
    # can build them (otherwise, or with False, the pure-torch path)
    cpu_kernels: bool = True
    # Admission keeps room for this many output tokens of every admitted sequence (capped by its
    # max_tokens), so decodes rarely outgrow the pool and preempt (a preempted sequence recomputes
    # its whole prompt: a stall for every stream). 0: admit while the prompt fits (nano-vllm).
    reserve_output_tokens: int = 0
    # A step with no decode in it (nothing it would stall) lets the oldest prompt prefill up to
    # this many tokens (0: max_num_batched_tokens always; scheduler.py).
    max_num_batched_tokens_no_decode: int = 0
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"EngineConfig.{name} must be a positive integer, got {value!r}")
        if (
            not isinstance(self.max_num_batched_tokens_no_decode, int)
            or self.max_num_batched_tokens_no_decode < 0
        ):
            raise ValueError(
                "EngineConfig.max_num_batched_tokens_no_decode must be an integer >= 0, got "
                f"{self.max_num_batched_tokens_no_decode!r}"
            )
        if not isinstance(self.reserve_output_tokens, int) or self.reserve_output_tokens < 0:
            raise ValueError(
                "EngineConfig.reserve_output_tokens must be an integer >= 0, got "
                f"{self.reserve_output_tokens!r}"
            )
        for name in ("num_blocks", "kv_cache_bytes", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(
                    f"EngineConfig.{name} must be a positive integer or None, got {value!r}"
                )
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError(
                f"EngineConfig.max_num_batched_tokens ({self.max_num_batched_tokens}) must be at "
                f"least block_size ({self.block_size}): hand-off prefill chunks are whole blocks"
            )
        if self.num_blocks is not None and self.kv_cache_bytes is not None:
            raise ValueError("EngineConfig: give num_blocks or kv_cache_bytes, not both")
        if self.dtype is not None and not (
            isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point
        ):
            raise ValueError(
                f"EngineConfig.dtype must be a floating torch.dtype, got {self.dtype!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"EngineConfig.kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                f"{self.kv_cache_dtype!r}"
            )
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(
                f"EngineConfig.device {self.device!r} is not a torch device: {exc}"
            ) from exc

    def kv_dtype(self, model_dtype: torch.dtype, weights_stored: bool = False) -> torch.dtype:
        """The KV pool's element dtype for a model computing in ``model_dtype``: the one place
        "auto" is resolved (every engine's pool, the draft service's, the KV store's blocks).
        "auto" is the compute dtype (``dtype``, else the model's), except that float32 compute
        over weights kept as stored (``weights_stored``: Q4/Q8 blocks, F16/BF16 matrices; see
        ``quant_layers.keeps_weights_stored``, ``quant_formats.checkpoint_keeps_stored``) gets
        float16: llama.cpp's default KV, and vLLM's "auto" for a GGUF model; half the bytes a
        decode step's attention reads. A float32 model keeps float32."""
        if self.kv_cache_dtype == "fp8_e4m3":
            return torch.float8_e4m3fn
        if self.kv_cache_dtype == "int8":
            return torch.int8
        if self.kv_cache_dtype in ("float16", "bfloat16", "float32"):
            return getattr(torch, self.kv_cache_dtype)
        compute = self.dtype or model_dtype
        return torch.float16 if weights_stored and compute == torch.float32 else compute

    def pool_spec(
        self,
        model_config: Any,
        model_dtype: torch.dtype,
        num_kv_heads: int | None = None,
        weights_stored: bool = False,
    ) -> KVCacheSpec:
        """The block layout of the KV pool for a model of ``model_config`` (its layers, KV heads,
        head size) computing in ``model_dtype``; ``num_kv_heads``: the heads a tensor-parallel
        rank holds (default: all); ``weights_stored``: see ``kv_dtype``."""
        return KVCacheSpec(
            num_layers=model_config.num_hidden_layers,
            num_kv_heads=model_config.num_key_value_heads if num_kv_heads is None else num_kv_heads,
            head_dim=model_config.head_dim,
            block_size=self.block_size,
            dtype=self.kv_dtype(model_dtype, weights_stored),
        )

    def pool_layout(
        self,
        model_config: Any,
        model_dtype: torch.dtype,
        num_kv_heads: int | None = None,
        weights_stored: bool = False,
    ) -> tuple[KVCacheSpec, int]:
        """The KV pool of an engine holding ``num_kv_heads`` of the model's KV heads (a
        tensor-parallel rank's share; default: all): its block layout and its blocks. The blocks
        are the whole model's count: ``num_blocks``, else ``kv_cache_bytes`` over the whole
        model's block, so a TP worker's ranks hold the blocks a TP1 pool of those bytes holds,
        each rank its heads of every block (its pool's bytes its head slice's; docs/tp.md)."""
        whole = self.pool_spec(model_config, model_dtype, None, weights_stored)
        spec = (
            whole
            if num_kv_heads is None
            else self.pool_spec(model_config, model_dtype, num_kv_heads, weights_stored)
        )
        return spec, self.resolve_num_blocks(whole.block_bytes)

    def resolve_num_blocks(self, block_bytes: int) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        num_bytes = self.kv_cache_bytes or DEFAULT_KV_CACHE_BYTES
        num_blocks = num_bytes // block_bytes
        if num_blocks == 0:
            raise ValueError(
                f"kv_cache_bytes={num_bytes} is smaller than one KV block ({block_bytes} bytes)"
            )
        return num_blocks


def worker_engine_config(
    worker: EngineWorkerConfig, dtype: torch.dtype | None, **role: Any
) -> EngineConfig:
    """The engine of a worker (prefill, decode, draft), built one way: the pool (block size,
    blocks or bytes, KV cache dtype), device and prefix caching from its config, ``dtype`` (None:
    the model's), and ``role``: the fields its role sets or overrides (batch and chunk sizes, the
    output reserve; a prefill worker's draft engine its own pool bytes)."""
    fields: dict[str, Any] = {
        "block_size": worker.block_size,
        "num_blocks": worker.num_blocks,
        "kv_cache_bytes": worker.kv_cache_bytes,
        "kv_cache_dtype": worker.kv_cache_dtype,
        "enable_prefix_caching": worker.enable_prefix_caching,
        "device": worker.device,
        "dtype": dtype,
    }
    return EngineConfig(**(fields | role))
