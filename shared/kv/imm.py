"""The immediate of a KV write: which reservation and which chunk of it a write carries.

Every KV write a prefill worker makes into a decode worker's pool carries 32 bits of immediate
data (verbs' ``imm_data``; the tcp and shm backends carry the same 32 bits). kvmesh packs the
request's *slot* and the write's *chunk index* into them::

    bit 31 ............... 12 11 ......... 0
        slot (IMM_SLOT_BITS)   chunk (IMM_CHUNK_BITS)

The slot comes from the address of the request's first reserved decode block,
``(first_block_addr // block_bytes) mod MAX_SLOTS``, so the prefill worker (which sees the job's
block addresses) and the decode worker (which reserved the blocks) agree on it without another
field on the wire. Block ``b`` of a pool lies at ``base + b * block_bytes``, which makes
``addr // block_bytes == base // block_bytes + b``: the slots of distinct first blocks differ as
long as the pool has at most MAX_SLOTS blocks, the limit of a decode worker's pool. One request
is written in at most MAX_CHUNKS chunks.

Users: the decode worker derives the slot when it reserves blocks and splits each immediate that
arrives (services/decode/worker.py, services/decode/pending.py); the prefill plan derives the
same slot from the job and tags each chunk's write (services/prefill/plan.py); every transport
checks that an immediate fits 32 bits. Torch-free, so that any process can import it.
"""

from __future__ import annotations

IMM_BITS = 32
IMM_SLOT_BITS = 20
IMM_CHUNK_BITS = IMM_BITS - IMM_SLOT_BITS
IMM_MAX = (1 << IMM_BITS) - 1
MAX_SLOTS = 1 << IMM_SLOT_BITS  # 1,048,576: requests in flight per decode worker, blocks per pool
MAX_CHUNKS = 1 << IMM_CHUNK_BITS  # 4,096 chunk writes per request


class ImmediateError(ValueError):
    """A value that does not fit the immediate's layout (the message says which limit)."""


def imm_slot(first_block_addr: int, block_bytes: int) -> int:
    """The slot of the request whose first reserved decode block lies at ``first_block_addr``
    in a pool of ``block_bytes``-byte blocks (the receiver's address space)."""
    if block_bytes <= 0:
        raise ImmediateError(f"block_bytes must be positive, got {block_bytes}")
    if first_block_addr < 0:
        raise ImmediateError(f"a block address must be >= 0, got {first_block_addr}")
    return (first_block_addr // block_bytes) % MAX_SLOTS


def pack_imm(slot: int, chunk: int) -> int:
    """The immediate of chunk ``chunk`` of the request in ``slot``: ``slot << 12 | chunk``."""
    if not 0 <= slot < MAX_SLOTS:
        raise ImmediateError(f"an immediate's slot must be in [0, {MAX_SLOTS}), got {slot}")
    if not 0 <= chunk < MAX_CHUNKS:
        raise ImmediateError(
            f"a request is written in at most {MAX_CHUNKS} chunks, got chunk index {chunk}: "
            "prefill it in larger chunks"
        )
    return (slot << IMM_CHUNK_BITS) | chunk


def unpack_imm(imm: int) -> tuple[int, int]:
    """``(slot, chunk)`` of an immediate: the inverse of ``pack_imm``."""
    check_imm(imm)
    return imm >> IMM_CHUNK_BITS, imm & (MAX_CHUNKS - 1)


def check_imm(imm: int) -> int:
    """``imm`` itself if it is a 32-bit unsigned int; raises ImmediateError otherwise."""
    if not isinstance(imm, int) or not 0 <= imm <= IMM_MAX:
        raise ImmediateError(f"an immediate must be a 32-bit unsigned int, got {imm!r}")
    return imm
