"""The float32 CPU kernels of ``cpu_ops.c`` (elementwise work and decode attention),
``cpu_linear.c`` (linear layers over prepacked weights) and ``cpu_layer.c`` (a whole decoder
layer's decode step in one call and one OpenMP region), built with the system C compiler into one
library and called through ctypes.

``load_cpu_ops()`` compiles the sources once per machine (``-O3 -march=native``) into a cache
folder (``$KVMESH_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvmesh``, else ``~/.cache/kvmesh``), keyed
by a hash of the sources, the flags and the CPU's feature flags, and returns a ``CpuOps``; with no
compiler it returns None and says why in the log, and the engine keeps its pure-torch path.
Each wrapper checks shapes, strides and dtypes; ``*_reference`` are the torch definitions the
tests hold the kernels to. Decode attention splits its batch into runs of sequences with about
equal context (``split_by_work``), one per torch thread, run on the OpenMP threads torch itself
uses (the library is built with ``-fopenmp`` and binds to the libgomp already loaded).
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import hashlib
import itertools
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import torch
import torch.nn.functional as F
from kvmesh.shared.cache_dir import cache_dir
from kvmesh.shared.cache_dir import temp_cache_dir as _temp_cache_dir
from kvmesh.shared.engine.kv_int8 import GROUP as INT8_GROUP
from kvmesh.shared.engine.kv_quant import e4m3_lut

if TYPE_CHECKING:
    from kvmesh.shared.engine.attention import TreeRows

SOURCES = tuple(Path(__file__).with_name(n) for n in ("cpu_ops.c", "cpu_linear.c", "cpu_layer.c"))
# The most context positions of a draft-tree row read past its sequence's last token: a node's
# ancestors and itself (the engine's trees have at most 63 nodes).
MAX_TREE_TAIL = 64
# Output columns per panel of a packed weight (NR in cpu_linear.c).
PANEL_WIDTH = 16
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-std=gnu11")
# the decode attention's parts run on the process's OpenMP threads (torch's runtime); a compiler
# without OpenMP builds the library without it, and the parts run one after another
OPENMP = "-fopenmp"

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {
    "kv_rms_norm": (_ptr, _ptr, _ptr, _i64, _i64, _f32),
    "kv_silu_mul": (_ptr, _ptr, _i64, _i64),
    # x, rows, in, packed weight, out features, bias or NULL, y, threads
    "kv_linear": (_ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64),
    # qkv, heads, kv heads, d, cos, sin, k, v, strides, block size, tables, width, context
    # lens, scale, out, scratch, scratch stride, part bounds, parts, fp8 or int8 (KVQuant* or NULL),
    # tree rows (KVTree* or NULL)
    "kv_decode_attention": (
        *(_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr),
        *(_i64, _i64, _i64, _ptr, _i64, _ptr, _f32, _ptr, _ptr, _i64, _ptr, _i64, _ptr, _ptr),
    ),
    # x, batch, hidden, attn norm, ffn norm, eps, wqkv, bqkv, wo, bo, wgu, bgu, wdown, bdown,
    # inter, xn, qkv, attn, gu, act, then the attention's: heads, kv heads, d, cos, sin, k, v,
    # strides, block size, tables, width, context lens, scale, scratch, scratch stride; threads;
    # fp8 or int8 (KVQuant* or NULL); tree rows (KVTree* or NULL)
    "kv_decode_layer": (
        *(_ptr, _i64, _i64, _ptr, _ptr, _f32, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr),
        *(_i64, _ptr, _ptr, _ptr, _ptr, _ptr),
        *(_i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _f32),
        *(_ptr, _i64, _i64, _ptr, _ptr),
    ),
}


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A linear layer's (out, in) weight as panels of ``PANEL_WIDTH`` output columns, each one
    contiguous (in, PANEL_WIDTH) strip: ``panels`` is (num_panels, in, PANEL_WIDTH) float32, the
    last panel zero-padded past ``out_features``."""

    panels: torch.Tensor
    out_features: int


def pack_linear_weight(weight: torch.Tensor) -> PackedWeight:
    """The panels of a float32 (out, in) weight (any strides), for ``CpuOps.linear``."""
    assert weight.dtype == torch.float32 and weight.dim() == 2, (weight.dtype, weight.shape)
    n, k = weight.shape
    num_panels = -(-n // PANEL_WIDTH)
    padded = weight.new_zeros(num_panels * PANEL_WIDTH, k)
    padded[:n] = weight
    panels = padded.view(num_panels, PANEL_WIDTH, k).transpose(1, 2).contiguous()
    return PackedWeight(panels, n)


class CpuOpsBuildError(RuntimeError):
    """The C compiler is missing or failed; the message has its output."""


def _cpu_fingerprint() -> str:
    """The CPU feature flags -march=native compiles for (empty where /proc/cpuinfo is absent)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line for line in text.splitlines() if line.startswith("flags")), "")


def build(directory: Path | None = None, compiler: str | None = None) -> Path:
    """Compile ``cpu_ops.c`` unless the cache has it; returns the shared library's path."""
    cc = compiler or os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise CpuOpsBuildError(f"no C compiler {cc!r} on PATH (install gcc, or set CC)")
    source = b"".join(path.read_bytes() for path in SOURCES)
    key = hashlib.sha256(
        source + " ".join((*CFLAGS, OPENMP)).encode() + cc.encode() + _cpu_fingerprint().encode()
    ).hexdigest()[:16]
    name = f"kvmesh_cpu_ops-{key}.so"
    if directory is not None:
        return _compile(cc, directory / name)
    try:
        return _compile(cc, cache_dir() / name)
    except OSError:  # a read-only or broken cache folder: the temp folder will do
        return _compile(cc, _temp_cache_dir() / name)


def _compile(cc: str, target: Path) -> Path:
    if target.exists():
        return target
    directory = target.parent
    directory.mkdir(parents=True, exist_ok=True)
    # Several processes may build at once: each compiles to its own name, then renames.
    fd, tmp = tempfile.mkstemp(prefix=target.name, suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        for flags in ((*CFLAGS, OPENMP), CFLAGS):  # without OpenMP where the compiler has none
            result = subprocess.run(
                [cc, *flags, "-o", tmp, *map(str, SOURCES), "-lm"],
                capture_output=True,
                text=True,
            )
            if result.returncode == 0:
                break
        else:
            raise CpuOpsBuildError(
                f"{cc} failed on {' '.join(map(str, SOURCES))}:\n{result.stderr.strip()}"
            )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


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
        self._decode_layer = lib.kv_decode_layer

    def linear(
        self, x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x (rows, in) @ w.T (+ bias) for w packed by ``pack_linear_weight``: (rows, out).
        Runs on ``torch.get_num_threads()`` threads, each over its own share of the weight."""
        _check_f32_contiguous(x=x)
        k, n = weight.panels.shape[1], weight.out_features
        assert x.dim() == 2 and x.shape[1] == k, (x.shape, weight.panels.shape)
        if bias is not None:
            _check_f32_contiguous(bias=bias)
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

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x: (rows, n) float32 contiguous; weight: (n,). A new (rows, n) tensor."""
        _check_f32_contiguous(x=x, weight=weight)
        assert x.dim() == 2 and weight.shape == (x.shape[1],), (x.shape, weight.shape)
        out = torch.empty_like(x)
        self._rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), *x.shape, eps)
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: (rows, 2n) = [gate | up] float32 contiguous. Returns silu(gate) * up, (rows, n)."""
        _check_f32_contiguous(gate_up=gate_up)
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
        plan then needs ``quant_head_dim``), stored and read as ``shared/engine/kv_quant.py`` and
        ``kv_int8.py`` do.

        qkv: (batch, num_q_heads + 2 * H_kv, D); cos, sin: (batch, 1, D) rotation-table rows of
        each token's position; k_cache, v_cache: (num_blocks, block_size, H_kv, D) per-layer views
        of the pool (``KVPool.layer``); block_tables: (batch, width) int64; context_lens: (batch,)
        int64 including the new token. ``plan``: the step's ``decode_plan``, shared by its
        layers (built here when None).
        """
        # Called once per layer per decode step: the checks are kept to plain attribute reads.
        _check_f32_contiguous(qkv=qkv, cos=cos, sin=sin)
        batch, num_heads, d = qkv.shape
        _, block_size, num_kv_heads, kd = k_cache.shape
        strides = k_cache.stride()
        assert num_heads == num_q_heads + 2 * num_kv_heads and kd == d, (qkv.shape, k_cache.shape)
        assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
        assert cos.shape == sin.shape == (batch, 1, d), (cos.shape, sin.shape)
        assert k_cache.dtype == v_cache.dtype and _is_cache_dtype(k_cache.dtype, kv_scales), (
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
        quant = _quant_args(kv_scales, plan, k_cache)
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
            _tree_arg(plan),
        )
        return out

    def decode_layer(
        self, x: torch.Tensor, w: DecodeLayerWeights, kv: DecodeLayerKV
    ) -> torch.Tensor:
        """One decoder layer's decode step (``kv_decode_layer`` in ``cpu_layer.c``): the
        residual stream x (batch, hidden) after attention and MLP, a new tensor. Rotates, stores
        and attends as ``decode_attention`` does, with ``kv``'s cache, tables and plan; runs on
        ``torch.get_num_threads()`` threads in one parallel region."""
        _check_f32_contiguous(x=x, cos=kv.cos, sin=kv.sin)
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
        assert k_cache.dtype == v_cache.dtype and _is_cache_dtype(k_cache.dtype, kv.scales)
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
        quant = _quant_args(kv.scales, plan, k_cache)
        n_qkv, n_attn, inter = w.wqkv.out_features, w.wo.panels.shape[1], w.inter
        out = x.clone()
        # one allocation, cut into contiguous (batch, n) buffers
        sizes = (hidden, n_qkv, n_attn, 2 * inter, inter)
        work = x.new_empty(batch * sum(sizes)).split([batch * n for n in sizes])
        self._decode_layer(
            out.data_ptr(),
            batch,
            hidden,
            w.attn_norm.data_ptr(),
            w.ffn_norm.data_ptr(),
            w.eps,
            *_weight_bias(w.wqkv, w.bqkv),
            *_weight_bias(w.wo, w.bo),
            *_weight_bias(w.w_gate_up, w.b_gate_up),
            *_weight_bias(w.w_down, w.b_down),
            inter,
            *(t.data_ptr() for t in work),  # xn, qkv, attn, gu, act
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
            _tree_arg(plan),
        )
        return out


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


def _tree_arg(plan: DecodePlan) -> int | None:
    return None if plan.tree is None else ctypes.addressof(plan.tree)


def _is_cache_dtype(dtype: torch.dtype, kv_scales: tuple[torch.Tensor, ...] | None) -> bool:
    """Whether the kernels read a cache of ``dtype`` with (or without) ``kv_scales``."""
    if kv_scales is None:
        return dtype == torch.float32
    return dtype in (torch.float8_e4m3fn, torch.int8)


def _quant_args(
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


def _weight_bias(weight: PackedWeight, bias: torch.Tensor | None) -> tuple[int, int | None]:
    return weight.panels.data_ptr(), None if bias is None else bias.data_ptr()


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
        h, n_q, n_kv, d, i = (
            self.hidden,
            self.num_q_heads,
            self.num_kv_heads,
            self.head_dim,
            self.inter,
        )
        assert n_q % n_kv == 0, (n_q, n_kv)
        _check_f32_contiguous(attn_norm=self.attn_norm, ffn_norm=self.ffn_norm)
        assert self.attn_norm.shape == self.ffn_norm.shape == (h,)
        for name, weight, bias, n, k in (
            ("wqkv", self.wqkv, self.bqkv, (n_q + 2 * n_kv) * d, h),
            ("wo", self.wo, self.bo, h, n_q * d),
            ("w_gate_up", self.w_gate_up, self.b_gate_up, 2 * i, h),
            ("w_down", self.w_down, self.b_down, h, i),
        ):
            assert weight.out_features == n and weight.panels.shape[1] == k, (name, n, k)
            _check_f32_contiguous(**{name: weight.panels})
            if bias is not None:
                _check_f32_contiguous(**{f"{name} bias": bias})
                assert bias.shape == (n,), (name, bias.shape)


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


def _check_f32_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        assert t.dtype == torch.float32, f"{name} must be float32, got {t.dtype}"
        assert t.is_cpu and t.is_contiguous(), f"{name} must be contiguous on CPU"


@functools.cache
def load_cpu_ops() -> CpuOps | None:
    """The process's CpuOps, built on first use; None (logged once) when it cannot be built."""
    try:
        return CpuOps(build())
    except (CpuOpsBuildError, OSError) as exc:
        structlog.get_logger("kvmesh.kernels").warning(
            "cpu_ops_unavailable", reason=str(exc), fallback="torch decode path"
        )
        return None


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * x.square().mean(-1, keepdim=True).add(eps).rsqrt() * weight


def linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return F.linear(x, weight, bias)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
