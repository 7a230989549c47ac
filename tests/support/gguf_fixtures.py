"""Small synthetic Llama GGUF files written with ``gguf.GGUFWriter``, as llama.cpp's converter
writes them (Q/K rows permuted, tensors in every type the importer must read), so most import
tests need no download.

The model: hidden 256 (K-quants pack 256 values per block), 2 layers, 4 heads / 2 KV heads of 64,
intermediate 512, a byte-level BPE vocabulary trained here on a few sentences, with three control
tokens and one user-defined token. Its 2-D tensors take the types of ``TYPES`` in turn, so one
file holds all of them; norms stay F32, as llama.cpp keeps them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
HIDDEN, LAYERS, HEADS, KV_HEADS, INTER = 256, 2, 4, 2, 512
CONTROL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
USER_DEFINED = ("<think>",)
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. The capital of France is Paris.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Numbers like 12, 123 and 2024 appear here: 12 12 123 123 2024 2024.",
    "What is the capital of France? It is Paris, the largest city in France.",
]


@dataclass(frozen=True)
class Vocabulary:
    tokens: list[str]
    types: list[int]
    merges: list[str]


def vocabulary() -> Vocabulary:
    """Control tokens, then a byte-level BPE trained on ``CORPUS`` (digits merged too: the
    GPT-2 regex keeps numbers whole), then the user-defined tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=list(CONTROL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    model = tok.to_str()
    import json

    bpe = json.loads(model)["model"]
    vocab = sorted(bpe["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab] + list(USER_DEFINED)
    types = [3 if t in CONTROL else 1 for t, _ in vocab] + [4] * len(USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in bpe["merges"]]
    return Vocabulary(tokens, types, merges)


def sentencepiece_vocabulary() -> tuple[Vocabulary, list[float]]:
    """A SentencePiece-style vocabulary as llama.cpp stores one: <unk>, <s>, </s>, the 256
    <0xNN> byte tokens, then pieces ("▁" for spaces) trained as BPE on ``CORPUS``, each scored
    by its rank (earlier pieces merge first), and the user-defined tokens."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    pieces = sorted(json.loads(tok.to_str())["model"]["vocab"].items(), key=lambda kv: kv[1])
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    for piece, rank in pieces:
        tokens.append(piece)
        types.append(1)
        scores.append(-float(rank))
    tokens += list(USER_DEFINED)
    types += [4] * len(USER_DEFINED)
    scores += [0.0] * len(USER_DEFINED)
    return Vocabulary(tokens, types, []), scores


def hf_weights(vocab_size: int, seed: int = 3) -> dict[str, np.ndarray]:
    """float32 weights under HF Llama names (tied embeddings: no lm_head)."""
    rng = np.random.default_rng(seed)
    q, kv = HEADS * 64, KV_HEADS * 64

    def w(*shape: int, scale: float = 0.08) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    out = {"model.embed_tokens.weight": w(vocab_size, HIDDEN, scale=1.0)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = 1 + w(HIDDEN, scale=0.1)
        out[p + "self_attn.q_proj.weight"] = w(q, HIDDEN)
        out[p + "self_attn.k_proj.weight"] = w(kv, HIDDEN)
        out[p + "self_attn.v_proj.weight"] = w(kv, HIDDEN)
        out[p + "self_attn.o_proj.weight"] = w(HIDDEN, q)
        out[p + "post_attention_layernorm.weight"] = 1 + w(HIDDEN, scale=0.1)
        out[p + "mlp.gate_proj.weight"] = w(INTER, HIDDEN)
        out[p + "mlp.up_proj.weight"] = w(INTER, HIDDEN)
        out[p + "mlp.down_proj.weight"] = w(HIDDEN, INTER, scale=0.05)
    out["model.norm.weight"] = 1 + w(HIDDEN, scale=0.1)
    return out


def llamacpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute, as it writes Q and K."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf: str) -> str:
    if hf in _GGUF_NAMES:
        return _GGUF_NAMES[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_GGUF_NAMES[rest]}"


def encode(values: np.ndarray, type_name: str, rng: np.random.Generator) -> np.ndarray:
    """``values`` (rows, cols) in ggml type ``type_name`` (raw bytes for quantized types). The
    K-quants, which gguf cannot quantize, get random blocks with sane scales instead."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    qtype = GGMLQuantizationType[type_name]
    if type_name in ("F32", "F16", "I32"):  # I32: a type nothing dequantizes (bad-file tests)
        return values.astype({"F32": np.float32, "F16": np.float16, "I32": np.int32}[type_name])
    if type_name not in ("Q4_K", "Q5_K", "Q6_K"):
        return quantize(values, qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    rows, cols = values.shape
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    if type_name in ("Q4_K", "Q5_K"):  # d, dmin (f16) lead the block
        raw[..., 0:2] = scale
        raw[..., 2:4] = scale
    else:  # Q6_K: d (f16) ends the block
        raw[..., size - 2 : size] = scale
    return raw.reshape(rows, cols // block * size)


def write_gguf(
    path: Path,
    *,
    types: Sequence[str] = TYPES,
    arch: str = "llama",
    tokenizer_model: str = "gpt2",
    pre: str = "smollm",
    extra_tensors: dict[str, np.ndarray] | None = None,
    seed: int = 3,
) -> dict[str, np.ndarray]:
    """Write the synthetic model to ``path``; returns its HF weights as stored (after the
    quantization round trip they are not: compare dequantized values with a tolerance)."""
    import gguf

    scores = None
    if tokenizer_model == "llama":
        vocab, scores = sentencepiece_vocabulary()
        bos, eos = "<s>", "</s>"
    else:
        vocab = vocabulary()
        bos, eos = "<|im_start|>", "<|im_end|>"
    weights = hf_weights(len(vocab.tokens), seed)
    rng = np.random.default_rng(seed + 1)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(2048)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(64)
    writer.add_vocab_size(len(vocab.tokens))
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    if scores is None:
        writer.add_token_merges(vocab.merges)
        writer.add_add_bos_token(False)
    else:
        writer.add_token_scores(scores)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(True)
    writer.add_bos_token_id(vocab.tokens.index(bos))
    writer.add_eos_token_id(vocab.tokens.index(eos))
    writer.add_chat_template(CHAT_TEMPLATE)
    two_d = 0
    for hf, values in weights.items():
        if hf.endswith("q_proj.weight"):
            values = llamacpp_permute(values, HEADS)
        elif hf.endswith("k_proj.weight"):
            values = llamacpp_permute(values, KV_HEADS)
        if values.ndim == 1:
            writer.add_tensor(gguf_name(hf), values)
            continue
        type_name = types[two_d % len(types)]
        two_d += 1
        data = encode(values, type_name, rng)
        plain = ("F32", "F16", "I32")
        raw_dtype = None if type_name in plain else gguf.GGMLQuantizationType[type_name]
        writer.add_tensor(gguf_name(hf), data, raw_dtype=raw_dtype)
    for name, values in (extra_tensors or {}).items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights
