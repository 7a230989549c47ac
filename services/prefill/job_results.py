"""How a prefill job ended, as its messages (pure): ``PrefillDone`` for its decode worker (always:
it frees the reserved blocks on a failure) and ``PrefillReport`` for its router (the job's
timing; none for a job refused before it started).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.services.prefill.job import Job
from kvmesh.services.prefill.job_hooks import Announcement
from kvmesh.services.prefill.plan import PrefillTiming
from kvmesh.shared.bus.messages.prefill_jobs import PrefillDone, PrefillJob, PrefillReport


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """How a job ended: ``done`` goes to its decode worker (always), ``report`` to its router
    (None for a job refused before it started)."""

    done: PrefillDone
    report: PrefillReport | None = None
    # (draft worker id, its announcement) when a hook wrote the prompt's draft KV there: sent
    # before ``done``, so the draft worker has the KV when the decode's first context arrives
    draft_done: Announcement | None = None


def job_result(
    worker_id: str,
    msg: PrefillJob,
    job: Job | None,
    error: str,
    timing: PrefillTiming | None,
    draft_done: Announcement | None = None,
) -> PrefillResult:
    """What ``worker_id`` tells of ``msg``'s job: ``job`` None when it was refused before it
    started, ``error`` "" when it succeeded; ``timing``: the job's (``job.timeline``)."""
    ok = job is not None and not error
    done = PrefillDone(
        msg.request_id,
        msg.lease_id,
        ok,
        first_token=job.first_token if ok else -1,
        first_logprobs=job.first_logprobs if ok else None,
        prompt_logprobs=job.prompt_logprobs if ok else (),
        # every writer's: the TP followers write each chunk too (ChunkPlanner.num_writes)
        num_writes=(job.num_writes * job.planner.rank_slice.num_writers if job is not None else 0),
        error=error,
        rkey=msg.rkey,
        draft_worker_id=draft_done[0] if draft_done and draft_done[1].ok else "",
    )
    if job is None:
        return PrefillResult(done)
    assert timing is not None
    report = PrefillReport(
        msg.request_id,
        worker_id,
        queue_s=timing.queue_s,
        compute_s=timing.compute_s,
        transfer_s=timing.transfer_s,
        exposed_transfer_s=timing.exposed_transfer_s,
        num_chunks=timing.num_chunks,
    )
    return PrefillResult(done, report, draft_done)
