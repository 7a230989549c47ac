"""The transport API without peers: descriptors, registry checks, backend choice."""

from __future__ import annotations

import asyncio
import dataclasses
import os

import msgspec
import pytest
import torch
from kvmesh.shared.kv.descriptor import RdmaBackend, ShmBackend, TcpBackend
from kvmesh.shared.transport import (
    Access,
    BackendUnavailableError,
    Completion,
    CompletionQueue,
    LocalAccessError,
    MemoryRegion,
    PeerUnreachableError,
    RefusalReason,
    Registry,
    RemoteAccessError,
    TransportConfig,
    TransportDescriptor,
    WriteEntry,
    auto,
    create_transport,
    local_host_id,
    select_backend,
)

SECRET = "ab" * 32  # a lane secret (64 hex digits)
TCP = TcpBackend("10.0.0.2", 4242, SECRET, lanes=4)


def test_descriptor_roundtrips_through_json() -> None:
    region = MemoryRegion(
        addr=0x7F00_0000_0000, length=1 << 30, rkey=0xDEADBEEF, access=Access.REMOTE
    )
    desc = TransportDescriptor(
        peer_id="decode-0",
        host_id=local_host_id(),
        backends=(TCP, ShmBackend("/x", "kvmesh-1-deadbeef-table")),
        regions=(region,),
    )
    back = msgspec.json.decode(msgspec.json.encode(desc), type=TransportDescriptor)
    assert back == desc
    assert back.backend("tcp") == TCP and back.backend("rdma") is None
    assert back.backend_names == ("tcp", "shm")
    assert back.region(0xDEADBEEF).access is Access.REMOTE
    with pytest.raises(KeyError, match="no region with rkey 7"):
        back.region(7)
    with pytest.raises(msgspec.ValidationError, match="missing required field `host_id`"):
        msgspec.json.decode(b'{"peer_id": "x"}', type=TransportDescriptor)


def test_descriptor_offering_a_backend_twice_is_refused() -> None:
    wire = msgspec.json.encode(TransportDescriptor("p", "h", (TCP,)))
    twice = wire.replace(b"[{", b"[" + msgspec.json.encode(TCP)[:-1] + b"},{", 1)
    with pytest.raises(msgspec.ValidationError, match="each backend once"):
        msgspec.json.decode(twice, type=TransportDescriptor)


def test_region_access_outside_the_flags_is_refused_on_the_wire() -> None:
    for access, match in ((4, "<= 3"), (-1, ">= 0")):
        wire = f'{{"addr": 1, "length": 2, "rkey": 3, "access": {access}}}'.encode()
        with pytest.raises(msgspec.ValidationError, match=match):
            msgspec.json.decode(wire, type=MemoryRegion)
    decoded = msgspec.json.decode(
        b'{"addr": 1, "length": 2, "rkey": 3, "access": 1}', type=MemoryRegion
    )
    assert decoded.access is Access.REMOTE_WRITE


def test_registry_refuses_unknown_rkey_bounds_access_and_closed() -> None:
    reg = Registry()
    mem = torch.zeros(4096, dtype=torch.uint8)
    region = reg.register(mem, Access.REMOTE_WRITE)
    assert (region.addr, region.length) == (mem.data_ptr(), 4096)
    # the region's own key opens nothing remotely; a window over all of it does
    err = reg.refusal(region.rkey, region.addr, 8, Access.REMOTE_WRITE)
    assert err is not None and "region's own key" in str(err)
    w = reg.open_window(region, [(region.addr, region.length)])
    r = MemoryRegion(region.addr, region.length, w.rkey, region.access)
    assert reg.refusal(r.rkey, r.addr, 4096, Access.REMOTE_WRITE) is None
    cases = {
        RefusalReason.UNKNOWN_RKEY: (r.rkey ^ 0x5A5A, r.addr, 8, Access.REMOTE_WRITE),
        RefusalReason.OUT_OF_BOUNDS: (r.rkey, r.addr + 4090, 8, Access.REMOTE_WRITE),
        RefusalReason.ACCESS_DENIED: (r.rkey, r.addr, 8, Access.REMOTE_READ),
        RefusalReason.BAD_LENGTH: (r.rkey, r.addr, 0, Access.REMOTE_WRITE),
    }
    for reason, args in cases.items():
        err = reg.refusal(*args)
        assert isinstance(err, RemoteAccessError) and err.reason == reason, (reason, err)
    with pytest.raises(RemoteAccessError, match="out_of_bounds"):
        reg.remote_view(r.rkey, r.addr - 1, 8, Access.REMOTE_WRITE)
    reg.deregister(region)
    err = reg.refusal(r.rkey, r.addr, 8, Access.REMOTE_WRITE)
    assert err is not None and err.reason == RefusalReason.DEREGISTERED
    assert "deregistered" in str(err)


def test_registry_local_view_checks_the_local_span() -> None:
    reg = Registry()
    mem = torch.arange(256, dtype=torch.int32)
    r = reg.register(mem)
    view = reg.local_view(r, 4, 8)
    assert view.data_ptr() == mem.data_ptr() + 4 and view.numel() == 8
    with pytest.raises(LocalAccessError):
        reg.local_view(r, 1020, 8)
    with pytest.raises(LocalAccessError, match="outside the local region"):
        WriteEntry(r, 1020, 0, 1, 8)
    reg.deregister(r)
    with pytest.raises(LocalAccessError, match="not registered"):
        reg.local_view(r, 0, 8)


def test_registry_counts_per_outcome() -> None:
    reg = Registry()
    reg.count_write(100)
    reg.count_write(28)
    reg.count_refused()
    reg.count_read(7)
    s = reg.stats()
    assert (s.writes, s.bytes, s.refused, s.reads, s.read_bytes) == (2, 128, 1, 1, 7)


async def test_completion_queue_delivers_in_order_across_threads_and_ends_on_close() -> None:
    q = CompletionQueue()

    def produce() -> None:
        for i in range(100):
            q.put(Completion(imm=i, peer_id="p", num_bytes=i))

    await asyncio.to_thread(produce)
    got = [await q.get() for _ in range(100)]
    assert [c.imm for c in got] == list(range(100))
    q.put(Completion(1, "p", 1))
    q.close()
    assert [c.imm async for c in q] == [1]


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="tcp_lanes"):
        TransportConfig(tcp_lanes=0)
    with pytest.raises(ValueError, match="tcp_port"):
        TransportConfig(tcp_port=70000)
    with pytest.raises(ValueError, match="tcp_slice_bytes"):
        TransportConfig(tcp_slice_bytes=10)


def test_create_transport_rdma_says_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auto, "rdma_status", lambda: (False, "no RDMA device found"))
    with pytest.raises(BackendUnavailableError, match="rdma backend unavailable: no RDMA device"):
        create_transport("rdma")
    with pytest.raises(ValueError, match="unknown transport"):
        create_transport("carrier-pigeon")


def test_rdma_status_explains_itself() -> None:
    ok, why = auto.rdma_status()
    assert isinstance(ok, bool) and why


RDMA = RdmaBackend("mlx5_0", 1, 0, "fe80::1", 0, 5, "10.0.0.2", 4791)


def _desc(host_id: str, *parts: ShmBackend | TcpBackend | RdmaBackend) -> TransportDescriptor:
    return TransportDescriptor(peer_id=f"p-{host_id}", host_id=host_id, backends=parts)


def test_select_backend_prefers_rdma_then_reachable_shm_then_tcp(tmp_path) -> None:
    import socket

    here = local_host_id()
    folder = tmp_path / "kvmesh-notify"
    folder.mkdir()
    sock = folder / "notify.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(sock))
    table = f"kvmesh-{os.getpid()}-5e1ec7ed-table"  # not in /dev/shm yet: shm unreachable
    tcp = TcpBackend("127.0.0.1", 1, SECRET)
    shm = ShmBackend(str(sock), table)
    local = _desc(here, shm, tcp, RDMA)
    assert select_backend(local, _desc(here, RDMA, tcp)) == "rdma"
    assert select_backend(local, _desc(here, shm, tcp)) == "tcp"  # table missing
    open(f"/dev/shm/{table}", "wb").close()
    try:
        assert select_backend(local, _desc(here, shm, tcp)) == "shm"
        assert select_backend(local, _desc("other-host", shm, tcp)) == "tcp"
    finally:
        os.unlink(f"/dev/shm/{table}")
        listener.close()
    bad_table = msgspec.structs.replace(shm, table="../x")
    assert select_backend(local, _desc(here, bad_table, tcp)) == "tcp"
    with pytest.raises(PeerUnreachableError, match="no common backend"):
        select_backend(_desc(here, tcp), _desc("other-host", shm))


def test_each_backend_reads_the_descriptor_part_its_name_tags() -> None:
    from kvmesh.shared.kv.descriptor import backend_name
    from kvmesh.shared.transport.rdma import RdmaTransport
    from kvmesh.shared.transport.shm import ShmTransport
    from kvmesh.shared.transport.tcp import TcpTransport

    parts = {"shm": ShmBackend("/x", "t"), "tcp": TCP, "rdma": RDMA}
    for kind in (ShmTransport, TcpTransport, RdmaTransport):
        assert backend_name(parts[kind.name]) == kind.name and isinstance(
            parts[kind.name], kind.part
        )


async def test_connect_to_a_peer_without_the_backend_says_what_it_offers() -> None:
    from kvmesh.shared.transport.tcp import TcpTransport

    shm_only = _desc("other-host", ShmBackend("/x", "kvmesh-1-deadbeef-table"))
    async with TcpTransport(TransportConfig()) as tx:
        with pytest.raises(
            PeerUnreachableError, match=r"offers no tcp backend \(it offers \['shm'\]\)"
        ):
            await tx.connect(shm_only)


def test_transport_config_is_frozen() -> None:
    cfg = TransportConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.tcp_lanes = 3  # type: ignore[misc]
