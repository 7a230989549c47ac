"""A prefill job in hand: what the prefill worker keeps of it while its chunks compute and their
KV is written, and its draft KV's writes (to a draft worker, best effort)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from kvmesh.services.prefill.convert import KVMirror
from kvmesh.services.prefill.draft_kv import DraftBlockPlanner, DraftKvPlanner
from kvmesh.services.prefill.plan import ChunkPlanner, PrefillTimeline
from kvmesh.shared.bus.protocol import DraftKvReserveReply, PrefillJob
from kvmesh.shared.engine.sequence import ChunkReady
from kvmesh.shared.text.sampling import TokenLogprobs
from kvmesh.shared.transport import Endpoint, MemoryRegion

STOP = None  # queue marker: the job was aborted or failed; no more chunks come


@dataclass(eq=False)
class Job:
    msg: PrefillJob
    planner: ChunkPlanner
    timeline: PrefillTimeline
    endpoint: Endpoint
    mirror: KVMirror | None = None  # the decode's KV dtype differs: written from this mirror
    chunks: asyncio.Queue[ChunkReady | None] = field(default_factory=asyncio.Queue)
    num_writes: int = 0
    first_token: int = -1
    first_logprobs: TokenLogprobs | None = None  # with SamplingOptions.logprobs
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # with SamplingOptions.prompt_logprobs
    error: str = ""
    is_computed: bool = False  # the last chunk is in; the engine holds the blocks until release
    draft: DraftWrites | None = None  # the prompt's draft KV to a draft worker
    # the draft engine's chunks of the prompt (with a draft model; None: not run for this job)
    draft_chunks: asyncio.Queue[ChunkReady | None] | None = None


@dataclass(eq=False)
class DraftWrites:
    """A job's writes of draft KV (docs/speculative.md): best effort, never the job's failure."""

    reply: DraftKvReserveReply
    # None: the reply did not fit (``error`` says why)
    planner: DraftKvPlanner | DraftBlockPlanner | None = None
    region: MemoryRegion | None = None  # written from: the target's pool or the draft engine's
    endpoint: Endpoint | None = None
    num_writes: int = 0
    error: str = ""

    @property
    def is_complete(self) -> bool:
        """Every planned write landed: the draft worker holds the prompt's full blocks."""
        return (
            self.planner is not None
            and self.planner.is_complete
            and not self.error
            and self.num_writes == self.planner.num_writes_planned
        )
