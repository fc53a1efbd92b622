"""An engine stream read to its end however slowly its consumer takes the steps.

vLLM runs a request to its end whatever the client does, and keeps the output a slow
reader has not taken yet (merged). A consumer that pulls steps only as fast as its client
reads (a stream blocked on a full TCP window) would learn that the engine has finished only
once the client had read all before it; whatever the gateway holds for "in the engine"
(a LoRA request's adapter turn) would be held that long, and other adapters kept waiting.

``ReadAhead`` reads the stream in a task of its own and calls ``on_end`` as soon as the
engine's last step arrives, or the stream fails (the engine is done with it then too).
Steps the consumer has not taken yet are merged into one, by choice, as vLLM merges its
deltas, so a stalled reader costs its output's text, not an object per token.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from gateway.types import Chunk, StepOutput

_JOIN_EVERY = 256  # text pieces of a choice kept before they are joined into one


class _Choice:
    __slots__ = ("finish_reason", "index", "logprobs", "num_tokens", "texts")

    def __init__(self, chunk: Chunk) -> None:
        self.index = chunk.index
        self.texts = [chunk.text]
        self.num_tokens = chunk.num_tokens
        self.finish_reason = chunk.finish_reason
        self.logprobs = None if chunk.logprobs is None else list(chunk.logprobs)

    def add(self, chunk: Chunk) -> None:
        self.texts.append(chunk.text)
        if len(self.texts) >= _JOIN_EVERY:
            self.texts = ["".join(self.texts)]
        self.num_tokens += chunk.num_tokens
        self.finish_reason = chunk.finish_reason or self.finish_reason
        if chunk.logprobs is not None:  # in place: a copy per step is quadratic in the answer
            if self.logprobs is None:
                self.logprobs = list(chunk.logprobs)
            else:
                self.logprobs.extend(chunk.logprobs)

    def chunk(self) -> Chunk:
        return Chunk(self.index, "".join(self.texts), self.num_tokens, self.finish_reason, self.logprobs)


class _Merged:
    """Steps not taken yet, as one."""

    def __init__(self, step: StepOutput) -> None:
        self.first = step  # the usual case: one step, handed on as it is
        self.choices: dict[int, _Choice] | None = None
        self.prompt_tokens = step.prompt_tokens
        self.cached_tokens = step.cached_tokens
        self.finished = step.finished

    def add(self, step: StepOutput) -> None:
        if self.choices is None:
            self.choices = {}
            self._add_chunks(self.first)
        self._add_chunks(step)
        self.prompt_tokens = step.prompt_tokens
        self.cached_tokens = step.cached_tokens
        self.finished = step.finished

    def _add_chunks(self, step: StepOutput) -> None:
        assert self.choices is not None
        for chunk in step.chunks:
            choice = self.choices.get(chunk.index)
            if choice is None:
                self.choices[chunk.index] = _Choice(chunk)
            else:
                choice.add(chunk)

    def step(self) -> StepOutput:
        if self.choices is None:
            return self.first
        chunks = [c.chunk() for c in self.choices.values()]
        return StepOutput(
            chunks, self.prompt_tokens, self.finished, self.first.prompt_logprobs, self.cached_tokens
        )


class ReadAhead:
    """``stream``'s steps, read ahead by a task; ``on_end`` runs once the engine's last step
    (``finished``) has arrived, taken or not, or once the stream has failed (its error is
    raised to the consumer after the steps before it). ``close`` (however the consumer stops)
    cancels the reading: a request cut short is the caller's to abort."""

    def __init__(self, stream: AsyncIterator[StepOutput], on_end: Callable[[], None]) -> None:
        self._pending: _Merged | None = None
        self._error: BaseException | None = None
        self._done = False
        self._taker: asyncio.Future[None] | None = None  # set while the consumer waits for a step
        self._task = asyncio.ensure_future(self._read(stream, on_end))

    async def _read(self, stream: AsyncIterator[StepOutput], on_end: Callable[[], None]) -> None:
        ended = False
        try:
            async for step in stream:
                if self._pending is None:
                    self._pending = _Merged(step)
                else:
                    self._pending.add(step)
                if step.finished:
                    self._wake()
                    ended = True
                    on_end()
                elif self._wake():  # a consumer that keeps up takes the steps one by one
                    await asyncio.sleep(0)
        except Exception as exc:  # the consumer raises it, after the steps before it
            self._error = exc
            if not ended:  # a stream that failed is over in the engine: a stalled reader holds nothing
                on_end()
        finally:
            self._done = True
            self._wake()

    def _wake(self) -> bool:
        """Hand the waiting consumer its step; False if none waited."""
        taker, self._taker = self._taker, None
        if taker is None or taker.done():
            return False
        taker.set_result(None)
        return True

    def __aiter__(self) -> ReadAhead:
        return self

    async def __anext__(self) -> StepOutput:
        while self._pending is None:
            if self._done:
                if self._error is not None:
                    raise self._error
                raise StopAsyncIteration
            self._taker = asyncio.get_running_loop().create_future()
            await self._taker
        pending, self._pending = self._pending, None
        return pending.step()

    def close(self) -> None:
        self._task.cancel()
