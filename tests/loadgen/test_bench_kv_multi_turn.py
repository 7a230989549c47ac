"""`kvmesh bench kv --multi-turn`: the multi-turn chat workload, the figures made from the workers'
counters, and one tiny run of the whole benchmark on two real meshes (kvmesh-tiny, shm).

The tiny run's numbers are not timed claims (TTFT on kvmesh-tiny is overhead); what it checks is
real: both meshes served every turn, the same prompts went to both, the greedy answers agree,
the registry handed later turns to the decode worker holding their prefix in the store mesh
only, and the store mesh computed fewer prompt tokens from turn 3 on, as the prefill and decode
workers counted them.
"""

from __future__ import annotations

import json

import pytest
from kvmesh.loadgen.bench_kv import main as bench_kv_main
from kvmesh.loadgen.multi_turn import (
    DECODE_LOCAL_PROMPT,
    DECODE_PREFIX_HIT,
    DECODE_STORE_HIT,
    PREFILL_PREFIX_HIT,
    PREFILL_PROMPT,
    PREFILL_STORE_HIT,
    MultiTurnSpec,
    TurnCounters,
    build_conversations,
    turn_figures,
)
from kvmesh.loadgen.serve_metrics import RequestRecord


class ByteTokenizer:
    vocab_size = 256

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("latin-1"))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("latin-1")


SPEC = MultiTurnSpec(conversations=3, turns=4, system_len=40, user_len=5, answer_len=7, seed=1)


def test_every_turn_resends_the_system_prompt_earlier_messages_and_answers_then_a_new_message():
    conversations = build_conversations(SPEC, ByteTokenizer())
    assert len(conversations) == 3
    assert len({c.system for c in conversations}) == 1  # one shared system prompt
    assert len({c.user_messages for c in conversations}) == 3
    conv = conversations[0]
    first = conv.prompt(0)
    assert first.token_ids == (*conv.system, *conv.user_messages[0])
    assert first.output_len == 7
    conv.answers.append(tuple(range(7)))
    second = conv.prompt(1)
    assert second.token_ids == (*first.token_ids, *range(7), *conv.user_messages[1])
    with pytest.raises(AssertionError):
        conv.prompt(3)  # needs the answers of turns 1-3
    conv.answers += [(1,) * 7, (2,) * 7]
    assert conv.prompt(3).input_len == SPEC.max_prompt_len == 40 + 4 * 5 + 3 * 7


def test_the_same_seed_builds_the_same_conversations_and_another_seed_others():
    again = build_conversations(SPEC, ByteTokenizer())
    assert [c.user_messages for c in again] == [
        c.user_messages for c in build_conversations(SPEC, ByteTokenizer())
    ]
    other = MultiTurnSpec(3, 4, 40, 5, 7, seed=2)
    assert build_conversations(other, ByteTokenizer())[0].system != again[0].system


def test_a_spec_with_no_turns_is_refused():
    with pytest.raises(ValueError, match="turns"):
        MultiTurnSpec(turns=0)


def test_turn_counters_sum_the_deltas_of_prefill_and_decode_workers_and_say_what_was_computed():
    before = {
        "prefill-0": {PREFILL_PROMPT: 100.0, PREFILL_PREFIX_HIT: 50.0},
        "prefill-1": {PREFILL_PROMPT: 10.0},
        "decode-0": {DECODE_PREFIX_HIT: 5.0},
        "router-0": {PREFILL_PROMPT: 1e9},  # not a worker: ignored
    }
    after = {
        "prefill-0": {PREFILL_PROMPT: 400.0, PREFILL_PREFIX_HIT: 250.0, PREFILL_STORE_HIT: 64.0},
        "prefill-1": {PREFILL_PROMPT: 110.0, PREFILL_PREFIX_HIT: 32.0},
        "decode-0": {DECODE_PREFIX_HIT: 165.0},
        "router-0": {PREFILL_PROMPT: 2e9},
    }
    c = TurnCounters.between(before, after, local_requests=1, local_prompt_tokens=176)
    assert (c.prefill_prompt_tokens, c.prefill_prefix_hit_tokens) == (400, 232)
    assert c.prefill_store_hit_tokens == 64
    assert c.prefill_computed_tokens == 168
    assert c.local_computed_tokens == 176 - 160
    assert c.computed_tokens == 184
    assert (c + c).computed_tokens == 368


def test_decode_workers_that_count_their_local_prompt_tokens_are_believed_over_the_client():
    before = {"decode-0": {DECODE_LOCAL_PROMPT: 10.0, DECODE_PREFIX_HIT: 0.0}}
    after = {
        "decode-0": {DECODE_LOCAL_PROMPT: 186.0, DECODE_PREFIX_HIT: 160.0, DECODE_STORE_HIT: 32.0}
    }
    c = TurnCounters.between(before, after, local_requests=1, local_prompt_tokens=999)
    assert (c.local_prompt_tokens, c.local_computed_tokens) == (176, 16)
    assert c.decode_store_hit_tokens == 32


def test_turn_figures_take_ttft_percentiles_over_completed_requests_only():
    ok = [RequestRecord(i, 0.0, 0.0, 1.0, 100, 7, 7, (0.1 * (i + 1), 0.9)) for i in range(3)]
    failed = RequestRecord(3, 0.0, 0.0, 1.0, 100, 7, 0, (), error="timeout")
    fig = turn_figures([*ok, failed], TurnCounters(prefill_prompt_tokens=400))
    assert (fig["requests"], fig["failed"], fig["prompt_tokens"]) == (4, 1, 400)
    assert fig["ttft_p50_s"] == pytest.approx(0.2)
    assert fig["ttft_p99_s"] == pytest.approx(0.298)
    assert fig["computed_tokens"] == 400


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_tiny_multi_turn_bench_computes_fewer_prefill_tokens_with_the_store_and_prefix_routing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--multi-turn", "--json", "--transport", "shm", "--conversations", "3"]
    argv += ["--turns", "4", "--system-len", "128", "--user-len", "16", "--answer-len", "32"]
    assert bench_kv_main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["workload"]["max_prompt_len"] == 128 + 4 * 16 + 3 * 32
    plain, store = result["runs"]["plain"], result["runs"]["store"]
    assert (plain["kv_store"], store["kv_store"]) == (0, 1)
    assert plain["env"] == {"KVMESH_PREFIX_WEIGHT": "0"}
    for run in (plain, store):
        assert [t["turn"] for t in run["turns"]] == [1, 2, 3, 4]
        for turn in run["turns"]:
            assert (turn["requests"], turn["failed"]) == (3, 0)
            assert turn["ttft_p50_s"] > 0 and turn["ttft_p99_s"] >= turn["ttft_p50_s"]
            # every prompt token was counted by a prefill worker or sent to a local prefill
            counted = turn["prefill"]["prompt_tokens"] + turn["local_prefill"]["prompt_tokens"]
            assert counted == turn["prompt_tokens"]
    # the same prompts went to both meshes, and the greedy answers agree
    assert [t["prompt_tokens"] for t in plain["turns"]] == [
        t["prompt_tokens"] for t in store["turns"]
    ]
    assert result["answers_compared"] == 12 and result["answers_equal"] == 12
    # without prefix routing no request is a local prefill; with it, later turns are
    assert all(t["local_prefill"]["requests"] == 0 for t in plain["turns"])
    assert store["turns_3_on"]["local_prefill"]["requests"] > 0
    assert store["turns_3_on"]["computed_tokens"] < plain["turns_3_on"]["computed_tokens"]
    assert result["computed_tokens_plain_over_store_turns_3_on"] > 1
    assert result["ttft_p50_plain_over_store_turns_3_on"] > 0


def test_routing_baseline_keeps_prefix_placement_and_caches_and_drops_only_the_store():
    from kvmesh.loadgen.bench_kv_meshes import variants

    plain, store = variants("routing")
    assert (plain.kv_store, store.kv_store) == (0, 1)
    assert dict(plain.env) == {}  # the registry's prefix weight and every prefix cache: defaults
    no_store, _ = variants("no-store")
    assert dict(no_store.env) == {"KVMESH_PREFIX_WEIGHT": "0"}
