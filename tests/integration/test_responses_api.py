"""``/v1/responses`` against the live gateway through the openai SDK: create, stream,
routing, max_output_tokens, structured output, the per-key store and its chaining."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.integration.conftest import ADMIN_KEY, USER_KEY, LiveGateway

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def client(gateway: LiveGateway) -> Iterator[openai.OpenAI]:
    # Closed here: one left to the garbage collector may leave its socket to warn later.
    with openai.OpenAI(base_url=gateway.v1, api_key=USER_KEY, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def other(gateway: LiveGateway) -> Iterator[openai.OpenAI]:
    """Another key (its name is another owner in the store)."""
    # Closed here: one left to the garbage collector may leave its socket to warn later.
    with openai.OpenAI(base_url=gateway.v1, api_key=ADMIN_KEY, max_retries=0) as c:
        yield c


def upper_ratio(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    assert letters, f"no letters in {text!r}"
    return sum(c.isupper() for c in letters) / len(letters)


def test_string_input(client: openai.OpenAI, base_model: str) -> None:
    r = client.responses.create(model=base_model, input=QUESTION, max_output_tokens=12, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == base_model
    assert r.status in ("completed", "incomplete") and r.output_text
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage is not None and r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 12
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_message_list_and_instructions(client: openai.OpenAI, base_model: str) -> None:
    items: Any = [
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
    ]
    plain = client.responses.create(model=base_model, input=QUESTION, max_output_tokens=4, temperature=0)
    r = client.responses.create(
        model=base_model, input=items, instructions="Answer in French.", max_output_tokens=4, temperature=0
    )
    assert r.instructions == "Answer in French." and r.output_text
    assert r.usage is not None and plain.usage is not None
    assert r.usage.input_tokens > plain.usage.input_tokens  # the earlier turns and instructions are in


def test_max_output_tokens_makes_it_incomplete(client: openai.OpenAI, base_model: str) -> None:
    r = client.responses.create(
        model=base_model, input="Tell me a long story.", max_output_tokens=3, temperature=0
    )
    assert r.status == "incomplete"
    assert r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and r.usage.output_tokens == 3


def test_routes_to_a_lora_by_model_and_by_task(client: openai.OpenAI, base_model: str) -> None:
    by_model = client.responses.create(model="shout", input=QUESTION, max_output_tokens=24)
    by_task = client.responses.create(input=QUESTION, max_output_tokens=24, extra_body={"task": "shouting"})
    assert by_model.model == by_task.model == "shout"
    assert upper_ratio(by_model.output_text) >= 0.8, by_model.output_text
    assert by_model.temperature == 0.0  # the route's default


def test_stream(client: openai.OpenAI, base_model: str) -> None:
    whole = client.responses.create(model=base_model, input=QUESTION, max_output_tokens=16, temperature=0)
    deltas = []
    with client.responses.stream(
        model=base_model, input=QUESTION, max_output_tokens=16, temperature=0
    ) as stream:
        kinds = []
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response() if kinds[-1] == "response.completed" else None
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert kinds[-1] == ("response.completed" if whole.status == "completed" else "response.incomplete")
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text  # greedy: same text
    if final is not None:
        assert final.output_text == whole.output_text and final.usage is not None


def test_stream_get_final_response(client: openai.OpenAI) -> None:
    # the json adapter stops on its own well within the budget, so the stream completes
    with client.responses.stream(model="json", input="name: Ada, age: 36", max_output_tokens=200) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == text and text
    assert client.responses.retrieve(final.id).output_text == text  # stored when streamed too


def test_logprobs_match_chat_and_stream(client: openai.OpenAI, base_model: str) -> None:
    """``include`` logprobs: the same tokens and numbers as chat's for the same greedy
    prompt, and the stream's deltas carry them one token at a time."""
    asked: Any = {"include": ["message.output_text.logprobs"], "top_logprobs": 2}
    r = client.responses.create(model=base_model, input=QUESTION, max_output_tokens=8, temperature=0, **asked)
    part = r.output[0].content[0]  # type: ignore[union-attr]
    assert part.type == "output_text" and part.logprobs is not None
    assert r.usage is not None and len(part.logprobs) == r.usage.output_tokens > 0
    assert "".join(lp.token for lp in part.logprobs) == part.text
    for lp in part.logprobs:
        assert lp.logprob <= 0 and bytes(lp.bytes).decode() == lp.token and len(lp.top_logprobs) == 2
        assert lp.top_logprobs[0].logprob >= lp.top_logprobs[1].logprob
    chat = client.chat.completions.create(
        model=base_model,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    assert [lp.token for lp in part.logprobs] == [c.token for c in content]
    assert [lp.logprob for lp in part.logprobs] == pytest.approx([c.logprob for c in content], abs=1e-4)
    events = list(
        client.responses.create(
            model=base_model, input=QUESTION, max_output_tokens=8, temperature=0, stream=True, **asked
        )
    )
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert [lp.token for d in deltas for lp in d.logprobs] == [lp.token for lp in part.logprobs]
    assert all(len(lp.top_logprobs or ()) == 2 for d in deltas for lp in d.logprobs)
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete")
    streamed = last.response.output[0].content[0]  # type: ignore[union-attr]
    assert streamed.type == "output_text" and streamed.logprobs == part.logprobs


def test_previous_response_id_continues_and_other_keys_cannot(
    client: openai.OpenAI, other: openai.OpenAI, base_model: str
) -> None:
    first = client.responses.create(
        model=base_model, input="My name is Ada.", max_output_tokens=8, temperature=0
    )
    second = client.responses.create(
        model=base_model,
        input="What is my name?",
        previous_response_id=first.id,
        max_output_tokens=8,
        temperature=0,
    )
    alone = client.responses.create(
        model=base_model, input="What is my name?", max_output_tokens=8, temperature=0
    )
    assert second.previous_response_id == first.id
    assert second.usage is not None and first.usage is not None and alone.usage is not None
    # the second prompt holds the first turn (input and output) before the new one
    assert second.usage.input_tokens >= alone.usage.input_tokens + first.usage.output_tokens + 4
    assert client.responses.retrieve(second.id).output_text == second.output_text
    items = client.responses.input_items.list(second.id, order="asc").to_dict()["data"]
    assert [(i["role"], i["content"][0]["text"]) for i in items] == [
        ("user", "My name is Ada."),
        ("assistant", first.output_text),
        ("user", "What is my name?"),
    ]
    with pytest.raises(openai.NotFoundError):
        other.responses.input_items.list(second.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as info:  # OpenAI's 400, as for an unknown id
        other.responses.create(
            model=base_model, input="x", previous_response_id=first.id, max_output_tokens=2
        )
    assert info.value.code == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(first.id)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_store_false_is_not_kept(client: openai.OpenAI, base_model: str) -> None:
    r = client.responses.create(model=base_model, input="Hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_json_schema_output_is_valid_json(client: openai.OpenAI, base_model: str) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    }
    fmt: Any = {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}
    r = client.responses.create(
        model=base_model, input=QUESTION, text={"format": fmt}, max_output_tokens=60, temperature=0
    )
    assert r.status == "completed", r.output_text
    value = json.loads(r.output_text)
    assert set(value) == {"city"} and isinstance(value["city"], str)


class Answer(BaseModel):
    city: str = Field(max_length=20)


def test_sdk_parse_with_a_pydantic_model(client: openai.OpenAI, base_model: str) -> None:
    r = client.responses.parse(
        model=base_model, input=QUESTION, text_format=Answer, max_output_tokens=60, temperature=0
    )
    assert r.status == "completed", r.output_text
    assert isinstance(r.output_parsed, Answer) and r.output_parsed.city


def test_unsupported_field_is_400(client: openai.OpenAI, base_model: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=base_model, input="Hi", tools=[{"type": "web_search"}])
    assert info.value.body["param"] == "tools[0].type"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=base_model, input="Hi", reasoning={"effort": "high"})
    assert info.value.body["param"] == "reasoning"  # type: ignore[index]


# -- function tools -------------------------------------------------------------------------
WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "strict": True,
}
TIME: Any = {
    "type": "function",
    "name": "get_time",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"type": "string", "maxLength": 30}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}


def valid_call(item: Any, tool: Any) -> dict[str, Any]:
    assert item.type == "function_call" and item.name == tool["name"], item
    assert item.call_id and item.id.startswith("fc_")
    arguments = json.loads(item.arguments)
    jsonschema.validate(arguments, tool["parameters"])
    return arguments  # type: ignore[no-any-return]


@pytest.mark.parametrize("model", ["base", "shout"])
def test_named_function_call_parses_and_validates(client: openai.OpenAI, model: str) -> None:
    r = client.responses.create(
        model=model,
        input="What is the weather in Paris?",
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=80,
        temperature=0,
    )
    assert r.status == "completed" and len(r.output) == 1
    valid_call(r.output[0], WEATHER)


def test_required_stream_assembles_valid_calls(client: openai.OpenAI) -> None:
    with client.responses.stream(
        model="base",
        input="Weather in Oslo, and the time there?",
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,  # one call: the base model would go on adding calls
        max_output_tokens=80,
        temperature=0,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.status == "completed" and len(final.output) == 1
    (item,) = final.output
    valid_call(item, {"get_weather": WEATHER, "get_time": TIME}[item.name])  # type: ignore[union-attr]
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1  # streamed as generated, not in one piece
    joined = "".join(e.delta for e in deltas if e.output_index == 0)
    assert joined == final.output[0].arguments  # type: ignore[union-attr]


def test_function_call_output_round_trip(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model="base",
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=80,
        temperature=0,
    )
    call = first.output[0]
    valid_call(call, WEATHER)
    result: Any = [{"type": "function_call_output", "call_id": call.call_id, "output": "22 C and sunny"}]  # type: ignore[union-attr]
    second = client.responses.create(
        model="base",
        input=result,
        previous_response_id=first.id,
        tools=[WEATHER],
        max_output_tokens=16,
        temperature=0,
    )
    assert second.status in ("completed", "incomplete") and second.output
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens  # the call and its output are in the prompt
    with pytest.raises(openai.BadRequestError) as info:  # an output that answers no call
        other: Any = [{"type": "function_call_output", "call_id": "call_nope", "output": "x"}]
        client.responses.create(model="base", input=other, tools=[WEATHER])
    assert info.value.body["param"] == "input"  # type: ignore[index]
