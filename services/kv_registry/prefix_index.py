"""Which decode worker holds which prefix: the registry's index of block hashes, pure.

Fed by the decode workers' KvCacheEvents (batched changes) and KvCacheDigests (their whole cache,
periodically). It is a hint, never a promise: a worker may evict a block a moment after saying it
holds it, and then simply computes more of the prompt. So the index favours being cheap and
bounded over being exact:

- memory: at most ``max_blocks_per_worker`` hashes per worker, least recently stored or matched
  evicted first; a dropped worker's entries go with it;
- order: each worker numbers its messages (``seq``, within an ``epoch``: its process). A message
  older than what was applied is ignored; a gap (messages lost, or a registry that started
  mid-stream) marks the worker unsynced until its next digest, which replaces everything known of
  it. Changes after the gap are still applied: they are as true as any.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Sequence
from dataclasses import dataclass, field

from kvmesh.shared.bus.messages.cache_events import KvCacheDigest, KvCacheEvents


@dataclass(slots=True)
class WorkerPrefixes:
    """What the index holds of one worker."""

    epoch: str = ""
    seq: int = 0  # of the last message applied
    is_synced: bool = False  # every change since a digest (or the worker's start) was applied
    num_reported: int = 0  # the worker's own count of cached blocks, as its last digest said
    hashes: OrderedDict[int, None] = field(default_factory=OrderedDict)  # oldest first


class PrefixIndex:
    def __init__(self, max_blocks_per_worker: int = 65_536) -> None:
        assert max_blocks_per_worker > 0
        self.max_blocks_per_worker = max_blocks_per_worker
        self.workers: dict[str, WorkerPrefixes] = {}
        self._holders: dict[int, set[str]] = {}  # hash -> workers holding it
        self.num_gaps = 0  # event streams found to have missed messages

    def __len__(self) -> int:
        """Distinct hashes indexed."""
        return len(self._holders)

    # --- what the workers tell us ---------------------------------------------------------------

    def apply_events(self, msg: KvCacheEvents) -> None:
        entry = self.workers.get(msg.worker_id)
        if entry is None or entry.epoch != msg.epoch:  # a worker (re)started: its cache is new
            entry = self._reset(msg.worker_id, msg.epoch)
            entry.is_synced = msg.seq == 1
        elif msg.seq <= entry.seq:
            return  # a duplicate, or older than a digest already applied
        elif msg.seq != entry.seq + 1:
            entry.is_synced = False
            self.num_gaps += 1
        entry.seq = msg.seq
        for h in msg.removed:
            self._forget(msg.worker_id, entry, h)
        for h in msg.stored:
            self._remember(msg.worker_id, entry, h)

    def apply_digest(self, msg: KvCacheDigest) -> None:
        entry = self.workers.get(msg.worker_id)
        if entry is not None and entry.epoch == msg.epoch and msg.seq <= entry.seq:
            return  # events newer than this digest were applied already
        entry = self._reset(msg.worker_id, msg.epoch)
        entry.seq, entry.is_synced, entry.num_reported = msg.seq, True, msg.num_cached_blocks
        # the digest lists the newest last: an over-full index keeps those
        for h in msg.hashes:
            self._remember(msg.worker_id, entry, h)

    def apply_from(self, known: Container[str], msg: KvCacheEvents | KvCacheDigest) -> bool:
        """Apply a holder's report (its changes, or all it holds) if ``known`` (the holders known
        by their adverts) has its sender; False (ignored) for an unknown one: it resyncs with
        its next digest once it is known."""
        if msg.worker_id not in known:
            return False
        if isinstance(msg, KvCacheDigest):
            self.apply_digest(msg)
        else:
            self.apply_events(msg)
        return True

    def drop_worker(self, worker_id: str) -> None:
        """Forget everything of a worker (dropped for silence, or gone)."""
        entry = self.workers.pop(worker_id, None)
        if entry is not None:
            for h in entry.hashes:
                self._unhold(worker_id, h)

    # --- what placement asks --------------------------------------------------------------------

    def matched_blocks(self, worker_id: str, hashes: Sequence[int]) -> int:
        """How many leading ``hashes`` (a prompt's chain) ``worker_id`` holds."""
        entry = self.workers.get(worker_id)
        if entry is None:
            return 0
        n = 0
        for h in hashes:
            if h not in entry.hashes:
                break
            n += 1
        return n

    def touch(self, worker_id: str, hashes: Sequence[int]) -> None:
        """A placement used these hashes: keep them longest."""
        entry = self.workers.get(worker_id)
        if entry is not None:
            for h in hashes:
                if h in entry.hashes:
                    entry.hashes.move_to_end(h)

    def holders(self, block_hash: int) -> frozenset[str]:
        """The workers said to hold ``block_hash``."""
        return frozenset(self._holders.get(block_hash, ()))

    def num_blocks(self, worker_id: str) -> int:
        entry = self.workers.get(worker_id)
        return len(entry.hashes) if entry is not None else 0

    def is_synced(self, worker_id: str) -> bool:
        entry = self.workers.get(worker_id)
        return entry is not None and entry.is_synced

    # --- internals ------------------------------------------------------------------------------

    def _reset(self, worker_id: str, epoch: str) -> WorkerPrefixes:
        self.drop_worker(worker_id)
        entry = self.workers[worker_id] = WorkerPrefixes(epoch=epoch)
        return entry

    def _remember(self, worker_id: str, entry: WorkerPrefixes, h: int) -> None:
        if h in entry.hashes:
            entry.hashes.move_to_end(h)
            return
        entry.hashes[h] = None
        self._holders.setdefault(h, set()).add(worker_id)
        while len(entry.hashes) > self.max_blocks_per_worker:
            oldest, _ = entry.hashes.popitem(last=False)
            self._unhold(worker_id, oldest)

    def _forget(self, worker_id: str, entry: WorkerPrefixes, h: int) -> None:
        if entry.hashes.pop(h, 0) is None:  # it was there (values are None)
            self._unhold(worker_id, h)

    def _unhold(self, worker_id: str, h: int) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(worker_id)
            if not holders:
                del self._holders[h]
