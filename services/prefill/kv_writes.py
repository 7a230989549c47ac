"""Planning the scatter-gather writes that move KV blocks from a prefill rank to decode ranks.

Pure: given the prefill rank's pool (and the ``MemoryRegion`` it is registered under), the blocks
to send, and where the matching decode blocks are, return one ``WriteEntry`` list per destination
(decode) rank. Tensor-parallel degrees may differ on the two sides: ``KVHeadShards`` on each side
says which heads a rank holds (runs of different lengths when the ranks do not divide the
heads; replicated when there are fewer heads than ranks), and
``reshard_pieces`` which of them this rank sends where: every head once, by the first rank
holding it, into every decode rank holding it (docs/tp.md). ``ChunkPlanner``
(``services/prefill/plan.py``) spans a chunk's blocks through ``block_spans.py``.

* Same layout (block size, dtype, head_dim, layers): every entry is a span of the registered prefill
  pool, no staging copy. Head-major blocks make a head range of a block one contiguous span, so a
  whole block goes as one entry (same TP) and a head slice as one entry landing at
  ``h0 * head_bytes`` in the decode block (TP differs); uneven splits are spans of different
  lengths, and decode ranks of different block sizes in bytes (each ``KVDestination`` its own).
  Spans adjacent on both sides are coalesced.
* Different block size: the prefill rank packs each head piece into a staging region, regrouped
  into decode-sized blocks (``run_packs``, the Triton pack kernel), and the entries read from there.
  Write whole decode blocks only: a short last block goes with a zero tail, so a caller that splits
  one decode block over two calls (chunk boundaries not on decode block boundaries) overwrites the
  first call's tokens. Cut chunks at multiples of the larger block size.
* Different KV dtype (``--kv-cache-dtype``: float32/bf16/fp16 against int8 or fp8 e4m3 with
  scales), same block size: the prefill rank converts each head piece into staging in the
  decode's layout (``run_packs``, ``kvmesh.kernels.kv_convert.pack_converted``), and the entries read
  from there; an fp8 destination then takes a quarter of float32's bytes (half of bf16's), an
  int8 one 9/32 (its per-token scales included).
* Different dtype and block size together, an fp8 or int8 side with a different block size (a
  block's scales sit after its own tokens), different head_dim, layer count or total head count:
  refused (``KVLayoutError``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from kvmesh.kernels.kv_convert import pack_converted
from kvmesh.kernels.kv_pack import pack_blocks, staging_shape
from kvmesh.services.prefill.block_spans import coalesce_spans, head_slice_spans, piece_bytes
from kvmesh.shared.kv.head_shards import HeadPiece, KVHeadShards, reshard_pieces
from kvmesh.shared.kv.kv_cache import KVCacheSpec, KVPool
from kvmesh.shared.transport.base import MemoryRegion, WriteEntry
from kvmesh.shared.transport.errors import LocalAccessError


class KVLayoutError(ValueError):
    """The prefill and decode KV layouts cannot be bridged by a write plan."""


@dataclass(frozen=True, slots=True)
class KVDestination:
    """One destination (decode) rank's share of a write: its local KV layout (``spec.num_kv_heads``
    is the number of heads that rank holds: ranks differ in it when the split is uneven, in
    nothing else), the rkey of its registered pool and, in token order,
    the address of each destination block in the receiver's address space."""

    spec: KVCacheSpec
    rkey: int
    block_addrs: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PackStep:
    """Pack heads ``[heads[0], heads[1])`` of the source blocks ``block_ids`` into staging blocks of
    ``block_size`` tokens at ``staging_offset`` (bytes) of the staging region; converted to
    ``dtype`` (the destination's head-span layout) when it is not None."""

    block_ids: tuple[int, ...]
    heads: tuple[int, int]
    block_size: int
    staging_offset: int
    num_bytes: int
    dtype: torch.dtype | None = None


@dataclass(frozen=True, slots=True)
class KVWritePlan:
    """``writes[r]``: the entries for destination rank ``r`` (empty when this source rank holds
    none of its heads). ``packs`` must run (``run_packs``) before the writes when non-empty."""

    writes: tuple[tuple[WriteEntry, ...], ...]
    packs: tuple[PackStep, ...] = ()
    staging: MemoryRegion | None = None

    @property
    def num_bytes(self) -> int:
        return sum(e.length for entries in self.writes for e in entries)

    @property
    def num_entries(self) -> int:
        return sum(len(entries) for entries in self.writes)


def staging_bytes(
    spec: KVCacheSpec,
    num_blocks: int,
    destinations: Sequence[KVDestination],
    *,
    src_rank: int = 0,
    src_tp: int = 1,
    num_kv_heads: int | None = None,
) -> int:
    """Bytes of staging ``plan_kv_writes`` needs for ``num_blocks`` source blocks; 0 when the
    writes go straight from the pool."""
    dst_spec, pieces = _check_layouts(spec, destinations, src_rank, src_tp, num_kv_heads)
    if dst_spec.block_size == spec.block_size and dst_spec.dtype == spec.dtype:
        return 0
    m = _num_dst_blocks(spec, dst_spec, num_blocks)
    heads = sum(p.src_heads[1] - p.src_heads[0] for p in pieces)
    return m * heads * dst_spec.head_bytes


def plan_kv_writes(
    pool: KVPool,
    pool_region: MemoryRegion,
    block_ids: Sequence[int],
    destinations: Sequence[KVDestination],
    *,
    src_rank: int = 0,
    src_tp: int = 1,
    num_kv_heads: int | None = None,
    staging: MemoryRegion | None = None,
    staging_offset: int = 0,
) -> KVWritePlan:
    """The write entries that move ``block_ids`` of this source rank's ``pool`` (registered as
    ``pool_region``) to ``destinations[r]`` for every destination (decode) TP rank ``r``.

    ``num_kv_heads``: the model's KV heads in all (default: this rank's times ``src_tp``, an
    even split with none replicated; pass it for any other). Each side splits them as
    ``KVHeadShards`` says; ``pool.spec.num_kv_heads`` and each destination's
    ``spec.num_kv_heads`` must be the heads its rank holds there. Source
    block ``i`` goes to destination block ``i`` (same block size) or the tokens of the source
    blocks, as one run, fill the destination blocks in order (different block size; then a
    ``staging`` region of ``staging_bytes(...)`` bytes from ``staging_offset`` is needed).
    """
    spec = pool.spec
    dst_spec, pieces = _check_layouts(spec, destinations, src_rank, src_tp, num_kv_heads)
    ids = tuple(int(b) for b in block_ids)
    bad = [b for b in ids if not 0 <= b < pool.num_blocks]
    if bad:
        raise ValueError(f"source block ids {bad} are outside the pool's {pool.num_blocks} blocks")
    n_dst = _num_dst_blocks(spec, dst_spec, len(ids))
    for rank, dst in enumerate(destinations):
        if len(dst.block_addrs) != n_dst:
            raise ValueError(
                f"{len(ids)} source blocks of {spec.block_size} tokens fill {n_dst} destination "
                f"blocks of {dst_spec.block_size}, but destination rank {rank} gave "
                f"{len(dst.block_addrs)} block addresses"
            )
    pool_offset = pool.base_addr - pool_region.addr
    if pool_offset < 0 or pool_offset + pool.nbytes > pool_region.length:
        raise LocalAccessError(
            f"the KV pool [{pool.base_addr:#x}, +{pool.nbytes}) is not inside its registered "
            f"region [{pool_region.addr:#x}, +{pool_region.length}) (rkey {pool_region.rkey}); "
            f"register the memory the pool lives in"
        )
    writes: list[list[WriteEntry]] = [[] for _ in destinations]
    if not ids:
        return KVWritePlan(tuple(tuple(w) for w in writes))

    if dst_spec.block_size == spec.block_size and dst_spec.dtype == spec.dtype:
        for piece in pieces:
            dst = destinations[piece.dst_rank]
            spans = head_slice_spans(ids, dst.block_addrs, spec, piece, local_base=pool_offset)
            writes[piece.dst_rank] = _entries(pool_region, dst.rkey, spans)
        return KVWritePlan(tuple(tuple(w) for w in writes))

    need = staging_bytes(
        spec, len(ids), destinations, src_rank=src_rank, src_tp=src_tp, num_kv_heads=num_kv_heads
    )
    convert = dst_spec.dtype if dst_spec.dtype != spec.dtype else None
    if staging is None:
        why = (
            f"prefill KV is {spec.dtype}, decode KV {dst_spec.dtype}: the KV must be converted"
            if convert is not None
            else f"prefill blocks hold {spec.block_size} tokens, decode blocks "
            f"{dst_spec.block_size}: the KV must be regrouped"
        )
        raise KVLayoutError(
            f"{why} through a registered staging region of {need} bytes; pass staging= (or run "
            f"prefill and decode with the same KV dtype and block size)"
        )
    align = max(spec.dtype_size, dst_spec.dtype_size)
    if staging_offset < 0 or staging_offset % align:
        raise ValueError(
            f"staging_offset must be a non-negative multiple of {align} "
            f"(the KV dtype size), got {staging_offset}"
        )
    if staging_offset + need > staging.length:
        raise LocalAccessError(
            f"staging region (rkey {staging.rkey}) holds {staging.length} bytes; this write "
            f"needs {need} bytes from offset {staging_offset}"
        )
    packs = []
    offset = staging_offset
    for piece in pieces:
        h0, h1 = piece.src_heads
        span = (h1 - h0) * dst_spec.head_bytes  # one staging block of this piece
        dst_offset = piece.dst_head_offset * dst_spec.head_bytes
        packs.append(PackStep(ids, (h0, h1), dst_spec.block_size, offset, n_dst * span, convert))
        addrs = destinations[piece.dst_rank].block_addrs
        spans = [(offset + j * span, addr + dst_offset, span) for j, addr in enumerate(addrs)]
        writes[piece.dst_rank] = _entries(staging, destinations[piece.dst_rank].rkey, spans)
        offset += n_dst * span
    return KVWritePlan(tuple(tuple(w) for w in writes), tuple(packs), staging)


def run_packs(plan: KVWritePlan, pool: KVPool, staging: torch.Tensor) -> None:
    """Fill the staging region for ``plan`` from ``pool`` (the pool the plan was made for).

    ``staging``: the memory registered as ``plan.staging`` (a flat uint8 tensor, e.g. from
    ``Transport.allocate``). Call before issuing the plan's writes; a no-op when there are no packs.
    """
    if not plan.packs:
        return
    assert plan.staging is not None
    if staging.dtype != torch.uint8 or staging.dim() != 1 or not staging.is_contiguous():
        raise ValueError(
            f"staging must be a flat contiguous uint8 tensor, got {staging.dtype} "
            f"{tuple(staging.shape)}"
        )
    if staging.data_ptr() != plan.staging.addr or staging.numel() < plan.staging.length:
        raise LocalAccessError(
            f"staging tensor [{staging.data_ptr():#x}, +{staging.numel()}) is not the memory of "
            f"the plan's staging region [{plan.staging.addr:#x}, +{plan.staging.length})"
        )
    for step in plan.packs:
        out = staging[step.staging_offset : step.staging_offset + step.num_bytes]
        if step.dtype is not None:  # another KV dtype: same block size, converted
            ids = list(step.block_ids)
            pack_converted(
                pool.tensor, pool.scales, ids, *step.heads, step.dtype, out.view(len(ids), -1)
            )
            continue
        shape = staging_shape(
            pool.tensor, len(step.block_ids), step.heads[1] - step.heads[0], step.block_size
        )
        pack_blocks(
            pool.tensor,
            list(step.block_ids),
            *step.heads,
            out=out.view(pool.spec.dtype).view(shape),
            block_size=step.block_size,
        )


@dataclass(frozen=True, slots=True)
class RankSlice:
    """What one prefill rank writes of every block into one decode rank: bytes ``block_slice``
    = (start in the local block, start in the decode block, length), as writer ``writer`` of the
    ``num_writers`` prefill ranks that write into that decode rank. Each writes every chunk, so
    the decode rank counts ``num_writers`` writes a chunk (write index ``chunk * num_writers +
    writer``: distinct immediates, as its write lease wants)."""

    dst_rank: int
    block_slice: tuple[int, int, int]
    writer: int = 0
    num_writers: int = 1


def rank_block_slices(
    spec: KVCacheSpec, src: KVHeadShards, dst: KVHeadShards, src_rank: int
) -> list[RankSlice]:
    """What source rank ``src_rank`` (its pool laid out as ``spec``) writes of every block, per
    decode rank it writes to; none for a replica that is not its heads' writer.
    ``ChunkPlanner(rank_slice=...)`` plans a chunk's write from one of them."""
    if spec.num_kv_heads != src.num_heads(src_rank):
        raise KVLayoutError(
            f"rank {src_rank} of TP {src.tp_size} holds {src.num_heads(src_rank)} of "
            f"{src.num_kv_heads} KV heads, but its KV layout has {spec.num_kv_heads}"
        )
    slices = []
    for piece in reshard_pieces(src, dst, src_rank):
        writers = decode_writers(src, dst, piece.dst_rank)
        block_slice = piece_bytes(piece, spec.head_bytes)
        slices.append(RankSlice(piece.dst_rank, block_slice, writers.index(src_rank), len(writers)))
    return slices


def job_rank_slices(
    spec: KVCacheSpec, num_kv_heads: int, tp_size: int, decode_tp: int
) -> list[RankSlice]:
    """What prefill rank 0 of TP ``tp_size`` (its pool laid out as ``spec``) writes of every
    block into a decode worker at TP ``decode_tp``: one ``RankSlice`` per decode rank it writes
    to, decode rank 0's first (rank 0 holds head 0, whose first writer it is). ValueError
    (KVLayoutError) when the two TP degrees do not fit the model's KV heads."""
    src, dst = KVHeadShards(num_kv_heads, tp_size), KVHeadShards(num_kv_heads, decode_tp)
    slices = rank_block_slices(spec, src, dst, 0)
    assert slices and slices[0].dst_rank == 0, slices
    return slices


def decode_writers(src: KVHeadShards, dst: KVHeadShards, dst_rank: int) -> list[int]:
    """The source ranks that write into decode rank ``dst_rank``, in rank order."""
    return [
        s
        for s in range(src.tp_size)
        if any(p.dst_rank == dst_rank for p in reshard_pieces(src, dst, s))
    ]


def _check_layouts(
    spec: KVCacheSpec,
    destinations: Sequence[KVDestination],
    src_rank: int,
    src_tp: int,
    num_kv_heads: int | None,
) -> tuple[KVCacheSpec, list[HeadPiece]]:
    """The destination ranks' spec (rank 0's: the ranks' differ in their head count alone), once
    it is checked against the source's, and the head pieces this source rank sends."""
    if src_tp <= 0 or not 0 <= src_rank < src_tp:
        raise ValueError(f"src_rank must be in [0, src_tp={src_tp}), got {src_rank}")
    if not destinations:
        raise ValueError("no destinations: pass one KVDestination per decode TP rank")
    dst_spec = destinations[0].spec
    for rank, dst in enumerate(destinations):
        if replace(dst.spec, num_kv_heads=dst_spec.num_kv_heads) != dst_spec:
            raise KVLayoutError(
                f"decode TP ranks disagree on the KV layout: rank 0 has {dst_spec.fingerprint()}, "
                f"rank {rank} {dst.spec.fingerprint()}"
            )
    if (spec.num_layers, spec.head_dim) != (dst_spec.num_layers, dst_spec.head_dim):
        raise KVLayoutError(
            f"prefill KV is {spec.fingerprint()}, decode KV {dst_spec.fingerprint()}: layer count "
            f"or head_dim differ, so prefill and decode do not serve the same model"
        )
    if spec.dtype != dst_spec.dtype and spec.block_size != dst_spec.block_size:
        raise KVLayoutError(
            f"prefill KV is {spec.fingerprint()}, decode KV {dst_spec.fingerprint()}: a write "
            f"converts the KV dtype or regroups block sizes, not both; run prefill and decode "
            f"with the same block size"
        )
    if (spec.is_quantized or dst_spec.is_quantized) and spec.block_size != dst_spec.block_size:
        raise KVLayoutError(
            f"prefill KV is {spec.fingerprint()}, decode KV {dst_spec.fingerprint()}: fp8 and "
            f"int8 blocks carry the scales of their own tokens and are not regrouped; run "
            f"prefill and decode with the same block size"
        )
    total = spec.num_kv_heads * src_tp if num_kv_heads is None else num_kv_heads
    try:
        src_shards = KVHeadShards(total, src_tp)
        dst_shards = KVHeadShards(total, len(destinations))
    except ValueError as exc:
        raise KVLayoutError(f"{exc} (the model has {total} KV heads)") from None
    held = [("prefill", src_shards, src_rank, spec.num_kv_heads)] + [
        ("decode", dst_shards, rank, dst.spec.num_kv_heads) for rank, dst in enumerate(destinations)
    ]
    for side, shards, rank, per_rank in held:
        if shards.num_heads(rank) != per_rank:
            raise KVLayoutError(
                f"{side} rank {rank} of TP {shards.tp_size} holds {shards.num_heads(rank)} of "
                f"the model's {total} KV heads, but its KV layout has {per_rank}: not the same "
                f"model, a TP rank missing, or num_kv_heads not passed for an uneven split"
            )
    return dst_spec, reshard_pieces(src_shards, dst_shards, src_rank)


def _num_dst_blocks(spec: KVCacheSpec, dst_spec: KVCacheSpec, num_src_blocks: int) -> int:
    return -(-num_src_blocks * spec.block_size // dst_spec.block_size)


def _entries(
    local: MemoryRegion, rkey: int, spans: Sequence[tuple[int, int, int]]
) -> list[WriteEntry]:
    """WriteEntries for ``(local_offset, remote_addr, length)`` spans, adjacent runs merged."""
    return [WriteEntry(local, off, addr, rkey, n) for off, addr, n in coalesce_spans(spans)]
