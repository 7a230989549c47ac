"""The sampling options that act on logits, against hand-computed cases, and what the sampler
makes of them (min-p, logprobs)."""

from __future__ import annotations

import math

import pytest
import torch
from kvmesh.shared.engine.logit_options import RowHistory, apply_logit_options
from kvmesh.shared.engine.sampler import Sampler, apply_min_p, token_logprobs
from kvmesh.shared.engine.sequence import Sequence
from kvmesh.shared.text.sampling import SamplingOptions

ROW = [1.0, -2.0, 3.0, 0.5, 0.0]
EOS = frozenset({4})


def apply(params: SamplingOptions, prompt=(0,), output=(2, 2, 3), row=ROW) -> list[float]:
    out = apply_logit_options(
        torch.tensor([row]), [params], [RowHistory(list(prompt), list(output))], EOS
    )
    return out[0].tolist()


def test_penalties_match_the_hand_computed_case():
    # repetition 2 over prompt {0} and output {2, 3}: positive logits halved, negatives doubled;
    # frequency 0.5 x count (token 2 twice, 3 once); presence 0.25 for 2 and 3
    got = apply(
        SamplingOptions(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    )
    assert got == pytest.approx([0.5, -2.0, 1.5 - 1.0 - 0.25, 0.25 - 0.5 - 0.25, 0.0])


def test_repetition_penalty_multiplies_negative_logits_of_seen_tokens():
    got = apply(SamplingOptions(repetition_penalty=2.0), prompt=(1,), output=())
    assert got == pytest.approx([1.0, -4.0, 3.0, 0.5, 0.0])


def test_negative_penalties_favour_repeats():
    got = apply(SamplingOptions(frequency_penalty=-1.0, presence_penalty=-0.5))
    assert got == pytest.approx([1.0, -2.0, 5.5, 2.0, 0.0])


def test_logit_bias_is_added():
    got = apply(SamplingOptions(logit_bias={1: 5.0, 4: -100.0}))
    assert got == pytest.approx([1.0, 3.0, 3.0, 0.5, -100.0])


def test_min_tokens_masks_stop_tokens_and_eos_until_reached():
    params = SamplingOptions(min_tokens=4, stop_token_ids=(3,))
    got = apply(params, output=(2, 2, 1))
    assert got[3] == got[4] == -math.inf and got[:3] == pytest.approx(ROW[:3])
    assert apply(params, output=(2, 2, 1, 1)) == pytest.approx(ROW)  # reached: no mask
    ignore = apply(SamplingOptions(min_tokens=4, ignore_eos=True), output=())
    assert ignore == pytest.approx(ROW)  # EOS cannot end it anyway


def test_rows_without_options_are_left_alone():
    x = torch.randn(2, 5)
    rows = [RowHistory([0], [1]), RowHistory([0], [1])]
    out = apply_logit_options(x, [SamplingOptions(), SamplingOptions(min_p=0.5)], rows, EOS)
    assert torch.equal(out, x)


def test_min_p_keeps_tokens_at_least_min_p_times_the_likeliest():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = apply_min_p(probs.log(), torch.tensor([0.4])).isfinite()[0].tolist()
    assert kept == [True, True, False, False]  # 0.15 < 0.4 x 0.5


def test_sampling_with_min_p_never_draws_a_dropped_token():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(200, 1)
    seqs = [Sequence(f"r{i}", [1], SamplingOptions(min_p=0.4)) for i in range(200)]
    assert set(Sampler(0)(logits, seqs)) == {0, 1}


def test_greedy_follows_the_bias():
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    seq = Sequence("r", [1], SamplingOptions(temperature=0, logit_bias={2: 5.0}))
    assert Sampler(0)(logits, [seq]) == [2]


def test_token_logprobs_are_the_log_softmax_and_its_likeliest():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [1.0, 1.0, 1.0, 1.0]])
    lps = token_logprobs(logits, [0, 2], [2, 0])
    ref = logits.log_softmax(-1)
    assert lps[0].logprob == pytest.approx(ref[0, 0].item())
    assert lps[0].top_ids == (1, 3)
    assert lps[0].top_logprobs == pytest.approx((ref[0, 1].item(), ref[0, 3].item()))
    assert lps[1].logprob == pytest.approx(math.log(0.25)) and lps[1].top_ids == ()
