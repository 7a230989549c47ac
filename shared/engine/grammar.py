"""Structured outputs in the engine: a grammar matcher per sequence, masks where tokens are
sampled (xgrammar).

``GrammarBook`` compiles a request's ``StructuredOutputs`` against the engine's vocabulary once
(an LRU of compiled grammars: a schema sent again is not compiled again) and gives each sequence
its own ``GrammarMatcher``. It remembers the specs that failed (by hash, bounded), so a bad spec
sent again is refused at once. ``compile`` is thread-safe and touches no cache: a worker compiles
in a thread (``grammar_compile.py``) and ``add``s the result, so ``matcher`` finds it compiled. ``mask_rows`` sets the logits of tokens a row's grammar forbids to
-inf before the draw; ``tree_bitmask`` gives the masks of a draft tree's verification rows (the
grammar's state after each node's path), so a draft token the grammar forbids can never be the
target's pick and is rejected. The vocabulary is given to xgrammar as each token's bytes
(``Tokenizer.token_bytes``); special tokens are no text, and EOS ends a completed grammar.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

import msgspec
import torch
from kvmesh.shared.engine.draft_tree import DraftTree
from kvmesh.shared.text.structured_output import (
    StructuredOutputError,
    StructuredOutputs,
    build_grammar,
)
from kvmesh.shared.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    import xgrammar

MAX_COMPILED = 64  # compiled grammars kept per engine
MAX_FAILED = 256  # failed specs remembered per engine (their hashes and reasons)


class GrammarBook:
    """Compiled grammars of one vocabulary, and matchers over them."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: frozenset[int]):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler: Any = None
        self._compiler_lock = threading.Lock()  # compile threads share one compiler
        self._compiled: OrderedDict[StructuredOutputs, Any] = OrderedDict()
        self._failed: OrderedDict[bytes, str] = OrderedDict()  # spec hash -> why it failed
        self.num_compiled = 0  # grammars compiled (the rest came from the cache)
        self.num_compiles = 0  # compiles started, failed ones included

    def matcher(self, spec: StructuredOutputs) -> xgrammar.GrammarMatcher:
        """A fresh matcher of ``spec`` (StructuredOutputError: it does not build, or failed
        before), compiled here unless it is cached."""
        import xgrammar as xgr

        compiled = self._compiled.get(spec)
        if compiled is None:
            reason = self.failure(spec)
            if reason is not None:
                raise StructuredOutputError(reason)
            try:
                compiled = self.compile(spec)
            except StructuredOutputError as exc:
                self.fail(spec, str(exc))
                raise
            self.add(spec, compiled)
        else:
            self._compiled.move_to_end(spec)
        return xgr.GrammarMatcher(compiled)

    def compile(self, spec: StructuredOutputs) -> Any:
        """``spec`` compiled against the vocabulary, the caches left alone (thread-safe; slow:
        seconds for a large schema). StructuredOutputError: it does not build."""
        self.num_compiles += 1
        return self.compiler().compile_grammar(build_grammar(spec))

    def add(self, spec: StructuredOutputs, compiled: Any) -> None:
        """Cache ``compiled`` (``compile(spec)``'s result), dropping the least recently used."""
        self._compiled[spec] = compiled
        self._compiled.move_to_end(spec)
        self.num_compiled += 1
        if len(self._compiled) > MAX_COMPILED:
            self._compiled.popitem(last=False)

    def is_compiled(self, spec: StructuredOutputs) -> bool:
        return spec in self._compiled

    def fail(self, spec: StructuredOutputs, reason: str) -> None:
        """Remember that ``spec`` failed and why: ``matcher`` refuses it at once from now on."""
        key = spec_hash(spec)
        self._failed[key] = reason
        self._failed.move_to_end(key)
        if len(self._failed) > MAX_FAILED:
            self._failed.popitem(last=False)

    def failure(self, spec: StructuredOutputs) -> str | None:
        """Why ``spec`` failed, if it did (lately)."""
        return self._failed.get(spec_hash(spec))

    def compiler(self) -> Any:
        """The vocabulary's xgrammar compiler, made on first use (thread-safe; slow once)."""
        with self._compiler_lock:
            return self._new_compiler() if self._compiler is None else self._compiler

    def _new_compiler(self) -> Any:
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


def spec_hash(spec: StructuredOutputs) -> bytes:
    """A spec's key in the failure cache (a hash: a failed 64 KiB schema is not kept)."""
    return hashlib.sha256(msgspec.json.encode(spec)).digest()


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
