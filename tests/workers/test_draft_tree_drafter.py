"""Trees from the model drafters: TreeExpansion (pure) and EngineTreeDrafter on kvmesh-tiny's
first two layers (the early-exit draft): each node's children are the draft model's top tokens
there, the likeliest path and its lookahead are the chain drafter's chain, and the draft
engine's prefix cache afterwards is the one chain drafting leaves."""

from __future__ import annotations

import pytest
import torch
from kvmesh.services.draft.config import DraftConfig
from kvmesh.services.draft.core import DraftSnapshot
from kvmesh.services.draft.drafters import EngineDrafter, truncate_layers
from kvmesh.services.draft.shape import TreeShape
from kvmesh.services.draft.tree_drafter import EngineTreeDrafter
from kvmesh.services.draft.tree_expansion import TreeExpansion
from kvmesh.shared.engine.config import EngineConfig
from kvmesh.shared.engine.draft_tree import MAX_TREE_NODES, DraftTree
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.kv.kv_cache import KVPool
from kvmesh.shared.model import load_model
from support.hf_fixtures import prefill_metadata

WIDTHS = (2, 2, 1, 1)
LOOKAHEAD = 5
CONTEXTS = [
    tuple((5 * i + 3) % 250 for i in range(21)),
    tuple((7 * i + 11) % 240 for i in range(34)),
]


def _paths(tokens: tuple[int, ...], parents: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Each node's path of tokens from the root, in node order."""
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(tokens, parents, strict=True):
        paths.append((paths[parent] if parent >= 0 else ()) + (token,))
    return paths


def _children(tree: tuple[tuple[int, ...], tuple[int, ...]]) -> dict[tuple[int, ...], list[int]]:
    """Path of a node (() for the root) -> its children's tokens, in node order."""
    tokens, parents = tree
    paths = _paths(tokens, parents)
    out: dict[tuple[int, ...], list[int]] = {}
    for token, parent in zip(tokens, parents, strict=True):
        out.setdefault(paths[parent] if parent >= 0 else (), []).append(token)
    return out


def _fake_ranked(path: tuple[int, ...]) -> list[int]:
    """A made-up model: the likeliest tokens after ``path``, most likely first."""
    base = (sum((i + 1) * t for i, t in enumerate(path)) * 7 + len(path)) % 50
    return [base + 100 * r for r in range(4)]


def test_tree_expansion_grows_each_node_from_the_logits_of_the_pass_that_scored_it():
    expansion = TreeExpansion.start(WIDTHS, LOOKAHEAD, _fake_ranked(())[0])
    for level in range(1, len(WIDTHS) + 1):
        nodes = expansion.pass_nodes(level)
        tokens, parents = expansion.subtree(nodes)
        DraftTree(tokens, parents)  # topological, within the engine's limits
        assert len(tokens) <= MAX_TREE_NODES
        assert max(expansion.depths[n] for n in nodes) == level  # the greedy node, one ahead
        paths = _paths(tokens, parents)
        expansion.expand(nodes, [_fake_ranked(())] + [_fake_ranked(p) for p in paths])
    path, next_token = expansion.kept_path()
    assert [expansion.depths[n] for n in path] == [1, 2, 3, 4]  # the greedy path to depth K
    greedy = [expansion.tokens[n] for n in path] + [next_token]
    while not expansion.is_done:  # the lookahead, as greedy decoding gives it
        token = _fake_ranked(tuple(greedy))[0]
        expansion.extend([token])
        greedy.append(token)
    tree = expansion.tree()
    assert len(tree[0]) == 2 + 4 + 4 + 4 + LOOKAHEAD
    DraftTree(*tree)
    for parent, kids in _children(tree).items():
        depth = len(parent)
        width = WIDTHS[depth] if depth < len(WIDTHS) else 1
        assert kids == _fake_ranked(parent)[:width], parent
    # the first child at every node is the greedy path, lookahead included
    tokens, parents = tree
    node, first_path = -1, []
    while (node := next((i for i, p in enumerate(parents) if p == node), None)) is not None:
        first_path.append(tokens[node])
    assert first_path == greedy and len(greedy) == len(WIDTHS) + LOOKAHEAD


def test_tree_expansion_without_lookahead_keeps_the_path_above_the_last_greedy_token():
    expansion = TreeExpansion.start((3,), 0, 7)
    nodes = expansion.pass_nodes(1)
    assert nodes == [0]
    expansion.expand(nodes, [[7, 8, 9, 10], [1, 2, 3, 4]])
    assert expansion.kept_path() == ([], 7) and expansion.is_done
    assert expansion.tree() == ((7, 8, 9), (-1, -1, -1))


@pytest.fixture(scope="module")
def draft_model():
    model, tokenizer = load_model("kvmesh-tiny")
    return truncate_layers(model, 2), tokenizer


def _engine(draft_model) -> LLMEngine:
    config = EngineConfig(num_blocks=64, block_size=8, enable_prefix_caching=True)
    return LLMEngine(*draft_model, config)


def _logits_after(engine: LLMEngine, tokens: tuple[int, ...]) -> torch.Tensor:
    """The draft model's logits after ``tokens``: one prefill of them, in a pool of its own."""
    bs = engine.kv_pool.spec.block_size
    num_blocks = -(-len(tokens) // bs)
    pool = KVPool(engine.kv_pool.spec, num_blocks)
    meta = prefill_metadata(len(tokens), list(range(num_blocks)), block_size=bs)
    with torch.inference_mode():
        hidden = engine.model(torch.tensor(tokens), torch.arange(len(tokens)), pool, meta)
        return engine.model.compute_logits(hidden[-1:])[0].float()


def _assert_top(logits: torch.Tensor, kids: list[int], where: str) -> None:
    """``kids`` are the ``len(kids)`` likeliest tokens of ``logits``, most likely first (up to
    float noise between near-equal logits)."""
    tol = 1e-4
    chosen = logits[kids]
    others = logits.clone()
    others[kids] = -torch.inf
    assert len(set(kids)) == len(kids), where
    assert chosen.min() >= others.max() - tol, (where, chosen, others.max())
    assert (chosen[1:] <= chosen[:-1] + tol).all(), (where, chosen)


@pytest.mark.parametrize("lookahead", [LOOKAHEAD, 0])
def test_engine_tree_children_are_the_draft_models_top_tokens_at_each_node(draft_model, lookahead):
    engine = _engine(draft_model)
    drafter = EngineTreeDrafter(engine, TreeShape(WIDTHS), lookahead)
    jobs = [DraftSnapshot(f"r{i}", "d", c, len(c)) for i, c in enumerate(CONTEXTS)]
    trees = drafter.propose(jobs)
    for context, tree in zip(CONTEXTS, trees, strict=True):
        assert len(tree[0]) == 2 + 4 + 4 + 4 + lookahead
        DraftTree(*tree)
        children = _children(tree)
        for path, kids in children.items():
            depth = len(path)
            width = WIDTHS[depth] if depth < len(WIDTHS) else 1
            assert len(kids) == width, (path, kids)
            _assert_top(_logits_after(engine, context + path), kids, f"node {path}")
        # every node of the K levels branches as the shape says; only the likeliest path goes on
        assert sum(1 for p in children if len(p) >= len(WIDTHS)) == lookahead
    assert all(b.ref_count == 0 for b in engine.block_manager.blocks)  # every request ended
    engine.block_manager.check_invariants()


def _first_path(tree: tuple[tuple[int, ...], tuple[int, ...]]) -> list[int]:
    tokens, parents = tree
    node, out = -1, []
    while (node := next((i for i, p in enumerate(parents) if p == node), None)) is not None:
        out.append(tokens[node])
    return out


def _cache(engine: LLMEngine) -> dict[int, tuple[tuple[int, ...], torch.Tensor]]:
    """The prefix cache: block hash -> (its tokens, its KV)."""
    bm, pool = engine.block_manager, engine.kv_pool.tensor
    return {
        h: (bm.blocks[b].token_ids, pool[b].clone().float()) for h, b in bm.hash_to_block.items()
    }


def test_tree_drafting_leaves_the_draft_cache_that_chain_drafting_leaves(draft_model):
    depth = len(WIDTHS) + LOOKAHEAD
    tree_engine, chain_engine = _engine(draft_model), _engine(draft_model)
    tree_drafter = EngineTreeDrafter(tree_engine, TreeShape(WIDTHS), LOOKAHEAD)
    chain_drafter = EngineDrafter(chain_engine, depth)
    jobs = [DraftSnapshot(f"r{i}", "d", c, len(c)) for i, c in enumerate(CONTEXTS)]
    trees = tree_drafter.propose(jobs)
    chains = chain_drafter.propose(jobs)
    assert tree_drafter.num_computed_tokens == sum(len(c) for c in CONTEXTS)  # nothing cached
    # the likeliest path with its lookahead is the chain the chain drafter drafts
    assert [_first_path(t) for t in trees] == [list(c[0]) for c in chains]
    tree_cache, chain_cache = _cache(tree_engine), _cache(chain_engine)
    assert tree_cache.keys() == chain_cache.keys() and tree_cache
    for h, (tokens, kv) in tree_cache.items():
        assert tokens == chain_cache[h][0]
        torch.testing.assert_close(kv, chain_cache[h][1], atol=1e-5, rtol=1e-4)
    # drafting on from there (three drafts accepted, then a token of the target's own): both
    # engines, with chains now, draft the same
    later = [
        DraftSnapshot(f"s{i}", "d", c + tuple(t[0][:3]) + (9,), len(c))
        for i, (c, t) in enumerate(zip(CONTEXTS, chains, strict=True))
    ]
    assert EngineDrafter(tree_engine, depth).propose(later) == chain_drafter.propose(later)
    again = [DraftSnapshot(j.request_id, "d", j.context, len(j.context)) for j in later]
    tree_drafter.propose(again)  # every full block of these contexts is cached by now
    bs = tree_engine.block_manager.block_size
    tails = [len(j.context) - (len(j.context) - 1) // bs * bs for j in again]  # 1 .. bs each
    assert tree_drafter.num_computed_tokens == sum(len(c) for c in CONTEXTS) + sum(tails)
    for engine in (tree_engine, chain_engine):
        assert all(b.ref_count == 0 for b in engine.block_manager.blocks)
        engine.block_manager.check_invariants()


def test_engine_tree_drafter_at_the_length_limit_proposes_the_levels_that_fit(draft_model):
    # a pool of 4 blocks of 8 (32 tokens): a 22-token context leaves room for its greedy path
    # (K + lookahead + 1 = 10 tokens), not for the last pass's 11 nodes: it gets the three
    # levels its passes decided and the greedy node below them, no lookahead
    model, tokenizer = draft_model
    config = EngineConfig(num_blocks=4, block_size=8, enable_prefix_caching=True)
    engine = LLMEngine(model, tokenizer, config)
    context = tuple((3 * i + 1) % 200 for i in range(22))
    drafter = EngineTreeDrafter(engine, TreeShape(WIDTHS), LOOKAHEAD)
    [tree] = drafter.propose([DraftSnapshot("r", "d", context, len(context))])
    assert len(tree[0]) == 2 + 4 + 4 + 1 and DraftTree(*tree).depth == 4
    for path, kids in _children(tree).items():
        _assert_top(_logits_after(engine, context + path), kids, f"node {path}")
    assert all(b.ref_count == 0 for b in engine.block_manager.blocks)
    engine.block_manager.check_invariants()


@pytest.mark.parametrize("method", ["early-exit", "model"])
def test_model_drafter_trees_are_accepted_within_the_node_limit_and_refused_past_it(method):
    extra = {"draft_model": "kvmesh-tiny"} if method == "model" else {}
    config = DraftConfig(method=method, num_speculative_tokens=4, tree=(2, 2, 1, 1), **extra)
    assert config.pipeline_depth == 0  # trees are drafted anew; chains are topped up
    chain = DraftConfig(method=method, num_speculative_tokens=4, **extra)
    assert chain.pipeline_depth == 4 + 5
    with pytest.raises(ValueError, match=f"limit is {MAX_TREE_NODES}"):
        DraftConfig(method=method, num_speculative_tokens=3, tree=(4, 4, 4), **extra)
