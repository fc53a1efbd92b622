"""``ReadAhead``: an engine stream read to its end while its consumer stalls."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from gateway.errors import EngineFailed
from gateway.read_ahead import ReadAhead
from gateway.types import Chunk, StepOutput, TokenLogprob


async def engine(steps: list[StepOutput], fail: bool = False) -> AsyncIterator[StepOutput]:
    for step in steps:
        await asyncio.sleep(0)
        yield step
    if fail:
        raise EngineFailed("the engine failed to process the request")


def step(texts: list[str], finished: bool = False) -> StepOutput:
    chunks = [
        Chunk(i, t, 1, "length" if finished else None, [TokenLogprob(t, -1.0)]) for i, t in enumerate(texts)
    ]
    return StepOutput(chunks, 3, finished, [TokenLogprob("p", None)] if texts[0] == "a" else None)


async def test_steps_not_taken_are_merged_by_choice_and_the_end_is_seen_at_once() -> None:
    ended = asyncio.Event()
    ahead = ReadAhead(engine([step(["a", "x"]), step(["b", "y"]), step(["c", "z"], True)]), ended.set)
    await asyncio.wait_for(ended.wait(), 1)  # nothing taken yet: the engine is done all the same
    merged = [s async for s in ahead]
    assert len(merged) == 1 and merged[0].finished and merged[0].prompt_logprobs is not None
    assert [(c.index, c.text, c.num_tokens, c.finish_reason) for c in merged[0].chunks] == [
        (0, "abc", 3, "length"),
        (1, "xyz", 3, "length"),
    ]
    assert [t.token for t in merged[0].chunks[1].logprobs or []] == ["x", "y", "z"]


async def test_merged_steps_keep_the_cached_prompt_tokens() -> None:
    """A merged step carries the count of the last step in it: behind ``merge_steps`` (several
    prompts of a LoRA request) the count grows as each prompt's first step arrives."""
    steps = [step(["a"]), step(["b"]), step(["c"], True)]
    for s, cached in zip(steps, (0, 2, 6), strict=True):
        s.cached_tokens = cached
    ended = asyncio.Event()
    ahead = ReadAhead(engine(steps), ended.set)
    await asyncio.wait_for(ended.wait(), 1)
    merged = [s async for s in ahead]
    assert len(merged) == 1 and merged[0].cached_tokens == 6


async def test_an_engine_error_comes_after_the_steps_before_it() -> None:
    ahead = ReadAhead(engine([step(["a"])], fail=True), lambda: None)
    await asyncio.sleep(0.01)
    assert (await ahead.__anext__()).chunks[0].text == "a"
    with pytest.raises(EngineFailed):
        await ahead.__anext__()


async def test_close_stops_the_reading_and_on_end_never_runs() -> None:
    ended: list[bool] = []
    gate = asyncio.Event()

    async def held() -> AsyncIterator[StepOutput]:
        yield step(["a"])
        await gate.wait()
        yield step(["b"], True)

    ahead = ReadAhead(held(), lambda: ended.append(True))
    await ahead.__anext__()
    ahead.close()
    gate.set()
    await asyncio.sleep(0.01)
    assert ended == []


async def test_a_long_stalled_stream_with_logprobs_is_merged_in_linear_time() -> None:
    """A reader that stalls for a whole answer with logprobs: each step's logprobs were
    appended by copying all those merged before (quadratic: 60k tokens took seconds of event
    loop, in steps that grow as the answer does). Appending in place keeps it linear."""
    n = 60_000

    async def tokens() -> AsyncIterator[StepOutput]:
        for i in range(n):
            yield StepOutput([Chunk(0, "a", 1, None, [TokenLogprob("a", -1.0)])], 3, i == n - 1)

    ended = asyncio.Event()
    started = time.perf_counter()
    ahead = ReadAhead(tokens(), ended.set)
    await asyncio.wait_for(ended.wait(), 10)
    [merged] = [s async for s in ahead]
    assert len(merged.chunks[0].logprobs or []) == n and merged.chunks[0].num_tokens == n
    assert time.perf_counter() - started < 2.0  # linear: ~0.2 s; quadratic: ~7 s


@pytest.mark.parametrize("burst", [False, True])
async def test_a_consumer_that_keeps_up_takes_every_step_on_its_own(burst: bool) -> None:
    """Steps arriving as the engine makes them (one per loop turn or slower) are handed on
    one by one: a reader that keeps up sees the engine's steps, not merged ones. Also steps
    the engine has ready at once (``burst``): the reader lets the consumer take each."""
    queue: asyncio.Queue[StepOutput] = asyncio.Queue()

    async def engine_steps() -> AsyncIterator[StepOutput]:
        while True:
            item = await queue.get()
            yield item
            if item.finished:
                return

    ahead = ReadAhead(engine_steps(), lambda: None)
    taken: list[str] = []

    async def consume() -> None:
        async for s in ahead:
            taken.append(s.chunks[0].text)

    consumer = asyncio.create_task(consume())
    await asyncio.sleep(0.001)  # the consumer waits for its first step
    for i in range(20):
        queue.put_nowait(StepOutput([Chunk(0, str(i), 1)], 3, i == 19))
        if not burst:
            await asyncio.sleep(0.001)
    await asyncio.wait_for(consumer, 5)
    assert taken == [str(i) for i in range(20)]
