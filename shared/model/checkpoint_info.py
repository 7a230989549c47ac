"""A checkpoint's config and tokenizer, without its weights: what the router reads.

Torch-free (the router never computes; ``shared/model/loader.py`` builds the model from the same
config). ``kvmesh-tiny`` or a local Hugging Face checkpoint directory; nothing is fetched.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

from kvmesh.shared.model.config import ModelConfig, ModelConfigError
from kvmesh.shared.model.tiny import TINY_NAME, tiny_config, tiny_tokenizer
from kvmesh.shared.text.tokenizer import Tokenizer, TokenizerError

if TYPE_CHECKING:
    import torch


class ModelLoadError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and what is wrong."""


def load_config_and_tokenizer(
    name_or_path: str = TINY_NAME, dtype: torch.dtype | str | None = None
) -> tuple[ModelConfig, Tokenizer]:
    """The model's config and tokenizer without reading any weights (what the router needs).
    EOS ids merge config.json, generation_config.json and the tokenizer's own."""
    if name_or_path == TINY_NAME:
        return tiny_config(dtype or "float32"), tiny_tokenizer()
    directory = Path(name_or_path)
    if not directory.is_dir():
        raise ModelLoadError(
            f"{directory}: no such checkpoint directory; kvmesh loads only local Hugging Face checkpoints "
            f"(a directory with config.json and *.safetensors) or {TINY_NAME!r}, and downloads nothing"
        )
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(
            f"{config_path}: file not found; a checkpoint directory needs config.json"
        )
    try:
        config = ModelConfig.from_file(config_path)
    except ModelConfigError as e:
        raise ModelLoadError(str(e)) from None
    eos_ids = set(config.eos_token_ids) | _generation_eos_ids(directory / "generation_config.json")
    try:
        tokenizer = Tokenizer.from_pretrained(directory, extra_eos_token_ids=eos_ids)
    except TokenizerError as e:
        raise ModelLoadError(str(e)) from None
    if tokenizer.vocab_size > config.vocab_size:
        raise ModelLoadError(
            f"{directory / 'tokenizer.json'}: the tokenizer has {tokenizer.vocab_size} tokens but "
            f"config.json's vocab_size is {config.vocab_size}; the tokenizer belongs to another model"
        )
    config = dataclasses.replace(
        config,
        dtype=dtype or config.dtype,
        eos_token_ids=tuple(sorted(eos_ids | tokenizer.eos_token_ids)),
        bos_token_id=config.bos_token_id
        if config.bos_token_id is not None
        else tokenizer.bos_token_id,
    )
    return config, tokenizer


def _generation_eos_ids(path: Path) -> set[int]:
    if not path.is_file():
        return set()
    try:
        eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ModelLoadError(f"{path}: invalid JSON: {e}") from None
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {int(eos)}
