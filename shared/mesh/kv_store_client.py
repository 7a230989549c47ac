"""Putting KV blocks into a kv-store and getting them back, one-sided (asyncio; docs/kv_store.md).

The client owns nothing but a small registered header buffer and one endpoint per store: blocks
move between the caller's registered pool and the store's pool by one batched ``write`` (put)
or ``read`` (get) each, the control messages go over NATS. A get verifies every block it read
(``verify_block``: header, layout, token digest, CRC32) and reports how many leading blocks are
good; the caller uses those and computes the rest.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from kvmesh.shared.bus.messages.codec import Message, MessageError, decode_message, encode_message
from kvmesh.shared.bus.messages.kv_store import (
    MAX_STORE_BLOCKS,
    StoreAck,
    StoreCommit,
    StoreCommitReply,
    StoreGet,
    StoreGetReply,
    StorePut,
    StorePutReply,
    StoreRelease,
)
from kvmesh.shared.config.subjects import Subjects
from kvmesh.shared.kv.kv_block_header import (
    HEADER_BYTES,
    BlockVerifyError,
    make_header,
    token_digests,
    verify_block,
)
from kvmesh.shared.kv.kv_cache import KVPool
from kvmesh.shared.kv.prefix_hash import layout_root
from kvmesh.shared.obs import logs
from kvmesh.shared.transport import (
    Access,
    Endpoint,
    MemoryRegion,
    Transport,
    TransportDescriptor,
    TransportError,
    WriteEntry,
)
from kvmesh.shared.transport.endpoint_cache import EndpointCache
from nats.aio.client import Client

log = logs.get_logger(__name__)

R = TypeVar("R", bound=Message)


class StoreRequestError(RuntimeError):
    """The store did not answer, or answered something that is not its reply."""


@dataclass(frozen=True, slots=True)
class StoreTarget:
    """Where a store is: its id (its subjects) and its data-plane descriptor."""

    store_id: str
    descriptor: TransportDescriptor


@dataclass(frozen=True, slots=True)
class LocalBlock:
    """One block of the caller's pool: its name and where its bytes lie in ``region``."""

    block_hash: int
    token_digest: bytes  # kv_block_header.token_digests()
    offset: int  # byte offset in the pool region


def local_blocks(
    pool: KVPool,
    kv_spec: str,
    token_ids: Sequence[int],
    hashes: Sequence[int],
    block_ids: Sequence[int],
    first: int = 0,
) -> list[LocalBlock]:
    """Pool blocks ``block_ids`` holding full blocks ``first``, ``first + 1``, ... of
    ``token_ids``, named by ``hashes`` (the chain's from ``first`` on)."""
    num_blocks = first + len(block_ids)
    digests = token_digests(token_ids, pool.spec.block_size, kv_spec, num_blocks)[first:]
    return [
        LocalBlock(h, d, pool.block_offset(b))
        for h, d, b in zip(hashes, digests, block_ids, strict=True)
    ]


@dataclass(frozen=True, slots=True)
class PutResult:
    ok: bool
    present: tuple[int, ...] = ()
    committed: tuple[int, ...] = ()
    rejected: tuple[int, ...] = ()
    error: str = ""
    retry_after_s: float = 0.0


@dataclass(frozen=True, slots=True)
class GetResult:
    num_blocks: int  # leading blocks that landed in the pool and verified
    num_offered: int  # blocks the store had (its leading run)
    error: str = ""  # why fewer than offered were used, or why the get failed


@dataclass(eq=False)
class KvStoreClient:
    """Puts and gets for one pool ``pool`` (flat uint8) registered as ``region`` on
    ``transport``. Operations take turns on the header buffer (one at a time per client)."""

    nc: Client
    subjects: Subjects
    transport: Transport
    pool: torch.Tensor
    region: MemoryRegion
    block_bytes: int
    client_id: str
    request_timeout_s: float = 5.0
    lease_ms: int = 30_000
    _endpoints: EndpointCache = field(init=False)
    _turn: asyncio.Lock = field(default_factory=asyncio.Lock, init=False)

    def __post_init__(self) -> None:
        self._headers = self.transport.allocate(MAX_STORE_BLOCKS * HEADER_BYTES)
        self._header_region = self.transport.register(self._headers, Access.LOCAL)
        self._endpoints = EndpointCache(self.transport)

    @classmethod
    def for_pool(
        cls,
        nc: Client,
        subjects: Subjects,
        transport: Transport,
        kv_pool: KVPool,
        region: MemoryRegion,
        client_id: str,
    ) -> KvStoreClient:
        """The client of an engine's ``kv_pool``, registered as ``region``."""
        return cls(
            nc, subjects, transport, kv_pool.raw, region, kv_pool.spec.block_bytes, client_id
        )

    async def aclose(self) -> None:
        await self._endpoints.aclose()
        self.transport.deregister(self._header_region)

    async def __aenter__(self) -> KvStoreClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # --- put -------------------------------------------------------------------------------------

    async def put(
        self, store: StoreTarget, kv_spec: str, blocks: Sequence[LocalBlock]
    ) -> PutResult:
        """Offer ``blocks``; write those the store lacks (with their headers), then commit."""
        layout = layout_root(kv_spec)
        by_hash = {b.block_hash: b for b in blocks}
        reply = await self._request(
            self.subjects.store_put(store.store_id),
            StorePut(self.client_id, kv_spec, tuple(by_hash), self.lease_ms),
            StorePutReply,
        )
        if not reply.ok:
            return PutResult(False, error=reply.error, retry_after_s=reply.retry_after_s)
        if not reply.write_hashes:
            return PutResult(True, present=reply.present)
        self._check_block_bytes(reply.block_bytes)
        async with self._turn:
            writes = [by_hash[h] for h in reply.write_hashes]
            await asyncio.to_thread(self._fill_headers, layout, writes)  # CRC32s: every byte
            entries = self._block_entries(writes, reply.block_addrs, reply.header_addrs, reply.rkey)
            ep = await self._endpoint(store)
            try:
                await ep.write(entries, 0)
            except TransportError:
                await self._drop(store)  # the put's lease frees its slots
                raise
        done = await self._request(
            self.subjects.store_commit(store.store_id),
            StoreCommit(reply.put_id, reply.rkey),
            StoreCommitReply,
        )
        if not done.ok:
            return PutResult(False, present=reply.present, error=done.error)
        return PutResult(True, reply.present, done.committed, done.rejected)

    def _block_entries(
        self,
        blocks: Sequence[LocalBlock],
        block_addrs: Sequence[int],
        header_addrs: Sequence[int],
        rkey: int,
    ) -> list[WriteEntry]:
        """One entry per block and one per its header (header ``i`` at ``i * HEADER_BYTES`` of
        the header staging), against the store's addresses: the same list serves a put's writes
        and a get's reads."""
        entries = []
        for i, block in enumerate(blocks):
            entries.append(
                WriteEntry(self.region, block.offset, block_addrs[i], rkey, self.block_bytes)
            )
            entries.append(
                WriteEntry(
                    self._header_region, i * HEADER_BYTES, header_addrs[i], rkey, HEADER_BYTES
                )
            )
        return entries

    # --- get -------------------------------------------------------------------------------------

    async def get(
        self, store: StoreTarget, kv_spec: str, blocks: Sequence[LocalBlock]
    ) -> GetResult:
        """Read the leading run of ``blocks`` the store holds into their offsets of the pool;
        the result says how many leading blocks verified (the others must be computed)."""
        reply = await self._request(
            self.subjects.store_get(store.store_id),
            StoreGet(self.client_id, kv_spec, tuple(b.block_hash for b in blocks), self.lease_ms),
            StoreGetReply,
        )
        if not reply.ok:
            return GetResult(0, 0, reply.error)
        offered = len(reply.block_hashes)
        if not offered:
            return GetResult(0, 0)
        try:
            self._check_block_bytes(reply.block_bytes)
            if reply.block_hashes != tuple(b.block_hash for b in blocks[:offered]):
                raise StoreRequestError(
                    "the store offered other blocks than the leading ones asked"
                )
            async with self._turn:
                entries = self._block_entries(
                    blocks[:offered], reply.block_addrs, reply.header_addrs, reply.rkey
                )
                ep = await self._endpoint(store)
                await ep.read(entries)
                good, error = await asyncio.to_thread(self._verify, kv_spec, blocks[:offered])
        except TransportError as exc:
            await self._drop(store)
            good, error = 0, str(exc)
        except StoreRequestError as exc:
            good, error = 0, str(exc)
        finally:
            await self._release(store, reply)
        return GetResult(good, offered, error)

    def _fill_headers(self, layout: int, blocks: Sequence[LocalBlock]) -> None:
        """Header ``i`` of the buffer for ``blocks[i]`` (in a thread: it reads every byte)."""
        for i, block in enumerate(blocks):
            data = self.pool[block.offset : block.offset + self.block_bytes].numpy()
            header = make_header(block.block_hash, layout, block.token_digest, data).pack()
            self._headers[i * HEADER_BYTES : (i + 1) * HEADER_BYTES] = torch.frombuffer(
                bytearray(header), dtype=torch.uint8
            )

    def _verify(self, kv_spec: str, blocks: Sequence[LocalBlock]) -> tuple[int, str]:
        layout = layout_root(kv_spec)
        for i, block in enumerate(blocks):
            raw = self._headers[i * HEADER_BYTES : (i + 1) * HEADER_BYTES].numpy().tobytes()
            data = self.pool[block.offset : block.offset + self.block_bytes].numpy()
            try:
                verify_block(raw, data, block.block_hash, layout, block.token_digest)
            except BlockVerifyError as exc:
                log.warning("store block refused by the reader", index=i, error=str(exc))
                return i, str(exc)
        return len(blocks), ""

    async def _release(self, store: StoreTarget, reply: StoreGetReply) -> None:
        try:
            await self._request(
                self.subjects.store_release(store.store_id),
                StoreRelease(reply.get_id, reply.rkey),
                StoreAck,
            )
        except StoreRequestError as exc:  # its lease frees the pins
            log.warning("store release not answered", error=str(exc))

    # --- plumbing --------------------------------------------------------------------------------

    def _check_block_bytes(self, block_bytes: int) -> None:
        if block_bytes != self.block_bytes:
            raise StoreRequestError(
                f"the store's blocks are {block_bytes} bytes, this pool's {self.block_bytes}"
            )

    async def _endpoint(self, store: StoreTarget) -> Endpoint:
        return await self._endpoints.get(store.descriptor)

    async def _drop(self, store: StoreTarget) -> None:
        """Forget a store's endpoint after a failed operation (the next one connects again)."""
        await self._endpoints.forget(store.descriptor)

    async def _request(self, subject: str, body: Message, cls: type[R]) -> R:
        try:
            msg = await self.nc.request(
                subject, encode_message(body), timeout=self.request_timeout_s
            )
        except Exception as exc:  # no responders, timeout, connection: the store is unreachable
            raise StoreRequestError(f"store request on {subject} failed: {exc!r}") from exc
        if msg.headers and msg.headers.get("Nats-Service-Error"):
            raise StoreRequestError(
                f"store refused the request: {msg.headers['Nats-Service-Error']}"
            )
        try:
            return decode_message(msg.data, cls)
        except MessageError as exc:
            raise StoreRequestError(str(exc)) from exc
