"""``kvmesh generate``: run one prompt through an LLMEngine in this process (no mesh, no NATS) and
print the result: the engine alone, to try a model or check a checkpoint. A mesh's answers come
from its router (``curl http://HOST:8000/v1/completions``, or any OpenAI client).

    kvmesh generate --prompt "Hello" --max-tokens 32 --temperature 0
    kvmesh generate --model /path/to/hf_dir --prompt-ids 1,2,3 --json

With ``--json`` one object is printed: ``{"token_ids": [...generated ids...], "text": ...,
"finish_reason": ..., "num_prompt_tokens": ...}``; otherwise the text streams as it is generated.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from kvmesh.commands.up_model import DEFAULT_MODEL


def _token_ids(value: str) -> list[int]:
    try:
        ids = [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--prompt-ids takes comma-separated integers like 1,2,3, got {value!r}"
        ) from None
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids needs at least one token id")
    return ids


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate text for one prompt with an engine in this process (no mesh)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="a fetchable model (default: kvmesh up's, fetched into the cache on first use), "
        "kvmesh-tiny, a checkpoint dir or a .gguf file",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text (tokenized with the model's tokenizer)")
    source.add_argument("--prompt-ids", type=_token_ids, help="prompt token ids, e.g. 1,2,3")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--dtype", default=None, help="float32 | bfloat16 | float16 (default: checkpoint's)"
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "int8", "fp8_e4m3"],
        help="KV cache dtype: auto (the model's; float16 for a float32 model whose weights are "
        "kept quantized), int8 (recommended 8-bit) or fp8_e4m3 "
        "(docs/kv_cache.md)",
    )
    # a mesh's flags: refused with what to do instead of argparse's "unrecognized arguments"
    for flag in ("--nats-url", "--mesh", "--base-url"):
        p.add_argument(flag, dest="mesh_flag", action=_RefuseMeshFlag, help=argparse.SUPPRESS)
    p.set_defaults(func=run)


class _RefuseMeshFlag(argparse.Action):
    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[object] | None,
        option: str | None = None,
    ) -> None:
        parser.error(
            f"{option}: kvmesh generate runs the model in this process and talks to no mesh; "
            "ask a mesh through its router instead (curl http://HOST:8000/v1/completions -d "
            '\'{"model": ..., "prompt": ...}\', or any OpenAI client)'
        )


def run(args: argparse.Namespace) -> int:
    import torch

    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine
    from kvmesh.shared.engine.sequence import RequestError
    from kvmesh.shared.model import ModelLoadError, load_model
    from kvmesh.shared.model.model_ref import model_path
    from kvmesh.shared.text.detokenize import TextStream
    from kvmesh.shared.text.sampling import SamplingOptions

    args.model = model_path(args.model, "kvmesh generate")

    try:
        params = SamplingOptions(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            stop=tuple(args.stop),
            ignore_eos=args.ignore_eos,
        )
        model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    except (ValueError, ModelLoadError) as exc:
        print(f"kvmesh generate: {exc}", file=sys.stderr)
        return 2
    prompt_ids = args.prompt_ids if args.prompt_ids is not None else tokenizer.encode(args.prompt)
    block_size = 16
    max_len = model.config.max_position_embeddings
    num_tokens = min(len(prompt_ids) + args.max_tokens, max_len) + block_size
    config = EngineConfig(
        block_size=block_size,
        num_blocks=max(num_tokens // block_size + 1, 2),
        max_num_seqs=1,
        device=args.device,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    with torch.inference_mode():
        engine = LLMEngine(model, tokenizer, config)
        try:
            engine.add_request("cli", prompt_ids, params)
        except RequestError as exc:
            print(f"kvmesh generate: {exc}", file=sys.stderr)
            return 2
        # The text as the router makes it: stop strings cut, a possible one held back until settled.
        text = TextStream(tokenizer, prompt_ids, params.stop)
        token_ids: list[int] = []
        finish_reason = None

        def show(delta: str) -> None:
            if not args.json and delta:
                sys.stdout.write(delta)
                sys.stdout.flush()

        while engine.has_unfinished():
            for out in engine.step():
                token_ids += out.new_token_ids
                show(text.add(out.new_token_ids))
                finish_reason = out.finish_reason
        show(text.finish())
    if args.json:
        result = {
            "token_ids": token_ids,
            "text": text.text,
            "finish_reason": finish_reason,
            "num_prompt_tokens": len(prompt_ids),
        }
        print(json.dumps(result, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
    return 0
