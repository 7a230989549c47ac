"""Memory for what the CPU kernels stream each decode step (the KV pool, packed weights), in
2 MiB transparent huge pages where the kernel grants them.

A decode step reads its KV cache as tiles of a few KiB scattered over the pool (one per block,
KV head, layer and K or V) and every weight once. With 4 KiB pages each tile is a page of its
own, so nearly every tile costs a TLB miss and a page walk before its first line can even be
asked for; with 2 MiB pages the walks all but vanish (a float32 decode step of SmolLM2-135M at
batch 8 and 1k context: attention 48 -> 38 ms on one Sapphire Rapids core, docs/models.md).

``huge_page_empty`` maps fresh anonymous memory, aligns it to 2 MiB and advises the kernel
(``madvise(MADV_HUGEPAGE)``): that is honoured when
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise`` (the defaults of
the common distributions) and is a no-op otherwise. The advice covers the tensor rounded up to
whole huge pages, so its last page may hold up to 2 MiB that no one uses (one pool, one arena
of a model's weights: a few MiB at most). The memory is zeroed by the kernel and resident only
once written. ``advise_huge_pages`` advises an existing mapping (a shared-memory segment:
honoured when ``shmem_enabled`` allows).
"""

from __future__ import annotations

import ctypes
import mmap

import torch

HUGE_PAGE = 2 << 20

_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only


def huge_page_empty(nbytes: int) -> torch.Tensor:
    """A flat uint8 CPU tensor of ``nbytes`` zero bytes in 2 MiB pages advised for huge pages (a
    plain zeroed tensor when ``nbytes`` is below one huge page or the OS has no
    ``MADV_HUGEPAGE``). The mapping lives as long as the tensor and its views."""
    if nbytes < 0:
        raise ValueError(f"nbytes must not be negative, got {nbytes}")
    if nbytes < HUGE_PAGE or _MADV_HUGEPAGE is None:  # under one page: not worth a mapping
        return torch.zeros(nbytes, dtype=torch.uint8)
    whole_pages = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    # private: a shared anonymous mapping is shmem, under shmem_enabled (often never)
    mm = mmap.mmap(-1, whole_pages + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mm, dtype=torch.uint8)  # keeps mm alive
    offset = -whole.data_ptr() % HUGE_PAGE
    advise_huge_pages(mm, offset, whole_pages)
    return whole[offset : offset + nbytes]


def advise_huge_pages(mm: mmap.mmap, offset: int, nbytes: int) -> bool:
    """Advise ``mm[offset:offset + nbytes]`` (``offset`` page-aligned) for huge pages; False
    where the OS has no such advice or refuses it."""
    if _MADV_HUGEPAGE is None or nbytes <= 0:
        return False
    try:
        mm.madvise(_MADV_HUGEPAGE, offset, nbytes)
    except OSError:  # EINVAL: a kernel built without transparent huge pages
        return False
    return True


class HugePageArena:
    """One ``huge_page_empty`` mapping handed out as tensors, each at a 64-byte boundary: many
    weights that are each under 2 MiB, or not a multiple of it, in huge pages all the same (a
    model's packed linear layers, its quantized weights). Sized up front: ``take`` past the end
    is an error. The mapping lives as long as any tensor taken from it."""

    ALIGN = 64

    def __init__(self, nbytes: int) -> None:
        self._buffer = huge_page_empty(nbytes)
        self._used = 0

    @classmethod
    def padded(cls, nbytes: int) -> int:
        """What a tensor of ``nbytes`` takes of an arena (its start aligned)."""
        return -(-nbytes // cls.ALIGN) * cls.ALIGN

    @property
    def free(self) -> int:
        return self._buffer.numel() - self._used

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous tensor (zero where never written) of the arena."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if self.padded(nbytes) > self.free:
            raise ValueError(
                f"a {nbytes}-byte tensor does not fit the arena's {self.free} bytes left"
            )
        start = self._used
        self._used += self.padded(nbytes)
        return self._buffer[start : start + nbytes].view(dtype).view(shape)

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of a CPU ``tensor`` in the arena."""
        return self.take(tuple(tensor.shape), tensor.dtype).copy_(tensor)


def release_freed_heap() -> bool:
    """Hand the C heap's freed pages back to the OS (glibc's ``malloc_trim(0)``): tensors moved
    into huge pages leave their old copies freed but resident, in holes of the heap that glibc
    would keep. False where the C library has no ``malloc_trim`` (musl, macOS)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True
