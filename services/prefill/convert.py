"""A decode worker whose KV dtype differs from this prefill worker's: convert, then write.

``--kv-cache-dtype`` may differ between the pools (int8 or fp8 e4m3 with scales on one side,
the model's dtype or the other 8-bit format on the other). Their blocks then differ in bytes, so a chunk cannot be copied
from the local pool as it is: its blocks are first converted (``kernels/kv_convert.pack_converted``)
into a mirror pool in the decode's layout, block ``i`` of the mirror for local block ``i``, so the
``ChunkPlanner``'s spans (local block id times block bytes) address the mirror unchanged, and
written from there. One mirror per decode dtype, registered with the transport and allocated on
first use: ``num_blocks`` blocks of the decode's size, a quarter of the pool's bytes behind a
float32 prefill for an fp8 decode side (9/32 for int8), four times them for float32 behind an
fp8 prefill.
Specs that differ in more than the dtype are refused (``KVSpecMismatchError``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from kvmesh.kernels.kv_convert import pack_converted
from kvmesh.services.prefill.plan import KVSpecMismatchError
from kvmesh.shared.kv.kv_cache import KVCacheSpec, KVPool
from kvmesh.shared.transport import MemoryRegion
from kvmesh.shared.transport.endpoint_cache import EndpointCache

# KV dtypes a write converts between (KVCacheSpec.fingerprint names them so)
CONVERTIBLE_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "int8": torch.int8,
}


def decode_kv_dtype(kv_spec: str, decode_kv_spec: str) -> torch.dtype | None:
    """The decode side's KV dtype when its spec (``DecodeAdvert.kv_spec``) differs from this
    worker's ``kv_spec`` in the dtype alone; None when they are equal. KVSpecMismatchError when
    they differ in anything else (model, layout, block size), or in a dtype not converted."""
    if decode_kv_spec == kv_spec:
        return None
    ours, theirs = _split(kv_spec), _split(decode_kv_spec)
    if ours is None or theirs is None or ours[0] != theirs[0]:
        raise KVSpecMismatchError(
            f"KV spec mismatch: this prefill worker has {kv_spec}, the decode worker has "
            f"{decode_kv_spec}; run both with the same model and block size (the KV dtype may "
            "differ: writes convert it)"
        )
    dtype = CONVERTIBLE_DTYPES.get(theirs[1])
    if dtype is None or ours[1] not in CONVERTIBLE_DTYPES:
        raise KVSpecMismatchError(
            f"KV dtype {ours[1]} here, {theirs[1]} on the decode worker: no conversion between "
            f"them (converted: {', '.join(CONVERTIBLE_DTYPES)})"
        )
    return dtype


def _split(kv_spec: str) -> tuple[str, str] | None:
    """(the spec without its dtype, the dtype name) of ``kv_spec_fingerprint``'s
    ``L..-H..-D..-B..-<dtype>:model-<digest>``; None if it is not of that form."""
    layout, sep, model = kv_spec.partition(":")
    fields = layout.split("-")
    if not sep or len(fields) != 5:
        return None
    return "-".join(fields[:4]) + ":" + model, fields[4]


@dataclasses.dataclass(frozen=True, slots=True)
class KVMirror:
    """The local pool's blocks in a decode worker's layout: ``blocks`` (num_blocks, block_bytes)
    uint8, registered as ``region``."""

    spec: KVCacheSpec
    region: MemoryRegion
    blocks: torch.Tensor

    def convert(self, pool: KVPool, block_ids: Sequence[int], num_tokens: int | None) -> None:
        """Convert local blocks ``block_ids`` (a run holding ``num_tokens`` tokens; None: full)
        into their mirror blocks. Runs in a worker thread: the blocks are the job's own and
        computed, nothing else writes them meanwhile."""
        ids = list(block_ids)
        converted = pack_converted(
            pool.tensor,
            pool.scales,
            ids,
            0,
            pool.spec.num_kv_heads,
            self.spec.dtype,
            num_tokens=num_tokens,
        )
        self.blocks[torch.tensor(ids)] = converted.to(self.blocks.device)  # host memory


class KVMirrors:
    """The mirrors of one pool, one per decode dtype met, made on first use."""

    def __init__(self, pool: KVPool, endpoints: EndpointCache) -> None:
        self.pool = pool
        self.endpoints = endpoints  # its transport allocates and registers the mirrors
        self._mirrors: dict[torch.dtype, KVMirror] = {}

    def get(self, dtype: torch.dtype) -> KVMirror:
        mirror = self._mirrors.get(dtype)
        if mirror is None:
            spec = dataclasses.replace(self.pool.spec, dtype=dtype)
            transport = self.endpoints.transport
            memory = transport.allocate(self.pool.num_blocks * spec.block_bytes)
            region = transport.register(memory)
            blocks = memory[: self.pool.num_blocks * spec.block_bytes]
            mirror = KVMirror(spec, region, blocks.view(self.pool.num_blocks, spec.block_bytes))
            self._mirrors[dtype] = mirror
        return mirror
