"""What of a prompt each candidate decode worker would not have to compute (pure).

A worker reaches a prompt's leading blocks two ways: its own prefix cache holds them (the
registry's ``PrefixIndex`` of decode workers, fed by their KV events), or the kv-store it reads
holds them (``StoreTable``, fed by the stores' KV events) and the worker reads them one-sided
into its pool before it prefills the rest itself (``DecodeReach.reads_kv_store``; the read is
``PrefixReader`` in shared/mesh/kv_store_prefix.py). It reads only the blocks its cache lacks, past
its own leading run, so what it reaches is ``max(own run, store run)`` leading blocks.

The score (``prefix_score``) weighs a block to read below a block already in the pool: both
save the block's prefill compute, but a read costs a NATS round trip to the store before the
request is queued, the block's bytes on the data plane and a free pool block at read time, and
it may come back short (the store evicted the block since its last report; the worker
computes it then). ``store_block_weight`` (0.5 by default) is that discount: a worker that can
read a prefix scores above one that can reach nothing of it, and below one that holds it.
Since every reader of a store gets the same term for it, the weight decides only between a
holder and a reader: with the defaults, a worker holding a 128-block prefix keeps requests
for it until it carries 16 requests more than an idle reader (at weight 1 the store term
would cancel out and load alone would decide; at 0 stores would not count at all, the
behaviour before stores were scored).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.services.kv_registry.prefix_index import PrefixIndex
from kvmesh.services.kv_registry.stores import StoreTable
from kvmesh.shared.bus.messages.workers import DecodeAdvert
from kvmesh.shared.kv.prefix_hash import request_root, reusable_prefix_hashes


@dataclass(frozen=True, slots=True)
class PrefixReach:
    """One worker's reach into a prompt: ``own`` is the hashes of the leading blocks its
    prefix cache holds; ``store_blocks`` the leading blocks the store of its layout holds
    (counted whether or not the worker reads it); ``reads_store``: it would read them."""

    own: tuple[int, ...] = ()
    store_blocks: int = 0
    reads_store: bool = False

    @property
    def read_blocks(self) -> int:
        """Blocks it would read from the store, past its own cached run."""
        return max(0, self.store_blocks - len(self.own)) if self.reads_store else 0

    @property
    def num_blocks(self) -> int:
        """Leading blocks of the prompt it need not compute."""
        return len(self.own) + self.read_blocks


def prefix_score(reach: PrefixReach, prefix_weight: float, store_block_weight: float) -> float:
    """The prefix part of a worker's placement score (module docstring)."""
    return prefix_weight * (len(reach.own) + store_block_weight * reach.read_blocks)


def prefix_reach(
    workers: Sequence[DecodeAdvert],
    prompt_ids: Sequence[int],
    cached: PrefixIndex,
    stores: StoreTable | None,
    *,
    use_cache: bool,
    use_stores: bool,
    cache_salt: str = "",
) -> dict[str, PrefixReach]:
    """Each worker's ``PrefixReach`` into the prompt. ``use_cache`` False: its own cache counts
    for nothing (prefix-aware placement off); ``use_stores`` False: it reads nothing. The chain
    depends on the worker's block size and KV layout, so it is hashed once per pair, from the
    request's ``cache_salt`` (a salted request reaches only blocks of its own salt)."""
    store_table = stores if stores is not None and stores.prefixes.workers else None
    chains: dict[tuple[int, str], list[int]] = {}
    reach = {}
    for w in workers:
        if not use_cache and store_table is None:
            reach[w.worker_id] = PrefixReach()
            continue
        key = (w.reach.block_size, w.reach.kv_spec)
        if key not in chains:
            root = request_root(w.reach.kv_spec, cache_salt)
            chains[key] = reusable_prefix_hashes(prompt_ids, w.reach.block_size, root)
        chain = chains[key]
        own = chain[: cached.matched_blocks(w.worker_id, chain)] if use_cache else []
        in_store = store_table.matched_blocks(w.reach.kv_spec, chain) if store_table else 0
        reads = use_cache and use_stores and w.reach.reads_kv_store and w.mode == "disagg"
        reach[w.worker_id] = PrefixReach(tuple(own), in_store, reads)
    return reach
