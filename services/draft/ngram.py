"""Prompt lookup (n-gram) drafting: continue a sequence the way it went on before.

The last n tokens of the context (n from ``max_n`` down to ``min_n``; the longest n that occurs
earlier wins) are looked up in the context itself (prompt + output); what followed each earlier
occurrence is a candidate continuation. Candidates are merged into a trie; each depth keeps the
``widths[d]`` most frequent branches (ties: the most recent occurrence first). A chain keeps one.
Where the tree narrows to one child per level (a chain, and the lookahead below a tree), a path
that reaches the end of the context goes on as the lookup goes on over context + path: in a text
that repeats with a short period, the most recent occurrence's continuation stops at the end of
the context after one period, and the drafts past it repeat the lookup. Pure: no I/O, no state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmesh.services.draft.shape import TreeShape

MAX_MATCHES = 64  # earlier occurrences considered, most recent first (bounds the work per draft)


@dataclass(slots=True)
class _Node:
    count: int = 0
    rank: int = 0  # order of the first occurrence that reached it (0: most recent)
    children: dict[int, _Node] = field(default_factory=dict)


def find_continuations(
    context: Sequence[int], depth: int, min_n: int, max_n: int
) -> list[tuple[int, ...]]:
    """What followed the earlier occurrences of the context's longest matching suffix (at most
    ``depth`` tokens each, most recent occurrence first); [] when no suffix of ``min_n`` tokens
    or more occurs earlier."""
    tokens = list(context)
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n :]
        found = []
        # an occurrence must leave at least one token after it (not the suffix itself)
        for start in range(size - n - 1, -1, -1):
            if tokens[start] == suffix[0] and tokens[start : start + n] == suffix:
                found.append(tuple(tokens[start + n : start + n + depth]))
                if len(found) == MAX_MATCHES:
                    break
        if found:
            return found
    return []


def build_tree(
    continuations: Sequence[tuple[int, ...]], shape: TreeShape
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Merge continuations into a trie pruned to ``shape``: ``(tokens, parents)`` in
    breadth-first order (every parent before its children; -1: the sequence's last token)."""
    root = _Node()
    for rank, cont in enumerate(continuations):
        node = root
        for token in cont[: shape.depth]:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node(rank=rank)
            child.count += 1
            node = child
    tokens: list[int] = []
    parents: list[int] = []
    level: list[tuple[int, _Node]] = [(-1, root)]
    for width in shape.widths:
        next_level = []
        for parent_index, node in level:
            ranked = sorted(node.children.items(), key=lambda kv: (-kv[1].count, kv[1].rank))
            for token, child in ranked[:width]:
                tokens.append(token)
                parents.append(parent_index)
                next_level.append((len(tokens) - 1, child))
        if not next_level:
            break
        level = next_level
    return tuple(tokens), tuple(parents)


def extend_chains(
    context: Sequence[int],
    tokens: tuple[int, ...],
    parents: tuple[int, ...],
    shape: TreeShape,
    min_n: int,
    max_n: int,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The tree with each leaf that stops short of ``shape.depth``, where the shape has one
    child per level from its depth on, continued by the lookup over context + its path (new
    nodes after the old ones: parents still come first)."""
    if not tokens:
        return tokens, parents
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    has_child = set(parents)
    out_tokens, out_parents = list(tokens), list(parents)
    for leaf in range(-1, len(tokens)):
        depth = depths[leaf] if leaf >= 0 else 0
        if leaf in has_child or depth >= shape.depth or any(w != 1 for w in shape.widths[depth:]):
            continue
        path = []
        node = leaf
        while node >= 0:
            path.append(tokens[node])
            node = parents[node]
        drafted = list(context) + path[::-1]
        parent = leaf
        while depth < shape.depth:
            left = shape.depth - depth
            conts = find_continuations(drafted, left, min_n, max_n)
            more = build_tree(conts, TreeShape((1,) * left))[0]  # as a chain keeps it
            if not more:
                break
            for token in more:
                out_tokens.append(token)
                out_parents.append(parent)
                parent = len(out_tokens) - 1
            drafted += more
            depth += len(more)
    return tuple(out_tokens), tuple(out_parents)


def propose_ngram(
    context: Sequence[int], shape: TreeShape, min_n: int = 1, max_n: int = 4
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The draft tree ``(tokens, parents)`` for ``context``; empty when nothing matches."""
    tokens, parents = build_tree(find_continuations(context, shape.depth, min_n, max_n), shape)
    return extend_chains(context, tokens, parents, shape, min_n, max_n)
