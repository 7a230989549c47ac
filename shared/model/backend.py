"""The kernels a model computes with, chosen once per engine (``select_backend``).

A backend ``install``s itself on a model when the engine is built and plans each step before
the model's forward pass (``plan_step``); the model's modules (``llama.py``) are the math and
choose nothing. ``TorchBackend``: the modules as they are (on CUDA, ``use_triton``: the
metadata sends ``paged_attention`` to Triton's kernels, and the linear layers over weights kept
as stored multiply with ``kernels/quant_matmul.py``, installed as ``triton_modules.py``'s
subclasses). ``CpuBackend``: the C kernels of ``kernels/cpu_ops.py`` installed as subclasses of
the modules (``cpu_modules.py``), and for a decode step the ``DecodePlan`` that the C decode
attention and the fused decoder layer share.
One backend per engine: it keeps what it needs of the model it was installed on.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import torch
from kvmesh.kernels.cpu_plans import (
    DecodeLayerWeights,
    QuantDecodeLayerWeights,
    decode_plan,
    pack_linear_weight,
    packed_shape,
)
from kvmesh.shared.config.huge_pages import HugePageArena, release_freed_heap
from kvmesh.shared.kv.kv_cache import KVCacheSpec, KVPool
from kvmesh.shared.model.attention import AttentionMetadata
from kvmesh.shared.model.cpu_modules import (
    CpuDecodeAttention,
    CpuEmbedding,
    CpuQuantEmbedding,
    CpuQuantLinear,
    CpuRMSNorm,
    CpuSiluAndMul,
    FusedDecodeBlock,
    PackedLinear,
    remove_cpu_kernels,
)
from kvmesh.shared.model.llama import (
    Embedding,
    Linear,
    RMSNorm,
    RotaryPagedAttention,
    SiluAndMul,
    Transformer,
    TransformerBlock,
)
from kvmesh.shared.model.quant import QuantWeight, StackedWeight
from kvmesh.shared.model.quant_layers import QuantEmbedding, QuantLinear
from kvmesh.shared.model.quant_paired import pair_blocks, unpair_blocks
from kvmesh.shared.model.triton_modules import install_triton_kernels, remove_triton_kernels
from torch import nn

if TYPE_CHECKING:
    from kvmesh.kernels.cpu_bindings import CpuOps
    from kvmesh.kernels.cpu_plans import DecodePlan

# KV caches the C decode attention reads: float32, float16, bfloat16, fp8 e4m3 and int8 with
# scales (kv_quant.py, kv_int8.py)
CPU_KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int8)


class TorchBackend:
    """The model's own torch modules; Triton's paged attention and quantized linear layers
    where ``use_triton``."""

    cpu_ops: CpuOps | None = None

    def __init__(self, use_triton: bool = False) -> None:
        self.use_triton = use_triton

    def install(self, model: nn.Module) -> None:
        """Undo an earlier engine's kernels; where ``use_triton``, install the Triton ones
        (``triton_modules.py``: the linear layers over weights kept as stored)."""
        remove_cpu_kernels(model)  # a model an earlier engine computed on with its kernels
        remove_triton_kernels(model)
        if self.use_triton:
            install_triton_kernels(model)

    def decodes_in_c(self, spec: KVCacheSpec) -> bool:
        """Whether decode steps over a cache of ``spec`` run the C decode kernels (which alone
        read draft-tree rows, ``TreeRows``)."""
        return False

    def plan_step(self, meta: AttentionMetadata, kv_pool: KVPool) -> DecodePlan | None:
        return None


class CpuBackend(TorchBackend):
    """The C kernels of ``ops`` on a float32 CPU model. ``fuse_layers=False`` keeps every layer
    on its modules' separate kernels (the fused layer's reference)."""

    def __init__(self, ops: CpuOps, fuse_layers: bool = True) -> None:
        super().__init__(use_triton=False)
        self.cpu_ops = ops
        self.fuse_layers = fuse_layers
        self._float32 = False
        self._group = 1
        self._head_dim = 0

    def install(self, model: Transformer) -> None:
        """Install the kernels on every module they compute for (``cpu_modules.py``). Float32
        linear layers get a packed copy of their weight (as much memory again as the layers'
        weights); the Q4 and Q8_0 weights kept as stored (the tied LM head's too) are rewritten
        in place in the kernels' paired layout where ``ops`` reads it (``quant.pair_blocks``:
        the same bytes, the same values, 16 rows interleaved). Everything a decode step streams
        (the packed layers, the weights kept as stored, a float32 tied head) moves into one
        huge-page arena (``shared/config/huge_pages.py``), the old copies freed."""
        remove_cpu_kernels(model)
        remove_triton_kernels(model)
        ops = self.cpu_ops
        arena = HugePageArena(_streamed_bytes(model))
        moved: dict[int, QuantWeight | StackedWeight] = {}
        for module in model.modules():
            kind = type(module)
            if kind in (RMSNorm, Linear, Embedding) and not _is_cpu_float32(module.weight):
                continue
            if kind in (QuantLinear, QuantEmbedding) and not module.qweight.data.is_cpu:
                continue
            if kind is Linear:
                packed = pack_linear_weight(module.weight.detach(), arena)
                PackedLinear.install(module, ops, packed=packed)
            elif kind in _KERNELS:
                if kind is Embedding:  # the tied head's rows stream by in every decode step
                    module.weight.data = arena.copy(module.weight.data)
                elif kind in (QuantLinear, QuantEmbedding):  # shared weights move once
                    w = module.qweight
                    if id(w) not in moved:
                        moved[id(w)] = _quant_in_arena(w, arena)
                    module.qweight = moved[id(w)]
                _KERNELS[kind].install(module, ops)
        for quant in model.modules():  # in the layout ops reads (paired: faster)
            if isinstance(quant, (CpuQuantLinear, CpuQuantEmbedding)):
                w = quant.qweight  # rewritten in place: no second copy stays resident
                quant.qweight = (
                    pair_blocks(w, in_place=True) if ops.quant_pairs else unpair_blocks(w)
                )
                if isinstance(quant, CpuQuantEmbedding):  # its head (next) shares the bytes
                    quant.head.qweight = quant.qweight
        release_freed_heap()  # the weights' old copies, freed above
        for block in model.modules():
            if not isinstance(block, TransformerBlock):
                continue
            weights = _decode_layer_weights(block)
            if weights is not None and self.fuse_layers:
                decode = (
                    ops.decode_layer_quant
                    if isinstance(weights, QuantDecodeLayerWeights)
                    else ops.decode_layer
                )
                FusedDecodeBlock.install(block, ops, weights=weights, decode=decode)
        attention = model.layers[0].attention
        self._float32 = model.config.dtype == "float32"
        self._group = attention.num_heads // attention.num_kv_heads
        self._head_dim = attention.head_dim

    def decodes_in_c(self, spec: KVCacheSpec) -> bool:
        return self._float32 and spec.dtype in CPU_KV_DTYPES

    def plan_step(self, meta: AttentionMetadata, kv_pool: KVPool) -> DecodePlan | None:
        """A decode step's ``DecodePlan`` (its batch split over the threads, shared by every
        layer), made before the pass; None for any other step (the torch paths)."""
        spec = kv_pool.spec
        if not meta.is_decode_only or meta.use_triton or not self.decodes_in_c(spec):
            return None
        return decode_plan(
            meta.context_lens,
            meta.block_tables.shape[1],
            spec.block_size,
            self._group,
            quant_head_dim=self._head_dim if spec.is_quantized else 0,
            tree_rows=meta.tree_rows,
            head_dim=self._head_dim,
        )


def _streamed_bytes(model: Transformer) -> int:
    """The arena ``CpuBackend.install`` moves a model's streamed weights into (see there)."""
    total, seen = 0, set()
    for module in model.modules():
        kind = type(module)
        if kind in (Linear, Embedding) and _is_cpu_float32(module.weight):
            w = module.weight
            numel = math.prod(packed_shape(w)) if kind is Linear else w.numel()
            total += HugePageArena.padded(numel * 4)
        elif (
            kind in (QuantLinear, QuantEmbedding)
            and module.qweight.data.is_cpu
            and id(module.qweight) not in seen  # shared weights move once
        ):
            seen.add(id(module.qweight))
            total += sum(HugePageArena.padded(p.data.numel()) for p in _parts(module.qweight))
    return total


def _parts(weight: QuantWeight | StackedWeight) -> tuple[QuantWeight, ...]:
    return weight.parts if isinstance(weight, StackedWeight) else (weight,)


def _quant_in_arena(
    weight: QuantWeight | StackedWeight, arena: HugePageArena
) -> QuantWeight | StackedWeight:
    """``weight`` with its bytes copied into ``arena`` (a stacked weight: each part's)."""
    if isinstance(weight, StackedWeight):
        return StackedWeight(tuple(_quant_in_arena(p, arena) for p in weight.parts))
    return dataclasses.replace(weight, data=arena.copy(weight.data))


_KERNELS = {
    Embedding: CpuEmbedding,  # its tied LM head (project)
    RMSNorm: CpuRMSNorm,
    SiluAndMul: CpuSiluAndMul,
    RotaryPagedAttention: CpuDecodeAttention,
    QuantLinear: CpuQuantLinear,
    QuantEmbedding: CpuQuantEmbedding,
}


def select_backend(device: torch.device, cpu_kernels: bool = True) -> TorchBackend:
    """The backend of an engine on ``device``: the C kernels on the CPU where ``cpu_kernels``
    and they build (``load_cpu_ops``; without a compiler the torch path), Triton on CUDA."""
    if device.type == "cpu" and cpu_kernels:
        from kvmesh.kernels.cpu_ops import load_cpu_ops

        ops = load_cpu_ops()
        if ops is not None:
            return CpuBackend(ops)
    return TorchBackend(use_triton=device.type == "cuda")


def _is_cpu_float32(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.float32 and weight.device.type == "cpu"


def _decode_layer_weights(
    block: TransformerBlock,
) -> DecodeLayerWeights | QuantDecodeLayerWeights | None:
    """The fused decode layer's view of a block whose norms are float32 on the CPU and whose
    linear layers are all packed (float32) or all kept as stored on the CPU; None where any part
    is not (the block then runs module by module)."""
    attn, ffn = block.attention, block.feed_forward
    linears = (attn.wqkv, attn.wo, ffn.w_gate_up, ffn.w_down)
    norms = (block.attention_norm, block.ffn_norm)
    if block.attention_norm.eps != block.ffn_norm.eps:
        return None
    if any(not _is_cpu_float32(n.weight) for n in norms):
        return None
    if all(isinstance(linear, CpuQuantLinear) for linear in linears):
        layout: type[DecodeLayerWeights | QuantDecodeLayerWeights] = QuantDecodeLayerWeights
        weights = [linear.qweight for linear in linears]
    elif all(isinstance(linear, PackedLinear) for linear in linears):
        layout, weights = DecodeLayerWeights, [linear.packed for linear in linears]
    else:
        return None

    def bias(linear: nn.Module) -> torch.Tensor | None:
        return None if linear.bias is None else linear.bias.detach().float().contiguous()

    return layout(
        hidden=block.attention_norm.weight.shape[0],
        inter=ffn.intermediate_size,
        num_q_heads=attn.num_heads,
        num_kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim,
        eps=block.attention_norm.eps,
        scale=attn.attend.scale,
        attn_norm=block.attention_norm.weight.detach().contiguous(),
        ffn_norm=block.ffn_norm.weight.detach().contiguous(),
        wqkv=weights[0],
        bqkv=bias(attn.wqkv),
        wo=weights[1],
        bo=bias(attn.wo),
        w_gate_up=weights[2],
        b_gate_up=bias(ffn.w_gate_up),
        w_down=weights[3],
        b_down=bias(ffn.w_down),
    )
