"""The draft model a prefill worker runs beside its target (``--draft-kv --draft-model``): the
checkpoint of the mesh's model draft workers in an engine of its own, over the same prompt
chunks, so its prompt KV can be written into a draft worker's blocks (docs/speculative.md,
Prompt KV through the data plane). Loaded and checked here, at start-up."""

from __future__ import annotations

from typing import Any

from kvmesh.services.prefill.config import PrefillConfig
from kvmesh.shared.config.service_errors import ServiceStartError
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.model.config import parse_dtype
from kvmesh.shared.model.loader import ModelLoadError, load_model
from kvmesh.shared.model.vocabulary import vocabulary_difference


def load_draft_engine(config: PrefillConfig, target_tokenizer: Any) -> LLMEngine:
    """The draft engine of ``config.draft_model``: ``config.engine_config`` with a pool of
    ``draft_kv_cache_bytes``. ServiceStartError when the checkpoint cannot be loaded or its
    vocabulary is not the target's."""
    assert config.draft_model is not None
    dtype = parse_dtype(config.dtype, "--dtype") if config.dtype else None
    try:
        model, tokenizer = load_model(config.draft_model, dtype, config.device)
    except ModelLoadError as exc:
        raise ServiceStartError(f"--draft-model {config.draft_model}: {exc}") from None
    why = vocabulary_difference(target_tokenizer, tokenizer)
    if why is not None:
        raise ServiceStartError(
            f"--draft-model {config.draft_model} does not share the vocabulary of --model "
            f"{config.model}: {why}; use the draft workers' checkpoint, with the target's "
            "tokenizer"
        )
    econf = config.engine_config(dtype, config.draft_kv_cache_bytes)
    try:
        return LLMEngine(model, tokenizer, econf)
    except ValueError as exc:  # a pool smaller than one block
        raise ServiceStartError(f"--draft-kv-cache-bytes: {exc}") from None
