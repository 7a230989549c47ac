"""The arguments of the fused decode layers' C calls (``CpuOps.decode_layer`` and
``decode_layer_quant``): the attention's, checked and built by a step's first layer and kept for
the others (``StepMemo``), the ctypes structs of an fp8 or int8 cache and of draft-tree rows, and
the weights' pointers.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
from kvmesh.kernels.cpu_plans import (
    DecodeLayerKV,
    DecodeLayerWeights,
    DecodePlan,
    KVQuant,
    PackedWeight,
    QuantDecodeLayerWeights,
    check_f32_contiguous,
)
from kvmesh.shared.kv.kv_int8 import GROUP as INT8_GROUP
from kvmesh.shared.kv.kv_quant import e4m3_lut
from kvmesh.shared.model.quant import QuantWeight, StackedWeight

# an unquantized KV cache's element type as the kernels name it (KV_F32 ... in cpu_kernels.h)
KV_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


class StepMemo:
    """What ``CpuOps._step_args`` keeps of a decode step: its plan and rotation rows, tables and
    lengths (compared by identity), the layer shapes and threads (``key``), the attention
    arguments the first layer built, and work buffers by shape."""

    __slots__ = ("args", "buffers", "keep", "key", "plan", "rows")

    def __init__(self, plan: DecodePlan, rows: tuple, key: tuple, args: tuple, keep: tuple):
        self.plan, self.rows, self.key, self.args, self.keep = plan, rows, key, args, keep
        self.buffers: dict[tuple, list[torch.Tensor]] = {}

    def work(
        self, x: torch.Tensor, sizes: tuple[int, ...], dtype: torch.dtype = torch.float32
    ) -> list[torch.Tensor]:
        """Contiguous buffers of batch * n for each n of ``sizes``, one allocation, the same ones
        for every layer of the step (each layer's call is done before the next one's)."""
        found = self.buffers.get((sizes, dtype))
        if found is None:
            batch = x.shape[0]
            flat = torch.empty(batch * sum(sizes), dtype=dtype)
            found = list(flat.split([batch * n for n in sizes]))
            self.buffers[(sizes, dtype)] = found
        return found


def layer_attention_args(
    x: torch.Tensor,
    w: DecodeLayerWeights | QuantDecodeLayerWeights,
    kv: DecodeLayerKV,
    parts_floats: Callable[[int, int, int, int], int],
) -> tuple[tuple, tuple]:
    """The fused layers' attention arguments (heads, cache, tables, plan, threads, fp8/int8
    and tree structs, the room for partial results) after checking them against x (batch,
    hidden) and the layer; and what they point into, to keep alive through the call.
    ``parts_floats``: the library's ``kv_attention_parts_floats``."""
    check_f32_contiguous(x=x, cos=kv.cos, sin=kv.sin)
    batch, hidden = x.shape
    k_cache, v_cache, plan = kv.k_cache, kv.v_cache, kv.plan
    _, block_size, num_kv_heads, d = k_cache.shape
    strides = k_cache.stride()
    num_threads = torch.get_num_threads()
    assert hidden == w.hidden and num_kv_heads == w.num_kv_heads and d == w.head_dim, (
        x.shape,
        k_cache.shape,
    )
    assert kv.cos.shape == kv.sin.shape == (batch, 1, d), (kv.cos.shape, kv.sin.shape)
    assert k_cache.dtype == v_cache.dtype and is_cache_dtype(k_cache.dtype, kv.scales)
    assert k_cache.is_cpu
    assert v_cache.shape == k_cache.shape and v_cache.stride() == strides
    assert strides[1] == d and strides[3] == 1, strides
    assert kv.block_tables.dtype == kv.context_lens.dtype == torch.int64
    assert kv.block_tables.is_contiguous() and kv.context_lens.is_contiguous()
    assert kv.block_tables.shape[0] == kv.context_lens.shape[0] == batch
    width = kv.block_tables.shape[1]
    stride = plan.scratch.shape[1]
    assert plan.batch == batch and plan.scratch.shape[0] >= num_threads, (
        "the plan was made for another step or thread count"
    )
    assert stride >= width * block_size * (w.num_q_heads // num_kv_heads), plan.scratch.shape
    quant = quant_args(kv.scales, plan, k_cache)
    args = (
        w.num_q_heads,
        num_kv_heads,
        d,
        kv.cos.data_ptr(),
        kv.sin.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        strides[0],
        strides[2],
        block_size,
        kv.block_tables.data_ptr(),
        width,
        kv.context_lens.data_ptr(),
        w.scale,
        plan.scratch.data_ptr(),
        stride,
        num_threads,
        None if quant is None else ctypes.addressof(quant),
        tree_arg(plan),
        KV_DTYPE_CODES.get(k_cache.dtype, 0),
    )
    # an unquantized cache's attention splits by chunks of context over the threads: each
    # thread's room for the partial results of the units it shares with others
    parts = None
    if quant is None:
        group = w.num_q_heads // num_kv_heads
        parts_stride = parts_floats(width, block_size, group, d)
        parts = torch.empty(num_threads * parts_stride)
    args += (None, 0) if parts is None else (parts.data_ptr(), parts_stride)
    return args, (quant, parts)


def tree_arg(plan: DecodePlan) -> int | None:
    return None if plan.tree is None else ctypes.addressof(plan.tree)


def is_cache_dtype(dtype: torch.dtype, kv_scales: tuple[torch.Tensor, ...] | None) -> bool:
    """Whether the kernels read a cache of ``dtype`` with (or without) ``kv_scales``."""
    if kv_scales is None:
        return dtype in KV_DTYPE_CODES
    return dtype in (torch.float8_e4m3fn, torch.int8)


def quant_args(
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None, plan: DecodePlan, k_cache: torch.Tensor
) -> KVQuant | None:
    """The kernels' quantized-cache argument for a cache with ``kv_scales`` (None for float32):
    fp8 scales (num_blocks, H_kv), int8 scales (num_blocks, block_size, H_kv, D // 32)."""
    if kv_scales is None:
        return None
    k_scales, v_scales = kv_scales
    num_blocks, block_size, num_kv_heads, d = k_cache.shape
    assert plan.quant_offset is not None, "the plan was made for a float32 cache"
    assert k_scales.dtype == v_scales.dtype == torch.float32 and k_scales.is_cpu
    assert k_scales.stride() == v_scales.stride(), (k_scales.stride(), v_scales.stride())
    if k_cache.dtype == torch.int8:
        shape = (num_blocks, block_size, num_kv_heads, d // INT8_GROUP)
        assert k_scales.shape == v_scales.shape == shape, (k_scales.shape, shape)
        block_stride, slot_stride, head_stride, group_stride = k_scales.stride()
        assert group_stride == 1, k_scales.stride()
        return KVQuant(
            None,
            k_scales.data_ptr(),
            v_scales.data_ptr(),
            block_stride,
            head_stride,
            slot_stride,
            plan.quant_offset,
        )
    assert k_scales.shape == v_scales.shape == (num_blocks, num_kv_heads), k_scales.shape
    return KVQuant(
        e4m3_lut().data_ptr(),
        k_scales.data_ptr(),
        v_scales.data_ptr(),
        *k_scales.stride(),
        0,
        plan.quant_offset,
    )


def weight_bias(weight: PackedWeight, bias: torch.Tensor | None) -> tuple[int, int | None]:
    return weight.panels.data_ptr(), None if bias is None else bias.data_ptr()


def quant_weight_bias(
    weight: QuantWeight | StackedWeight, bias: torch.Tensor | None
) -> tuple[int, int | None]:
    return weight.data.data_ptr(), None if bias is None else bias.data_ptr()
