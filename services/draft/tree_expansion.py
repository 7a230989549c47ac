"""TreeExpansion: the draft tree a model drafter grows, pass by pass (pure, no torch).

With ``--tree W1,...,WK`` a model drafter proposes, at each node of depth d - 1, the ``W_d``
likeliest tokens of its draft model there as children (most likely first), and below the
likeliest path (every node's first child: the greedy path) ``lookahead`` more greedy tokens. A
node's children need the draft model's logits at it, so the tree grows level by level, one
forward pass of the draft engine per level with a tree attention mask (``LLMEngine.score_trees``,
the nodes rolled back after each pass). Pass d scores every node shallower than d and, one level
ahead, the greedy node at depth d (``pass_nodes``): so pass 1 needs the root's greedy child from
the draft engine's prefill (its sampled token), and after pass K the greedy path's next token is
known too. The drafter then keeps the greedy path as its sequence (``kept_path``) and decodes the
rest of the lookahead plainly, as the chain drafter would: K + lookahead passes in all, as for a
chain of that depth. A node's children are decided once, from the first pass that scores it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Tree = tuple[tuple[int, ...], tuple[int, ...]]  # (tokens, parents)


@dataclass(slots=True)
class TreeExpansion:
    """One sequence's tree while it grows. Nodes are kept in creation order (parents first);
    ``greedy[d - 1]`` is the greedy path's node at depth d."""

    widths: tuple[int, ...]  # children per node at each depth up to K
    lookahead: int  # greedy tokens below the greedy path's node at depth K
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    greedy: list[int] = field(default_factory=list)
    expanded: set[int] = field(default_factory=set)  # nodes (-1: the root) with children decided

    @classmethod
    def start(cls, widths: tuple[int, ...], lookahead: int, first_token: int) -> TreeExpansion:
        """A tree whose root's greedy child is ``first_token`` (the draft engine's own token
        after the context)."""
        assert widths and all(w >= 1 for w in widths) and lookahead >= 0, (widths, lookahead)
        return cls(tuple(widths), lookahead, [first_token], [-1], [1], [0])

    @property
    def num_levels(self) -> int:
        return len(self.widths)

    @property
    def depth(self) -> int:
        """How deep the greedy path goes when the tree is done: K + lookahead."""
        return self.num_levels + self.lookahead

    @property
    def max_rank(self) -> int:
        """How many of the likeliest tokens ``expand`` needs per scored row."""
        return max(self.widths) + 1  # + 1: the root's greedy child may not be among them

    def pass_nodes(self, level: int) -> list[int]:
        """The nodes pass ``level`` (1..K) scores, in node order: every node shallower than
        ``level`` and the greedy node at depth ``level``."""
        assert 1 <= level <= self.num_levels and len(self.greedy) >= level, level
        ahead = self.greedy[level - 1]
        return [i for i, d in enumerate(self.depths) if d < level or i == ahead]

    def subtree(self, nodes: list[int]) -> Tree:
        """``nodes`` (each with its parent among them, in node order) as a tree of their own:
        ``(tokens, parents)`` with parents re-indexed."""
        index = {-1: -1}
        parents = []
        for i, node in enumerate(nodes):
            index[node] = i
            parents.append(index[self.parents[node]])
        return tuple(self.tokens[n] for n in nodes), tuple(parents)

    def expand(self, nodes: list[int], ranked: list[list[int]]) -> None:
        """Decide the children of the root and of ``nodes`` not yet expanded, from the pass that
        scored them: ``ranked[0]`` the likeliest tokens after the root (most likely first, at
        least ``max_rank``), ``ranked[1 + j]`` those after ``nodes[j]``."""
        assert len(ranked) == len(nodes) + 1, (len(ranked), len(nodes))
        if -1 not in self.expanded:
            self.expanded.add(-1)
            first = self.tokens[0]
            for token in [t for t in ranked[0] if t != first][: self.widths[0] - 1]:
                self._add(token, -1)
        for node, tokens in zip(nodes, ranked[1:], strict=True):
            if node in self.expanded:
                continue
            self.expanded.add(node)
            is_greedy_leaf = node == self.greedy[-1]
            depth = self.depths[node]
            if depth < self.num_levels:
                width = self.widths[depth]
            else:  # past the tree: only the greedy path goes on
                width = int(is_greedy_leaf and depth < self.depth)
            for rank, token in enumerate(tokens[:width]):
                child = self._add(token, node)
                if rank == 0 and is_greedy_leaf:
                    self.greedy.append(child)

    def kept_path(self) -> tuple[list[int], int]:
        """After pass K: the greedy nodes the draft engine keeps as its sequence and the token
        after them (the last greedy node known), to decode the rest of the lookahead from."""
        assert len(self.greedy) >= self.num_levels, (self.greedy, self.widths)
        return self.greedy[:-1], self.tokens[self.greedy[-1]]

    def extend(self, tokens: list[int]) -> None:
        """Greedy tokens decoded below the greedy path, up to ``depth``."""
        for token in tokens[: self.depth - len(self.greedy)]:
            self.greedy.append(self._add(token, self.greedy[-1]))

    @property
    def is_done(self) -> bool:
        return len(self.greedy) >= self.depth

    def tree(self) -> Tree:
        """The proposal: every node, shallower first (siblings in their order, so each node's
        first child is its likeliest and the greedy path runs through first children)."""
        order = sorted(range(len(self.tokens)), key=lambda n: self.depths[n])
        return self.subtree(order)

    def _add(self, token: int, parent: int) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        return len(self.tokens) - 1
