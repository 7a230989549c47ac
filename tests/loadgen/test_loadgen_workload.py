"""Prompts of ``kvmesh bench serve``: exact token lengths, length ranges, ShareGPT, seeds."""

from __future__ import annotations

import random
from collections.abc import Sequence

import orjson
import pytest
from kvmesh.loadgen.workload import (
    LengthSpec,
    WorkloadError,
    fit_text,
    load_sharegpt,
    parse_sharegpt,
    random_prompts,
    sample_lengths,
    sharegpt_prompts,
    token_pool,
)
from kvmesh.shared.model.tiny import tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


class MergingTokenizer:
    """a, b, c and the merge "ab": decoding then encoding two tokens can give one."""

    vocab = ("a", "b", "c", "ab")

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            if text.startswith("ab", i):
                ids.append(3)
                i += 2
            else:
                ids.append(self.vocab.index(text[i]))
                i += 1
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.vocab[i] for i in ids)


def test_length_spec_parses_exact_ratio_and_bounds():
    assert LengthSpec.parse(100) == LengthSpec(100, 100)
    assert LengthSpec.parse(100, "0.25") == LengthSpec(75, 125)
    assert LengthSpec.parse(100, "10:30") == LengthSpec(10, 30)
    assert LengthSpec.parse(1, "0.9") == LengthSpec(1, 2)
    for bad in ("1.0", "-0.1", "x", "5:", "30:10", "0:4"):
        with pytest.raises(WorkloadError):
            LengthSpec.parse(100, bad)


def test_sampled_lengths_stay_in_range_and_cover_it():
    rng = random.Random(0)
    pairs = sample_lengths(2000, LengthSpec(10, 20), LengthSpec(3, 5), rng)
    assert {n for n, _ in pairs} == set(range(10, 21))
    assert {m for _, m in pairs} == {3, 4, 5}


def test_long_fraction_mixes_in_long_prompts():
    rng = random.Random(0)
    pairs = sample_lengths(
        4000, LengthSpec(16, 16), LengthSpec(4, 4), rng, long_input_len=512, long_fraction=0.1
    )
    num_long = sum(n == 512 for n, _ in pairs)
    assert {n for n, _ in pairs} == {16, 512}
    assert 300 < num_long < 500
    short, out = LengthSpec(16, 16), LengthSpec(4, 4)
    everything = sample_lengths(5, short, out, rng, long_input_len=64, long_fraction=1.0)
    assert everything == [(64, 4)] * 5
    with pytest.raises(WorkloadError, match="long input length"):
        sample_lengths(5, short, out, rng, long_fraction=0.5)


def test_token_pool_of_the_byte_tokenizer_is_the_ascii_bytes(tokenizer):
    # bytes >= 128 decode to U+FFFD alone and specials decode to nothing: neither round-trips
    assert token_pool(tokenizer) == tuple(range(128))


def test_random_id_prompts_have_exact_lengths(tokenizer):
    lengths = [(1, 2), (17, 3), (300, 4)]
    prompts = random_prompts(tokenizer, lengths, random.Random(0), as_text=False)
    assert [(p.input_len, p.output_len) for p in prompts] == lengths
    assert all(p.text is None for p in prompts)
    assert all(0 <= t < 128 for p in prompts for t in p.token_ids)


def test_random_text_prompts_encode_to_their_length(tokenizer):
    prompts = random_prompts(tokenizer, [(5, 1), (64, 1)], random.Random(0), as_text=True)
    for p in prompts:
        assert p.text is not None
        assert tokenizer.encode(p.text, add_special_tokens=False) == list(p.token_ids)
    assert [p.input_len for p in prompts] == [5, 64]


def test_same_seed_gives_the_same_prompts(tokenizer):
    lengths = [(32, 4)] * 5
    first = random_prompts(tokenizer, lengths, random.Random("3:prompts"), as_text=False)
    again = random_prompts(tokenizer, lengths, random.Random("3:prompts"), as_text=False)
    other = random_prompts(tokenizer, lengths, random.Random("4:prompts"), as_text=False)
    assert first == again and first != other


def test_fit_text_tops_up_when_tokens_merge():
    tok = MergingTokenizer()
    pool = token_pool(tok)
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.choice(pool) for _ in range(12)]
        text, fitted = fit_text(tok, ids, pool, rng)
        assert tok.encode(text) == list(fitted)
        assert len(fitted) == 12


def sharegpt_file(tmp_path, conversations):
    path = tmp_path / "sharegpt.json"
    path.write_bytes(orjson.dumps(conversations))
    return path


def conversation(question: str, answer: str) -> dict:
    return {
        "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]
    }


def test_sharegpt_prompts_use_the_first_turn_and_the_reply_length(tmp_path, tokenizer):
    data = [
        conversation("what is a kv cache?", "memory of past keys"),
        conversation("hi", "a reply long enough"),  # prompt too short: 3 tokens with BOS
        conversation("a long enough question", "no"),  # reply too short
        {"id": "broken"},
        {"conversations": [{"from": "human", "value": "only one turn"}]},
    ]
    pairs = load_sharegpt(sharegpt_file(tmp_path, data))
    assert len(pairs) == 3
    prompts = sharegpt_prompts(tokenizer, pairs, 4, random.Random(0))
    assert {p.text for p in prompts} == {"what is a kv cache?"}  # the only one kept, repeated
    assert prompts[0].output_len == len("memory of past keys")
    assert list(prompts[0].token_ids) == tokenizer.encode("what is a kv cache?")


def test_sharegpt_fixed_output_len_skips_the_reply_filter(tokenizer):
    pairs = [("a long enough question", "no")]
    prompts = sharegpt_prompts(tokenizer, pairs, 2, random.Random(0), output_len=50)
    assert [p.output_len for p in prompts] == [50, 50]


def test_sharegpt_without_usable_conversations_is_an_error(tmp_path, tokenizer):
    with pytest.raises(WorkloadError, match="two text turns"):
        parse_sharegpt([{"conversations": []}])
    with pytest.raises(WorkloadError, match="JSON list"):
        parse_sharegpt({"conversations": []})
    with pytest.raises(WorkloadError, match="passes the length filters"):
        sharegpt_prompts(tokenizer, [("hi", "yo")], 1, random.Random(0))
    with pytest.raises(WorkloadError, match="cannot read"):
        load_sharegpt(tmp_path / "missing.json")
