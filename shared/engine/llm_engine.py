"""LLMEngine: requests in, tokens out; one ``step()`` = schedule -> run -> postprocess.

Public API (the mesh services build on exactly this)::

    engine = LLMEngine(model, tokenizer, EngineConfig(...), kv_buffer=None)
    engine.add_request(request_id, prompt_ids, params, *, prefill_only=False, on_chunk=None)
    engine.step() -> list[RequestOutput]      # new token ids per request this step
    engine.step(drafts={request_id: DraftTree}) # verify draft trees in the same batch step
    engine.abort(request_id) -> bool          # True if it was known; its blocks are freed and the
                                              # next step() reports finish_reason "abort"
    engine.has_unfinished() -> bool
    engine.generate(prompts: list[list[int]], params) -> list[list[int]]
    engine.kv_pool, engine.block_manager      # the KVPool (over kv_buffer if given), its allocator

Draft trees (decode side): ``step(drafts)`` verifies each decoding request's tree in the step's one
forward pass (tree attention mask), keeps the longest accepted path (``acceptance``: greedy output
and seeded sampling token for token as without drafts, the sampling distribution exact) plus the
target's next token, and rolls the rest back; outputs may carry several tokens, cut by stop
tokens, stop strings and max_tokens as single tokens are, with ``accepted_drafts`` set. Trees for
requests not decoding (prefilling, finished, unknown) are ignored. ``engine.last_spec_step``
(``SpecStepStats``) and ``engine.spec_totals`` count drafts proposed and accepted and verify time.

Speculative verification, lower level (``score``, ``score_trees``, ``accept``, ``keep_path``,
``rollback``; decode side, between steps): ``SpecCalls`` in spec_calls.py.

KV handoff::

    # prefill side: on_chunk(ChunkReady) after every step that computed prompt tokens; chunks are
    # whole blocks except the last; the last one carries the first token. The request then ends
    # with finish_reason "prefill_done" and keeps its blocks until:
    engine.release(request_id)                # (abort() does the same)
    # decode side (``PrefilledCalls`` in prefilled_calls.py):
    engine.reserve_blocks(num_tokens) -> list[int]   # raises OutOfBlocksError; free_reserved(ids)
    engine.admit_prefilled(request_id, prompt_ids, block_ids, first_token, params)

Errors: ``RequestError`` (``PromptTooLongError``, ``UnknownRequestError``) for requests the engine
cannot take as given, ``OutOfBlocksError`` when KV blocks run out for a reservation or a score;
each message says what to change. A sequence never grows past ``max_model_len`` nor past what the
whole KV pool holds (finish_reason "length").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from kvmesh.shared.engine import choices, draft_step, handoff, scoring
from kvmesh.shared.engine.admission import AdmissionRules
from kvmesh.shared.engine.block_manager import BlockManager, OutOfBlocksError
from kvmesh.shared.engine.choices import ChoiceGroups
from kvmesh.shared.engine.config import EngineConfig
from kvmesh.shared.engine.draft_tree import DraftTree
from kvmesh.shared.engine.grammar import GrammarBook
from kvmesh.shared.engine.model_runner import ModelRunner
from kvmesh.shared.engine.outputs import collect_tokens, request_output, stop_check
from kvmesh.shared.engine.prefilled_calls import PrefilledCalls
from kvmesh.shared.engine.sampler import Sampler
from kvmesh.shared.engine.scheduler import Scheduler
from kvmesh.shared.engine.sequence import (
    ChunkReady,
    RequestError,
    RequestOutput,
    Sequence,
    SequenceStatus,
    UnknownRequestError,
)
from kvmesh.shared.engine.spec_calls import SpecCalls
from kvmesh.shared.engine.speculative import DraftVerifier, SpecStepStats, SpecTotals
from kvmesh.shared.engine.step_rows import step_rows
from kvmesh.shared.kv.kv_cache import KVPool
from kvmesh.shared.kv.prefix_hash import layout_root
from kvmesh.shared.model.identity import kv_spec_fingerprint
from kvmesh.shared.model.quant_layers import keeps_weights_stored
from kvmesh.shared.model.tensor_parallel import kv_heads_held
from kvmesh.shared.text.sampling import SamplingOptions

__all__ = [
    "ChunkReady",
    "EngineConfig",
    "LLMEngine",
    "OutOfBlocksError",
    "RequestOutput",
    "SamplingOptions",
]


class LLMEngine(SpecCalls, PrefilledCalls):
    def __init__(
        self, model: Any, tokenizer: Any | None, config: EngineConfig, kv_buffer: Any | None = None
    ) -> None:
        mc = model.config
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                f"{mc.max_position_embeddings}"
            )
        model_dtype = getattr(mc, "torch_dtype", None) or next(model.parameters()).dtype
        # this rank's share of the KV heads under tensor parallelism, in the whole model's blocks
        spec, num_blocks = config.pool_layout(
            mc, model_dtype, kv_heads_held(model), keeps_weights_stored(model)
        )
        self.kv_pool = KVPool(spec, num_blocks, device=config.device, buffer=kv_buffer)
        # what DecodeAdvert.kv_spec says; it roots the prefix hash chain (shared/kv/prefix_hash.py)
        self.kv_spec = kv_spec_fingerprint(spec, mc)
        self.block_manager = BlockManager(
            num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            root_hash=layout_root(self.kv_spec),
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.reserve_output_tokens,
            config.max_num_batched_tokens_no_decode,
        )
        self.runner = ModelRunner(model, self.kv_pool, config.device, config.cpu_kernels)
        eos = set(getattr(mc, "eos_token_ids", ()) or ())
        eos |= set(getattr(tokenizer, "eos_token_ids", ()) or ())
        self.eos_token_ids = frozenset(eos)
        self.sampler = Sampler(config.seed, self.eos_token_ids)
        # structured outputs' compiled grammars (xgrammar is loaded on the first one)
        self.grammars = (
            GrammarBook(tokenizer, mc.vocab_size, self.eos_token_ids) if tokenizer else None
        )
        self.vocab_size = mc.vocab_size
        # A sequence stops ("length") before it could outgrow the whole pool and preempt itself
        # forever.
        self.max_seq_len = min(self.max_model_len, num_blocks * config.block_size)
        self.verifier = DraftVerifier(
            self.block_manager,
            self.kv_pool,
            self.runner,
            tokenizer,
            self.max_seq_len,
            self.vocab_size,
        )
        # what a request is refused for, and the sequences admitted (admission.py)
        self.admission = AdmissionRules(
            tokenizer,
            self.grammars,
            self.vocab_size,
            self.max_model_len,
            self.block_manager,
            self.kv_pool,
        )
        self.seqs: dict[str, Sequence] = {}
        self._last_accepted: dict[str, int] = {}  # request id -> drafts accepted this step
        self.last_spec_step: SpecStepStats | None = None  # set by each step given drafts
        self.spec_totals = SpecTotals()
        self._pending: list[RequestOutput] = []
        self._num_generated = 0
        self._choices = ChoiceGroups()  # the requests whose n > 1 choices run

    # ---- requests -----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingOptions,
        *,
        prefill_only: bool = False,
        on_chunk: Callable[[ChunkReady], Any] | None = None,
    ) -> None:
        seq = self.admission.sequence(
            request_id, prompt_ids, params, self.seqs, prefill_only, on_chunk
        )
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    def _get(self, request_id: str) -> Sequence:
        seq = self.seqs.get(request_id)
        if seq is None:
            raise UnknownRequestError(f"no request {request_id!r} in this engine")
        return seq

    def abort(self, request_id: str) -> bool:
        """Abort the request: each of its choices' sequences still here."""
        seq = self.seqs.get(request_id)
        others = self._choices.others(request_id, self.seqs)
        if seq is None and not others:
            return False
        if seq is not None and seq.is_finished:  # prefill_done, still holding its blocks
            self.release(request_id)
            return True
        for s in [seq, *others] if seq is not None else others:
            self._finish(s, "abort")
            self._pending.append(self._output(s, []))
        return True

    def release(self, request_id: str) -> None:
        """Free the blocks of a finished ``prefill_only`` request (its KV has been handed off)."""
        seq = self._get(request_id)
        if seq.finish_reason != "prefill_done":
            raise RequestError(f"request {request_id!r} is not a finished prefill_only request")
        self.block_manager.deallocate(seq)
        del self.seqs[request_id]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    # ---- the step -----------------------------------------------------------------------------

    def step(self, drafts: Mapping[str, DraftTree] | None = None) -> list[RequestOutput]:
        """One batch step. ``drafts``: request id -> draft tree to verify in this step's forward
        pass; such a request may get several tokens (its accepted path and the next one).
        Trees for requests that are not decoding now, or that do not fit, are ignored."""
        t0 = time.perf_counter()
        outputs, self._pending = self._pending, []
        batch = self.scheduler.schedule()
        if not batch.seqs:
            if drafts:
                self.last_spec_step = draft_step.spec_stats(
                    self.spec_totals, {}, 0, len(drafts), t0
                )
            return outputs
        trees = draft_step.trees_for(self.verifier, batch.seqs, drafts) if drafts else {}
        layout = step_rows(batch.seqs, batch.num_new_tokens, trees)
        num_new, num_samples, num_scored = layout.num_new, layout.num_samples, layout.num_scored
        if trees:
            logits = self.runner.execute(batch.seqs, num_new, layout.num_logits, trees)
        else:
            logits = self.runner.execute(batch.seqs, num_new, layout.num_logits)
        rows, plain, plain_logits = layout.split(logits, trees)
        plain_seqs = [batch.seqs[i] for i in plain]
        sampled = self.sampler(plain_logits, plain_seqs) if plain else []
        logprobs = scoring.sampled_logprobs(plain_logits, plain_seqs, sampled) if plain else {}
        for i, k in enumerate(num_scored):
            if k:
                scoring.score_prompt(batch.seqs[i], rows[i][:k])
        tokens = iter(sampled)
        bm = self.block_manager
        num_accepted = 0
        for i, (seq, n, k) in enumerate(zip(batch.seqs, num_new, num_samples, strict=True)):
            tree = trees.get(i)
            if tree is not None:
                path_len = draft_step.accept_tree(
                    self.verifier, self.sampler.generator, self.eos_token_ids, seq, tree, rows[i]
                )
                self._last_accepted[seq.request_id] = path_len
                num_accepted += path_len
                bm.commit(seq)
                outputs.append(self._emit(seq))
                continue
            seq.num_computed_tokens += n
            bm.commit(seq)
            token = next(tokens) if k else None
            lp = logprobs.get(id(seq))
            if seq.prefill_only:
                handoff.report_chunk(seq, token, bm, lp, seq.prompt_logprobs)
            if token is None:
                continue
            seq.token_ids.append(token)
            if lp is not None:
                seq.logprobs.append(lp)
            if seq.grammar is not None and not seq.prefill_only:
                accepted = seq.grammar.accept_token(token)
                assert accepted, (seq.request_id, token)  # it was sampled under its mask
            if seq.prefill_only:
                self._finish(seq, "prefill_done")
                outputs.append(self._output(seq, [token]))
            else:
                self._fork_choices(seq)
                outputs.append(self._emit(seq))
        if drafts:
            self.last_spec_step = draft_step.spec_stats(
                self.spec_totals, trees, num_accepted, len(drafts) - len(trees), t0
            )
        return outputs

    def _emit(self, seq: Sequence) -> RequestOutput:
        """Stop-check the output tokens not yet returned, in order; build their output."""
        emitted, reason = stop_check(seq, self.eos_token_ids, self.max_seq_len)
        if reason is not None:
            self._finish(seq, reason)
        return self._output(seq, emitted)

    def _output(self, seq: Sequence, new_token_ids: list[int]) -> RequestOutput:
        num_accepted = self._last_accepted.pop(seq.request_id, 0)
        return request_output(seq, new_token_ids, num_accepted)

    def _fork_choices(self, seq: Sequence) -> None:
        """After choice 0's first token: the request's other choices, over its prompt KV. A
        pool too full for their private blocks gets them as plain sequences instead (their
        prompt prefilled again, from the prefix cache where it holds it)."""
        if not self._choices.start(seq):
            return
        forked = choices.can_fork(seq, self.block_manager)
        for i in range(1, seq.params.n):
            child = self.admission.choice(seq, i, forked)
            self.seqs[child.request_id] = child
            if forked:
                self.scheduler.add_prefilled(child)
            else:
                self.scheduler.add(child)

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if reason != "prefill_done":
            self.block_manager.deallocate(seq)
            del self.seqs[seq.request_id]
            self._choices.ended(seq.reply_id, self.seqs)

    def generate(
        self, prompts: list[list[int]], params: SamplingOptions | list[SamplingOptions]
    ) -> list[list[int]]:
        """Run the prompts to completion; returns the generated token ids of each, in order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if any(p.n > 1 for p in params_list):
            raise RequestError("generate() runs n=1; add_request and step() run n > 1 choices")
        ids = []
        for prompt, p in zip(prompts, params_list, strict=True):
            self._num_generated += 1
            ids.append(f"generate-{self._num_generated}")
            self.add_request(ids[-1], prompt, p)
        return collect_tokens(self.step, ids)
