"""A GGUF's tokenizer metadata as ``tokenizer.json`` + ``tokenizer_config.json``.

A GGUF carries no tokenizer.json: llama.cpp keeps the vocabulary (``tokenizer.ggml.tokens``),
each token's type (normal, control, user-defined, byte ...), the BPE merges or SentencePiece
scores, the special token ids, a pre-tokenizer *name* (``tokenizer.ggml.pre``: which regex splits
text before the merges) and the chat template. This module rebuilds the ``tokenizers`` tokenizer
llama.cpp runs from those, over the same ids:

- byte-level BPE (``tokenizer.ggml.model == "gpt2"``: SmolLM, Llama 3, Qwen2 ...): the file's
  merges, and the pre-tokenizer llama.cpp's ``llama-vocab.cpp`` uses for the file's ``pre`` name
  (a table below; a name not in it is refused);
- SentencePiece BPE (``"llama"``: Llama 2, Mistral, TinyLlama): merges ranked by the scores, as
  transformers converts a SentencePiece model, "▁" for spaces, byte fallback;

control tokens as special added tokens and user-defined ones as plain added tokens, both matched
whole in text as llama.cpp does. Other vocabularies (WordPiece, Unigram ...) are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvmesh.shared.model.gguf_file import GGUFError, GGUFFile

# llama.cpp's token types (llama_token_type in llama.h)
NORMAL = 1
CONTROL = 3
USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True, slots=True)
class PreTokenizer:
    """How llama.cpp splits text before BPE for one ``tokenizer.ggml.pre`` family."""

    split: (
        str | None
    )  # the regex, as in the model's tokenizer.json (None: GPT-2's, ByteLevel's own)
    digits_first: bool = False  # every digit is split off on its own before the regex
    ignore_merges: bool = False  # a whole pre-token found in the vocabulary is one token
    add_bos: bool = False  # llama.cpp's default when the file has no add_bos_token


_GPT2 = PreTokenizer(None)
_STARCODER = PreTokenizer(None, digits_first=True)
_LLAMA3 = PreTokenizer(_LLAMA3_SPLIT, ignore_merges=True, add_bos=True)
_QWEN2 = PreTokenizer(_QWEN2_SPLIT)
# tokenizer.ggml.pre -> pre-tokenizer (llama-vocab.cpp: llama_vocab::impl::load and
# llm_tokenizer_bpe's regex_exprs)
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **dict.fromkeys(("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais"), _GPT2),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell"), _STARCODER),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3"), _LLAMA3),
    **dict.fromkeys(("qwen2", "stablelm2", "deepseek-r1-qwen"), _QWEN2),
}


@dataclass(frozen=True, slots=True)
class GGUFTokenizer:
    """The rebuilt tokenizer: ``tokenizers.Tokenizer`` and tokenizer_config.json's fields."""

    tokenizer: Any  # tokenizers.Tokenizer
    config: dict[str, Any]


def build_tokenizer(gguf: GGUFFile) -> GGUFTokenizer:
    """The file's tokenizer, ids equal to the GGUF's token indices."""
    from tokenizers import AddedToken

    kind = gguf.metadata.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise GGUFError(
            f"{gguf.path}: tokenizer {kind!r} is not supported; kvmesh rebuilds byte-level BPE "
            "('gpt2': SmolLM, Llama 3, Qwen2) and SentencePiece BPE ('llama': Llama 2, Mistral, "
            "TinyLlama) vocabularies"
        )
    tokens: list[str] = list(gguf.require("tokenizer.ggml.tokens"))
    types: list[int] = list(gguf.metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if len(types) != len(tokens):
        raise GGUFError(
            f"{gguf.path}: {len(tokens)} tokens but {len(types)} token types; the file is damaged"
        )
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFError(f"{gguf.path}: the vocabulary lists a token twice; the file is damaged")
    if kind == "gpt2":
        tok, default_add_bos = _byte_level_bpe(gguf, vocab)
    else:
        tok, default_add_bos = _sentencepiece_bpe(gguf, vocab, types)
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == CONTROL
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == USER_DEFINED
        ]
    )
    assert tok.get_vocab_size(with_added_tokens=True) == len(tokens)

    def token(key: str) -> str | None:
        i = gguf.metadata.get(f"tokenizer.ggml.{key}")
        if i is None:
            return None
        if not 0 <= int(i) < len(tokens):
            raise GGUFError(f"{gguf.path}: tokenizer.ggml.{key} {i} is outside the vocabulary")
        return tokens[int(i)]

    add_bos = bool(gguf.metadata.get("tokenizer.ggml.add_bos_token", default_add_bos))
    add_eos = bool(gguf.metadata.get("tokenizer.ggml.add_eos_token", False))
    bos, eos = token("bos_token_id"), token("eos_token_id")
    _set_post_processor(tok, bos if add_bos else None, eos if add_eos else None)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos and bos is not None,
        "add_eos_token": add_eos and eos is not None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(gguf.arch_key("context_length", 4096)),
    }
    for name, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        if (text := token(key)) is not None:
            config[name] = text
    template = gguf.metadata.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return GGUFTokenizer(tok, config)


def _byte_level_bpe(gguf: GGUFFile, vocab: dict[str, int]) -> tuple[Any, bool]:
    """A byte-level BPE (tokenizer.ggml.model "gpt2") and llama.cpp's add_bos default for it."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre_name = gguf.metadata.get("tokenizer.ggml.pre", "gpt-2")
    pre = PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        raise GGUFError(
            f"{gguf.path}: pre-tokenizer {pre_name!r} is not in kvmesh's table (known: "
            f"{', '.join(sorted(PRE_TOKENIZERS))}); add it to shared/model/gguf_tokenizer.py"
        )
    merges = [tuple(m.split(" ", 1)) for m in gguf.metadata.get("tokenizer.ggml.merges") or []]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges))
    steps = [pre_tokenizers.Digits(individual_digits=True)] if pre.digits_first else []
    if pre.split is not None:
        steps.append(pre_tokenizers.Split(Regex(pre.split), behavior="isolated"))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre.split is None))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    return tok, pre.add_bos


def _sentencepiece_bpe(gguf: GGUFFile, vocab: dict[str, int], types: list[int]) -> tuple[Any, bool]:
    """A SentencePiece BPE vocabulary (tokenizer.ggml.model "llama") as llama.cpp runs it:
    spaces as "▁", one prepended to each piece of text (llama.cpp's add_space_prefix), merges
    ranked by the merged piece's score, bytes outside the vocabulary as <0xNN> tokens. llama.cpp
    adds BOS by default for it."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = gguf.metadata.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(vocab):
        raise GGUFError(
            f"{gguf.path}: a SentencePiece vocabulary needs a score per token "
            "(tokenizer.ggml.scores); the file is incomplete"
        )
    pieces = {t: i for t, i in vocab.items() if types[i] in (NORMAL, USER_DEFINED)}
    merges = sentencepiece_merges(pieces, {t: float(scores[i]) for t, i in pieces.items()})
    unk_id = gguf.metadata.get("tokenizer.ggml.unknown_token_id")
    unk = next((t for t, i in vocab.items() if i == unk_id), None)
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    prefix = bool(gguf.metadata.get("tokenizer.ggml.add_space_prefix", True))
    # A normalizer, not a Metaspace pre-tokenizer: it runs on each piece of text between added
    # tokens, and llama.cpp prefixes every such piece with a space (and never merges it away
    # when the text already starts with one), as SentencePiece's dummy prefix does.
    spaces = [normalizers.Replace(" ", "▁")]
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), *spaces] if prefix else spaces)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(steps)
    return tok, True


def sentencepiece_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges that reproduce SentencePiece's choices: every split of a piece into two
    pieces, best merged score first (as transformers' ``generate_merges``)."""
    merges = []
    for piece, score in scores.items():
        local = [
            (piece[:i], piece[i:], score)
            for i in range(1, len(piece))
            if piece[:i] in vocab and piece[i:] in vocab
        ]
        merges += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _set_post_processor(tok: Any, bos: str | None, eos: str | None) -> None:
    """Prepend BOS / append EOS on encode, as llama.cpp's add_bos / add_eos do."""
    from tokenizers import processors

    if bos is None and eos is None:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        return
    single = " ".join(x for x in (bos and f"{bos}:0", "$A:0", eos and f"{eos}:0") if x)
    pair = " ".join(x for x in (single, bos and f"{bos}:1", "$B:1", eos and f"{eos}:1") if x)
    specials = [(t, tok.token_to_id(t)) for t in dict.fromkeys(x for x in (bos, eos) if x)]
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=specials
    )
