"""Planning the scatter-gather writes that move KV blocks from a prefill rank to decode ranks.

Not product code: the services do not run tensor-parallel yet (prefill plans its chunk writes in
``services/prefill/plan.py``, converts dtypes in ``services/prefill/convert.py``); this planner
shows, with tests/test_kv_reshard.py and tests/test_kv_convert.py, that the pool layout reshards
without staging.

Pure: given the prefill rank's pool (and the ``MemoryRegion`` it is registered under), the blocks
to send, and where the matching decode blocks are, return one ``WriteEntry`` list per destination
(decode) rank. Tensor-parallel degrees may differ on the two sides (``kvmesh.kernels.kv_pack.reshard_plan``
says which heads go where).

* Same layout (block size, dtype, head_dim, layers): every entry is a span of the registered prefill
  pool, no staging copy. Head-major blocks make a head range of a block one contiguous span, so a
  whole block goes as one entry (same TP) and a head slice as one entry landing at
  ``h0 * head_bytes`` in the decode block (TP differs). Spans adjacent on both sides are coalesced.
* Different block size: the prefill rank packs each head piece into a staging region, regrouped
  into decode-sized blocks (``run_packs``, the Triton pack kernel), and the entries read from there.
  Write whole decode blocks only: a short last block goes with a zero tail, so a caller that splits
  one decode block over two calls (chunk boundaries not on decode block boundaries) overwrites the
  first call's tokens. Cut chunks at multiples of the larger block size.
* Different KV dtype (``--kv-cache-dtype``: float32/bf16/fp16 against int8 or fp8 e4m3 with
  scales), same block size: the prefill rank converts each head piece into staging in the
  decode's layout (``run_packs``, ``kvmesh.kernels.kv_pack.pack_converted``), and the entries read
  from there; an fp8 destination then takes a quarter of float32's bytes (half of bf16's), an
  int8 one 9/32 (its per-token scales included).
* Different dtype and block size together, an fp8 or int8 side with a different block size (a
  block's scales sit after its own tokens), different head_dim, layer count or total head count:
  refused (``KVLayoutError``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from kvmesh.kernels.kv_pack import pack_blocks, pack_converted, reshard_plan, staging_shape
from kvmesh.shared.kv.kv_cache import KVCacheSpec, KVPool
from kvmesh.shared.transport.base import MemoryRegion, WriteEntry
from kvmesh.shared.transport.errors import LocalAccessError


class KVLayoutError(ValueError):
    """The prefill and decode KV layouts cannot be bridged by a write plan."""


@dataclass(frozen=True, slots=True)
class KVDestination:
    """One destination (decode) rank's share of a write: its local KV layout (``spec.num_kv_heads``
    is the number of heads that rank holds), the rkey of its registered pool and, in token order,
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
) -> int:
    """Bytes of staging ``plan_kv_writes`` needs for ``num_blocks`` source blocks; 0 when the
    writes go straight from the pool."""
    dst_spec = _check_layouts(spec, destinations, src_rank, src_tp)
    if dst_spec.block_size == spec.block_size and dst_spec.dtype == spec.dtype:
        return 0
    m = _num_dst_blocks(spec, dst_spec, num_blocks)
    pieces = reshard_plan(spec.num_kv_heads * src_tp, src_tp, len(destinations))[src_rank]
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
    staging: MemoryRegion | None = None,
    staging_offset: int = 0,
) -> KVWritePlan:
    """The write entries that move ``block_ids`` of this source rank's ``pool`` (registered as
    ``pool_region``) to ``destinations[r]`` for every destination (decode) TP rank ``r``.

    Source rank ``src_rank`` of ``src_tp`` holds global heads ``[src_rank * h, (src_rank + 1) * h)``
    with ``h = pool.spec.num_kv_heads``; destination rank ``r`` likewise with its own spec. Source
    block ``i`` goes to destination block ``i`` (same block size) or the tokens of the source
    blocks, as one run, fill the destination blocks in order (different block size; then a
    ``staging`` region of ``staging_bytes(...)`` bytes from ``staging_offset`` is needed).
    """
    spec = pool.spec
    dst_spec = _check_layouts(spec, destinations, src_rank, src_tp)
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
    pieces = reshard_plan(spec.num_kv_heads * src_tp, src_tp, len(destinations))[src_rank]
    writes: list[list[WriteEntry]] = [[] for _ in destinations]
    if not ids:
        return KVWritePlan(tuple(tuple(w) for w in writes))

    if dst_spec.block_size == spec.block_size and dst_spec.dtype == spec.dtype:
        for piece in pieces:
            h0, h1 = piece.src_heads
            dst_offset = piece.dst_head_offset * dst_spec.head_bytes
            addrs = destinations[piece.dst_rank].block_addrs
            rkey = destinations[piece.dst_rank].rkey
            spans = []
            for block_id, addr in zip(ids, addrs, strict=True):
                offset, length = pool.head_span(block_id, h0, h1)
                spans.append((pool_offset + offset, addr + dst_offset, length))
            writes[piece.dst_rank] = _entries(pool_region, rkey, spans)
        return KVWritePlan(tuple(tuple(w) for w in writes))

    need = staging_bytes(spec, len(ids), destinations, src_rank=src_rank, src_tp=src_tp)
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


def _check_layouts(
    spec: KVCacheSpec, destinations: Sequence[KVDestination], src_rank: int, src_tp: int
) -> KVCacheSpec:
    """The destination ranks' common spec, once it is checked against the source's."""
    if src_tp <= 0 or not 0 <= src_rank < src_tp:
        raise ValueError(f"src_rank must be in [0, src_tp={src_tp}), got {src_rank}")
    if not destinations:
        raise ValueError("no destinations: pass one KVDestination per decode TP rank")
    dst_spec = destinations[0].spec
    for rank, dst in enumerate(destinations):
        if dst.spec != dst_spec:
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
    total_src, total_dst = spec.num_kv_heads * src_tp, dst_spec.num_kv_heads * len(destinations)
    if total_src != total_dst:
        raise KVLayoutError(
            f"prefill holds {total_src} KV heads ({spec.num_kv_heads} per rank x TP {src_tp}), "
            f"decode {total_dst} ({dst_spec.num_kv_heads} per rank x TP {len(destinations)}): "
            f"not the same model, or a destination TP rank is missing"
        )
    return dst_spec


def _num_dst_blocks(spec: KVCacheSpec, dst_spec: KVCacheSpec, num_src_blocks: int) -> int:
    return -(-num_src_blocks * spec.block_size // dst_spec.block_size)


def _entries(
    local: MemoryRegion, rkey: int, spans: Sequence[tuple[int, int, int]]
) -> list[WriteEntry]:
    """WriteEntries for ``(local_offset, remote_addr, length)`` spans, in order, merging a span
    into the previous one when both its local and remote sides continue it."""
    merged: list[list[int]] = []
    for local_offset, remote_addr, length in spans:
        if merged:
            last = merged[-1]
            if last[0] + last[2] == local_offset and last[1] + last[2] == remote_addr:
                last[2] += length
                continue
        merged.append([local_offset, remote_addr, length])
    return [WriteEntry(local, off, addr, rkey, length) for off, addr, length in merged]
