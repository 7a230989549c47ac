"""What a step returns of a sequence: its output tokens not yet returned, stop-checked one by one
in order (``finish.finish_reason``), as a ``RequestOutput`` with their logprobs (and the
prompt's, with the request's first output); ``collect_tokens`` gathers requests' tokens from
steps until each has finished (``LLMEngine.generate``).
"""

from __future__ import annotations

from collections.abc import Callable

from kvmesh.shared.engine.finish import finish_reason
from kvmesh.shared.engine.sequence import RequestOutput, Sequence


def stop_check(
    seq: Sequence, eos_token_ids: frozenset[int], max_seq_len: int
) -> tuple[list[int], str | None]:
    """Check the output tokens not yet returned in order; those after the first that ends the
    sequence are dropped. Returns the tokens to emit and the finish reason (None: not done)."""
    start = seq.num_prompt_tokens + seq.num_emitted_tokens
    new = seq.token_ids[start:]
    del seq.token_ids[start:]
    reason = None
    for token in new:
        seq.token_ids.append(token)
        reason = finish_reason(seq, eos_token_ids, max_seq_len)
        if reason is not None:
            break
    return seq.token_ids[start:], reason


def request_output(seq: Sequence, new_token_ids: list[int], num_accepted: int) -> RequestOutput:
    """The output of ``new_token_ids`` (``num_accepted`` of them accepted drafts); they count as
    returned from now on."""
    logprobs = None
    if seq.params.logprobs is not None and not seq.prefill_only:
        first = seq.num_emitted_tokens
        logprobs = seq.logprobs[first : first + len(new_token_ids)]
        assert len(logprobs) == len(new_token_ids), (seq.request_id, len(logprobs))
    prompt_logprobs = None
    if seq.params.prompt_logprobs is not None and seq.index == 0 and not seq.num_emitted_tokens:
        prompt_logprobs = list(seq.prompt_logprobs)
    seq.num_emitted_tokens = seq.num_output_tokens
    return RequestOutput(
        seq.reply_id,
        new_token_ids,
        seq.is_finished,
        seq.finish_reason,
        seq.num_prompt_tokens,
        seq.num_output_tokens,
        num_accepted,
        logprobs,
        seq.index,
        prompt_logprobs,
    )


def collect_tokens(
    step: Callable[[], list[RequestOutput]], request_ids: list[str]
) -> list[list[int]]:
    """Call ``step`` until each of ``request_ids`` has finished; the new token ids of each, in
    order (outputs of other requests are dropped)."""
    results: dict[str, list[int]] = {rid: [] for rid in request_ids}
    remaining = set(request_ids)
    while remaining:
        for out in step():
            if out.request_id in results:
                results[out.request_id] += out.new_token_ids
                if out.finished:
                    remaining.discard(out.request_id)
    return [results[rid] for rid in request_ids]
