"""DraftTree: the draft tokens proposed for one sequence, as a tree rooted at its last token.

Node ``i`` holds ``tokens[i]`` and hangs under ``parents[i]`` (-1: under the sequence's last
token, the root). Nodes come in topological order (a parent before its children), so node ``i``
at depth ``d`` (a child of the root has depth 1) has index ``>= d - 1`` and every prefix of the
nodes is itself a tree. A chain of K drafts is the tree with ``parents[i] == i - 1``.

Verification appends the nodes after the sequence's tokens in this order; node ``i`` attends to
the sequence and to its own ancestors only, at RoPE position ``len(seq) - 1 + depth(i)``.
Torch-free: the draft service builds and ships these.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# Node bitmasks (a node's ancestors and itself) fit one int64 with the root's bit besides.
MAX_TREE_NODES = 63


class DraftTreeError(ValueError):
    """A draft tree that is malformed or over the given limits; the message says which node."""


@dataclass(frozen=True, slots=True)
class DraftTree:
    """Draft tokens as a tree; see the module docstring. Empty trees are allowed (no drafts)."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    depths: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(self.tokens))
        object.__setattr__(self, "parents", tuple(self.parents))
        n = len(self.tokens)
        if len(self.parents) != n:
            raise DraftTreeError(
                f"a draft tree needs one parent per token: {n} tokens, {len(self.parents)} parents"
            )
        if n > MAX_TREE_NODES:
            raise DraftTreeError(f"a draft tree holds at most {MAX_TREE_NODES} nodes, got {n}")
        depths: list[int] = []
        for i, (token, parent) in enumerate(zip(self.tokens, self.parents, strict=True)):
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise DraftTreeError(f"node {i}: token ids are integers >= 0, got {token!r}")
            if not isinstance(parent, int) or isinstance(parent, bool) or not -1 <= parent < i:
                raise DraftTreeError(
                    f"node {i}: parent must be -1 (the sequence's last token) or an earlier node "
                    f"(0..{i - 1}; nodes in topological order), got {parent!r}"
                )
            depths.append(1 if parent < 0 else depths[parent] + 1)
        object.__setattr__(self, "depths", tuple(depths))

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> DraftTree:
        """K drafts one after another: node i's parent is node i - 1."""
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depth(self) -> int:
        """Length of the longest root-to-leaf path (0 for an empty tree)."""
        return max(self.depths, default=0)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def width(self, depth: int) -> int:
        """Number of nodes at ``depth`` (1 = the root's children)."""
        return sum(1 for d in self.depths if d == depth)

    def children(self, node: int) -> list[int]:
        """Children of ``node`` (-1: the root) in node order, the order acceptance tries them."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def path(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node``, inclusive."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def paths(self) -> list[list[int]]:
        """The root-to-leaf paths (node indices), leaves in node order."""
        has_child = {p for p in self.parents if p >= 0}
        return [self.path(i) for i in range(len(self)) if i not in has_child]

    def ancestor_masks(self) -> list[int]:
        """Per node, a bitmask over nodes: bit j set iff node j is the node or an ancestor."""
        masks: list[int] = []
        for i, p in enumerate(self.parents):
            masks.append((masks[p] if p >= 0 else 0) | (1 << i))
        return masks

    def check_limits(
        self,
        *,
        max_nodes: int | None = None,
        max_depth: int | None = None,
        max_width: int | None = None,
    ) -> None:
        """Raise DraftTreeError if the tree has more nodes, depth or nodes at one depth than given."""
        if max_nodes is not None and len(self) > max_nodes:
            raise DraftTreeError(f"the draft tree has {len(self)} nodes, the limit is {max_nodes}")
        if max_depth is not None and self.depth > max_depth:
            raise DraftTreeError(f"the draft tree is {self.depth} deep, the limit is {max_depth}")
        if max_width is not None:
            for d in range(1, self.depth + 1):
                if self.width(d) > max_width:
                    raise DraftTreeError(
                        f"the draft tree has {self.width(d)} nodes at depth {d}, the limit is {max_width}"
                    )
