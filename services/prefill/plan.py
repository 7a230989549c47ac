"""What a prefill writes where, and where its time went. Pure and synchronous.

``ChunkPlanner`` turns each ``ChunkReady`` of the engine (local block ids of the chunk's blocks)
into one batched write: scatter-gather spans from the local KV pool to the decode worker's
reserved blocks, runs of adjacent blocks merged into one span, tagged with the immediate
``(slot, chunk)``. Whole blocks by default; under tensor parallelism (``rank_slice``, from
``kv_writes.rank_block_slices``) a rank's head slice of each block into one decode rank's blocks,
tagged ``(slot, chunk * num_writers + writer)`` so that the decode rank counts every prefill
rank's write of a chunk (``num_writes`` announces them all). ``PrefillTimeline`` accounts the time: queue, compute (forward passes), transfer
(write durations) and the part of the transfer that compute did not hide.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvmesh.services.prefill.block_spans import block_slice_spans
from kvmesh.services.prefill.kv_writes import RankSlice
from kvmesh.shared.kv.imm import imm_slot, pack_imm


class PlanError(ValueError):
    """A prefill job this worker cannot carry out as given (the message says why)."""


class KVSpecMismatchError(PlanError):
    """Prefill and decode lay out KV differently; blocks cannot be copied between them."""


@dataclass(frozen=True, slots=True)
class WriteSpan:
    """``length`` bytes from ``local_offset`` of the local KV pool to ``remote_addr``."""

    local_offset: int
    remote_addr: int
    length: int


@dataclass(frozen=True, slots=True)
class ChunkWrite:
    chunk_index: int
    imm: int
    spans: tuple[WriteSpan, ...]
    is_last: bool

    @property
    def num_bytes(self) -> int:
        return sum(s.length for s in self.spans)


class ChunkPlanner:
    """The writes of one request: prompt block ``i`` goes to ``block_addrs[i]`` on the decode.

    ``rank_slice``: what of every block this TP rank writes, as which of the decode rank's
    writers (``kv_writes.rank_block_slices``); None: whole blocks, of one size both sides, one
    writer."""

    def __init__(
        self,
        num_prompt_tokens: int,
        block_size: int,
        block_bytes: int,
        remote_block_addrs: tuple[int, ...],
        remote_block_bytes: int,
        rank_slice: RankSlice | None = None,
    ) -> None:
        block_slice = None if rank_slice is None else rank_slice.block_slice
        if block_slice is None and remote_block_bytes != block_bytes:
            raise KVSpecMismatchError(
                f"the decode worker's KV blocks are {remote_block_bytes} bytes, this prefill "
                f"worker's are {block_bytes}: run both with the same model, dtype and block size"
            )
        if block_slice is not None and block_slice[1] + block_slice[2] > remote_block_bytes:
            raise KVSpecMismatchError(
                f"this rank's head slice (bytes {block_slice[1]}..{sum(block_slice[1:])} of a "
                f"decode block) does not fit the decode rank's {remote_block_bytes}-byte blocks: "
                f"run both with the same model, dtype and block size"
            )
        num_blocks = math.ceil(num_prompt_tokens / block_size)
        if len(remote_block_addrs) != num_blocks:
            raise PlanError(
                f"the prompt has {num_prompt_tokens} tokens ({num_blocks} blocks of {block_size}) "
                f"but {len(remote_block_addrs)} decode blocks were reserved"
            )
        self.num_prompt_tokens = num_prompt_tokens
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.remote_block_addrs = remote_block_addrs
        self.rank_slice = rank_slice or RankSlice(0, (0, 0, block_bytes))
        self.slot = imm_slot(remote_block_addrs[0], remote_block_bytes)
        self.num_blocks_planned = 0
        self.num_chunks_planned = 0

    def plan(
        self, chunk_index: int, end_token: int, local_block_ids: tuple[int, ...], is_last: bool
    ) -> ChunkWrite:
        """The write for one chunk; chunks must come in order, as the engine reports them."""
        if chunk_index != self.num_chunks_planned:
            raise PlanError(f"chunk {chunk_index} reported, expected {self.num_chunks_planned}")
        first = self.num_blocks_planned
        end_block = (
            math.ceil(end_token / self.block_size) if is_last else end_token // self.block_size
        )
        if first + len(local_block_ids) != end_block or end_block > len(self.remote_block_addrs):
            raise PlanError(
                f"chunk {chunk_index} up to token {end_token} brings {len(local_block_ids)} "
                f"blocks after {first}; expected {end_block - first}"
            )
        if is_last and end_token != self.num_prompt_tokens:
            raise PlanError(
                f"last chunk ends at token {end_token}, prompt has {self.num_prompt_tokens}"
            )
        remote = self.remote_block_addrs[first : first + len(local_block_ids)]
        spans = tuple(
            WriteSpan(*span)
            for span in block_slice_spans(
                local_block_ids, remote, self.block_bytes, *self.rank_slice.block_slice
            )
        )
        self.num_blocks_planned = end_block
        self.num_chunks_planned += 1
        r = self.rank_slice
        imm = pack_imm(self.slot, chunk_index * r.num_writers + r.writer)
        return ChunkWrite(chunk_index, imm, spans, is_last)

    @property
    def num_writes(self) -> int:
        """The writes the decode counts for the chunks planned so far, from every writer."""
        return self.num_chunks_planned * self.rank_slice.num_writers


@dataclass(frozen=True, slots=True)
class PrefillTiming:
    queue_s: float
    compute_s: float
    transfer_s: float
    exposed_transfer_s: float
    num_chunks: int


class PrefillTimeline:
    """Time accounting for one request (clock values in seconds, one clock throughout).

    ``exposed_transfer_s`` is the time from the end of the last forward pass until the last write
    completed: the transfer the compute did not hide. With perfect overlap it is the duration of
    the last chunk's write alone."""

    def __init__(self, enqueued_at: float, started_at: float) -> None:
        self.queue_s = max(0.0, started_at - enqueued_at)
        self.compute_s = 0.0
        self.transfer_s = 0.0
        self.num_chunks = 0
        self.compute_done_at: float | None = None
        self.writes_done_at: float | None = None

    def on_forward(self, duration_s: float) -> None:
        self.compute_s += duration_s
        self.num_chunks += 1

    def on_compute_done(self, at: float) -> None:
        self.compute_done_at = at

    def on_write(self, started_at: float, finished_at: float) -> None:
        self.transfer_s += finished_at - started_at
        self.writes_done_at = max(self.writes_done_at or finished_at, finished_at)

    def timing(self) -> PrefillTiming:
        exposed = 0.0
        if self.compute_done_at is not None and self.writes_done_at is not None:
            exposed = max(0.0, self.writes_done_at - self.compute_done_at)
        return PrefillTiming(
            self.queue_s, self.compute_s, self.transfer_s, exposed, self.num_chunks
        )
