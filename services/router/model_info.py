"""What the router needs of the model: its tokenizer and context length, without the weights."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shared.model.config import ModelConfig, ModelConfigError
from shared.model.tiny import TINY_NAME, tiny_config, tiny_tokenizer
from shared.tokenizer import Tokenizer, TokenizerError


class ModelInfoError(ValueError):
    """The model named in the router config cannot be found or read."""


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str  # the id clients send
    tokenizer: Tokenizer
    max_model_len: int


def load_model_info(name_or_path: str, served_name: str, max_model_len: int | None) -> ModelInfo:
    """Tokenizer and config of ``kvmesh-tiny`` or a local HF checkpoint (weights are not read)."""
    if name_or_path == TINY_NAME:
        config, tokenizer = tiny_config(), tiny_tokenizer()
    else:
        directory = Path(name_or_path)
        if not (directory / "config.json").is_file():
            raise ModelInfoError(
                f"{directory}: no config.json; --model must be {TINY_NAME!r} or a local Hugging "
                "Face checkpoint directory"
            )
        try:
            config = ModelConfig.from_file(directory / "config.json")
            tokenizer = Tokenizer.from_pretrained(directory, config.eos_token_ids)
        except (ModelConfigError, TokenizerError) as exc:
            raise ModelInfoError(str(exc)) from None
    context = config.max_position_embeddings
    if max_model_len is not None:
        if max_model_len > context:
            raise ModelInfoError(
                f"max_model_len {max_model_len} exceeds the model's context of {context} tokens"
            )
        context = max_model_len
    return ModelInfo(name=served_name, tokenizer=tokenizer, max_model_len=context)
