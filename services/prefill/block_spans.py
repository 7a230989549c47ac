"""Byte spans of a KV write: ``(local_offset, remote_addr, length)``, a byte range of each local
block (a head slice, or the whole block) to its place in the matching remote block, adjacent runs
merged. Pure arithmetic, shared by the write planner (kv_writes.py) and ``ChunkPlanner``
(plan.py)."""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.shared.kv.head_shards import HeadPiece
from kvmesh.shared.kv.kv_cache import KVCacheSpec


def head_slice_spans(
    block_ids: Sequence[int],
    remote_block_addrs: Sequence[int],
    spec: KVCacheSpec,
    piece: HeadPiece,
    local_base: int = 0,
) -> list[tuple[int, int, int]]:
    """``(local_offset, remote_addr, length)`` spans that write ``piece``'s heads of the local
    blocks ``block_ids`` (a pool of ``spec``'s layout at ``local_base`` of its region) into the
    remote blocks at ``remote_block_addrs`` (same order), at the piece's head offset there."""
    local_start, remote_start, length = piece_bytes(piece, spec.head_bytes)
    spans = block_slice_spans(
        block_ids, remote_block_addrs, spec.block_bytes, local_start, remote_start, length
    )
    return [(local_base + off, addr, n) for off, addr, n in spans]


def piece_bytes(piece: HeadPiece, head_bytes: int) -> tuple[int, int, int]:
    """(its first byte in a local block, its first byte in the remote block, its length)."""
    h0, h1 = piece.src_heads
    return h0 * head_bytes, piece.dst_head_offset * head_bytes, (h1 - h0) * head_bytes


def block_slice_spans(
    block_ids: Sequence[int],
    remote_block_addrs: Sequence[int],
    block_bytes: int,
    local_start: int,
    remote_start: int,
    length: int,
) -> list[tuple[int, int, int]]:
    """``(local_offset, remote_addr, length)`` spans of bytes ``[local_start, +length)`` of each
    local block (``block_id * block_bytes`` from the pool's start) to ``remote_start`` of its
    remote block; one span per block, runs adjacent on both sides merged. ``(0, 0,
    block_bytes)`` writes whole blocks (the same TP on both sides)."""
    assert local_start >= 0 and local_start + length <= block_bytes, (local_start, length)
    spans = [
        (block_id * block_bytes + local_start, addr + remote_start, length)
        for block_id, addr in zip(block_ids, remote_block_addrs, strict=True)
    ]
    return coalesce_spans(spans)


def coalesce_spans(spans: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """``(local_offset, remote_addr, length)`` spans in order, each merged into the previous one
    when both its local and remote sides continue it."""
    merged: list[tuple[int, int, int]] = []
    for local_offset, remote_addr, length in spans:
        if merged:
            last_local, last_remote, last_length = merged[-1]
            if (
                last_local + last_length == local_offset
                and last_remote + last_length == remote_addr
            ):
                merged[-1] = (last_local, last_remote, last_length + length)
                continue
        merged.append((local_offset, remote_addr, length))
    return merged
