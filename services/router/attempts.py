"""A request's attempts on the mesh and the tokens they sent its client (pure: no NATS, no clock).

A request that loses something it depends on runs again under a new wire id: ``<id>`` first,
then ``<id>-r1`` / ``-m2`` ... numbered in one sequence. Before its first token it is retried
from the start; after it, its stream migrates: the prompt plus the tokens sent so far become the
prompt of an attempt for the tokens still owed. Either counts against --max-retries.
``dispatch.py`` does the I/O of each attempt and asks ``Attempts`` what to do.
"""

from __future__ import annotations

from typing import Literal

import msgspec
from kvmesh.services.router.errors import MeshError
from kvmesh.services.router.prompt import Prompt
from kvmesh.shared.bus.messages.token_streams import TokenEvent
from kvmesh.shared.bus.wire_ids import wire_id
from kvmesh.shared.text.sampling import SamplingOptions


class Attempts:
    """The bookkeeping of one request across its attempts: wire ids, runs again, and every token
    the client has been sent (which a migrated attempt takes as prompt)."""

    def __init__(self, response_id: str, prompt: Prompt, max_retries: int) -> None:
        self.response_id = response_id  # what the client sees; constant across attempts
        self.max_retries = max_retries
        self.num_attempts = 1  # wire ids used: <id>, then <id>-r1 / -m2 ... in one sequence
        self.num_runs_again = 0  # of them, runs again after a failure (--max-retries counts)
        self.num_events = 0  # token events of the current attempt
        self.num_accepted_drafts = 0  # of the tokens relayed, accepted drafts (all attempts)
        self.prompt = prompt  # of the current attempt: a migrated one carries the output so far
        self.generated: list[int] = []  # every token the client has been sent, all attempts
        self.migrated_tokens = 0  # of those, how many the current attempt's prompt carries
        # n > 1: tokens per choice (of this attempt: they never migrate) and the finished ones
        self._choice_tokens: dict[int, int] = {}
        self._finished_choices: set[int] = set()

    def next_wire_id(self, kind: Literal["r", "m"]) -> str:
        """The next attempt's wire id: ``-r<n>`` runs it from the start (a retry, or a placement
        asked again), ``-m<n>`` migrates its stream; ``n`` counts every attempt."""
        wire = wire_id(self.response_id, kind, self.num_attempts)
        self.num_attempts += 1
        return wire

    def run_again(self, why: str) -> Literal["retry", "migrate"]:
        """Something the request depended on failed (``why``): how it runs again, from the start
        before its first token, else by migrating its stream; a MeshError once --max-retries runs
        are spent, or when its stream cannot migrate."""
        if self.num_runs_again >= self.max_retries:
            raise MeshError(
                f"{why} while serving request {self.response_id} ({self.num_events} token "
                f"events in, attempt {self.num_attempts}; --max-retries spent)"
            )
        self.num_runs_again += 1
        if self.num_events == 0:
            return "retry"
        unmovable = why_not_migrated(self.prompt.sampling)
        if unmovable:
            raise MeshError(
                f"{why} while serving request {self.response_id} after its first tokens; a "
                f"request {unmovable} is not migrated (send it again)"
            )
        return "migrate"

    def migrate(self) -> bool:
        """Make the prompt of the attempt that takes over a broken stream: the prompt plus the
        tokens sent so far, for the tokens still owed (greedy output is what an undisturbed run
        gives). False when nothing is owed any more (the finish event was lost)."""
        generated = tuple(self.generated)
        made = len(generated) - self.migrated_tokens  # by the attempt that broke
        owed = self.prompt.sampling.max_tokens - made
        if owed <= 0:
            return False
        base = self.prompt.prompt_ids[: len(self.prompt.prompt_ids) - self.migrated_tokens]
        # The output so far becomes prompt: its tokens still count for repetition_penalty, no
        # longer for the frequency and presence penalties (vLLM's output-only counts).
        sampling = msgspec.structs.replace(
            self.prompt.sampling,
            max_tokens=owed,
            min_tokens=max(0, self.prompt.sampling.min_tokens - made),
            prompt_logprobs=None,  # the first attempt scored the prompt; this one's is longer
        )
        self.prompt = Prompt(base + generated, sampling)
        self.migrated_tokens = len(generated)
        self.num_events = 0
        return True

    def gap(self, event: TokenEvent) -> str:
        """Why ``event`` shows that token events of its attempt were lost on the way ("" when
        none was): the stream migrates then."""
        received = self._received(event)
        if not is_gap(event, received):
            return ""
        return (
            f"token events were lost (the decode worker counts {event.num_output_tokens} "
            f"tokens of choice {event.index}, {received} arrived before)"
        )

    def arrived_before(self, event: TokenEvent) -> bool:
        """Whether ``event``'s tokens all arrived already: a resumed stream hears the events
        the decode worker made between its subscription and its replay twice."""
        if self.prompt.sampling.n != 1 or not event.token_ids or not event.num_output_tokens:
            return False
        return event.num_output_tokens <= self._received(event)

    def record(self, event: TokenEvent) -> bool:
        """Count ``event``'s tokens as sent to the client; whether every choice has finished."""
        received = self._received(event)
        self.num_events += 1
        self.generated.extend(event.token_ids)
        self._choice_tokens[event.index] = received + len(event.token_ids)
        self.num_accepted_drafts += event.num_accepted_drafts
        if event.finish_reason is None:
            return False
        self._finished_choices.add(event.index)
        return len(self._finished_choices) >= self.prompt.sampling.n

    def _received(self, event: TokenEvent) -> int:
        """The tokens of ``event``'s choice that this attempt sent before it."""
        if self.prompt.sampling.n == 1:
            return len(self.generated) - self.migrated_tokens
        return self._choice_tokens.get(event.index, 0)


def why_not_migrated(sampling: SamplingOptions) -> str:
    """What keeps a request that has streamed tokens from migrating ("" if nothing): a migrated
    attempt takes the output so far as prompt, which n > 1 choices cannot share, and which a
    structured output's grammar would start over after."""
    if sampling.n > 1:
        return "of n > 1 choices"
    if sampling.structured_outputs is not None:
        return "with a structured output (its grammar cannot resume mid-output)"
    return ""


def is_gap(event: TokenEvent, num_received: int) -> bool:
    """Whether ``event`` says its attempt made more (or fewer) tokens than the ``num_received``
    that arrived before it plus its own: a token event was lost on the way (0: not counted)."""
    if event.num_output_tokens == 0 or event.finish_reason in ("error", "abort"):
        return False
    return event.num_output_tokens != num_received + len(event.token_ids)
