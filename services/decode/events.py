"""The TokenEvents a decode worker publishes: what the client hears of a step's output of a
request, and of a request that failed before it ran."""

from __future__ import annotations

from kvmesh.shared.bus.messages.token_streams import TokenEvent
from kvmesh.shared.engine.sequence import RequestOutput
from kvmesh.shared.obs import logs

log = logs.get_logger(__name__)


def token_event(out: RequestOutput) -> TokenEvent | None:
    """What the client hears of one step's output of a request (None: nothing new)."""
    if not out.new_token_ids and not out.finished:
        return None
    if out.finished:
        log.debug(
            "finished",
            request_id=out.request_id,
            finish_reason=out.finish_reason,
            num_output_tokens=out.num_output_tokens,
        )
    return TokenEvent(
        out.request_id,
        tuple(out.new_token_ids),
        finish_reason=out.finish_reason if out.finished else None,
        num_prompt_tokens=out.num_prompt_tokens,
        num_output_tokens=out.num_output_tokens,
        num_accepted_drafts=min(out.accepted_drafts, len(out.new_token_ids)),
        logprobs=tuple(out.logprobs or ()),
        index=out.index,
        prompt_logprobs=tuple(out.prompt_logprobs or ()),
    )


def failed_event(request_id: str, num_prompt_tokens: int, error: str) -> TokenEvent:
    return TokenEvent(
        request_id, (), finish_reason="error", num_prompt_tokens=num_prompt_tokens, error=error
    )
