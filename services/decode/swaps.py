"""Swapping preempted sequences out to a kv-store and back (docs/kv_store.md, "Tiered offload").

When the scheduler preempts a sequence for lack of KV blocks, its blocks are freed at once (the
step that preempted needs them) but keep their hashes in the prefix cache until another
allocation takes them. Right after that step, under the same engine lock, the full blocks of the
victim still cached are pinned (one more reference each: neither evicted nor handed out) and put
into the store in the background; the put's write reads them from the pool, and they are
unpinned when it ends, whatever its outcome. The victim is held in the queue meanwhile.

When the held sequence is at the head of the queue and would be admitted (``Scheduler.fits``),
the worker decides its swap-in, between steps: the blocks still in its own prefix cache (or
still pinned by a put in flight) are local hits; those the store acknowledged (present or
committed, the leading run) but the pool lost are read back one-sided into fresh blocks
(``fetch_prefix``, as a prefill worker reads a prompt's prefix), verified and adopted into the
prefix cache; then the hold is released and the next step admits it with those hits. Only the
rest (blocks neither cached nor read, and the partial last block) is recomputed.

Ordering: nothing is freed before the put has read it, because the put reads only blocks it
pinned, and it pins only those still cached after the preempting step: a block that step handed
to another sequence has lost its hash and is simply not put. So a swap-out never delays the step
that needed the room, and what it misses (or a failed or refused put, or no store) is recomputed
on readmission, as without a store. Never is a request lost to a swap.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvmesh.services.decode.metrics import DecodeMetrics
from kvmesh.services.decode.step_hooks import Step, StepHook
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.engine.sequence import Sequence
from kvmesh.shared.mesh.kv_store_client import KvStoreClient, PutResult, StoreTarget
from kvmesh.shared.mesh.kv_store_prefix import PoolIo, adopt_fetched, fetch_prefix
from kvmesh.shared.mesh.kv_store_writer import PinnedPrefix, pin_cached_prefix, put_pinned
from kvmesh.shared.mesh.store_book import StoreBook
from kvmesh.shared.obs import logs

if TYPE_CHECKING:
    from kvmesh.services.decode.compose import DecodeParts

log = logs.get_logger(__name__)


# --- the pure part: what was swapped out, what a swap-in reads and counts ----------------------


def stored_run(hashes: list[int], present: Iterable[int], committed: Iterable[int]) -> int:
    """How many leading ``hashes`` the store holds after a put (present before it, or committed
    by it): a block is of use on readmission only with every block before it."""
    held = set(present) | set(committed)
    n = 0
    while n < len(hashes) and hashes[n] in held:
        n += 1
    return n


@dataclass(slots=True)
class SwapOut:
    """A preempted sequence whose full blocks (``hashes``, the leading run still cached after the
    preempting step) were pinned and offered to ``store_id``. ``num_stored`` is None while the put
    is in flight (the blocks are pinned: local hits), then the leading blocks the store holds."""

    request_id: str
    store_id: str
    hashes: list[int]
    num_stored: int | None = None


@dataclass(frozen=True, slots=True)
class SwapIn:
    """How a swapped-out sequence's swapped blocks came back on readmission, in tokens."""

    num_cached_tokens: int  # still in the worker's own prefix cache (or pinned by its put)
    num_read_tokens: int  # read back from the store and verified
    num_recomputed_tokens: int  # neither: the engine computes them again

    @classmethod
    def of(cls, num_blocks: int, num_cached: int, num_read: int, block_size: int) -> SwapIn:
        """``num_blocks`` swapped out, the leading ``num_cached`` found locally and the next
        ``num_read`` read from the store."""
        num_cached = max(0, min(num_cached, num_blocks))
        num_read = min(num_read, num_blocks - num_cached)
        return cls(
            num_cached * block_size,
            num_read * block_size,
            (num_blocks - num_cached - num_read) * block_size,
        )


# --- the shell: puts, holds and reads around the engine ---------------------------------------


class Swaps(StepHook):
    """The decode worker's swaps, a step hook (``step_hooks.py``): ``after_step`` swaps out
    what a step preempted and ``between_steps`` plans the queue head's swap-in, both under the
    engine lock (the worker holds it); ``swap_in`` takes ``lock`` itself, never across I/O."""

    def __init__(
        self,
        engine: LLMEngine,
        client: KvStoreClient,
        stores: StoreBook,
        kv_spec: str,
        metrics: DecodeMetrics,
        lock: asyncio.Lock,
    ) -> None:
        self.engine = engine
        self.lock = lock  # the engine's: swap-outs unpin and swap-ins adopt under it
        self.io = PoolIo.of(client, kv_spec, engine)
        self.stores = stores  # shared with the finished requests' puts
        self.metrics = metrics
        self.block_size = engine.kv_pool.spec.block_size
        self.swapped: dict[str, SwapOut] = {}
        self._puts: set[asyncio.Task[None]] = set()

    @classmethod
    def compose(cls, parts: DecodeParts) -> Swaps | None:
        link = parts.store_link()
        if link is None:
            return None
        return cls(parts.engine, link.client, link.stores, link.kv_spec, parts.metrics, parts.lock)

    def after_step(self, engine: LLMEngine, step: Step) -> None:
        if engine.scheduler.preempted:
            self.swap_out_preempted()

    def between_steps(self, engine: LLMEngine) -> Coroutine[Any, Any, None] | None:
        plan = self.plan_swap_in()
        return self.swap_in(*plan) if plan is not None else None

    def swap_out_preempted(self) -> None:
        """Under the lock, right after a step: pin and put what the step's preemptions left
        cached, and hold those sequences in the queue until their swap-in."""
        store = self.stores.target()
        if store is None:
            return  # no store: preempted sequences are recomputed
        sched, bm = self.engine.scheduler, self.engine.block_manager
        for seq in sched.preempted:
            if len(seq) < 2:
                continue
            # every token but the last sampled one may have KV (pinning stops at the first
            # block that has none, or that the step handed to another sequence)
            pinned = pin_cached_prefix(
                bm, self.block_size, seq.token_ids[:-1], seq.params.cache_salt
            )
            if pinned is None:
                continue
            swap = SwapOut(seq.request_id, store.store_id, pinned.hashes)
            self.swapped[seq.request_id] = swap
            sched.hold(seq)
            task = asyncio.ensure_future(self._put(store, swap, pinned))
            self._puts.add(task)
            task.add_done_callback(self._puts.discard)

    async def _put(self, store: StoreTarget, swap: SwapOut, pinned: PinnedPrefix) -> None:
        result: PutResult | None = None
        try:
            result = await put_pinned(self.io, store, pinned, self.lock)
        except Exception as exc:  # recomputed on readmission
            log.warning("kv-store swap-out failed", request_id=swap.request_id, error=str(exc))
            self.stores.forget(store.store_id)
        if result is not None and not result.ok:
            log.info("kv-store swap-out refused", request_id=swap.request_id, error=result.error)
        swap.num_stored = (
            stored_run(swap.hashes, result.present, result.committed)
            if result is not None and result.ok
            else 0
        )
        if swap.num_stored:
            self.metrics.swap_outs.inc()
        else:
            self.metrics.swap_out_failures.inc()

    def plan_swap_in(self) -> tuple[Sequence, SwapOut] | None:
        """Under the lock, between steps: forget the swaps of sequences that ended; release the
        hold of the queue's head if nothing needs reading (counted now), or return it with its
        swap when its blocks are to be read back (``swap_in``)."""
        engine = self.engine
        for rid in [r for r in self.swapped if r not in engine.seqs]:
            del self.swapped[rid]  # aborted while swapped out
        sched = engine.scheduler
        if not sched.waiting:
            return None
        # only the head: admission goes in queue order, and fits() speaks for the head alone (a
        # held sequence behind it is decided once it is the head, an admit() later)
        seq = sched.waiting[0]
        swap = self.swapped.get(seq.request_id)
        if swap is None or not sched.is_held(seq.request_id) or not sched.fits(seq):
            return None
        num_cached = engine.block_manager.num_cached(swap.hashes)
        if swap.num_stored is not None and num_cached < swap.num_stored:
            return seq, swap
        self._readmit(seq, swap, num_cached, 0)  # nothing to read: cached, pinned or lost
        return None

    async def swap_in(self, seq: Sequence, swap: SwapOut) -> None:
        """Read the blocks of ``swap`` the pool lost back from its store (without the lock), adopt
        the good ones into the prefix cache and release the hold (under it)."""
        engine = self.engine
        num_stored = swap.num_stored or 0
        store = self.stores.target()
        fetched = None
        if store is not None and store.store_id == swap.store_id:
            fetched = await fetch_prefix(
                self.io,
                store,
                seq.token_ids,
                self.lock,
                max_blocks=num_stored,
                cache_salt=seq.params.cache_salt,
            )
            if fetched is not None and fetched.failed:
                self.stores.forget(store.store_id)
        async with self.lock:
            num_read = 0
            if fetched is not None:
                num_read = adopt_fetched(engine.block_manager, fetched) // self.block_size
            if engine.seqs.get(seq.request_id) is seq:  # not aborted meanwhile
                num_cached = engine.block_manager.num_cached(swap.hashes) - num_read
                self._readmit(seq, swap, num_cached, num_read)

    def _readmit(self, seq: Sequence, swap: SwapOut, num_cached: int, num_read: int) -> None:
        self.swapped.pop(seq.request_id, None)
        self.engine.scheduler.unhold(seq.request_id)
        swap_in = SwapIn.of(len(swap.hashes), num_cached, num_read, self.block_size)
        self.metrics.observe_swap_in(
            swap_in.num_cached_tokens, swap_in.num_read_tokens, swap_in.num_recomputed_tokens
        )

    async def aclose(self) -> None:
        """Wait for the swap-outs in flight (they pin pool blocks)."""
        if self._puts:
            await asyncio.gather(*self._puts, return_exceptions=True)
