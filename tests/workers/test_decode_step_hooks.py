"""The decode worker's step hooks (services/decode/step_hooks.py): a feature written as a hook
and handed to the worker is called at each point of the engine loop, in composition order, with
the engine lock held; its drafts reach the engine, the work it returns runs without the lock,
and it hears of every remote prefill admitted. The recording hook here is a feature added the
way any is: its own module and the composition (here, the test's), nothing in worker.py."""

from __future__ import annotations

import asyncio

from kvmesh.services.decode.step_hooks import Step, StepHook, StepPlan
from kvmesh.services.decode.worker import DecodeWorker
from kvmesh.shared.bus.messages.placement import ReserveRequest
from kvmesh.shared.bus.messages.prefill_jobs import PrefillDone
from kvmesh.shared.bus.messages.token_streams import TokenEvent
from kvmesh.shared.engine.draft_tree import DraftTree
from kvmesh.shared.kv.imm import imm_slot, pack_imm
from kvmesh.shared.text.sampling import SamplingOptions
from kvmesh.shared.transport.completions import Completion


class Recorder(StepHook):
    """Records every call; proposes ``drafts`` once; returns work from ``between_steps`` that
    checks the engine lock is free while it runs."""

    def __init__(self, lock: asyncio.Lock, drafts: dict[str, DraftTree] | None = None) -> None:
        self.lock = lock
        self.drafts = drafts
        self.calls: list[str] = []
        self.steps: list[Step] = []
        self.admitted: list[tuple[str, int]] = []
        self.work_ran_unlocked: list[bool] = []

    def before_step(self, engine) -> StepPlan | None:
        assert self.lock.locked()
        self.calls.append("before")
        drafts, self.drafts = self.drafts, None
        return StepPlan(drafts=drafts) if drafts else None

    def after_step(self, engine, step: Step) -> None:
        assert self.lock.locked()
        self.calls.append("after")
        self.steps.append(step)

    def between_steps(self, engine):
        assert self.lock.locked()
        self.calls.append("between")
        return self._work()

    async def _work(self) -> None:
        self.work_ran_unlocked.append(not self.lock.locked())

    def on_admitted(self, request_id: str, done: PrefillDone) -> None:
        self.admitted.append((request_id, done.first_token))


def worker_with(tiny, *hooks_of) -> tuple[DecodeWorker, list[Recorder]]:
    """A decode worker composed with one Recorder per entry of ``hooks_of`` (its drafts)."""
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine

    engine = LLMEngine(*tiny, EngineConfig(num_blocks=64))
    lock = asyncio.Lock()
    hooks = [Recorder(lock, drafts) for drafts in hooks_of]
    worker = DecodeWorker(
        engine, worker_id="d0", base_addr=engine.kv_pool.base_addr, hooks=hooks, lock=lock
    )
    return worker, hooks


def _request(rid: str, n: int, local: bool, max_tokens: int = 4) -> ReserveRequest:
    opts = SamplingOptions(max_tokens=max_tokens, temperature=0.0)
    return ReserveRequest(rid, tuple(range(1, n + 1)), opts, local, "L" + rid, 1000)


async def _drive(worker: DecodeWorker) -> list[TokenEvent]:
    events = []
    for _ in range(1000):
        if worker.is_idle:
            return events
        events += await worker.admit()
        events += await worker.step()
    raise AssertionError("the worker was still busy after 1000 steps")


async def test_every_hook_is_called_in_order_at_each_point_of_the_loop(tiny):
    worker, (first, second) = worker_with(tiny, None, None)
    assert (await worker.reserve(_request("a", 10, local=True))).ok
    events = await _drive(worker)
    assert events[-1].finish_reason == "length"
    assert first.calls == second.calls
    # each admit() calls between_steps once; each step() before, then after
    assert first.calls[:3] == ["between", "before", "after"]
    assert first.calls.count("before") == first.calls.count("after") == len(first.steps)
    assert all(first.work_ran_unlocked) and len(first.work_ran_unlocked) >= len(first.steps)


async def test_after_step_sees_finished_sequences_as_they_ended(tiny):
    worker, (hook,) = worker_with(tiny, None)
    assert (await worker.reserve(_request("a", 10, local=True, max_tokens=3))).ok
    events = await _drive(worker)
    output = [t for e in events for t in e.token_ids]
    [(out, seq)] = [pair for step in hook.steps for pair in step.finished()]
    assert out.request_id == "a" and out.finish_reason == "length"
    assert list(seq.token_ids) == [*range(1, 11), *output]  # prompt and every output token
    assert all(step.seconds >= 0 for step in hook.steps)


async def test_drafts_a_hook_plans_are_verified_by_the_step(tiny):
    """A draft of the right next token is accepted: the step emits two tokens, the Step says
    which tree it verified."""
    plain, _ = worker_with(tiny)
    assert (await plain.reserve(_request("a", 10, local=True, max_tokens=6))).ok
    expected = [t for e in await _drive(plain) for t in e.token_ids]

    worker, (hook,) = worker_with(tiny, None)
    assert (await worker.reserve(_request("a", 10, local=True, max_tokens=6))).ok
    await worker.admit()
    first = await worker.step()  # the prefill: the first token
    assert [t for e in first for t in e.token_ids] == expected[:1]
    tree = DraftTree((expected[1],), (-1,))
    hook.drafts = {"a": tree}
    second = await worker.step()
    assert [t for e in second for t in e.token_ids] == expected[1:3]
    assert hook.steps[-1].drafts == {"a": tree}
    rest = await _drive(worker)
    assert [t for e in first + second + rest for t in e.token_ids] == expected


async def test_a_remote_prefills_admission_is_told_to_every_hook(tiny):
    worker, hooks = worker_with(tiny, None, None)
    reply = await worker.reserve(_request("a", 20, local=False))
    assert reply.ok
    slot = imm_slot(worker.base_addr + reply.block_ids[0] * worker.block_bytes, worker.block_bytes)
    worker.on_completion(Completion(pack_imm(slot, 0), "p0", 1))
    worker.on_prefill_done(PrefillDone("a", "La", True, first_token=65, num_writes=1))
    events = await _drive(worker)
    assert events[0].token_ids == (65,)
    assert [hook.admitted for hook in hooks] == [[("a", 65)], [("a", 65)]]
