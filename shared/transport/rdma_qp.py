"""RC queue pairs for the rdma backend: the QP info peers exchange, the RESET->INIT->RTR->RTS
sequence, work-request chains for batched writes and reads, and work-completion status -> typed
errors. Functions over a ``verbs`` namespace (pyverbs or the test stand-in).
"""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvmesh.shared.transport.errors import (
    LocalAccessError,
    PeerGoneError,
    ProtocolError,
    RefusalReason,
    RemoteAccessError,
    TransportError,
)

# Same values as ibv_rc_pingpong: ~67 ms ACK timeout (4.096 us * 2^14), 7 retries,
# RNR retry 7 = retry forever (the receiver reposts receive WRs as it consumes them).
ACK_TIMEOUT = 14
RETRY_CNT = 7
RNR_RETRY = 7
MIN_RNR_TIMER = 12  # 0.64 ms

# wr_id spaces: receive WRs carry RECV_WR_ID_BIT so the poller can route error completions,
# whose opcode is undefined, by wr_id alone.
RECV_WR_ID_BIT = 1 << 63


@dataclass(frozen=True, slots=True)
class QPInfo:
    """What the other side of an RC connection needs to reach this QP (sent at handshake)."""

    qpn: int
    psn: int  # 24-bit starting packet sequence number of this QP's send queue
    gid: str  # "fe80:0000:...", the port's GID at gid_index
    gid_index: int
    lid: int  # 0 on RoCE
    port: int
    mtu: int  # ibv_mtu enum value (1: 256 B ... 5: 4096 B), the port's active MTU

    def to_dict(self) -> dict[str, Any]:
        return {
            "qpn": self.qpn,
            "psn": self.psn,
            "gid": self.gid,
            "gid_index": self.gid_index,
            "lid": self.lid,
            "port": self.port,
            "mtu": self.mtu,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> QPInfo:
        try:
            info = cls(
                qpn=int(d["qpn"]),
                psn=int(d["psn"]),
                gid=str(d["gid"]),
                gid_index=int(d["gid_index"]),
                lid=int(d["lid"]),
                port=int(d["port"]),
                mtu=int(d["mtu"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"malformed rdma QP info {d!r}: {exc}") from exc
        if not 0 <= info.psn < (1 << 24):
            raise ProtocolError(f"rdma QP info psn must be 24-bit, got {info.psn}")
        return info


@dataclass(frozen=True, slots=True)
class QPLimits:
    """Queue sizes, clamped to what the device supports (see ``clamp_limits``)."""

    send_depth: int = 256  # max_send_wr
    recv_depth: int = 256  # max_recv_wr; one receive WR consumed per write-with-imm
    max_send_sge: int = 16
    max_rd_atomic: int = 16  # RDMA READs this QP may have in flight
    max_dest_rd_atomic: int = 16  # RDMA READs it serves concurrently
    max_msg_bytes: int = 1 << 30  # port max_msg_sz: one WR moves at most this many bytes


def clamp_limits(limits: QPLimits, device_attr: Any, port_attr: Any) -> QPLimits:
    return QPLimits(
        send_depth=max(2, min(limits.send_depth, device_attr.max_qp_wr)),
        recv_depth=max(1, min(limits.recv_depth, device_attr.max_qp_wr)),
        max_send_sge=max(1, min(limits.max_send_sge, device_attr.max_sge)),
        max_rd_atomic=max(1, min(limits.max_rd_atomic, device_attr.max_qp_init_rd_atom)),
        max_dest_rd_atomic=max(1, min(limits.max_dest_rd_atomic, device_attr.max_qp_rd_atom)),
        max_msg_bytes=max(1, min(limits.max_msg_bytes, port_attr.max_msg_sz)),
    )


# ---------------------------------------------------------------------------------------------------
# QP lifecycle


def create_rc_qp(verbs: Any, pd: Any, cq: Any, limits: QPLimits, send_cq: Any = None) -> Any:
    """An RC QP; ``send_cq`` (default ``cq``) takes its send completions: an accepting QP posts
    only memory-window binds, which the event loop waits for on a CQ of their own."""
    cap = verbs.QPCap(
        max_send_wr=limits.send_depth,
        max_recv_wr=limits.recv_depth,
        max_send_sge=limits.max_send_sge,
        max_recv_sge=1,
    )
    # sq_sig_all=0: only WRs posted with IBV_SEND_SIGNALED complete, one per segment.
    init = verbs.QPInitAttr(
        qp_type=verbs.e.IBV_QPT_RC, scq=send_cq or cq, rcq=cq, cap=cap, sq_sig_all=0
    )
    return verbs.QP(pd, init)


def qp_to_init(verbs: Any, qp: Any, port: int) -> None:
    e = verbs.e
    attr = verbs.QPAttr(qp_state=e.IBV_QPS_INIT, cur_qp_state=e.IBV_QPS_RESET)
    attr.pkey_index = 0
    attr.port_num = port
    # What peers may do through this QP; each MR further limits it to its own access.
    attr.qp_access_flags = (
        e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
    )
    mask = e.IBV_QP_STATE | e.IBV_QP_PKEY_INDEX | e.IBV_QP_PORT | e.IBV_QP_ACCESS_FLAGS
    qp.modify(attr, mask)


def qp_to_rtr(verbs: Any, qp: Any, local: QPInfo, remote: QPInfo, limits: QPLimits) -> None:
    e = verbs.e
    attr = verbs.QPAttr(qp_state=e.IBV_QPS_RTR, cur_qp_state=e.IBV_QPS_INIT)
    attr.path_mtu = min(local.mtu, remote.mtu)
    attr.dest_qp_num = remote.qpn
    attr.rq_psn = remote.psn  # the first PSN the peer will send
    attr.max_dest_rd_atomic = limits.max_dest_rd_atomic
    attr.min_rnr_timer = MIN_RNR_TIMER
    route = verbs.GlobalRoute(dgid=verbs.GID(val=remote.gid), sgid_index=local.gid_index)
    # is_global with the peer's GID works on RoCE (required there) and on IB.
    attr.ah_attr = verbs.AHAttr(dlid=remote.lid, is_global=1, port_num=local.port, gr=route)
    mask = (
        e.IBV_QP_STATE
        | e.IBV_QP_AV
        | e.IBV_QP_PATH_MTU
        | e.IBV_QP_DEST_QPN
        | e.IBV_QP_RQ_PSN
        | e.IBV_QP_MAX_DEST_RD_ATOMIC
        | e.IBV_QP_MIN_RNR_TIMER
    )
    qp.modify(attr, mask)


def qp_to_rts(verbs: Any, qp: Any, local: QPInfo, limits: QPLimits) -> None:
    e = verbs.e
    attr = verbs.QPAttr(qp_state=e.IBV_QPS_RTS, cur_qp_state=e.IBV_QPS_RTR)
    attr.sq_psn = local.psn
    attr.timeout = ACK_TIMEOUT
    attr.retry_cnt = RETRY_CNT
    attr.rnr_retry = RNR_RETRY
    attr.max_rd_atomic = limits.max_rd_atomic
    mask = (
        e.IBV_QP_STATE
        | e.IBV_QP_SQ_PSN
        | e.IBV_QP_TIMEOUT
        | e.IBV_QP_RETRY_CNT
        | e.IBV_QP_RNR_RETRY
        | e.IBV_QP_MAX_QP_RD_ATOMIC
    )
    qp.modify(attr, mask)


def qp_to_error(verbs: Any, qp: Any) -> None:
    """Flush the QP: every posted WR completes with IBV_WC_WR_FLUSH_ERR."""
    attr = verbs.QPAttr(qp_state=verbs.e.IBV_QPS_ERR)
    qp.modify(attr, verbs.e.IBV_QP_STATE)


def post_recvs(verbs: Any, qp: Any, count: int, sge_addr: int, lkey: int) -> None:
    """Receive WRs that consume the immediates of incoming writes. Write-with-imm places no
    payload in the receive buffer, so a zero-length SGE suffices."""
    for _ in range(count):
        post_recv(verbs, qp, sge_addr, lkey)


def post_recv(verbs: Any, qp: Any, sge_addr: int, lkey: int) -> None:
    sge = verbs.SGE(sge_addr, 0, lkey)
    qp.post_recv(verbs.RecvWR(wr_id=RECV_WR_ID_BIT | qp.qp_num, num_sge=1, sg=[sge]))


# ---------------------------------------------------------------------------------------------------
# Work-request chains


@dataclass(frozen=True, slots=True)
class Span:
    """One entry, already translated to the addresses the NIC uses."""

    local_addr: int
    lkey: int
    remote_addr: int
    rkey: int
    length: int


@dataclass(slots=True)
class Segment:
    """WRs posted with one ``post_send``: linked by next_wr, only the last one signaled."""

    head: Any
    wrs: list[Any]  # keeps every WR and SGE alive until post_send has copied them
    sges: list[Any]
    wr_id: int

    @property
    def num_wrs(self) -> int:
        return len(self.wrs)


def coalesce(spans: Sequence[Span], max_sge: int, max_msg_bytes: int) -> list[list[Span]]:
    """Group spans into WRs: a WR gathers up to ``max_sge`` local spans into one contiguous remote
    range of one rkey (adjacent destination blocks travel as one WR)."""
    groups: list[list[Span]] = []
    end = rkey = size = -1
    for span in spans:
        if (
            groups
            and span.rkey == rkey
            and span.remote_addr == end
            and len(groups[-1]) < max_sge
            and size + span.length <= max_msg_bytes
        ):
            groups[-1].append(span)
            size += span.length
        else:
            groups.append([span])
            rkey, size = span.rkey, span.length
        end = span.remote_addr + span.length
    return groups


def build_segments(
    verbs: Any,
    spans: Sequence[Span],
    *,
    read: bool,
    imm: int | None,
    limits: QPLimits,
    next_wr_id: Any,
) -> list[Segment]:
    """Split a batched write (or read) into segments of at most ``send_depth // 2`` WRs, so two
    segments can be in flight on one QP. Writes: every WR is RDMA_WRITE except the very last,
    RDMA_WRITE_WITH_IMM carrying ``imm`` (network byte order on the wire, as verbs defines it).
    ``next_wr_id()`` gives each segment's signaled wr_id."""
    e = verbs.e
    groups = coalesce(spans, limits.max_send_sge, limits.max_msg_bytes)
    per_segment = max(1, limits.send_depth // 2)
    segments = []
    for start in range(0, len(groups), per_segment):
        chunk = groups[start : start + per_segment]
        is_last_segment = start + per_segment >= len(groups)
        wr_id = next_wr_id()
        wrs: list[Any] = []
        sges: list[Any] = []
        nxt = None
        for i in range(len(chunk) - 1, -1, -1):  # build backwards: next_wr must exist first
            group = chunk[i]
            last = i == len(chunk) - 1
            sg = [verbs.SGE(s.local_addr, s.length, s.lkey) for s in group]
            sges.extend(sg)
            if read:
                opcode = e.IBV_WR_RDMA_READ
            elif last and is_last_segment and imm is not None:
                opcode = e.IBV_WR_RDMA_WRITE_WITH_IMM
            else:
                opcode = e.IBV_WR_RDMA_WRITE
            wr = verbs.SendWR(
                wr_id=wr_id,  # an error completes even an unsignaled WR: route it by wr_id
                opcode=opcode,
                num_sge=len(sg),
                sg=sg,
                imm_data=socket.htonl(imm) if opcode == e.IBV_WR_RDMA_WRITE_WITH_IMM else 0,
                send_flags=e.IBV_SEND_SIGNALED if last else 0,
                next_wr=nxt,
            )
            wr.set_wr_rdma(rkey=group[0].rkey, addr=group[0].remote_addr)
            wrs.append(wr)
            nxt = wr
        wrs.reverse()
        segments.append(Segment(head=wrs[0], wrs=wrs, sges=sges, wr_id=wr_id))
    return segments


# ---------------------------------------------------------------------------------------------------
# Completion status -> typed error


def status_name(verbs: Any, status: int) -> str:
    for name in dir(verbs.e):
        if (
            name.startswith("IBV_WC_")
            and name.endswith("_ERR")
            and getattr(verbs.e, name) == status
        ):
            return name
    return f"status {status}"


def completion_error(verbs: Any, status: int, vendor_err: int, what: str) -> TransportError:
    """The typed error for a failed work completion of ``what`` ("write to peer x", ...)."""
    e = verbs.e
    detail = f"{what}: {status_name(verbs, status)} (vendor error {vendor_err:#x})"
    if status == e.IBV_WC_REM_ACCESS_ERR:
        return RemoteAccessError(
            RefusalReason.REFUSED,
            f"{detail}; the NIC does not say which: unknown or deregistered rkey, span out of "
            "bounds, or a region without the needed remote access",
        )
    if status == e.IBV_WC_REM_INV_REQ_ERR:
        return RemoteAccessError(RefusalReason.BAD_LENGTH, f"{detail}; request larger than allowed")
    if status in (e.IBV_WC_LOC_PROT_ERR, e.IBV_WC_LOC_ACCESS_ERR, e.IBV_WC_LOC_LEN_ERR):
        return LocalAccessError(
            f"{detail}; the local span is not inside a region registered with this transport"
        )
    if status == e.IBV_WC_WR_FLUSH_ERR:
        return PeerGoneError(
            f"{detail}; the queue pair is in the error state (closed, or an earlier operation "
            "failed); connect again"
        )
    if status in (
        e.IBV_WC_RETRY_EXC_ERR,
        e.IBV_WC_RNR_RETRY_EXC_ERR,
        e.IBV_WC_RESP_TIMEOUT_ERR,
        e.IBV_WC_REM_ABORT_ERR,
        e.IBV_WC_REM_OP_ERR,
    ):
        return PeerGoneError(
            f"{detail}; the peer stopped acknowledging (process gone, QP destroyed, or link "
            "down); connect again"
        )
    return TransportError(detail)
