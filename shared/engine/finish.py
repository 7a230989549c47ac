"""When a sequence is done: a stop token or EOS, a stop string, or its length limit.

Stop strings are matched on text from ``kvmesh.shared.text.detokenize`` (the router's pipeline, so both sides
stop at the same token). Only sequences with stop strings carry a ``TextStream``
(``Sequence.stop_text``); every other sequence is checked on ids alone and never detokenized.
The stream has been fed exactly the sequence's emitted output tokens.
"""

from __future__ import annotations

from kvmesh.shared.engine.sequence import Sequence
from kvmesh.shared.text.detokenize import TextStream, TokenDecoder


def stop_text_for(seq: Sequence, tokenizer: TokenDecoder | None) -> TextStream | None:
    """A stream over the sequence's emitted output tokens, or None when it has no stop strings."""
    if not seq.params.stop:
        return None
    assert tokenizer is not None, "stop strings need a tokenizer (checked on admission)"
    stream = TextStream(tokenizer, seq.prompt_ids, seq.params.stop)
    stream.add(seq.output_ids[: seq.num_emitted_tokens])
    return stream


def finish_reason(seq: Sequence, eos_token_ids: frozenset[int], max_seq_len: int) -> str | None:
    """Check the sequence's last token, which is not yet emitted: "stop", "length" or None.

    A stop token (or EOS) ends the request and adds no text; a stop string ends it at the token
    whose text completes the match."""
    p = seq.params
    token = seq.token_ids[-1]
    if token in p.stop_token_ids or (not p.ignore_eos and token in eos_token_ids):
        return "stop"
    if seq.grammar is not None and seq.grammar.is_terminated():  # the structured output is done
        return "stop"
    if seq.stop_text is not None:
        seq.stop_text.add((token,))
        if seq.stop_text.is_stopped:
            return "stop"
    if seq.num_output_tokens >= p.max_tokens or len(seq.token_ids) >= max_seq_len:
        return "length"
    return None
