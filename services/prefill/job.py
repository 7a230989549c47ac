"""A prefill job in hand: what the prefill worker keeps of it while its chunks compute and their
KV is written (a hook keeps its own state of the job: job_hooks.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from kvmesh.services.prefill.convert import KVMirror
from kvmesh.services.prefill.plan import ChunkPlanner, PrefillTimeline
from kvmesh.shared.bus.messages.prefill_jobs import PrefillJob
from kvmesh.shared.engine.sequence import ChunkReady
from kvmesh.shared.text.sampling import TokenLogprobs
from kvmesh.shared.transport import Endpoint, TransportDescriptor

STOP = None  # queue marker: the job was aborted or failed; no more chunks come


@dataclass(frozen=True, slots=True)
class RankTarget:
    """A tensor-parallel decode worker's rank past rank 0 that this worker writes heads of each
    chunk into: its planner (this worker's ``RankSlice`` of it), endpoint and window key."""

    planner: ChunkPlanner
    endpoint: Endpoint
    rkey: int
    descriptor: TransportDescriptor


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
    # decode ranks past 0 written too (a TP decode worker); ``planner``/``endpoint``: rank 0's
    others: tuple[RankTarget, ...] = ()
