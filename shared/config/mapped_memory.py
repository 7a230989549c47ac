"""A tensor over a memory mapping that keeps the mapping while any view of it lives.

``torch.frombuffer(mm)`` keeps the mmap object alive but holds no buffer export of it, so
``mm.close()`` unmaps the memory at once, under every tensor still viewing it: the next copy
into one is a segfault. A prefill worker died so: a failed KV write to a killed decode worker
closed the shm endpoint, and with it the endpoint's mappings of that worker's segments, while
another chunk's copy into one was still running in a thread. ``mapping_tensor`` holds an export
(a memoryview): ``mm.close()`` then raises ``BufferError``, which ``close_mapping`` leaves be,
and the memory is unmapped when the last view is gone. (A transport's own memory, viewed by its
KVPool for the worker's life, is still unmapped by the transport's close, at shutdown.)
"""

from __future__ import annotations

import mmap

import torch


def mapping_tensor(mm: mmap.mmap) -> torch.Tensor:
    """``mm``'s bytes as a flat uint8 tensor that keeps ``mm`` mapped while it or a view of it
    lives (``mm.close()`` meanwhile raises ``BufferError``)."""
    return torch.frombuffer(memoryview(mm), dtype=torch.uint8)
