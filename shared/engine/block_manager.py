"""Block allocation for the paged KV cache: free list, reference counts, prefix reuse.

A block whose ``block_size`` tokens all have their K/V computed gets a chained hash
``h = H(parent_hash, token ids of the block)`` and enters the prefix cache. When its last user
frees it, it goes to the back of the free list still carrying its hash, so a later prompt with
the same prefix can take it back; allocating a fresh block evicts from the front (least recently
freed, uncached blocks first). Blocks reserved with ``allocate_blocks`` for a remote writer are
plain owned blocks; ``free_blocks`` returns them.

The hash chain is shared/kv/prefix_hash.py's, started from ``root_hash`` (the KV layout's root), so
the kv-registry computes the same names. ``events``, when its owner sets a CacheEventLog, hears
every hash that enters or leaves the cache (the decode worker publishes them).
"""

from __future__ import annotations

from collections import OrderedDict

from kvmesh.shared.engine.cache_events import CacheEventLog
from kvmesh.shared.engine.sequence import Sequence
from kvmesh.shared.kv.prefix_hash import block_hash, salted_root

__all__ = ["Block", "BlockManager", "OutOfBlocksError", "block_hash"]


class OutOfBlocksError(RuntimeError):
    """More KV blocks were asked for than are free."""


class Block:
    __slots__ = ("block_id", "hash", "ref_count", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        root_hash: int = 0,
    ) -> None:
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.root_hash = root_hash  # parent of every chain's first block (prefix_hash.layout_root)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.events: CacheEventLog | None = None  # set by an owner that publishes cache changes
        self.num_hit_tokens = 0  # prompt tokens taken from the prefix cache by allocate()

    @property
    def num_total_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- raw blocks -------------------------------------------------------------------------

    def _take_free(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if block.hash is not None:  # evict from the prefix cache
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
                if self.events is not None:
                    self.events.on_removed(block.hash)
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} freed twice"
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None
            if block.hash is None:  # nothing worth keeping: hand it out first
                self.free.move_to_end(block_id, last=False)

    def allocate_blocks(self, num_blocks: int) -> list[int]:
        """Reserve ``num_blocks`` fresh blocks (e.g. for a remote writer); ref count 1 each."""
        if num_blocks > len(self.free):
            raise OutOfBlocksError(f"asked for {num_blocks} KV blocks, {len(self.free)} are free")
        return [self._take_free() for _ in range(num_blocks)]

    def share(self, block_ids: list[int]) -> None:
        """One more reference to each block in use (a forked choice reads them too)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} is not in use"
            block.ref_count += 1

    def free_blocks(self, block_ids: list[int]) -> None:
        """Drop one reference to each block (reverse order keeps a chain's tail evicted first)."""
        for block_id in reversed(block_ids):
            self._release(block_id)

    # ---- blocks from and to a KV store (docs/kv_store.md) -------------------------------------

    def num_cached(self, hashes: list[int]) -> int:
        """How many leading ``hashes`` the prefix cache holds (tokens are checked on use)."""
        n = 0
        while n < len(hashes) and hashes[n] in self.hash_to_block:
            n += 1
        return n

    def adopt(self, block_ids: list[int], hashes: list[int], tokens: list[tuple[int, ...]]) -> int:
        """Enter blocks whose KV was placed from outside (read from a KV store into blocks from
        ``allocate_blocks``) into the prefix cache under their chain hashes; the caller still
        frees them, after which they stay cached until evicted, as computed blocks do. A hash
        cached already is left as it is. Returns how many blocks were entered."""
        if not self.enable_prefix_caching:
            return 0
        entered = 0
        for block_id, h, toks in zip(block_ids, hashes, tokens, strict=True):
            block = self.blocks[block_id]
            assert block.ref_count > 0 and block.hash is None, block_id
            assert len(toks) == self.block_size, len(toks)
            if h in self.hash_to_block:
                continue
            block.hash, block.token_ids = h, tuple(toks)
            self.hash_to_block[h] = block_id
            if self.events is not None:
                self.events.on_stored(h)
            entered += 1
        return entered

    def pin_cached(self, hashes: list[int]) -> list[int]:
        """The blocks of the leading run of ``hashes`` in the prefix cache, each with one more
        reference (neither evicted nor handed out) until ``free_blocks``: what a KV store put
        reads while the engine goes on."""
        pinned = []
        for h in hashes:
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            pinned.append(block_id)
        return pinned

    def share_cached(self, seq: Sequence) -> int:
        """For a sequence whose computed KV was written into blocks of its own (``allocate_blocks``
        for a remote prefill): swap each computed full block whose chain hash the prefix cache
        holds already, with the same tokens, for the cached block (one more reference) and free
        the sequence's own copy. Without this the copy that carries the name would sit in the free
        list while the sequence runs on an unnamed duplicate, and could be evicted meanwhile: the
        chain a later prefix hit or kv-store put walks (``pin_cached``) would break there, though
        the pool still held the KV. Returns how many blocks were swapped."""
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        own_copies = []
        for i, h in enumerate(self._ensure_hashes(seq, seq.num_computed_tokens // bs)):
            cached, own = self.hash_to_block.get(h), seq.block_table[i]
            if cached is None or cached == own:
                continue
            block = self.blocks[cached]
            if block.token_ids != tuple(seq.token_ids[i * bs : (i + 1) * bs]):
                continue  # hash collision: keep the sequence's own KV
            if block.ref_count == 0:
                del self.free[cached]
            block.ref_count += 1
            seq.block_table[i] = cached
            own_copies.append(own)
        self.free_blocks(own_copies)
        return len(own_copies)

    # ---- sequences ----------------------------------------------------------------------------

    def root_of(self, cache_salt: str) -> int:
        """The chain root of a request salted with ``cache_salt`` (prefix_hash.salted_root):
        requests of different salts never share a cached block."""
        return salted_root(self.root_hash, cache_salt)

    def _ensure_hashes(self, seq: Sequence, num_full_blocks: int) -> list[int]:
        bs = self.block_size
        hashes = seq.block_hashes
        for i in range(len(hashes), num_full_blocks):
            parent = hashes[i - 1] if i else self.root_of(seq.params.cache_salt)
            hashes.append(block_hash(parent, seq.token_ids[i * bs : (i + 1) * bs]))
        return hashes

    def _cache_hits(self, seq: Sequence) -> list[int]:
        """Leading blocks of ``seq`` found in the prefix cache. At least one token is always
        left to compute, so the forward pass has a row to sample from."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []  # prompt log-probabilities need every prompt token computed here
        bs = self.block_size
        num_full = (len(seq) - 1) // bs
        hits = []
        for i, h in enumerate(self._ensure_hashes(seq, num_full)):
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            if self.blocks[block_id].token_ids != tuple(seq.token_ids[i * bs : (i + 1) * bs]):
                break  # hash collision
            hits.append(block_id)
        return hits

    def can_allocate(self, seq: Sequence) -> bool:
        hits = self._cache_hits(seq)
        num_in_use_hits = sum(1 for b in hits if self.blocks[b].ref_count > 0)
        return self.num_blocks_for(len(seq)) - num_in_use_hits <= len(self.free)

    def allocate(self, seq: Sequence) -> None:
        """Give a waiting sequence blocks for all its tokens, reusing cached prefix blocks."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        hits = self._cache_hits(seq)
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
        num_new = self.num_blocks_for(len(seq)) - len(hits)
        if num_new > len(self.free):
            self.free_blocks(hits)
            raise OutOfBlocksError(
                f"sequence needs {num_new} more KV blocks, {len(self.free)} free"
            )
        seq.block_table = hits + [self._take_free() for _ in range(num_new)]
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_hashed_blocks = len(hits)
        self.num_hit_tokens += seq.num_computed_tokens

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether the blocks for ``num_new_tokens`` more computed tokens can be had."""
        need = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return need <= len(self.free)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        need = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        assert need <= len(self.free), "call can_append first"
        for _ in range(need):
            seq.block_table.append(self._take_free())

    def commit(self, seq: Sequence) -> None:
        """Enter the sequence's newly completed full blocks into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        if num_full <= seq.num_hashed_blocks:
            return
        hashes = self._ensure_hashes(seq, num_full)
        for i in range(seq.num_hashed_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and hashes[i] not in self.hash_to_block:
                block.hash = hashes[i]
                block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                self.hash_to_block[block.hash] = block.block_id
                if self.events is not None:
                    self.events.on_stored(block.hash)
        seq.num_hashed_blocks = num_full

    def deallocate(self, seq: Sequence) -> None:
        self.free_blocks(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0

    def truncate(self, seq: Sequence, num_tokens: int, num_computed: int) -> list[tuple[int, int]]:
        """Cut ``seq`` back to ``num_tokens`` tokens of which the first ``num_computed`` keep their
        KV; blocks past those are freed. Returns ``(src, dst)`` block copies the caller must do on
        the KV pool: a shared cached block that is now partial is copied to a private one before it
        gets written again (a private one just leaves the prefix cache)."""
        assert 0 < num_tokens <= len(seq) and 0 <= num_computed <= min(
            num_tokens, seq.num_computed_tokens
        )
        bs = self.block_size
        del seq.token_ids[num_tokens:]
        del seq.block_hashes[num_tokens // bs :]
        seq.num_computed_tokens = num_computed
        keep = self.num_blocks_for(num_computed)
        self.free_blocks(seq.block_table[keep:])
        del seq.block_table[keep:]
        copies = []
        num_full = num_computed // bs
        if num_full < keep and num_full < seq.num_hashed_blocks:  # a cached block is partial now
            block = self.blocks[seq.block_table[num_full]]
            if block.ref_count == 1:
                if block.hash is not None and self.hash_to_block.get(block.hash) == block.block_id:
                    del self.hash_to_block[block.hash]
                    if self.events is not None:
                        self.events.on_removed(block.hash)
                block.hash, block.token_ids = None, ()
            else:
                new_id = self.allocate_blocks(1)[0]
                self._release(block.block_id)
                seq.block_table[num_full] = new_id
                copies.append((block.block_id, new_id))
        seq.num_hashed_blocks = min(seq.num_hashed_blocks, num_full)
        return copies

    def check_invariants(self) -> None:
        """Full consistency check (tests and debugging; O(num_blocks))."""
        for block in self.blocks:
            assert block.ref_count >= 0
            assert (block.ref_count == 0) == (block.block_id in self.free), block.block_id
        for h, block_id in self.hash_to_block.items():
            assert self.blocks[block_id].hash == h
