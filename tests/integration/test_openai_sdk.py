"""The official OpenAI SDK against the live gateway: sync and async, streaming and not."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import openai
import pytest

from tests.integration.conftest import USER_KEY, LiveGateway

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(gateway: LiveGateway) -> Iterator[openai.OpenAI]:
    # Closed here: one left to the garbage collector may leave its socket to warn later.
    with openai.OpenAI(base_url=gateway.v1, api_key=USER_KEY, max_retries=0) as c:
        yield c


@pytest.fixture
async def aclient(gateway: LiveGateway) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=gateway.v1, api_key=USER_KEY, max_retries=0) as c:
        yield c


def test_models_list_has_base_and_every_route(client: openai.OpenAI, base_model: str) -> None:
    models = {m.id: m for m in client.models.list()}
    assert base_model in models and "base" in models
    for name in ("shout", "loud", "json", "bullets", "concise", "brief"):
        assert name in models, name
        assert models[name].model_extra["parent"] == base_model  # type: ignore[index]
    assert models[base_model].model_extra["parent"] is None  # type: ignore[index]
    assert models["shout"].model_extra["kind"] == "lora"  # type: ignore[index]
    assert models["concise"].model_extra["kind"] == "preset"  # type: ignore[index]
    assert client.models.retrieve("shout").id == "shout"


def test_chat_non_streaming(client: openai.OpenAI, base_model: str) -> None:
    r = client.chat.completions.create(model=base_model, messages=QUESTION, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    assert r.object == "chat.completion"
    assert r.model == base_model
    assert r.id.startswith("chatcmpl-")
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage is not None and r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_stream_equals_non_stream_when_greedy(client: openai.OpenAI, base_model: str) -> None:
    kwargs = dict(model=base_model, messages=QUESTION, max_tokens=16, temperature=0)
    whole = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)  # type: ignore[call-overload]
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # really streamed
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_max_completion_tokens_and_stop(client: openai.OpenAI, base_model: str) -> None:
    r = client.chat.completions.create(
        model=base_model, messages=QUESTION, max_completion_tokens=3, temperature=0
    )  # type: ignore[arg-type]
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"  # type: ignore[union-attr]
    full = client.chat.completions.create(model=base_model, messages=QUESTION, max_tokens=20, temperature=0)  # type: ignore[arg-type]
    word = (full.choices[0].message.content or "").split()[1]
    cut = client.chat.completions.create(
        model=base_model, messages=QUESTION, max_tokens=20, temperature=0, stop=[word]
    )  # type: ignore[arg-type]
    assert word not in (cut.choices[0].message.content or "")
    assert cut.choices[0].finish_reason == "stop"


def test_n_seed_and_logprobs(client: openai.OpenAI, base_model: str) -> None:
    kwargs = dict(
        model=base_model,
        messages=QUESTION,
        max_tokens=8,
        temperature=1.0,
        seed=123,
        n=2,
        logprobs=True,
        top_logprobs=2,
    )
    a = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    b = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    lp = a.choices[0].logprobs
    assert lp is not None and lp.content and len(lp.content[0].top_logprobs) == 2
    assert all(t.logprob <= 0 for t in lp.content)


def test_greedy_n_answers_every_choice_as_openai_does(client: openai.OpenAI, base_model: str) -> None:
    """vLLM's server refuses n > 1 at temperature 0; OpenAI answers with n choices."""
    r = client.chat.completions.create(model=base_model, messages=QUESTION, max_tokens=8, temperature=0, n=3)
    one = client.chat.completions.create(model=base_model, messages=QUESTION, max_tokens=8, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert {c.message.content for c in r.choices} == {one.choices[0].message.content}
    assert r.usage is not None and one.usage is not None
    assert r.usage.prompt_tokens == one.usage.prompt_tokens
    assert r.usage.completion_tokens == 3 * one.usage.completion_tokens
    chunks = list(
        client.chat.completions.create(
            model=base_model, messages=QUESTION, max_tokens=8, temperature=0, n=2, stream=True
        )
    )
    texts = ["", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [one.choices[0].message.content] * 2


def test_penalties_and_user_are_accepted(client: openai.OpenAI, base_model: str) -> None:
    r = client.chat.completions.create(
        model=base_model,
        messages=QUESTION,
        max_tokens=4,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        user="u-1",
        top_p=0.9,  # type: ignore[arg-type]
    )
    assert r.choices[0].message.content is not None


def test_completions(client: openai.OpenAI, base_model: str) -> None:
    r = client.completions.create(
        model=base_model, prompt="The capital of France is", max_tokens=8, temperature=0, logprobs=1
    )
    assert r.object == "text_completion"
    assert r.choices[0].text.strip()
    assert (
        r.choices[0].logprobs is not None
        and len(r.choices[0].logprobs.tokens or []) == r.usage.completion_tokens
    )  # type: ignore[union-attr]
    chunks = list(
        client.completions.create(
            model=base_model, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


def test_a_repeated_long_prompt_reports_cached_tokens(client: openai.OpenAI, base_model: str) -> None:
    """The engine's prefix cache (on by default; 128-token blocks on CPU, only whole blocks
    are shared) serves a prompt seen before: usage says how many of its tokens it read there.
    The prompt opens with text of its own, so its first sending finds nothing cached."""
    text = f"{uuid.uuid4()}: " + " ".join(
        f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(40)
    )
    messages = [{"role": "user", "content": text}]
    first = client.chat.completions.create(model=base_model, messages=messages, max_tokens=1)  # type: ignore[arg-type]
    second = client.chat.completions.create(model=base_model, messages=messages, max_tokens=1)  # type: ignore[arg-type]
    assert first.usage is not None and first.usage.prompt_tokens > 256
    assert first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert 0 < (second.usage.prompt_tokens_details.cached_tokens or 0) <= second.usage.prompt_tokens
    # The Responses API renders the same conversation: its first sending finds it cached.
    response = client.responses.create(model=base_model, input=text, max_output_tokens=1, store=False)
    assert response.usage is not None and response.usage.input_tokens_details.cached_tokens > 0


async def test_async_client_streaming_and_not(aclient: openai.AsyncOpenAI, base_model: str) -> None:
    whole = await aclient.chat.completions.create(
        model=base_model, messages=QUESTION, max_tokens=10, temperature=0
    )  # type: ignore[arg-type]
    stream = await aclient.chat.completions.create(
        model=base_model, messages=QUESTION, max_tokens=10, temperature=0, stream=True
    )  # type: ignore[arg-type]
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == whole.choices[0].message.content
    models = [m.id async for m in aclient.models.list()]
    assert base_model in models
    await aclient.close()


def test_unknown_model_is_404_model_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-adapter", messages=QUESTION)  # type: ignore[arg-type]
    assert info.value.status_code == 404
    assert info.value.code == "model_not_found"
    assert info.value.body["param"] == "model"  # type: ignore[index]


def test_unknown_task_is_404(client: openai.OpenAI, base_model: str) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model=base_model, messages=QUESTION, extra_body={"task": "nope"})  # type: ignore[arg-type]
    assert info.value.code == "model_not_found"


def test_bad_input_is_400_with_param(client: openai.OpenAI, base_model: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=base_model, messages=QUESTION, temperature=5)  # type: ignore[arg-type]
    assert info.value.body["param"] == "temperature"  # type: ignore[index]
    assert info.value.body["type"] == "invalid_request_error"  # type: ignore[index]


def test_context_length_exceeded(client: openai.OpenAI, base_model: str) -> None:
    long = [{"role": "user", "content": "word " * 5000}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=base_model, messages=long)  # type: ignore[arg-type]
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=base_model, messages=QUESTION, max_tokens=100_000)  # type: ignore[arg-type]
    assert info.value.code == "context_length_exceeded"
