"""Function tools on ``/v1/responses`` in-process, through the openai SDK, with a fake engine
whose words are the model's answer: the items and typed events a client assembles."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
from starlette.testclient import TestClient

from gateway.catalog import Catalog, Route
from gateway.responses_api import ResponsesRequest, chat_request, input_messages
from gateway.tools import plan_tools
from gateway.types import Constraint
from tests.unit.test_responses_app import FailingEngine, ReadyEngine, make_app, message_events, prompt_of, sdk

WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
TIME: Any = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}
CALL = ['{"name": "get_weather", ', '"arguments": {"city": ', '"Paris"}}']


def app(words: list[str]) -> tuple[TestClient, ReadyEngine]:
    engine = ReadyEngine(words=words, max_model_len=1000)
    return make_app(engine), engine


def kinds(events: list[Any]) -> list[str]:
    return [e.type for e in events]


def streamed(http: TestClient, **fields: Any) -> tuple[list[Any], Any]:
    """The events of a streamed Response and the SDK's final Response."""
    with sdk(http).responses.stream(model="base-model", **fields) as stream:
        return list(stream), stream.get_final_response()


def test_auto_answer_with_a_call_is_a_function_call_item() -> None:
    http, _ = app(CALL)
    r = sdk(http).responses.create(model="base-model", input="Weather in Paris?", tools=[WEATHER])
    assert r.status == "completed" and len(r.output) == 1
    call = r.output[0]
    assert call.type == "function_call" and call.status == "completed"
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert r.output_text == ""
    assert r.tools[0].type == "function" and r.tools[0].name == "get_weather"  # echoed
    assert r.tool_choice == "auto" and r.parallel_tool_calls is True


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_a_tool_choice_that_changes_nothing_needs_no_tools(choice: str) -> None:
    http, _ = app(["Hi", "!"])
    r = sdk(http).responses.create(model="base-model", input="Hi", tool_choice=choice)  # type: ignore[arg-type]
    assert r.output_text == "Hi!" and r.tools == []


def test_auto_plain_answer_is_a_message_and_streams_at_once() -> None:
    http, _ = app(["Sunny", " today", "."])
    client = sdk(http)
    assert (
        client.responses.create(model="base-model", input="Hi", tools=[WEATHER]).output_text == "Sunny today."
    )
    events, final = streamed(http, input="Hi", tools=[WEATHER])
    assert kinds(events) == message_events(3)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.output_text == "Sunny today." and final.output[0].type == "message"


def test_auto_stream_on_a_route_that_reads_no_calls_flows_whatever_it_opens_with() -> None:
    """Under ``tool_parser: none`` an answer is text however it starts: one opening with a
    code block or a call's shape sent nothing until the answer ended, then all at once."""
    http, _ = app(CALL)
    table = http.app.state.gateway.catalog.table  # type: ignore[attr-defined]
    plain = Route(name="plain", kind="preset", tool_parser="none")
    http.app.state.gateway.catalog = Catalog(lambda ids: replace(table, routes={"plain": plain}))  # type: ignore[attr-defined]
    with sdk(http).responses.stream(model="plain", input="Weather?", tools=[WEATHER]) as stream:
        events, final = list(stream), stream.get_final_response()
    assert kinds(events) == message_events(len(CALL))
    assert [e.delta for e in events if e.type == "response.output_text.delta"] == CALL
    assert final.output_text == "".join(CALL) and [o.type for o in final.output] == ["message"]


def test_auto_stream_of_a_call_is_read_at_the_end() -> None:
    http, _ = app(CALL)
    events, final = streamed(http, input="Weather?", tools=[WEATHER])
    assert kinds(events) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added, done = events[2], events[5]
    assert added.item.type == "function_call" and added.item.status == "in_progress"
    assert done.item.status == "completed" and done.item.id == added.item.id
    assert json.loads(events[4].arguments) == {"city": "Paris"} and events[4].item_id == added.item.id
    call = final.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id == done.item.call_id


def test_auto_stream_of_text_then_a_call_sends_the_text_then_the_call() -> None:
    words = ["Let", " me", " check.", "\n", *CALL]
    http, _ = app(words)
    events, final = streamed(http, input="Weather?", tools=[WEATHER])
    assert kinds(events) == [
        *message_events(3)[:-1],  # the newline waits (a call may follow), then is dropped
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.delta for e in events if e.type == "response.output_text.delta"] == ["Let", " me", " check."]
    assert [o.type for o in final.output] == ["message", "function_call"]
    assert final.output_text == "Let me check." and json.loads(final.output[1].arguments) == {"city": "Paris"}  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("answer", "order"),
    [
        ('{"name": "get_time", "arguments": {}}\nThat is all.', ["function_call", "message"]),
        ('```json\n{"name": "get_time", "arguments": {}}\n```\nDone.', ["function_call", "message"]),
        ('{"oops": 1}\n{"name": "get_time", "arguments": {}}', ["message", "function_call"]),
    ],
)
def test_auto_items_keep_the_order_generated(answer: str, order: list[str]) -> None:
    http, _ = app([answer])
    whole = sdk(http).responses.create(model="base-model", input="Hi", tools=[WEATHER, TIME])
    events, final = streamed(http, input="Hi", tools=[WEATHER, TIME])
    assert [o.type for o in whole.output] == order and [o.type for o in final.output] == order
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    indexes = [e.output_index for e in events if e.type == "response.output_item.added"]
    assert added == order and indexes == [0, 1]


@pytest.mark.parametrize(
    "answer",
    [
        "Sunny.  ",
        'Let me check.\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n',
        'Text\n{"name": "get_time", "arguments": {}} and more',
        '{"name": "get_time", "arguments": {}}\nThat is all.',
        'Cut\n[{"name": "get_time", "arguments": {',
    ],
)
@pytest.mark.parametrize("size", [1, 3, 1000])
def test_auto_stream_adds_up_to_the_whole_response(answer: str, size: int) -> None:
    http, _ = app([answer[i : i + size] for i in range(0, len(answer), size)])
    whole = sdk(http).responses.create(model="base-model", input="Hi", tools=[WEATHER, TIME])
    events, final = streamed(http, input="Hi", tools=[WEATHER, TIME])

    def items(output: list[Any]) -> list[tuple[str, str]]:
        return [(o.type, o.content[0].text if o.type == "message" else o.name + o.arguments) for o in output]

    assert items(final.output) == items(whole.output)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = [e.text for e in events if e.type == "response.output_text.done"]
    assert deltas == whole.output_text and done == ([deltas] if deltas else [])


def test_named_function_streams_its_arguments_as_generated() -> None:
    words = ['{"city": ', '"Paris"', "}"]
    http, engine = app(words)
    choice: Any = {"type": "function", "name": "get_weather"}
    events, final = streamed(http, input="Weather?", tools=[WEATHER, TIME], tool_choice=choice)
    assert kinds(events)[2:] == [
        "response.output_item.added",  # before the first token: the name is known
        *["response.function_call_arguments.delta"] * 3,
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.delta for e in events if e.type == "response.function_call_arguments.delta"] == words
    assert events[-3].arguments == "".join(words) and events[-3].name == "get_weather"
    assert final.output[0].name == "get_weather" and final.tool_choice.name == "get_weather"  # type: ignore[union-attr]
    assert engine.calls[0][1].constraint == Constraint("json", WEATHER["parameters"])  # under its grammar


def test_required_streams_each_call_as_its_own_item() -> None:
    words = [
        '[{"name": "get_weather", "arguments": ',
        '{"city": "Oslo"}}, ',
        '{"name": "get_time", ',
        '"arguments": {}}]',
    ]
    http, engine = app(words)
    events, final = streamed(http, input="Weather and time?", tools=[WEATHER, TIME], tool_choice="required")
    items = [e for e in events if e.type in ("response.output_item.added", "response.output_item.done")]
    assert [(e.type.rsplit(".", 1)[-1], e.output_index, e.item.name) for e in items] == [
        ("added", 0, "get_weather"),
        ("done", 0, "get_weather"),
        ("added", 1, "get_time"),
        ("done", 1, "get_time"),
    ]
    assert [(c.name, json.loads(c.arguments)) for c in final.output] == [  # type: ignore[union-attr]
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]
    constraint = engine.calls[0][1].constraint
    assert constraint is not None and constraint.kind == "json" and constraint.value["type"] == "array"


def test_required_with_one_function_and_two_calls_in_one_step() -> None:
    """The one function's call is announced at the start; a step naming it and a second call
    (vLLM merges steps when its reader lags) opens only the second."""
    words = ['[{"name": "get_time", "arguments": {}}, {"name": "get_time", "arguments": {}}]']
    http, _ = app(words)
    events, final = streamed(http, input="Time?", tools=[TIME], tool_choice="required")
    added = [(e.output_index, e.item.name) for e in events if e.type == "response.output_item.added"]
    assert added == [(0, "get_time"), (1, "get_time")]
    assert [(c.name, c.arguments) for c in final.output] == [("get_time", "{}")] * 2  # type: ignore[union-attr]


def test_a_tool_round_trip_through_previous_response_id() -> None:
    http, engine = app(CALL)
    client = sdk(http)
    first = client.responses.create(model="base-model", input="Weather in Paris?", tools=[WEATHER])
    call = first.output[0]
    assert call.type == "function_call"
    output: Any = [{"type": "function_call_output", "call_id": call.call_id, "output": "22 C, sunny"}]
    client.responses.create(model="base-model", input=output, previous_response_id=first.id, tools=[WEATHER])
    assert prompt_of(engine).endswith("user:Weather in Paris?\nassistant:\ntool:22 C, sunny\nmodel:")
    # the same turn sent whole, without the store
    items: Any = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {
            "type": "function_call_output",
            "call_id": "call_1",
            "output": [{"type": "input_text", "text": "22 C"}],
        },
    ]
    client.responses.create(model="base-model", input=items, tools=[WEATHER], store=False)
    assert prompt_of(engine).endswith("assistant:\ntool:22 C\nmodel:")
    # an answer of text and a call (as a Response's output lists them) is one assistant turn
    said: Any = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "Let me see."}],
    }
    client.responses.create(
        model="base-model", input=[items[0], said, *items[1:]], tools=[WEATHER], store=False
    )
    assert prompt_of(engine).endswith("user:Weather in Paris?\nassistant:Let me see.\ntool:22 C\nmodel:")


def test_calls_then_text_sent_back_with_the_outputs_is_one_assistant_turn() -> None:
    # An answer that opened with a call lists [function_call, message]: resent as input (the
    # stateless way) with the call's output after them, that was a 400 "No tool output found".
    http, engine = app(['{"name": "get_time", "arguments": {}}\nThat is all.'])
    client = sdk(http)
    first = client.responses.create(model="base-model", input="Hi", tools=[TIME], store=False)
    assert [o.type for o in first.output] == ["function_call", "message"]
    call = first.output[0]
    assert call.type == "function_call"
    items: Any = [
        {"role": "user", "content": "Hi"},
        *[o.model_dump(exclude_none=True) for o in first.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "noon"},
    ]
    client.responses.create(model="base-model", input=items, tools=[TIME], store=False)
    assert prompt_of(engine).endswith("user:Hi\nassistant:That is all.\ntool:noon\nmodel:")


def test_only_an_answers_own_text_after_its_calls_joins_their_turn() -> None:
    """As vLLM reads the items: an output message fills the calls' turn only where it has
    no text yet. Text before the calls stays (the later text is a turn of its own), and a
    user's or a system message after them is never the assistant's text."""
    from gateway.responses_api import input_messages

    call = {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": "{}"}
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]
    before_and_after = [{"role": "assistant", "content": "A"}, call, {"role": "assistant", "content": "B"}]
    assert input_messages(before_and_after) == [
        {"role": "assistant", "content": "A", "tool_calls": calls},
        {"role": "assistant", "content": "B"},
    ]
    for role in ("user", "system", "developer"):
        assert input_messages([call, {"role": role, "content": "U"}]) == [
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": role, "content": "U"},
        ]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{**WEATHER, "parameters": {"type": "array"}}]}, "tools"),
        ({"tools": [WEATHER, {**WEATHER, "name": "g", "defer_loading": True}]}, "tools[1].defer_loading"),
        ({"tools": [{**WEATHER, "defer_loading": "later"}]}, "tools[0].defer_loading"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}, "input[0].name"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ],
)
def test_bad_tool_fields_are_400_with_param(fields: dict[str, Any], param: str) -> None:
    http, engine = app(CALL)
    body = {"model": "base-model", "input": "Hi", **fields}
    r = http.post("/v1/responses", json=body, headers={"Authorization": "Bearer sk-alice-000000001"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert engine.calls == []


def test_engine_failure_mid_call_is_response_failed_with_the_call_so_far() -> None:
    engine = FailingEngine(words=['{"city": ', '"Paris"}'], max_model_len=1000, cached_tokens=2)
    choice: Any = {"type": "function", "name": "get_weather"}
    events = list(
        sdk(make_app(engine)).responses.create(
            model="base-model", input="Hi", tools=[WEATHER], tool_choice=choice, stream=True
        )
    )
    failed = events[-1]
    assert failed.type == "response.failed" and failed.response.status == "failed"
    item = failed.response.output[0]
    assert item.type == "function_call" and item.status == "incomplete" and item.arguments == '{"city": '
    usage = failed.response.usage  # the usage of what it ran
    assert usage is not None and usage.output_tokens == 1 and usage.input_tokens_details.cached_tokens == 2


def test_required_cut_short_whole_agrees_with_the_stream() -> None:
    # max_output_tokens ends the list inside the second call: streamed, two function_call
    # items; not streamed it was one message holding the raw JSON list.
    words = [
        '[{"name": "get_weather", "arguments": {"city": "X"}}, ',
        '{"name": "get_time", "arguments": {"ci',
    ]
    http, _ = app(words)
    fields: Any = dict(input="w", tools=[WEATHER, TIME], tool_choice="required", max_output_tokens=2)
    with sdk(http).responses.stream(model="base-model", **fields) as stream:
        incomplete = [e.response for e in stream if e.type == "response.incomplete"]
    whole = sdk(http).responses.create(model="base-model", **fields)
    assert whole.status == incomplete[0].status == "incomplete"
    assert [(i.type, i.name, i.arguments, i.status) for i in whole.output] == [  # type: ignore[union-attr]
        (i.type, i.name, i.arguments, i.status)
        for i in incomplete[0].output  # type: ignore[union-attr]
    ]
    # the first call was whole once the second began: completed, streamed or not
    assert [(i.name, i.status) for i in whole.output] == [  # type: ignore[union-attr]
        ("get_weather", "completed"),
        ("get_time", "incomplete"),
    ]


# -- OpenAI: a Responses function tool that leaves out ``strict`` is strict --------------------
ALICE = {"Authorization": "Bearer sk-alice-000000001"}
STRICT_PARAMS: Any = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
A_FORMAT: Any = {
    "format": {"type": "json_schema", "name": "answer", "schema": {"type": "object", "properties": {}}}
}


def _answer(tool: dict[str, Any], words: list[str], **fields: Any) -> tuple[dict[str, Any], Any]:
    http, engine = app(words)
    body = {"model": "base-model", "input": "Weather?", "tools": [tool], **fields}
    r = http.post("/v1/responses", json=body, headers=ALICE)
    assert r.status_code == 200, r.text
    return r.json(), engine.calls[0][1].constraint


@pytest.mark.parametrize("strict", [None, "left out"])
def test_a_tool_without_strict_is_decoded_and_echoed_as_a_strict_one(strict: Any) -> None:
    """OpenAI: "If you omit strict ... Responses requests will normalize your schema into
    strict mode", chat's tools stay non-strict: beside a format, its arguments are decoded
    against its parameters, as with ``strict: true``."""
    tool = {"type": "function", "name": "get_weather", "parameters": STRICT_PARAMS}
    if strict is None:
        tool["strict"] = None
    omitted, decoded = _answer(tool, ["{}"], text=A_FORMAT)
    _, strict_decoded = _answer({**tool, "strict": True}, ["{}"], text=A_FORMAT)
    _, free = _answer({**tool, "strict": False}, ["{}"], text=A_FORMAT)
    assert decoded == strict_decoded != free
    assert omitted["tools"][0]["strict"] is True


@pytest.mark.parametrize(
    "tool",
    [
        WEATHER,  # strict left out: strict, but not written into the prompt
        {**WEATHER, "strict": None},
        {**WEATHER, "strict": True},
        {**WEATHER, "strict": False},
        TIME,  # no description
        {"type": "function", "name": "ping"},  # no description, no parameters
    ],
)
def test_responses_tools_reach_the_template_as_vllms_server_hands_them(tool: dict[str, Any]) -> None:
    """vLLM's Responses server gives the chat template each function tool as sent, in chat's
    shape (``construct_tool_dicts``). The gateway wrote ``"strict": true`` into the prompt of
    a tool that left ``strict`` out (it is read as strict, which is the grammar's business,
    not the prompt's), and left out a missing description's null: 4 and 5 tokens off
    ``vllm serve``'s prompt."""
    utils = pytest.importorskip("vllm.entrypoints.openai.responses.utils")
    protocol = pytest.importorskip("vllm.entrypoints.openai.responses.protocol")
    body = {"model": "m", "input": "Hi", "tools": [tool]}
    vllms = protocol.ResponsesRequest.model_validate(body)
    ours = ResponsesRequest.model_validate(body)
    plan = plan_tools(chat_request(ours, [], input_messages(ours.input)))
    assert plan.template_tools() == utils.construct_tool_dicts(vllms.tools, vllms.tool_choice)
    assert [fn.is_strict for fn in plan.tools] == [tool.get("strict") is not False]


def test_a_responses_tool_that_is_no_function_is_a_400_naming_its_field() -> None:
    http, _ = app(["Hi"])
    bad = {"type": "function", "name": "no spaces allowed"}
    r = http.post(
        "/v1/responses", json={"model": "base-model", "input": "Hi", "tools": [WEATHER, bad]}, headers=ALICE
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[1].name", r.text


def test_a_tool_without_strict_takes_no_arguments_outside_its_schema() -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": STRICT_PARAMS}
    wrong = ['{"name": "get_weather", "arguments": {"town": "Paris"}}']
    assert [item["type"] for item in _answer(tool, wrong)[0]["output"]] == ["message"]
    loose, _ = _answer({**tool, "strict": False}, wrong)
    assert [item["type"] for item in loose["output"]] == ["function_call"]
    assert loose["tools"][0]["strict"] is False


# -- errors in the Responses API's words ----------------------------------------------------
def _refused(**fields: Any) -> dict[str, Any]:
    http, engine = app(["x"])
    r = http.post("/v1/responses", json={"model": "base-model", **fields}, headers=ALICE)
    assert r.status_code == 400, r.text
    assert engine.calls == []
    return r.json()["error"]  # type: ignore[no-any-return]


def test_an_output_answering_no_call_is_openais_400() -> None:
    """OpenAI's words (with instructions before the input, chat's ``messages[i]`` would point
    one item off)."""
    error = _refused(
        instructions="Be brief.",
        input=[
            {"role": "user", "content": "hi"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        ],
    )
    assert error["param"] == "input"
    assert error["message"] == "No tool call found for function call output with call_id c1."


def test_an_unknown_tool_choice_names_the_responses_shape() -> None:
    error = _refused(input="x", tools=[TIME], tool_choice="sometimes")
    assert error["param"] == "tool_choice"
    assert '{"type": "function", "name": ...}' in error["message"], error
