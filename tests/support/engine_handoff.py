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


def prefill_handoff(
    prefill: Any, decode: Any, prompt_ids: list[int], params: Any, request_id: str = "r"
) -> tuple[list, list[int]]:
    """Prefill ``prompt_ids`` on ``prefill`` (``prefill_only``), its chunks copied into blocks
    reserved for them on ``decode``, then release the request on the prefill side. Returns the
    chunks (the last has the first token) and the reserved blocks, to admit on ``decode``."""
    reserved = decode.reserve_blocks(len(prompt_ids))
    chunks, on_chunk = chunk_copier(prefill, decode, reserved)
    prefill.add_request(request_id, prompt_ids, params, prefill_only=True, on_chunk=on_chunk)
    while prefill.has_unfinished():
        prefill.step()
    prefill.release(request_id)
    return chunks, reserved
