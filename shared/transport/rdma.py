"""RDMA backend (pyverbs): RC queue pairs, RDMA WRITE WITH IMM, hardware rkeys.

One transport holds a device context, a PD, one CQ shared by all its QPs, a poller thread
(rdma_poller.py) and a TCP side channel (rdma_side_channel.py). RC QPs are per connection pair
(rdma_connections.py): ``connect(descriptor)`` creates a QP, swaps QP info with the peer over the
side channel at the address in its descriptor, and both sides go INIT -> RTR -> RTS. The
side-channel socket stays open for the connection's life; when it closes the peer's QP is torn
down.

Writes (rdma_endpoint.py): a batch of WriteEntry becomes RDMA_WRITE work requests chained with
next_wr, the last one RDMA_WRITE_WITH_IMM and signaled; its completion arrives after the responder
acknowledged every byte, so ``write()`` returning means "placed". Each incoming imm consumes a
receive WR, which the poller reposts, and becomes one Completion. Reads are RDMA_READ chains.

Lease-scoped writes (rdma_windows.py): where the NIC offers memory windows, ``open_window`` gives
a random key that a writer resolves over the side channel into MWs bound, on its own connection,
to exactly the window's spans; ``close_window`` deallocates them. A refusal by the NIC moves the
receiving QP to the error state: the poller counts it as a refused access and hangs up.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from kvmesh.shared.kv.descriptor import RdmaBackend, TransportDescriptor
from kvmesh.shared.transport import lane_auth
from kvmesh.shared.transport.backend import BackendBase
from kvmesh.shared.transport.base import (
    Access,
    Buffer,
    MemoryRegion,
    MemoryWindow,
    Spans,
    unenforced_window,
)
from kvmesh.shared.transport.completions import CompletionQueue
from kvmesh.shared.transport.config import TransportConfig
from kvmesh.shared.transport.errors import (
    BackendUnavailableError,
    TransportClosedError,
    TransportError,
)
from kvmesh.shared.transport.rdma_connections import QPTable
from kvmesh.shared.transport.rdma_device import (
    choose_device,
    choose_gid,
    cuda_dmabuf_export,
    rdma_available,
    require_pyverbs,
)
from kvmesh.shared.transport.rdma_endpoint import RdmaEndpoint
from kvmesh.shared.transport.rdma_memory import RdmaMemory
from kvmesh.shared.transport.rdma_mw_bind import NO_WINDOWS, MwBinder, choose_window_type
from kvmesh.shared.transport.rdma_poller import CompletionPoller
from kvmesh.shared.transport.rdma_qp import RECV_WR_ID_BIT, QPLimits, clamp_limits
from kvmesh.shared.transport.rdma_side_channel import SideChannelServer, dial
from kvmesh.shared.transport.rdma_windows import WindowTable, log_window_support
from kvmesh.shared.transport.registry import Registry

__all__ = ["RdmaEndpoint", "RdmaTransport", "rdma_available"]


class RdmaTransport(BackendBase[RdmaBackend]):
    """The rdma backend; use as ``async with RdmaTransport(config) as t``.

    ``verbs``: the pyverbs namespace (``rdma_device.load_pyverbs()``); tests inject a stand-in.
    ``config.extra`` knobs: ``rdma_port`` (device port), ``rdma_send_depth``, ``rdma_recv_depth``
    (work requests per QP), ``rdma_cq_depth``, ``rdma_memory_windows`` (False: never bind memory
    windows, even where the NIC offers them; writes are then scoped to the region only).
    """

    name, part = "rdma", RdmaBackend

    def __init__(
        self,
        config: TransportConfig | None = None,
        *,
        registry: Registry | None = None,
        completions: CompletionQueue | None = None,
        verbs: Any = None,
        dmabuf_exporter: Callable[[int, int], tuple[int, int]] = cuda_dmabuf_export,
    ) -> None:
        super().__init__(config, registry, completions)
        self.verbs = verbs if verbs is not None else require_pyverbs()
        self._secret = lane_auth.new_secret()  # the side channel's (rdma_side_channel.py)
        self._dmabuf_exporter = dmabuf_exporter
        extra = self.config.extra
        defaults = QPLimits()
        self._want_limits = dataclasses.replace(
            defaults,
            send_depth=int(extra.get("rdma_send_depth", defaults.send_depth)),
            recv_depth=int(extra.get("rdma_recv_depth", defaults.recv_depth)),
        )
        self._cq_depth = int(extra.get("rdma_cq_depth", 16384))
        self._wr_ids = iter(range(1, RECV_WR_ID_BIT))  # send WRs: segments and window binds
        self._ctx = self._pd = self._cq = self._ctrl_cq = self._recv_mr = None
        self.qps: QPTable | None = None
        self.poller: CompletionPoller | None = None
        self.memory: RdmaMemory | None = None
        self.windows: WindowTable | None = None
        self.memory_windows = NO_WINDOWS  # the MW type bound per lease, once started
        self._side_channel: SideChannelServer | None = None

    # -- lifecycle ---------------------------------------------------------------------------------

    @property
    def handshake_port(self) -> int:
        """The side channel's TCP port (in the descriptor)."""
        self._check_open()
        return self._side_channel.port

    async def start(self) -> None:
        """Open the device, PD, CQ; listen for handshakes; start polling."""
        if self._ctx is not None:
            return
        v = self.verbs
        self._ctx, self.device = choose_device(v, self.config.rdma_device)
        try:
            port = int(self.config.extra.get("rdma_port", self.device.port))
            if port != self.device.port:
                attr = self._ctx.query_port(port)
                self.device = dataclasses.replace(self.device, port=port, port_attr=attr)
            self.gid_index, self.gid = choose_gid(
                v, self._ctx, self.device, self.config.rdma_gid_index
            )
            dev_attr = self._ctx.query_device()
            self.limits = clamp_limits(self._want_limits, dev_attr, self.device.port_attr)
            self._pd = v.PD(self._ctx)
            self._cq = v.CQ(self._ctx, min(self._cq_depth, dev_attr.max_cqe), None, None, 0)
            # receive WRs need an lkey even though write-with-imm puts no payload there
            self._recv_mr = v.MR(self._pd, 64, v.e.IBV_ACCESS_LOCAL_WRITE)
            if self.config.extra.get("rdma_memory_windows", True):
                self.memory_windows = choose_window_type(v, dev_attr)
            if self.memory_windows != NO_WINDOWS:  # accepted QPs' send CQ: binds only
                self._ctrl_cq = v.CQ(self._ctx, self.limits.send_depth + 16, None, None, 0)
        except (v.PyverbsError, BackendUnavailableError) as exc:
            self._close_verbs()
            raise BackendUnavailableError(
                f"cannot set up RDMA device {self.device.name}: {exc}"
            ) from exc
        self.memory = RdmaMemory(
            v,
            self._pd,
            self._registry,
            self._dmabuf_exporter,
            mw_bind=self.memory_windows != NO_WINDOWS,
        )
        self.qps = QPTable(
            v,
            self._pd,
            self._cq,
            self._ctrl_cq,
            self._recv_mr,
            self.device,
            self.gid,
            self.gid_index,
            self.limits,
        )
        log_window_support(self.device.name, self.memory_windows)
        if self.memory_windows != NO_WINDOWS:
            binder = MwBinder(
                v,
                self._pd,
                self.memory_windows,
                self._ctrl_cq,
                self.next_wr_id,
                self.limits.send_depth // 2,
            )
            self.windows = WindowTable(binder, self._registry, self.config.max_refusals)
        self.poller = CompletionPoller(
            v,
            self._cq,
            self.qps,
            self.windows,
            self._registry,
            self._queue,
            asyncio.get_running_loop(),
        )
        self._side_channel = SideChannelServer(
            self.qps, self.windows, self._registry, self.config, self._peer_id, self._secret
        )
        await self._side_channel.__aenter__()
        self.poller.start()

    async def _teardown(self) -> None:
        if self._side_channel is not None:  # accepted connections retire their QPs
            await self._side_channel.aclose()
        if self.windows is not None:  # MWs go before the QPs they are bound on and their MRs
            self.windows.close_all()
        if self.qps is not None:
            self.qps.close_all()
        if self.poller is not None:
            await self.poller.stop()
            self.poller.fail_all(TransportClosedError("rdma transport closed"))
        if self.memory is not None:
            self.memory.close()
        self._close_verbs()

    def _close_verbs(self) -> None:
        for obj in (self._recv_mr, self._ctrl_cq, self._cq, self._pd, self._ctx):
            if obj is not None:
                with contextlib.suppress(self.verbs.PyverbsError):
                    obj.close()
        self._recv_mr = self._ctrl_cq = self._cq = self._pd = self._ctx = None

    def _check_open(self) -> None:
        self._check_not_closed()
        if self._ctx is None:
            raise TransportError("enter the rdma transport (async with) before using it")

    # -- memory ------------------------------------------------------------------------------------

    def allocate(self, nbytes: int) -> torch.Tensor:
        """Page-aligned host memory for a receiving KVPool; freed when the transport closes."""
        self._check_open()
        return self.memory.allocate(nbytes)

    def register(self, memory: Buffer, access: Access = Access.LOCAL) -> MemoryRegion:
        """Register host memory (MR) or a CUDA tensor (dma-buf MR); the MR's rkey is the rkey."""
        self._check_open()
        return self.memory.register(memory, access)

    def deregister(self, region: MemoryRegion) -> None:
        self._check_open()
        if self.windows is not None:  # an MR with bound MWs cannot be deregistered
            self.windows.close_region(region)
        self.memory.deregister(region)

    def open_window(
        self, region: MemoryRegion, spans: Spans, access: Access = Access.REMOTE_WRITE
    ) -> MemoryWindow:
        """A random key to ``spans`` of ``region`` alone: a writer resolves it into memory
        windows bound on its connection (rdma_windows.py). Where the NIC binds no memory windows
        the window is the region itself (``enforced`` False): the NIC checks its bounds only."""
        self._check_open()
        if self.windows is None:
            return unenforced_window(region, spans, access)
        return self.windows.open(self.memory.registration(region), spans, access)

    def close_window(self, window: MemoryWindow) -> None:
        """Invalidate the window's memory windows; later accesses with its key fail on the NIC.
        Closing twice, or an unenforced window, is a no-op."""
        if self.windows is not None and window.enforced:
            self.windows.close(window)

    # -- descriptor and connections ----------------------------------------------------------------

    def backend_info(self) -> RdmaBackend:
        self._check_open()
        return RdmaBackend(
            device=self.device.name,
            port=self.device.port,
            lid=self.device.port_attr.lid,
            gid=self.gid,
            gid_index=self.gid_index,
            mtu=self.device.port_attr.active_mtu,
            host=self.config.tcp_advertise_host or self.config.tcp_host,
            handshake_port=self.handshake_port,
            iova=self.memory.iova_map(),
            memory_windows=self.memory_windows,
            secret=self._secret.hex(),
        )

    def remote_regions(self) -> tuple[MemoryRegion, ...]:
        return self.memory.remote_regions()

    async def connect(self, descriptor: TransportDescriptor) -> RdmaEndpoint:
        """Create an RC QP, swap QP info over the peer's side channel, bring the QP to RTS."""
        self._check_open()
        info = self.peer_part(descriptor)
        entry = self.qps.new(descriptor.peer_id, accepting=False)
        reader, writer = await dial(
            self.qps, entry, self._peer_id, descriptor.peer_id, info, self.config.connect_timeout_s
        )
        ep = RdmaEndpoint(
            self,
            entry,
            descriptor.peer_id,
            descriptor.regions,
            dict(info.iova),
            writer,
            reader,
            info.memory_windows,
        )
        self._endpoints.add(ep)
        return ep

    def next_wr_id(self) -> int:
        return next(self._wr_ids)
