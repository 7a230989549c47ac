"""The transport API without peers: descriptors, registry checks, backend choice."""

from __future__ import annotations

import asyncio
import dataclasses
import os

import orjson
import pytest
import torch
from kvmesh.shared.transport import (
    Access,
    BackendUnavailableError,
    Completion,
    CompletionQueue,
    LocalAccessError,
    MemoryRegion,
    PeerDescriptor,
    PeerUnreachableError,
    RefusalReason,
    Registry,
    RemoteAccessError,
    TransportConfig,
    WriteEntry,
    auto,
    create_transport,
    local_host_id,
    select_backend,
)


def test_descriptor_roundtrips_through_orjson() -> None:
    region = MemoryRegion(
        addr=0x7F00_0000_0000, length=1 << 30, rkey=0xDEADBEEF, access=Access.REMOTE
    )
    desc = PeerDescriptor(
        peer_id="decode-0",
        host_id=local_host_id(),
        backends={"tcp": {"host": "10.0.0.2", "port": 4242, "lanes": 4}, "shm": {"socket": "/x"}},
        regions=(region,),
    )
    back = PeerDescriptor.from_dict(orjson.loads(orjson.dumps(desc.to_dict())))
    assert back == desc
    assert back.region(0xDEADBEEF).access == Access.REMOTE
    with pytest.raises(ValueError, match="malformed PeerDescriptor"):
        PeerDescriptor.from_dict({"peer_id": "x"})


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


def _desc(host_id: str, **backends: dict) -> PeerDescriptor:
    return PeerDescriptor(peer_id=f"p-{host_id}", host_id=host_id, backends=backends)


def test_select_backend_prefers_rdma_then_reachable_shm_then_tcp(tmp_path) -> None:
    import socket

    here = local_host_id()
    folder = tmp_path / "kvmesh-notify"
    folder.mkdir()
    sock = folder / "notify.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(sock))
    table = f"kvmesh-{os.getpid()}-5e1ec7ed-table"  # not in /dev/shm yet: shm unreachable
    tcp = {"host": "127.0.0.1", "port": 1, "lanes": 1}
    shm = {"socket": str(sock), "table": table}
    local = _desc(here, shm=shm, tcp=tcp, rdma={})
    assert select_backend(local, _desc(here, rdma={}, tcp=tcp)) == "rdma"
    assert select_backend(local, _desc(here, shm=shm, tcp=tcp)) == "tcp"  # table missing
    open(f"/dev/shm/{table}", "wb").close()
    try:
        assert select_backend(local, _desc(here, shm=shm, tcp=tcp)) == "shm"
        assert select_backend(local, _desc("other-host", shm=shm, tcp=tcp)) == "tcp"
    finally:
        os.unlink(f"/dev/shm/{table}")
        listener.close()
    assert select_backend(local, _desc(here, shm={**shm, "table": "../x"}, tcp=tcp)) == "tcp"
    with pytest.raises(PeerUnreachableError, match="no common backend"):
        select_backend(_desc(here, tcp=tcp), _desc("other-host", shm=shm))


def test_transport_config_is_frozen() -> None:
    cfg = TransportConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.tcp_lanes = 3  # type: ignore[misc]
