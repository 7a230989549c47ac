"""LLMEngine's KV hand-off calls, decode side::

    engine.reserve_blocks(num_tokens) -> list[int]   # raises OutOfBlocksError; free_reserved(ids)
    engine.admit_prefilled(request_id, prompt_ids, block_ids, first_token, params)

The first token of an admitted request counts as already delivered: later outputs carry the tokens
after it (if the first token already ends it, the next step() reports it finished with no tokens).
An admitted request waits, holding its blocks, for a seat in the running batch
(``max_num_seqs``); a preempted one is recomputed locally like any other.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Sequence_

from kvmesh.shared.engine.admission import AdmissionRules
from kvmesh.shared.engine.block_manager import BlockManager
from kvmesh.shared.engine.handoff import PrefilledRequest
from kvmesh.shared.engine.scheduler import Scheduler
from kvmesh.shared.engine.sequence import RequestOutput, Sequence
from kvmesh.shared.text.sampling import SamplingOptions, TokenLogprobs


class PrefilledCalls:
    """The calls above: blocks reserved for a remote writer, then admitted (LLMEngine inherits
    them)."""

    scheduler: Scheduler
    block_manager: BlockManager
    admission: AdmissionRules
    seqs: dict[str, Sequence]
    _pending: list[RequestOutput]  # outputs the next step() returns first
    _emit: Callable[[Sequence], RequestOutput]  # stop-check its new tokens, build their output
    _fork_choices: Callable[[Sequence], None]  # its n > 1 choices started

    def can_reserve(self, num_tokens: int, max_tokens: int, num_promised: int = 0) -> bool:
        """Whether ``reserve_blocks(num_tokens)`` leaves the output room owed to every sequence
        (and ``num_promised`` more blocks the caller owes, e.g. to reservations in flight)."""
        sched, bm = self.scheduler, self.block_manager
        blocks = bm.num_blocks_for(num_tokens)
        room = sched.output_room(num_tokens, max_tokens, blocks)
        return blocks + room + sched.num_promised_blocks() + num_promised <= bm.num_free_blocks

    def check_request(self, request_id: str, prompt_ids: list[int]) -> None:
        """RequestError if ``add_request`` would refuse this prompt (needs no lock: reads only
        what a step does not change but the id set, whose race add_request settles)."""
        self.admission.check_prompt(request_id, prompt_ids, self.seqs)

    def reserve_blocks(self, num_tokens: int) -> list[int]:
        """Blocks for a remote writer to fill with ``num_tokens`` tokens of KV."""
        return self.block_manager.allocate_blocks(self.block_manager.num_blocks_for(num_tokens))

    def free_reserved(self, block_ids: list[int]) -> None:
        self.block_manager.free_blocks(block_ids)

    def admit_prefilled(
        self,
        request_id: str,
        prompt_ids: list[int],
        block_ids: list[int],
        first_token: int,
        params: SamplingOptions,
        first_logprobs: TokenLogprobs | None = None,
        prompt_logprobs: Sequence_[TokenLogprobs] = (),
    ) -> None:
        """Start decoding a request whose prompt KV is already in ``block_ids`` (from
        ``reserve_blocks``; the engine takes them over and frees them when the request ends).
        ``first_logprobs``: the first token's, when ``params.logprobs`` asks for them;
        ``prompt_logprobs``: the prompt's, when ``params.prompt_logprobs`` does."""
        req = PrefilledRequest(
            request_id, prompt_ids, block_ids, first_token, params, first_logprobs, prompt_logprobs
        )
        seq = self.admission.prefilled(req, self.seqs)
        self.seqs[request_id] = seq
        self.scheduler.add_prefilled(seq)
        self._fork_choices(seq)
        out = self._emit(seq)  # stop checks on the first token, already delivered by prefill
        if out.finished:
            self._pending.append(
                RequestOutput(
                    request_id,
                    [],
                    True,
                    out.finish_reason,
                    out.num_prompt_tokens,
                    out.num_output_tokens,
                )
            )
