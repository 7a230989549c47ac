"""Text prompts cut from a corpus: exact token lengths, natural text, seeds, the shipped file."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from kvmesh.loadgen.corpus import DEFAULT_CORPUS, Corpus
from kvmesh.loadgen.workload import WorkloadError
from kvmesh.shared.model.tiny import tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


class ByteTokenizer:
    """UTF-8 bytes as tokens: a span cut inside a character decodes to U+FFFD (3 bytes)."""

    @property
    def vocab_size(self) -> int:
        return 256

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode(errors="replace")


def test_prompts_have_the_drawn_token_lengths_and_corpus_text(tokenizer):
    corpus = Corpus.load(tokenizer)
    text = DEFAULT_CORPUS.read_text()
    prompts = corpus.prompts(tokenizer, [(1, 4), (37, 4), (1500, 96), (4800, 96)], random.Random(3))
    assert [p.input_len for p in prompts] == [1, 37, 1500, 4800]
    for p in prompts:
        assert p.text is not None
        assert tokenizer.encode(p.text, add_special_tokens=False) == list(p.token_ids)
        assert p.text[:200] in text + text  # a passage of the corpus (wrapping round)
    assert prompts[2].output_len == 96


def test_the_same_seed_cuts_the_same_prompts(tokenizer):
    corpus = Corpus.load(tokenizer)
    lengths = [(300, 8), (900, 8)]
    first = corpus.prompts(tokenizer, lengths, random.Random(5))
    assert first == corpus.prompts(tokenizer, lengths, random.Random(5))
    assert first != corpus.prompts(tokenizer, lengths, random.Random(6))


def test_a_prompt_longer_than_the_corpus_wraps_round():
    tok = ByteTokenizer()
    corpus = Corpus.from_text(tok, "abc.")
    prompt = corpus.prompt(tok, 10, 1, random.Random(0))
    assert prompt.input_len == 10
    assert prompt.text is not None and len(prompt.text) == 10


def test_spans_cut_inside_a_character_move_on_until_they_encode_to_the_length():
    tok = ByteTokenizer()
    corpus = Corpus.from_text(tok, "día señor, él y ella " * 30)
    rng = random.Random(1)
    prompts = [corpus.prompt(tok, n, 1, rng) for n in range(1, 200)]
    assert [p.input_len for p in prompts] == list(range(1, 200))
    assert all(tok.encode(p.text or "") == list(p.token_ids) for p in prompts)
    assert all("\ufffd" not in (p.text or "") for p in prompts)


def test_an_empty_or_missing_corpus_is_refused(tokenizer, tmp_path):
    with pytest.raises(WorkloadError, match="holds no text"):
        Corpus.from_text(tokenizer, "")
    with pytest.raises(WorkloadError, match="cannot read the corpus"):
        Corpus.load(tokenizer, tmp_path / "missing.txt")


def test_the_shipped_corpus_is_large_enough_for_long_prompts(tokenizer):
    corpus = Corpus.load(tokenizer)
    assert len(corpus.token_ids) >= 50 * 4800  # 50 of the longest prompts without wrapping
