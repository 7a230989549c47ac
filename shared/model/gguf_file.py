"""A GGUF file opened for import: its metadata as Python values and its tensors, checked.

GGUF (llama.cpp's format) is one file: a header of typed key/value metadata (architecture,
hyperparameters, the tokenizer's vocabulary and merges, the chat template), then tensor infos,
then the tensors' bytes, each in its own ggml type (F32, F16, BF16, Q8_0, Q4_K, ...). The ``gguf``
package reads it through a memory map; everything it can raise on a damaged file, and a file cut
short (a tensor's bytes past its end), becomes one ``GGUFError`` naming the file and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# Architectures whose GGUF tensors map onto kvmesh's Llama decoder (shared/model/llama.py).
SUPPORTED_GGUF_ARCHITECTURES = ("llama",)


class GGUFError(ValueError):
    """A GGUF file kvmesh cannot import; the message names the file and what is wrong."""


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor: its GGUF name, ggml type name (e.g. "Q4_1"), logical shape in PyTorch order
    (rows first) and its raw bytes (a view into the memory map)."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    raw: np.ndarray
    qtype: Any  # gguf.GGMLQuantizationType


@dataclass(frozen=True, slots=True)
class GGUFFile:
    """The metadata (key -> str, int, float, bool or list) and tensors of one GGUF file."""

    path: Path
    metadata: Mapping[str, Any]
    tensors: Mapping[str, GGUFTensor]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def require(self, key: str) -> Any:
        """A metadata value the import cannot do without."""
        if key not in self.metadata:
            raise GGUFError(f"{self.path}: metadata key {key!r} is missing; the file is incomplete")
        return self.metadata[key]

    def arch_key(self, name: str, default: Any = None) -> Any:
        """``<architecture>.<name>``, e.g. ``llama.block_count``; ``default`` when absent (None:
        required)."""
        key = f"{self.architecture}.{name}"
        if default is None:
            return self.require(key)
        return self.metadata.get(key, default)


def read_gguf(path: str | Path) -> GGUFFile:
    """Open ``path`` and check it is a complete GGUF of a supported architecture."""
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{path}: no such file")
    size = path.stat().st_size
    try:
        reader = GGUFReader(path)
    except Exception as e:  # gguf raises ValueError, KeyError, IndexError on damaged headers
        if _read_past_the_end(e):
            raise GGUFError(
                f"{path}: truncated file: it ends ({size} bytes) before its header or tensor "
                f"data does ({type(e).__name__}: {e}); download or convert it again"
            ) from None
        raise GGUFError(
            f"{path}: not a readable GGUF file ({type(e).__name__}: {e}); is it a .gguf "
            "written by llama.cpp's converter, complete and uncorrupted?"
        ) from None
    metadata = {name: _field_value(field) for name, field in reader.fields.items()}
    tensors: dict[str, GGUFTensor] = {}
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or t.data.nbytes != t.n_bytes:
            raise GGUFError(
                f"{path}: truncated file: tensor {t.name!r} needs bytes up to {end}, the file "
                f"has {size}; download or convert it again"
            )
        # GGUF lists dimensions fastest-varying first; PyTorch's order is the reverse.
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        tensors[t.name] = GGUFTensor(t.name, t.tensor_type.name, shape, t.data, t.tensor_type)
    gguf_file = GGUFFile(path, metadata, tensors)
    arch = gguf_file.architecture
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise GGUFError(
            f"{path}: unsupported architecture {arch or '(none)'!r}; kvmesh imports "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)} GGUF files"
        )
    return gguf_file


def _read_past_the_end(error: Exception) -> bool:
    """Whether gguf failed on a short read: a slice of the memory map past the file's end comes
    back short, and reshaping or indexing it fails."""
    if isinstance(error, IndexError):
        return True
    return isinstance(error, ValueError) and "cannot reshape array" in str(error)


def _field_value(field: Any) -> Any:
    """A metadata field as a Python value (strings decoded, arrays as lists)."""
    try:
        return field.contents()
    except UnicodeDecodeError:  # a string that is not UTF-8: keep its bytes readable
        return bytes(field.parts[-1]).decode("utf-8", errors="replace")
