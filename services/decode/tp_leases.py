"""A reservation's write lease on every rank of a tensor-parallel decode worker (docs/tp.md).

Each rank holds its share of the KV heads in a pool of its own, registered with its own
transport, so a reservation is a window on every rank, over the same block ids (the engine runs
SPMD: the leader's ``reserve_blocks`` is every rank's). The leader (rank 0, the worker's only
process on NATS) keeps the lease:

- ``GroupWindows`` opens the leader's window and asks every follower to open its own
  (``OpenWindow``; each answers ``WindowOpened`` with its key and block addresses) before the
  reservation is answered; their targets go in ``ReserveReply.ranks`` (``ranks``). Closing the
  lease's window closes every rank's (``CloseWindow``).
- ``RankLeases`` is a follower's side: its open windows, and each write that lands in its pool
  checked against the window of the lease its immediate names; a good one goes to the leader as
  a ``RankWrite``, a stray one is counted.
- ``GroupPendingTable`` is the leader's pending table: its own writes count as at TP1, the
  followers' as ``RankWrite``s, and a lease is complete once every rank's announced writes have
  landed (``PrefillDone.num_writes`` counts one rank's: each of the ``tp`` ranks takes as many).
  Expiry and quarantine are the table's own rules over all ranks' writes.

Leader and followers exchange these over multiprocessing queues (``tp_group.py``).
"""

from __future__ import annotations

import queue
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from kvmesh.services.decode.pending import PendingTable, Verdict
from kvmesh.services.decode.windows import LeaseWindows
from kvmesh.shared.bus.messages.placement import DecodeRankTarget
from kvmesh.shared.bus.messages.prefill_jobs import PrefillDone
from kvmesh.shared.kv.descriptor import TransportDescriptor
from kvmesh.shared.kv.imm import IMM_BITS, imm_slot, unpack_imm
from kvmesh.shared.obs import logs
from kvmesh.shared.transport.base import MemoryRegion, MemoryWindow, Transport
from kvmesh.shared.transport.completions import Completion

log = logs.get_logger(__name__)

WINDOW_REPLY_TIMEOUT_S = 10.0  # a follower answers an OpenWindow in milliseconds


@dataclass(frozen=True, slots=True)
class OpenWindow:
    """Leader -> follower: open a window over these blocks of your pool (one reservation)."""

    seq: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CloseWindow:
    """Leader -> follower: the lease of the window with key ``rkey`` ended."""

    rkey: int


@dataclass(frozen=True, slots=True)
class RankReady:
    """Follower -> leader: its pool is registered; how prefill workers reach it (JSON)."""

    rank: int
    descriptor: bytes


@dataclass(frozen=True, slots=True)
class WindowOpened:
    """Follower -> leader: the answer to ``OpenWindow`` ``seq`` (``error``: why none)."""

    rank: int
    seq: int
    rkey: int = 0
    block_addrs: tuple[int, ...] = ()
    error: str = ""
    block_bytes: int = 0  # the rank's block (ranks of an uneven split differ)


@dataclass(frozen=True, slots=True)
class RankWrite:
    """Follower -> leader: write ``write`` of the lease whose window on rank ``rank`` has key
    ``rkey`` landed there, ``num_bytes`` of it, from the lease's holder."""

    rank: int
    rkey: int
    write: int
    num_bytes: int


class GroupWindows(LeaseWindows):
    """The leader's ``LeaseWindows``: every lease's window on every rank. ``controls[r - 1]``
    reaches follower ``r``; ``replies`` is where they answer; ``descriptors[r - 1]`` is how
    prefill workers reach follower ``r``."""

    def __init__(
        self,
        transport: Transport,
        region: MemoryRegion,
        block_bytes: int,
        controls: Sequence[Any],
        replies: Any,
        descriptors: Sequence[TransportDescriptor],
        reply_timeout_s: float = WINDOW_REPLY_TIMEOUT_S,
    ) -> None:
        super().__init__(transport, region, block_bytes)
        assert len(controls) == len(descriptors)
        self.controls = list(controls)
        self.replies = replies
        self.descriptors = list(descriptors)
        self.reply_timeout_s = reply_timeout_s
        self._seq = 0
        self._ranks: dict[int, tuple[DecodeRankTarget, ...]] = {}  # leader key -> others'
        self._leader_keys: dict[tuple[int, int], int] = {}  # (rank, its key) -> leader key
        self.table: GroupPendingTable | None = None  # pending_table's

    @property
    def tp_size(self) -> int:
        return len(self.controls) + 1

    def pending_table(self, quarantine_s: float) -> GroupPendingTable:
        """The worker's pending table: a lease complete once every rank's writes landed."""
        self.table = GroupPendingTable(quarantine_s, self.tp_size)
        return self.table

    def open(self, block_ids: Sequence[int]) -> MemoryWindow:
        """The leader's window; every follower's opened too (ValueError when one cannot, or
        says nothing within ``reply_timeout_s``: the reservation is then refused)."""
        window = super().open(block_ids)
        self._seq += 1
        seq = self._seq
        for control in self.controls:
            control.put(OpenWindow(seq, tuple(block_ids)))
        opened: dict[int, WindowOpened] = {}
        error = ""
        deadline = time.monotonic() + self.reply_timeout_s
        while len(opened) < len(self.controls) and not error:
            try:
                reply = self.replies.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                missing = sorted(set(range(1, len(self.controls) + 1)) - set(opened))
                error = (
                    f"tensor-parallel ranks {missing} did not open their windows within "
                    f"{self.reply_timeout_s} s"
                )
                break
            if not isinstance(reply, WindowOpened):
                continue
            if reply.seq != seq:  # the answer to an open that gave up: nobody uses it
                if reply.rkey:
                    self.controls[reply.rank - 1].put(CloseWindow(reply.rkey))
                continue
            if reply.error:
                error = f"tensor-parallel rank {reply.rank}: {reply.error}"
            else:
                opened[reply.rank] = reply
        if error:
            super().close(window)
            for reply in opened.values():
                self.controls[reply.rank - 1].put(CloseWindow(reply.rkey))
            raise ValueError(error)
        self._ranks[window.rkey] = tuple(
            DecodeRankTarget(
                opened[r].rkey,
                opened[r].block_addrs,
                self.descriptors[r - 1],
                0 if opened[r].block_bytes == self.block_bytes else opened[r].block_bytes,
            )
            for r in range(1, len(self.controls) + 1)
        )
        for reply in opened.values():
            self._leader_keys[(reply.rank, reply.rkey)] = window.rkey
        return window

    def close(self, window: MemoryWindow) -> None:
        super().close(window)
        for rank, target in enumerate(self._ranks.pop(window.rkey, ()), start=1):
            self._leader_keys.pop((rank, target.rkey), None)
            self.controls[rank - 1].put(CloseWindow(target.rkey))

    def ranks(self, window: MemoryWindow | None) -> tuple[DecodeRankTarget, ...]:
        return () if window is None else self._ranks.get(window.rkey, ())

    def leader_key(self, rank: int, rkey: int) -> int | None:
        """The leader's key of the lease whose window on ``rank`` has key ``rkey`` (None: that
        lease ended)."""
        return self._leader_keys.get((rank, rkey))


class GroupPendingTable(PendingTable):
    """The leader's pending table at TP ``tp_size``: a lease is complete once every rank's
    ``PrefillDone.num_writes`` writes have landed (its own and the followers' ``RankWrite``s)."""

    def __init__(self, quarantine_s: float, tp_size: int) -> None:
        super().__init__(quarantine_s)
        self.tp_size = tp_size

    def on_done(self, done: PrefillDone) -> Verdict | None:
        """As at TP1, the announced writes counted on every rank."""
        whole = msgspec.structs.replace(done, num_writes=done.num_writes * self.tp_size)
        return super().on_done(whole)

    def on_rank_write(self, rank: int, leader_key: int | None, write: int) -> Verdict | None:
        """Follower ``rank``'s write ``write`` of the lease whose leader window key is
        ``leader_key`` landed (None: its lease ended: a stray write)."""
        lease = next((r for r in self.reservations() if leader_key and r.rkey == leader_key), None)
        if lease is None:
            self._count_stray(-1, write, f"rank {rank}", "its lease ended (late)", None)
            return None
        key = rank << IMM_BITS | write  # apart from the leader's own (< 2**IMM_BITS)
        if key in lease.writes:
            self._pop(lease)
            return Verdict(lease, False, f"KV write {write} arrived twice at rank {rank}")
        lease.writes.add(key)
        return self._settle(lease)


class RankLeases:
    """A follower's windows, one a lease (block ``b`` at ``region.addr + b * block_bytes``),
    and the writes that land in them."""

    def __init__(
        self, rank: int, transport: Transport, region: MemoryRegion, block_bytes: int
    ) -> None:
        self.rank = rank
        self.windows = LeaseWindows(transport, region, block_bytes)
        self.block_bytes = block_bytes
        self._by_slot: dict[int, MemoryWindow] = {}
        self._slots: dict[int, int] = {}  # key -> slot
        self.num_stray = 0
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._by_slot)

    def on_control(self, msg: OpenWindow | CloseWindow) -> WindowOpened | None:
        if isinstance(msg, CloseWindow):
            slot = self._slots.pop(msg.rkey, None)
            if slot is not None:
                self.windows.close(self._by_slot.pop(slot))
            return None
        base = self.windows.region.addr
        try:
            window = self.windows.open(msg.block_ids)
        except ValueError as exc:  # the transport's table of windows is full
            return WindowOpened(self.rank, msg.seq, error=f"cannot open a write window: {exc}")
        addrs = tuple(base + b * self.block_bytes for b in msg.block_ids)
        slot = imm_slot(addrs[0], self.block_bytes)
        stale = self._by_slot.get(slot)
        if stale is not None:  # its CloseWindow is on its way: this lease holds the slot now
            self._slots.pop(stale.rkey, None)
            self.windows.close(stale)
        self._by_slot[slot] = window
        self._slots[window.rkey] = slot
        return WindowOpened(self.rank, msg.seq, window.rkey, addrs, block_bytes=self.block_bytes)

    def on_completion(self, completion: Completion) -> RankWrite | None:
        """A write landed here: the leader's to count if it came with the key of the window of
        the lease its immediate names; else stray (None)."""
        slot, write = unpack_imm(completion.imm)
        window = self._by_slot.get(slot)
        if window is None or (completion.keys is not None and window.rkey not in completion.keys):
            self.num_stray += 1
            if logs.is_sampled(self.num_stray):
                log.warning("immediate refused", rank=self.rank, slot=slot, peer=completion.peer_id)
            return None
        self.num_bytes += completion.num_bytes
        return RankWrite(self.rank, window.rkey, write, completion.num_bytes)
