"""The kv-store's disk tier (`--disk-path`, `--disk-capacity-gb`): a block the host pool evicts
is spilled to the store's file and is still a hit, its bytes read back one-sided and verified by
the reader; the file is the store's own (O_EXCL, mode 0600, unlinked at once); a disk path that
is not a writable directory is refused at start with a message that says why
(docs/kv_store.md)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kvmesh.services.kv_store.disk_file import DiskFile, check_disk_dir
from kvmesh.shared.config.service_errors import ServiceStartError
from kvmesh.shared.kv.kv_block_header import HEADER_BYTES
from test_kv_store_service import OTHER_TOKENS, TOKENS, Client, store_process

HOST_BLOCKS = 4


def scrape_tiers(port: int) -> dict[str, float]:
    """``name`` and ``name{tier="..."}`` of every sample of the store's metrics."""
    from kvmesh.loadgen import prom_text

    return prom_text.series(prom_text.fetch(f"http://127.0.0.1:{port}/metrics"))


def test_disk_dir_that_is_missing_a_file_or_read_only_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ServiceStartError, match="no such directory"):
        check_disk_dir(str(tmp_path / "nope"))
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(ServiceStartError, match="not a directory"):
        check_disk_dir(str(tmp_path / "f"))
    if os.geteuid() != 0:  # root may write anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(ServiceStartError, match="not writable"):
            check_disk_dir(str(ro))
    assert check_disk_dir(str(tmp_path)) == tmp_path


def test_disk_file_is_private_preallocated_unlinked_and_round_trips_a_slot(
    tmp_path: Path,
) -> None:
    disk = DiskFile.create(tmp_path, 3, 4096)
    try:
        st = os.fstat(disk.fd)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_size == 3 * (4096 + HEADER_BYTES) and st.st_nlink == 0  # unlinked
        assert list(tmp_path.iterdir()) == []  # nothing left behind, whatever ends the store
        block = torch.randint(0, 256, (4096,), dtype=torch.uint8)
        header = torch.randint(0, 256, (HEADER_BYTES,), dtype=torch.uint8)
        disk.write_slot(2, memoryview(block.numpy()), memoryview(header.numpy()))
        back, back_header = torch.zeros_like(block), torch.zeros_like(header)
        disk.read_slot(2, memoryview(back.numpy()), memoryview(back_header.numpy()))
        assert torch.equal(back, block) and torch.equal(back_header, header)
    finally:
        disk.close()


def test_store_refuses_to_start_on_a_disk_path_that_is_not_a_directory(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_bytes(b"")
    argv = [sys.executable, "-m", "kvmesh.cli", "serve", "kv-store", "--nats-url"]
    argv += ["nats://127.0.0.1:1", "--disk-path", str(target), "--disk-capacity-gb", "0.001"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert f"--disk-path {target}: not a directory" in done.stderr


@pytest.mark.slow
async def test_block_evicted_from_host_is_a_disk_hit_and_its_bytes_verify(
    nats_server: str, unused_tcp_port: int, tmp_path: Path
) -> None:
    flags = ("--num-blocks", str(HOST_BLOCKS), "--transport", "tcp")
    flags += ("--disk-path", str(tmp_path), "--disk-capacity-gb", "0.001")  # 16 slots
    flags += ("--metrics-port", str(unused_tcp_port))
    async with (
        store_process(nats_server, "store-d", *flags) as advert,
        Client(nats_server, "tcp", advert) as c,
    ):
        assert advert.load.disk_total_blocks == 16
        torch.manual_seed(1)
        c.pool.copy_(torch.randint(0, 256, c.pool.shape, dtype=torch.uint8))
        sent = [c.block(s).clone() for s in range(8)]
        first = await c.client.put(c.target, advert.reach.kv_spec, c.blocks(TOKENS, [0, 1, 2, 3]))
        assert len(first.committed) == 4
        # the host tier is full: these four evict the first four to disk
        second = await c.client.put(
            c.target, advert.reach.kv_spec, c.blocks(OTHER_TOKENS, [4, 5, 6, 7])
        )
        assert len(second.committed) == 4
        m = scrape_tiers(unused_tcp_port)
        assert m['kvmesh_store_tier_used_bytes{tier="disk"}'] == 4 * advert.reach.block_bytes
        assert m["kvmesh_store_spills_total"] == 4
        c.pool.zero_()
        got = await c.client.get(c.target, advert.reach.kv_spec, c.blocks(TOKENS, [4, 5, 6, 7]))
        assert (got.num_blocks, got.num_offered, got.error) == (4, 4, "")  # verified
        for i in range(4):
            assert torch.equal(c.block(4 + i), sent[i]), f"block {i} differs"
        # promoting them spilled the other four: those are disk hits in turn
        got = await c.client.get(
            c.target, advert.reach.kv_spec, c.blocks(OTHER_TOKENS, [0, 1, 2, 3])
        )
        assert (got.num_blocks, got.error) == (4, "")
        for i in range(4):
            assert torch.equal(c.block(i), sent[4 + i]), f"block {4 + i} differs"
        m = scrape_tiers(unused_tcp_port)
        assert m['kvmesh_store_tier_hits_total{tier="disk"}'] == 8
        assert m['kvmesh_store_tier_hits_total{tier="host"}'] == 0
        assert m["kvmesh_store_promotions_total"] == 8 and m["kvmesh_store_spills_total"] == 12
        assert m['kvmesh_store_tier_evictions_total{tier="host"}'] == 12
        assert m['kvmesh_store_tier_evictions_total{tier="disk"}'] == 0
        assert m["kvmesh_store_failed_copies_total"] == 0
        assert m["kvmesh_store_rejected_blocks_total"] == 0
        assert list(tmp_path.iterdir()) == []  # the store's file is unlinked
