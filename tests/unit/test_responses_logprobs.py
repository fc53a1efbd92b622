"""``include: ["message.output_text.logprobs"]`` on ``/v1/responses``, through the openai SDK,
with a fake engine that reports a logprob for each word it generates (and ``k`` alternatives
when asked for ``k``): where the logprobs land in the Response and in its typed stream."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from gateway.types import LoraSpec, SamplingSpec, StepOutput, TokenLogprob
from tests.unit.test_responses_app import ReadyEngine, make_app, sdk
from tests.unit.test_responses_tools import CALL, WEATHER

LOGPROBS = ["message.output_text.logprobs"]


class LogprobEngine(ReadyEngine):
    """Word ``i`` has logprob ``-i - 0.5``; its alternatives ``alt<j>`` have ``-i - 1 - j``. A
    word given as ``""`` is a token with no text of its own (half of a character)."""

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingSpec,
        request_id: str,
        lora: LoraSpec | None,
        priority: int = 0,
    ) -> AsyncIterator[StepOutput]:
        i = 0
        async for step in super().generate(prompt_ids, sampling, request_id, lora, priority):
            if sampling.logprobs is not None:
                top = [(f"alt{j}", -i - 1.0 - j) for j in range(sampling.logprobs)]
                for chunk in step.chunks:
                    chunk.logprobs = [TokenLogprob(chunk.text or "\ufffd", -i - 0.5, top)]
            i += 1
            yield step


def app(words: list[str] | None = None) -> tuple[Any, LogprobEngine]:
    engine = LogprobEngine(words=words, max_model_len=1000)
    return make_app(engine), engine


def test_whole_response_carries_each_tokens_logprob_and_alternatives() -> None:
    http, engine = app()
    r = sdk(http).responses.create(model="base-model", input="Hi", include=LOGPROBS, top_logprobs=2)
    assert engine.calls[-1][1].logprobs == 2
    part = r.output[0].content[0]
    assert part.type == "output_text" and part.text == "Hello world!"
    assert part.logprobs is not None
    assert [(lp.token, lp.logprob) for lp in part.logprobs] == [
        ("Hello", -0.5),
        (" world", -1.5),
        ("!", -2.5),
    ]
    first = part.logprobs[0]
    assert first.bytes == list(b"Hello")
    assert [(t.token, t.logprob, t.bytes) for t in first.top_logprobs] == [
        ("alt0", -1.0, list(b"alt0")),
        ("alt1", -2.0, list(b"alt1")),
    ]
    assert r.top_logprobs == 2
    # stored as answered
    again = sdk(http).responses.retrieve(r.id).output[0].content[0]
    assert again.type == "output_text" and again.logprobs == part.logprobs


def test_include_without_top_logprobs_gives_the_chosen_tokens_only() -> None:
    http, engine = app()
    r = sdk(http).responses.create(model="base-model", input="Hi", include=LOGPROBS)
    assert engine.calls[-1][1].logprobs == 0
    part = r.output[0].content[0]
    assert part.type == "output_text" and part.logprobs is not None
    assert len(part.logprobs) == 3 and all(lp.top_logprobs == [] for lp in part.logprobs)


@pytest.mark.parametrize("fields", [{}, {"top_logprobs": 3}, {"include": ["reasoning.encrypted_content"]}])
def test_without_the_include_no_logprobs_are_asked_for(fields: dict[str, Any]) -> None:
    """As vLLM's server: ``top_logprobs`` is read only with the include."""
    http, engine = app()
    r = sdk(http).responses.create(model="base-model", input="Hi", **fields)
    assert engine.calls[-1][1].logprobs is None
    part = r.output[0].content[0]
    assert part.type == "output_text" and part.logprobs == []


def test_stream_puts_each_deltas_tokens_on_it_and_all_on_done() -> None:
    http, _ = app(["Hel", "", "lo", "!"])
    with sdk(http).responses.stream(
        model="base-model", input="Hi", include=LOGPROBS, top_logprobs=1
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert [d.delta for d in deltas] == ["Hel", "lo", "!"]
    # the textless token rides on the next delta
    assert [[lp.token for lp in d.logprobs] for d in deltas] == [["Hel"], ["\ufffd", "lo"], ["!"]]
    top = deltas[0].logprobs[0].top_logprobs
    assert top is not None and [(t.token, t.logprob) for t in top] == [("alt0", -1.0)]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert [lp.logprob for lp in done.logprobs] == [-0.5, -1.5, -2.5, -3.5]
    (part_done,) = [e for e in events if e.type == "response.content_part.done"]
    assert (
        part_done.part.type == "output_text"
        and part_done.part.logprobs == final.output[0].content[0].logprobs
    )
    streamed = final.output[0].content[0]
    assert streamed.type == "output_text" and streamed.logprobs is not None
    assert [lp.token for lp in streamed.logprobs] == ["Hel", "\ufffd", "lo", "!"]
    assert streamed.logprobs[2].bytes == list(b"lo")


def test_stream_without_the_include_has_empty_logprobs() -> None:
    http, engine = app()
    events = list(sdk(http).responses.create(model="base-model", input="Hi", stream=True))
    assert engine.calls[-1][1].logprobs is None
    for event in events:
        if event.type in ("response.output_text.delta", "response.output_text.done"):
            assert event.logprobs == []


@pytest.mark.parametrize("stream", [False, True])
def test_with_tools_a_text_answer_carries_them(stream: bool) -> None:
    http, _ = app(["Sunny", " today"])
    fields: Any = {"model": "base-model", "input": "Hi", "tools": [WEATHER], "include": LOGPROBS}
    if stream:
        with sdk(http).responses.stream(**fields) as s:
            events = list(s)
            r = s.get_final_response()
        deltas = [e for e in events if e.type == "response.output_text.delta"]
        assert [lp.token for d in deltas for lp in d.logprobs] == ["Sunny", " today"]
        (done,) = [e for e in events if e.type == "response.output_text.done"]
        assert len(done.logprobs) == 2
    else:
        r = sdk(http).responses.create(**fields)
    part = r.output[0].content[0]  # type: ignore[union-attr]
    assert part.type == "output_text" and part.logprobs is not None
    assert [lp.token for lp in part.logprobs] == ["Sunny", " today"]


@pytest.mark.parametrize("stream", [False, True])
def test_with_tools_a_call_alone_has_no_message_to_carry_them(stream: bool) -> None:
    """As vLLM's server: the logprobs go with the message; a call is not a message."""
    http, _ = app(CALL)
    fields: Any = {"model": "base-model", "input": "Hi", "tools": [WEATHER], "include": LOGPROBS}
    if stream:
        with sdk(http).responses.stream(**fields) as s:
            list(s)
            r = s.get_final_response()
    else:
        r = sdk(http).responses.create(**fields)
    assert [item.type for item in r.output] == ["function_call"]


def test_top_logprobs_above_20_is_a_400() -> None:
    http, _ = app()
    with pytest.raises(openai.BadRequestError) as err:
        sdk(http).responses.create(model="base-model", input="Hi", include=LOGPROBS, top_logprobs=21)
    assert err.value.body["param"] == "top_logprobs"  # type: ignore[index]
