"""The drafters: given sequences' contexts, propose draft trees ``(tokens, parents)``.

``NgramDrafter`` looks the context up in itself (ngram.py). ``EngineDrafter`` runs a small
model greedily in its own LLMEngine (own KV pool; prefix caching keeps each sequence's context
KV between drafts, so a draft computes only what was appended since plus K tokens): the
target's first layers (early exit) or a separate checkpoint; for a tree, ``EngineTreeDrafter``
(tree_drafter.py) grows one level by level from the model's top tokens. ``build_drafter`` makes
the one a DraftConfig asks for and checks it at start-up (one clear error when it cannot serve).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvmesh.services.draft.config import DraftConfig
from kvmesh.services.draft.core import DraftSnapshot
from kvmesh.services.draft.ngram import propose_ngram
from kvmesh.services.draft.shape import TreeShape
from kvmesh.shared.config.service_errors import ServiceStartError
from kvmesh.shared.model.vocabulary import vocabulary_difference

Tree = tuple[tuple[int, ...], tuple[int, ...]]  # (tokens, parents)


class Drafter(Protocol):
    def propose(self, jobs: Sequence[DraftSnapshot]) -> list[Tree]:
        """One tree per job, in order, continuing its context + ahead (empty: nothing to
        propose)."""
        ...


@dataclasses.dataclass(frozen=True, slots=True)
class NgramDrafter:
    shape: TreeShape
    min_n: int
    max_n: int

    def propose(self, jobs: Sequence[DraftSnapshot]) -> list[Tree]:
        return [
            propose_ngram(j.context + j.ahead, self.shape, self.min_n, self.max_n) for j in jobs
        ]


class EngineDrafter:
    """Greedy chains from a model in its own engine (all jobs batched): ``depth`` tokens past
    each job's context, the job's ``ahead`` drafts included (only the rest is computed)."""

    def __init__(self, engine: Any, depth: int) -> None:
        self.engine = engine
        self.depth = depth
        self._num_requests = 0
        # context tokens this drafter computed itself (the rest were prefix-cache hits: KV it
        # kept from earlier drafts or received through the data plane)
        self.num_computed_tokens = 0

    def propose(self, jobs: Sequence[DraftSnapshot]) -> list[Tree]:
        from kvmesh.shared.engine.block_manager import OutOfBlocksError
        from kvmesh.shared.engine.sequence import RequestError
        from kvmesh.shared.text.sampling import SamplingOptions

        ids: dict[str, int] = {}
        num_hits, num_context = self.engine.block_manager.num_hit_tokens, 0
        for i, job in enumerate(jobs):
            num_tokens = self.depth - len(job.ahead)
            if num_tokens < 1 or job.position + self.depth > self.engine.max_seq_len:
                continue  # deep enough, or too long for the draft's pool
            self._num_requests += 1
            rid = f"draft-{self._num_requests}"
            params = SamplingOptions(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
            try:
                self.engine.add_request(rid, list(job.context + job.ahead), params)
            except (RequestError, OutOfBlocksError):
                continue
            ids[rid] = i
            num_context += job.position + len(job.ahead)
        drafted: list[list[int]] = [[] for _ in jobs]
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.request_id in ids:
                    drafted[ids[out.request_id]] += out.new_token_ids
        self.num_computed_tokens += num_context - (
            self.engine.block_manager.num_hit_tokens - num_hits
        )
        return [(tuple(t), tuple(range(-1, len(t) - 1))) for t in drafted]


def truncate_layers(model: Any, num_layers: int) -> Any:
    """``model`` with only its first ``num_layers`` layers (+ its final norm and LM head): the
    early-exit draft. The loader has no layer-count override, so the checkpoint loads whole and
    the rest is dropped here (freed once the last reference goes)."""
    mc = model.config
    if not 1 <= num_layers < mc.num_hidden_layers:
        raise ServiceStartError(
            f"--exit-layer {num_layers}: the target has {mc.num_hidden_layers} layers; exit "
            f"after 1 to {mc.num_hidden_layers - 1} of them"
        )
    model.layers = model.layers[:num_layers]
    model.config = dataclasses.replace(mc, num_hidden_layers=num_layers)
    return model


def build_drafter(config: DraftConfig, allocate: Callable[[int], Any] | None = None) -> Drafter:
    """The drafter of ``config`` (loads models for early-exit and model; ServiceStartError on
    a bad exit layer or a draft model with another vocabulary). ``allocate(nbytes)``: where the
    draft engine's KV pool lives (transport memory, for a pool that receives prompt KV)."""
    if config.method == "ngram":
        return NgramDrafter(config.drafted_shape, config.ngram_min, config.ngram_max)
    import torch
    from kvmesh.shared.engine.config import worker_engine_config
    from kvmesh.shared.engine.llm_engine import LLMEngine
    from kvmesh.shared.model.config import parse_dtype
    from kvmesh.shared.model.loader import ModelLoadError, load_config_and_tokenizer, load_model

    if config.threads is not None:
        torch.set_num_threads(config.threads)
    dtype = parse_dtype(config.dtype, "--dtype") if config.dtype else None
    try:
        if config.method == "early-exit":
            model, tokenizer = load_model(config.model, dtype, config.device)
            model = truncate_layers(model, config.exit_layer)
        else:
            assert config.draft_model is not None
            _, target_tokenizer = load_config_and_tokenizer(config.model)
            model, tokenizer = load_model(config.draft_model, dtype, config.device)
            why = vocabulary_difference(target_tokenizer, tokenizer)
            if why is not None:
                raise ServiceStartError(
                    f"--draft-model {config.draft_model} does not share the vocabulary of "
                    f"--model {config.model}: {why}; use a draft checkpoint with the target's "
                    "tokenizer"
                )
    except ModelLoadError as exc:
        raise ServiceStartError(str(exc)) from None
    econf = worker_engine_config(
        config, None, max_num_seqs=config.max_batch, enable_prefix_caching=True
    )
    buffer = None
    if allocate is not None:
        from kvmesh.services.draft.prompt_kv_receiver import pool_bytes

        buffer = allocate(pool_bytes(model, econf))
    engine = LLMEngine(model, tokenizer, econf, kv_buffer=buffer)
    if not config.shape.is_chain:
        from kvmesh.services.draft.tree_drafter import EngineTreeDrafter

        return EngineTreeDrafter(engine, config.shape, config.num_lookahead_tokens)
    return EngineDrafter(engine, config.drafted_shape.depth)
