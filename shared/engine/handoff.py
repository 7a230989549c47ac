"""KV hand-off between engines: prompt KV computed by one process, decoded by another.

Prefill side: after every step that computed prompt tokens of a ``prefill_only`` sequence,
``report_chunk`` hands its new blocks to ``on_chunk`` as a ``ChunkReady``; chunks are whole blocks
except the last, which carries the first token. Decode side: ``prefilled_sequence`` builds a
sequence over blocks a remote writer filled with its prompt KV (a ``PrefilledRequest``: what
``LLMEngine.admit_prefilled`` was given), ready to decode its first token.
"""

from __future__ import annotations

from collections.abc import Sequence as Sequence_
from dataclasses import dataclass

from kvmesh.shared.engine.block_manager import BlockManager
from kvmesh.shared.engine.sequence import ChunkReady, RequestError, Sequence
from kvmesh.shared.text.sampling import SamplingOptions, TokenLogprobs


def report_chunk(
    seq: Sequence,
    first_token: int | None,
    block_manager: BlockManager,
    first_logprobs: TokenLogprobs | None = None,
    prompt_logprobs: list[TokenLogprobs] | None = None,
) -> None:
    """Report the prompt tokens computed since the last report; ``first_token`` ends the prefill
    (with the first token's and the prompt's log-probabilities, when asked for)."""
    end = seq.num_computed_tokens
    is_last = first_token is not None
    num_blocks = block_manager.num_blocks_for(end) if is_last else end // block_manager.block_size
    chunk = ChunkReady(
        seq.request_id,
        seq.num_chunks,
        seq.num_reported_tokens,
        end,
        tuple(seq.block_table[seq.num_reported_blocks : num_blocks]),
        is_last,
        first_token,
        first_logprobs,
        tuple(prompt_logprobs or ()) if is_last else (),
    )
    seq.num_chunks += 1
    seq.num_reported_tokens, seq.num_reported_blocks = end, num_blocks
    if seq.on_chunk is not None:
        seq.on_chunk(chunk)


@dataclass(frozen=True, slots=True)
class PrefilledRequest:
    """A request whose prompt KV a remote prefill wrote into ``block_ids``, with the first token
    it sampled (and the first token's and the prompt's log-probabilities, when asked for)."""

    request_id: str
    prompt_ids: list[int]
    block_ids: list[int]
    first_token: int
    params: SamplingOptions
    first_logprobs: TokenLogprobs | None = None
    prompt_logprobs: Sequence_[TokenLogprobs] = ()


def prefilled_sequence(
    req: PrefilledRequest, block_manager: BlockManager, vocab_size: int
) -> Sequence:
    """A decoding sequence whose prompt KV is already in ``req.block_ids``, its full blocks
    committed to the prefix cache. The prompt itself is checked by the caller."""
    rid, prompt = req.request_id, req.prompt_ids
    need = block_manager.num_blocks_for(len(prompt))
    if len(req.block_ids) != need:
        raise RequestError(
            f"request {rid!r}: {len(prompt)} prompt tokens need {need} blocks, "
            f"got {len(req.block_ids)}"
        )
    if not 0 <= req.first_token < vocab_size:
        raise RequestError(
            f"request {rid!r}: first token {req.first_token} is outside the vocabulary"
        )
    seq = Sequence(rid, [*prompt, req.first_token], req.params, num_prompt_tokens=len(prompt))
    if req.params.logprobs is not None:
        if req.first_logprobs is None:
            raise RequestError(
                f"request {rid!r} asks for logprobs; its first token came without them"
            )
        seq.logprobs.append(req.first_logprobs)
    seq.block_table = list(req.block_ids)
    seq.num_computed_tokens = len(prompt)
    block_manager.share_cached(seq)  # the cache's copies of the prompt stay held while it runs
    block_manager.commit(seq)
    return seq
