"""Whether two tokenizers share a vocabulary: a draft model must propose the target's token ids
(kvmesh serve draft --method model, kvmesh serve prefill --draft-model)."""

from __future__ import annotations

from typing import Any

_VOCAB_PROBE = "The quick brown fox jumps over the lazy dog. 0123456789 <|>{}[]() äöü 你好"


def vocabulary_difference(target: Any, draft: Any) -> str | None:
    """Why two tokenizers do not share a vocabulary (None: they do, as far as ids go): sizes,
    special tokens and the ids of a probe text in both."""
    if target.vocab_size != draft.vocab_size:
        return f"vocabulary sizes differ ({target.vocab_size} vs {draft.vocab_size})"
    if target.bos_token_id != draft.bos_token_id:
        return f"bos_token_id differs ({target.bos_token_id} vs {draft.bos_token_id})"
    if target.encode(_VOCAB_PROBE, False) != draft.encode(_VOCAB_PROBE, False):
        return "the same text encodes to different token ids"
    return None
