"""The streaming clients of the fault drills (``fault_drill.py``) and what they saw: greedy
streamed completions of kvmesh-tiny, ``concurrency`` at a time, each one's text, error (an HTTP
error status, an SSE error event, a broken connection) and worst token gap, or None for one that
hung; ``tally`` counts them against the offline engine's texts."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

MODEL = "kvmesh-tiny"


@dataclass(slots=True)
class StreamOutcome:
    """What one streaming client saw."""

    text: str = ""
    error: str | None = None  # "503: ..." (a status) or "stream: ..." (an SSE error event)
    ended_at: float = 0.0
    worst_gap_s: float = 0.0  # between two token chunks
    num_chunks: int = 0  # token chunks (not the finish chunk)


def stream_body(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """A greedy streamed completion of ``prompt``, EOS ignored: every drill's request."""
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }


async def stream_completion(
    session: Any, url: str, prompt: list[int], max_tokens: int, under_way: asyncio.Event | None
) -> StreamOutcome:
    """One greedy streamed completion; sets ``under_way`` at its first token."""
    import aiohttp

    body = stream_body(prompt, max_tokens)
    out = StreamOutcome()
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                error = (await resp.json())["error"]
                out.error = f"{resp.status}: {error['message']}"
                return out
            last, done = None, False
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[len(b"data: ") :].strip()
                if payload == b"[DONE]":
                    done = True
                    continue
                event = orjson.loads(payload)
                if "error" in event:
                    out.error = f"stream: {event['error']['message']}"
                    continue
                choice = event["choices"][0]
                out.text += choice["text"]
                if choice["finish_reason"] is not None:
                    continue
                out.num_chunks += 1
                now = time.monotonic()
                if last is not None:
                    out.worst_gap_s = max(out.worst_gap_s, now - last)
                last = now
                if under_way is not None:
                    under_way.set()
            if not done and out.error is None:
                out.error = "stream: ended without [DONE]"
    except TimeoutError:
        raise  # hung: the caller counts it
    except (aiohttp.ClientError, OSError) as exc:  # the connection broke
        out.error = f"connection: {exc!r}"
    finally:
        out.ended_at = time.monotonic()
    return out


async def stream_load(
    url: str,
    prompts: list[list[int]],
    max_tokens: int,
    concurrency: int,
    under_way: asyncio.Event | None = None,
    hang_s: float = 120.0,
) -> list[StreamOutcome | None]:
    """Every prompt streamed, ``concurrency`` at a time; None for a stream still open after
    ``hang_s`` (hung)."""
    import aiohttp

    queue = list(range(len(prompts)))
    outcomes: list[StreamOutcome | None] = [None] * len(prompts)

    async def client(session: Any) -> None:
        while queue:
            i = queue.pop(0)
            with contextlib.suppress(TimeoutError):  # still open after hang_s: hung (None)
                outcomes[i] = await stream_completion(
                    session, url, prompts[i], max_tokens, under_way
                )

    timeout = aiohttp.ClientTimeout(total=hang_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        clients = [asyncio.create_task(client(session)) for _ in range(concurrency)]
        _, pending = await asyncio.wait(clients, timeout=hang_s * 2)
        for task in pending:
            task.cancel()
    return outcomes


@dataclass(slots=True)
class Tally:
    right: int = 0
    wrong: list[int] = field(default_factory=list)  # a 200 with other text: never acceptable
    errors: list[str] = field(default_factory=list)
    hung: int = 0

    @property
    def total(self) -> int:
        return self.right + len(self.wrong) + len(self.errors) + self.hung

    @property
    def right_share(self) -> float:
        return self.right / self.total if self.total else 0.0

    def summary(self) -> str:
        kinds: dict[str, int] = {}
        for error in self.errors:
            kinds[error[:90]] = kinds.get(error[:90], 0) + 1
        shown = "; ".join(f"{n}x {e}" for e, n in sorted(kinds.items(), key=lambda kv: -kv[1]))
        return (
            f"{self.right}/{self.total} right ({self.right_share:.1%}), {len(self.wrong)} wrong, "
            f"{len(self.errors)} clear errors, {self.hung} hung" + (f" [{shown}]" if shown else "")
        )


def tally(outcomes: list[StreamOutcome | None], expected: list[str]) -> Tally:
    result = Tally()
    for i, (out, text) in enumerate(zip(outcomes, expected, strict=True)):
        if out is None:
            result.hung += 1
        elif out.error is not None:
            result.errors.append(out.error)
        elif out.text == text:
            result.right += 1
        else:
            result.wrong.append(i)
    return result


def end_of(outcomes: list[StreamOutcome | None]) -> float:
    ends = [o.ended_at for o in outcomes if o is not None]
    return max(ends) if ends else time.monotonic()
