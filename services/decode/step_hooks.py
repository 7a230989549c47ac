"""Step hooks: how a feature joins the decode worker's engine loop without the worker knowing it.

The worker owns the engine, its lock and the loop: ``admit()`` between steps, then ``step()``.
A feature (speculative decoding, kv-store puts, swaps) is a ``StepHook`` that the composition
builds from the config (``services/decode/compose.py``). The worker calls each
hook, in the order given, at fixed points, always holding the engine lock itself:

- ``before_step(engine)``: what the hook wants the step to do. Today: draft trees to verify
  (``StepPlan.drafts``).
- ``after_step(engine, step)``: what the step did (``Step``: its outputs, the draft trees it
  verified, its time, the sequences as they were before it). The hook records what it needs and
  may start background work (a put) that does its own I/O.
- ``between_steps(engine)``: in ``admit()``, after the new requests went in. A hook may return a
  coroutine (a swap-in's read) that the worker awaits after it released the lock, before the
  next step.
- ``on_admitted(request_id, done)``: a remote prefill's request entered the engine.

Hooks never receive the lock in a call. The ones whose background work touches the pool later
(a put pinning and unpinning blocks, a swap-in adopting them) are given the engine lock when the
shell composes them, as their one way to touch the engine outside a step. A ``StepHook`` is a
``Feature`` (``shared/bus/worker_feature.py``): its subscriptions, messages, advert fields and
``aclose`` are the shell's business. A feature is added by writing its hook in a module of its
own and one line in ``compose.py``'s ``FEATURES``: ``worker.py`` and ``service.py`` do not change.
"""

from __future__ import annotations

from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvmesh.shared.bus.messages.prefill_jobs import PrefillDone
from kvmesh.shared.bus.worker_feature import Feature
from kvmesh.shared.engine.draft_tree import DraftTree
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.engine.sequence import RequestOutput, Sequence


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What a hook asks of the next step."""

    drafts: Mapping[str, DraftTree] = field(default_factory=dict)  # request id -> tree to verify


@dataclass(frozen=True, slots=True)
class Step:
    """One engine step, as the hooks see it after it ran."""

    outputs: list[RequestOutput]
    drafts: Mapping[str, DraftTree]  # the trees it verified
    seconds: float
    before: Mapping[str, Sequence]  # the engine's sequences as they were when it began

    def finished(self) -> list[tuple[RequestOutput, Sequence]]:
        """Outputs of choice 0 that ended in this step with their sequences (one that ended
        before the step began has none and is left out)."""
        return [
            (out, seq)
            for out in self.outputs
            if out.finished
            and out.index == 0
            and (seq := self.before.get(out.request_id)) is not None
        ]


class StepHook(Feature):
    """A feature of the engine loop. Every method is optional: the base does nothing."""

    def before_step(self, engine: LLMEngine) -> StepPlan | None:
        return None

    def after_step(self, engine: LLMEngine, step: Step) -> None:
        return None

    def between_steps(self, engine: LLMEngine) -> Coroutine[Any, Any, None] | None:
        return None

    def on_admitted(self, request_id: str, done: PrefillDone) -> None:
        return None
