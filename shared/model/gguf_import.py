"""``kvmesh model import FILE.gguf DIR``: a Llama GGUF as a Hugging Face checkpoint directory.

The directory holds what kvmesh (``--model DIR``) and transformers (``from_pretrained(DIR)``) both
load: ``model.safetensors``, ``config.json``,
``generation_config.json``, ``tokenizer.json`` and ``tokenizer_config.json`` with the chat
template (shared/model/gguf_config.py, gguf_weights.py, gguf_tokenizer.py), and
``kvmesh-import.json``, written last: the source file's and every written file's SHA-256. The
files are written into a sibling folder renamed into place at the end, so an interrupted import
leaves no directory that looks complete. Every file is made mode 0644 and the folder 0755,
whatever the umask or the writer chose (safetensors writes 0600): a container image that copies
the checkpoint runs as another user, who must read it.

The weights: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, F16 and BF16 matrices keep their
bytes as stored (uint8 tensors, their formats in the safetensors metadata under ``CHECKPOINT_KEY``;
kvmesh computes with them as they are, transformers cannot read them), every other tensor is
dequantized to the dtype asked for.
``dequantize=True`` dequantizes every tensor: a plain HF checkpoint transformers loads too.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh.shared.model.config import dtype_name
from kvmesh.shared.model.gguf_config import generation_config, hf_config, model_config
from kvmesh.shared.model.gguf_file import GGUFError, read_gguf
from kvmesh.shared.model.gguf_tokenizer import build_tokenizer
from kvmesh.shared.model.gguf_weights import hf_tensors
from kvmesh.shared.model.quant_formats import (
    CHECKPOINT_KEY,
    cols_multiple,
    row_bytes,
    row_values,
)

MARKER = "kvmesh-import.json"
_CHUNK = 1 << 20
FILE_MODE = 0o644  # every user reads the checkpoint (container images copy it), its owner writes
DIR_MODE = 0o755


@dataclass(frozen=True, slots=True)
class ImportedModel:
    """What ``import_gguf`` wrote (or found, for ``verify_import``)."""

    directory: Path
    source_sha256: str
    dtype: str
    num_parameters: int
    is_dequantized: bool = True  # imported with dequantize: every weight in ``dtype``


def import_gguf(
    source: str | Path,
    directory: str | Path,
    dtype: str = "float32",
    keep_source: bool = False,
    dequantize: bool = False,
) -> ImportedModel:
    """Convert ``source`` into the checkpoint directory ``directory`` (new, or an empty folder);
    ``keep_source``: a copy of the GGUF goes in too (llama.cpp runs it: ``kvmesh bench engine``);
    ``dequantize``: every weight in ``dtype``, none kept in its block format."""
    source, directory = Path(source), Path(directory)
    try:
        dtype = dtype_name(dtype, "--dtype")
    except ValueError as e:
        raise GGUFError(str(e)) from None
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise GGUFError(f"{directory}: exists and is not an empty folder; choose a new one")
    gguf = read_gguf(source)
    config = model_config(gguf, dtype)
    tokenizer = build_tokenizer(gguf)  # before the weights: a bad tokenizer fails in a second
    weights, formats = _torch_weights(gguf, config, keep_formats=not dequantize)

    directory.parent.mkdir(parents=True, exist_ok=True)
    partial = directory.parent / f".{directory.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        from safetensors.torch import save_file

        metadata = {"format": "pt"}
        if formats:
            metadata[CHECKPOINT_KEY] = json.dumps(formats, sort_keys=True)
        save_file(weights, str(partial / "model.safetensors"), metadata=metadata)
        num_parameters = sum(
            t.shape[0] * row_values(formats[n], t.shape[1]) if n in formats else t.numel()
            for n, t in weights.items()
        )
        del weights
        _write_json(partial / "config.json", hf_config(config, gguf))
        _write_json(partial / "generation_config.json", generation_config(config))
        tokenizer.tokenizer.save(str(partial / "tokenizer.json"))
        _write_json(partial / "tokenizer_config.json", tokenizer.config)
        source_sha256 = file_sha256(source)
        if keep_source:
            shutil.copyfile(source, partial / source.name)
        marker = {
            "source": source.name,
            "source_sha256": source_sha256,
            "dtype": dtype,
            "num_parameters": num_parameters,
            "dequantized": dequantize,
            "files": {p.name: file_sha256(p) for p in sorted(partial.iterdir())},
        }
        _write_json(partial / MARKER, marker)  # last: its presence means the rest is whole
        make_readable(partial)
        if directory.is_dir():
            directory.rmdir()  # empty (checked above)
        os.rename(partial, directory)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return ImportedModel(directory, source_sha256, dtype, num_parameters, dequantize)


def verify_import(directory: str | Path, full: bool = False) -> ImportedModel | None:
    """The import recorded in ``directory`` when its marker is present and every file it lists
    has its recorded size (``full``: and its SHA-256); None otherwise."""
    directory = Path(directory)
    try:
        marker = json.loads((directory / MARKER).read_text(encoding="utf-8"))
        files: Mapping[str, str] = marker["files"]
        for name, digest in files.items():
            path = directory / name
            if not path.is_file() or (full and file_sha256(path) != digest):
                return None
        return ImportedModel(
            directory,
            marker["source_sha256"],
            marker["dtype"],
            int(marker["num_parameters"]),
            bool(marker.get("dequantized", True)),  # imports before formats were kept
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def make_readable(directory: Path) -> None:
    """``directory`` mode 0755 and every file in it 0644 where they are not (an import made
    before the modes were set kept safetensors' 0600); a file another user owns is left as is."""
    for path in (directory, *directory.iterdir()):
        mode = DIR_MODE if path.is_dir() else FILE_MODE
        try:
            if path.stat().st_mode & 0o777 != mode:
                path.chmod(mode)
        except PermissionError:
            pass


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _torch_weights(
    gguf: Any, config: Any, keep_formats: bool
) -> tuple[dict[str, Any], dict[str, str]]:
    """HF-named torch tensors, exactly the tensors the model needs: in the config's dtype, or
    (``keep_formats``) the bytes of those kvmesh reads as stored; and those tensors' formats."""
    import torch
    from kvmesh.shared.model.loader import hf_weight_plan

    out: dict[str, torch.Tensor] = {}
    formats: dict[str, str] = {}
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    for name, values, format in hf_tensors(gguf, heads, kv_heads, keep_formats):
        values = values if values.flags.writeable else values.copy()  # F32: a memmap view
        if format is not None:
            out[name], formats[name] = torch.from_numpy(values).contiguous(), format
            continue
        out[name] = torch.from_numpy(values).to(config.torch_dtype).contiguous()
    expected = {hf: shape for parts in hf_weight_plan(config).values() for hf, shape in parts}
    missing = sorted(set(expected) - set(out))
    if missing:
        raise GGUFError(
            f"{gguf.path}: tensor {missing[0]!r} (HF name) is missing"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            + "; the file is incomplete"
        )
    for name, shape in expected.items():
        got = tuple(out[name].shape)
        if name in formats:  # (rows, bytes): the logical shape needs whole blocks of columns
            stored_shape = (shape[0], row_bytes(formats[name], shape[1])) if len(shape) == 2 else ()
            whole = shape[1] % cols_multiple(formats[name]) == 0
            got = shape if got == stored_shape and whole else got
        if got != shape:
            raise GGUFError(
                f"{gguf.path}: tensor {name!r} (HF name) has shape {got}, the "
                f"file's hyperparameters say {shape}"
            )
    return out, formats


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
