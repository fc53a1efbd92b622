"""Ported from vLLM's tests/entrypoints/openai/chat_completion/test_chat.py: the structured
output cases. Not ported: test_structured_outputs_json_chat, test_response_format_json_object
and test_response_format_json_schema, which check what a particular model answers
(``{"result": 2}``, two different names); tests/integration/test_structured.py covers the
shapes on this model."""

from __future__ import annotations

import re
from typing import Any

import openai

from tests.conformance.conftest import BASE, refused

CHOICES = ["Python", "Java", "JavaScript", "C++", "C#", "PHP", "TypeScript", "Ruby", "Swift", "Kotlin"]
IP_REGEX = r"((25[0-5]|(2[0-4]|1\d|[1-9]|)\d)\.){3}(25[0-5]|(2[0-4]|1\d|[1-9]|)\d)"
LANGUAGE = [
    {"role": "system", "content": "you are a helpful assistant"},
    {"role": "user", "content": "The best language for type-safe systems programming is "},
]


async def test_structured_outputs_choice_chat(client: openai.AsyncOpenAI) -> None:
    """vLLM chat_completion/test_chat.py::test_structured_outputs_choice_chat, without its
    last check (that the model picks another language when told it disagrees: what a
    model answers, not what the server does)."""
    messages: list[Any] = list(LANGUAGE)
    body = {"structured_outputs": {"choice": CHOICES}}
    r = await client.chat.completions.create(
        model=BASE, messages=messages, max_completion_tokens=10, temperature=0.7, extra_body=body
    )
    first = r.choices[0].message.content
    assert first in CHOICES
    messages += [
        {"role": "assistant", "content": first},
        {"role": "user", "content": "I disagree, pick another one"},
    ]
    r = await client.chat.completions.create(
        model=BASE, messages=messages, max_completion_tokens=10, temperature=0.7, extra_body=body
    )
    assert r.choices[0].message.content in CHOICES


async def test_structured_outputs_regex_chat(client: openai.AsyncOpenAI) -> None:
    """vLLM chat_completion/test_chat.py::test_structured_outputs_regex_chat, without its last
    check (that the model gives a different address when asked: model behaviour)."""
    messages: list[Any] = [
        {"role": "system", "content": "you are a helpful assistant"},
        {"role": "user", "content": f"Give an example IP address with this regex: {IP_REGEX}"},
    ]
    body = {"structured_outputs": {"regex": IP_REGEX}}
    r = await client.chat.completions.create(
        model=BASE, messages=messages, max_completion_tokens=20, extra_body=body
    )
    ip1 = r.choices[0].message.content
    assert ip1 is not None and re.fullmatch(IP_REGEX, ip1) is not None
    messages += [
        {"role": "assistant", "content": ip1},
        {"role": "user", "content": "Give me a different one"},
    ]
    r = await client.chat.completions.create(
        model=BASE, messages=messages, max_completion_tokens=20, extra_body=body
    )
    ip2 = r.choices[0].message.content
    assert ip2 is not None and re.fullmatch(IP_REGEX, ip2) is not None


async def test_structured_outputs_type_error(client: openai.AsyncOpenAI) -> None:
    """vLLM chat_completion/test_chat.py::test_structured_outputs_type_error"""
    await refused(
        client.chat.completions.create(
            model=BASE,
            messages=LANGUAGE,
            max_completion_tokens=5,
            extra_body={"structured_outputs": {"regex": {1: "Python", 2: "C++"}}},
        )
    )


async def test_structured_outputs_choice_chat_logprobs(client: openai.AsyncOpenAI) -> None:
    """vLLM chat_completion/test_chat.py::test_structured_outputs_choice_chat_logprobs"""
    r = await client.chat.completions.create(
        model=BASE,
        messages=LANGUAGE,
        max_completion_tokens=10,
        logprobs=True,
        top_logprobs=5,
        extra_body={"structured_outputs": {"choice": CHOICES}},
    )
    logprobs = r.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert len(logprobs.content[0].top_logprobs) == 5
    for item in logprobs.content[0].top_logprobs:
        assert item.logprob >= -9999.0  # OpenAI's floor


async def test_response_format_text(client: openai.AsyncOpenAI) -> None:
    """vLLM chat_completion/test_chat.py::test_response_format_text"""
    for _ in range(2):
        r = await client.chat.completions.create(
            model=BASE,
            messages=[{"role": "user", "content": "what is 1+1?"}],
            max_completion_tokens=10,
            response_format={"type": "text"},
        )
        assert r.choices[0].message.content is not None
