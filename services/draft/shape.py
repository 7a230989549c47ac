"""TreeShape: how wide a draft tree may branch at each depth, and the limits on it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvmesh.shared.engine.draft_tree import MAX_TREE_NODES  # what the engine verifies at most

MAX_SPECULATIVE_TOKENS = 16  # depth: verifying more per step rarely pays and grows the KV rollback


@dataclass(frozen=True, slots=True)
class TreeShape:
    """``widths[d]``: children at most per node at depth d (all 1: a chain of ``depth``)."""

    widths: tuple[int, ...]

    @classmethod
    def parse(cls, num_speculative_tokens: int, tree: tuple[int, ...] = ()) -> TreeShape:
        """The shape of ``--num-speculative-tokens K --tree W1,...``; ValueError says what is
        wrong (K out of range, a tree of another depth, one too wide)."""
        k = num_speculative_tokens
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {k}"
            )
        if not tree:
            return cls((1,) * k)
        if len(tree) != k:
            raise ValueError(
                f"--tree {','.join(map(str, tree))} has {len(tree)} depths but "
                f"--num-speculative-tokens is {k}; give one width per depth"
            )
        if any(w < 1 for w in tree):
            raise ValueError(f"--tree widths must be >= 1, got {','.join(map(str, tree))}")
        shape = cls(tuple(tree))
        if shape.max_nodes > MAX_TREE_NODES:
            raise ValueError(
                f"--tree {','.join(map(str, tree))} has up to {shape.max_nodes} nodes; the "
                f"limit is {MAX_TREE_NODES} per sequence (narrow it or make it shallower)"
            )
        return shape

    @property
    def depth(self) -> int:
        return len(self.widths)

    @property
    def is_chain(self) -> bool:
        return all(w == 1 for w in self.widths)

    @property
    def max_nodes(self) -> int:
        """Nodes of the full tree: W1 + W1*W2 + ..."""
        return sum(math.prod(self.widths[: d + 1]) for d in range(self.depth))
