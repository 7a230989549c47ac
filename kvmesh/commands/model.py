"""``kvmesh model seeded DIR``: write a seeded Llama checkpoint of any shape (no download).
``kvmesh model kv-accuracy MODEL``: what fp8 KV costs that model (``loadgen/kv_accuracy.py``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

SEEDED_DEFAULT_SEED = 23


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "model", help="make model checkpoints, measure a model's fp8 KV accuracy"
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
