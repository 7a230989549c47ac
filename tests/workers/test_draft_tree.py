"""DraftTree: validation, chains, depths, paths, ancestor masks, limits."""

import pytest
from kvmesh.shared.engine.draft_tree import MAX_TREE_NODES, DraftTree, DraftTreeError


def test_chain_has_consecutive_parents_and_its_length_as_depth():
    tree = DraftTree.chain([5, 6, 7])
    assert tree.parents == (-1, 0, 1)
    assert tree.depth == 3 and tree.is_chain
    assert tree.paths() == [[0, 1, 2]]
    assert tree.ancestor_masks() == [0b1, 0b11, 0b111]


def test_tree_depths_paths_and_children_follow_parents():
    #      root
    #     /    \
    #    0      1
    #   / \     |
    #  2   3    4
    tree = DraftTree((10, 11, 12, 13, 14), (-1, -1, 0, 0, 1))
    assert tree.depths == (1, 1, 2, 2, 2)
    assert tree.depth == 2 and not tree.is_chain
    assert tree.children(-1) == [0, 1] and tree.children(0) == [2, 3]
    assert tree.paths() == [[0, 2], [0, 3], [1, 4]]
    assert tree.ancestor_masks()[3] == 0b1001
    assert tree.width(2) == 3


def test_empty_tree_has_depth_zero():
    tree = DraftTree((), ())
    assert len(tree) == 0 and tree.depth == 0 and tree.paths() == []


@pytest.mark.parametrize(
    ("tokens", "parents", "message"),
    [
        ((1, 2), (-1,), "one parent per token"),
        ((1, 2), (-1, 1), "earlier node"),
        ((1, 2), (-1, 5), "earlier node"),
        ((1,), (-2,), "earlier node"),
        ((-1,), (-1,), "integers >= 0"),
        ((True,), (-1,), "integers >= 0"),
    ],
)
def test_malformed_tree_is_refused_naming_the_problem(tokens, parents, message):
    with pytest.raises(DraftTreeError, match=message):
        DraftTree(tokens, parents)


def test_tree_over_the_node_bound_is_refused():
    with pytest.raises(DraftTreeError, match=str(MAX_TREE_NODES)):
        DraftTree.chain(range(MAX_TREE_NODES + 1))


def test_limits_refuse_too_many_nodes_too_deep_or_too_wide():
    tree = DraftTree((1, 2, 3, 4), (-1, -1, -1, 0))
    tree.check_limits(max_nodes=4, max_depth=2, max_width=3)
    with pytest.raises(DraftTreeError, match="4 nodes, the limit is 3"):
        tree.check_limits(max_nodes=3)
    with pytest.raises(DraftTreeError, match="2 deep, the limit is 1"):
        tree.check_limits(max_depth=1)
    with pytest.raises(DraftTreeError, match="3 nodes at depth 1, the limit is 2"):
        tree.check_limits(max_width=2)
