"""The RC queue pairs of one rdma transport, one per connection.

A queue pair (QP) is created in INIT (an accepting one with its receive WRs already posted: a
write with an immediate may arrive as soon as it reaches RTR), brought to RTS by the side
channel's handshake (rdma_side_channel.py), retired to the error state so that every posted WR
flushes, and destroyed. The poller thread finds a QP by number when a work completion names it
and reposts its receive WRs; one lock orders those reposts against teardown on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any

from kvmesh.shared.transport.errors import TransportError
from kvmesh.shared.transport.rdma_device import DeviceChoice
from kvmesh.shared.transport.rdma_qp import (
    QPInfo,
    QPLimits,
    create_rc_qp,
    post_recv,
    post_recvs,
    qp_to_error,
    qp_to_init,
)


@dataclass(slots=True)
class QPEntry:
    """One connection's QP. ``peer_id`` is what the peer declared in its hello: a name for logs,
    not an identity (the receiver's proof of who writes is the QP itself, which the NIC ties to
    the connection the receiver accepted)."""

    qp: Any
    info: QPInfo
    peer_id: str
    closed: bool = False
    conn: asyncio.StreamWriter | None = None  # an accepted QP's side channel


@dataclass(eq=False)
class QPTable:
    """Creates, finds, retires and destroys the QPs of one transport (all on its one CQ).

    ``ctrl_cq``: the send CQ of accepting QPs (they post nothing but memory-window binds, which
    the event loop waits for there); None where the NIC binds no memory windows.
    """

    verbs: Any
    pd: Any
    cq: Any
    ctrl_cq: Any
    recv_mr: Any  # receive WRs need an lkey though write-with-imm puts no payload there
    device: DeviceChoice
    gid: str
    gid_index: int
    limits: QPLimits
    _entries: dict[int, QPEntry] = field(default_factory=dict, init=False)
    # teardown vs receive-WR reposts from the poller
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, qpn: int) -> QPEntry | None:
        return self._entries.get(qpn)

    def entries(self) -> list[QPEntry]:
        return list(self._entries.values())

    def new(self, peer_id: str, *, accepting: bool) -> QPEntry:
        """A QP in INIT for a connection to ``peer_id``; raises TransportError when the CQ has no
        room for another, PyverbsError when the device refuses."""
        v, limits = self.verbs, self.limits
        max_qps = self.cq.cqe // (limits.send_depth + limits.recv_depth)
        if len(self._entries) >= max_qps:
            raise TransportError(
                f"{len(self._entries)} rdma connections fill the completion queue; raise "
                "TransportConfig.extra['rdma_cq_depth'] or lower rdma_send_depth/rdma_recv_depth"
            )
        send_cq = self.ctrl_cq if accepting else None
        qp = create_rc_qp(v, self.pd, self.cq, limits, send_cq=send_cq)
        try:
            qp_to_init(v, qp, self.device.port)
            if accepting:  # receive WRs must be posted before RTR: imms may arrive right away
                post_recvs(v, qp, limits.recv_depth, self.recv_mr.buf, self.recv_mr.lkey)
        except v.PyverbsError:
            qp.close()
            raise
        info = QPInfo(
            qpn=qp.qp_num,
            psn=secrets.randbits(24),
            gid=self.gid,
            gid_index=self.gid_index,
            lid=self.device.port_attr.lid,
            port=self.device.port,
            mtu=self.device.port_attr.active_mtu,
        )
        entry = QPEntry(qp, info, peer_id)
        self._entries[info.qpn] = entry
        return entry

    def repost_recv(self, entry: QPEntry) -> None:
        """Poller thread: give back the receive WR an immediate consumed (unless retired)."""
        with self._lock:
            if not entry.closed:
                post_recv(self.verbs, entry.qp, self.recv_mr.buf, self.recv_mr.lkey)

    def mark_failed(self, entry: QPEntry) -> bool:
        """Poller thread: the NIC moved ``entry``'s QP to the error state. True the first time
        for a QP we did not retire ourselves (the peer broke a rule), False otherwise."""
        with self._lock:
            if entry.closed:
                return False
            entry.closed = True
            return True

    def retire(self, entry: QPEntry) -> None:
        """Move the QP to ERR so every posted WR flushes; idempotent."""
        with self._lock:
            if entry.closed:
                return
            entry.closed = True
            with contextlib.suppress(self.verbs.PyverbsError):
                qp_to_error(self.verbs, entry.qp)

    def destroy(self, entry: QPEntry) -> None:
        with self._lock:
            self._entries.pop(entry.info.qpn, None)
            with contextlib.suppress(self.verbs.PyverbsError):
                entry.qp.close()

    def close_all(self) -> None:
        for entry in self.entries():
            self.retire(entry)
            self.destroy(entry)
