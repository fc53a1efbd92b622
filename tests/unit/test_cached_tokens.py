"""The prompt tokens the engine read from its prefix cache (vLLM's ``num_cached_tokens``)
reach every usage the gateway reports: chat and completions ``usage.prompt_tokens_details``
(whole and as the stream's usage chunk), the Responses API's ``input_tokens_details``, the
access log and ``/metrics``. Read through the openai SDK's typed objects, as a client reads
them; the fake engine reports ``CACHED`` for each prompt."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx2
import jsonschema
import openai
import pytest
from openai.types import CompletionUsage

from gateway.openapi import build_document
from gateway.routes import PUBLIC_PATHS, ROUTES
from tests.helpers import chat_body, completion_body
from tests.unit.conftest import USER_KEY, Serve, Served
from tests.unit.fakes import FakeEngine

CACHED = 4
TOOLS: list[Any] = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
R_TOOLS: list[Any] = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]


@pytest.fixture
async def served(serve: Serve) -> Served:
    return await serve(FakeEngine(cached_tokens=CACHED, max_model_len=1000))


@pytest.fixture
async def client(served: Served) -> AsyncIterator[openai.AsyncOpenAI]:
    transport = httpx2.ASGITransport(app=served.app)
    async with httpx2.AsyncClient(transport=transport, base_url="http://gateway.test") as http:
        yield openai.AsyncOpenAI(
            base_url="http://gateway.test/v1", api_key=USER_KEY, http_client=http, max_retries=0
        )


def cached(usage: CompletionUsage | None) -> int | None:
    assert usage is not None and usage.prompt_tokens_details is not None
    return usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["plain", "tools"])
async def test_chat_usage_carries_the_cached_prompt_tokens(
    client: openai.AsyncOpenAI, tools: list[Any] | None
) -> None:
    offered: dict[str, Any] = {"tools": tools} if tools else {}
    messages: Any = chat_body("base")["messages"]
    whole = await client.chat.completions.create(model="base", messages=messages, **offered)
    assert cached(whole.usage) == CACHED
    chunks = await client.chat.completions.create(
        model="base", messages=messages, stream=True, stream_options={"include_usage": True}, **offered
    )
    usages = [chunk.usage async for chunk in chunks if chunk.usage is not None]
    assert len(usages) == 1 and cached(usages[0]) == CACHED


@pytest.mark.parametrize(
    ("prompt", "n", "expected"),
    [
        ("Hello", 1, CACHED),
        (["Hello", "World"], 1, 2 * CACHED),  # summed over the prompts, as prompt_tokens
        ("Hello", 2, CACHED),  # greedy n: a request per choice, the prompt counted once
        (["Hello", "World"], 2, 2 * CACHED),
    ],
)
async def test_completions_usage_carries_the_cached_prompt_tokens(
    client: openai.AsyncOpenAI, prompt: str | list[str], n: int, expected: int
) -> None:
    whole = await client.completions.create(model="base", prompt=prompt, n=n, temperature=0)
    assert cached(whole.usage) == expected
    chunks = await client.completions.create(
        model="base", prompt=prompt, n=n, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    usages = [chunk.usage async for chunk in chunks if chunk.usage is not None]
    assert len(usages) == 1 and cached(usages[0]) == expected


@pytest.mark.parametrize("tools", [None, R_TOOLS], ids=["plain", "tools"])
async def test_responses_usage_carries_the_cached_prompt_tokens(
    client: openai.AsyncOpenAI, tools: list[Any] | None
) -> None:
    offered: dict[str, Any] = {"tools": tools} if tools else {}
    whole = await client.responses.create(model="base", input="Hi", **offered)
    assert whole.usage is not None and whole.usage.input_tokens_details.cached_tokens == CACHED
    async with client.responses.stream(model="base", input="Hi", **offered) as stream:
        async for _ in stream:
            pass
        final = await stream.get_final_response()
    assert final.usage is not None and final.usage.input_tokens_details.cached_tokens == CACHED
    stored = await client.responses.retrieve(final.id)
    assert stored.usage is not None and stored.usage.input_tokens_details.cached_tokens == CACHED


async def test_none_cached_is_zero_not_left_out(serve: Serve) -> None:
    """OpenAI sends ``cached_tokens: 0`` on a miss: the field is always there."""
    served = await serve()
    r = await served.http.post("/v1/chat/completions", json=chat_body("base"))
    assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_the_access_log_and_metrics_count_them_by_route(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="gateway.access"):
        for _ in range(2):
            assert (
                await served.http.post("/v1/chat/completions", json=chat_body("shout"))
            ).status_code == 200
    access = [json.loads(r.getMessage()) for r in caplog.records if r.name == "gateway.access"]
    assert [line["cached_prompt_tokens"] for line in access] == [CACHED, CACHED]
    registry = served.gw.metrics.registry
    assert registry.get_sample_value("gateway_cached_prompt_tokens_total", {"route": "shout"}) == 2 * CACHED


@pytest.mark.parametrize(
    ("path", "body", "schema"),
    [
        ("/v1/chat/completions", chat_body("base"), "ChatCompletion"),
        ("/v1/completions", completion_body("base"), "Completion"),
        ("/v1/responses", {"model": "base", "input": "Hi"}, "Response"),
    ],
)
async def test_the_usage_sent_is_the_usage_documented(
    served: Served, path: str, body: dict[str, Any], schema: str
) -> None:
    components = build_document(ROUTES, PUBLIC_PATHS)["components"]
    documented = {**components["schemas"][schema], "components": components}
    answer = (await served.http.post(path, json=body)).json()
    jsonschema.validate(answer, documented)
    usage = answer["usage"]
    details = "input_tokens_details" if "input_tokens" in usage else "prompt_tokens_details"
    without = {k: v for k, v in usage.items() if k != details}
    for missing in ({**usage, details: {}}, without):  # the document names the cached count
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**answer, "usage": missing}, documented)
