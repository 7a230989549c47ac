"""A draft worker's receiving side of prompt KV (docs/speculative.md, Prompt KV through the data
plane), early exit or model: reserves draft-pool blocks for a prefill worker, opens a write
window over exactly them, counts the writes that land and adopts the blocks into the draft
engine's prefix cache once the prefill says it is done. An early exit takes the first layers of
the prefill's target blocks (``kv_spec``: its target's layout); a model drafter takes whole
blocks of the draft model the prefill runs beside its target (``kv_spec``: its own layout,
``whole_blocks``). The leases themselves are PromptKvTable's (pure);
this shell owns the engine's block manager only under ``lock``, the lock the drafting loop
holds while the drafter runs the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, InitVar, dataclass
from typing import Any

from kvmesh.services.draft.metrics import DraftMetrics
from kvmesh.services.draft.prompt_kv import PromptKvError, PromptKvTable, PromptKvVerdict
from kvmesh.shared.bus.messages.drafts import DraftKvReserve, DraftKvReserveReply
from kvmesh.shared.bus.messages.prefill_jobs import PrefillDone
from kvmesh.shared.kv.imm import imm_slot, unpack_imm
from kvmesh.shared.kv.prefix_hash import prefix_block_hashes
from kvmesh.shared.model.identity import kv_spec_fingerprint
from kvmesh.shared.obs import logs
from kvmesh.shared.transport import Access, Completion, MemoryRegion, Transport

log = logs.get_logger(__name__)

MAX_LEASE_S = 60.0  # nobody holds draft blocks longer than this unannounced


def pool_bytes(model: Any, econf: Any) -> int:
    """Bytes of the KV pool LLMEngine makes for ``model`` under EngineConfig ``econf`` (to
    allocate it in transport memory first)."""
    mc = model.config
    from kvmesh.shared.model.quant_layers import keeps_weights_stored

    dtype = getattr(mc, "torch_dtype", None) or next(model.parameters()).dtype
    spec = econf.pool_spec(mc, dtype, weights_stored=keeps_weights_stored(model))
    return econf.resolve_num_blocks(spec.block_bytes) * spec.block_bytes


def target_kv_spec(engine: Any, target_num_layers: int) -> str:
    """The KV layout fingerprint of the early-exit draft's target: the draft's own pool and
    model config with the target's layer count (truncate_layers changed only that)."""
    spec = dataclasses.replace(engine.kv_pool.spec, num_layers=target_num_layers)
    mc = dataclasses.replace(engine.model.config, num_hidden_layers=target_num_layers)
    return kv_spec_fingerprint(spec, mc)


@dataclass(eq=False)
class PromptKvReceiver:
    engine: Any
    transport: Transport
    region: MemoryRegion
    lock: asyncio.Lock
    _: KW_ONLY
    worker_id: str
    # the layout a reservation must offer: the target's (early exit, DraftKvReserve.kv_spec)
    # or, with whole_blocks, this draft model's own (DraftKvReserve.draft_kv_spec)
    kv_spec: str
    metrics: DraftMetrics
    whole_blocks: bool = False
    quarantine_s: InitVar[float] = 30.0
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self, quarantine_s: float) -> None:
        self.table = PromptKvTable(quarantine_s)
        self.block_bytes = self.engine.kv_pool.spec.block_bytes
        self.block_size = self.engine.kv_pool.spec.block_size
        self.descriptor = self.transport.descriptor().public()

    def _refuse(self, error: str) -> DraftKvReserveReply:
        self.metrics.prompt_kv_refused.inc()
        return DraftKvReserveReply(False, self.worker_id, error=error)

    async def reserve(self, req: DraftKvReserve) -> DraftKvReserveReply:
        """Blocks for the prompt's full blocks, under a window and a lease (or why not)."""
        error = self._layout_error(req)
        if error:
            return self._refuse(error)
        bs = self.block_size
        num_full = len(req.prompt_ids) // bs
        if num_full < 1:
            return self._refuse(f"a prompt of {len(req.prompt_ids)} tokens has no full block")
        bm = self.engine.block_manager
        async with self.lock:
            if req.request_id in self.table:
                return self._refuse(f"request {req.request_id!r} already holds draft blocks")
            # a quarter of the pool stays for drafting (reserved blocks cannot be evicted)
            if bm.num_free_blocks - num_full < bm.num_total_blocks // 4:
                return self._refuse(f"draft worker {self.worker_id} is short of KV blocks")
            block_ids = bm.allocate_blocks(num_full)
            base = self.region.addr
            spans = [(base + b * self.block_bytes, self.block_bytes) for b in block_ids]
            try:
                window = self.transport.open_window(self.region, spans, Access.REMOTE_WRITE)
            except ValueError as exc:  # the transport's table of windows is full
                bm.free_blocks(block_ids)
                return self._refuse(f"cannot open a write window: {exc}")
            slot = imm_slot(spans[0][0], self.block_bytes)
            lease_s = min(req.lease_ms / 1000, MAX_LEASE_S)
            try:
                self.table.add(
                    req.request_id,
                    req.lease_id,
                    slot,
                    tuple(block_ids),
                    self.clock() + lease_s,
                    window,
                    token_ids=tuple(req.prompt_ids[: num_full * bs]),
                )
            except PromptKvError as exc:
                self.transport.close_window(window)
                bm.free_blocks(block_ids)
                return self._refuse(str(exc))
        return DraftKvReserveReply(
            True,
            self.worker_id,
            descriptor=self.descriptor,
            rkey=window.rkey,
            block_addrs=tuple(a for a, _ in spans),
            block_bytes=self.block_bytes,
            num_layers=self.engine.kv_pool.spec.num_layers,
            whole_blocks=self.whole_blocks,
        )

    def _layout_error(self, req: DraftKvReserve) -> str:
        """Why the KV the prefill offers is not what this worker's pool holds ("": it is)."""
        if self.whole_blocks:
            if not req.draft_kv_spec:
                return (
                    "the prefill worker runs no draft model: start it with --draft-kv "
                    "--draft-model (this worker's checkpoint)"
                )
            if req.draft_kv_spec != self.kv_spec:
                return (
                    f"the prefill's draft KV layout {req.draft_kv_spec} is not this draft "
                    f"model's {self.kv_spec}: run both on the same --draft-model, dtype and "
                    "block size"
                )
            return ""
        if req.kv_spec != self.kv_spec:
            return (
                f"the prefill's KV layout {req.kv_spec} is not this draft's target's "
                f"{self.kv_spec}: run both on the same model, dtype and block size"
            )
        if self.engine.kv_pool.spec.is_quantized:
            return "fp8 and int8 KV caches do not split by layer: no prompt KV transfer"
        return ""

    async def on_completion(self, completion: Completion) -> None:
        slot, write = unpack_imm(completion.imm)
        verdict = self.table.on_immediate(slot, write, completion.keys)
        if verdict is not None:
            await self._apply(verdict)

    async def on_done(self, done: PrefillDone) -> None:
        verdict = self.table.on_done(done)
        if verdict is not None:
            await self._apply(verdict)

    async def expire(self) -> None:
        for verdict in self.table.expire(self.clock()):
            await self._apply(verdict)

    async def _apply(self, verdict: PromptKvVerdict) -> None:
        """Close the lease's window; adopt its blocks (ready) and free them (cached), or free
        them (failed; unless quarantined)."""
        lease = verdict.lease
        if lease.window is not None:
            self.transport.close_window(lease.window)  # closing twice is harmless
        if not verdict.ok:
            if not (lease.is_expired and verdict.release):  # a quarantine's end: counted before
                self.metrics.prompt_kv_refused.inc()
            log.info("prompt kv not taken", request_id=lease.request_id, error=verdict.error)
            if not verdict.release:
                return
        bm = self.engine.block_manager
        async with self.lock:
            if verdict.ok:
                bs = self.block_size
                tokens = lease.token_ids
                hashes = prefix_block_hashes(tokens, bs, bm.root_hash)
                blocks = [tokens[i * bs : (i + 1) * bs] for i in range(len(lease.block_ids))]
                bm.adopt(list(lease.block_ids), hashes, blocks)
                self.metrics.prompt_tokens_received.inc(len(tokens))
            bm.free_blocks(list(lease.block_ids))

    async def expiry_loop(self, interval_s: float = 0.5) -> None:
        """Expire leases every ``interval_s`` (a task body)."""
        while True:
            await asyncio.sleep(interval_s)
            await self.expire()

    async def completion_loop(self) -> None:
        """Count the writes that land (a task body)."""
        async for completion in self.transport.completions():
            await self.on_completion(completion)
