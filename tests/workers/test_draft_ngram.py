"""Prompt-lookup drafting (services/draft/ngram.py) and the tree shapes it fills."""

from __future__ import annotations

import pytest
from kvmesh.services.draft.ngram import build_tree, find_continuations, propose_ngram
from kvmesh.services.draft.shape import MAX_TREE_NODES, TreeShape


def test_chain_proposes_what_followed_the_last_occurrence_of_the_suffix():
    context = [1, 2, 3, 4, 5, 6, 9, 9, 1, 2, 3]
    tokens, parents = propose_ngram(context, TreeShape.parse(3), min_n=1, max_n=3)
    assert tokens == (4, 5, 6)
    assert parents == (-1, 0, 1)


def test_longest_matching_suffix_wins_over_more_frequent_shorter_ones():
    # "3" is followed by 7 twice, but "2 3" only once, by 4
    context = [3, 7, 3, 7, 2, 3, 4, 8, 2, 3]
    tokens, _ = propose_ngram(context, TreeShape.parse(1), min_n=1, max_n=2)
    assert tokens == (4,)


def test_no_proposal_when_no_suffix_of_min_n_tokens_occurs_earlier():
    assert propose_ngram([1, 2, 3, 4], TreeShape.parse(4), min_n=1, max_n=3) == ((), ())
    # "4" occurs once before but min_n 2 asks for two-token matches
    assert propose_ngram([4, 5, 6, 4], TreeShape.parse(2), min_n=2, max_n=3) == ((), ())


def test_chain_that_reaches_the_end_of_the_context_goes_on_over_its_own_drafts():
    tokens, parents = propose_ngram([5, 6, 5], TreeShape.parse(4), min_n=1, max_n=1)
    assert tokens == (6, 5, 6, 5) and parents == (-1, 0, 1, 2)
    # a period of 3 after a prefix: the lookahead repeats it as deep as asked
    context = [9, 8, 1, 2, 3, 1, 2, 3, 1]
    tokens, _ = propose_ngram(context, TreeShape.parse(2, ()), min_n=1, max_n=2)
    assert tokens == (2, 3)
    tokens, _ = propose_ngram(context, TreeShape((1,) * 8), min_n=1, max_n=2)
    assert tokens == (2, 3, 1, 2, 3, 1, 2, 3)


def test_tree_leaves_go_on_only_below_the_branching_levels():
    # after "1": 2 then 0, and 3 then 0; the shape branches at depth 1, then one child per level
    context = [1, 3, 0, 1, 2, 0, 1]
    tokens, parents = propose_ngram(context, TreeShape((2, 1, 1, 1)), min_n=1, max_n=1)
    assert tokens[:4] == (2, 3, 0, 0) and parents[:4] == (-1, -1, 0, 1)
    # each leaf continues the lookup over context + its own path, to depth 4
    depth = {-1: 0}
    for i, p in enumerate(parents):
        depth[i] = depth[p] + 1
    assert max(depth.values()) == 4 and len(tokens) == 8


def test_tree_keeps_the_distinct_continuations_most_frequent_first():
    # after "1": 2 (twice, most recent at 6), 3 (once), 4 (once, least recent)
    context = [1, 4, 0, 1, 3, 0, 1, 2, 0, 1, 2, 0, 1]
    conts = find_continuations(context, 2, 1, 1)
    assert conts[0] == (2, 0)  # most recent first
    tokens, parents = build_tree(conts, TreeShape.parse(2, (2, 1)))
    assert tokens[:2] == (2, 3)  # 2 twice; 3 more recent than 4
    assert parents == (-1, -1, 0, 1)
    assert tokens[2:] == (0, 0)


def test_tree_nodes_have_their_parents_before_them_and_respect_the_widths():
    context = [i % 5 for i in range(200)] + [7, 1, 2] + [1, 3, 1, 4, 1]
    shape = TreeShape.parse(3, (3, 2, 1))
    tokens, parents = propose_ngram(context, shape, min_n=1, max_n=1)
    assert len(tokens) == len(parents) <= shape.max_nodes
    children: dict[int, int] = {}
    for i, p in enumerate(parents):
        assert p < i
        children[p] = children.get(p, 0) + 1
    assert children[-1] <= 3


@pytest.mark.parametrize(
    ("k", "tree", "error"),
    [
        (0, (), "num_speculative_tokens must be in"),
        (17, (), "num_speculative_tokens must be in"),
        (2, (2, 2, 2), "has 3 depths"),
        (3, (8, 8, 8), f"limit is {MAX_TREE_NODES}"),
        (2, (0, 1), "widths must be >= 1"),
    ],
)
def test_tree_shape_refuses_bad_input(k, tree, error):
    with pytest.raises(ValueError, match=error):
        TreeShape.parse(k, tree)


def test_tree_shape_counts_nodes_and_knows_a_chain():
    assert TreeShape.parse(3, (2, 2, 1)).max_nodes == 2 + 4 + 4
    assert TreeShape.parse(4).is_chain and not TreeShape.parse(2, (2, 1)).is_chain
