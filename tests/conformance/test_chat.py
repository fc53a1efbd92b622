"""Ported from vLLM's tests/entrypoints/openai/chat_completion/test_chat.py (chat completions
on the base model and a LoRA adapter); its structured-output cases are in
test_chat_structured.py."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import openai
import pytest

from tests.conformance.conftest import BASE, MODELS, prompt_tokens, refused
from tests.integration.conftest import LiveGateway

SYSTEM_11 = [
    {"role": "system", "content": "you are a helpful assistant"},
    {"role": "user", "content": "what is 1+1?"},
]
HISTORY = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Who won the world series in 2020?"},
    {"role": "assistant", "content": "The Los Angeles Dodgers won the World Series in 2020."},
    {"role": "user", "content": "Where was it played?"},
]


@pytest.mark.parametrize("model_name", MODELS)
async def test_no_logprobs_chat(client: openai.AsyncOpenAI, model_name: str) -> None:
    """vLLM chat_completion/test_chat.py::test_no_logprobs_chat"""
    r = await client.chat.completions.create(
        model=model_name, messages=SYSTEM_11, max_completion_tokens=5, temperature=0.0, logprobs=False
    )
    assert r.choices[0].logprobs is None


@pytest.mark.parametrize("model_name", MODELS)
async def test_zero_logprobs_chat(client: openai.AsyncOpenAI, model_name: str) -> None:
    """vLLM chat_completion/test_chat.py::test_zero_logprobs_chat"""
    r = await client.chat.completions.create(
        model=model_name,
        messages=SYSTEM_11,
        max_completion_tokens=5,
        temperature=0.0,
        logprobs=True,
        top_logprobs=0,
    )
    logprobs = r.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert len(logprobs.content[0].top_logprobs) == 0


@pytest.mark.parametrize("model_name", MODELS)
async def test_some_logprobs_chat(client: openai.AsyncOpenAI, model_name: str) -> None:
    """vLLM chat_completion/test_chat.py::test_some_logprobs_chat"""
    r = await client.chat.completions.create(
        model=model_name,
        messages=SYSTEM_11,
        max_completion_tokens=5,
        temperature=0.0,
        logprobs=True,
        top_logprobs=5,
    )
    logprobs = r.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert len(logprobs.content[0].top_logprobs) == 5


@pytest.mark.parametrize("model_name", MODELS)
async def test_too_many_chat_logprobs(client: openai.AsyncOpenAI, model_name: str) -> None:
    """vLLM chat_completion/test_chat.py::test_too_many_chat_logprobs (max_logprobs is 20 in
    both). The gateway refuses the streamed request with a 400 before the stream starts."""
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        stream = await client.chat.completions.create(
            model=model_name,
            messages=SYSTEM_11,
            max_completion_tokens=10,
            logprobs=True,
            top_logprobs=21,
            stream=True,
        )
        async for _ in stream:
            pass
    await refused(
        client.chat.completions.create(
            model=model_name, messages=SYSTEM_11, max_completion_tokens=10, logprobs=True, top_logprobs=30
        )
    )
    r = await client.chat.completions.create(model=model_name, messages=SYSTEM_11, max_completion_tokens=10)
    assert r.choices[0].message.content is not None


@pytest.mark.parametrize("prompt_logprobs", [1, 0, -1, None])
async def test_prompt_logprobs_chat(client: openai.AsyncOpenAI, prompt_logprobs: int | None) -> None:
    """vLLM chat_completion/test_chat.py::test_prompt_logprobs_chat. Difference: vLLM's
    ``prompt_logprobs`` is not implemented, so any value is a 400 naming it (vLLM refuses
    only -1); without it the response has no ``prompt_logprobs``, as in vLLM."""
    if prompt_logprobs is None:
        r = await client.chat.completions.create(model=BASE, messages=HISTORY, max_completion_tokens=5)
        assert getattr(r, "prompt_logprobs", None) is None
        return
    await refused(
        client.chat.completions.create(
            model=BASE,
            messages=HISTORY,
            max_completion_tokens=5,
            extra_body={"prompt_logprobs": prompt_logprobs},
        ),
        "prompt_logprobs",
    )


async def test_more_than_one_prompt_logprobs_chat(client: openai.AsyncOpenAI) -> None:
    """vLLM chat_completion/test_chat.py::test_more_than_one_prompt_logprobs_chat. Difference:
    ``prompt_logprobs`` is refused (400), for 1 and 2 alike."""
    for n in (1, 2):
        await refused(
            client.chat.completions.create(
                model=BASE, messages=HISTORY, max_completion_tokens=5, extra_body={"prompt_logprobs": n}
            ),
            "prompt_logprobs",
        )


@pytest.mark.parametrize("model_name", MODELS)
async def test_single_chat_session(client: openai.AsyncOpenAI, gateway: LiveGateway, model_name: str) -> None:
    """vLLM chat_completion/test_chat.py::test_single_chat_session (prompt_tokens from our
    tokenizer instead of vLLM's hard-coded 37; ``min_tokens`` 5, so that the small base
    model, sampled at temperature 1, cannot end its turn before the 5-token limit)."""
    messages: list[Any] = list(SYSTEM_11)
    r = await client.chat.completions.create(
        model=model_name,
        messages=messages,
        max_completion_tokens=5,
        logprobs=True,
        top_logprobs=5,
        extra_body={"min_tokens": 5},
    )
    assert r.id is not None and len(r.choices) == 1
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    expected = prompt_tokens(gateway, model_name, messages=messages)
    assert r.usage is not None
    assert (r.usage.completion_tokens, r.usage.prompt_tokens, r.usage.total_tokens) == (
        5,
        expected,
        expected + 5,
    )
    assert choice.message.content is not None and len(choice.message.content) >= 5
    assert choice.message.role == "assistant"
    messages.append({"role": "assistant", "content": choice.message.content})
    messages.append({"role": "user", "content": "express your result in json"})
    r = await client.chat.completions.create(model=model_name, messages=messages, max_completion_tokens=5)
    assert r.choices[0].message.content is not None


@pytest.mark.parametrize("model_name", MODELS)
async def test_chat_streaming(client: openai.AsyncOpenAI, model_name: str) -> None:
    """vLLM chat_completion/test_chat.py::test_chat_streaming"""
    whole = await client.chat.completions.create(
        model=model_name, messages=SYSTEM_11, max_completion_tokens=10, temperature=0.0
    )
    output, finish_reason = whole.choices[0].message.content, whole.choices[0].finish_reason
    stream = await client.chat.completions.create(
        model=model_name, messages=SYSTEM_11, max_completion_tokens=10, temperature=0.0, stream=True
    )
    chunks: list[str] = []
    finish_reasons = 0
    async for chunk in stream:
        delta = chunk.choices[0].delta
        if delta.role:
            assert delta.role == "assistant"
        if delta.content:
            chunks.append(delta.content)
        if chunk.choices[0].finish_reason is not None:
            finish_reasons += 1
    assert finish_reasons == 1  # only in the last chunk
    assert chunk.choices[0].finish_reason == finish_reason
    assert delta.content
    assert "".join(chunks) == output


@pytest.mark.parametrize("model_name", MODELS)
async def test_chat_completion_stream_options(client: openai.AsyncOpenAI, model_name: str) -> None:
    """vLLM chat_completion/test_chat.py::test_chat_completion_stream_options. Differences:
    ``continuous_usage_stats: true`` and vLLM's ``min_characters`` are refused (400)."""
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    common: dict[str, Any] = {
        "model": model_name,
        "messages": messages,
        "max_completion_tokens": 10,
        "temperature": 0.0,
    }
    stream = await client.chat.completions.create(
        **common, stream=True, stream_options={"include_usage": False}
    )
    async for chunk in stream:
        assert chunk.usage is None

    stream = await client.chat.completions.create(
        **common, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": False}
    )
    usage_chunks = 0
    async for chunk in stream:
        assert chunk.usage is None
        if chunk.choices[0].finish_reason is not None:
            final = await anext(stream)
            assert final.usage is not None
            assert final.usage.prompt_tokens > 0 and final.usage.completion_tokens > 0
            assert final.usage.total_tokens == final.usage.prompt_tokens + final.usage.completion_tokens
            assert final.choices == []
            usage_chunks += 1
    assert usage_chunks == 1  # a finish_reason came, and the usage chunk after it

    for options in ({"include_usage": None}, {"include_usage": True}):
        await refused(client.chat.completions.create(**common, stream=False, stream_options=options))  # type: ignore[call-overload]

    await refused(
        client.chat.completions.create(
            **common,
            extra_body={"min_tokens": 10},
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        ),
        "stream_options.continuous_usage_stats",
    )
    await refused(
        client.chat.completions.create(
            **common, extra_body={"min_characters": 10}, stream=True, stream_options={"include_usage": False}
        ),
        "min_characters",
    )


async def test_extra_fields_allowed(client: openai.AsyncOpenAI) -> None:
    """vLLM chat_completion/test_chat.py::test_extra_fields_allowed (an unknown field in a
    message is ignored)"""
    r = await client.chat.completions.create(
        model=BASE,
        messages=[{"role": "user", "content": "what is 1+1?", "extra_field": "0"}],  # type: ignore[misc, list-item]
        temperature=0,
        seed=0,
        max_completion_tokens=5,
    )
    assert r.choices[0].message.content is not None


async def test_complex_message_content(client: openai.AsyncOpenAI) -> None:
    """vLLM chat_completion/test_chat.py::test_complex_message_content. vLLM checks its
    model's answer ("2"); model-agnostic here: a list of text parts gets, at temperature 0,
    the same answer as the same text as a string."""
    text = "what is 1+1? please provide the result without any other text."
    answers = []
    for content in ([{"type": "text", "text": text}], text):
        r = await client.chat.completions.create(
            model=BASE,
            messages=[{"role": "user", "content": content}],  # type: ignore[misc, list-item]
            temperature=0,
            seed=0,
            max_completion_tokens=8,
        )
        answers.append(r.choices[0].message.content)
    assert answers[0] is not None and answers[0] == answers[1]


async def test_custom_role(client: openai.AsyncOpenAI) -> None:
    """vLLM chat_completion/test_chat.py::test_custom_role. Difference: roles other than
    system, developer, user, assistant and tool are refused (400 on ``messages``), as
    OpenAI does; vLLM passes them to the chat template."""
    for content in ("what is 1+1?", [{"type": "text", "text": "what is 1+1?"}]):
        error = await refused(
            client.chat.completions.create(
                model=BASE,
                messages=[{"role": "my-custom-role", "content": content}],  # type: ignore[misc, list-item]
                temperature=0,
                seed=0,
            )
        )
        assert error.param is not None and error.param.startswith("messages")


async def test_long_seed(client: openai.AsyncOpenAI) -> None:
    """vLLM chat_completion/test_chat.py::test_long_seed (a seed outside a signed 64-bit
    integer is a 400 naming ``seed``)."""
    for seed in (-(2**63) - 1, 2**63):
        await refused(
            client.chat.completions.create(
                model=BASE,
                messages=[{"role": "system", "content": "You are a helpful assistant."}],
                temperature=0,
                seed=seed,
            ),
            "seed",
        )


async def test_invocations(gateway: LiveGateway) -> None:
    """vLLM chat_completion/test_chat.py::test_invocations. Difference: the gateway has no
    SageMaker-style ``POST /invocations`` (404); use ``/v1/chat/completions``."""
    with gateway.client() as http:
        r = http.post("/invocations", json={"model": BASE, "messages": SYSTEM_11, "max_completion_tokens": 5})
    assert r.status_code == 404
    assert r.json()["error"]["type"]


async def test_chat_completion_n_parameter_non_streaming(client: openai.AsyncOpenAI) -> None:
    """vLLM chat_completion/test_chat.py::test_chat_completion_n_parameter_non_streaming"""
    r = await client.chat.completions.create(
        model=BASE,
        messages=[
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the opposite of big?"},
        ],
        max_completion_tokens=20,
        temperature=0.7,
        n=3,
    )
    assert len(r.choices) == 3
    for i, choice in enumerate(r.choices):
        assert choice.index == i
        assert choice.message.content
    assert len({c.message.content for c in r.choices}) > 1


async def test_chat_completion_n_parameter_streaming(client: openai.AsyncOpenAI) -> None:
    """vLLM chat_completion/test_chat.py::test_chat_completion_n_parameter_streaming"""
    stream = await client.chat.completions.create(
        model=BASE,
        messages=[
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        max_completion_tokens=15,
        temperature=0.7,
        n=2,
        stream=True,
    )
    texts: defaultdict[int, list[str]] = defaultdict(list)
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                texts[choice.index].append(choice.delta.content)
    assert "".join(texts[0]) and "".join(texts[1])


async def test_chat_completion_n_with_seed(client: openai.AsyncOpenAI) -> None:
    """vLLM chat_completion/test_chat.py::test_chat_completion_n_with_seed"""
    r = await client.chat.completions.create(
        model=BASE,
        messages=[{"role": "user", "content": "Say hello."}],
        max_completion_tokens=10,
        temperature=0.8,
        n=2,
        seed=42,
    )
    assert len(r.choices) == 2
    for i, choice in enumerate(r.choices):
        assert choice.index == i and choice.message.content


async def test_chat_completion_n_equals_1(client: openai.AsyncOpenAI) -> None:
    """vLLM chat_completion/test_chat.py::test_chat_completion_n_equals_1"""
    r = await client.chat.completions.create(
        model=BASE,
        messages=[{"role": "user", "content": "Hello!"}],
        max_completion_tokens=10,
        temperature=0.7,
        n=1,
    )
    assert len(r.choices) == 1 and r.choices[0].index == 0
    assert r.choices[0].message.content is not None
