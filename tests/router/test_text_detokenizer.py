"""IncrementalDetokenizer: token by token, the same text as one full decode, on the tokenizers
kvmesh serves (byte-level BPE, kvmesh-tiny's bytes, SentencePiece with leading spaces and byte
fallback)."""

import subprocess
import sys

import pytest
from kvmesh.shared.model.tiny import tiny_tokenizer
from kvmesh.shared.text.detokenize import IncrementalDetokenizer
from kvmesh.shared.text.tokenizer import Tokenizer
from support.hf_fixtures import (
    LLAMA_CHAT_TEMPLATE,
    LLAMA_SPECIALS,
    QWEN2_CHAT_TEMPLATE,
    QWEN2_SPECIALS,
    write_tokenizer,
)

TEXT = "Grüße aus Zürich 🦊 日本語 — ok"


def stream(tokenizer, ids, prompt_ids=()):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.finish())
    assert "".join(deltas) == detok.text
    return deltas, detok.text


@pytest.fixture
def byte_bpe(tmp_path):
    """The HF checkpoints' tokenizer: byte-level BPE, multi-byte characters over several ids."""
    write_tokenizer(
        tmp_path, LLAMA_SPECIALS, bos="<s>", eos="</s>", chat_template=LLAMA_CHAT_TEMPLATE
    )
    return Tokenizer.from_pretrained(tmp_path)


@pytest.fixture
def sentencepiece(tmp_path):
    """A Llama-2 style tokenizer.json: "▁" for spaces (dropped at the start of a decode), words
    that are not in the vocabulary fall back to <0xNN> byte tokens."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers

    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    vocab = {p: i for i, p in enumerate(pieces)}
    merges = []
    for word in ["▁Hello", "▁world", "▁how", "▁are", "▁you", "▁Zü", "rich"]:
        for i in range(1, len(word) + 1):
            vocab.setdefault(word[i - 1], len(vocab))
            if i > 1 and word[:i] not in vocab:
                vocab[word[:i]] = len(vocab)
                merges.append((word[: i - 1], word[i - 1]))
    hf = HFTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    hf.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    hf.save(str(tmp_path / "tokenizer.json"))
    return Tokenizer.from_pretrained(tmp_path)


def test_incremental_text_equals_full_decode_on_byte_level_bpe(byte_bpe):
    ids = byte_bpe.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT)  # multi-byte characters span several ids
    deltas, text = stream(byte_bpe, ids)
    assert text == byte_bpe.decode(ids) == TEXT
    assert all("\ufffd" not in d for d in deltas)


def test_incremental_text_equals_full_decode_after_a_prompt(byte_bpe):
    prompt = byte_bpe.encode("Sagen Sie: ")
    ids = byte_bpe.encode(TEXT, add_special_tokens=False)
    full = byte_bpe.decode(prompt + ids)
    assert stream(byte_bpe, ids, prompt)[1] == full[len(byte_bpe.decode(prompt)) :] == TEXT


def test_incremental_text_after_a_chat_prompt_holds_back_split_characters(tmp_path):
    write_tokenizer(
        tmp_path, QWEN2_SPECIALS, bos=None, eos="<|im_end|>", chat_template=QWEN2_CHAT_TEMPLATE
    )
    tok = Tokenizer.from_pretrained(tmp_path)
    prompt = tok.encode_chat([{"role": "user", "content": "again, 日本語"}])
    ids = tok.encode(TEXT, add_special_tokens=False)
    deltas, text = stream(tok, ids, prompt_ids=prompt)
    assert text == TEXT
    assert "" in deltas and all("\ufffd" not in d for d in deltas)


def test_incremental_text_holds_back_split_utf8_characters_until_complete():
    tok = tiny_tokenizer()
    ids = tok.encode(TEXT, add_special_tokens=False)
    deltas, text = stream(tok, ids)
    assert text == TEXT
    # the first three bytes of the 4-byte fox produce nothing, the fourth the whole character
    fox_at = TEXT.encode().index("🦊".encode())
    assert deltas[fox_at : fox_at + 4] == ["", "", "", "🦊"]
    assert all("\ufffd" not in d for d in deltas)


def test_incremental_text_flushes_an_unfinished_character_at_the_end():
    deltas, text = stream(tiny_tokenizer(), [104, 105, 0xF0, 0x9F])
    assert deltas == ["h", "i", "", "", "\ufffd"]
    assert text == "hi\ufffd"


def test_incremental_text_skips_special_tokens():
    tok = tiny_tokenizer()
    ids = [
        *tok.encode("ok", add_special_tokens=False),
        tok.token_to_id("<|end|>"),
        *tok.encode(" go", add_special_tokens=False),
    ]
    assert stream(tok, ids)[1] == "ok go"


def test_incremental_text_keeps_sentencepiece_word_spaces(sentencepiece):
    ids = sentencepiece.encode("Hello world how are you", add_special_tokens=False)
    assert len(ids) == 5
    deltas, text = stream(sentencepiece, ids)
    # each word's "▁" is a space except the first of the whole decode, as in the full decode
    assert deltas == ["Hello", " world", " how", " are", " you", ""]
    assert text == sentencepiece.decode(ids)
    # after a prompt, the first generated word keeps its leading space
    prompt = sentencepiece.encode("how are", add_special_tokens=False)
    assert stream(sentencepiece, ids, prompt)[1] == " Hello world how are you"


def test_incremental_text_equals_full_decode_with_byte_fallback(sentencepiece):
    text = "Hello Zürich 🦊 日本語 how are you"
    ids = sentencepiece.encode(text, add_special_tokens=False)
    byte_ids = {sentencepiece.token_to_id(f"<0x{b:02X}>") for b in "🦊日本語".encode()}
    assert byte_ids <= set(ids)  # these characters are not in the vocabulary: bytes
    deltas, streamed = stream(sentencepiece, ids)
    assert streamed == sentencepiece.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
    prompt = sentencepiece.encode("how", add_special_tokens=False)
    full = sentencepiece.decode(prompt + ids)
    assert stream(sentencepiece, ids, prompt)[1] == full[len("how") :] == " " + text


def test_text_module_imports_without_torch_or_tokenizers():
    code = "import sys, kvmesh.shared.text.detokenize; print('torch' in sys.modules, 'tokenizers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
