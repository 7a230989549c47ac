"""A prefill handoff between two in-process engines, as the data plane does it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def chunk_copier(prefill: Any, decode: Any, reserved: Sequence[int]) -> tuple[list, Callable]:
    """An ``on_chunk`` callback for ``prefill.add_request(..., prefill_only=True)`` that copies
    each chunk's blocks into ``reserved`` (blocks of the ``decode`` engine's pool), in order; and
    the list of the chunks it was given."""
    chunks: list = []

    def on_chunk(chunk: Any) -> None:
        chunks.append(chunk)
        done = sum(len(c.block_ids) for c in chunks[:-1])
        for i, src in enumerate(chunk.block_ids):
            decode.kv_pool.block_bytes_view(reserved[done + i]).copy_(
                prefill.kv_pool.block_bytes_view(src)
            )

    return chunks, on_chunk
