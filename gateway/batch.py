"""Completions that are more than one engine stream: several prompts, and ``echo``.

``merge_steps`` runs one engine stream per prompt at once and interleaves their steps as
they come, with choice ``i`` of prompt ``p`` re-indexed ``p * n + i`` (as vLLM numbers
them); each step carries the prompt tokens read from the prefix cache so far, summed over
the prompts as their prompt tokens are. ``echo_steps`` puts the prompt (and its logprobs,
when asked for) in front of each choice's first chunk, as vLLM's completions ``echo``
does. A single prompt without echo uses neither: the engine's stream goes straight to the
encoder.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from gateway.types import StepOutput, TokenLogprob

_Item = StepOutput | BaseException | None


async def merge_steps(
    streams: list[AsyncIterator[StepOutput]], n: int, copies: int = 1
) -> AsyncIterator[StepOutput]:
    """One stream of the steps of ``streams`` (one per prompt, ``n`` choices each); the
    last step has ``finished`` set once every stream has finished. ``copies`` streams in a
    row are one prompt's (greedy choices, a request each): the prompt counts once, as in
    ``prompt_tokens``, with the fewest cached tokens any of its copies read."""
    queue: asyncio.Queue[tuple[int, _Item]] = asyncio.Queue()
    cached = [0] * len(streams)  # each stream's cached prompt tokens
    cached_total = 0

    async def pump(p: int, stream: AsyncIterator[StepOutput]) -> None:
        try:
            async for step in stream:
                queue.put_nowait((p, step))
            queue.put_nowait((p, None))
        except Exception as exc:  # the consumer raises it in order
            queue.put_nowait((p, exc))

    tasks = [asyncio.ensure_future(pump(p, s)) for p, s in enumerate(streams)]
    live, finished = len(streams), set()
    try:
        while live:
            p, item = await queue.get()
            if item is None:
                live -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            for chunk in item.chunks:
                chunk.index += p * n
            if item.finished:
                finished.add(p)
            if item.cached_tokens != cached[p]:  # a stream's first step, mostly
                cached[p] = item.cached_tokens
                cached_total = sum(min(cached[k : k + copies]) for k in range(0, len(cached), copies))
            done = len(finished) == len(streams)
            yield StepOutput(item.chunks, item.prompt_tokens, done, cached_tokens=cached_total)
    finally:
        for task in tasks:
            task.cancel()  # closes the engine streams left (each aborts its request)
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass(frozen=True, slots=True)
class Echo:
    """What to put before a prompt's completions: ``text`` (the prompt), ``first_token``
    (its first token as text: the engine gives no logprob, so no text, for it), and with
    ``prompt_only`` (``max_tokens: 0``) nothing after it (the engine made one token to drop)."""

    text: str
    first_token: str
    prompt_only: bool = False


async def echo_steps(stream: AsyncIterator[StepOutput], echo: Echo) -> AsyncIterator[StepOutput]:
    """``stream`` with the prompt before each choice's first chunk, and the prompt's
    logprobs before that chunk's logprobs."""
    echoed: set[int] = set()
    prompt_logprobs: list[TokenLogprob] | None = None
    async for step in stream:
        if prompt_logprobs is None and step.prompt_logprobs:
            prompt_logprobs = step.prompt_logprobs
            if prompt_logprobs[0].logprob is None:
                prompt_logprobs[0].token = echo.first_token
        for chunk in step.chunks:
            if echo.prompt_only:
                chunk.text, chunk.num_tokens = ("" if chunk.index in echoed else echo.text), 0
                if chunk.logprobs is not None:
                    chunk.logprobs = [] if chunk.index in echoed else list(prompt_logprobs or [])
            elif chunk.index not in echoed:
                chunk.text = echo.text + chunk.text
                if chunk.logprobs is not None and prompt_logprobs is not None:
                    chunk.logprobs = [*prompt_logprobs, *chunk.logprobs]
            echoed.add(chunk.index)
        yield step
