"""The argument layouts of the C kernels (``cpu_ops.py``): packed linear weights
(``pack_linear_weight``), a decoder layer's weights and KV views for ``CpuOps.decode_layer``, the
decode step's ``DecodePlan`` (its batch split into runs of about equal context by
``split_by_work``, one per torch thread, and each thread's scratch), and the ctypes structs the
kernels take for an fp8 or int8 cache (``KVQuant``) and draft-tree rows (``KVTree``).
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from kvmesh.shared.config.huge_pages import HugePageArena
from kvmesh.shared.model.quant import QuantWeight

if TYPE_CHECKING:
    from kvmesh.shared.model.attention import TreeRows

# The most context positions of a draft-tree row read past its sequence's last token: a node's
# ancestors and itself (the engine's trees have at most 63 nodes).
MAX_TREE_TAIL = 64
# Output columns per panel of a packed weight (NR in cpu_linear.c).
PANEL_WIDTH = 16


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A linear layer's (out, in) weight as panels of ``PANEL_WIDTH`` output columns, each one
    contiguous (in, PANEL_WIDTH) strip: ``panels`` is (num_panels, in, PANEL_WIDTH) float32, the
    last panel zero-padded past ``out_features``."""

    panels: torch.Tensor
    out_features: int


def packed_shape(weight: torch.Tensor) -> tuple[int, int, int]:
    """The shape of ``pack_linear_weight``'s panels for ``weight``: (panels, in, PANEL_WIDTH)."""
    n, k = weight.shape
    return -(-n // PANEL_WIDTH), k, PANEL_WIDTH


def pack_linear_weight(weight: torch.Tensor, arena: HugePageArena | None = None) -> PackedWeight:
    """The panels of a float32 (out, in) weight (any strides), for ``CpuOps.linear``; taken from
    ``arena`` where one is given (huge pages: the backend packs a model's layers into one)."""
    assert weight.dtype == torch.float32 and weight.dim() == 2, (weight.dtype, weight.shape)
    n, k = weight.shape
    num_panels = packed_shape(weight)[0]
    padded = weight.new_zeros(num_panels * PANEL_WIDTH, k)
    padded[:n] = weight
    panels = padded.view(num_panels, PANEL_WIDTH, k).transpose(1, 2)
    return PackedWeight(panels.contiguous() if arena is None else arena.copy(panels), n)


class KVQuant(ctypes.Structure):
    """``kv_quant`` of cpu_ops.c: what the kernels need to store and read an fp8 or int8 cache
    (``lut`` NULL: int8)."""

    _fields_ = [
        ("lut", ctypes.c_void_p),
        ("k_scales", ctypes.c_void_p),
        ("v_scales", ctypes.c_void_p),
        ("scale_block_stride", ctypes.c_int64),
        ("scale_head_stride", ctypes.c_int64),
        ("scale_slot_stride", ctypes.c_int64),
        ("scratch_offset", ctypes.c_int64),
    ]


class KVTree(ctypes.Structure):
    """``kv_tree`` of cpu_ops.c: a decode batch's draft-tree rows (``TreeRows``)."""

    _fields_ = [
        ("starts", ctypes.c_void_p),
        ("offsets", ctypes.c_void_p),
        ("positions", ctypes.c_void_p),
        ("scratch_offset", ctypes.c_int64),
    ]


@dataclass(frozen=True, slots=True)
class DecodeLayerWeights:
    """What ``CpuOps.decode_layer`` needs of one decoder layer: float32 norms, packed weights
    (gate and up as one (2 * inter, hidden) weight, gate first) and contiguous biases or None."""

    hidden: int
    inter: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scale: float
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    wqkv: PackedWeight
    bqkv: torch.Tensor | None
    wo: PackedWeight
    bo: torch.Tensor | None
    w_gate_up: PackedWeight
    b_gate_up: torch.Tensor | None
    w_down: PackedWeight
    b_down: torch.Tensor | None

    def __post_init__(self) -> None:
        for name, weight, bias, n, k in checked_linears(self):
            assert weight.out_features == n and weight.panels.shape[1] == k, (name, n, k)
            check_f32_contiguous(**{name: weight.panels})
            if bias is not None:
                check_f32_contiguous(**{f"{name} bias": bias})
                assert bias.shape == (n,), (name, bias.shape)


@dataclass(frozen=True, slots=True)
class QuantDecodeLayerWeights:
    """What ``CpuOps.decode_layer_quant`` needs of one decoder layer: as ``DecodeLayerWeights``,
    with the four linear weights kept in their block formats (``QuantWeight`` on the CPU, each
    in any of the formats; gate and up one weight, gate first). ``formats``: their format
    codes, wqkv, wo, w_gate_up, w_down, as the kernel takes them."""

    hidden: int
    inter: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scale: float
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    wqkv: QuantWeight
    bqkv: torch.Tensor | None
    wo: QuantWeight
    bo: torch.Tensor | None
    w_gate_up: QuantWeight
    b_gate_up: torch.Tensor | None
    w_down: QuantWeight
    b_down: torch.Tensor | None
    formats: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        linears = checked_linears(self)
        for name, weight, bias, n, k in linears:
            assert weight.shape == (n, k), (name, weight.shape, (n, k))
            assert weight.data.is_cpu, f"{name}: the weight must be in CPU memory"
            if bias is not None:
                check_f32_contiguous(**{f"{name} bias": bias})
                assert bias.shape == (n,), (name, bias.shape)
        codes = [weight.code for _, weight, _, _, _ in linears]
        object.__setattr__(self, "formats", torch.tensor(codes, dtype=torch.int64))

    @property
    def max_in_features(self) -> int:
        """The widest linear input: the room one quantized activation row needs."""
        return max(self.hidden, self.num_q_heads * self.head_dim, self.inter)


def checked_linears(w: DecodeLayerWeights | QuantDecodeLayerWeights) -> tuple[tuple, ...]:
    """A layer's shape checks both weight forms share (heads, norms), and its four linears as
    (name, weight, bias, out_features, in_features) for the checks of the form's own."""
    h, n_q, n_kv, d, i = w.hidden, w.num_q_heads, w.num_kv_heads, w.head_dim, w.inter
    assert n_q % n_kv == 0, (n_q, n_kv)
    check_f32_contiguous(attn_norm=w.attn_norm, ffn_norm=w.ffn_norm)
    assert w.attn_norm.shape == w.ffn_norm.shape == (h,)
    return (
        ("wqkv", w.wqkv, w.bqkv, (n_q + 2 * n_kv) * d, h),
        ("wo", w.wo, w.bo, h, n_q * d),
        ("w_gate_up", w.w_gate_up, w.b_gate_up, 2 * i, h),
        ("w_down", w.w_down, w.b_down, h, i),
    )


@dataclass(frozen=True, slots=True)
class DecodeLayerKV:
    """One layer's view of a decode step for ``CpuOps.decode_layer``: its K and V cache
    (num_blocks, block_size, H_kv, D), the rotation rows cos, sin (batch, 1, D) of each token's
    position, block tables (batch, width) and context lengths (batch,) int64, and the step's
    ``DecodePlan``."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    plan: DecodePlan
    scales: tuple[torch.Tensor, torch.Tensor] | None = None  # an fp8 or int8 cache's K, V scales


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """How one decode step's attention splits its batch over threads, shared by every layer:
    ``bounds`` (parts + 1,) int64 run starts then the batch size; ``scratch`` (threads, stride)
    float32 score rows of each thread."""

    batch: int
    bounds: torch.Tensor
    scratch: torch.Tensor
    quant_offset: int | None = None  # where a row's room to dequantize fp8/int8 KV starts (floats)
    tree: KVTree | None = None  # the step's draft-tree rows (``tree_rows``); None: plain rows
    tree_rows: TreeRows | None = None  # keeps the tensors ``tree`` points into alive


def decode_plan(
    context_lens: torch.Tensor,
    table_width: int,
    block_size: int,
    group: int,
    quant_head_dim: int = 0,
    tree_rows: TreeRows | None = None,
    head_dim: int = 0,
) -> DecodePlan:
    """The ``DecodePlan`` of a step: runs of sequences with about equal context, one per torch
    thread (``split_by_work``), and scratch for the longest context a block table can hold, a
    row for each torch thread (``decode_layer`` splits the work finer than by sequence).
    ``quant_head_dim``: for an fp8 or int8 cache of that head size, each row also has room for one
    (sequence, KV head)'s context dequantized (K and V) and its tile table. ``tree_rows``: the
    batch's draft-tree rows (``TreeRows``), with room in each row for a tree row's gathered
    context tail (K and V, ``head_dim`` each)."""
    lens = context_lens.tolist()
    num_threads = torch.get_num_threads()
    parts = split_by_work(lens, min(num_threads, len(lens)))
    bounds = torch.tensor([start for start, _ in parts] + [len(lens)], dtype=torch.int64)
    scores = table_width * block_size * group
    quant_offset = None
    stride = scores
    if quant_head_dim:
        quant_offset = scores + scores % 2  # the tile table after K and V is int64: even offset
        stride = quant_offset + 2 * table_width * block_size * quant_head_dim + 2 * table_width
    tree = None
    if tree_rows is not None:
        assert head_dim > 0 and tree_rows.starts.shape == (len(lens),), tree_rows.starts.shape
        assert int(tree_rows.max_tail()) <= MAX_TREE_TAIL, "a tree row past the tail's room"
        tree = KVTree(
            tree_rows.starts.data_ptr(),
            tree_rows.offsets.data_ptr(),
            tree_rows.positions.data_ptr(),
            stride + stride % 2,
        )
        stride += stride % 2 + 2 * (block_size + MAX_TREE_TAIL) * head_dim
    scratch = torch.empty(max(num_threads, len(parts)), stride + stride % 2)
    return DecodePlan(len(lens), bounds, scratch, quant_offset, tree, tree_rows)


def split_by_work(context_lens: list[int], parts: int) -> list[tuple[int, int]]:
    """``[start, stop)`` runs of consecutive sequences, at most ``parts`` of them, each with about
    the same total context (the attention work); never an empty run."""
    batch = len(context_lens)
    parts = max(1, min(parts, batch))
    prefix = list(itertools.accumulate(context_lens))  # prefix[j - 1]: work of sequences < j
    runs, start = [], 0
    for k in range(1, parts):
        target = prefix[-1] * k / parts
        lo, hi = start + 1, batch - (parts - k)  # leave a sequence for each later run
        j = min(max(bisect.bisect_left(prefix, target) + 1, lo), hi)
        if j > lo and abs(prefix[j - 2] - target) <= abs(prefix[j - 1] - target):
            j -= 1  # ending one sequence earlier is nearer the target
        runs.append((start, j))
        start = j
    runs.append((start, batch))
    return runs


def check_f32_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        assert t.dtype == torch.float32, f"{name} must be float32, got {t.dtype}"
        assert t.is_cpu and t.is_contiguous(), f"{name} must be contiguous on CPU"


def quant_scale_stride(k: int) -> int:
    """Floats per row of a quantized activation's scales (``qk_scale_stride`` of cpu_quant.c):
    32 per pair of blocks of 32 values."""
    return (k // 32 + 1) // 2 * 32
