"""What a prefill worker writes of a prompt's draft KV into a draft worker's reserved blocks
(docs/speculative.md, Prompt KV through the data plane). Pure and synchronous.

Early exit (``DraftKvPlanner``): the draft runs the target's first N layers, so its KV of a
prompt is the first N layers of the target's. A block is head-major, ``(H_kv, L, 2,
block_size, D)``: within each KV head the layers follow each other, so the first N layers of a
head are one contiguous span of ``N * 2 * block_size * D`` elements at the head's start, and
the draft's block is the same shape with ``L = N``. fp8 and int8 pools are refused where the
reservation is made: their per-layer scales sit after every layer's data, so a head's first
layers are not one span.

Model (``DraftBlockPlanner``): the prefill worker runs the draft checkpoint in an engine of its
own, whose blocks have the draft worker's layout, so each of the draft engine's full prompt
blocks is written whole.

Either planner turns each chunk's local blocks into one batched write (the prompt's full
blocks only, those the draft worker reserved), tagged with the immediate ``(slot, write
index)``; chunks without a full block to write make no write.
"""

from __future__ import annotations

from kvmesh.services.prefill.plan import ChunkWrite, PlanError, WriteSpan
from kvmesh.shared.bus.messages.drafts import DraftKvReserveReply
from kvmesh.shared.kv.imm import imm_slot, pack_imm


class _ReservedBlocksPlanner:
    """What both planners share: the reply's blocks, one per full prompt block, each chunk's
    blocks in order, a write per chunk with a reserved block in it."""

    def __init__(self, reply: DraftKvReserveReply, num_prompt_tokens: int, block_size: int) -> None:
        if not reply.ok or not reply.block_addrs:
            raise PlanError(f"no draft blocks reserved: {reply.error or 'empty reply'}")
        if len(reply.block_addrs) != num_prompt_tokens // block_size:
            raise PlanError(
                f"{len(reply.block_addrs)} draft blocks reserved for a prompt of "
                f"{num_prompt_tokens // block_size} full blocks"
            )
        self.remote_block_addrs = reply.block_addrs
        self.slot = imm_slot(reply.block_addrs[0], reply.block_bytes)
        self.num_blocks_seen = 0
        self.num_writes_planned = 0

    @property
    def is_complete(self) -> bool:
        """Every reserved block has been planned (the prompt's chunks up to its last full
        block came)."""
        return self.num_blocks_seen >= len(self.remote_block_addrs)

    def _spans(self, block_id: int, remote: int) -> list[WriteSpan]:
        """The spans of local block ``block_id`` written into the reserved block at ``remote``."""
        raise NotImplementedError

    def plan(self, local_block_ids: tuple[int, ...]) -> ChunkWrite | None:
        """The write of one chunk's blocks (the chunk's local block ids, in order, as the engine
        reports them; chunks in order); None when none of them is a reserved full block."""
        first = self.num_blocks_seen
        self.num_blocks_seen += len(local_block_ids)
        spans = [
            span
            for i, block_id in enumerate(local_block_ids, first)
            if i < len(self.remote_block_addrs)  # past it: the partial last block
            for span in self._spans(block_id, self.remote_block_addrs[i])
        ]
        if not spans:
            return None
        index = self.num_writes_planned
        self.num_writes_planned += 1
        return ChunkWrite(index, pack_imm(self.slot, index), tuple(spans), is_last=False)


class DraftKvPlanner(_ReservedBlocksPlanner):
    """The draft writes of one request: prompt block ``i`` (the first N layers of each of its
    heads) goes to ``reply.block_addrs[i]``."""

    def __init__(
        self,
        reply: DraftKvReserveReply,
        num_prompt_tokens: int,
        block_size: int,
        num_layers: int,
        num_kv_heads: int,
        block_bytes: int,
    ) -> None:
        """``num_layers``, ``num_kv_heads``, ``block_bytes``: this worker's (the target's) KV
        blocks, float pools only. Raises PlanError when the reply does not fit them."""
        super().__init__(reply, num_prompt_tokens, block_size)
        if reply.whole_blocks:
            raise PlanError("the reservation is for a draft model's whole blocks")
        if not 1 <= reply.num_layers < num_layers:
            raise PlanError(
                f"the draft worker runs {reply.num_layers} layers; an early-exit draft of this "
                f"{num_layers}-layer model runs 1 to {num_layers - 1}"
            )
        self.head_bytes = block_bytes // num_kv_heads
        self.draft_head_bytes = self.head_bytes // num_layers * reply.num_layers
        if reply.block_bytes != num_kv_heads * self.draft_head_bytes:
            raise PlanError(
                f"the draft worker's blocks are {reply.block_bytes} bytes; {reply.num_layers} of "
                f"this worker's layers make {num_kv_heads * self.draft_head_bytes}"
            )
        self.block_bytes = block_bytes
        self.num_kv_heads = num_kv_heads

    def _spans(self, block_id: int, remote: int) -> list[WriteSpan]:
        return [
            WriteSpan(
                block_id * self.block_bytes + h * self.head_bytes,
                remote + h * self.draft_head_bytes,
                self.draft_head_bytes,
            )
            for h in range(self.num_kv_heads)
        ]


class DraftBlockPlanner(_ReservedBlocksPlanner):
    """The whole-block draft writes of one request (a model draft worker's reservation):
    prompt block ``i`` of the prefill's draft engine goes whole to ``reply.block_addrs[i]``."""

    def __init__(
        self, reply: DraftKvReserveReply, num_prompt_tokens: int, block_size: int, block_bytes: int
    ) -> None:
        """``block_bytes``: the blocks of this worker's draft engine. Raises PlanError when the
        reply does not fit them."""
        super().__init__(reply, num_prompt_tokens, block_size)
        if not reply.whole_blocks:
            raise PlanError("the reservation is for an early exit's first layers, not blocks")
        if reply.block_bytes != block_bytes:
            raise PlanError(
                f"the draft worker's blocks are {reply.block_bytes} bytes; this worker's draft "
                f"model's are {block_bytes}"
            )
        self.block_bytes = block_bytes

    def _spans(self, block_id: int, remote: int) -> list[WriteSpan]:
        return [WriteSpan(block_id * self.block_bytes, remote, self.block_bytes)]
