"""Structured outputs in the engine: a grammar matcher per sequence, masks where tokens are
sampled (xgrammar).

``GrammarBook`` compiles a request's ``StructuredOutputs`` against the engine's vocabulary once
(an LRU of compiled grammars: a schema sent again is not compiled again) and gives each sequence
its own ``GrammarMatcher``. ``mask_rows`` sets the logits of tokens a row's grammar forbids to
-inf before the draw; ``tree_bitmask`` gives the masks of a draft tree's verification rows (the
grammar's state after each node's path), so a draft token the grammar forbids can never be the
target's pick and is rejected. The vocabulary is given to xgrammar as each token's bytes
(``Tokenizer.token_bytes``); special tokens are no text, and EOS ends a completed grammar.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

import torch
from kvmesh.shared.engine.draft_tree import DraftTree
from kvmesh.shared.text.structured_output import StructuredOutputs, build_grammar
from kvmesh.shared.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    import xgrammar

MAX_COMPILED = 64  # compiled grammars kept per engine


class GrammarBook:
    """Compiled grammars of one vocabulary, and matchers over them."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: frozenset[int]):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler: Any = None
        self._compiled: OrderedDict[StructuredOutputs, Any] = OrderedDict()
        self.num_compiled = 0  # grammars compiled (the rest came from the cache)

    def matcher(self, spec: StructuredOutputs) -> xgrammar.GrammarMatcher:
        """A fresh matcher of ``spec`` (StructuredOutputError: it does not build)."""
        import xgrammar as xgr

        compiled = self._compiled.get(spec)
        if compiled is None:
            compiled = self._compiler_of().compile_grammar(build_grammar(spec))
            self.num_compiled += 1
            self._compiled[spec] = compiled
            if len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(spec)
        return xgr.GrammarMatcher(compiled)

    def _compiler_of(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            tok = self._tokenizer
            specials = tok.special_ids()
            vocab = [
                b"" if i in specials or i >= tok.vocab_size else tok.token_bytes(i)
                for i in range(self.vocab_size)
            ]
            info = xgr.TokenizerInfo(
                vocab,
                xgr.VocabType.RAW,
                vocab_size=self.vocab_size,
                stop_token_ids=self._stop_token_ids,
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler


def mask_rows(logits: torch.Tensor, matchers: Seq[Any]) -> torch.Tensor:
    """``logits`` (N, V) float32 CPU with each row's forbidden tokens at -inf (rows whose
    matcher is None left alone); a new tensor."""
    import xgrammar as xgr

    out = logits.clone()
    bitmask = xgr.allocate_token_bitmask(len(matchers), out.shape[1])
    for i, matcher in enumerate(matchers):
        if matcher is not None:
            matcher.fill_next_token_bitmask(bitmask, i)
    xgr.apply_token_bitmask_inplace(out, bitmask)
    return out


def tree_bitmask(matcher: Any, tree: DraftTree, vocab_size: int) -> torch.Tensor:
    """The bitmask of each verification row of ``tree`` (row 0: after the sequence, row
    ``1 + j``: after node ``j``'s path). A row below a draft token the grammar forbids allows
    everything: the target never picks that token at its parent, so the row is never used."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(tree) + 1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    for j in range(len(tree)):
        path = [tree.tokens[a] for a in tree.path(j)]
        accepted = 0
        for token in path:
            if not matcher.accept_token(token):
                break
            accepted += 1
        if accepted == len(path):
            matcher.fill_next_token_bitmask(bitmask, 1 + j)
        if accepted:
            matcher.rollback(accepted)
    return bitmask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` (N, V) float32 CPU masked by ``bitmask`` (N, words); a new tensor."""
    import xgrammar as xgr

    out = logits.clone()
    xgr.apply_token_bitmask_inplace(out, bitmask)
    return out
