"""How a feature joins the prefill worker: ``JobHook``, told of each job's life.

The worker runs jobs (``PrefillWorker.prefill``) and steps its engine; a hook, composed from the
config (``compose.py``'s ``FEATURES``), is called at fixed points and never edits the worker:

* ``on_received(msg)``: a job arrived (not a duplicate); before any wait of the worker's;
* ``prepare(job)``: the job is taken, its prompt not yet in the engine; no lock held (a hook may
  wait on I/O here, e.g. read the prompt's prefix from a kv-store);
* ``before_add(job)``: under the engine lock, right before the prompt enters the engine (what
  ``prepare`` fetched enters the prefix cache here, so nothing evicts it before the prompt uses it);
* ``admit(job, prompt)``: the prompt is in the engine; called under the engine lock;
* ``has_work()`` / ``step()``: the engine loop runs while any hook has work and calls ``step``
  after each target step (the hook takes the engine lock itself: it got it at construction);
* ``start(job, tg)``: the job's chunks begin; tasks of the hook's go into the job's task group,
  which the job waits for before it ends;
* ``on_chunk(job, chunk, tg)``: after the write of a target chunk was issued;
* ``on_computed(job)``: the last chunk is in;
* ``on_stop(job)``: the job stops early (aborted, a write failed); no more chunks come;
* ``on_end(job)``: the job's engine work is released; called under the engine lock;
* ``finish(msg, job, ok, error)``: the job's outcome, ``job`` None for one refused before it
  started; what to announce to another worker (``Announcement``), or None.

The kv-store's prompt prefixes (store_prefix.py) and draft-KV writes (draft_writes.py) are the
hooks today. Every method has a no-op default, so a hook
implements only what it uses. A ``JobHook`` is a ``Feature`` (shared/bus/worker_feature.py): its
subscriptions, loops and ``aclose`` are the service shell's, which names none of them.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from kvmesh.shared.bus.worker_feature import Feature

if TYPE_CHECKING:
    from kvmesh.services.prefill.job import Job
    from kvmesh.shared.bus.messages.prefill_jobs import PrefillDone, PrefillJob
    from kvmesh.shared.engine.sequence import ChunkReady

# (the worker id it goes to, the message): sent before the decode worker's PrefillDone
Announcement = tuple[str, "PrefillDone"]


class JobHook(Feature):
    """A prefill feature; the worker calls these in the order the module docstring gives."""

    def on_received(self, msg: PrefillJob) -> None:
        return None

    async def prepare(self, job: Job) -> None:
        return None

    def before_add(self, job: Job) -> None:
        return None

    def admit(self, job: Job, prompt: list[int]) -> None:
        return None

    def has_work(self) -> bool:
        return False

    async def step(self) -> None:
        return None

    def start(self, job: Job, tg: asyncio.TaskGroup) -> None:
        return None

    async def on_chunk(self, job: Job, chunk: ChunkReady, tg: asyncio.TaskGroup) -> None:
        return None

    async def on_computed(self, job: Job) -> None:
        return None

    async def on_stop(self, job: Job) -> None:
        return None

    def on_end(self, job: Job) -> None:
        return None

    def finish(self, msg: PrefillJob, job: Job | None, ok: bool, error: str) -> Announcement | None:
        return None
