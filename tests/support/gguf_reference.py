"""transformers' own GGUF loading, the import's reference, with its repeated parsing done once.

``from_pretrained(..., gguf_file=...)`` parses the file's metadata three times (config, weights,
tokenizer: about 8 s each for SmolLM2-135M's 49k-token vocabulary on a 2-core box) and builds
gguf's tensor-name map once per module of the model (about 400 times, 30 ms each). Both are pure
functions of their arguments, so inside :func:`parsed_once` each is computed once and shared;
what transformers computes from them is unchanged.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest


@contextmanager
def parsed_once() -> Iterator[None]:
    """Within the block, ``gguf.GGUFReader`` of one path (read-only) and
    ``gguf.get_tensor_name_map`` of one (arch, blocks) are built once. transformers imports both
    from ``gguf`` at each call, so patching the module reaches it."""
    import gguf

    reader_class = gguf.GGUFReader
    readers: dict[tuple[str, str], object] = {}

    def reader(path, mode: str = "r"):
        key = (os.path.realpath(os.fspath(path)), mode)
        if mode != "r":  # a writable memmap is not shared
            return reader_class(path, mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", reader)
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield
