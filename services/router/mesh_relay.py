"""A request's token events from the mesh fed into its choices (choices.py) until every choice
is done, and out to the client as they come when it streams; the usage they add up to.

A stop string ends its choice here, in the router, before the mesh knows; once every choice is
done the rest of the request is aborted on the mesh.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import aclosing

from kvmesh.services.router.api import GenerateRequest
from kvmesh.services.router.choices import Choice
from kvmesh.services.router.errors import MeshError
from kvmesh.services.router.mesh_request import MeshRequest
from kvmesh.services.router.prompt import Prompt
from kvmesh.services.router.responses import Logprobs, Usage
from kvmesh.shared.text.tokenizer import Tokenizer

# a streamed choice's new text, how many tokens it holds, and their logprobs, sent as it comes
Send = Callable[[Choice, str, int, Logprobs | None], Awaitable[None]]


def new_choices(
    request: GenerateRequest, prompt: Prompt, tokenizer: Tokenizer, tool_parser: str
) -> list[Choice]:
    """The ``n`` choices of ``request``'s answer, none of their tokens in yet."""
    is_chat = request.kind == "chat"
    sampling = prompt.sampling
    echo_text = None
    if request.echo:
        echo_text = request.prompt_text
        if echo_text is None:
            echo_text = tokenizer.decode(prompt.prompt_ids)
    tool_format = request.tools.output_format(tool_parser) if request.tools else None
    return [
        Choice.new(i, tokenizer, prompt.prompt_ids, sampling, is_chat, echo_text, tool_format)
        for i in range(sampling.n)
    ]


def usage_of(prompt: Prompt, choices: list[Choice], mesh: MeshRequest) -> Usage:
    """The request's token counts, with the accepted drafts among the tokens the client got."""
    num_tokens = sum(choice.output.num_tokens for choice in choices)
    accepted = min(mesh.num_accepted_drafts, num_tokens)
    return Usage.of(len(prompt.prompt_ids), num_tokens, accepted)


async def relay(mesh: MeshRequest, choices: list[Choice], send: Send | None) -> None:
    """Feed the mesh's tokens into their choices (and out through ``send``, when streaming)
    until every choice is done."""
    async with aclosing(mesh.events()) as events:
        async for event in events:
            if event.index >= len(choices):
                raise MeshError(
                    f"a decode worker sent choice {event.index} of a request of {len(choices)}"
                )
            if event.prompt_logprobs:  # the prompt's, on choice 0's first event
                for c in choices:
                    c.prompt_scored = list(event.prompt_logprobs)
            choice = choices[event.index]
            if choice.is_done:  # a stop string the router saw first; the mesh ends it too
                continue
            try:
                text, logprobs = choice.add(event)
            except ValueError as exc:
                raise MeshError(f"a decode worker sent a malformed token event: {exc}") from None
            if send is not None:  # after a stop string: its last text only
                stopped = choice.output.is_stopped
                await send(choice, text, 0 if stopped else len(event.token_ids), logprobs)
            if all(c.is_done for c in choices):
                await mesh.abort("stop string")  # nothing to stop when the mesh finished them
                return
    raise AssertionError("events() ended before every choice finished")
