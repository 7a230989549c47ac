"""Paged KV cache: a pool of fixed-size blocks, one contiguous byte range per block.

Layout (see docs/ARCHITECTURE.md): ``[num_blocks, num_kv_heads, num_layers, 2, block_size, head_dim]``.
Every block holds all layers' K and V for ``block_size`` tokens in one contiguous span, so moving one
block to another process is one scatter-gather entry of ``block_bytes`` bytes; and within a block
each KV head is itself one contiguous span, so a tensor-parallel rank's head slice moves as one
entry too (resharding without a staging copy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

    @property
    def dtype_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        # 2 (K and V) * layers * kv_heads * head_dim * dtype size
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_size

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.bytes_per_token

    @property
    def head_bytes(self) -> int:
        """Bytes of one KV head within one block (all layers, K and V)."""
        return self.block_bytes // self.num_kv_heads

    def block_shape(self) -> tuple[int, ...]:
        return (self.num_kv_heads, self.num_layers, 2, self.block_size, self.head_dim)

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
        if buffer is None:
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
        # (num_blocks, H_kv, L, 2, block_size, D)
        self.tensor = self.raw.view(spec.dtype).view(num_blocks, *spec.block_shape())
        # Per-layer K/V views, made once: a decode step asks for them in every layer.
        self._layers = [self._layer_views(i) for i in range(spec.num_layers)]

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
