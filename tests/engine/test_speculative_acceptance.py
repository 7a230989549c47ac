"""acceptance: path choice, target picks as the Sampler draws them, and an unbiased distribution."""

from collections import Counter

import pytest
import torch
from kvmesh.shared.engine.acceptance import Verdict, accept, target_tokens
from kvmesh.shared.engine.draft_tree import DraftTree
from kvmesh.shared.engine.sampler import Sampler
from kvmesh.shared.engine.sequence import Sequence
from kvmesh.shared.text.sampling import SamplingOptions
from support.stats import chi2_sf


def test_chi2_sf_matches_known_quantiles():
    # 95th percentiles of chi-square: df 1 -> 3.841, 4 -> 9.488, 5 -> 11.070
    for df, q95 in ((1, 3.841459), (4, 9.487729), (5, 11.070498)):
        assert chi2_sf(q95, df) == pytest.approx(0.05, abs=1e-5)


def test_accept_follows_the_first_child_equal_to_each_pick():
    tree = DraftTree((10, 11, 12, 13, 14), (-1, -1, 0, 1, 1))
    assert accept(tree, [11, 0, 0, 0, 0, 0]) == Verdict((1,), 0)
    assert accept(tree, [11, 0, 14, 0, 0, 7]) == Verdict((1, 4), 7)
    assert accept(tree, [10, 12, 0, 99, 0, 0]) == Verdict((0, 2), 99)
    assert accept(tree, [5, 10, 11, 12, 13, 14]) == Verdict((), 5)
    assert accept(DraftTree((), ()), [3]) == Verdict((), 3)


def test_accept_takes_the_first_of_equal_siblings():
    tree = DraftTree((4, 4, 5), (-1, -1, 1))
    assert accept(tree, [4, 9, 5, 0]) == Verdict((0,), 9)


def test_greedy_picks_are_the_argmax_of_each_row():
    logits = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    params = SamplingOptions(temperature=0.0)
    assert target_tokens(logits, params, [3, 4, 4, 5, 5], torch.Generator()) == (
        logits.argmax(-1).tolist()
    )


@pytest.mark.parametrize(
    "params",
    [
        SamplingOptions(temperature=1.0, seed=3),
        SamplingOptions(temperature=0.6, top_k=5, seed=4),
        SamplingOptions(temperature=1.4, top_p=0.8, seed=5),
    ],
)
def test_seeded_picks_are_what_the_sampler_draws_at_that_output_index(params):
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    picks = target_tokens(logits, params, [7, 8, 8, 9], torch.Generator())
    sampler = Sampler(seed=0)
    for row, index in enumerate([7, 8, 8, 9]):
        seq = Sequence("r", [1] * 5 + [2] * index, params, num_prompt_tokens=5)
        assert sampler(logits[row : row + 1], [seq]) == [picks[row]]


def first_tokens(tree: DraftTree, logits: torch.Tensor, params, n: int, seeded: bool) -> Counter:
    """The first emitted token of ``n`` verifications of ``tree`` whose every row has
    ``logits`` (one position, fixed context)."""
    rows = logits.expand(len(tree) + 1, -1)
    indices = [0, *tree.depths]
    generator = torch.Generator().manual_seed(99)
    counts: Counter = Counter()
    for i in range(n):
        p = SamplingOptions(
            temperature=params.temperature, top_k=params.top_k, seed=i if seeded else None
        )
        verdict = accept(tree, target_tokens(rows, p, indices, generator))
        counts[tree.tokens[verdict.path[0]] if verdict.path else verdict.next_token] += 1
    return counts


@pytest.mark.parametrize(
    ("tree_kind", "seeded"),
    [
        ("likely chain", True),
        ("unlikely chain", True),
        ("unlikely chain", False),
        ("unlikely pair", True),
        ("duplicate children", True),
    ],
)
def test_emitted_distribution_matches_the_target_whatever_the_drafts(seeded, tree_kind):
    vocab, n = 12, 1000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(7)) * 1.5
    params = SamplingOptions(temperature=1.0, top_k=6)
    kept = logits.topk(6).indices
    probs = torch.zeros(vocab)
    probs[kept] = logits[kept].softmax(-1)
    order = probs.argsort(descending=True).tolist()
    best, worst, second_worst = order[0], order[5], order[4]
    trees = {
        "likely chain": DraftTree.chain([best, order[1]]),
        "unlikely chain": DraftTree.chain([worst, worst]),  # a biased drafter
        "unlikely pair": DraftTree((worst, second_worst, best), (-1, -1, 0)),
        "duplicate children": DraftTree((worst, worst, best), (-1, -1, -1)),
    }
    counts = first_tokens(trees[tree_kind], logits, params, n, seeded)
    assert set(counts) <= set(kept.tolist())
    stat = sum(
        (counts[t] - n * float(probs[t])) ** 2 / (n * float(probs[t])) for t in kept.tolist()
    )
    assert chi2_sf(stat, df=5) > 0.01, (counts, probs[kept])
