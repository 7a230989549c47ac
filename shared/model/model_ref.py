"""What a ``--model`` argument names, made into something every service loads.

``kvmesh up --model`` takes kvmesh-tiny, a checkpoint directory, a fetchable model's name
(shared/model/fetch.py: downloaded and imported once into the cache) or a ``.gguf`` file
(imported once into the cache, keyed by its path, size and modification time). Services get the
directory; clients send the served name: the fetchable name or the GGUF file's stem, not the
cache path (a directory given as it is keeps being its own name, as before).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvmesh.shared.model.tiny import TINY_NAME


class ModelRefError(ValueError):
    """A ``--model`` that names nothing kvmesh can serve; the message lists what it takes."""


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    path: str  # what services load: kvmesh-tiny or a checkpoint directory
    served_name: str  # the model id clients send


def resolve_model(ref: str, progress: Callable[[str], None] = lambda _: None) -> ResolvedModel:
    """``ref`` as a loadable model; fetches or imports into the cache when it must (FetchError,
    GGUFError from there)."""
    from kvmesh.shared.model.fetch import FETCHABLE, fetch_model

    if ref == TINY_NAME:
        return ResolvedModel(TINY_NAME, TINY_NAME)
    path = Path(ref).expanduser()
    if path.is_dir():
        return ResolvedModel(ref, ref)
    if ref in FETCHABLE:
        return ResolvedModel(str(fetch_model(ref, progress=progress)), ref)
    if path.suffix == ".gguf" and path.is_file():
        return ResolvedModel(str(import_cached_gguf(path, progress)), path.stem)
    raise ModelRefError(
        f"--model {ref!r}: not {TINY_NAME!r}, a checkpoint directory, a .gguf file or a "
        f"fetchable model ({', '.join(sorted(FETCHABLE))})"
    )


def model_path(ref: str, command: str) -> str:
    """``resolve_model(ref).path`` for a command's ``--model``; SystemExit with one line naming
    ``command`` where it cannot be had."""
    from kvmesh.shared.model.fetch import FetchError
    from kvmesh.shared.model.gguf_file import GGUFError

    try:
        return resolve_model(ref).path
    except (FetchError, GGUFError, ModelRefError) as e:
        raise SystemExit(f"{command}: {e}") from None


def import_cached_gguf(path: Path, progress: Callable[[str], None] = lambda _: None) -> Path:
    """The cache's import of the GGUF at ``path``, made unless the cache holds it already."""
    from kvmesh.shared.model.fetch import models_dir
    from kvmesh.shared.model.gguf_import import import_gguf, make_readable, verify_import

    path = path.resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()
    directory = models_dir() / "gguf" / f"{path.stem}-{key[:12]}"
    imported = verify_import(directory)
    if imported is None or imported.is_dequantized:  # an import from before formats were kept
        if directory.exists():
            import shutil

            shutil.rmtree(directory)
        progress(f"importing {path} into {directory}")
        import_gguf(path, directory)
    make_readable(directory)
    return directory
