"""Memory in transparent huge pages for what a decode step streams (shared/config/huge_pages.py):
the advice holds on the tensor's whole 2 MiB pages (read back from /proc/self/smaps), the
memory is zeroed, outlives the caller's names for it, and an arena hands out aligned tensors
and refuses to overflow. The KV pool and a float32 model's packed weights come from it."""

from __future__ import annotations

import dataclasses
import gc
import platform
from pathlib import Path

import pytest
import torch
from kvmesh.shared.config.huge_pages import (
    HUGE_PAGE,
    HugePageArena,
    huge_page_empty,
    release_freed_heap,
)
from kvmesh.shared.kv.kv_cache import KVCacheSpec, KVPool
from kvmesh.shared.model.backend import CpuBackend
from kvmesh.shared.model.cpu_modules import CpuQuantLinear, PackedLinear
from kvmesh.shared.model.quant import quantize
from support.cpu_layers import layer_config, quantized_twins, random_model

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_eligible(addr: int) -> bool | None:
    """Whether the mapping holding ``addr`` may take huge pages (smaps' THPeligible)."""
    eligible, inside = None, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "THPeligible:":
            eligible = line.split()[1] == "1"
    return eligible


needs_thp = pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(),
    reason="this kernel grants no transparent huge pages (enabled: never, or none built in)",
)


def test_small_tensors_are_plain_zeroed_memory():
    t = huge_page_empty(HUGE_PAGE - 1)
    assert t.dtype == torch.uint8 and t.shape == (HUGE_PAGE - 1,)
    assert int(t.count_nonzero()) == 0
    with pytest.raises(ValueError, match="must not be negative"):
        huge_page_empty(-1)


@needs_thp
def test_a_large_tensor_is_aligned_zeroed_and_advised_and_lives_on_its_own():
    t = huge_page_empty(3 * HUGE_PAGE + 4096)
    assert t.data_ptr() % HUGE_PAGE == 0
    assert int(t.count_nonzero()) == 0
    assert _thp_eligible(t.data_ptr()) is True
    assert _thp_eligible(t.data_ptr() + t.numel() - 1) is True  # the last page too
    tail = t[-4096:]
    del t
    gc.collect()
    tail.fill_(7)
    assert int(tail.sum()) == 7 * 4096


def test_arena_hands_out_aligned_tensors_and_refuses_to_overflow():
    parts = [torch.randn(5, 7), torch.arange(3, dtype=torch.int64), torch.ones(2, 2)]
    size = sum(HugePageArena.padded(p.numel() * p.element_size()) for p in parts)
    arena = HugePageArena(size)
    copies = [arena.copy(p) for p in parts]
    for part, copy in zip(parts, copies, strict=True):
        assert torch.equal(part, copy) and copy.is_contiguous()
        assert copy.data_ptr() % HugePageArena.ALIGN == 0
    assert arena.free == 0
    with pytest.raises(ValueError, match="does not fit"):
        arena.take((1,), torch.uint8)


@needs_thp
def test_the_kv_pool_is_in_huge_pages():
    spec = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16)
    pool = KVPool(spec, num_blocks=64)  # 16 MiB
    assert pool.base_addr % HUGE_PAGE == 0 and _thp_eligible(pool.base_addr) is True
    assert int(pool.raw.count_nonzero()) == 0


@needs_thp
@pytest.mark.parametrize("stored", [None, "Q8_0"])
def test_the_backend_moves_what_decode_streams_into_one_advised_arena(ops, stored):
    config = dataclasses.replace(layer_config(256, 1024, 4, 2, 64, False), vocab_size=1024)
    if stored is None:
        model = random_model(config)
    else:
        model = quantized_twins(config, lambda name, w: quantize(w, stored))[0]
    hidden = torch.randn(3, 256)
    expected = model.compute_logits(hidden)
    CpuBackend(ops).install(model)
    layers = [m for m in model.modules() if isinstance(m, (PackedLinear, CpuQuantLinear))]
    assert len(layers) == 4 * config.num_hidden_layers + 1  # and the (untied) head
    tensors = [m.packed.panels if isinstance(m, PackedLinear) else m.qweight.data for m in layers]
    arena = tensors[0].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == arena for t in tensors)
    assert all(_thp_eligible(t.data_ptr()) for t in tensors)
    torch.testing.assert_close(model.compute_logits(hidden), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_freed_heap_goes_back_to_the_os_on_glibc():
    assert release_freed_heap() is True
