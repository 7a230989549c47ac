"""StopMatcher and TextStream: stop strings cut the text before the match (OpenAI semantics) and
nothing that might start one is released before it is settled; the same, token by token."""

import pytest
from kvmesh.shared.model.tiny import tiny_tokenizer
from kvmesh.shared.text.detokenize import StopMatcher, TextStream


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()  # ids 0..255 are bytes


def ids(text: str) -> list[int]:
    return list(text.encode())


def feed(stream: TextStream, token_ids: list[int]) -> list[str]:
    return [stream.add([t]) for t in token_ids]


# --- StopMatcher: text in, releasable text out ---------------------------------------------------


def test_matcher_without_stop_strings_releases_everything_at_once():
    matcher = StopMatcher(())
    assert [matcher.add(t) for t in ("ab", "", "c")] == ["ab", "", "c"]
    assert matcher.finish() == "" and matcher.text == "abc" and not matcher.is_stopped


def test_matcher_holds_back_only_a_tail_that_starts_a_stop_string():
    matcher = StopMatcher(("abc",))
    assert matcher.add("xxab") == "xx"  # "ab" may become "abc"
    assert matcher.add("x") == "abx"  # settled: no match
    assert matcher.add("a") == ""
    assert matcher.add("bc tail") == "" and matcher.is_stopped
    assert matcher.text == "xxabx"


def test_matcher_cuts_at_the_earliest_of_several_stop_strings():
    matcher = StopMatcher(("world", "lo w", "d"))
    assert matcher.add("hello world") == "hel"
    assert matcher.is_stopped and matcher.text == "hel"
    assert matcher.add("more") == "" and matcher.finish() == ""


def test_matcher_finish_completes_a_match_with_the_last_text():
    matcher = StopMatcher(("END",))
    assert matcher.add("ok E") == "ok "
    assert matcher.finish("ND!") == ""
    assert matcher.is_stopped and matcher.text == "ok "


def test_matcher_finish_releases_held_back_text():
    matcher = StopMatcher(("END", "EXIT"))
    assert matcher.add("bye EX") == "bye "
    assert matcher.finish() == "EX"
    assert matcher.text == "bye EX" and not matcher.is_stopped


# --- TextStream: token ids in ------------------------------------------------------------------


def test_stream_without_stop_streams_every_character(tokenizer):
    out = TextStream(tokenizer, [1], ())
    assert feed(out, ids("hello")) == list("hello")
    assert out.finish() == "" and out.text == "hello" and out.num_tokens == 5


def test_stream_holds_back_a_possible_stop_prefix_and_cuts_at_the_match(tokenizer):
    out = TextStream(tokenizer, [1], ("END",))
    assert "".join(feed(out, ids("abEN"))) == "ab"  # "EN" might start "END"
    assert out.add(ids("D and more")) == ""
    assert out.is_stopped and out.text == "ab"
    assert out.add(ids("x")) == "" and out.finish() == ""
    assert out.num_tokens == 14  # tokens after the stop are not counted


def test_stream_releases_held_text_that_turns_out_not_to_match(tokenizer):
    out = TextStream(tokenizer, [1], ("END",))
    assert out.add(ids("xE")) == "x"
    assert out.add(ids("Nx")) == "ENx"
    assert out.add(ids("EN")) == ""
    assert out.finish() == "EN"  # the stream ended: no match is possible any more
    assert out.text == "xENxEN" and not out.is_stopped


def test_stream_stop_string_spanning_tokens_stops_at_the_token_completing_it(tokenizer):
    out = TextStream(tokenizer, [1], ("lo wo",))
    deltas = feed(out, ids("hello world"))
    assert out.is_stopped and out.text == "hel"
    # an "l" waits until the next character shows it does not begin "lo wo"; the 8th token
    # completes the match; the tokens after it add nothing
    assert deltas == ["h", "e", "", "l", "", "", "", "", "", "", ""]
    assert out.num_tokens == 8


def test_stream_stop_string_inside_a_multibyte_character_run(tokenizer):
    out = TextStream(tokenizer, [1], ("日本",))
    deltas = feed(out, ids("語日本語"))
    # a character is text only with its last byte; 日 waits (it may begin "日本")
    assert deltas == ["", "", "語"] + [""] * 9
    assert out.is_stopped and out.text == "語" and out.num_tokens == 9


def test_stream_stop_inside_one_batch_of_tokens_picks_the_earliest_match(tokenizer):
    out = TextStream(tokenizer, [1], ("c", "ab"))
    assert out.add(ids("xxabc")) == "xx"
    assert out.is_stopped


def test_stream_stop_string_at_the_very_first_token(tokenizer):
    out = TextStream(tokenizer, ids("prompt "), ("X", "never"))
    assert out.add(ids("X")) == ""
    assert out.is_stopped and out.text == "" and out.num_tokens == 1
    assert out.finish() == ""


def test_stream_flushes_held_back_text_and_an_unfinished_character_at_the_end(tokenizer):
    out = TextStream(tokenizer, [1], ("ok?",))
    assert "".join(feed(out, [*ids("fine ok"), 0xF0, 0x9F])) == "fine "
    assert out.finish() == "ok\ufffd"
    assert out.text == "fine ok\ufffd" and not out.is_stopped


def test_stream_joins_a_utf8_character_split_over_tokens(tokenizer):
    out = TextStream(tokenizer, [1], ())
    first, second = "é".encode()
    assert out.add([first]) == ""
    assert out.add([second]) == "é"


def test_matcher_with_include_stop_keeps_the_stop_string_and_nothing_after():
    matcher = StopMatcher(("ab", "abc"), include_stop=True)
    assert matcher.add("xxa") == "xx"
    assert matcher.add("bcd tail") == "abc" and matcher.is_stopped
    assert matcher.text == "xxabc"
