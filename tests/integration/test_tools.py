"""Tool calling against the live gateway with the real clients: the openai SDK (whole,
streamed, its stream helper with ``pydantic_function_tool``), instructor in TOOLS and
RESPONSES_TOOLS modes and LangChain (``with_structured_output`` and ``bind_tools`` with a
tool message round trip, over chat and over /v1/responses).

The embedded model is a 270M base model: forced calls (``required``, a named function) are
generated under a grammar, so their arguments must parse and validate whatever it writes;
``auto`` may or may not call a tool, so only the shape of the answer is judged there.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from pydantic import BaseModel

from tests.integration.conftest import USER_KEY, LiveGateway

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER_PARAMS},
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = {
    "id": "call_abc",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
}
ROUND_TRIP = [
    *ASK,
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_abc", "content": "18 degrees and sunny"},
]


class Weather(BaseModel):
    city: str
    unit: Literal["celsius", "fahrenheit"]


class Person(BaseModel):
    name: str
    country: str


@pytest.fixture(scope="module")
def client(gateway: LiveGateway) -> Iterator[openai.OpenAI]:
    # Closed here: one left to the garbage collector may leave its socket to warn later.
    with openai.OpenAI(base_url=gateway.v1, api_key=USER_KEY, max_retries=0) as c:
        yield c


def schema_of(name: str) -> dict[str, Any]:
    return next(t["function"]["parameters"] for t in (WEATHER, TIME) if t["function"]["name"] == name)  # type: ignore[index, no-any-return]


@pytest.mark.parametrize("model", ["base", "shout"])
def test_named_choice_arguments_parse_and_validate(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(
        model=model,
        messages=ASK,  # type: ignore[arg-type]
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60,
        temperature=0,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop"  # a forced function: OpenAI and vLLM say stop, not tool_calls
    assert choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)  # type: ignore[union-attr]


@pytest.mark.parametrize("model", ["base", "shout"])
def test_required_calls_parse_and_validate(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(
        model=model,
        messages=ASK,  # type: ignore[arg-type]
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    (call,) = choice.message.tool_calls or []  # parallel_tool_calls false: exactly one
    assert call.function.name in ("get_weather", "get_time")  # type: ignore[union-attr]
    jsonschema.validate(json.loads(call.function.arguments), schema_of(call.function.name))  # type: ignore[union-attr]


def test_raw_stream_deltas_are_openai_shaped(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="base",
        messages=ASK,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60,
        temperature=0,
        stream=True,
    )
    calls = [tc for chunk in stream for c in chunk.choices for tc in (c.delta.tool_calls or [])]
    first, rest = calls[0], calls[1:]
    assert first.index == 0 and first.id and first.type == "function"
    assert first.function.name == "get_weather" and first.function.arguments == ""  # type: ignore[union-attr]
    assert len(rest) > 1 and all(tc.id is None and tc.function.name is None for tc in rest)  # type: ignore[union-attr]
    arguments = "".join(tc.function.arguments or "" for tc in rest)  # type: ignore[union-attr]
    jsonschema.validate(json.loads(arguments), WEATHER_PARAMS)


def test_stream_helper_assembles_pydantic_function_tool(client: openai.OpenAI) -> None:
    tool = openai.pydantic_function_tool(Weather, name="get_weather")
    with client.chat.completions.stream(
        model="base",
        messages=ASK,  # type: ignore[arg-type]
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60,
        temperature=0,
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.delta" in kinds and "tool_calls.function.arguments.done" in kinds
    choice = final.choices[0]
    assert choice.finish_reason == "stop"  # forced, as above
    (call,) = choice.message.tool_calls or []
    assert isinstance(call.function.parsed_arguments, Weather)


def test_required_stream_helper(client: openai.OpenAI) -> None:
    with client.chat.completions.stream(
        model="shout",
        messages=ASK,  # type: ignore[arg-type]
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
    ) as stream:
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls or []
    assert final.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), schema_of(call.function.name))


def assert_valid_auto_answer(message: Any, finish_reason: str | None) -> None:
    """Either plain text or calls to offered tools with JSON-object arguments."""
    if message.tool_calls:
        assert finish_reason in ("tool_calls", "length")
        for call in message.tool_calls:
            assert call.function.name in ("get_weather", "get_time") and call.id
            assert isinstance(json.loads(call.function.arguments), dict)
    else:
        assert isinstance(message.content, str) and message.content
        assert finish_reason in ("stop", "length")


def test_required_calls_cut_short_are_calls_streamed_or_not(client: openai.OpenAI) -> None:
    """max_tokens ends the grammar's list (the base model writes call after call): the stream
    sends the calls so far, and so does the whole response (it was the raw JSON as content,
    which openai-agents' Runner took for the final answer, its tool never run)."""
    kw: dict[str, Any] = dict(
        model="base",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER, TIME],
        tool_choice="required",
        max_tokens=16,  # within the first call, or just past it
        temperature=0,
    )
    with client.chat.completions.stream(**kw) as stream:
        for _ in stream:
            pass
        streamed = stream.current_completion_snapshot.choices[0]
    whole = client.chat.completions.create(**kw).choices[0]
    assert streamed.finish_reason == whole.finish_reason == "length"
    assert whole.message.content == streamed.message.content
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []] == [
        (c.function.name, c.function.arguments) for c in streamed.message.tool_calls or []
    ]


def test_auto_tools_with_a_json_schema_answer_or_call(client: openai.OpenAI) -> None:
    """tool_choice auto and a response format (openai-agents' output_type with tools): the
    answer is a call or follows the schema; before, the schema's grammar left no room
    for a call."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    }
    for _ in range(2):
        r = client.chat.completions.create(
            model="base",
            messages=ASK,
            tools=[WEATHER, TIME],
            response_format={"type": "json_schema", "json_schema": {"name": "City", "schema": schema}},
            max_tokens=60,
            temperature=1.0,
        )
        msg = r.choices[0].message
        if msg.tool_calls:  # arguments are read as under auto without a format: a JSON object
            for call in msg.tool_calls:
                assert call.function.name in ("get_weather", "get_time")
                assert isinstance(json.loads(call.function.arguments), dict)
        elif r.choices[0].finish_reason == "stop":
            jsonschema.validate(json.loads(msg.content or ""), schema)


def test_strict_tools_with_a_json_schema_give_valid_calls_or_the_answer(client: openai.OpenAI) -> None:
    """Strict tools (openai-agents' default) under auto with a response format: a call's
    arguments were free, and the parser takes a strict call only if they validate, so most
    answers were call-shaped text that followed neither the tool nor the format."""
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "weather": {"type": "string", "maxLength": 20},
        },
        "required": ["city", "weather"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model="base",
        messages=ASK,
        tools=[strict],  # type: ignore[list-item]
        response_format={"type": "json_schema", "json_schema": {"name": "Report", "schema": schema}},
        max_tokens=120,
        temperature=1.0,
        n=6,
        seed=1,
    )
    finished = [c for c in r.choices if c.finish_reason in ("stop", "tool_calls")]
    assert len(finished) >= 4, [c.finish_reason for c in r.choices]
    for choice in finished:
        msg = choice.message
        if msg.tool_calls:
            for call in msg.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)  # type: ignore[union-attr]
        else:
            jsonschema.validate(json.loads(msg.content or ""), schema)


def test_a_strict_tool_the_grammar_cannot_hold_beside_a_format_is_served(client: openai.OpenAI) -> None:
    """pydantic's HttpUrl (``format: uri``), which xgrammar refuses, in a strict tool beside an
    output format (openai-agents with an output_type): the whole request was a 400 blamed on
    the format. Now the tool's arguments stay free and the answer is a call or the format."""
    fetch = {
        "type": "function",
        "function": {
            "name": "fetch",
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {"url": {"type": "string", "format": "uri", "minLength": 1, "maxLength": 30}},
                "required": ["url"],
                "additionalProperties": False,
            },
        },
    }
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string", "maxLength": 20}},
        "required": ["a"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model="base",
        messages=[{"role": "user", "content": "Fetch example.com"}],
        tools=[fetch],  # type: ignore[list-item]
        response_format={"type": "json_schema", "json_schema": {"name": "A", "schema": schema}},
        max_tokens=80,
        temperature=1.0,
        n=3,
        seed=2,
    )
    for choice in r.choices:
        if choice.message.tool_calls:
            assert isinstance(json.loads(choice.message.tool_calls[0].function.arguments), dict)  # type: ignore[union-attr]
        elif choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content or ""), schema)


def test_auto_answer_is_text_or_valid_calls(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model="base", messages=ASK, tools=[WEATHER, TIME], max_tokens=40, temperature=0)
    whole = client.chat.completions.create(**kw)
    assert_valid_auto_answer(whole.choices[0].message, whole.choices[0].finish_reason)
    # the SDK's stream accumulator (the helper's get_final_completion refuses a "length" answer)
    state: ChatCompletionStreamState[Any] = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(stream=True, **kw):
        state.handle_chunk(chunk)
    streamed = state.current_completion_snapshot.choices[0]
    assert_valid_auto_answer(streamed.message, streamed.finish_reason)
    # the same greedy answer, whole or streamed
    assert streamed.message.content == whole.choices[0].message.content
    assert [c.function.name for c in streamed.message.tool_calls or []] == [
        c.function.name  # type: ignore[union-attr]
        for c in whole.choices[0].message.tool_calls or []
    ]


@pytest.mark.parametrize("model", ["base", "shout"])
def test_tool_result_round_trip_gives_an_answer(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(
        model=model,
        messages=ROUND_TRIP,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="none",
        max_tokens=30,
        temperature=0,
    )
    choice = r.choices[0]
    assert choice.message.tool_calls is None
    assert choice.message.content and choice.finish_reason in ("stop", "length")
    auto = client.chat.completions.create(
        model=model, messages=ROUND_TRIP, tools=[WEATHER], max_tokens=30, temperature=0
    )  # type: ignore[arg-type, list-item]
    assert_valid_auto_answer(auto.choices[0].message, auto.choices[0].finish_reason)


@pytest.mark.parametrize("mode", ["TOOLS", "RESPONSES_TOOLS"])
def test_instructor_tools_mode_returns_the_model(gateway: LiveGateway, mode: str) -> None:
    """TOOLS over chat completions; RESPONSES_TOOLS over /v1/responses (function tools)."""
    import instructor

    with openai.OpenAI(base_url=gateway.v1, api_key=USER_KEY) as raw:
        inst = instructor.from_openai(raw, mode=instructor.Mode[mode])
        person = inst.chat.completions.create(
            model="base",
            response_model=Person,
            messages=[{"role": "user", "content": "Marie Curie was born in Poland. Extract the person."}],
            max_tokens=60,
            temperature=0,
            max_retries=0,
        )
        assert isinstance(person, Person) and person.name and person.country


def test_langchain_structured_output_function_calling(gateway: LiveGateway) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=gateway.v1, api_key=USER_KEY, model="base", max_tokens=60, temperature=0, max_retries=0
    )  # type: ignore[arg-type]
    structured = llm.with_structured_output(Weather, method="function_calling")
    result = structured.invoke("What is the weather in Rome, in celsius?")
    assert isinstance(result, Weather)


@pytest.mark.parametrize("responses_api", [False, True], ids=["chat", "responses"])
def test_langchain_bind_tools_and_tool_message_round_trip(gateway: LiveGateway, responses_api: bool) -> None:
    """Over chat completions, and over /v1/responses (``use_responses_api``)."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"18 degrees and sunny in {city}"

    llm = ChatOpenAI(
        base_url=gateway.v1,
        api_key=USER_KEY,
        model="base",
        max_tokens=40,
        temperature=0,
        max_retries=0,
        use_responses_api=responses_api,
    )  # type: ignore[arg-type]
    ask = HumanMessage("What is the weather in Paris?")
    ai = llm.bind_tools([get_weather], tool_choice="get_weather").invoke([ask])
    (call,) = ai.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    result = ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])
    answer = llm.bind_tools([get_weather], tool_choice="none").invoke([ask, ai, result])
    blocks = [answer.content] if isinstance(answer.content, str) else answer.content  # responses: blocks
    text = "".join(b if isinstance(b, str) else b.get("text", "") for b in blocks)
    assert text and not answer.tool_calls


# -- 400s --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]}, "tools"),
        ({"messages": [*ASK, {"role": "tool", "content": "18"}]}, "messages"),
        ({"messages": [*ASK, {"role": "tool", "tool_call_id": "call_none", "content": "18"}]}, "messages"),
        (
            {
                "messages": [
                    *ASK,
                    {"role": "assistant", "tool_calls": [CALL]},
                    {"role": "user", "content": "?"},
                ]
            },
            "messages",
        ),
        ({"functions": [{"name": "f", "parameters": {"type": "object"}}]}, None),
        ({"tools": [{**WEATHER, "defer_loading": True}]}, "tools[0].defer_loading"),
    ],
)
def test_bad_tool_requests_are_400(gateway: LiveGateway, extra: dict[str, Any], param: str | None) -> None:
    body = {"model": "base", "messages": ASK, "max_tokens": 4, **extra}
    with gateway.client() as http:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error"
        if param is not None:
            assert err["param"] == param, err
        assert (
            http.post(
                "/v1/chat/completions", json={"model": "base", "messages": ASK, "max_tokens": 2}
            ).status_code
            == 200
        )


def test_sdk_raises_bad_request_for_an_unknown_tool_choice(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="base",
            messages=ASK,  # type: ignore[arg-type]
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice={"type": "function", "function": {"name": "get_time"}},
        )
    assert info.value.body["param"] == "tool_choice"  # type: ignore[index]


def test_house_stream_format_refuses_tools(gateway: LiveGateway) -> None:
    body = {"model": "base", "messages": ASK, "tools": [WEATHER], "max_tokens": 4}
    r = httpx.post(
        gateway.v1 + "/chat/completions",
        json=body,
        headers={**gateway.headers, "x-stream-format": "house"},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
