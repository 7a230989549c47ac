"""What the prefill worker believes about decode workers: their latest ``DecodeAdvert``s.

A ``PrefillJob`` names a decode worker, a transport descriptor, a window key and block addresses.
Those are data from the network, never a place to dial: a job is served only when its target
matches what that decode worker itself advertised (descriptor, block size, KV layout, which may
differ in its dtype alone: see convert.py) and its addresses are distinct blocks that fit in the
advertised pool (the advert names no address: the decode worker's transport checks each write
against the lease's window). So a forged job cannot make this worker connect to an arbitrary
host:port or map an arbitrary shm name; at most it can name a real decode worker, and its writes
then carry a key the decode worker never opened a window for, or fall outside the window, which
its transport refuses (see docs/security.md).
"""

from __future__ import annotations

import asyncio
import time

from kvmesh.services.prefill.convert import decode_kv_dtype
from kvmesh.services.prefill.core_loan import HeardLoad
from kvmesh.shared.bus.messages.prefill_jobs import PrefillJob
from kvmesh.shared.bus.messages.workers import DecodeAdvert


class UnvouchedJobError(ValueError):
    """A job whose target does not match its decode worker's advert (or none was heard)."""


class AdvertBook:
    """The latest advert of each decode worker; ``vouch`` checks a job against it."""

    def __init__(self, kv_spec: str) -> None:
        self.kv_spec = kv_spec
        self._adverts: dict[str, DecodeAdvert] = {}
        self._heard_at: dict[str, float] = {}  # worker id -> monotonic time its advert came
        self._heard = asyncio.Event()  # set and replaced on every new advert

    def note(self, advert: DecodeAdvert) -> None:
        self._adverts[advert.worker_id] = advert
        self._heard_at[advert.worker_id] = time.monotonic()
        self._heard.set()
        self._heard = asyncio.Event()

    def loads(self) -> list[HeardLoad]:
        """Each decode worker's latest load, with when it was heard (core_loan.py)."""
        return [
            HeardLoad(wid, self._heard_at[wid], advert.load.num_running)
            for wid, advert in self._adverts.items()
        ]

    def get(self, worker_id: str) -> DecodeAdvert | None:
        return self._adverts.get(worker_id)

    async def wait_for(self, worker_id: str, timeout_s: float) -> DecodeAdvert | None:
        """The worker's advert, waiting up to ``timeout_s`` for one (a worker just started)."""
        deadline = time.monotonic() + timeout_s
        while (advert := self._adverts.get(worker_id)) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                await asyncio.wait_for(self._heard.wait(), left)
            except TimeoutError:
                return None
        return advert

    async def vouch(self, job: PrefillJob, timeout_s: float) -> DecodeAdvert:
        """The advert that vouches for ``job``'s target; UnvouchedJobError saying what differs."""
        advert = await self.wait_for(job.decode_worker_id, timeout_s)
        if advert is None:
            raise UnvouchedJobError(
                f"decode worker {job.decode_worker_id!r} has not advertised on "
                f"its mesh's registry.advertise subject within {timeout_s:g} s; is it running (in "
                "this mesh)?"
            )
        check_job_against_advert(job, advert, self.kv_spec)
        return advert


def check_job_against_advert(job: PrefillJob, advert: DecodeAdvert, kv_spec: str) -> None:
    """Raise UnvouchedJobError unless ``job`` targets blocks of ``advert``'s pool."""
    who = f"decode worker {advert.worker_id!r}"
    # equal specs, or specs that differ in the KV dtype alone (the writes convert it)
    decode_kv_dtype(kv_spec, advert.reach.kv_spec)
    if job.descriptor != advert.reach.descriptor:
        raise UnvouchedJobError(f"the job's transport descriptor is not the one {who} advertises")
    if job.block_bytes != advert.reach.block_bytes:
        raise UnvouchedJobError(
            f"the job's block_bytes {job.block_bytes} are not {who}'s {advert.reach.block_bytes}"
        )
    if len(job.ranks) != advert.reach.tp - 1:
        raise UnvouchedJobError(
            f"the job names {len(job.ranks) + 1} ranks' blocks but {who} runs at TP {advert.reach.tp}"
        )
    _check_block_addrs(job.block_addrs, advert, who, advert.reach.block_bytes)
    for rank, target in enumerate(job.ranks, start=1):
        if len(target.block_addrs) != len(job.block_addrs):
            raise UnvouchedJobError(
                f"the job names {len(job.block_addrs)} blocks but {len(target.block_addrs)} on "
                f"rank {rank} of {who}"
            )
        # an uneven split's rank holds fewer heads than rank 0 (the advert's), never more
        block_bytes = target.block_bytes or advert.reach.block_bytes
        if not 0 < block_bytes <= advert.reach.block_bytes:
            raise UnvouchedJobError(
                f"rank {rank} of {who} has {block_bytes}-byte blocks, more than rank 0's "
                f"{advert.reach.block_bytes}"
            )
        _check_block_addrs(target.block_addrs, advert, f"rank {rank} of {who}", block_bytes)


def _check_block_addrs(
    block_addrs: tuple[int, ...], advert: DecodeAdvert, who: str, block_bytes: int
) -> None:
    # the advert carries no address (issue 40): the blocks must be whole blocks apart, distinct,
    # and span no more than the pool; the decode worker's transport checks each write's bounds
    lowest = min(block_addrs, default=0)
    seen: set[int] = set()
    for addr in block_addrs:
        offset = addr - lowest
        if (
            addr < 0
            or addr in seen
            or offset % block_bytes
            or offset // block_bytes >= advert.pool.total_blocks
        ):
            raise UnvouchedJobError(f"block address {addr:#x} is not a block of {who}'s pool")
        seen.add(addr)
