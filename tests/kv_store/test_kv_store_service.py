"""`kvmesh serve kv-store` as a real process on a real nats-server: blocks written one-sided come
back byte for byte through one-sided reads; a restart loses the cache (a miss, not an error); a
store full of pinned blocks refuses a put at once and says why; a request naming another KV
layout is refused; a hash collision is caught by the reader; a read after release is refused and
counted; `kvmesh admin status` lists the store (docs/kv_store.md)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator

import pytest
import torch
from kvmesh.loadgen import prom_text
from kvmesh.shared.bus.messages.codec import decode_message, encode_message
from kvmesh.shared.bus.messages.kv_store import (
    StoreAck,
    StoreAdvert,
    StoreGet,
    StoreGetReply,
    StorePut,
    StorePutReply,
    StoreRelease,
    StoreSolicit,
)
from kvmesh.shared.bus.messages.workers import WorkerGone
from kvmesh.shared.bus.nats_connect import connect_nats
from kvmesh.shared.bus.store_solicit import store_adverts_solicited
from kvmesh.shared.config.subjects import Subjects
from kvmesh.shared.kv.kv_block_header import token_digests
from kvmesh.shared.kv.prefix_hash import layout_root, prefix_block_hashes
from kvmesh.shared.mesh.kv_store_client import KvStoreClient, LocalBlock, StoreTarget
from kvmesh.shared.transport import (
    Access,
    RemoteAccessError,
    TransportConfig,
    WriteEntry,
    create_transport,
)

pytestmark = pytest.mark.slow  # kv-store processes

MESH = "kvs"
SUBJECTS = Subjects(MESH)
BLOCK_SIZE = 16
NUM_LOCAL = 8  # blocks in the test's own pool


def spawn_store(nats_url: str, store_id: str, log, *flags: str) -> subprocess.Popen:
    """``kvmesh serve kv-store`` in its own process, its output in ``log`` (a file, not a pipe:
    a chatty child must never block on it)."""
    argv = [sys.executable, "-m", "kvmesh.cli", "serve", "kv-store", "--nats-url", nats_url]
    argv += ["--mesh", MESH, "--worker-id", store_id, "--heartbeat-s", "0.2", *flags]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)


def stop_store(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def next_advert(
    nats_url: str, store_id: str, proc: subprocess.Popen, log, after_epoch: str = ""
) -> StoreAdvert:
    """The store's next advert (of an epoch other than ``after_epoch``): it is up and answering."""
    async with connect_nats(nats_url, "test-advert") as nc:
        adverts: asyncio.Queue[StoreAdvert] = asyncio.Queue()

        async def on_advert(msg) -> None:
            advert = decode_message(msg.data, StoreAdvert)
            if advert.store_id == store_id and advert.reach.epoch != after_epoch:
                adverts.put_nowait(advert)

        await nc.subscribe(SUBJECTS.REGISTRY_STORE_ADVERTISE, cb=on_advert)
        for _ in range(240):  # up to 120 s: its start imports torch
            try:
                return await asyncio.wait_for(adverts.get(), 0.5)
            except TimeoutError:
                if proc.poll() is not None:
                    break
        proc.kill()
        log.seek(0)
        raise AssertionError(f"kv-store did not come up: {log.read().decode()[-4000:]}")


@contextlib.asynccontextmanager
async def store_process(
    nats_url: str, store_id: str, *flags: str, after_epoch: str = ""
) -> AsyncIterator[StoreAdvert]:
    """A store of this test alone; yields its first advert, stops it with SIGTERM on exit."""
    with tempfile.TemporaryFile() as log:
        proc = spawn_store(nats_url, store_id, log, *flags)
        try:
            yield await next_advert(nats_url, store_id, proc, log, after_epoch)
        finally:
            stop_store(proc)


SHARED = "store-m"  # the module's store: tests that need no fresh one share it


@pytest.fixture(scope="module")
def shared_store(nats_server_module: str, unused_tcp_port_factory):
    """One kv-store process for the module (tcp, 8 blocks, metrics on a port of its own): each
    test that uses it names blocks of its own tokens, so none sees another's."""
    port = unused_tcp_port_factory()
    with tempfile.TemporaryFile() as log:
        flags = ("--num-blocks", "8", "--transport", "tcp", "--metrics-port", str(port))
        proc = spawn_store(nats_server_module, SHARED, log, *flags)
        try:
            yield nats_server_module, proc, log, port
        finally:
            stop_store(proc)


class Client:
    """The test's side: a transport, a pool of NUM_LOCAL blocks and a KvStoreClient over it."""

    def __init__(self, nats_url: str, backend: str, advert: StoreAdvert) -> None:
        self.nats_url, self.backend, self.advert = nats_url, backend, advert

    async def __aenter__(self) -> Client:
        self._stack = contextlib.AsyncExitStack()
        self.nc = await self._stack.enter_async_context(connect_nats(self.nats_url, "test-client"))
        self.t = await self._stack.enter_async_context(
            create_transport(self.backend, TransportConfig(peer_id="test-client"))
        )
        bb = self.advert.reach.block_bytes
        self.pool = self.t.allocate(NUM_LOCAL * bb)
        self.region = self.t.register(self.pool, Access.LOCAL)
        self.client = KvStoreClient(self.nc, SUBJECTS, self.t, self.pool, self.region, bb, "test")
        self._stack.push_async_callback(self.client.aclose)
        self.target = StoreTarget(self.advert.store_id, self.advert.reach.descriptor)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    def blocks(self, tokens: list[int], slots: list[int], kv_spec: str = "") -> list[LocalBlock]:
        """The first len(slots) blocks of ``tokens``, named as the engine names them, lying in
        local blocks ``slots``."""
        kv_spec = kv_spec or self.advert.reach.kv_spec
        n = len(slots)
        hashes = prefix_block_hashes(tokens, BLOCK_SIZE, layout_root(kv_spec), n)
        digests = token_digests(tokens, BLOCK_SIZE, kv_spec, n)
        bb = self.advert.reach.block_bytes
        return [LocalBlock(h, d, s * bb) for h, d, s in zip(hashes, digests, slots, strict=True)]

    def block(self, slot: int) -> torch.Tensor:
        bb = self.advert.reach.block_bytes
        return self.pool[slot * bb : (slot + 1) * bb]


TOKENS = list(range(1000, 1000 + 6 * BLOCK_SIZE))
OTHER_TOKENS = list(range(2000, 2000 + 6 * BLOCK_SIZE))


def scrape(port: int) -> dict[str, float]:
    return prom_text.scrape(f"http://127.0.0.1:{port}/metrics")


@pytest.mark.parametrize("backend", ["shm", "tcp"])
async def test_store_put_then_get_reads_back_the_same_bytes_one_sided(
    nats_server: str, backend: str, unused_tcp_port: int
) -> None:
    flags = ("--num-blocks", "16", "--transport", backend, "--metrics-port", str(unused_tcp_port))
    async with (
        store_process(nats_server, "store-0", *flags) as advert,
        Client(nats_server, backend, advert) as c,
    ):
        torch.manual_seed(0)
        c.pool.copy_(torch.randint(0, 256, c.pool.shape, dtype=torch.uint8))
        sent = [c.block(s).clone() for s in range(4)]
        put = await c.client.put(c.target, advert.reach.kv_spec, c.blocks(TOKENS, [0, 1, 2, 3]))
        assert put.ok and len(put.committed) == 4 and put.rejected == ()
        again = await c.client.put(c.target, advert.reach.kv_spec, c.blocks(TOKENS, [0, 1, 2, 3]))
        assert again.ok and again.present == put.committed and again.committed == ()
        c.pool.zero_()
        got = await c.client.get(c.target, advert.reach.kv_spec, c.blocks(TOKENS, [7, 5, 4, 6, 1]))
        assert (got.num_blocks, got.num_offered, got.error) == (4, 4, "")  # block 5 never put
        for i, slot in enumerate([7, 5, 4, 6]):
            assert torch.equal(c.block(slot), sent[i]), f"block {i} differs"
        assert not c.block(1).any()  # nothing beyond the store's run was touched
        m = scrape(unused_tcp_port)
        assert m["kvmesh_store_hits_total"] == 4 and m["kvmesh_store_misses_total"] == 1
        assert m["kvmesh_store_commits_total"] == 4 and m["kvmesh_store_used_blocks"] == 4
        assert m["kvmesh_store_bytes_written_total"] == 4 * (advert.reach.block_bytes + 64)
        # a one-sided read is counted when the reader's notice reaches the store (shm: its
        # READ_DONE on the side socket), which may come after the get returned: wait for it
        read = 4 * (advert.reach.block_bytes + 64)
        deadline = time.monotonic() + 10
        while m["kvmesh_store_bytes_read_total"] < read and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            m = scrape(unused_tcp_port)
        assert m["kvmesh_store_bytes_read_total"] == read


async def test_store_restart_loses_its_cache_and_a_get_is_a_miss(nats_server: str) -> None:
    flags = ("--num-blocks", "8", "--transport", "tcp")
    async with (
        store_process(nats_server, "store-r", *flags) as first,
        Client(nats_server, "tcp", first) as c,
    ):
        put = await c.client.put(c.target, first.reach.kv_spec, c.blocks(TOKENS, [0, 1]))
        assert len(put.committed) == 2
    async with store_process(
        nats_server, "store-r", *flags, after_epoch=first.reach.epoch
    ) as second:
        assert second.load.used_blocks == 0
        async with Client(nats_server, "tcp", second) as c:
            got = await c.client.get(c.target, second.reach.kv_spec, c.blocks(TOKENS, [0, 1]))
            assert (got.num_blocks, got.num_offered, got.error) == (0, 0, "")


async def test_a_starting_reader_gets_every_stores_advert_at_once_not_at_its_heartbeat(
    nats_server: str,
) -> None:
    """A store heartbeating every 60 s answers a StoreSolicit with its advert at once: a worker
    that starts between two heartbeats knows the store in milliseconds."""
    async with (
        store_process(nats_server, "store-s", "--heartbeat-s", "60") as first,
        connect_nats(nats_server, "test-reader") as nc,
    ):
        adverts: asyncio.Queue[StoreAdvert] = asyncio.Queue()

        async def on_advert(msg) -> None:
            adverts.put_nowait(decode_message(msg.data, StoreAdvert))

        await nc.subscribe(SUBJECTS.REGISTRY_STORE_ADVERTISE, cb=on_advert)
        async with store_adverts_solicited(nc, SUBJECTS, "test-reader"):
            advert = await asyncio.wait_for(adverts.get(), 10.0)
        assert (advert.store_id, advert.reach.epoch) == ("store-s", first.reach.epoch)
        # a second solicit at once is within the store's interval: no second advert
        await nc.publish(
            SUBJECTS.REGISTRY_STORE_SOLICIT, encode_message(StoreSolicit("test-reader"))
        )
        await asyncio.sleep(0.05)
        assert adverts.empty()


async def test_store_full_of_pinned_blocks_refuses_a_put_at_once(nats_server: str) -> None:
    async with (
        # one writer may fill it: this test is about pins, not writers' shares
        store_process(nats_server, "store-f", "--num-blocks", "2", "--writer-share", "1") as advert,
        Client(nats_server, "tcp", advert) as c,
    ):
        blocks = c.blocks(TOKENS, [0, 1, 2])
        assert len((await c.client.put(c.target, advert.reach.kv_spec, blocks[:2])).committed) == 2
        hold = StoreGet("holder", advert.reach.kv_spec, tuple(b.block_hash for b in blocks[:2]))
        msg = await c.nc.request(SUBJECTS.store_get("store-f"), encode_message(hold), timeout=5)
        assert len(decode_message(msg.data, StoreGetReply).block_hashes) == 2  # both pinned
        t0 = time.monotonic()
        refused = await c.client.put(c.target, advert.reach.kv_spec, blocks)
        assert time.monotonic() - t0 < 2.0  # refused, not queued
        assert not refused.ok and "full of pinned blocks" in refused.error
        assert refused.retry_after_s > 0


async def test_store_refuses_a_request_naming_another_kv_layout(shared_store) -> None:
    url, proc, log, _ = shared_store
    advert = await next_advert(url, SHARED, proc, log)
    async with Client(url, "tcp", advert) as c:
        stale = advert.reach.kv_spec.replace("B16", "B32")
        assert stale != advert.reach.kv_spec
        put = await c.client.put(c.target, stale, c.blocks(TOKENS, [0], kv_spec=stale))
        assert not put.ok and "stale or foreign KV layout" in put.error
        got = await c.client.get(c.target, stale, c.blocks(TOKENS, [0], kv_spec=stale))
        assert got.num_blocks == 0 and "stale or foreign KV layout" in got.error


async def test_store_block_under_a_colliding_hash_is_refused_by_the_reader(shared_store) -> None:
    url, proc, log, _ = shared_store
    advert = await next_advert(url, SHARED, proc, log)
    async with Client(url, "tcp", advert) as c:
        mine = c.blocks(TOKENS, [0, 1])
        assert len((await c.client.put(c.target, advert.reach.kv_spec, mine)).committed) == 2
        other_tokens = [7, *TOKENS[1:]]  # other tokens that (we pretend) hash the same
        digests = token_digests(other_tokens, BLOCK_SIZE, advert.reach.kv_spec, 2)
        colliding = [
            LocalBlock(b.block_hash, d, b.offset) for b, d in zip(mine, digests, strict=True)
        ]
        got = await c.client.get(c.target, advert.reach.kv_spec, colliding)
        assert (got.num_blocks, got.num_offered) == (0, 2) and "token digest" in got.error


async def test_store_read_after_release_is_refused_and_counted(shared_store) -> None:
    url, proc, log, port = shared_store
    advert = await next_advert(url, SHARED, proc, log)
    refused = scrape(port)["kvmesh_store_refused_accesses_total"]
    async with Client(url, "tcp", advert) as c:
        blocks = c.blocks(OTHER_TOKENS, [0])  # blocks no other test puts
        assert len((await c.client.put(c.target, advert.reach.kv_spec, blocks)).committed) == 1
        ask = StoreGet("reader", advert.reach.kv_spec, (blocks[0].block_hash,))
        msg = await c.nc.request(SUBJECTS.store_get(SHARED), encode_message(ask), timeout=5)
        grant = decode_message(msg.data, StoreGetReply)
        entry = WriteEntry(c.region, 0, grant.block_addrs[0], grant.rkey, advert.reach.block_bytes)
        async with await c.t.connect(c.target.descriptor) as ep:
            await ep.read([entry])  # inside the window: served
            beside = WriteEntry(
                c.region, 0, grant.block_addrs[0] + 64, grant.rkey, advert.reach.block_bytes
            )
            with pytest.raises(RemoteAccessError):  # not the slot's span: refused
                await ep.read([beside])
            done = StoreRelease(grant.get_id, grant.rkey)
            msg = await c.nc.request(SUBJECTS.store_release(SHARED), encode_message(done), 5)
            assert decode_message(msg.data, StoreAck).ok
            with pytest.raises(RemoteAccessError):  # the window closed with the release
                await ep.read([entry])
        assert scrape(port)["kvmesh_store_refused_accesses_total"] == refused + 2


async def test_admin_status_lists_the_store_with_its_use_and_hit_rate(nats_server: str) -> None:
    from kvmesh.services.kv_registry.config import RegistryConfig
    from kvmesh.services.kv_registry.service import registry_service
    from kvmesh.shared.bus.admin_client import admin_client

    config = RegistryConfig(nats_url=nats_server, mesh=MESH, worker_id="reg-0", heartbeat_s=0.2)
    async with (
        registry_service(config),
        store_process(nats_server, "store-a", "--num-blocks", "4") as advert,
        Client(nats_server, "tcp", advert) as c,
        admin_client(nats_server, mesh=MESH) as admin,
    ):
        await c.client.put(c.target, advert.reach.kv_spec, c.blocks(TOKENS, [0, 1]))
        await c.client.get(c.target, advert.reach.kv_spec, c.blocks(TOKENS, [2, 3, 4]))  # 2 of 3
        for _ in range(100):  # the next advert carries the counts
            rows = (await admin.status()).stores
            if rows and rows[0].load.hits == 2:
                break
            await asyncio.sleep(0.1)
        [row] = rows
        assert (row.store_id, row.load.total_blocks, row.load.used_blocks) == ("store-a", 4, 2)
        assert (row.load.hits, row.load.misses, row.hit_rate) == (2, 1, round(2 / 3, 4))

        # drained: no new put (with what to do), gets still served, "draining" advertised
        assert (await admin.drain("store-a")).state == "draining"
        refused = await c.client.put(c.target, advert.reach.kv_spec, c.blocks(TOKENS, [2]))
        assert not refused.ok and "draining" in refused.error
        assert "kvmesh admin resume store-a" in refused.error
        got = await c.client.get(c.target, advert.reach.kv_spec, c.blocks(TOKENS, [0, 1]))
        assert got.num_blocks == 2
        for _ in range(100):
            [row] = (await admin.status()).stores
            if row.load.state == "draining":
                break
            await asyncio.sleep(0.1)
        assert row.load.state == "draining"
        assert (await admin.resume("store-a")).state == "ready"
        put = await c.client.put(c.target, advert.reach.kv_spec, c.blocks(TOKENS, [2]))
        assert put.ok and not put.error  # taken again (its block already held: present)


async def test_store_evicts_a_dropped_workers_blocks_and_refuses_puts_from_other_roles(
    nats_server: str,
) -> None:
    """Issue #27: blocks a compromised decode worker put were committed and served to every
    other worker for as long as the store kept them. Each block now records its writer; when
    the kv-registry drops that worker, its blocks go. A put whose reply goes to the inbox of a
    role that may not put (here the router's) is refused: only that role would learn the
    window's key."""
    import nats

    async with (
        store_process(nats_server, "store-o", "--num-blocks", "8") as advert,
        Client(nats_server, "tcp", advert) as c,
    ):
        put = await c.client.put(c.target, advert.reach.kv_spec, c.blocks(TOKENS, [0, 1]))
        assert put.ok and len(put.committed) == 2
        got = await c.client.get(c.target, advert.reach.kv_spec, c.blocks(TOKENS, [4, 5]))
        assert got.num_blocks == 2
        gone = WorkerGone(worker_id="test", role="decode", last_seen_s=3.0)
        await c.nc.publish(SUBJECTS.REGISTRY_WORKER_GONE, encode_message(gone))
        for _ in range(100):
            got = await c.client.get(c.target, advert.reach.kv_spec, c.blocks(TOKENS, [4, 5]))
            if got.num_blocks == 0:
                break
            await asyncio.sleep(0.05)
        assert got.num_blocks == 0  # the dropped worker's blocks are no longer served

        router = await nats.connect(nats_server, inbox_prefix=b"_INBOX_router")
        try:
            body = StorePut("router-0", advert.reach.kv_spec, (1, 2), 1000)
            msg = await router.request(
                SUBJECTS.store_put(advert.store_id), encode_message(body), timeout=10
            )
            reply = decode_message(msg.data, StorePutReply)
            assert not reply.ok and "may not put" in reply.error and reply.rkey == 0
        finally:
            await router.close()


async def test_store_starts_without_disk_tier_when_its_file_cannot_be_made(
    nats_server: str, tmp_path
) -> None:
    disk_dir = tmp_path / "disk"
    disk_dir.mkdir(mode=0o700)
    # a file of 1e9 GiB: no filesystem here makes it (a full disk fails the same way)
    flags = ("--num-blocks", "8", "--transport", "tcp", "--disk-path", str(disk_dir))
    with tempfile.TemporaryFile() as log:
        proc = spawn_store(nats_server, "store-nodisk", log, *flags, "--disk-capacity-gb", "1e9")
        try:
            advert = await next_advert(nats_server, "store-nodisk", proc, log)
            assert (advert.load.total_blocks, advert.load.disk_total_blocks) == (8, 0)
            async with Client(nats_server, "tcp", advert) as c:  # it serves from host memory
                put = await c.client.put(c.target, advert.reach.kv_spec, c.blocks(TOKENS, [0, 1]))
                assert len(put.committed) == 2
        finally:
            stop_store(proc)
        log.seek(0)
        output = log.read().decode()
    assert "no disk tier: serving from host memory only" in output and "File too large" in output
    assert list(disk_dir.iterdir()) == []
