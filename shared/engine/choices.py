"""A request's further choices (``SamplingOptions.n`` > 1) forked from its first sequence (pure
over the block manager and the KV pool).

Once choice 0's prompt KV is computed (its prefill, or the remote prefill it was admitted
with), each other choice becomes a sequence of its own that shares the prompt's blocks: the
blocks before the one holding the last prompt token by reference (ref counts), that block as
a private copy, and the last prompt token left to compute, so the choice's first step computes
one token and samples its first token from the same logits choice 0's came from. The prompt is
thus prefilled once; each choice then decodes (and may be preempted, or finish) on its own.
``ChoiceGroups`` keeps an engine's requests whose choices run, from the fork to the last one's end.
"""

from __future__ import annotations

from collections.abc import Container, Mapping

from kvmesh.shared.engine.block_manager import BlockManager
from kvmesh.shared.engine.sequence import Sequence
from kvmesh.shared.kv.kv_cache import KVPool


def choice_id(request_id: str, index: int) -> str:
    """The engine's id of a choice's sequence (choice 0 is the request's own)."""
    return request_id if index == 0 else f"{request_id}#{index}"


def can_fork(parent: Sequence, block_manager: BlockManager) -> bool:
    """Whether the private blocks of ``parent.params.n - 1`` choices can be had now."""
    return parent.params.n - 1 <= block_manager.num_free_blocks


def fork(parent: Sequence, index: int, block_manager: BlockManager, kv_pool: KVPool) -> Sequence:
    """Choice ``index`` of ``parent``'s request over ``parent``'s prompt KV (see the module
    docstring); ``can_fork`` first."""
    n = parent.num_prompt_tokens
    assert parent.index == 0 and parent.num_computed_tokens >= n and index > 0
    last = (n - 1) // block_manager.block_size  # the block holding the last prompt token
    shared = parent.block_table[:last]
    child = Sequence(
        choice_id(parent.request_id, index),
        parent.token_ids[:n],
        parent.params,
        choice_of=parent.request_id,
        index=index,
    )
    block_manager.share(shared)
    (private,) = block_manager.allocate_blocks(1)
    kv_pool.block_bytes_view(private).copy_(kv_pool.block_bytes_view(parent.block_table[last]))
    child.block_table = [*shared, private]
    child.block_hashes = parent.block_hashes[:last]
    child.num_hashed_blocks = min(parent.num_hashed_blocks, last)
    child.num_computed_tokens = n - 1
    return child


class ChoiceGroups:
    """The requests whose further choices were forked: request id -> its n, while a choice of it
    is among the engine's sequences."""

    def __init__(self) -> None:
        self.num_choices: dict[str, int] = {}

    def start(self, seq: Sequence) -> bool:
        """Whether ``seq`` is choice 0 of a request with n > 1 that has just got its first token
        and not forked yet: then its group is kept from now on and the caller forks."""
        n = seq.params.n
        if n == 1 or seq.index or seq.num_output_tokens != 1 or seq.request_id in self.num_choices:
            return False
        self.num_choices[seq.request_id] = n
        return True

    def others(self, request_id: str, seqs: Mapping[str, Sequence]) -> list[Sequence]:
        """The request's choices after choice 0 still in ``seqs``."""
        return [
            seqs[sid]
            for i in range(1, self.num_choices.get(request_id, 1))
            if (sid := choice_id(request_id, i)) in seqs
        ]

    def ended(self, request_id: str, seqs: Container[str]) -> None:
        """A choice of the request has ended: forget the group once none is in ``seqs``."""
        if request_id in self.num_choices and not any(
            choice_id(request_id, i) in seqs for i in range(self.num_choices[request_id])
        ):
            del self.num_choices[request_id]
