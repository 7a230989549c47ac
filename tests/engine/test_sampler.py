import pytest
import torch
from kvmesh.shared.engine.sampler import Sampler, apply_top_k_top_p
from kvmesh.shared.engine.sequence import Sequence
from kvmesh.shared.text.sampling import SamplingOptions


def seq_with(params: SamplingOptions, prompt=(65, 66), rid="r") -> Sequence:
    return Sequence(rid, list(prompt), params)


def test_sampling_params_validation_names_the_field():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingOptions(max_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingOptions(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingOptions(top_p=0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingOptions(top_k=-1)
    with pytest.raises(ValueError, match="stop"):
        SamplingOptions(stop=[""])
    assert SamplingOptions(stop="x").stop == ("x",)
    assert SamplingOptions(stop_token_ids=[3]).stop_token_ids == (3,)


def test_greedy_takes_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 1.0]])
    seqs = [seq_with(SamplingOptions(temperature=0)), seq_with(SamplingOptions(temperature=0))]
    assert Sampler(0)(logits, seqs) == [1, 0]


def test_top_k_one_equals_greedy_under_sampling():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    seqs = [seq_with(SamplingOptions(temperature=1.0, top_k=1)) for _ in range(4)]
    assert Sampler(0)(logits, seqs) == logits.argmax(-1).tolist()


def test_top_k_top_p_filter():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    out = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([1.0]))
    assert torch.isinf(out[0, 2:]).all() and torch.isfinite(out[0, :2]).all()
    out = apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.7]))
    assert torch.isfinite(out[0, :2]).all() and torch.isinf(out[0, 2:]).all()
    out = apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.1]))
    assert torch.isfinite(out[0, 0]) and torch.isinf(out[0, 1:]).all()


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.7, 0.2, 0.1])
    logits = probs.log().expand(4000, 3).contiguous()
    seqs = [seq_with(SamplingOptions(temperature=1.0)) for _ in range(4000)]
    counts = torch.bincount(torch.tensor(Sampler(1)(logits, seqs)), minlength=3).float() / 4000
    assert torch.allclose(counts, probs, atol=0.03)


def test_seeded_request_is_independent_of_batch_composition():
    torch.manual_seed(0)
    logits = torch.randn(3, 100)
    p = SamplingOptions(temperature=1.0, seed=1234)
    alone = [Sampler()(logits[1:2], [seq_with(p)])[0] for _ in range(1)]
    a = seq_with(p)
    mixed = Sampler()(
        logits,
        [seq_with(SamplingOptions(temperature=0.8)), a, seq_with(SamplingOptions(temperature=0))],
    )
    assert mixed[1] == alone[0]
    # Same seed, fresh sequence: same stream of tokens.
    s1, s2 = seq_with(p), seq_with(p)
    sampler = Sampler()
    assert [sampler(logits[:1], [s1])[0] for _ in range(5)] == [
        sampler(logits[:1], [s2])[0] for _ in range(5)
    ]
