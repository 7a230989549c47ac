"""Request admission: what an engine refuses a request for, and the ``Sequence`` it admits.

``check_prompt`` and ``check_stop`` raise ``RequestError`` (``PromptTooLongError``) for a request
the engine cannot take as given, each message saying what to change; ``grammar_for`` gives a
fresh matcher of a request's structured output. ``sequence`` builds a new request's sequence
(``LLMEngine.add_request``), ``prefilled`` one whose prompt KV a remote prefill wrote
(``LLMEngine.admit_prefilled``, over ``handoff.prefilled_sequence``) and ``choice`` one of a
request's further choices (``SamplingOptions.n`` > 1, over ``choices.fork``). Registering the
sequence with the engine and its scheduler is the caller's.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import Any

from kvmesh.shared.engine import choices, handoff
from kvmesh.shared.engine.block_manager import BlockManager
from kvmesh.shared.engine.finish import stop_text_for
from kvmesh.shared.engine.grammar import GrammarBook
from kvmesh.shared.engine.sequence import ChunkReady, PromptTooLongError, RequestError, Sequence
from kvmesh.shared.kv.kv_cache import KVPool
from kvmesh.shared.text.detokenize import TokenDecoder
from kvmesh.shared.text.sampling import SamplingOptions
from kvmesh.shared.text.structured_output import StructuredOutputError


@dataclass(eq=False)
class AdmissionRules:
    """An engine's admission rules over its vocabulary, length limit and KV pool."""

    tokenizer: TokenDecoder | None
    grammars: GrammarBook | None
    vocab_size: int
    max_model_len: int
    block_manager: BlockManager
    kv_pool: KVPool

    def check_prompt(self, request_id: str, prompt_ids: list[int], in_use: Container[str]) -> None:
        """RequestError unless the id is free (not in ``in_use``) and the prompt fits."""
        if request_id in in_use:
            raise RequestError(f"request id {request_id!r} is already in use; pick a unique id")
        n = len(prompt_ids)
        if n == 0:
            raise RequestError(
                f"request {request_id!r}: the prompt is empty; send at least one token"
            )
        if any(not 0 <= t < self.vocab_size for t in prompt_ids):
            bad = next(t for t in prompt_ids if not 0 <= t < self.vocab_size)
            raise RequestError(
                f"request {request_id!r}: token id {bad} is outside the vocabulary (size {self.vocab_size})"
            )
        if n > self.max_model_len:
            raise PromptTooLongError(
                f"request {request_id!r}: the prompt has {n} tokens but max_model_len is "
                f"{self.max_model_len}; shorten the prompt by at least {n - self.max_model_len} tokens"
            )
        bm = self.block_manager
        if bm.num_blocks_for(n) > bm.num_total_blocks:
            raise PromptTooLongError(
                f"request {request_id!r}: the prompt has {n} tokens but the KV pool holds only "
                f"{bm.num_total_blocks * bm.block_size}; shorten it or give the engine more KV memory"
            )

    def check_stop(self, request_id: str, params: SamplingOptions) -> None:
        """RequestError for stop or bias token ids outside the vocabulary, or stop strings
        without a tokenizer."""
        named = {*params.stop_token_ids, *params.logit_bias}
        bad = next((t for t in sorted(named) if t >= self.vocab_size), None)
        if bad is not None:
            raise RequestError(
                f"request {request_id!r}: token id {bad} (in stop_token_ids or logit_bias) is "
                f"outside the vocabulary (size {self.vocab_size})"
            )
        if params.stop and self.tokenizer is None:
            raise RequestError(
                f"request {request_id!r}: stop strings need a tokenizer and this engine has none; "
                "use stop_token_ids instead"
            )

    def grammar_for(self, request_id: str, params: SamplingOptions) -> Any:
        """A fresh matcher of the request's structured output (None without one)."""
        if params.structured_outputs is None:
            return None
        if self.grammars is None:
            raise RequestError(
                f"request {request_id!r}: structured outputs need a tokenizer and this engine "
                "has none"
            )
        try:
            return self.grammars.matcher(params.structured_outputs)
        except StructuredOutputError as exc:
            raise RequestError(f"request {request_id!r}: {exc}") from None

    def sequence(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingOptions,
        in_use: Container[str],
        prefill_only: bool,
        on_chunk: Callable[[ChunkReady], Any] | None,
    ) -> Sequence:
        """A new request's sequence, waiting for its prefill."""
        self.check_prompt(request_id, prompt_ids, in_use)
        if not prefill_only:
            self.check_stop(request_id, params)
        seq = Sequence(
            request_id, list(prompt_ids), params, prefill_only=prefill_only, on_chunk=on_chunk
        )
        seq.grammar = self.grammar_for(request_id, params)
        if not prefill_only:
            seq.stop_text = stop_text_for(seq, self.tokenizer)
        return seq

    def prefilled(self, req: handoff.PrefilledRequest, in_use: Container[str]) -> Sequence:
        """A decoding sequence over ``req.block_ids`` (the engine takes them over), its first
        token not yet emitted (``num_emitted_tokens`` 0)."""
        self.check_prompt(req.request_id, req.prompt_ids, in_use)
        self.check_stop(req.request_id, req.params)
        matcher = self.grammar_for(req.request_id, req.params)
        if matcher is not None and not matcher.accept_token(req.first_token):
            raise RequestError(
                f"request {req.request_id!r}: the first token {req.first_token} breaks its "
                "structured output's grammar"
            )
        seq = handoff.prefilled_sequence(req, self.block_manager, self.vocab_size)
        seq.grammar = matcher
        seq.prompt_logprobs = list(req.prompt_logprobs)
        seq.num_emitted_tokens = 0
        seq.stop_text = stop_text_for(seq, self.tokenizer)
        return seq

    def choice(self, parent: Sequence, index: int, forked: bool) -> Sequence:
        """Choice ``index`` of ``parent``'s request: over ``parent``'s prompt KV when ``forked``
        (``choices.can_fork``), else a plain sequence (its prompt prefilled again, from the prefix
        cache where it holds it)."""
        if forked:
            child = choices.fork(parent, index, self.block_manager, self.kv_pool)
        else:
            child = Sequence(
                choices.choice_id(parent.request_id, index),
                parent.prompt_ids,
                parent.params,
                choice_of=parent.request_id,
                index=index,
            )
        child.stop_text = stop_text_for(child, self.tokenizer)
        child.grammar = self.grammar_for(child.request_id, parent.params)
        return child
