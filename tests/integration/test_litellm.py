"""LiteLLM (the ``litellm`` Python SDK, not its proxy) on the live gateway, as its users point it
at an OpenAI-compatible server: ``model="openai/<route>"``, ``api_base=<gateway>/v1`` and the key.

Chat (plain, streamed, async, ``n``, structured, tools), ``text_completion`` on
``/v1/completions``, the Responses API (``litellm.responses``: plain, streamed, stored and
continued, tools) and the exceptions litellm maps the gateway's OpenAI errors to. Endpoints the
gateway does not serve (embeddings) must be a 404 that litellm maps, not a 500."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.integration.conftest import SINGLE_KEY, USER_KEY, LiveGateway

# litellm fetches its model cost map from GitHub at import; the tests run offline.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
import litellm  # noqa: E402

# litellm's own warnings, none about what the gateway sends (pytest makes warnings errors):
# pydantic on its TypedDicts' ReadOnly items and on its access to instance model_fields, its
# Responses usage object when it logs a streamed response, and an event loop it leaves open
# for its async logging of a sync call.
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*using the `ReadOnly` qualifier:UserWarning"),
    pytest.mark.filterwarnings("ignore:Accessing the 'model_.*' attribute on the instance is deprecated"),
    pytest.mark.filterwarnings("ignore:Pydantic serializer warnings:UserWarning"),
    pytest.mark.filterwarnings("ignore:unclosed event loop:ResourceWarning"),
]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER_PARAMS},
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# A call of get_weather, forced by name (the base model always makes it).
NAMED_CALL: dict[str, Any] = {
    "messages": ASK_WEATHER,
    "tools": [WEATHER],
    "tool_choice": NAMED,
    "max_tokens": 60,
    "temperature": 0,
}
CAPITAL = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "enum": ["France", "Italy", "Spain"]},
    },
    "required": ["city", "country"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def kw(gateway: LiveGateway) -> dict[str, Any]:
    """How a litellm user reaches an OpenAI-compatible server; no retries, so errors show."""
    return {"api_base": gateway.v1, "api_key": USER_KEY, "num_retries": 0, "max_retries": 0}


@pytest.fixture(scope="module")
def base(base_model: str) -> str:
    return f"openai/{base_model}"


def text_of(chunks: list[Any]) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


# -- chat ------------------------------------------------------------------------------------
def test_completion(kw: dict[str, Any], base: str, base_model: str) -> None:
    r = litellm.completion(model=base, messages=QUESTION, max_tokens=12, temperature=0, **kw)
    assert isinstance(r, litellm.ModelResponse)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.model == base_model
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert 0 < r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_stream_reassembles_to_the_whole_answer_with_usage(kw: dict[str, Any], base: str) -> None:
    args: dict[str, Any] = dict(model=base, messages=QUESTION, max_tokens=16, temperature=0, **kw)
    whole = litellm.completion(**args)
    chunks = list(litellm.completion(stream=True, stream_options={"include_usage": True}, **args))
    assert text_of(chunks) == whole.choices[0].message.content
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # really streamed
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    usage = [u for c in chunks if (u := getattr(c, "usage", None)) is not None]
    assert usage and usage[-1].completion_tokens == whole.usage.completion_tokens
    assert usage[-1].prompt_tokens == whole.usage.prompt_tokens
    built = litellm.stream_chunk_builder(chunks, messages=QUESTION)
    assert built.choices[0].message.content == whole.choices[0].message.content
    assert built.usage.completion_tokens == whole.usage.completion_tokens


def test_async_completion_and_stream(kw: dict[str, Any], base: str) -> None:
    async def both() -> tuple[Any, str]:
        args: dict[str, Any] = dict(model=base, messages=QUESTION, max_tokens=10, temperature=0, **kw)
        whole = await litellm.acompletion(**args)
        stream = await litellm.acompletion(stream=True, **args)
        return whole, text_of([c async for c in stream])

    whole, streamed = asyncio.run(both())
    assert whole.choices[0].message.content and streamed == whole.choices[0].message.content


@pytest.mark.parametrize("model", ["shout", "loud"])  # the route and an alias of it
def test_an_adapter_route_by_model_name(kw: dict[str, Any], model: str) -> None:
    r = litellm.completion(model=f"openai/{model}", messages=QUESTION, max_tokens=24, **kw)
    assert r.model == "shout"
    text = r.choices[0].message.content or ""
    assert any(ch.isalpha() for ch in text) and text == text.upper()  # the adapter shouts


def test_a_route_by_task_in_extra_body(kw: dict[str, Any], base: str) -> None:
    r = litellm.completion(
        model=base, messages=QUESTION, max_tokens=24, extra_body={"task": "shouting"}, **kw
    )
    assert r.model == "shout"


def test_n_choices_are_indexed_and_seeded(kw: dict[str, Any], base: str) -> None:
    args: dict[str, Any] = dict(
        model=base, messages=QUESTION, max_tokens=6, temperature=1.0, seed=7, n=2, **kw
    )
    a, b = litellm.completion(**args), litellm.completion(**args)
    assert [c.index for c in a.choices] == [0, 1]
    assert all(c.message.content and c.finish_reason in ("stop", "length") for c in a.choices)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.usage.completion_tokens <= 12


# -- structured outputs ----------------------------------------------------------------------
def test_response_format_json_schema_parses_and_validates(kw: dict[str, Any], base: str) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "capital", "schema": CAPITAL, "strict": True}}
    ask = [{"role": "user", "content": "The capital of France, as JSON:"}]
    r = litellm.completion(model=base, messages=ask, response_format=fmt, max_tokens=80, temperature=0, **kw)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), CAPITAL)


def test_response_format_pydantic_model(kw: dict[str, Any], base: str) -> None:
    """litellm turns a pydantic class into a strict ``json_schema`` format, as the openai SDK."""

    class Capital(BaseModel):
        city: str = Field(max_length=20)
        country: str = Field(max_length=20)

    ask = [{"role": "user", "content": "The capital of France, as JSON:"}]
    r = litellm.completion(
        model=base, messages=ask, response_format=Capital, max_tokens=80, temperature=0, **kw
    )
    assert r.choices[0].finish_reason == "stop"
    assert Capital.model_validate_json(r.choices[0].message.content).city


def test_an_enforcing_route_refuses_another_schema(kw: dict[str, Any]) -> None:
    class Other(BaseModel):
        count: int

    with pytest.raises(litellm.BadRequestError) as info:
        litellm.completion(model="openai/json", messages=QUESTION, response_format=Other, **kw)
    assert info.value.status_code == 400 and "enforces its own response format" in str(info.value)


# -- tools -----------------------------------------------------------------------------------
def valid_args(call: Any) -> dict[str, Any]:
    assert isinstance(call, litellm.ChatCompletionMessageToolCall)
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER_PARAMS)
    return args  # type: ignore[no-any-return]


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_forced_tool_calls_parse_into_litellm_objects(
    kw: dict[str, Any], base: str, tool_choice: Any
) -> None:
    r = litellm.completion(
        model=base,
        messages=ASK_WEATHER,
        tools=[WEATHER],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
        **kw,
    )
    choice = r.choices[0]
    # litellm turns "stop" with calls into "tool_calls": the gateway's "stop" for a named function too
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert valid_args(call)["city"]


def test_streamed_tool_call_assembles(kw: dict[str, Any], base: str) -> None:
    args = {"model": base, **NAMED_CALL, **kw}
    whole = litellm.completion(**args)
    chunks = list(litellm.completion(stream=True, stream_options={"include_usage": True}, **args))
    fragments = [
        tc.function.arguments for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()
    ]
    assert len([f for f in fragments if f]) > 1  # the arguments streamed as generated
    built = litellm.stream_chunk_builder(chunks, messages=ASK_WEATHER)
    assert built.choices[0].finish_reason == "tool_calls"  # litellm's, from the gateway's "stop" (named)
    (call,) = built.choices[0].message.tool_calls
    assert valid_args(call) == json.loads(whole.choices[0].message.tool_calls[0].function.arguments)


def test_tool_round_trip_with_litellms_message_in_the_history(kw: dict[str, Any], base: str) -> None:
    first = litellm.completion(model=base, **NAMED_CALL, **kw)
    message = first.choices[0].message  # litellm's Message, sent back as users do
    (call,) = message.tool_calls
    result = {"role": "tool", "tool_call_id": call.id, "name": "get_weather", "content": "22 C and sunny"}
    second = litellm.completion(
        model=base,
        messages=[*ASK_WEATHER, message, result],
        tools=[WEATHER],
        max_tokens=16,
        temperature=0,
        **kw,
    )
    assert second.choices[0].message.content or second.choices[0].message.tool_calls
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result are in the prompt


def test_a_parallel_call_left_unanswered_is_a_400(kw: dict[str, Any], base: str) -> None:
    """Two calls, one tool result: OpenAI's 400. The gateway answered as if the second call had
    not been made (it checked only calls followed by another turn)."""
    calls = [
        {
            "id": f"call_{k}",
            "type": "function",
            "function": {"name": "get_weather", "arguments": f'{{"city": "{c}"}}'},
        }
        for k, c in ((1, "Paris"), (2, "Rome"))
    ]
    messages = [
        *ASK_WEATHER,
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
    ]
    with pytest.raises(litellm.BadRequestError) as info:
        litellm.completion(model=base, messages=messages, tools=[WEATHER], max_tokens=8, **kw)
    assert "unanswered: call_2" in str(info.value)


# -- /v1/completions -------------------------------------------------------------------------
def test_text_completion(kw: dict[str, Any], base: str, base_model: str) -> None:
    args: dict[str, Any] = dict(
        model=base, prompt="The capital of France is", max_tokens=8, temperature=0, **kw
    )
    r = litellm.text_completion(**args)
    assert isinstance(r, litellm.TextCompletionResponse)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == base_model
    assert r.choices[0].text.strip() and r.choices[0].finish_reason in ("stop", "length")
    assert 0 < r.usage.completion_tokens <= 8
    streamed = list(litellm.text_completion(stream=True, **args))
    assert "".join(c.choices[0].text or "" for c in streamed if c.choices) == r.choices[0].text
    two = litellm.text_completion(**{**args, "prompt": ["The capital of France is", "One, two,"]})
    assert [c.index for c in two.choices] == [0, 1] and two.choices[0].text == r.choices[0].text


# -- not served ------------------------------------------------------------------------------
def test_embeddings_are_a_404_not_a_500(kw: dict[str, Any], base: str) -> None:
    with pytest.raises(litellm.NotFoundError) as info:
        litellm.embedding(model=base, input=["hello"], **kw)
    assert info.value.status_code == 404 and "/v1/embeddings" in str(info.value)


# -- errors ----------------------------------------------------------------------------------
def test_unknown_model_is_not_found(kw: dict[str, Any]) -> None:
    with pytest.raises(litellm.NotFoundError) as info:
        litellm.completion(model="openai/no-such-route", messages=QUESTION, **kw)
    assert info.value.status_code == 404 and "no-such-route" in str(info.value)


def test_a_bad_parameter_is_a_bad_request(kw: dict[str, Any], base: str) -> None:
    with pytest.raises(litellm.BadRequestError) as info:
        litellm.completion(model=base, messages=QUESTION, temperature=5, **kw)
    assert info.value.status_code == 400 and "temperature" in str(info.value)


def test_a_bad_key_is_an_authentication_error(gateway: LiveGateway, base: str) -> None:
    with pytest.raises(litellm.AuthenticationError) as info:
        litellm.completion(
            model=base,
            messages=QUESTION,
            api_base=gateway.v1,
            api_key="sk-wrong",
            num_retries=0,
            max_retries=0,
        )
    assert info.value.status_code == 401


def test_a_too_long_prompt_is_context_window_exceeded(kw: dict[str, Any], base: str) -> None:
    """litellm reads OpenAI's wording to raise ContextWindowExceededError (its
    ``context_window_fallbacks`` key on it)."""
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(
            model=base, messages=[{"role": "user", "content": "hello " * 3000}], max_tokens=4, **kw
        )


def test_over_the_keys_concurrency_is_a_rate_limit_error(gateway: LiveGateway, base: str) -> None:
    """The key allows one request in flight: of three sent together, the others are 429s."""
    args: dict[str, Any] = dict(
        model=base,
        messages=QUESTION,
        max_tokens=40,
        api_base=gateway.v1,
        api_key=SINGLE_KEY,
        num_retries=0,
        max_retries=0,
    )

    async def three() -> list[Any]:
        return await asyncio.gather(*(litellm.acompletion(**args) for _ in range(3)), return_exceptions=True)

    results = asyncio.run(three())
    assert sum(isinstance(r, litellm.ModelResponse) for r in results) >= 1
    limited = [r for r in results if isinstance(r, litellm.RateLimitError)]
    assert limited and all(r.status_code == 429 for r in limited)
    assert all(isinstance(r, litellm.ModelResponse | litellm.RateLimitError) for r in results)


# -- the Responses API -----------------------------------------------------------------------
def test_responses_plain(kw: dict[str, Any]) -> None:
    r = litellm.responses(
        model="openai/shout", input="Hi!", instructions="Be brief.", max_output_tokens=64, **kw
    )
    assert r.object == "response" and r.model == "shout" and r.status == "completed"
    text = r.output[0].content[0].text
    assert any(ch.isalpha() for ch in text) and text == text.upper()
    assert r.usage.output_tokens > 0 and r.instructions == "Be brief."


def test_responses_stream(kw: dict[str, Any]) -> None:
    """litellm fakes the stream (one whole request, cut in pieces) for a model its cost map
    does not say streams natively; registered, it streams the gateway's events."""
    litellm.register_model(
        {
            "openai/shout": {
                "litellm_provider": "openai",
                "mode": "responses",
                "supports_native_streaming": True,
            }
        }
    )
    events = list(
        litellm.responses(model="openai/shout", input="Hi!", max_output_tokens=64, stream=True, **kw)
    )
    types = [str(getattr(e.type, "value", e.type)) for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    deltas = [e.delta for e, t in zip(events, types, strict=True) if t == "response.output_text.delta"]
    assert len(deltas) > 1
    final = events[-1].response
    assert "".join(deltas) == final.output[0].content[0].text
    assert final.status == "completed" and final.usage.output_tokens > 0


def test_responses_store_and_continue(kw: dict[str, Any], base: str) -> None:
    first = litellm.responses(model="openai/shout", input="Hi!", max_output_tokens=32, temperature=0, **kw)
    second = litellm.responses(
        model=base, input="And then?", previous_response_id=first.id, max_output_tokens=16, **kw
    )
    assert second.status in ("completed", "incomplete") and second.output
    # the first turn, question and answer, is in the second's prompt
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    got = litellm.get_responses(response_id=first.id, custom_llm_provider="openai", **kw)
    assert got.output[0].content[0].text == first.output[0].content[0].text
    items = litellm.list_input_items(response_id=first.id, custom_llm_provider="openai", **kw)
    assert [i["content"][0]["text"] for i in items["data"]] == ["Hi!"]
    deleted = litellm.delete_responses(response_id=first.id, custom_llm_provider="openai", **kw)
    assert deleted.deleted is True
    with pytest.raises(litellm.NotFoundError):
        litellm.get_responses(response_id=first.id, custom_llm_provider="openai", **kw)
    with pytest.raises(litellm.BadRequestError) as info:
        litellm.responses(model=base, input="More", previous_response_id=first.id, **kw)
    assert "previous_response_not_found" in str(info.value)


def test_responses_function_call_round_trip(kw: dict[str, Any], base: str) -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMS, "strict": True}
    first = litellm.responses(
        model=base,
        input="What is the weather in Paris?",
        tools=[tool],
        tool_choice="required",
        max_output_tokens=60,
        temperature=0,
        **kw,
    )
    calls = [o for o in first.output if getattr(o, "type", None) == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls)
    if first.status == "completed":
        for c in calls:
            jsonschema.validate(json.loads(c.arguments), WEATHER_PARAMS)
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "22 C"} for c in calls]
    if len(calls) > 1:  # every call needs its output (OpenAI's 400 otherwise)
        with pytest.raises(litellm.BadRequestError) as info:
            litellm.responses(
                model=base, input=outputs[:1], previous_response_id=first.id, tools=[tool], **kw
            )
        assert "No tool output found for function call" in str(info.value)
    second = litellm.responses(
        model=base, input=outputs, previous_response_id=first.id, tools=[tool], max_output_tokens=16, **kw
    )
    assert second.status in ("completed", "incomplete") and second.output
    assert second.usage.input_tokens > first.usage.input_tokens


def test_responses_a_call_without_output_is_a_400(kw: dict[str, Any], base: str) -> None:
    calls = [
        {
            "type": "function_call",
            "call_id": f"call_{k}",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        }
        for k in (1, 2)
    ]
    output = {"type": "function_call_output", "call_id": "call_1", "output": "22 C"}
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMS}
    with pytest.raises(litellm.BadRequestError) as info:
        litellm.responses(
            model=base, input=[{"role": "user", "content": "Weather?"}, *calls, output], tools=[tool], **kw
        )
    assert "No tool output found for function call call_2." in str(info.value)
