"""A descriptor is data, never a path or an arbitrary endpoint (docs/security.md).

Each test reproduces an attack of the local probe: a forged descriptor naming a file by path, a
symlink planted in /dev/shm, a segment of another user, a region table pointing at another
transport's segment, a prefill job targeting something no decode worker advertised.
"""

from __future__ import annotations

import os

import msgspec
import pytest
import torch
from kvmesh.services.prefill.adverts import AdvertBook, UnvouchedJobError, check_job_against_advert
from kvmesh.services.prefill.plan import KVSpecMismatchError
from kvmesh.shared.bus.messages.codec import decode_message, encode_message
from kvmesh.shared.bus.messages.prefill_jobs import PrefillJob
from kvmesh.shared.bus.messages.workers import DecodeAdvert
from kvmesh.shared.kv.descriptor import ShmBackend, TcpBackend, TransportDescriptor
from kvmesh.shared.text.sampling import SamplingOptions
from kvmesh.shared.transport import Access, PeerUnreachableError, TransportConfig, WriteEntry
from kvmesh.shared.transport.shm import TABLE_DTYPE, ShmTransport
from kvmesh.shared.transport.shm_segments import (
    SHM_DIR,
    UntrustedDescriptorError,
    check_segment_name,
    check_socket_path,
)
from support.adverts import idle_advert, with_fields

SECRET = "ab" * 32  # a tcp descriptor's lane secret (64 hex digits)


def _forged(descriptor: TransportDescriptor, **shm: str) -> TransportDescriptor:
    """``descriptor`` with its shm part changed, as a peer would receive it: through a NATS
    message, where the schema takes the strings as data and the transport must refuse them."""
    forged = msgspec.structs.replace(descriptor.backend("shm"), **shm)
    heartbeat = encode_message(
        _advert(descriptor=msgspec.structs.replace(descriptor, backends=(forged,), regions=()))
    )
    advert = decode_message(heartbeat, DecodeAdvert)
    return advert.reach.descriptor


@pytest.fixture
def victim(tmp_path):
    """A 0600 file the attacker wants overwritten; its bytes must never change."""
    path = tmp_path / "victim.bin"
    path.write_bytes(b"precious" * 8192)
    path.chmod(0o600)
    return path


@pytest.mark.parametrize(
    "name",
    ["../../etc/passwd", "kvmesh-1-deadbeef-0/../../x", "/dev/shm/kvmesh-1-deadbeef-0", "", 7],
)
def test_segment_names_with_paths_are_refused(name):
    with pytest.raises(UntrustedDescriptorError, match="never paths"):
        check_segment_name(name)


async def test_shm_table_named_by_path_is_refused_and_the_file_is_untouched(victim):
    before = victim.read_bytes()
    traversal = os.path.relpath(victim, SHM_DIR)  # ../tmp/.../victim.bin
    async with ShmTransport(TransportConfig()) as rx, ShmTransport(TransportConfig()) as tx:
        rx.register(rx.allocate(4096), Access.REMOTE_WRITE)
        with pytest.raises(UntrustedDescriptorError):
            await tx.connect(_forged(rx.descriptor(), table=traversal))
    assert victim.read_bytes() == before


async def test_shm_socket_outside_a_kvmesh_folder_is_refused(tmp_path):
    async with ShmTransport(TransportConfig()) as rx, ShmTransport(TransportConfig()) as tx:
        for bad in ("/run/docker.sock", str(tmp_path / "notify.sock"), "rel/kvmesh-x/notify.sock"):
            with pytest.raises(UntrustedDescriptorError):
                await tx.connect(_forged(rx.descriptor(), socket=bad))
        good = rx.socket_path
        assert check_socket_path(good) == good
        with pytest.raises(UntrustedDescriptorError, match="normalized"):
            check_socket_path(good.replace("/notify.sock", "/../x/notify.sock"))


async def _connect_to_forged_table(name: str) -> None:
    """Connect to a receiver whose descriptor names the segment ``name`` as its region table."""
    async with ShmTransport(TransportConfig()) as rx, ShmTransport(TransportConfig()) as tx:
        await tx.connect(_forged(rx.descriptor(), table=name))


async def test_symlink_planted_under_a_segment_name_is_not_followed(victim):
    before = victim.read_bytes()
    name = f"kvmesh-{os.getpid()}-0badc0de-table"
    link = os.path.join(SHM_DIR, name)
    os.symlink(victim, link)
    try:
        with pytest.raises(PeerUnreachableError, match="cannot map"):
            await _connect_to_forged_table(name)
    finally:
        os.unlink(link)
    assert victim.read_bytes() == before


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create a file of another user")
async def test_segment_of_another_user_is_refused():
    name = f"kvmesh-{os.getpid()}-0ddba11a-table"
    path = os.path.join(SHM_DIR, name)
    with open(path, "wb") as f:
        f.write(bytes(TABLE_DTYPE.itemsize * 4))
    os.chown(path, 65534, 65534)  # nobody
    try:
        with pytest.raises(UntrustedDescriptorError, match="belongs to uid 65534"):
            await _connect_to_forged_table(name)
    finally:
        os.unlink(path)


async def test_region_table_row_naming_another_transports_segment_is_refused():
    async with (
        ShmTransport(TransportConfig()) as rx,
        ShmTransport(TransportConfig()) as other,
        ShmTransport(TransportConfig()) as tx,
    ):
        mem = rx.allocate(4096)
        registered = rx.register(mem, Access.REMOTE_WRITE)
        window = rx.open_window(registered, [(registered.addr, 4096)])
        other.allocate(4096)
        foreign = f"{other._token}-0"
        # what a table forged by (or corrupted in) the receiver could say
        [slot] = rx._window_slots[window.rkey]
        rx._table["segment"][slot] = foreign.encode()
        src = tx.register(torch.ones(4096, dtype=torch.uint8))
        async with await tx.connect(rx.descriptor()) as ep:
            with pytest.raises(UntrustedDescriptorError, match="another transport"):
                await ep.write([WriteEntry(src, 0, registered.addr, window.rkey, 4096)], 1)
        assert int(mem.sum()) == 0


# ---- prefill jobs are checked against the decode worker's own advert ---------------------------


BASE = 0x10000  # where the blocks are: the job knows it, the advert does not


def _advert(**changes):
    idle = idle_advert(
        "d0",
        TransportDescriptor("d0", "h", (TcpBackend("127.0.0.1", 1, SECRET),)),
        block_bytes=1024,
        block_size=16,
        kv_spec="spec-a",
        total_blocks=8,
    )
    return with_fields(idle, **changes)


def _job(advert, **changes):
    fields = dict(
        request_id="r",
        prompt_ids=(1, 2, 3),
        sampling=SamplingOptions(temperature=0.0),
        decode_worker_id=advert.worker_id,
        lease_id="L",
        descriptor=advert.reach.descriptor,
        rkey=7,
        block_addrs=(BASE + 2 * advert.reach.block_bytes, BASE + 5 * advert.reach.block_bytes),
        block_bytes=advert.reach.block_bytes,
        enqueued_at=0.0,
    )
    return PrefillJob(**{**fields, **changes})


def test_job_matching_the_advert_is_vouched_for():
    advert = _advert()
    check_job_against_advert(_job(advert), advert, "spec-a")


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        (
            {"descriptor": TransportDescriptor("d0", "h", (TcpBackend("10.9.9.9", 22, SECRET),))},
            "descriptor",
        ),
        (
            {"descriptor": TransportDescriptor("d0", "h", (ShmBackend("/x", "../../etc/shadow"),))},
            "descriptor",
        ),
        ({"block_bytes": 2048}, "block_bytes"),
        ({"block_addrs": (BASE, BASE + 8 * 1024)}, "not a block"),  # wider than the pool
        ({"block_addrs": (BASE, BASE + 100)}, "not a block"),  # not whole blocks apart
        ({"block_addrs": (BASE, BASE)}, "not a block"),  # the same block twice
        ({"block_addrs": (-1024,)}, "not a block"),  # no address
    ],
)
def test_job_that_differs_from_the_advert_is_refused(changes, match):
    advert = _advert()
    with pytest.raises(UnvouchedJobError, match=match):
        check_job_against_advert(_job(advert, **changes), advert, "spec-a")


def test_job_for_a_decode_worker_with_another_kv_layout_is_refused():
    advert = _advert(kv_spec="spec-b")
    with pytest.raises(KVSpecMismatchError, match="same model"):
        check_job_against_advert(_job(advert), advert, "spec-a")


async def test_job_for_a_worker_never_heard_is_refused_after_the_wait():
    book = AdvertBook("spec-a")
    with pytest.raises(UnvouchedJobError, match="has not advertised"):
        await book.vouch(_job(_advert()), timeout_s=0.05)


async def test_job_waits_for_the_first_advert_of_a_new_worker():
    import asyncio

    book = AdvertBook("spec-a")
    advert = _advert()
    pending = asyncio.create_task(book.vouch(_job(advert), timeout_s=5.0))
    await asyncio.sleep(0.05)
    assert not pending.done()
    book.note(advert)
    assert await asyncio.wait_for(pending, 1.0) == advert
