"""Memory registrations of the rdma backend: host memory as MRs, CUDA tensors as dma-buf MRs.

Host registrations are mirrored into the shared Registry (so ``auto``'s shm/tcp backends serve
the same regions and stats count them); GPU ones live only here, since the other backends cannot
reach device memory.

Where the NIC binds memory windows (``mw_bind``), a region peers may reach is registered with
LOCAL_WRITE | MW_BIND and no remote access of its own: peers reach it only through windows
(rdma_windows.py), and its key is the Registry's (random, as on shm/tcp), not the MR's. Without
memory windows the MR carries the remote access and its hardware rkey is the region's rkey.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
from kvmesh.shared.transport.base import Access, Buffer, MemoryRegion
from kvmesh.shared.transport.errors import LocalAccessError, TransportError
from kvmesh.shared.transport.registry import Registry, as_byte_tensor

_MEMLOCK_HINT = "; raise the locked-memory limit (ulimit -l unlimited, docker --ulimit memlock=-1)"


@dataclass(slots=True)
class Registration:
    mr: Any
    region: MemoryRegion
    iova: int  # the address the NIC uses for the region's first byte
    keepalive: torch.Tensor  # the registered memory stays alive while registered


class RdmaMemory:
    """rkey -> MR for one protection domain."""

    def __init__(
        self,
        verbs: Any,
        pd: Any,
        registry: Registry,
        dmabuf_exporter: Callable[[int, int], tuple[int, int]],
        *,
        mw_bind: bool = False,
    ) -> None:
        self.verbs = verbs
        self.mw_bind = mw_bind
        self.pd = pd
        self.registry = registry
        self.export_dmabuf = dmabuf_exporter
        self.relaxed_ordering = True  # cleared once the device refuses it
        self._regs: dict[int, Registration] = {}
        self._allocations: list[tuple[mmap.mmap, torch.Tensor]] = []

    def allocate(self, nbytes: int) -> torch.Tensor:
        """Page-aligned host memory for a receiving KVPool; freed by ``close``."""
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        mm = mmap.mmap(-1, nbytes)
        tensor = torch.frombuffer(mm, dtype=torch.uint8)  # (nbytes,)
        self._allocations.append((mm, tensor))
        return tensor

    def register(self, memory: Buffer, access: Access) -> MemoryRegion:
        access = Access(access)
        if isinstance(memory, torch.Tensor) and memory.device.type == "cuda":
            return self.register_dmabuf(memory, access)
        tensor = as_byte_tensor(memory)
        n = tensor.numel()
        if n == 0:
            raise ValueError("cannot register an empty buffer")
        mr = self._reg_mr(
            lambda flags: self.verbs.MR(self.pd, n, flags, address=tensor.data_ptr()), access
        )
        try:
            region = self._mirror(tensor, access, mr)
        except BaseException:
            mr.close()
            raise
        region = msgspec.structs.replace(region, lkey=mr.lkey)
        self._regs[region.rkey] = Registration(mr, region, region.addr, tensor)
        return region

    def _mirror(self, tensor: torch.Tensor, access: Access, mr: Any) -> MemoryRegion:
        if not (self.mw_bind and access & Access.REMOTE):
            return self.registry.register(tensor, access, rkey=mr.rkey)
        while True:  # a Registry key, unless it happens to equal a key registered here
            region = self.registry.register(tensor, access)
            if region.rkey not in self._regs:
                return region
            self.registry.deregister(region)

    def registration(self, region: MemoryRegion) -> Registration:
        reg = self._regs.get(region.rkey)
        if reg is None or reg.region != region:
            raise KeyError(f"region rkey={region.rkey} is not registered with this transport")
        return reg

    def register_dmabuf(self, tensor: torch.Tensor, access: Access) -> MemoryRegion:
        """Register through a dma-buf export of the memory (CUDA tensors); the NIC addresses it
        by iova, which peers learn from the descriptor's iova map."""
        if not tensor.is_contiguous():
            raise ValueError("a registered tensor must be contiguous")
        flat = tensor.view(torch.uint8).reshape(-1)
        ptr, n = flat.data_ptr(), flat.numel()
        fd, offset = self.export_dmabuf(ptr, n)
        try:
            # pyverbs registers a dma-buf MR with iova == its offset into the dma-buf
            mr = self._reg_mr(
                lambda flags: self.verbs.DmaBufMR(self.pd, n, flags, dmabuf=fd, offset=offset),
                access,
            )
        finally:
            os.close(fd)  # the MR holds its own reference to the dma-buf
        region = MemoryRegion(addr=ptr, length=n, rkey=mr.rkey, access=access, lkey=mr.lkey)
        self._regs[mr.rkey] = Registration(mr, region, offset, flat)
        return region

    def _reg_mr(self, make: Callable[[int], Any], access: Access) -> Any:
        e = self.verbs.e
        # LOCAL_WRITE: RDMA READ results land in local memory, and an MW granting remote write
        # needs it on its MR
        flags = e.IBV_ACCESS_LOCAL_WRITE
        if self.mw_bind and access & Access.REMOTE:
            flags |= e.IBV_ACCESS_MW_BIND  # remote access only through memory windows
        else:
            if access & Access.REMOTE_WRITE:
                flags |= e.IBV_ACCESS_REMOTE_WRITE
            if access & Access.REMOTE_READ:
                flags |= e.IBV_ACCESS_REMOTE_READ
        try:
            if self.relaxed_ordering:
                try:
                    return make(flags | e.IBV_ACCESS_RELAXED_ORDERING)
                except self.verbs.PyverbsRDMAError as exc:
                    if exc.error_code not in (
                        errno.EINVAL,
                        errno.EOPNOTSUPP,
                        errno.EPROTONOSUPPORT,
                    ):
                        raise
                    self.relaxed_ordering = False
            return make(flags)
        except self.verbs.PyverbsRDMAError as exc:
            hint = (
                _MEMLOCK_HINT if exc.error_code in (errno.ENOMEM, errno.EFAULT, errno.EPERM) else ""
            )
            raise TransportError(f"memory registration failed: {exc}{hint}") from exc

    def deregister(self, region: MemoryRegion) -> None:
        reg = self._regs.get(region.rkey)
        if reg is None or reg.region.addr != region.addr:
            raise KeyError(f"region rkey={region.rkey} is not registered here")
        self._drop(reg)

    def _drop(self, reg: Registration) -> None:
        self._regs.pop(reg.region.rkey, None)
        stored = self.registry.get(reg.region.rkey)
        if stored is not None:
            self.registry.deregister(stored)
        with contextlib.suppress(self.verbs.PyverbsError):
            reg.mr.close()

    def local_span(self, region: MemoryRegion, offset: int, length: int) -> tuple[int, int]:
        """``(NIC address, lkey)`` of a span of a region registered here."""
        reg = self._regs.get(region.rkey)
        if reg is None or reg.region.addr != region.addr:
            raise LocalAccessError(
                f"local region rkey={region.rkey} is not registered with this rdma transport; "
                "register it with transport.register() first"
            )
        if offset < 0 or length <= 0 or offset + length > reg.region.length:
            raise LocalAccessError(
                f"local span [{offset}, {offset + length}) outside region of {reg.region.length} bytes"
            )
        return reg.iova + offset, reg.mr.lkey

    def remote_regions(self) -> tuple[MemoryRegion, ...]:
        return tuple(r.region for r in self._regs.values() if r.region.access & Access.REMOTE)

    def iova_map(self) -> dict[int, tuple[int, int]]:
        """rkey -> (addr, iova) for regions the NIC addresses differently (dma-buf). Empty with
        memory windows: a window's resolution gives each span's NIC address, and region keys
        are not for peers."""
        if self.mw_bind:
            return {}
        return {
            k: (r.region.addr, r.iova) for k, r in self._regs.items() if r.iova != r.region.addr
        }

    def close(self) -> None:
        for reg in list(self._regs.values()):
            self._drop(reg)
        for mm, _ in self._allocations:
            with contextlib.suppress(BufferError):  # a KVPool may still view it
                mm.close()
        self._allocations.clear()
