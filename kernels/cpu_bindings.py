"""``CpuOps``: the kernels of one loaded C library (``cpu_ops.py`` builds and loads it) bound
through ctypes, each behind a wrapper that checks shapes, strides and dtypes. The fused layers'
arguments are built in ``cpu_layer_args.py``; the torch definitions the tests hold the kernels to
are in ``cpu_references.py``.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from kvmesh.kernels.cpu_layer_args import (
    KV_DTYPE_CODES,
    StepMemo,
    is_cache_dtype,
    layer_attention_args,
    quant_args,
    quant_weight_bias,
    tree_arg,
    weight_bias,
)
from kvmesh.kernels.cpu_plans import (
    DecodeLayerKV,
    DecodeLayerWeights,
    DecodePlan,
    PackedWeight,
    QuantDecodeLayerWeights,
    check_f32_contiguous,
    decode_plan,
    quant_scale_stride,
)
from kvmesh.shared.model.quant import GROUP, QuantWeight, StackedWeight, dequantize
from kvmesh.shared.model.quant_formats import FORMAT_CODES

_i64, _f32, _ptr, _int = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {
    # x, rows, in, format, weight, out features, bias or NULL, y, xq, xs, threads
    "kv_qlinear": (_ptr, _i64, _i64, _int, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64),
    # format (without the paired flag), weight, groups of 16 rows, in, out, threads
    "kv_dequant_groups": (_int, _ptr, _i64, _i64, _ptr, _i64),
    "kv_rms_norm": (_ptr, _ptr, _ptr, _i64, _i64, _f32),
    "kv_silu_mul": (_ptr, _ptr, _i64, _i64),
    # x, rows, in, packed weight, out features, bias or NULL, y, threads
    "kv_linear": (_ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64),
    # x, rows, in, row-major weight, out features, y, threads
    "kv_linear_rows": (_ptr, _i64, _i64, _ptr, _i64, _ptr, _i64),
    # qkv, heads, kv heads, d, cos, sin, k, v, strides, block size, tables, width, context
    # lens, scale, out, scratch, scratch stride, part bounds, parts, fp8 or int8 (KVQuant* or NULL),
    # tree rows (KVTree* or NULL), the cache's element type (KV_DTYPE_CODES)
    "kv_decode_attention": (
        *(_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr),
        *(_i64, _i64, _i64, _ptr, _i64, _ptr, _f32, _ptr, _ptr, _i64, _ptr, _i64, _ptr, _ptr),
        _i64,
    ),
    # x, batch, hidden, attn norm, ffn norm, eps, wqkv, bqkv, wo, bo, wgu, bgu, wdown, bdown,
    # inter, xn, qkv, attn, gu, act, then the attention's: heads, kv heads, d, cos, sin, k, v,
    # strides, block size, tables, width, context lens, scale, scratch, scratch stride; threads;
    # fp8 or int8 (KVQuant* or NULL); tree rows (KVTree* or NULL); the cache's element type;
    # room for the attention's partial results (NULL: split by whole units), floats a thread
    "kv_decode_layer": (
        *(_ptr, _i64, _i64, _ptr, _ptr, _f32, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr),
        *(_i64, _ptr, _ptr, _ptr, _ptr, _ptr),
        *(_i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _f32),
        *(_ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr, _i64),
    ),
    # as kv_decode_layer's, with the four weights' format codes (int64 *) before the weights
    # and the quantized activation's room (xq, xs) after the work buffers
    "kv_decode_layer_quant": (
        *(_ptr, _i64, _i64, _ptr, _ptr, _f32, _ptr),
        *(_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr),
        *(_i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr),
        *(_i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _f32),
        *(_ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr, _i64),
    ),
}


class CpuOps:
    """Bound kernels of one loaded library."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, None
        self._rms_norm = lib.kv_rms_norm
        self._silu_mul = lib.kv_silu_mul
        self._decode_attention = lib.kv_decode_attention
        self._linear = lib.kv_linear
        self._linear_rows = lib.kv_linear_rows
        self._decode_layer = lib.kv_decode_layer
        self._decode_layer_quant = lib.kv_decode_layer_quant
        self._qlinear = lib.kv_qlinear
        self._dequant_groups = lib.kv_dequant_groups
        lib.kv_quant_pairs.argtypes, lib.kv_quant_pairs.restype = (), _i64
        # floats of a thread's room for attention partials (kv_attention_parts_floats)
        self._parts_floats = lib.kv_attention_parts_floats
        self._parts_floats.argtypes, self._parts_floats.restype = (_i64, _i64, _i64, _i64), _i64
        # whether the kernels read Q4, Q5 and Q8_0 weights in the paired layout (quant.pair_blocks;
        # the VNNI build): CpuBackend.install repacks those weights (the tied head's too) then
        self.quant_pairs = bool(lib.kv_quant_pairs())
        self._memo: StepMemo | None = None  # the last decode step's layer arguments

    def quant_linear(
        self,
        x: torch.Tensor,
        weight: QuantWeight | StackedWeight,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (rows, in) @ w.T (+ bias) for w kept in its format (``cpu_quant.c``,
        ``cpu_kquant.c``), x quantized per block of 32 to int8 on the way for a block format,
        read as float32 for F16 and BF16 (``quant_linear_exact_reference``): (rows, out). Runs on
        ``torch.get_num_threads()`` threads, each over its own output features."""
        check_f32_contiguous(x=x)
        m, k = x.shape
        assert k == weight.cols and weight.data.is_cpu, (x.shape, weight.shape)
        if isinstance(weight, StackedWeight):
            assert all(p.data.is_cpu for p in weight.parts), "a part of the weight is not on CPU"
        if bias is not None:
            check_f32_contiguous(bias=bias)
            assert bias.shape == (weight.rows,), (bias.shape, weight.rows)
        xq = torch.empty(m, k, dtype=torch.int8)
        xs = torch.empty(m, quant_scale_stride(k))
        out = x.new_empty(m, weight.rows)
        self._qlinear(
            x.data_ptr(),
            m,
            k,
            weight.code,
            weight.data.data_ptr(),
            weight.rows,
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            xq.data_ptr(),
            xs.data_ptr(),
            torch.get_num_threads(),
        )
        return out

    def dequantize(self, weight: QuantWeight | StackedWeight) -> torch.Tensor:
        """The weight as float32 (rows, in): ``quant.dequantize``'s values, bit for bit, a
        paired weight's interleaved groups of rows in C (``cpu_dequant.c``, on
        ``torch.get_num_threads()`` threads), the rest in torch."""
        return dequantize(weight, torch.float32, self._dequantize_groups)

    def _dequantize_groups(
        self, format: str, rows: torch.Tensor, cols: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """``quant_paired._dequantize_groups`` in C: ``rows`` (groups * 16, row bytes) of a
        paired weight on the CPU, as float32."""
        assert dtype == torch.float32 and rows.is_cpu and rows.is_contiguous(), (dtype, rows)
        out = torch.empty(rows.shape[0], cols)
        self._dequant_groups(
            FORMAT_CODES[format],
            rows.data_ptr(),
            rows.shape[0] // GROUP,
            cols,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out

    def linear(
        self, x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x (rows, in) @ w.T (+ bias) for w packed by ``pack_linear_weight``: (rows, out).
        Runs on ``torch.get_num_threads()`` threads, each over its own share of the weight."""
        check_f32_contiguous(x=x)
        k, n = weight.panels.shape[1], weight.out_features
        assert x.dim() == 2 and x.shape[1] == k, (x.shape, weight.panels.shape)
        if bias is not None:
            check_f32_contiguous(bias=bias)
            assert bias.shape == (n,), (bias.shape, n)
        out = x.new_empty(x.shape[0], n)
        self._linear(
            x.data_ptr(),
            x.shape[0],
            k,
            weight.panels.data_ptr(),
            n,
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out

    def linear_rows(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x (rows, in) @ w.T for w (out, in) float32 row-major as it is, read in place (no
        packed copy: a float32 model's tied LM head): (rows, out). Each row's result does not
        depend on the others. Runs on ``torch.get_num_threads()`` threads over w's rows."""
        check_f32_contiguous(x=x, weight=weight)
        assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], (
            x.shape,
            weight.shape,
        )
        out = x.new_empty(x.shape[0], weight.shape[0])
        self._linear_rows(
            x.data_ptr(),
            x.shape[0],
            x.shape[1],
            weight.data_ptr(),
            weight.shape[0],
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x: (rows, n) float32 contiguous; weight: (n,). A new (rows, n) tensor."""
        check_f32_contiguous(x=x, weight=weight)
        assert x.dim() == 2 and weight.shape == (x.shape[1],), (x.shape, weight.shape)
        out = torch.empty_like(x)
        self._rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), *x.shape, eps)
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: (rows, 2n) = [gate | up] float32 contiguous. Returns silu(gate) * up, (rows, n)."""
        check_f32_contiguous(gate_up=gate_up)
        assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0, gate_up.shape
        rows, n = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty(rows, n)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, n)
        return out

    def decode_attention(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        num_q_heads: int,
        scale: float,
        plan: DecodePlan | None = None,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One new token per sequence: rotate q and k of ``qkv`` in place, store k and v in their
        slots, attend over each sequence's context. Returns (batch, num_q_heads, head_dim).
        ``kv_scales``: the K and V scales of an fp8 or int8 cache (``KVPool.layer_scales``; the
        plan then needs ``quant_head_dim``), stored and read as ``shared/kv/kv_quant.py`` and
        ``kv_int8.py`` do.

        qkv: (batch, num_q_heads + 2 * H_kv, D); cos, sin: (batch, 1, D) rotation-table rows of
        each token's position; k_cache, v_cache: (num_blocks, block_size, H_kv, D) per-layer views
        of the pool (``KVPool.layer``); block_tables: (batch, width) int64; context_lens: (batch,)
        int64 including the new token. ``plan``: the step's ``decode_plan``, shared by its
        layers (built here when None).
        """
        # Called once per layer per decode step: the checks are kept to plain attribute reads.
        check_f32_contiguous(qkv=qkv, cos=cos, sin=sin)
        batch, num_heads, d = qkv.shape
        _, block_size, num_kv_heads, kd = k_cache.shape
        strides = k_cache.stride()
        assert num_heads == num_q_heads + 2 * num_kv_heads and kd == d, (qkv.shape, k_cache.shape)
        assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
        assert cos.shape == sin.shape == (batch, 1, d), (cos.shape, sin.shape)
        assert k_cache.dtype == v_cache.dtype and is_cache_dtype(k_cache.dtype, kv_scales), (
            k_cache.dtype,
            v_cache.dtype,
        )
        assert k_cache.is_cpu and v_cache.is_cpu, "the KV cache must be in CPU memory"
        assert v_cache.shape == k_cache.shape, (v_cache.shape, k_cache.shape)
        assert v_cache.stride() == strides and strides[1] == d and strides[3] == 1, strides
        assert block_tables.dtype == context_lens.dtype == torch.int64, "int64 tables and lengths"
        assert block_tables.is_cpu and block_tables.is_contiguous(), "block_tables: CPU, contiguous"
        assert context_lens.is_cpu and context_lens.is_contiguous(), "context_lens: CPU, contiguous"
        assert block_tables.dim() == 2 and block_tables.shape[0] == batch, block_tables.shape
        assert context_lens.shape == (batch,), context_lens.shape
        width = block_tables.shape[1]
        group = num_q_heads // num_kv_heads
        if plan is None:
            quant_d = 0 if kv_scales is None else d
            plan = decode_plan(context_lens, width, block_size, group, quant_head_dim=quant_d)
        assert plan.batch == batch and plan.scratch.shape[1] >= width * block_size * group, (
            "the plan was made for another step",
            plan.batch,
            plan.scratch.shape,
        )
        quant = quant_args(kv_scales, plan, k_cache)
        scratch, bounds = plan.scratch, plan.bounds
        out = qkv.new_empty(batch, num_q_heads, d)
        self._decode_attention(
            qkv.data_ptr(),
            num_q_heads,
            num_kv_heads,
            d,
            cos.data_ptr(),
            sin.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            strides[0],
            strides[2],
            block_size,
            block_tables.data_ptr(),
            width,
            context_lens.data_ptr(),
            scale,
            out.data_ptr(),
            scratch.data_ptr(),
            scratch.shape[1],
            bounds.data_ptr(),
            bounds.shape[0] - 1,
            None if quant is None else ctypes.addressof(quant),
            tree_arg(plan),
            KV_DTYPE_CODES.get(k_cache.dtype, 0),
        )
        return out

    def _step_args(
        self, x: torch.Tensor, w: DecodeLayerWeights | QuantDecodeLayerWeights, kv: DecodeLayerKV
    ) -> tuple[tuple, tuple, StepMemo]:
        """``layer_attention_args`` and the work buffers of a decode step's layers: checked and
        built by the step's first layer, reused by the others, which bring the same step (plan,
        rotation rows, tables), shapes and threads and differ only in their K/V views (a step
        calls ~30 layers from Python: this is most of Python's share of it). An fp8 or int8
        cache's layers build their scale arguments each."""
        memo, k, v = self._memo, kv.k_cache, kv.v_cache
        rows = (kv.cos, kv.sin, kv.block_tables, kv.context_lens)
        key = (x.shape, k.dtype, k.shape, k.stride(), v.dtype, v.shape, v.stride())
        key += (w.hidden, w.num_q_heads, w.num_kv_heads, w.head_dim, w.scale)
        key += (torch.get_num_threads(),)
        if (
            memo is not None
            and kv.scales is None
            and memo.plan is kv.plan
            and all(a is b for a, b in zip(memo.rows, rows, strict=True))
            and memo.key == key
        ):
            args = memo.args
            return (*args[:5], k.data_ptr(), v.data_ptr(), *args[7:]), memo.keep, memo
        args, keep = layer_attention_args(x, w, kv, self._parts_floats)
        self._memo = memo = StepMemo(kv.plan, rows, key, args, keep)
        return args, keep, memo

    def decode_layer(
        self, x: torch.Tensor, w: DecodeLayerWeights, kv: DecodeLayerKV
    ) -> torch.Tensor:
        """One decoder layer's decode step (``kv_decode_layer`` in ``cpu_layer.c``): the
        residual stream x (batch, hidden) after attention and MLP, a new tensor. Rotates, stores
        and attends as ``decode_attention`` does, with ``kv``'s cache, tables and plan; runs on
        ``torch.get_num_threads()`` threads in one parallel region."""
        attention, keep, memo = self._step_args(x, w, kv)
        batch, hidden = x.shape
        n_qkv, n_attn, inter = w.wqkv.out_features, w.wo.panels.shape[1], w.inter
        out = x.clone()
        # one allocation, cut into contiguous (batch, n) buffers
        sizes = (hidden, n_qkv, n_attn, 2 * inter, inter)
        work = memo.work(x, sizes)
        self._decode_layer(
            out.data_ptr(),
            batch,
            hidden,
            w.attn_norm.data_ptr(),
            w.ffn_norm.data_ptr(),
            w.eps,
            *weight_bias(w.wqkv, w.bqkv),
            *weight_bias(w.wo, w.bo),
            *weight_bias(w.w_gate_up, w.b_gate_up),
            *weight_bias(w.w_down, w.b_down),
            inter,
            *(t.data_ptr() for t in work),  # xn, qkv, attn, gu, act
            *attention,
        )
        del keep  # alive until the call returned
        return out

    def decode_layer_quant(
        self, x: torch.Tensor, w: QuantDecodeLayerWeights, kv: DecodeLayerKV
    ) -> torch.Tensor:
        """``decode_layer`` over weights kept in their block formats (``kv_decode_layer_quant``
        in ``cpu_layer.c``): each linear layer's input quantized per block of 32 to int8 as
        ``quant_linear`` does, so the result is bit for bit the per-module path's (``QuantLinear``
        on ``quant_linear``, the separate norm, SiLU and attention kernels). A new tensor."""
        attention, keep, memo = self._step_args(x, w, kv)
        batch, hidden = x.shape
        n_qkv, n_attn, inter = w.wqkv.rows, w.wo.cols, w.inter
        out = x.clone()
        sizes = (hidden, n_qkv, n_attn, 2 * inter, inter, quant_scale_stride(w.max_in_features))
        work = memo.work(x, sizes)
        xq = memo.work(x, (w.max_in_features,), torch.int8)[0]
        self._decode_layer_quant(
            out.data_ptr(),
            batch,
            hidden,
            w.attn_norm.data_ptr(),
            w.ffn_norm.data_ptr(),
            w.eps,
            w.formats.data_ptr(),
            *quant_weight_bias(w.wqkv, w.bqkv),
            *quant_weight_bias(w.wo, w.bo),
            *quant_weight_bias(w.w_gate_up, w.b_gate_up),
            *quant_weight_bias(w.w_down, w.b_down),
            inter,
            *(t.data_ptr() for t in work[:5]),  # xn, qkv, attn, gu, act
            xq.data_ptr(),
            work[5].data_ptr(),  # xs
            *attention,
        )
        del keep
        return out
