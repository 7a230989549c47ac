"""Driving an in-process engine to completion, drafts or not, as the engine tests do."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def new_tokens(outputs: Sequence[Any]) -> list[int]:
    """The tokens that ``outputs`` (one request's, in order) added."""
    return [t for o in outputs for t in o.new_token_ids]


def run_requests(
    eng: Any,
    prompts: list[list[int]],
    params: Any,
    drafter: Callable[[str, list[int]], Any] | None = None,
) -> list[list[Any]]:
    """Add ``prompts`` as requests r0, r1, ... (``params``: one for all, or a list, one each)
    and step ``eng`` until nothing is unfinished, asking ``drafter(request_id, its tokens so
    far)`` for a draft tree (or None) before every step. Checks that every block came back;
    returns each request's outputs, in order."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt, sp in zip(ids, prompts, params_list, strict=True):
        eng.add_request(rid, prompt, sp)
    outs: dict[str, list[Any]] = {rid: [] for rid in ids}
    while eng.has_unfinished():
        drafts = {}
        if drafter is not None:
            for rid in ids:
                tree = drafter(rid, new_tokens(outs[rid]))
                if tree is not None:
                    drafts[rid] = tree
        for out in eng.step(drafts):
            outs[out.request_id].append(out)
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_total_blocks
    return [outs[rid] for rid in ids]
