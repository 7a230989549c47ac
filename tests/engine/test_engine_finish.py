"""When the engine ends a request: stop tokens, EOS, length, and stop strings matched on the text
of ``kvmesh.shared.text.detokenize`` (the router's pipeline) at the token that completes them. A request
without stop strings is never detokenized."""

import string

import pytest
from kvmesh.shared.engine.config import EngineConfig
from kvmesh.shared.engine.finish import finish_reason, stop_text_for
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.engine.sequence import RequestError, Sequence
from kvmesh.shared.text.detokenize import TextStream
from kvmesh.shared.text.sampling import SamplingOptions

EOS = frozenset({3})
PROMPT = list(b"The quick brown fox")


class Letters:
    """id -> one letter (3 is EOS and has no text); counts its decodes."""

    eos_token_ids = {3}

    def __init__(self) -> None:
        self.num_decodes = 0

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        self.num_decodes += 1
        return "".join(string.ascii_letters[i % 52] for i in ids if i != 3)


@pytest.fixture(scope="module")
def model(tiny):
    return tiny[0]


def engine(model, tokenizer) -> LLMEngine:
    return LLMEngine(model, tokenizer, EngineConfig(num_blocks=64))


def greedy(**kw) -> SamplingOptions:
    return SamplingOptions(**{"max_tokens": 24, "temperature": 0, "ignore_eos": True, **kw})


def run(eng: LLMEngine) -> dict[str, tuple[list[int], str | None]]:
    """Step until idle; each request's emitted ids and finish reason."""
    got: dict[str, tuple[list[int], str | None]] = {}
    while eng.has_unfinished():
        for out in eng.step():
            ids, _ = got.get(out.request_id, ([], None))
            got[out.request_id] = (ids + out.new_token_ids, out.finish_reason)
    return got


def first_token_containing(tokenizer, ids: list[int], stop: str) -> int:
    """Index of the first token whose text completes ``stop`` (by plain full decodes)."""
    return next(k for k in range(len(ids)) if stop in tokenizer.decode(ids[: k + 1]))


def seq_with(params: SamplingOptions, tokenizer=None) -> Sequence:
    seq = Sequence("r", list(b"AB"), params)
    seq.stop_text = stop_text_for(seq, tokenizer)
    return seq


# --- finish_reason on one sequence ----------------------------------------------------------------


def test_stop_token_eos_and_ignore_eos():
    seq = seq_with(SamplingOptions(stop_token_ids=(7,)))
    seq.token_ids.append(7)
    assert finish_reason(seq, EOS, 100) == "stop"
    seq = seq_with(SamplingOptions())
    seq.token_ids.append(3)
    assert finish_reason(seq, EOS, 100) == "stop"
    seq = seq_with(SamplingOptions(ignore_eos=True))
    seq.token_ids.append(3)
    assert finish_reason(seq, EOS, 100) is None


def test_max_tokens_and_max_model_len_finish_with_length():
    seq = seq_with(SamplingOptions(max_tokens=2))
    seq.token_ids.append(70)
    assert finish_reason(seq, EOS, 100) is None
    seq.token_ids.append(71)
    assert finish_reason(seq, EOS, 100) == "length"
    seq = seq_with(SamplingOptions(max_tokens=50))
    seq.token_ids.append(70)
    assert finish_reason(seq, EOS, 3) == "length"


def test_stop_string_finishes_at_the_token_completing_it_not_before():
    tok = Letters()
    seq = seq_with(SamplingOptions(stop=("cde", "zz"), max_tokens=50), tok)
    reasons = []
    for token in (0, 2, 55, 4):  # "a", "c", "d", "e"
        seq.token_ids.append(token)
        reasons.append(finish_reason(seq, EOS, 100))
    assert reasons == [None, None, None, "stop"]
    assert seq.stop_text.text == "a"


def test_sequence_without_stop_strings_has_no_stop_text():
    assert seq_with(SamplingOptions(), Letters()).stop_text is None


# --- the engine, on the decode side and locally ---------------------------------------------------


def test_request_without_stop_strings_is_never_detokenized(model):
    tok = Letters()
    eng = engine(model, tok)
    eng.add_request("local", PROMPT, greedy())
    blocks = eng.reserve_blocks(len(PROMPT))
    eng.admit_prefilled("handed-off", PROMPT, blocks, 65, greedy())
    got = run(eng)
    assert [len(got[r][0]) for r in ("local", "handed-off")] == [24, 23]
    assert tok.num_decodes == 0
    # the same engine does detokenize a request that has a stop string
    eng.add_request("stops", PROMPT, greedy(stop=("not in the output",)))
    run(eng)
    assert tok.num_decodes > 0


def test_stop_string_ends_generation_at_the_token_the_router_cuts(model):
    tok = Letters()
    ref = engine(model, tok).generate([PROMPT], greedy())[0]
    text = tok.decode(ref)
    late, early = text[12:15], text[6:9]  # each spans three tokens
    k = first_token_containing(tok, ref, early)
    assert k < first_token_containing(tok, ref, late)
    eng = engine(model, tok)
    eng.add_request("r", PROMPT, greedy(stop=(late, early)))
    ids, reason = run(eng)["r"]
    assert (ids, reason) == (ref[: k + 1], "stop")
    assert eng.block_manager.num_free_blocks == 64
    # the router's stream stops at the same token and shows the text before the stop string
    router = TextStream(tok, PROMPT, (late, early))
    router.add(ids[:-1])
    assert not router.is_stopped
    router.add(ids[-1:])
    assert router.is_stopped and router.text == text[: text.find(early)]


def test_stop_string_completed_by_the_first_token_ends_an_admitted_request(model):
    tok = Letters()
    eng = engine(model, tok)
    prompt = [*PROMPT, 26]  # the prompt ends in "A"
    x = string.ascii_letters.index("X")
    blocks = eng.reserve_blocks(len(prompt))
    eng.admit_prefilled("x", prompt, blocks, x, greedy(stop=("X",)))
    blocks = eng.reserve_blocks(len(prompt))
    eng.admit_prefilled("ax", prompt, blocks, x, greedy(stop=("AX",), max_tokens=3))
    got = run(eng)
    assert got["x"] == ([], "stop")
    # the prompt's text is context, not output: "A" + "X" does not match
    assert got["ax"][1] == "length" and len(got["ax"][0]) == 2
    assert eng.block_manager.num_free_blocks == 64


def test_stop_string_is_found_after_emitted_tokens_are_rolled_back(model):
    tok = Letters()
    ref = engine(model, tok).generate([PROMPT], greedy())[0]
    stop = tok.decode(ref[2:6])  # spans the tokens rolled back below
    k = first_token_containing(tok, ref, stop)
    eng = engine(model, tok)
    eng.add_request("r", PROMPT, greedy(stop=(stop,)))
    emitted: list[int] = []
    while len(emitted) < 5:
        emitted += [t for out in eng.step() for t in out.new_token_ids]
    eng.rollback("r", 2)  # the last two emitted tokens are gone; they come back identically
    del emitted[-2:]
    ids, reason = run(eng)["r"]
    assert (emitted + ids, reason) == (ref[: k + 1], "stop")


def test_stop_strings_without_a_tokenizer_are_refused(model):
    eng = engine(model, None)
    with pytest.raises(RequestError, match="stop strings need a tokenizer"):
        eng.add_request("r", PROMPT, greedy(stop=("x",)))
    eng.add_request("p", PROMPT, greedy(stop=("x",)), prefill_only=True)  # prefill never matches
