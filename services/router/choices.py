"""The choices of one response as their tokens arrive from the mesh (pure).

A ``Choice`` turns its TokenEvents into client text (``TextStream``: detokenized, stop strings
cut or kept), keeps its token ids and log-probabilities, and knows when it is done: a finish
reason from the mesh, or a stop string the router saw first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.services.router.logprobs import LogprobsBuilder
from kvmesh.services.router.responses import ChoiceResult, Logprobs
from kvmesh.shared.bus.messages.token_streams import TokenEvent
from kvmesh.shared.text.detokenize import TextStream
from kvmesh.shared.text.sampling import SamplingOptions, TokenLogprobs
from kvmesh.shared.text.tokenizer import Tokenizer
from kvmesh.shared.text.tool_calls import CallDelta, ToolCallStream, ToolFormat, parse


@dataclass(slots=True)
class Choice:
    index: int
    output: TextStream
    logprobs: LogprobsBuilder | None  # None: the request asked for none
    token_ids: list[int] = field(default_factory=list)
    token_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    # completions' echo: the prompt leads the text (and the logprobs, once scored)
    echo_text: str | None = None
    prompt_ids: tuple[int, ...] = ()
    prompt_scored: list[TokenLogprobs] | None = None  # the mesh's prompt logprobs (tokens 1..)
    is_echoed: bool = False  # the prompt went out (in a stream's first chunk)
    tool_calls: ToolCallStream | None = None  # chat with tools: how its text is read

    @property
    def api_finish_reason(self) -> str | None:
        """The finish reason a streamed choice ends with: "tool_calls" when it made calls."""
        if self.finish_reason == "stop" and self.tool_calls and self.tool_calls.num_calls:
            return "tool_calls"
        return self.finish_reason

    def tool_deltas(self, text: str) -> list[str | CallDelta]:
        """A streamed chat's new ``text`` read for tool calls: text and call deltas (the rest
        once the choice is done)."""
        assert self.tool_calls is not None
        deltas = self.tool_calls.add(text)
        return deltas + self.tool_calls.finish() if self.is_done else deltas

    @classmethod
    def new(
        cls,
        index: int,
        tokenizer: Tokenizer,
        prompt_ids: tuple[int, ...],
        sampling: SamplingOptions,
        is_chat: bool,
        echo_text: str | None = None,
        tool_format: ToolFormat | None = None,
    ) -> Choice:
        output = TextStream(
            tokenizer, prompt_ids, sampling.stop, sampling.include_stop_str_in_output
        )
        wants = sampling.logprobs is not None
        builder = LogprobsBuilder(tokenizer, is_chat) if wants else None
        # a one-token prompt has nothing to score: no message will carry its (empty) scores
        scored: list[TokenLogprobs] | None = [] if len(prompt_ids) == 1 else None
        return cls(
            index,
            output,
            builder,
            echo_text=echo_text,
            prompt_ids=prompt_ids,
            prompt_scored=scored,
            tool_calls=ToolCallStream(tool_format) if tool_format is not None else None,
        )

    @property
    def is_done(self) -> bool:
        return self.finish_reason is not None

    def add(self, event: TokenEvent) -> tuple[str, Logprobs | None]:
        """The event's new text and, when asked for, its tokens' logprobs (for a stream's
        chunk). Sets ``finish_reason`` when the event ends the choice, or a stop string does."""
        assert not self.is_done, self.index
        text = self.output.add(event.token_ids)
        self.token_ids += event.token_ids
        chunk_logprobs = None
        if self.logprobs is not None and event.token_ids:
            if len(event.logprobs) != len(event.token_ids):
                raise ValueError(
                    f"the mesh sent {len(event.logprobs)} logprobs for {len(event.token_ids)} "
                    "tokens"
                )
            self.token_logprobs += event.logprobs
            ids, lps = list(event.token_ids), list(event.logprobs)
            if self.echo_text is not None and not self.is_echoed:
                ids, lps = [*self.prompt_ids, *ids], [*self._prompt_logprobs(), *lps]
            chunk_logprobs = self.logprobs.build(ids, lps)
        if self.echo_text is not None and not self.is_echoed:
            text, self.is_echoed = self.echo_text + text, True
        if self.output.is_stopped:
            self.finish_reason = "stop"
        elif event.finish_reason is not None:
            self.finish_reason = event.finish_reason
        return text, chunk_logprobs

    def result(self) -> ChoiceResult:
        """The finished choice, for a non-streamed answer."""
        assert self.finish_reason is not None
        self.output.finish()
        logprobs = None
        if self.logprobs is not None:
            self.logprobs.text_offset = 0
            ids: list[int] = list(self.token_ids)
            lps: list[TokenLogprobs | None] = list(self.token_logprobs)
            if self.echo_text is not None:
                ids, lps = [*self.prompt_ids, *ids], [*self._prompt_logprobs(), *lps]
            logprobs = self.logprobs.build(ids, lps)
        text = (self.echo_text or "") + self.output.text
        if self.tool_calls is None:
            return ChoiceResult(self.index, text, self.finish_reason, logprobs)
        parsed = parse(text, self.tool_calls.fmt)
        finish_reason = self.finish_reason
        if parsed.calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return ChoiceResult(self.index, parsed.content, finish_reason, logprobs, parsed.calls)

    def _prompt_logprobs(self) -> list[TokenLogprobs | None]:
        """The echoed prompt's logprobs: none for its first token, the mesh's for the rest."""
        if self.prompt_scored is None or len(self.prompt_scored) != len(self.prompt_ids) - 1:
            raise ValueError("the mesh sent no prompt logprobs for an echo with logprobs")
        return [None, *self.prompt_scored]
