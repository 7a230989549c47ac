"""The 64-byte header a KV store keeps beside each block, and how readers verify a block.

A block in the store is named by its prefix hash (``shared/kv/prefix_hash.py``, 64 bits, rooted in
the KV layout). The header, written by the writer together with the block, says what the block
is: the hash, the layout root, a 128-bit *token digest* (a second chain, independent of the
hash: a 64-bit collision between two token sequences does not survive it) and the CRC32 of the
block's bytes. The store checks magic, hash, layout and CRC at commit; a reader checks all of it,
the token digest of its own tokens included, before it uses a block it read (torch-free).
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

HEADER_BYTES = 64
MAGIC = b"KVSB"
VERSION = 1
# magic, version, reserved, block hash, layout root, token digest (16 bytes), crc32 of the block,
# block length; padded to HEADER_BYTES
_LAYOUT = struct.Struct("<4sHHQQ16sII")
assert _LAYOUT.size <= HEADER_BYTES


class BlockVerifyError(ValueError):
    """A block read from a store is not the block asked for; it must not be used."""


@dataclass(frozen=True, slots=True)
class BlockHeader:
    block_hash: int
    layout: int  # layout_root(kv_spec)
    token_digest: bytes  # 16 bytes: token_digests()
    crc32: int
    num_bytes: int

    def pack(self) -> bytes:
        body = _LAYOUT.pack(
            MAGIC,
            VERSION,
            0,
            self.block_hash,
            self.layout,
            self.token_digest,
            self.crc32,
            self.num_bytes,
        )
        return body.ljust(HEADER_BYTES, b"\0")

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> BlockHeader:
        """Raises BlockVerifyError on a header that is not one (an empty or overwritten slot)."""
        if len(raw) < HEADER_BYTES:
            raise BlockVerifyError(f"header of {len(raw)} bytes, expected {HEADER_BYTES}")
        magic, version, _, block_hash, layout, digest, crc, num_bytes = _LAYOUT.unpack_from(raw)
        if magic != MAGIC or version != VERSION:
            raise BlockVerifyError(f"no block header (magic {magic!r}, version {version})")
        return cls(block_hash, layout, bytes(digest), crc, num_bytes)


def token_digests(
    token_ids: Sequence[int], block_size: int, kv_spec: str, num_blocks: int
) -> list[bytes]:
    """The token digest of each of the first ``num_blocks`` full blocks: ``d_i =
    blake2b-128(d_{i-1} || tokens of block i)``, ``d_{-1}`` derived from ``kv_spec``."""
    parent = hashlib.blake2b(kv_spec.encode(), digest_size=16, person=b"kvmesh-tokdig").digest()
    out = []
    for i in range(num_blocks):
        h = hashlib.blake2b(parent, digest_size=16, person=b"kvmesh-tokdig")
        h.update(array("q", token_ids[i * block_size : (i + 1) * block_size]).tobytes())
        parent = h.digest()
        out.append(parent)
    return out


def block_crc(block: bytes | memoryview) -> int:
    return zlib.crc32(block) & 0xFFFFFFFF


def make_header(
    block_hash: int, layout: int, token_digest: bytes, block: bytes | memoryview
) -> BlockHeader:
    """The header a writer puts beside ``block``."""
    return BlockHeader(block_hash, layout, token_digest, block_crc(block), len(memoryview(block)))


def check_stored(
    header: BlockHeader, block_hash: int, layout: int, block: bytes | memoryview
) -> None:
    """The store's commit check: the slot holds the reserved hash, layout and intact bytes."""
    if header.block_hash != block_hash:
        raise BlockVerifyError(
            f"header names hash {header.block_hash:#x}, reserved {block_hash:#x}"
        )
    if header.layout != layout:
        raise BlockVerifyError(
            f"header names layout {header.layout:#x}, the store's is {layout:#x}"
        )
    if header.num_bytes != len(memoryview(block)) or header.crc32 != block_crc(block):
        raise BlockVerifyError(f"block {block_hash:#x}: bytes do not match the header's CRC32")


def verify_block(
    raw_header: bytes | memoryview,
    block: bytes | memoryview,
    block_hash: int,
    layout: int,
    token_digest: bytes,
) -> None:
    """The reader's check of one block it read: raises BlockVerifyError unless the header names
    this hash, layout and token digest and the bytes that landed match its CRC32."""
    header = BlockHeader.unpack(raw_header)
    check_stored(header, block_hash, layout, block)
    if header.token_digest != token_digest:
        raise BlockVerifyError(
            f"block {block_hash:#x}: token digest differs (a hash collision: other tokens)"
        )
