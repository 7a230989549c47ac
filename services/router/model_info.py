"""What the router needs of the model: its tokenizer and context length, without the weights."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.shared.model.checkpoint_info import ModelLoadError, load_config_and_tokenizer
from kvmesh.shared.model.identity import model_spec
from kvmesh.shared.text.tokenizer import Tokenizer


class ModelInfoError(ValueError):
    """The model named in the router config cannot be found or read."""


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str  # the id clients send
    tokenizer: Tokenizer
    max_model_len: int
    spec: str  # model_spec(): decode workers must advertise the same to be placed on


def load_model_info(name_or_path: str, served_name: str, max_model_len: int | None) -> ModelInfo:
    """Tokenizer and config of ``kvmesh-tiny`` or a local HF checkpoint (weights are not read)."""
    try:
        config, tokenizer = load_config_and_tokenizer(name_or_path)
    except ModelLoadError as exc:
        raise ModelInfoError(str(exc)) from None
    context = config.max_position_embeddings
    if max_model_len is not None:
        if max_model_len > context:
            raise ModelInfoError(
                f"max_model_len {max_model_len} exceeds the model's context of {context} tokens"
            )
        context = max_model_len
    return ModelInfo(
        name=served_name, tokenizer=tokenizer, max_model_len=context, spec=model_spec(config)
    )
