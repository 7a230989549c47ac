"""Paged KV cache: a pool of fixed-size blocks, one contiguous byte range per block.

Layout (see docs/ARCHITECTURE.md): ``[num_blocks, num_kv_heads, num_layers, 2, block_size, head_dim]``.
Every block holds all layers' K and V for ``block_size`` tokens in one contiguous span, so moving one
block to another process is one scatter-gather entry of ``block_bytes`` bytes; and within a block
each KV head is itself one contiguous span, so a tensor-parallel rank's head slice moves as one
entry too (resharding without a staging copy).

An fp8 pool (``dtype=torch.float8_e4m3fn``, ``--kv-cache-dtype fp8_e4m3``) keeps a float32 scale
per (block, KV head, layer, K/V) at the end of each head span: ``[L, 2, block_size, D]`` fp8 bytes
then ``[L, 2]`` float32 scales. The scales thus travel inside the span with their block, whole or
as a head slice (docs/kv_cache.md; the scale rule is in ``kv_quant.py``).

An int8 pool (``dtype=torch.int8``, ``--kv-cache-dtype int8``) keeps a float32 scale per 32
values of every token likewise at the end of each head span: ``[L, 2, block_size, D]`` int8 bytes
then ``[L, 2, block_size, D // 32]`` float32 scales (``kv_int8.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvmesh.shared.config.huge_pages import huge_page_empty
from kvmesh.shared.kv.kv_int8 import GROUP as INT8_GROUP


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Shape of one worker's KV cache; two workers can exchange blocks iff their specs match."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVCacheSpec.{name} must be positive, got {getattr(self, name)}")
        if self.is_fp8 and (self.block_size * self.head_dim) % 4:
            raise ValueError(
                f"an fp8 KV cache needs block_size * head_dim to be a multiple of 4 (its scales "
                f"are float32), got {self.block_size} * {self.head_dim}"
            )
        if self.is_int8 and self.head_dim % INT8_GROUP:
            raise ValueError(
                f"an int8 KV cache needs head_dim to be a multiple of {INT8_GROUP} (one scale per "
                f"{INT8_GROUP} values), got {self.head_dim}: use --kv-cache-dtype fp8_e4m3 or auto"
            )

    @property
    def is_fp8(self) -> bool:
        """Whether the pool stores fp8 e4m3 with per-(block, head, layer, K/V) scales."""
        return self.dtype == torch.float8_e4m3fn

    @property
    def is_int8(self) -> bool:
        """Whether the pool stores int8 with a scale per 32 values of each token."""
        return self.dtype == torch.int8

    @property
    def is_quantized(self) -> bool:
        """Whether blocks carry scales after their data (fp8 or int8)."""
        return self.is_fp8 or self.is_int8

    @property
    def dtype_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token: 2 (K and V) * layers * kv_heads * head_dim * dtype size (an fp8
        or int8 block adds ``scale_bytes`` per head on top, see ``block_bytes``)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_size

    @property
    def scale_bytes(self) -> int:
        """Bytes of scales at the end of one head span: float32 per (layer, K/V) for fp8, per
        (layer, K/V, token, 32 values) for int8; 0 otherwise."""
        if self.is_int8:
            return 2 * self.num_layers * self.block_size * (self.head_dim // INT8_GROUP) * 4
        return 2 * self.num_layers * 4 if self.is_fp8 else 0

    @property
    def block_bytes(self) -> int:
        return self.num_kv_heads * self.head_bytes

    @property
    def head_bytes(self) -> int:
        """Bytes of one KV head within one block (all layers, K and V, and their scales)."""
        data = 2 * self.num_layers * self.block_size * self.head_dim * self.dtype_size
        return data + self.scale_bytes

    def block_shape(self) -> tuple[int, ...]:
        return (self.num_kv_heads, self.num_layers, 2, self.block_size, self.head_dim)

    def block_scale_shape(self) -> tuple[int, ...]:
        """Shape of one block's float32 scales: (H_kv, L, 2) for fp8, (H_kv, L, 2, block_size,
        D // 32) for int8; () when the pool has none."""
        H, L = self.num_kv_heads, self.num_layers
        if self.is_int8:
            return (H, L, 2, self.block_size, self.head_dim // INT8_GROUP)
        return (H, L, 2) if self.is_fp8 else ()

    def fingerprint(self) -> str:
        """A short string two workers compare before exchanging blocks."""
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"L{self.num_layers}-H{self.num_kv_heads}-D{self.head_dim}-B{self.block_size}-{dtype}"
        )

    def num_blocks_for(self, num_bytes: int) -> int:
        return num_bytes // self.block_bytes


class KVPool:
    """The block pool. Either owns its memory or lives over a buffer handed in from outside
    (a shared-memory segment, memory registered for RDMA)."""

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        device: str | torch.device = "cpu",
        buffer: memoryview | bytearray | torch.Tensor | None = None,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.spec = spec
        self.num_blocks = num_blocks
        nbytes = num_blocks * spec.block_bytes
        if buffer is None and torch.device(device).type == "cpu":
            # huge pages: in 4 KiB ones each of decode's scattered tiles costs a TLB miss
            raw = huge_page_empty(nbytes)
        elif buffer is None:
            raw = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        elif isinstance(buffer, torch.Tensor):
            raw = buffer.view(torch.uint8).reshape(-1)
        else:
            raw = torch.frombuffer(buffer, dtype=torch.uint8)
        if raw.numel() < nbytes:
            raise ValueError(
                f"KV buffer holds {raw.numel()} bytes, {num_blocks} blocks of {spec.block_bytes} "
                f"bytes need {nbytes}"
            )
        self.raw = raw[:nbytes]  # (num_blocks * block_bytes,) uint8
        # (num_blocks, H_kv, L, 2, block_size, D); strided over the scales of an fp8 or int8 pool
        self.tensor = _strided(self.raw, spec.dtype, (num_blocks, *spec.block_shape()), spec)
        # (num_blocks, *spec.block_scale_shape()) float32 scales of an fp8 or int8 pool, else None
        self.scales: torch.Tensor | None = None
        if spec.is_quantized:
            shape = (num_blocks, *spec.block_scale_shape())
            offset = spec.head_bytes - spec.scale_bytes
            self.scales = _strided(self.raw, torch.float32, shape, spec, offset=offset)
        # Per-layer K/V views, made once: a decode step asks for them in every layer.
        self._layers = [self._layer_views(i) for i in range(spec.num_layers)]
        self._layer_scales = [self._layer_scale_views(i) for i in range(spec.num_layers)]

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    @property
    def base_addr(self) -> int:
        return self.raw.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Strided (num_blocks, block_size, H_kv, D) views of one layer's K and V."""
        return self._layers[layer_idx]

    def layer_scales(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Float32 views of one layer's K and V scales: (num_blocks, H_kv) for fp8, (num_blocks,
        block_size, H_kv, D // 32) for int8 (laid out as ``layer``'s views); None otherwise."""
        return self._layer_scales[layer_idx]

    def _layer_scale_views(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.scales is None:
            return None
        layer = self.scales[:, :, layer_idx]
        if self.spec.is_int8:  # (num_blocks, H_kv, 2, block_size, G)
            return layer[:, :, 0].transpose(1, 2), layer[:, :, 1].transpose(1, 2)
        return layer[:, :, 0], layer[:, :, 1]

    def _layer_views(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.tensor[:, :, layer_idx]  # (num_blocks, H_kv, 2, block_size, D)
        return layer[:, :, 0].transpose(1, 2), layer[:, :, 1].transpose(1, 2)

    def block_offset(self, block_id: int) -> int:
        """Byte offset of a block from the start of the pool."""
        assert 0 <= block_id < self.num_blocks, block_id
        return block_id * self.spec.block_bytes

    def block_addr(self, block_id: int) -> int:
        """Address of a block's first byte in this process."""
        return self.base_addr + self.block_offset(block_id)

    def head_span(self, block_id: int, head_start: int, head_end: int) -> tuple[int, int]:
        """(byte offset from the pool start, length) of heads [head_start, head_end) of a block."""
        assert 0 <= head_start < head_end <= self.spec.num_kv_heads, (head_start, head_end)
        start = self.block_offset(block_id) + head_start * self.spec.head_bytes
        return start, (head_end - head_start) * self.spec.head_bytes

    def block_bytes_view(self, block_id: int) -> torch.Tensor:
        """The raw bytes of one block, (block_bytes,) uint8."""
        off = self.block_offset(block_id)
        return self.raw[off : off + self.spec.block_bytes]


def _strided(
    raw: torch.Tensor,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    spec: KVCacheSpec,
    offset: int = 0,
) -> torch.Tensor:
    """A ``dtype`` view of ``shape`` over the pool bytes: dimension 0 steps by blocks, 1 by head
    spans, the rest contiguous, starting ``offset`` bytes into each head span."""
    size = torch.empty((), dtype=dtype).element_size()
    assert spec.block_bytes % size == 0 and spec.head_bytes % size == 0 and offset % size == 0
    flat = raw.view(dtype)
    inner = torch.empty(shape[2:], device="meta").stride()
    strides = (spec.block_bytes // size, spec.head_bytes // size, *inner)
    return flat.as_strided(shape, strides, flat.storage_offset() + offset // size)
