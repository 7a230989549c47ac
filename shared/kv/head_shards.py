"""Which KV heads each tensor-parallel rank holds (pure, torch-free).

With at least as many KV heads as ranks, rank ``r`` of ``tp_size`` holds a run of consecutive
heads, the runs as even as the count allows: ``num_kv_heads // tp_size`` each, the first
``num_kv_heads % tp_size`` ranks one more (3 heads at TP2: ``[0, 2)`` and ``[2, 3)``; a head
with its query heads is a GQA group, the unit a rank holds: docs/tp.md). With fewer KV heads
than ranks (GQA; ``tp_size`` a multiple of ``num_kv_heads``) each head is replicated on
``tp_size / num_kv_heads`` consecutive ranks, one head each, as vLLM does: rank ``r`` holds head
``r // replicas``. More ranks than heads otherwise is refused.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HeadPiece:
    """Heads ``src_heads`` (indices into the source rank's own heads) go to destination rank
    ``dst_rank`` at head ``dst_head_offset`` of its own heads."""

    dst_rank: int
    src_heads: tuple[int, int]
    dst_head_offset: int


@dataclass(frozen=True, slots=True)
class KVHeadShards:
    """The split of a model's ``num_kv_heads`` KV heads over ``tp_size`` ranks."""

    num_kv_heads: int
    tp_size: int

    def __post_init__(self) -> None:
        if self.num_kv_heads <= 0 or self.tp_size <= 0:
            raise ValueError(
                f"num_kv_heads and tp_size must be positive, got {self.num_kv_heads}, "
                f"{self.tp_size}"
            )
        if self.tp_size > self.num_kv_heads and self.tp_size % self.num_kv_heads:
            raise ValueError(
                f"{self.num_kv_heads} KV heads cannot be split over TP {self.tp_size}: with more "
                f"ranks than KV heads each head is replicated on as many ranks, so the TP degree "
                f"must be a multiple of the KV head count (or at most {self.num_kv_heads})"
            )

    def num_heads(self, rank: int) -> int:
        """How many heads rank ``rank`` holds."""
        start, end = self.heads(rank)
        return end - start

    @property
    def replicas(self) -> int:
        """How many ranks hold each head (1 unless there are fewer heads than ranks)."""
        return max(1, self.tp_size // self.num_kv_heads)

    def heads(self, rank: int) -> tuple[int, int]:
        """The global heads ``[start, end)`` rank ``rank`` holds."""
        assert 0 <= rank < self.tp_size, (rank, self.tp_size)
        if self.tp_size > self.num_kv_heads:
            head = rank // self.replicas
            return head, head + 1
        base, extra = divmod(self.num_kv_heads, self.tp_size)
        start = rank * base + min(rank, extra)
        return start, start + base + (rank < extra)

    def is_writer(self, rank: int) -> bool:
        """Whether ``rank`` is the first of the ranks holding its heads: the one that sends them."""
        return rank % self.replicas == 0


def reshard_pieces(src: KVHeadShards, dst: KVHeadShards, src_rank: int) -> list[HeadPiece]:
    """What source rank ``src_rank`` writes when the heads move from ``src``'s split to ``dst``'s:
    every head it holds and is the writer of, to every destination rank that holds it (a head
    replicated on the destination side goes to each replica)."""
    if src.num_kv_heads != dst.num_kv_heads:
        raise ValueError(
            f"the source holds {src.num_kv_heads} KV heads in all, the destination "
            f"{dst.num_kv_heads}: not the same model"
        )
    if not src.is_writer(src_rank):
        return []
    lo, hi = src.heads(src_rank)
    pieces = []
    for dst_rank in range(dst.tp_size):
        d_lo, d_hi = dst.heads(dst_rank)
        start, end = max(lo, d_lo), min(hi, d_hi)
        if start < end:
            pieces.append(HeadPiece(dst_rank, (start - lo, end - lo), start - d_lo))
    return pieces
