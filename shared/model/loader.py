"""Load a model and its tokenizer: ``kvmesh-tiny`` or a local Hugging Face checkpoint directory.

A checkpoint directory holds config.json, the weights as model.safetensors or as shards listed in
model.safetensors.index.json, and tokenizer.json (+ tokenizer_config.json). Nothing is fetched
from the network. HF's separate q/k/v and gate/up tensors are concatenated into kvmesh's fused
projections here, so the model file stays free of checkpoint naming.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterable, Mapping
from contextlib import ExitStack
from pathlib import Path

import torch
from kvmesh.shared.model import quant
from kvmesh.shared.model.checkpoint_info import ModelLoadError, load_config_and_tokenizer
from kvmesh.shared.model.config import ModelConfig, ModelConfigError, parse_dtype
from kvmesh.shared.model.llama import Transformer
from kvmesh.shared.model.quant import CHECKPOINT_KEY, QuantWeight, StackedWeight, cat_rows
from kvmesh.shared.model.quant_layers import use_quant_weights
from kvmesh.shared.model.tiny import TINY_NAME, tiny_state_dict
from kvmesh.shared.text.tokenizer import Tokenizer
from safetensors import safe_open

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# devices a weight kept as stored is computed on: the C kernels (CPU), Triton's (CUDA,
# kernels/quant_matmul.py); any other gets the weights dequantized
KEEP_STORED_DEVICES = ("cpu", "cuda")
# Tensors some exporters leave in checkpoints that carry nothing kvmesh needs.
_HARMLESS_EXTRA = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def load_model(
    name_or_path: str = TINY_NAME,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device = "cpu",
    dequantize: bool = False,
) -> tuple[Transformer, Tokenizer]:
    """Build the model (eval mode, no grads) and its tokenizer.

    ``dtype`` (a torch dtype or a name such as "bfloat16") defaults to the checkpoint's own dtype,
    float32 when it names none; float32, bfloat16 and float16 are supported. Weights a checkpoint
    keeps as stored (Q8_0 ... Q5_1, K-quants, F16, BF16: ``kvmesh model import``) stay so on
    the CPU and on CUDA (``shared/model/quant_layers.py``; CUDA multiplies them with
    ``kernels/quant_matmul.py``); ``dequantize`` (and any other device) makes them ``dtype``.
    """
    if dtype is not None:
        try:
            dtype = parse_dtype(dtype, "load_model(dtype=...)")
        except ModelConfigError as e:
            raise ModelLoadError(str(e)) from None
    if name_or_path == TINY_NAME:
        config, tokenizer = load_config_and_tokenizer(TINY_NAME, dtype)
        weights = _tiny_weights()
        model = build_model(config, weights.__getitem__, weights.keys(), TINY_NAME, device)
        return model, tokenizer
    return _load_hf_checkpoint(Path(name_or_path), dtype, device, dequantize)


def hf_weight_plan(config: ModelConfig) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """For each kvmesh parameter: the HF tensors (name, shape) concatenated along dim 0 to fill it."""
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    plan: dict[str, list[tuple[str, tuple[int, ...]]]] = {
        "tok_embeddings.weight": [("model.embed_tokens.weight", (config.vocab_size, h))],
        "norm.weight": [("model.norm.weight", (h,))],
    }
    if not config.tie_word_embeddings:
        plan["output.weight"] = [("lm_head.weight", (config.vocab_size, h))]
    for i in range(config.num_hidden_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        attn = hf + "self_attn."
        mlp = hf + "mlp."
        plan[ours + "attention_norm.weight"] = [(hf + "input_layernorm.weight", (h,))]
        plan[ours + "ffn_norm.weight"] = [(hf + "post_attention_layernorm.weight", (h,))]
        plan[ours + "attention.wqkv.weight"] = [
            (attn + "q_proj.weight", (q, h)),
            (attn + "k_proj.weight", (kv, h)),
            (attn + "v_proj.weight", (kv, h)),
        ]
        if config.attention_bias:
            plan[ours + "attention.wqkv.bias"] = [
                (attn + "q_proj.bias", (q,)),
                (attn + "k_proj.bias", (kv,)),
                (attn + "v_proj.bias", (kv,)),
            ]
        plan[ours + "attention.wo.weight"] = [(attn + "o_proj.weight", (h, q))]
        if config.attention_out_bias:
            plan[ours + "attention.wo.bias"] = [(attn + "o_proj.bias", (h,))]
        plan[ours + "feed_forward.w_gate_up.weight"] = [
            (mlp + "gate_proj.weight", (inter, h)),
            (mlp + "up_proj.weight", (inter, h)),
        ]
        plan[ours + "feed_forward.w_down.weight"] = [(mlp + "down_proj.weight", (h, inter))]
        if config.mlp_bias:
            plan[ours + "feed_forward.w_gate_up.bias"] = [
                (mlp + "gate_proj.bias", (inter,)),
                (mlp + "up_proj.bias", (inter,)),
            ]
            plan[ours + "feed_forward.w_down.bias"] = [(mlp + "down_proj.bias", (h,))]
    return plan


def build_model(
    config: ModelConfig,
    get_tensor: Callable[[str], torch.Tensor],
    available: Iterable[str],
    source: str,
    device: str | torch.device = "cpu",
    formats: Mapping[str, str] | None = None,
    dequantize: bool = False,
) -> Transformer:
    """Materialise a Transformer from HF-named tensors. ``available`` lists every tensor in the
    checkpoint; ``source`` names the checkpoint in errors. ``formats``: the tensors kept in a
    block format (name -> format, their tensors (rows, row bytes) uint8); a weight whose parts
    are all kept stays as stored on the CPU or CUDA unless ``dequantize`` (parts in several
    formats: a ``StackedWeight``)."""
    formats = dict(formats or {})
    available = set(available)
    plan = hf_weight_plan(config)
    wanted = {name for parts in plan.values() for name, _ in parts}
    missing = sorted(wanted - available)
    if missing:
        raise ModelLoadError(
            f"{source}: missing weight tensor {missing[0]!r}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    extra = sorted(n for n in available - wanted if not _is_harmless_extra(n, config))
    if extra:
        shown = ", ".join(repr(n) for n in extra[:5])
        raise ModelLoadError(
            f"{source}: unexpected weight tensors {shown}"
            + (f" (and {len(extra) - 5} more)" if len(extra) > 5 else "")
            + f"; they do not belong to a {config.architecture} with this config.json"
        )

    keep = torch.device(device).type in KEEP_STORED_DEVICES and not dequantize
    kept = {
        param: parts
        for param, parts in plan.items()
        if keep and all(name in formats for name, _ in parts)
    }
    with torch.device("meta"):
        model = Transformer(config).to(dtype=config.torch_dtype)
    if kept:
        quant_weights = {
            param: _quant_weight(parts, formats, get_tensor, source).to(device)
            for param, parts in kept.items()
        }
        use_quant_weights(model, quant_weights)
        plan = {param: parts for param, parts in plan.items() if param not in kept}
    # model.to_empty(device=device), keeping each tensor's strides (Linear's are column-major),
    # without torch's meta empty_like: a Python reference that imports sympy (seconds of start-up)
    model._apply(lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device))
    params = dict(model.named_parameters())
    assert set(params) == set(plan), sorted(set(params) ^ set(plan))
    with torch.no_grad():
        for param_name, parts in plan.items():
            tensors = []
            for hf_name, expected in parts:
                tensor = get_tensor(hf_name)
                if hf_name in formats:  # blocks kept, a part of a weight that is not
                    tensor = quant.dequantize(_as_quant(hf_name, tensor, expected, formats, source))
                if tuple(tensor.shape) != expected:
                    raise ModelLoadError(
                        f"{source}: tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                        f"expected {expected} from config.json"
                    )
                if not tensor.is_floating_point():
                    raise ModelLoadError(
                        f"{source}: tensor {hf_name!r} has dtype {tensor.dtype}, expected floating point"
                    )
                tensors.append(tensor)
            fused = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)
            params[param_name].copy_(fused)
    model.reset_rope_cache()
    model.requires_grad_(False)
    return model.eval()


def _as_quant(
    name: str, tensor: torch.Tensor, shape: tuple[int, ...], formats: Mapping[str, str], source: str
) -> QuantWeight:
    try:
        return QuantWeight(formats[name], tensor.contiguous(), *shape)
    except (AssertionError, TypeError):
        raise ModelLoadError(
            f"{source}: tensor {name!r} is not a {formats[name]} {shape} weight as stored "
            f"(dtype {tensor.dtype}, shape {tuple(tensor.shape)})"
        ) from None


def _quant_weight(
    parts: list[tuple[str, tuple[int, ...]]],
    formats: Mapping[str, str],
    get_tensor: Callable[[str], torch.Tensor],
    source: str,
) -> QuantWeight | StackedWeight:
    weights = [_as_quant(name, get_tensor(name), shape, formats, source) for name, shape in parts]
    if len(weights) > 1:
        return cat_rows(weights)
    # a copy of its own: a view into the memory-mapped file would keep the whole mapping (and
    # every page the load read through it, the parts copied elsewhere too) resident
    w = weights[0]
    return QuantWeight(w.format, w.data.clone(), w.rows, w.cols)


@functools.cache
def _tiny_weights() -> dict[str, torch.Tensor]:
    # Generated once per process (~1 s of CPU); build_model copies, so sharing them is safe.
    return tiny_state_dict()


def _is_harmless_extra(name: str, config: ModelConfig) -> bool:
    # A tied checkpoint may still carry a copy of the embeddings as lm_head.
    return bool(_HARMLESS_EXTRA.search(name)) or (
        config.tie_word_embeddings and name == "lm_head.weight"
    )


def _load_hf_checkpoint(
    directory: Path, dtype: torch.dtype | None, device: str | torch.device, dequantize: bool
) -> tuple[Transformer, Tokenizer]:
    config, tokenizer = load_config_and_tokenizer(str(directory), dtype)
    shards = _weight_files(directory)
    with ExitStack() as stack:
        where: dict[str, object] = {}
        formats: dict[str, str] = {}
        for path, names in shards.items():
            handle = stack.enter_context(_open_safetensors(path))
            formats.update(_stored_formats(handle, path))
            present = set(handle.keys())
            for name in names if names is not None else present:
                if name not in present:
                    raise ModelLoadError(
                        f"{directory / INDEX_FILE}: maps tensor {name!r} to {path.name}, which does not contain it"
                    )
                where[name] = handle
        model = build_model(
            config,
            lambda n: where[n].get_tensor(n),
            where.keys(),
            str(directory),
            device,
            formats,
            dequantize,
        )
    return model, tokenizer


def _stored_formats(handle, path: Path) -> dict[str, str]:
    """The tensors of a safetensors file kept in a block format (``CHECKPOINT_KEY``)."""
    text = (handle.metadata() or {}).get(CHECKPOINT_KEY)
    if text is None:
        return {}
    try:
        formats = json.loads(text)
        assert isinstance(formats, dict) and all(isinstance(v, str) for v in formats.values())
    except (json.JSONDecodeError, AssertionError):
        raise ModelLoadError(
            f"{path}: metadata {CHECKPOINT_KEY!r} is not a name -> format object"
        ) from None
    from kvmesh.shared.model.quant import STORED_FORMATS

    unknown = sorted(set(formats.values()) - set(STORED_FORMATS))
    if unknown:
        raise ModelLoadError(
            f"{path}: weights in format {unknown[0]!r}, which kvmesh does not read; import the "
            "GGUF again with --dequantize"
        )
    return formats


def _weight_files(directory: Path) -> dict[Path, set[str] | None]:
    """safetensors files -> the tensor names to read from each (None: all of them)."""
    single = directory / WEIGHTS_FILE
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(
                f"{index}: not a valid safetensors index (needs a 'weight_map' object): {e}"
            ) from None
        if not isinstance(weight_map, Mapping):
            raise ModelLoadError(f"{index}: 'weight_map' must map tensor names to shard files")
        shards: dict[Path, set[str] | None] = {}
        for name, shard in weight_map.items():
            path = directory / shard
            if not path.is_file():
                raise ModelLoadError(
                    f"{index}: references shard {shard!r} (for {name!r}), which does not exist"
                )
            shards.setdefault(path, set()).add(name)
        return shards
    if single.is_file():
        return {single: None}
    bins = sorted(p.name for p in directory.glob("*.bin"))
    hint = f"; found {', '.join(bins)}: convert it to safetensors" if bins else ""
    raise ModelLoadError(f"{directory}: no weights: expected {WEIGHTS_FILE} or {INDEX_FILE}{hint}")


def _open_safetensors(path: Path):
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises SafetensorError / OSError with terse messages
        raise ModelLoadError(f"{path}: cannot read safetensors file: {e}") from None
