"""Tensor parallelism, Megatron-style, applied to a loaded ``Transformer`` from outside (docs/tp.md).

``shard_model(model, group)`` keeps this rank's share of every weight and wraps the layers whose
outputs must be summed or gathered over the ranks; the modules of ``llama.py`` then compute with
the heads and columns they hold, unchanged:

- ``wqkv`` and ``w_gate_up`` column-parallel (the rank's query and KV heads, its intermediate
  features); ``wo`` and ``w_down`` row-parallel (``RowParallel``: one all-reduce each);
- the token embedding and the LM head split by vocabulary (``VocabParallelEmbedding``: one
  all-reduce; ``VocabParallelHead``: one all-gather of the logits);
- norms and rotary tables replicated.

Heads go by whole GQA groups, ``KVHeadShards``' split of the KV heads (uneven when the ranks do
not divide them; replicated when there are fewer than ranks). Quantized weights
kept as stored shard by whole rows, and by whole 32-value blocks along a row; a split that would
cut a block raises ``TPShardError``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from kvmesh.shared.kv.head_shards import KVHeadShards
from kvmesh.shared.model.config import ModelConfig
from kvmesh.shared.model.llama import Embedding, Linear, Transformer
from kvmesh.shared.model.quant import QuantWeight, StackedWeight, cols_multiple, row_bytes
from kvmesh.shared.model.quant_layers import QuantEmbedding, QuantLinear
from torch import nn


class TPShardError(ValueError):
    """The model cannot be split over this many ranks (the message says what to change)."""


@dataclass(frozen=True, slots=True)
class TPLayout:
    """What rank ``rank`` of ``tp_size`` holds of a model with ``num_heads`` query heads and
    ``num_kv_heads`` KV heads: whole GQA groups (a KV head with its query heads), as evenly as
    the groups allow (``KVHeadShards``: 3 groups at TP2 are 2 + 1), or, with fewer KV heads
    than ranks, a replica of one KV head and an equal share of its group's query heads."""

    tp_size: int
    rank: int
    num_heads: int
    num_kv_heads: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.tp_size:
            raise TPShardError(f"rank must be in [0, {self.tp_size}), got {self.rank}")
        try:
            kv = KVHeadShards(self.num_kv_heads, self.tp_size)
        except ValueError as exc:
            raise TPShardError(str(exc)) from exc
        if self.num_heads % self.num_kv_heads:
            raise TPShardError(
                f"{self.num_heads} attention heads do not make groups of {self.num_kv_heads} KV "
                f"heads"
            )
        if (self.num_heads // self.num_kv_heads) % kv.replicas:
            raise TPShardError(
                f"{self.num_heads} attention heads do not split over TP {self.tp_size}: each of "
                f"the {self.num_kv_heads} KV heads is replicated on {kv.replicas} ranks, which "
                f"share its {self.num_heads // self.num_kv_heads} query heads; pick a TP degree "
                f"that divides the head count, or one of at most {self.num_kv_heads}"
            )

    @property
    def kv(self) -> KVHeadShards:
        return KVHeadShards(self.num_kv_heads, self.tp_size)

    @property
    def q_heads(self) -> tuple[int, int]:
        """The query heads ``[start, end)`` of the rank: those of its KV heads' groups, or its
        share of its replicated KV head's group (an equal share a replica)."""
        group = self.num_heads // self.num_kv_heads
        k0, k1 = self.kv_heads
        replicas = self.kv.replicas
        if replicas == 1:
            return k0 * group, k1 * group
        share = group // replicas
        start = k0 * group + (self.rank % replicas) * share
        return start, start + share

    @property
    def kv_heads(self) -> tuple[int, int]:
        return self.kv.heads(self.rank)


def kv_heads_held(model: nn.Module) -> int:
    """KV heads this process's share of ``model`` computes and stores: all of the model's unless
    ``shard_model`` split it."""
    layout: TPLayout | None = getattr(model, "tp_layout", None)
    if layout is None:
        return model.config.num_key_value_heads
    k0, k1 = layout.kv_heads
    return k1 - k0


def shard_model(model: Transformer, group: dist.ProcessGroup | None = None) -> TPLayout:
    """Keep this rank's share of ``model`` (in place) for the ranks of ``group`` (default: the
    whole world of ``torch.distributed``). Call before installing a backend (``backend.py``; the engine does that)."""
    config: ModelConfig = model.config
    if getattr(model, "tp_layout", None) is not None:
        raise TPShardError("this model is sharded already; shard a freshly loaded one")
    layout = TPLayout(
        dist.get_world_size(group),
        dist.get_rank(group),
        config.num_attention_heads,
        config.num_key_value_heads,
    )
    tp, D = layout.tp_size, config.head_dim
    if config.intermediate_size % tp:
        raise TPShardError(
            f"intermediate_size {config.intermediate_size} does not split over TP {tp}"
        )
    q0, q1 = layout.q_heads
    k0, k1 = layout.kv_heads
    inter = config.intermediate_size // tp
    i0 = layout.rank * inter
    qkv_rows = torch.cat(
        [
            torch.arange(q0 * D, q1 * D),
            config.q_size + torch.arange(k0 * D, k1 * D),
            config.q_size + config.kv_size + torch.arange(k0 * D, k1 * D),
        ]
    )
    gate_up_rows = torch.cat(
        [torch.arange(i0, i0 + inter), config.intermediate_size + torch.arange(i0, i0 + inter)]
    )
    for block in model.layers:
        attn, ffn = block.attention, block.feed_forward
        attn.wqkv = _rows(attn.wqkv, qkv_rows)
        attn.wo = RowParallel(*_columns(attn.wo, q0 * D, q1 * D, "wo"), group)
        attn.num_heads, attn.num_kv_heads, attn.q_size = q1 - q0, k1 - k0, (q1 - q0) * D
        ffn.w_gate_up = _rows(ffn.w_gate_up, gate_up_rows)
        ffn.w_down = RowParallel(*_columns(ffn.w_down, i0, i0 + inter, "w_down"), group)
        ffn.intermediate_size = inter
    vocab = _vocab_slice(config.vocab_size, layout)
    head = model.tok_embeddings if model.output is None else model.output
    model.output = VocabParallelHead(head, vocab, config.vocab_size, group)
    model.tok_embeddings = VocabParallelEmbedding(model.tok_embeddings, vocab, group)
    model.tp_layout = layout
    return layout


class RowParallel(nn.Module):
    """A row-parallel linear layer: this rank's input columns (``local``, no bias), the partial
    products summed over the ranks, then the bias once."""

    def __init__(
        self, local: nn.Module, bias: torch.Tensor | None, group: dist.ProcessGroup | None
    ) -> None:
        super().__init__()
        self.local = local
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local(x)
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y.add_(self.bias)


class VocabParallelEmbedding(nn.Module):
    """Token embeddings of ids ``[start, end)`` here; other ids look up zeros; summed over ranks."""

    def __init__(
        self, full: nn.Module, vocab: tuple[int, int], group: dist.ProcessGroup | None
    ) -> None:
        super().__init__()
        self.start, self.end = vocab
        self.local = _embedding_rows(full, torch.arange(*vocab))
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        is_here = (input_ids >= self.start) & (input_ids < self.end)
        local_ids = (input_ids - self.start).clamp_(0, self.end - self.start - 1)
        x = self.local(local_ids).masked_fill_(~is_here.unsqueeze(-1), 0)  # (T, hidden)
        dist.all_reduce(x, group=self.group)
        return x


class VocabParallelHead(nn.Module):
    """The LM head's rows ``[start, end)`` here; the ranks' logits gathered into the whole
    vocabulary (every rank's slice padded to the first rank's width for the gather)."""

    def __init__(
        self,
        full: nn.Module,
        vocab: tuple[int, int],
        vocab_size: int,
        group: dist.ProcessGroup | None,
    ) -> None:
        super().__init__()
        rows = torch.arange(*vocab)
        self.width = -(-vocab_size // dist.get_world_size(group))
        self.vocab_size = vocab_size
        self.group = group
        self.local: nn.Module | None = None
        self.weight: torch.Tensor | None = None
        if isinstance(full, QuantEmbedding):  # a tied head, as stored: project as it does
            self.local = _embedding_rows(full, rows)
        elif isinstance(full, QuantLinear):
            self.local = _rows(full, rows)
        else:  # float rows of the embedding or of the output layer: F.linear, as unsharded
            self.weight = nn.Parameter(full.weight.detach()[rows].contiguous(), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if isinstance(self.local, QuantEmbedding):
            logits = self.local.project(hidden)
        elif self.local is not None:
            logits = self.local(hidden)
        else:
            logits = F.linear(hidden, self.weight)
        logits = F.pad(logits.float(), (0, self.width - logits.shape[-1]))  # (N, width)
        parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, logits, group=self.group)
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]


def _vocab_slice(vocab_size: int, layout: TPLayout) -> tuple[int, int]:
    width = -(-vocab_size // layout.tp_size)
    start = layout.rank * width
    end = min(vocab_size, start + width)
    if start >= end:
        raise TPShardError(
            f"a vocabulary of {vocab_size} leaves rank {layout.rank} of TP {layout.tp_size} no "
            f"rows; use a smaller TP degree"
        )
    return start, end


def _rows(layer: nn.Module, rows: torch.Tensor) -> nn.Module:
    """A column-parallel shard: the output features ``rows`` of ``layer``."""
    bias = None
    if layer.bias is not None:
        bias = nn.Parameter(layer.bias.detach()[rows].clone(), requires_grad=False)
    if isinstance(layer, QuantLinear):
        return QuantLinear(layer.qweight.select_rows(rows), bias)
    assert isinstance(layer, Linear), type(layer)
    return _linear(layer.weight.detach()[rows], bias)


def _columns(
    layer: nn.Module, start: int, end: int, name: str
) -> tuple[nn.Module, torch.Tensor | None]:
    """A row-parallel shard: the input features ``[start, end)`` of ``layer``, without its bias
    (added once, after the sum), and the bias."""
    bias = None if layer.bias is None else layer.bias.detach()
    if isinstance(layer, QuantLinear):
        w = layer.qweight
        parts = w.parts if isinstance(w, StackedWeight) else (w,)
        block = max(cols_multiple(p.format) for p in parts)
        if start % block or end % block:
            raise TPShardError(
                f"{name} is stored as {w.format} in blocks of {block} values along its rows; TP "
                f"would split its rows at column {start if start % block else end}, inside a "
                f"block. Load the model with --dequantize, or use a TP degree that splits "
                f"{name}'s {w.cols} inputs into multiples of {block}"
            )
        shards = [
            QuantWeight(
                p.format,
                p.data[:, row_bytes(p.format, start) : row_bytes(p.format, end)].contiguous(),
                p.rows,
                end - start,
            )
            for p in parts
        ]
        shard = shards[0] if len(shards) == 1 else StackedWeight(tuple(shards))
        return QuantLinear(shard, None), bias
    assert isinstance(layer, Linear), type(layer)
    return _linear(layer.weight.detach()[:, start:end], None), bias


def _linear(weight: torch.Tensor, bias: nn.Parameter | None) -> Linear:
    """A ``Linear`` over ``weight`` (out, in), stored column-major as ``Linear`` keeps it."""
    with torch.device("meta"):
        layer = Linear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight = nn.Parameter(weight.t().contiguous().t(), requires_grad=False)
    layer.bias = bias
    return layer


def _embedding_rows(full: nn.Module, rows: torch.Tensor) -> nn.Module:
    if isinstance(full, QuantEmbedding):
        return QuantEmbedding(full.qweight.select_rows(rows), full.dtype)
    weight = full.weight.detach()[rows].contiguous()
    with torch.device("meta"):
        local = Embedding(weight.shape[0], weight.shape[1])
    local.weight = nn.Parameter(weight, requires_grad=False)
    return local
