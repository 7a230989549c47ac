"""The immediate's layout (kvmesh.shared.kv.imm): slot and chunk round-trip, slots derived from block
addresses are distinct within a pool, and every limit is refused with an error that names it."""

from __future__ import annotations

import subprocess
import sys

import pytest
from kvmesh.shared.kv.imm import (
    IMM_CHUNK_BITS,
    IMM_MAX,
    IMM_SLOT_BITS,
    MAX_CHUNKS,
    MAX_SLOTS,
    ImmediateError,
    check_imm,
    imm_slot,
    pack_imm,
    unpack_imm,
)


def test_layout_fills_32_bits_with_slot_above_chunk() -> None:
    assert IMM_SLOT_BITS + IMM_CHUNK_BITS == 32 and IMM_MAX == 0xFFFF_FFFF
    assert (MAX_SLOTS, MAX_CHUNKS) == (1 << 20, 1 << 12)
    assert pack_imm(1, 0) == 1 << IMM_CHUNK_BITS and pack_imm(0, 1) == 1
    assert pack_imm(MAX_SLOTS - 1, MAX_CHUNKS - 1) == IMM_MAX


@pytest.mark.parametrize(
    "slot,chunk", [(0, 0), (1, 2), (MAX_SLOTS - 1, MAX_CHUNKS - 1), (12345, 77), (0, 4095)]
)
def test_pack_imm_roundtrips_slot_and_chunk(slot: int, chunk: int) -> None:
    imm = pack_imm(slot, chunk)
    assert check_imm(imm) == imm
    assert unpack_imm(imm) == (slot, chunk)


def test_unpack_imm_splits_every_32_bit_value() -> None:
    for imm in (0, 1, 0x1000, 0xDEAD_BEEF, IMM_MAX):
        assert pack_imm(*unpack_imm(imm)) == imm


@pytest.mark.parametrize(
    "slot,chunk,message",
    [
        (-1, 0, "slot must be in"),
        (MAX_SLOTS, 0, "slot must be in"),
        (0, MAX_CHUNKS, "at most 4096 chunks"),
        (0, -1, "at most 4096 chunks"),
    ],
)
def test_pack_imm_refuses_values_that_do_not_fit(slot: int, chunk: int, message: str) -> None:
    with pytest.raises(ImmediateError, match=message):
        pack_imm(slot, chunk)


@pytest.mark.parametrize("imm", [-1, IMM_MAX + 1, 1.0, "7", None])
def test_unpack_imm_refuses_what_is_not_a_32_bit_unsigned_int(imm: object) -> None:
    with pytest.raises(ImmediateError, match="32-bit unsigned int"):
        unpack_imm(imm)  # type: ignore[arg-type]


def test_immediate_error_is_a_value_error() -> None:
    assert issubclass(ImmediateError, ValueError)


def test_imm_slot_distinct_for_distinct_first_blocks_of_a_full_pool() -> None:
    base, block_bytes = 0x7F00_0000_1234, 65536  # an unaligned base still gives distinct slots
    slots = {imm_slot(base + b * block_bytes, block_bytes) for b in range(MAX_SLOTS)}
    assert len(slots) == MAX_SLOTS


def test_imm_slot_wraps_past_the_slot_bits() -> None:
    assert imm_slot(MAX_SLOTS * 4096, 4096) == 0
    assert imm_slot((MAX_SLOTS + 3) * 4096 + 17, 4096) == 3


@pytest.mark.parametrize(
    "addr,block_bytes,message",
    [(0, 0, "block_bytes must be positive"), (-4096, 4096, "block address must be >= 0")],
)
def test_imm_slot_refuses_impossible_addresses(addr: int, block_bytes: int, message: str) -> None:
    with pytest.raises(ImmediateError, match=message):
        imm_slot(addr, block_bytes)


def test_imm_module_imports_without_torch() -> None:
    code = "import sys, kvmesh.shared.kv.imm; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
