"""shm backend specifics: segments, the region table seen by writers, cleanup."""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess

import msgspec
import pytest
import torch
from kvmesh.shared.kv.descriptor import TransportDescriptor
from kvmesh.shared.transport import Access, PeerUnreachableError, TransportConfig, WriteEntry
from kvmesh.shared.transport.shm import ShmTransport
from kvmesh.shared.transport.shm_segments import SHM_DIR
from support.transport_wire import remote


def segments() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(f"kvmesh-{os.getpid()}-")}


async def test_allocate_creates_segments_that_close_unlinks() -> None:
    before = segments()
    async with ShmTransport(TransportConfig()) as t:
        mem = t.allocate(10_000)
        assert mem.numel() == 10_000 and mem.dtype == torch.uint8
        assert mem.data_ptr() % 4096 == 0
        assert len(segments() - before) == 2  # the region table and the segment
        socket_path = t.socket_path
        assert os.path.exists(socket_path)
    assert segments() == before
    assert not os.path.exists(socket_path)


async def test_remote_registration_outside_a_segment_is_refused_with_a_hint() -> None:
    async with ShmTransport(TransportConfig()) as t:
        with pytest.raises(ValueError, match=r"transport\.allocate\(\)"):
            t.register(torch.zeros(4096, dtype=torch.uint8), Access.REMOTE_WRITE)
        local = t.register(torch.zeros(4096, dtype=torch.uint8))  # local sources are fine
        assert local.length == 4096


async def test_descriptor_names_socket_and_table_but_no_region_key_when_public() -> None:
    async with ShmTransport(TransportConfig()) as t:
        mem = t.allocate(8192)
        r = t.register(mem[4096:], Access.REMOTE_WRITE)
        wire = msgspec.json.encode(t.descriptor())
        descriptor = msgspec.json.decode(wire, type=TransportDescriptor)
        info = descriptor.backend("shm")
        assert info is not None and info.socket == t.socket_path
        assert os.path.exists(os.path.join(SHM_DIR, info.table))
        assert descriptor.region(r.rkey) == r
        public = descriptor.public()
        assert public.regions == () and str(r.rkey).encode() not in msgspec.json.encode(public)


async def test_writes_through_a_sub_region_land_at_the_right_offset() -> None:
    async with ShmTransport(TransportConfig()) as rx, ShmTransport(TransportConfig()) as tx:
        mem = rx.allocate(3 * 4096)
        r = remote(rx, rx.register(mem[4096:8192], Access.REMOTE_WRITE))  # offset in its segment
        src = torch.arange(256, dtype=torch.uint8).repeat(16)
        local = tx.register(src)
        async with await tx.connect(rx.descriptor()) as ep:
            await asyncio.wait_for(ep.write([WriteEntry(local, 0, r.addr, r.rkey, 4096)], 3), 10)
        assert torch.equal(mem[4096:8192], src)
        assert int(mem[:4096].sum()) == 0 and int(mem[8192:].sum()) == 0


# A write's copy into the peer's segment runs in a thread; the endpoint is closed (a failed
# write's teardown, the peer killed) while it runs, then the copy goes on. Run apart: before
# mapping_tensor, the close unmapped the segment under the copy and the process segfaulted.
_COPY_AFTER_CLOSE = """
import asyncio, threading, torch
from kvmesh.shared.transport import Access, TransportConfig, WriteEntry
from kvmesh.shared.transport import shm_endpoint
from kvmesh.shared.transport.shm import ShmTransport

go, copying = threading.Event(), threading.Event()
copy_all = shm_endpoint._copy_all

def held_copy(pairs):
    copying.set()
    go.wait(10)
    copy_all(pairs)

shm_endpoint._copy_all = held_copy

async def main():
    async with ShmTransport(TransportConfig()) as rx, ShmTransport(TransportConfig()) as tx:
        mem = rx.allocate(1 << 20)
        region = rx.register(mem, Access.REMOTE_WRITE)
        rkey = rx.open_window(region, [(region.addr, region.length)], region.access).rkey
        src = torch.full((1 << 20,), 7, dtype=torch.uint8)
        local = tx.register(src)
        ep = await tx.connect(rx.descriptor())
        write = asyncio.ensure_future(ep.write([WriteEntry(local, 0, region.addr, rkey, 1 << 20)], 1))
        await asyncio.to_thread(copying.wait, 10)
        await ep.aclose()  # the mappings closed under the copy
        go.set()
        await asyncio.gather(write, return_exceptions=True)  # its notice: the endpoint is closed
        assert int(mem.sum()) == 7 << 20, int(mem.sum())
    print("copied")

asyncio.run(main())
"""


def test_a_copy_in_flight_outlives_the_endpoint_closing_its_mappings() -> None:
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _COPY_AFTER_CLOSE], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "copied", (
        done.returncode,
        done.stderr[-2000:],
    )


def test_a_mapping_tensor_keeps_its_mapping_until_the_last_view_is_gone():
    """torch.frombuffer on an mmap holds no export: mm.close() unmapped it under live tensors.
    mapping_tensor's does: close is refused (BufferError) while a view lives."""
    import mmap

    from kvmesh.shared.config.mapped_memory import mapping_tensor

    mm = mmap.mmap(-1, 1 << 16)
    view = mapping_tensor(mm)[4096:8192]
    with pytest.raises(BufferError):
        mm.close()
    view.fill_(3)  # still mapped
    assert mm[4096] == 3 and not mm.closed
    del view
    gc.collect()
    mm.close()  # no view left: closes
    assert mm.closed


async def test_connect_to_another_host_is_unreachable() -> None:
    async with ShmTransport(TransportConfig()) as rx, ShmTransport(TransportConfig()) as tx:
        d = rx.descriptor()
        elsewhere = msgspec.structs.replace(d, host_id="other-host/boot")
        with pytest.raises(PeerUnreachableError, match="not this one"):
            await tx.connect(elsewhere)


async def test_start_sweeps_segments_left_by_dead_processes() -> None:
    proc = subprocess.Popen(["true"])  # its pid is free once it has exited
    proc.wait()
    stale = os.path.join(SHM_DIR, f"kvmesh-{proc.pid}-deadbeef-0")
    live = os.path.join(SHM_DIR, f"kvmesh-{os.getpid()}-deadbeef-0")
    # another user's: not ours to judge (its pid may be in another pid namespace) or remove
    theirs = os.path.join(SHM_DIR, f"kvmesh-{proc.pid}-deadbeef-1")
    for path in (stale, live, theirs):
        with open(path, "wb") as f:
            f.write(b"x")
    if os.geteuid() == 0:
        os.chown(theirs, 65534, 65534)
    else:
        os.unlink(theirs)
    try:
        async with ShmTransport(TransportConfig()):
            assert not os.path.exists(stale)
            assert os.path.exists(live)
            assert os.path.exists(theirs) == (os.geteuid() == 0)
    finally:
        for path in (stale, live, theirs):
            if os.path.exists(path):
                os.unlink(path)


async def test_start_sweeps_socket_folders_left_by_dead_receivers(tmp_path) -> None:
    """A receiver killed before closing leaves ``kvmesh-<pid>-*/notify.sock``; the next start
    in that folder removes it, and nothing else: a live pid's, or one holding other files."""
    import socket

    proc = subprocess.Popen(["true"])
    proc.wait()
    stale, live, busy = (
        tmp_path / n
        for n in (f"kvmesh-{proc.pid}-a", f"kvmesh-{os.getpid()}-b", f"kvmesh-{proc.pid}-c")
    )
    for folder in (stale, live, busy):
        folder.mkdir()
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(str(folder / "notify.sock"))
    (busy / "notes.txt").write_text("not a socket folder alone")
    async with ShmTransport(TransportConfig(shm_dir=str(tmp_path))) as transport:
        assert not stale.exists()
        assert live.exists() and busy.exists()
        own = os.path.dirname(transport.socket_path)
        assert os.path.basename(own).startswith(f"kvmesh-{os.getpid()}-")
    assert not os.path.exists(own)
