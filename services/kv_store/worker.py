"""The kv-store's worker: its pool in one registered region, the put/commit/get/release requests
over ``core.BlockStore`` (slots, pins, writers' quotas), the windows they open and the disk
tier's copies (docs/kv_store.md).

The worker knows no NATS. The service (the shell) drives it: it hands in the requests its
endpoints decode (with the requester's role for a put), the transport's completions, the
registry's WorkerGone, and calls ``expire_leases`` every ``lease_check_s``. KV bytes never pass
through here: writers and readers move them one-sided through the windows this worker opens; it
looks at the bytes only to check a commit, and, with a disk tier (``--disk-path``), to copy
evicted blocks to the disk file and hit ones back, in a worker thread, before the reply that
hands their host slots out.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from dataclasses import InitVar, dataclass
from typing import Any

from kvmesh.services.kv_store.config import StoreConfig
from kvmesh.services.kv_store.core import BlockStore
from kvmesh.services.kv_store.disk_file import DiskFile
from kvmesh.services.kv_store.disk_tier import DiskSlots
from kvmesh.services.kv_store.grants import Promotion, Spill, StoreFull
from kvmesh.services.kv_store.owners import writer_quota
from kvmesh.shared.bus.messages.kv_store import (
    StoreAck,
    StoreCommit,
    StoreCommitReply,
    StoreGet,
    StoreGetReply,
    StorePut,
    StorePutReply,
    StoreRelease,
)
from kvmesh.shared.bus.messages.workers import WorkerGone
from kvmesh.shared.kv.kv_block_header import (
    HEADER_BYTES,
    BlockHeader,
    BlockVerifyError,
    check_stored,
)
from kvmesh.shared.kv.prefix_hash import layout_root
from kvmesh.shared.obs import logs
from kvmesh.shared.transport import Access, MemoryWindow, Transport
from kvmesh.shared.transport.completions import Completion

log = logs.get_logger(__name__)


@dataclass(eq=False)
class StoreWorker:
    """One store: ``num_blocks`` blocks at ``data_addr``, their headers at ``header_addr``, in one
    registered region of ``transport``."""

    config: StoreConfig
    transport: Transport
    memory: Any  # (num_blocks * (block_bytes + HEADER_BYTES),) uint8
    store_id: str
    num_blocks: InitVar[int]
    block_bytes: int
    kv_spec: str
    disk: DiskFile | None = None  # the disk tier's file, if any

    def __post_init__(self, num_blocks: int) -> None:
        self.layout = layout_root(self.kv_spec)
        num_disk_slots = self.disk.num_slots if self.disk else 0
        self.core = BlockStore(
            num_blocks,
            disk=DiskSlots(num_disk_slots) if self.disk else None,
            max_per_owner=writer_quota(self.config.writer_share, num_blocks, num_disk_slots),
        )
        self.region = self.transport.register(self.memory, Access.REMOTE)
        self.data_addr = self.region.addr
        self.header_addr = self.region.addr + num_blocks * self.block_bytes
        self.windows: dict[str, MemoryWindow] = {}  # put or get id -> its window
        # put window key -> set when a write with that key completed here (its immediate)
        self._landed: dict[int, asyncio.Event] = {}
        self.is_draining = False  # `kvmesh admin drain`: no new put, gets still served

    @property
    def num_running(self) -> int:
        """Puts and gets in flight (their slots pinned)."""
        return len(self.core.puts) + len(self.core.gets)

    # --- addresses ------------------------------------------------------------------------------

    def block_addr(self, slot: int) -> int:
        return self.data_addr + slot * self.block_bytes

    def slot_header_addr(self, slot: int) -> int:
        return self.header_addr + slot * HEADER_BYTES

    def _views(self, slot: int) -> tuple[memoryview, memoryview]:
        """Host slot ``slot``'s block and header, as buffers for the disk file's I/O."""
        block = self.memory[slot * self.block_bytes : (slot + 1) * self.block_bytes]
        base = self.header_addr - self.data_addr + slot * HEADER_BYTES
        return memoryview(block.numpy()), memoryview(
            self.memory[base : base + HEADER_BYTES].numpy()
        )

    async def _copy(
        self, op_id: str, spills: tuple[Spill, ...], promotions: tuple[Promotion, ...]
    ) -> bool:
        """Make an op's copies between tiers (spills first: a promotion may land in a slot a
        spill empties), in a worker thread; report each to the core. False if a promotion did
        not end indexed (the get must not serve it)."""
        if not spills and not promotions:
            return True
        ok_spills, ok_promotions = await asyncio.to_thread(self._copy_blocking, spills, promotions)
        for spill, ok in zip(spills, ok_spills, strict=True):
            self.core.spilled(spill, ok)
        served = [
            self.core.promoted(op_id, p, ok)
            for p, ok in zip(promotions, ok_promotions, strict=True)
        ]
        return all(served)

    def _copy_blocking(
        self, spills: tuple[Spill, ...], promotions: tuple[Promotion, ...]
    ) -> tuple[list[bool], list[bool]]:
        assert self.disk is not None
        done: tuple[list[bool], list[bool]] = ([], [])
        for copies, out in ((spills, done[0]), (promotions, done[1])):
            for c in copies:
                try:
                    if isinstance(c, Spill):
                        self.disk.write_slot(c.disk_slot, *self._views(c.host_slot))
                    else:
                        self.disk.read_slot(c.disk_slot, *self._views(c.host_slot))
                    out.append(True)
                except OSError as exc:  # the block is dropped; the store goes on
                    log.warning("disk tier copy failed", kind=type(c).__name__, error=str(exc))
                    out.append(False)
        return done

    def _open(self, slots: tuple[int, ...], access: Access) -> MemoryWindow:
        spans = [(self.block_addr(s), self.block_bytes) for s in slots]
        spans += [(self.slot_header_addr(s), HEADER_BYTES) for s in slots]
        return self.transport.open_window(self.region, spans, access)

    def _close(self, op_id: str) -> None:
        window = self.windows.pop(op_id, None)
        if window is not None:
            self.transport.close_window(window)
            self._landed.pop(window.rkey, None)

    def _expiry(self, lease_ms: int) -> float:
        return time.monotonic() + min(lease_ms / 1000.0, self.config.max_lease_s)

    def _layout_error(self, kv_spec: str) -> str:
        if kv_spec == self.kv_spec:
            return ""
        return (
            f"stale or foreign KV layout: store {self.store_id} holds {self.kv_spec!r}, the "
            f"request names {kv_spec!r}"
        )

    # --- puts ------------------------------------------------------------------------------------

    async def put(self, body: StorePut, role: str = "") -> StorePutReply:
        """``role``: the NATS role whose inbox the reply goes to (``requester_role``), the only
        one that learns the window's key and can write the blocks."""
        error = self._layout_error(body.kv_spec)
        if self.is_draining:
            error = (
                f"kv-store {self.store_id} is draining: it takes no new blocks (gets are still "
                f"served; `kvmesh admin resume {self.store_id}`)"
            )
        if role and role not in self.config.allowed_put_roles:
            log.warning("put refused: role may not put", role=role, client=body.client_id)
            error = f"role {role!r} may not put blocks in store {self.store_id}"
        if error:
            return StorePutReply(ok=False, store_id=self.store_id, error=error)
        put_id = f"put-{secrets.token_hex(8)}"
        verdict = self.core.reserve(
            put_id, self.layout, body.block_hashes, self._expiry(body.lease_ms), body.client_id
        )
        if isinstance(verdict, StoreFull):
            log.info("put refused: full of pinned blocks", client=body.client_id)
            return StorePutReply(
                ok=False,
                store_id=self.store_id,
                error=verdict.error,
                retry_after_s=self.config.retry_after_s,
            )
        await self._copy(put_id, verdict.spills, ())  # before the writer may write those slots
        rkey = 0
        if verdict.slots:
            try:
                window = self.windows[put_id] = self._open(verdict.slots, Access.REMOTE_WRITE)
            except ValueError as exc:  # the transport's table of windows is full
                self.core.cancel_put(put_id)
                return StorePutReply(
                    ok=False,
                    store_id=self.store_id,
                    error=f"cannot open a write window: {exc}",
                    retry_after_s=self.config.retry_after_s,
                )
            rkey = window.rkey
            self._landed[rkey] = asyncio.Event()
        return StorePutReply(
            ok=True,
            store_id=self.store_id,
            put_id=put_id if verdict.slots else "",
            rkey=rkey,
            present=verdict.present,
            write_hashes=verdict.write_hashes,
            block_addrs=tuple(self.block_addr(s) for s in verdict.slots),
            header_addrs=tuple(self.slot_header_addr(s) for s in verdict.slots),
            block_bytes=self.block_bytes,
        )

    async def commit(self, body: StoreCommit) -> StoreCommitReply:
        window = self.windows.get(body.put_id)
        put = self.core.put_slots(body.put_id)
        if window is None or put is None or window.rkey != body.rkey:
            return StoreCommitReply(
                ok=False, error=f"no put {body.put_id!r} in flight with this key (expired?)"
            )
        # The writer's write() returned (placed), but its completion may reach this process
        # after the commit (shm: the notification socket; rdma: the receive queue): wait for it
        # (bounded) before the window closes, so it is not taken for a late write.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._landed[window.rkey].wait(), self.config.commit_wait_s)
        self._close(body.put_id)  # from here on a late write is refused
        hashes, slots, layout = put
        good = await asyncio.to_thread(self._check_slots, hashes, slots, layout)
        committed, rejected = self.core.commit(body.put_id, good)
        if rejected:
            log.warning("commit rejected blocks", put_id=body.put_id, rejected=len(rejected))
        return StoreCommitReply(ok=True, committed=tuple(committed), rejected=tuple(rejected))

    def _check_slots(
        self, hashes: tuple[int, ...], slots: tuple[int, ...], layout: int
    ) -> list[bool]:
        """Whether each slot's header names its reserved hash and layout and its bytes match
        the CRC32 (in a thread: it reads every byte of the put)."""
        good = []
        base = self.header_addr - self.data_addr
        for h, slot in zip(hashes, slots, strict=True):
            start = slot * self.block_bytes
            block = self.memory[start : start + self.block_bytes].numpy()
            raw = self.memory[base + slot * HEADER_BYTES : base + (slot + 1) * HEADER_BYTES]
            try:
                check_stored(BlockHeader.unpack(raw.numpy().tobytes()), h, layout, block)
                good.append(True)
            except BlockVerifyError as exc:
                log.warning("block refused at commit", block_hash=f"{h:#x}", error=str(exc))
                good.append(False)
        return good

    # --- gets ------------------------------------------------------------------------------------

    async def get(self, body: StoreGet) -> StoreGetReply:
        error = self._layout_error(body.kv_spec)
        if error:
            return StoreGetReply(ok=False, store_id=self.store_id, error=error)
        miss = StoreGetReply(ok=True, store_id=self.store_id, block_bytes=self.block_bytes)
        get_id = f"get-{secrets.token_hex(8)}"
        grant = self.core.lookup(
            get_id, self.layout, body.block_hashes, self._expiry(body.lease_ms)
        )
        if not grant.slots:
            return miss
        if not await self._copy(get_id, grant.spills, grant.promotions):
            self.core.release(get_id)  # a disk block could not be read back
            return miss
        try:
            window = self.windows[get_id] = self._open(grant.slots, Access.REMOTE_READ)
        except ValueError as exc:  # the transport's table of windows is full
            self.core.release(get_id)
            log.warning("get served as a miss: no read window", error=str(exc))
            return miss
        return StoreGetReply(
            ok=True,
            store_id=self.store_id,
            get_id=get_id,
            rkey=window.rkey,
            block_hashes=grant.block_hashes,
            block_addrs=tuple(self.block_addr(s) for s in grant.slots),
            header_addrs=tuple(self.slot_header_addr(s) for s in grant.slots),
            block_bytes=self.block_bytes,
        )

    def release(self, body: StoreRelease) -> StoreAck:
        window = self.windows.get(body.get_id)
        if window is None or window.rkey != body.rkey:
            return StoreAck(ok=False, error=f"no get {body.get_id!r} held with this key (expired?)")
        self._close(body.get_id)
        self.core.release(body.get_id)
        return StoreAck(ok=True)

    # --- what the shell hands in ----------------------------------------------------------------

    def expire_leases(self, now: float) -> None:
        """Drop the puts and gets whose lease ran out by ``now`` (monotonic): their windows close,
        their slots unpin."""
        puts, gets = self.core.expire(now)
        for op_id in (*puts, *gets):
            self._close(op_id)
        if puts or gets:
            log.info("leases expired", puts=len(puts), gets=len(gets))

    def on_completion(self, completion: Completion) -> None:
        """A put's write completed here with the key of its window (tcp, shm: the key it used;
        rdma: the windows its connection resolved; None: cannot tell, so every put waiting)."""
        keys = completion.keys if completion.keys is not None else list(self._landed)
        for key in keys:
            landed = self._landed.get(key)
            if landed is not None:
                landed.set()

    def on_worker_gone(self, gone: WorkerGone) -> None:
        """The kv-registry dropped a worker: evict every block it put, and its puts in flight."""
        before = self.core.counters.owner_drops
        cancelled = self.core.drop_owner(gone.worker_id)
        for put_id in cancelled:
            self._close(put_id)
        evicted = self.core.counters.owner_drops - before
        if evicted or cancelled:
            log.info(
                "a dropped worker's blocks evicted",
                worker=gone.worker_id,
                blocks=evicted,
                puts=len(cancelled),
            )


__all__ = ["StoreWorker"]
