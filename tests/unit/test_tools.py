"""Tool calling without an engine: request checks, grammars, the parser, the template."""

from __future__ import annotations

import json
import random
import time
import tracemalloc
from typing import Any

import jsonschema
import openai
import pytest
import regex
from pydantic import ValidationError

from gateway.errors import InvalidRequest
from gateway.protocol import ChatCompletionRequest
from gateway.structured import _cached_problem
from gateway.tools import (
    TOOL_TEMPLATE_PATH,
    ParsedCall,
    RequiredCallScanner,
    calls_of_answer,
    parse_calls,
    parse_required,
    plan_tools,
    template_messages,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}},
}
USER = [{"role": "user", "content": "Weather in Paris?"}]
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}


def request(**kw: Any) -> ChatCompletionRequest:
    body: dict[str, Any] = {"messages": USER}
    body.update(kw)
    return ChatCompletionRequest.model_validate(body)


def test_no_tools_is_plain_chat() -> None:
    plan = plan_tools(request())
    assert plan.mode == "none" and plan.constraint is None and plan.template_tools() is None


def test_tools_default_to_auto_without_a_grammar() -> None:
    plan = plan_tools(request(tools=[WEATHER, ADD]))
    assert plan.mode == "auto" and plan.constraint is None
    assert plan.names == {"get_weather": None, "add": None}  # neither strict: no validator
    add = {"type": "function", "function": {**ADD["function"], "description": None}}  # as vLLM's
    assert plan.template_tools() == [WEATHER, add]


@pytest.mark.parametrize(
    "tool",
    [
        WEATHER,
        ADD,  # no description
        {"type": "function", "function": {"name": "ping"}},  # no description, no parameters
        {"type": "function", "function": {**WEATHER["function"], "strict": True}},
        {"type": "function", "function": {**WEATHER["function"], "strict": False}},
    ],
)
def test_tools_reach_the_template_as_vllms_server_hands_them(tool: dict[str, Any]) -> None:
    """vLLM's server gives the chat template each tool as its ``ChatCompletionToolsParam``
    dumps it: ``description`` and ``parameters`` null where left out (a template that writes
    the tool as JSON shows ``"description": null``), ``strict`` only where sent. The gateway
    left the nulls out: a tool without a description made a prompt 5 tokens shorter than
    ``vllm serve``'s for the same request."""
    protocol = pytest.importorskip("vllm.entrypoints.openai.chat_completion.protocol")
    vllms = protocol.ChatCompletionToolsParam.model_validate(tool).model_dump()
    assert plan_tools(request(tools=[tool])).template_tools() == [vllms]


STRICT = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize(
    ("answer", "calls"),
    [
        ('{"name": "get_weather", "arguments": {"city": "Oslo"}}', 1),
        ('{"name": "get_weather", "arguments": {"town": 5}}', 0),  # breaks the strict schema
        ('[{"name": "add", "arguments": {"a": 1}}, {"name": "get_weather", "arguments": {}}]', 0),
        ('Sure.\n{"name": "get_weather", "arguments": {"city": 5}}', 0),
        ('[{"name": "add", "arguments": {"a": "any"}}]', 1),  # add is not strict
    ],
)
async def test_under_auto_a_strict_functions_call_validates_or_is_content(answer: str, calls: int) -> None:
    """OpenAI promises that a strict function's arguments follow its schema. The grammar
    leaves ``auto`` free, so a call that breaks the schema is not passed on as a call."""
    from gateway.sse_tools import tool_chat_response

    whole = make_gen([answer], tools=[STRICT, ADD])
    message = tool_chat_response(whole, await whole.collect())["choices"][0]["message"]
    streamed = assemble(await stream_chunks(make_gen([answer], tools=[STRICT, ADD])))[0]
    assert len(message.get("tool_calls") or []) == len(streamed["tool_calls"]) == calls
    if not calls:
        assert message["content"] == streamed["content"] == answer


NAMED_GROUPS = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"day": {"type": "string", "pattern": "^(?<y>[0-9]{4})-[0-9]{2}$"}},
            "patternProperties": {"^(?<unit>c|f)$": {"type": "number"}},
            "required": ["day"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize(
    ("answer", "calls"),
    [
        ('{"name": "get_weather", "arguments": {"day": "2024-05", "c": 20}}', 1),
        ('{"name": "get_weather", "arguments": {"day": "24-05"}}', 0),  # breaks its pattern
        ('{"name": "get_weather", "arguments": {"day": "2024-05", "k": 20}}', 0),  # no such key
    ],
)
async def test_a_strict_functions_ecma_named_groups_validate_its_calls(answer: str, calls: int) -> None:
    """A schema's regexes are ECMA-262: Python's re refused ``(?<y>...)``, so validating a
    strict call raised."""
    from gateway.sse_tools import tool_chat_response

    whole = make_gen([answer], tools=[NAMED_GROUPS])
    message = tool_chat_response(whole, await whole.collect())["choices"][0]["message"]
    assert len(message.get("tool_calls") or []) == calls


@pytest.mark.parametrize("pattern", ["^(a+)+$", "^(a|aa)+$"])  # the second is slow in the regex module too
async def test_a_strict_functions_pattern_does_not_stall_the_loop_on_the_models_text(pattern: str) -> None:
    """The client writes the regex and, by its prompt, the text it is run against: under
    Python's re, which backtracks without bound and holds the GIL, ``^(a+)+$`` against 27 a's
    and a ``!`` held the event loop (every stream) for seconds, doubling with each letter."""
    from gateway.sse_tools import tool_chat_response

    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {"x": {"type": "string", "pattern": pattern}},
                "patternProperties": {pattern: {"type": "string"}},
                "additionalProperties": False,
            },
        },
    }
    text = "a" * 27 + "!"
    for args in ({"x": text}, {text: "y"}):
        answer = json.dumps({"name": "f", "arguments": args})
        start = time.perf_counter()
        whole = make_gen([answer], tools=[tool])
        message = tool_chat_response(whole, await whole.collect())["choices"][0]["message"]
        assert time.perf_counter() - start < 1
        assert message["content"] == answer and not message.get("tool_calls")  # not shown valid: content
    valid = json.dumps({"name": "f", "arguments": {"x": "aaaa"}})
    whole = make_gen([valid], tools=[tool])
    assert len(tool_chat_response(whole, await whole.collect())["choices"][0]["message"]["tool_calls"]) == 1


def strict_tool(parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", "strict": True, "parameters": parameters}}


async def answered(arguments: dict[str, Any], parameters: dict[str, Any]) -> dict[str, Any]:
    """The message of a whole chat answer that calls ``f`` (strict, ``parameters``) so."""
    from gateway.sse_tools import tool_chat_response

    whole = make_gen([json.dumps({"name": "f", "arguments": arguments})], tools=[strict_tool(parameters)])
    message: dict[str, Any] = tool_chat_response(whole, await whole.collect())["choices"][0]["message"]
    return message


DRAFT_4 = "http://json-schema.org/draft-04/schema#"


@pytest.mark.parametrize(
    ("parameters", "arguments", "valid"),
    [
        ({"properties": {"x": {"pattern": "^a"}}}, {"x": 5}, True),  # a pattern judges strings only
        ({"properties": {"x": {"patternProperties": {"^a": {"type": "string"}}}}}, {"x": 5}, True),
        ({"patternProperties": {"^a": {"type": "integer"}}}, {"ab": "x"}, False),
        ({"patternProperties": {"^a": {}, "^b": {}}, "additionalProperties": False}, {"b": 1}, True),
        ({"patternProperties": {"^a": {}, "^b": {}}, "additionalProperties": False}, {"c": 1}, False),
        ({"properties": {"x": {}}, "additionalProperties": True}, {"k": 1}, True),
        ({"additionalProperties": {"type": "integer"}}, {"k": 1}, True),
        ({"additionalProperties": {"type": "integer"}}, {"k": "one"}, False),
        ({"properties": {"x": {}}, "unevaluatedProperties": False}, {"x": 1}, True),
        ({"properties": {"x": {}}, "unevaluatedProperties": False}, {"y": 1}, False),
    ],
)
async def test_a_strict_functions_arguments_are_judged_as_json_schema_judges_them(
    parameters: dict[str, Any], arguments: dict[str, Any], valid: bool
) -> None:
    """The bounded validator (its regexes under a time bound) keeps JSON Schema's reading:
    a call whose arguments validate is a call, any other is content."""
    schema = {"type": "object", **parameters}
    assert jsonschema.Draft202012Validator(schema).is_valid(arguments) is valid  # the reference
    message = await answered(arguments, schema)
    assert len(message.get("tool_calls") or []) == int(valid)
    assert (message["content"] is None) is valid


async def test_a_draft_4_pattern_property_that_is_no_regex_makes_content_not_a_500() -> None:
    # draft-04's meta-schema leaves patternProperties' keys unchecked: "(" reaches the validator
    schema = {"$schema": DRAFT_4, "type": "object", "patternProperties": {"(": {}}}
    message = await answered({"k": 1}, schema)
    assert message["content"] and not message.get("tool_calls")


async def test_unevaluated_properties_beside_a_client_pattern_do_not_stall_the_loop() -> None:
    """jsonschema finds the keys ``unevaluatedProperties`` leaves with Python's re, which
    backtracks without bound (seconds for ``^(a+)+$`` on 27 a's and a ``!``): such an object
    is not judged (content), at once."""
    schema = {
        "type": "object",
        "patternProperties": {"^(a+)+$": {"type": "string"}},
        "unevaluatedProperties": False,
    }
    start = time.perf_counter()
    message = await answered({"a" * 27 + "!": "y"}, schema)
    assert time.perf_counter() - start < 1
    assert message["content"] and not message.get("tool_calls")


def slow_key_length(least_s: float) -> int:
    """How many a's (then a ``!``) make ``SLOW`` take at least ``least_s`` in the regex
    module here, and well under a check's whole budget."""
    for n in range(8, 40):
        start = time.perf_counter()
        regex.search(SLOW, "a" * n + "!")
        if time.perf_counter() - start >= least_s:
            return n
    raise AssertionError("no length is slow enough")


SLOW = "^(a|aa)+$"  # slow in the regex module too: its time grows by 1.6 with each letter


async def test_a_strict_functions_regexes_share_one_time_budget() -> None:
    """200 keys, each a few ms under a ``patternProperties`` regex: each within the per-regex
    bound, a second together. The check's regexes share one budget, so the arguments are not
    shown valid (content) within about that budget."""
    n = slow_key_length(0.005)
    arguments = {"a" * n + f"!{i}": 1 for i in range(200)}
    start = time.perf_counter()
    message = await answered(arguments, {"type": "object", "patternProperties": {SLOW: {}}})
    assert time.perf_counter() - start < 0.5
    assert message["content"] and not message.get("tool_calls")


async def test_a_strict_functions_large_repeat_count_is_no_memory_bomb() -> None:
    """Checking the model's arguments compiled the client's regex with the regex module, which
    writes a repeat's minimum count out copy by copy: ``a{200000}`` took 50 MB, and
    ``a{4294967294}`` (14 bytes of schema) all the machine had. Such a regex is not run (the
    call cannot be shown valid: content); a count a schema uses as such still is."""

    def schema(pattern: str) -> dict[str, Any]:
        return {"type": "object", "properties": {"x": {"type": "string", "pattern": pattern}}}

    tracemalloc.start()
    try:
        message = await answered({"x": "aaaa"}, schema("^a{200000}$"))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 5 * 2**20, peak
    assert message["content"] and not message.get("tool_calls")
    for x, calls in (("a" * 4000, 1), ("a" * 3999, 0)):
        message = await answered({"x": x}, schema("^a{4000}$"))
        assert len(message.get("tool_calls") or []) == calls


def test_tool_choice_none_still_renders_the_tools() -> None:
    # OpenAI's none only stops calls (the definitions stay in context); vLLM's server renders
    # them too (--exclude-tools-when-tool-choice-none is off by default)
    plan = plan_tools(request(tools=[WEATHER], tool_choice="none"))
    assert plan.mode == "none" and plan.constraint is None and plan.template_tools() == [WEATHER]


async def test_chat_responses_and_tokenize_render_the_tools_under_none(serve: Any) -> None:
    from tests.unit.fakes import FakeEngine, FakeTokenizer

    class NamingTokenizer(FakeTokenizer):
        """Writes the offered tools' names after the chat, as a tool template renders them."""

        def apply_chat_template(self, conversation: Any, **kwargs: Any) -> str:
            names = [t["function"]["name"] for t in kwargs.get("tools") or ()]
            return super().apply_chat_template(conversation, **kwargs) + "".join(f"[{n}]" for n in names)

    engine = FakeEngine(words=["Hi"], max_model_len=4000)
    engine._tokenizer = NamingTokenizer()
    served = await serve(engine)
    body = {"model": "base", "messages": USER, "tools": [WEATHER], "tool_choice": "none"}
    plain = await served.http.post("/v1/chat/completions", json={"model": "base", "messages": USER})
    chat = await served.http.post("/v1/chat/completions", json=body)
    counted = await served.http.post("/tokenize", json=body)
    responses_tool = {"type": "function", **WEATHER["function"]}  # type: ignore[dict-item]
    responses = await served.http.post(
        "/v1/responses",
        json={"model": "base", "input": USER, "tools": [responses_tool], "tool_choice": "none"},
    )
    offered = chat.json()["usage"]["prompt_tokens"]
    assert offered == plain.json()["usage"]["prompt_tokens"] + len("[get_weather]")
    assert counted.json()["count"] == responses.json()["usage"]["input_tokens"] == offered
    assert chat.json()["choices"][0]["message"]["content"] == "Hi"  # none: still no call


def test_named_choice_is_generated_under_the_function_parameters() -> None:
    plan = plan_tools(
        request(tools=[WEATHER, ADD], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    )
    assert plan.mode == "named" and plan.named == "get_weather"
    assert plan.constraint is not None and plan.constraint.kind == "json"
    assert plan.constraint.value == WEATHER["function"]["parameters"]  # type: ignore[index]


def test_named_choice_without_parameters_is_any_object() -> None:
    fn = {"type": "function", "function": {"name": "ping"}}
    plan = plan_tools(request(tools=[fn], tool_choice={"type": "function", "function": {"name": "ping"}}))
    assert plan.constraint is not None and plan.constraint.value["type"] == "object"


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # xgrammar's own imports
@pytest.mark.parametrize("params", [{}, {"properties": {"a": {"type": "integer"}}}, {"anyOf": [{}, {}]}])
def test_forced_arguments_are_an_object_even_when_the_schema_has_no_type(params: dict[str, Any]) -> None:
    fn = {"type": "function", "function": {"name": "f", "parameters": params}}
    named = plan_tools(request(tools=[fn], tool_choice={"type": "function", "function": {"name": "f"}}))
    assert named.constraint is not None
    required = required_schema(fn)
    for value in (5, "x", None, [1]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, named.constraint.value)
        assert not grammar_accepts(named.constraint.value, value)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([{"name": "f", "arguments": value}], required)
        assert not grammar_accepts(required, [{"name": "f", "arguments": value}])
    jsonschema.validate({"a": 1}, named.constraint.value)
    assert grammar_accepts(named.constraint.value, {"a": 1})
    jsonschema.validate([{"name": "f", "arguments": {"a": 1}}], required)


@pytest.mark.parametrize("parallel", [None, True, False])
def test_required_schema_accepts_calls_of_offered_tools_only(parallel: bool | None) -> None:
    plan = plan_tools(request(tools=[WEATHER, ADD], tool_choice="required", parallel_tool_calls=parallel))
    assert plan.mode == "required" and plan.constraint is not None
    schema = plan.constraint.value
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    jsonschema.validate(ok, schema)
    two = ok + [{"name": "add", "arguments": {"a": 1}}]
    for bad in (
        [],
        [{"name": "nope", "arguments": {}}],
        [{"name": "get_weather", "arguments": {"days": 2}}],  # city is required
        [{"name": "add", "arguments": {"a": "one"}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    if parallel is False:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(two, schema)
    else:
        jsonschema.validate(two, schema)


def test_required_schema_lifts_defs_to_the_top() -> None:
    params = {
        "type": "object",
        "properties": {"item": {"$ref": "#/$defs/Item"}},
        "$defs": {"Item": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}},
    }
    fn = {"type": "function", "function": {"name": "put", "parameters": params}}
    schema = plan_tools(request(tools=[fn], tool_choice="required")).constraint.value  # type: ignore[union-attr]
    assert "put.defs.Item" in schema["$defs"]
    jsonschema.validate([{"name": "put", "arguments": {"item": {"n": 1}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "put", "arguments": {"item": {"n": "x"}}}], schema)


def required_schema(*tools: dict[str, Any]) -> dict[str, Any]:
    plan = plan_tools(request(tools=list(tools), tool_choice="required"))
    assert plan.constraint is not None
    return plan.constraint.value  # type: ignore[no-any-return]


def grammar_accepts(schema: dict[str, Any], value: Any) -> bool:
    """Whether the engine's grammar backend (xgrammar, without an engine) lets ``value`` out."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    return bool(
        _is_grammar_accept_string(xgr.Grammar.from_json_schema(json.dumps(schema)), json.dumps(value))
    )


TREE = {
    "type": "object",
    "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
    "required": ["v"],
}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # xgrammar's own imports
def test_required_keeps_a_recursive_ref_on_the_tool_arguments() -> None:
    schema = required_schema({"type": "function", "function": {"name": "tree", "parameters": TREE}}, ADD)
    good = [{"name": "tree", "arguments": {"v": 1, "kids": [{"v": 2, "kids": [{"v": 3}]}]}}]
    jsonschema.validate(good[0]["arguments"], TREE)
    jsonschema.validate(good, schema)  # "#" is the tool's arguments, not the list of calls
    assert grammar_accepts(schema, good)
    calls_as_kid = [{"name": "tree", "arguments": {"v": 1, "kids": good}}]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(calls_as_kid, schema)
    assert not grammar_accepts(schema, calls_as_kid)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_required_lifts_definitions_and_defs_of_each_tool_apart() -> None:
    def fn(name: str, p_type: str) -> dict[str, Any]:
        params = {
            "type": "object",
            "properties": {
                "p": {"$ref": "#/definitions/P"},
                "q": {"$ref": "#/$defs/P"},
                "r": {"$ref": "#/properties/p"},
            },
            "required": ["p", "q"],
            "definitions": {"P": {"type": p_type}},
            "$defs": {"P": {"type": "boolean"}},
        }
        return {"type": "function", "function": {"name": name, "parameters": params}}

    schema = required_schema(fn("a", "integer"), fn("b", "string"))  # the same names, two schemas
    good = [
        {"name": "a", "arguments": {"p": 1, "q": True, "r": 2}},
        {"name": "b", "arguments": {"p": "x", "q": False}},
    ]
    jsonschema.validate(good, schema)
    assert grammar_accepts(schema, good)
    for bad in (
        [{"name": "a", "arguments": {"p": "x", "q": True}}],
        [{"name": "b", "arguments": {"p": "x", "q": 1}}],
        [{"name": "a", "arguments": {"p": 1, "q": True, "r": "x"}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
        assert not grammar_accepts(schema, bad)


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]},
            "tools",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "tools",
        ),
        (  # every call's arguments would be infinite: the engine ran out of tokens to allow
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}]},
            "tools",
        ),
        # OpenAI hides a deferred tool until its tool search finds it; shown here, it would
        # change the answer
        (
            {"tools": [WEATHER, {**WEATHER, "function": {"name": "g"}, "defer_loading": True}]},
            "tools[1].defer_loading",
        ),
    ],
)
def test_bad_tool_fields_are_400_with_param(kw: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        plan_tools(request(**kw))
    assert info.value.param == param


def test_a_tool_not_deferred_is_offered() -> None:
    plan = plan_tools(request(tools=[{**WEATHER, "defer_loading": False}]))
    assert [fn.name for fn in plan.tools] == ["get_weather"]


@pytest.mark.parametrize("kind", ["string", "array", ["object", "null"]])
def test_parameters_of_another_type_than_object_are_400(kind: Any) -> None:
    fn = {"type": "function", "function": {"name": "f", "parameters": {"type": kind}}}
    with pytest.raises(InvalidRequest, match=r"tools\[1\]\.function\.parameters must describe an object"):
        plan_tools(request(tools=[WEATHER, fn]))


def test_tool_schemas_are_checked_once_and_bad_ones_every_time() -> None:
    fn = {"name": "once", "parameters": {"type": "object", "properties": {"tool_once": {}}}}
    before = _cached_problem.cache_info()
    for _ in range(3):
        assert plan_tools(request(tools=[{"type": "function", "function": fn}])).mode == "auto"
    after = _cached_problem.cache_info()
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 2)
    bad = {"name": "bad", "parameters": {"type": "object", "properties": {"a": {"minLength": -1}}}}
    for _ in range(2):
        with pytest.raises(
            InvalidRequest,
            match=r"tools\[1\]\.function\.parameters is not a valid JSON schema at properties/a/minLength: ",
        ):
            plan_tools(request(tools=[WEATHER, {"type": "function", "function": bad}]))
    deep: dict[str, Any] = {}
    for _ in range(3000):  # deeper than the recursion limit, within the size bound
        deep = {"not": deep}
    with pytest.raises(InvalidRequest, match="nested too deeply"):
        plan_tools(request(tools=[{"type": "function", "function": {"name": "d", "parameters": deep}}]))


@pytest.mark.parametrize(
    "body",
    [
        {"tools": [{"type": "function"}]},
        {"tools": [{"type": "retrieval", "function": {"name": "f"}}]},
        {"tools": [{"type": "function", "function": {"name": "has spaces"}}]},
        {"tools": [WEATHER], "tool_choice": "sometimes"},
        {"functions": [{"name": "f"}]},
        {"function_call": {"name": "f"}},
        {"messages": [{"role": "function", "name": "f", "content": "x"}]},
    ],
)
def test_malformed_tool_bodies_fail_validation(body: dict[str, Any]) -> None:
    with pytest.raises((ValidationError, InvalidRequest)):  # InvalidRequest: the field as param
        request(**body)


@pytest.mark.parametrize(
    "messages",
    [
        USER + [{"role": "tool", "content": "18 C"}],  # no tool_call_id
        USER + [{"role": "tool", "tool_call_id": "call_x", "content": "18 C"}],  # answers nothing
        USER
        + [
            {"role": "assistant", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_2", "content": "x"},
        ],
        USER
        + [{"role": "assistant", "tool_calls": [CALL]}, {"role": "user", "content": "and?"}],  # unanswered
        [{"role": "user", "content": "x", "tool_calls": [CALL]}],  # calls on a user message
    ],
)
def test_malformed_tool_turns_are_400_messages(messages: list[dict[str, Any]]) -> None:
    with pytest.raises(InvalidRequest) as info:
        plan_tools(request(messages=messages, tools=[WEATHER]))
    assert info.value.param == "messages"


CALL_2 = {
    "id": "call_2",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
}


@pytest.mark.parametrize(
    ("messages", "unanswered"),
    [
        # two parallel calls, one answered: the answer was generated as if the other had none
        (
            USER
            + [
                {"role": "assistant", "content": None, "tool_calls": [CALL, CALL_2]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
            ],
            "call_2",
        ),
        (USER + [{"role": "assistant", "content": None, "tool_calls": [CALL]}], "call_1"),  # none answered
    ],
)
def test_calls_left_unanswered_at_the_end_are_400_as_openai(
    messages: list[dict[str, Any]], unanswered: str
) -> None:
    """OpenAI refuses a call without its tool message whether a user turn or the end of the
    list comes next; only the first was a 400 here, the second was answered as if the call
    had not been made (litellm, agents answering some of a parallel turn)."""
    with pytest.raises(InvalidRequest) as info:
        plan_tools(request(messages=messages, tools=[WEATHER]))
    assert info.value.param == "messages"
    assert info.value.message.startswith("messages[1]: an assistant message with 'tool_calls'")
    assert f"(unanswered: {unanswered})" in info.value.message


def test_a_tool_round_trip_is_accepted_and_names_the_function() -> None:
    messages = USER + [
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    req = request(messages=messages, tools=[WEATHER])
    assert plan_tools(req).mode == "auto"
    rendered = template_messages(req.messages)
    assert rendered[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert rendered[2] == {"role": "tool", "content": "18 C", "tool_call_id": "call_1", "name": "get_weather"}


@pytest.mark.parametrize(
    ("arguments", "given"), [("", {}), ("{oops", {}), ("[1]", {}), ('{"a": [1]}', {"a": [1]})]
)
def test_history_calls_reach_the_template_with_an_arguments_object(arguments: str, given: Any) -> None:
    """As vLLM hands them over: Hugging Face's tool templates (Qwen, Hermes, Llama) write
    ``arguments | tojson``, which double-encoded the JSON text; text that is no object is {}."""
    call = {**CALL, "function": {"name": "get_weather", "arguments": arguments}}
    messages = USER + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    rendered = template_messages(request(messages=messages, tools=[WEATHER]).messages)
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == given
    qwen_like = "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.arguments | tojson }}{% endfor %}{% endfor %}"
    from transformers.utils.chat_template_utils import render_jinja_template

    out, _ = render_jinja_template([rendered], chat_template=qwen_like)
    assert json.loads(out[0]) == given


def test_a_participants_name_reaches_the_template() -> None:
    """OpenAI's ``name`` tells participants apart; vLLM hands it to the template (Gemma's
    ignores it, a route's own ``chat_template`` may read it). It was dropped."""
    req = request(
        messages=[{"role": "user", "content": "Hi", "name": "ana"}, {"role": "user", "content": "Yo"}]
    )
    assert template_messages(req.messages) == [
        {"role": "user", "content": "Hi", "name": "ana"},
        {"role": "user", "content": "Yo"},
    ]


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (
            '{"name": "get_weather", "arguments": {"city": "Paris"}}',
            None,
            [("get_weather", {"city": "Paris"})],
        ),
        (' \n{"name": "add", "parameters": {"a": 1}}', None, [("add", {"a": 1})]),
        (
            '[{"name": "add", "arguments": {"a": 1}}, {"name": "add", "arguments": {"a": 2}}]',
            None,
            [("add", {"a": 1}), ("add", {"a": 2})],
        ),
        (
            '```tool_call\n{"name": "add", "arguments": "{\\"a\\": 3}"}\n```\nDone.',
            "Done.",
            [("add", {"a": 3})],
        ),
        ('```json\n{"name": "add", "arguments": {}}\n```', None, [("add", {})]),
        ("It is sunny in Paris.", "It is sunny in Paris.", []),
        ('{"name": "unknown", "arguments": {}}', '{"name": "unknown", "arguments": {}}', []),
        ('{"name": "add", "arguments": [1]}', '{"name": "add", "arguments": [1]}', []),
        ('{"name": "add", "arguments": {"a": 1}', '{"name": "add", "arguments": {"a": 1}', []),  # cut short
        ('Sure: {"name": "add", "arguments": {}}', 'Sure: {"name": "add", "arguments": {}}', []),
        # a call first, then text: the text is content
        ('{"name": "add", "arguments": {"a": 1}}\nDone.', "Done.", [("add", {"a": 1})]),
        (
            '{"name": "add", "arguments": {}}\n{"name": "add", "arguments": {}}',
            None,
            [("add", {}), ("add", {})],
        ),
        # text, then calls on lines of their own that end the answer (as the template writes it)
        ('Let me check.\n{"name": "add", "arguments": {"a": 1}}\n', "Let me check.", [("add", {"a": 1})]),
        (
            'Both:\n\n[{"name": "add", "arguments": {}},\n {"name": "get_weather", "arguments": {"city": "X"}}]',
            "Both:",
            [("add", {}), ("get_weather", {"city": "X"})],
        ),
        ('A\n{"x": 1}\n{"name": "add", "arguments": {}}', 'A\n{"x": 1}', [("add", {})]),
        (
            'Text\n{"name": "add", "arguments": {}} and more',
            'Text\n{"name": "add", "arguments": {}} and more',
            [],
        ),
        (
            'Text\n{"name": "add", "arguments": {}}\nMore.',
            'Text\n{"name": "add", "arguments": {}}\nMore.',
            [],
        ),
        ('Text\n{"name": "nope", "arguments": {}}', 'Text\n{"name": "nope", "arguments": {}}', []),
        ('Text\n{"name": "add", "arguments": {"a"', 'Text\n{"name": "add", "arguments": {"a"', []),
        (
            'See:\n```json\n{"name": "add", "arguments": {}}\n```',
            'See:\n```json\n{"name": "add", "arguments": {}}\n```',
            [],
        ),
        # not JSON (json.loads reads them; arguments must be JSON): no call
        ('{"name": "add", "arguments": {"a": NaN}}', '{"name": "add", "arguments": {"a": NaN}}', []),
        (
            '{"name": "add", "arguments": {"a": -Infinity}}',
            '{"name": "add", "arguments": {"a": -Infinity}}',
            [],
        ),
        ('{"name": "add", "arguments": {"a": 1e999}}', '{"name": "add", "arguments": {"a": 1e999}}', []),
        (
            '{"name": "add", "arguments": "{\\"a\\": NaN}"}',
            '{"name": "add", "arguments": "{\\"a\\": NaN}"}',
            [],
        ),
        ('{"name": "add", "arguments": {"a": 1e300, "b": 10e-2}}', None, [("add", {"a": 1e300, "b": 0.1})]),
    ],
)
def test_json_parser(text: str, content: str | None, calls: list[tuple[str, dict[str, Any]]]) -> None:
    got_content, got = parse_calls(text, ("get_weather", "add"))
    assert got_content == content
    assert [(c.name, json.loads(c.arguments, parse_constant=reject)) for c in got] == calls


def reject(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def test_answers_by_mode() -> None:
    tools = [WEATHER, ADD]
    named = plan_tools(request(tools=tools, tool_choice={"type": "function", "function": {"name": "add"}}))
    assert calls_of_answer(named, '{"a": 1}', "json") == (None, [ParsedCall("add", '{"a": 1}')])
    required = plan_tools(request(tools=tools, tool_choice="required"))
    content, calls = calls_of_answer(required, '[{"name": "add", "arguments": {"a": 2}}]', "json")
    assert content is None and calls == [ParsedCall("add", '{"a": 2}')]
    assert calls_of_answer(required, '[{"name": "add", "argu', "json") == ('[{"name": "add", "argu', [])
    auto = plan_tools(request(tools=tools))
    text = '{"name": "add", "arguments": {}}'
    assert calls_of_answer(auto, text, "json")[1] == [ParsedCall("add", "{}")]
    assert calls_of_answer(auto, text, "none") == (text, [])  # a route whose parser is off
    two = f"[{text}, {text}]"
    assert len(calls_of_answer(auto, two, "json")[1]) == 2
    single = plan_tools(request(tools=tools, parallel_tool_calls=False))
    assert len(calls_of_answer(single, two, "json")[1]) == 1  # parallel_tool_calls false: the first


# -- the tool-aware template, rendered as transformers renders it -----------------------
def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    out, _ = render_jinja_template(
        [messages],
        tools=tools,
        chat_template=TOOL_TEMPLATE_PATH.read_text(),
        add_generation_prompt=True,
        bos_token="<bos>",
    )
    return str(out[0])


def test_template_without_tools_matches_the_plain_gemma_template() -> None:
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "More"},
    ]
    plain, _ = render_jinja_template(
        [messages],
        chat_template=(TOOL_TEMPLATE_PATH.parent / "gemma.jinja").read_text(),
        add_generation_prompt=True,
        bos_token="<bos>",
    )
    assert render(messages) == plain[0]


def _gemma_reference(messages: list[dict[str, Any]]) -> str:
    """What gemma.jinja documents: system and developer texts, trimmed, folded into the first
    user turn (one made up when the first turn is the model's), each followed by a blank line."""
    system = "".join(m["content"].strip() + "\n\n" for m in messages if m["role"] in ("system", "developer"))
    turns = [m for m in messages if m["role"] not in ("system", "developer")]
    if system and (not turns or turns[0]["role"] == "assistant"):
        turns.insert(0, {"role": "user", "content": ""})
    out = "<bos>"
    for i, m in enumerate(turns):
        role = "model" if m["role"] == "assistant" else "user"
        prefix = system if i == 0 and role == "user" else ""
        out += f"<start_of_turn>{role}\n{prefix}{m['content'].strip()}<end_of_turn>\n"
    return out + "<start_of_turn>model\n"


def test_gemma_templates_render_as_documented_however_many_messages() -> None:
    """Both templates, without tools, on random conversations, 2,000 turns included: the
    prompt the filters build (linear in the turns) is the one documented."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rng = random.Random(7)
    texts = ["", " hi ", "two\nlines ", "ü"]
    for size in [*range(8), 2000]:
        messages = [
            {"role": rng.choice(["system", "developer", "user", "assistant"]), "content": rng.choice(texts)}
            for _ in range(size)
        ]
        for path in (TOOL_TEMPLATE_PATH.parent / "gemma.jinja", TOOL_TEMPLATE_PATH):
            out, _ = render_jinja_template(
                [messages], chat_template=path.read_text(), add_generation_prompt=True, bos_token="<bos>"
            )
            assert out[0] == _gemma_reference(messages), (path.name, messages)


def test_template_shows_tools_calls_and_results_and_the_parser_reads_its_call_format() -> None:
    req = request(
        messages=USER
        + [
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
        ],
        tools=[WEATHER],
    )
    plan = plan_tools(req)
    text = render(template_messages(req.messages), plan.template_tools())
    assert text.startswith("<bos><start_of_turn>user\nYou can call these functions:")
    assert json.dumps(WEATHER["function"]) in text
    model_turn = text.split("<start_of_turn>model\n")[1].split("<end_of_turn>")[0]
    assert parse_calls(model_turn, plan.names) == (None, [ParsedCall("get_weather", '{"city": "Paris"}')])
    assert "<start_of_turn>user\nResult of get_weather: 18 C, sunny<end_of_turn>" in text
    assert text.endswith("<start_of_turn>model\n")


@pytest.mark.parametrize("calls", [[CALL], [CALL, {**CALL, "id": "call_2"}]])
def test_parser_reads_back_a_turn_with_text_and_calls_as_the_template_writes_it(
    calls: list[dict[str, Any]],
) -> None:
    req = request(
        messages=USER
        + [{"role": "assistant", "content": "Let me check.", "tool_calls": calls}]
        + [{"role": "tool", "tool_call_id": c["id"], "content": "18 C"} for c in calls],
        tools=[WEATHER, ADD],
    )
    plan = plan_tools(req)
    text = render(template_messages(req.messages), plan.template_tools())
    model_turn = text.split("<start_of_turn>model\n")[1].split("<end_of_turn>")[0]
    assert model_turn.startswith("Let me check.\n")
    content, got = parse_calls(model_turn, plan.names)
    assert content == "Let me check."
    assert got == [ParsedCall("get_weather", '{"city": "Paris"}')] * len(calls)


# -- the stream encoder and whole responses, with the fake engine -----------------------
def make_gen(words: list[str], n: int = 1, tool_parser: Any = "json", **kw: Any) -> Any:
    from gateway.catalog import Catalog, Route, RoutingTable
    from gateway.service import Generation
    from gateway.types import SamplingSpec
    from tests.unit.fakes import FakeEngine

    base = Route(name="base-model", kind="base", tool_parser=tool_parser)
    table = RoutingTable(base=base, routes={}, errors={})
    spec = SamplingSpec(max_tokens=kw.pop("max_tokens", 50), n=n, temperature=1.0)
    gen = Generation(
        FakeEngine(words=words), Catalog(lambda ids: table).acquire(None), [1, 2], spec, spec, "chatcmpl"
    )
    gen.tools = plan_tools(request(**{"tools": [WEATHER, ADD], **kw}))
    return gen


async def stream_chunks(gen: Any) -> list[dict[str, Any]]:
    from gateway.sse import encode_stream
    from gateway.sse_tools import ToolChatEncoder

    raw = b"".join([part async for part in encode_stream(gen, ToolChatEncoder(gen, include_usage=False))])
    parts = [p for p in raw.decode().split("\n\n") if p]
    assert parts[-1] == "data: [DONE]"
    return [json.loads(p.removeprefix("data: ")) for p in parts[:-1]]


def assemble(chunks: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """What the openai SDK's stream helper does with the deltas, per choice."""
    out: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            msg = out.setdefault(choice["index"], {"content": None, "tool_calls": {}, "finish_reason": None})
            delta = choice["delta"]
            if delta.get("content"):
                msg["content"] = (msg["content"] or "") + delta["content"]
            for tc in delta.get("tool_calls", []):
                call = msg["tool_calls"].setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
                call["id"] = tc.get("id") or call["id"]
                call["name"] = tc.get("function", {}).get("name") or call["name"]
                call["arguments"] += tc.get("function", {}).get("arguments", "")
            msg["finish_reason"] = choice["finish_reason"] or msg["finish_reason"]
    return out


async def test_named_stream_sends_the_name_first_then_argument_fragments() -> None:
    words = ['{"city"', ': "Par', 'is"}']
    gen = make_gen(words, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    chunks = await stream_chunks(gen)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": None}
    head = deltas[1]["tool_calls"][0]
    assert head["index"] == 0 and head["id"].startswith("call_") and head["type"] == "function"
    assert head["function"] == {"name": "get_weather", "arguments": ""}
    fragments = [d["tool_calls"][0]["function"]["arguments"] for d in deltas[2:] if d.get("tool_calls")]
    assert fragments == words  # streamed as generated
    msg = assemble(chunks)[0]
    assert msg["finish_reason"] == "stop" and msg["content"] is None  # a forced call: see below
    assert msg["tool_calls"] == {
        0: {"id": head["id"], "name": "get_weather", "arguments": '{"city": "Paris"}'}
    }


@pytest.mark.parametrize(
    ("choice", "max_tokens", "finish"),
    [
        ("named", 4, "stop"),
        ("named", 2, "length"),
        ("required", 4, "tool_calls"),
        ("required", 2, "length"),
        ("auto", 4, "tool_calls"),
    ],
)
@pytest.mark.parametrize("n", [1, 2])
async def test_finish_reason_of_calls_follows_the_tool_choice(
    choice: str, max_tokens: int, finish: str, n: int
) -> None:
    """OpenAI's API and vLLM's server end a forced function's call with ``stop``, calls under
    ``required`` and ``auto`` with ``tool_calls``; ``length`` stays; streamed or not alike,
    each choice of ``n``, with ``parallel_tool_calls: false`` too."""
    from gateway.sse_tools import tool_chat_response

    answers = {
        "named": ['{"city"', ': "Par', 'is"}'],
        "required": ['[{"name": "get_weather", ', '"arguments": {"city"', ': "Paris"}}]'],
        "auto": ['{"name": "get_weather", ', '"arguments": {"city"', ': "Paris"}}'],
    }
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else choice
    kw: dict[str, Any] = {"tool_choice": tool_choice, "max_tokens": max_tokens}
    if n > 1:
        kw["parallel_tool_calls"] = False
    streamed = assemble(await stream_chunks(make_gen(answers[choice], n, **kw)))
    whole = make_gen(answers[choice], n, **kw)
    choices = tool_chat_response(whole, await whole.collect())["choices"]
    assert len(choices) == len(streamed) == n
    for body, msg in zip(choices, (streamed[i] for i in range(n)), strict=True):
        assert body["finish_reason"] == msg["finish_reason"] == finish
        (call,) = body["message"]["tool_calls"]  # a call in both, whatever the finish reason
        assert call["function"]["name"] == msg["tool_calls"][0]["name"] == "get_weather"


async def test_required_stream_sends_each_name_then_its_argument_fragments() -> None:
    words = [
        '[{"name": "ad',
        'd", "arguments": {"a"',
        ": 1}}, ",
        '{"name": "get_weather", "arguments": {"city": "X"}}]',
    ]
    chunks = await stream_chunks(make_gen(words, tool_choice="required"))
    deltas = [c["choices"][0]["delta"].get("tool_calls") for c in chunks]
    deltas = [d[0] for d in deltas if d]
    assert deltas[0]["function"] == {"name": "add", "arguments": ""} and deltas[0]["index"] == 0
    assert [d["function"]["arguments"] for d in deltas[1:3]] == ['{"a"', ": 1}"]  # streamed as generated
    assert deltas[3]["index"] == 1 and deltas[3]["function"]["name"] == "get_weather"
    msg = assemble(chunks)[0]
    assert msg["finish_reason"] == "tool_calls"
    calls = msg["tool_calls"]
    assert [calls[0]["name"], calls[1]["name"]] == ["add", "get_weather"]
    assert json.loads(calls[0]["arguments"]) == {"a": 1} and json.loads(calls[1]["arguments"]) == {
        "city": "X"
    }
    assert calls[0]["id"] != calls[1]["id"]


async def test_required_with_one_function_sends_its_head_before_any_token() -> None:
    words = ['[{"name": "a', 'dd", "arguments": {"a"', ": 1}}, ", '{"name": "add", "arguments": {}}]']
    chunks = await stream_chunks(make_gen(words, tools=[ADD], tool_choice="required"))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": None}
    (head,) = deltas[1]["tool_calls"]  # the engine has produced nothing yet
    assert head["index"] == 0 and head["function"] == {"name": "add", "arguments": ""}
    heads = [d for delta in deltas for d in delta.get("tool_calls") or () if "name" in d.get("function", {})]
    assert [(h["index"], h["function"]["name"]) for h in heads] == [(0, "add"), (1, "add")]  # no repeat
    msg = assemble(chunks)[0]
    assert msg["finish_reason"] == "tool_calls" and msg["content"] is None
    assert [json.loads(c["arguments"]) for c in msg["tool_calls"].values()] == [{"a": 1}, {}]
    cut = make_gen(['[{"name": "ad'], tools=[ADD], tool_choice="required", max_tokens=1)
    msg = assemble(await stream_chunks(cut))[0]  # cut before the name: the call announced stays
    assert msg["finish_reason"] == "length" and msg["content"] is None
    assert msg["tool_calls"][0]["name"] == "add" and msg["tool_calls"][0]["arguments"] == ""


def test_required_arguments_are_the_generated_text_not_a_rewrite() -> None:
    # 1e999 is a JSON number; parsed and written again it was Infinity, which is not JSON,
    # and the whole response disagreed with the stream's fragments.
    text = '[{"name": "add", "arguments": {"a": 1e999, "b": 1.50}}, {"name": "f", "arguments": {}}]'
    assert parse_required(text) == [
        ParsedCall("add", '{"a": 1e999, "b": 1.50}'),
        ParsedCall("f", "{}"),
    ]
    # cut short by max_tokens: the calls so far, the last one's arguments as far as they got
    assert parse_required(text[: text.index('"b"')]) == [ParsedCall("add", '{"a": 1e999, ')]
    assert parse_required(text[: text.index("add")]) == []  # no name yet


@pytest.mark.parametrize(
    ("words", "tools"),
    [
        # a complete call, then a second one cut short by max_tokens
        (['[{"name": "add", "arguments": {"a": 1}}, ', '{"name": "add", "arguments": {"a'], None),
        # the only call, its name out, its arguments cut short
        (['[{"name": "add", ', '"arguments": {"a'], None),
        # blanks between the colon and the arguments come in a piece of their own
        (['[{"name": "add", "arguments":', " ", ' {"a": 1}}]'], None),
        # one function offered: announced before any token, cut short before its name
        (['[{"na'], "one"),
        # one step ends a call and starts the next (vLLM merges steps when its reader lags)
        (['[{"name": "add", "arguments": {"a"', ': 1}}, {"name": "get_weather", "arguments": {}}]'], None),
        # the whole list in one step
        (['[{"name": "add", "arguments": {"a": 1}}, {"name": "get_weather", "arguments": {}}]'], None),
    ],
)
async def test_a_required_answer_whole_agrees_with_its_stream(words: list[str], tools: str | None) -> None:
    """Cut short by max_tokens (or not), the whole response carries the calls the stream sent
    (it was the grammar's raw JSON list as content, with no tool_calls), with the same text."""
    from gateway.sse_tools import tool_chat_response

    extra: dict[str, Any] = {"tools": [ADD]} if tools == "one" else {}
    finish = "stop" if words[-1].endswith("]") else "length"
    limit = len(words) + (finish == "stop")  # the fake engine ends with length at max_tokens
    msg = assemble(await stream_chunks(make_gen(words, tool_choice="required", max_tokens=limit, **extra)))[0]
    whole = make_gen(words, tool_choice="required", max_tokens=limit, **extra)
    choice = tool_chat_response(whole, await whole.collect())["choices"][0]
    assert choice["finish_reason"] == msg["finish_reason"] == ("tool_calls" if finish == "stop" else finish)
    assert choice["message"]["content"] is None and msg["content"] is None
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]]
    assert calls and calls == [(c["name"], c["arguments"]) for c in msg["tool_calls"].values()]


async def test_required_stream_numbers_calls_of_one_step_in_order() -> None:
    words = ['[{"name": "add", "arguments": {"a": 1}}, {"name": "get_weather", "arguments": {}}]']
    chunks = await stream_chunks(make_gen(words, tool_choice="required"))
    deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls") or ()]
    heads = [(d["index"], d["function"]["name"]) for d in deltas if "name" in d["function"]]
    assert heads == [(0, "add"), (1, "get_weather")]
    assert [d["index"] for d in deltas] == [0, 0, 1, 1]  # each head, then its arguments


def test_required_scanner_survives_any_split_and_braces_in_strings() -> None:
    text = (
        '[{"name": "add", "arguments": {"a": "x}{\\"]", "b": [1, {"c": 2}]}}, {"name": "f", "arguments": {}}]'
    )
    for size in (1, 2, 5, len(text)):
        scanner, names, args = RequiredCallScanner(), [], []
        for i in range(0, len(text), size):
            for kind, value, k in scanner.feed(text[i : i + size]):
                assert k == len(names) - (kind == "arguments")  # its own call's index
                if kind == "name":
                    names.append(value)
                    args.append("")
                else:
                    args[-1] += value
        assert names == ["add", "f"]
        assert [json.loads(a) for a in args] == [{"a": 'x}{"]', "b": [1, {"c": 2}]}, {}]


async def test_auto_stream_plain_text_flows_at_once() -> None:
    chunks = await stream_chunks(make_gen(["It", " is", " sunny."]))
    contents = [c["choices"][0]["delta"].get("content") for c in chunks]
    assert contents == [None, "It", " is", " sunny."]
    msg = assemble(chunks)[0]
    assert msg["content"] == "It is sunny." and msg["tool_calls"] == {} and msg["finish_reason"] == "stop"


async def test_auto_stream_on_a_route_that_reads_no_calls_flows_whatever_it_opens_with() -> None:
    """Under ``tool_parser: none`` an answer is text however it starts: a code block, a JSON
    object or a call's shape streamed nothing until the choice ended, then all at once."""
    for words in (["```", "python\n", "print(1)", "\n```"], ['{"name": "add",', ' "arguments": {}}']):
        chunks = await stream_chunks(make_gen(words, tool_parser="none"))
        assert [c["choices"][0]["delta"].get("content") for c in chunks] == [None, *words]
        msg = assemble(chunks)[0]
        assert msg["tool_calls"] == {} and msg["finish_reason"] == "stop"


async def test_auto_stream_call_is_buffered_and_parsed() -> None:
    chunks = await stream_chunks(make_gen(["  {", '"name": "add", "arguments": {"a": 2}', "}"], n=2))
    for msg in assemble(chunks).values():
        assert msg["content"] is None and msg["finish_reason"] == "tool_calls"
        assert msg["tool_calls"][0]["name"] == "add" and json.loads(msg["tool_calls"][0]["arguments"]) == {
            "a": 2
        }


@pytest.mark.parametrize(
    "answer",
    [
        "It is sunny.  ",
        'Let me check.\n{"name": "add", "arguments": {"a": 1}}',
        'Let me check. \n\n[{"name": "add", "arguments": {}}, {"name": "add", "arguments": {"a": 2}}]\n',
        'Text\n{"name": "add", "arguments": {}} and more\n{"x": 1}\nend',
        'A [link](x)\n[1] note\n{"name": "add", "arguments": {"a": 3}}',
        'Code:\n```python\nprint({"a": 1})\n```\nDone.',
        'Cut\n{"name": "add", "arguments": {"a": ',
        '{"name": "add", "arguments": {"a": 1}}\nThat is all.',
        '  {"name": "add", "arguments": {"a": NaN}}',
        '```tool_call\n{"name": "add", "arguments": {}}\n```\nok',
    ],
)
@pytest.mark.parametrize("size", [1, 2, 5, 1000])
async def test_auto_stream_adds_up_to_the_whole_response(answer: str, size: int) -> None:
    from gateway.sse_tools import tool_chat_response

    words = [answer[i : i + size] for i in range(0, len(answer), size)]
    whole = make_gen(words)
    message = tool_chat_response(whole, await whole.collect())["choices"][0]
    msg = assemble(await stream_chunks(make_gen(words)))[0]
    assert msg["content"] == message["message"]["content"]
    calls = [
        (c["function"]["name"], c["function"]["arguments"]) for c in message["message"].get("tool_calls", [])
    ]
    assert [(c["name"], c["arguments"]) for c in msg["tool_calls"].values()] == calls
    assert msg["finish_reason"] == message["finish_reason"]


async def test_auto_stream_sends_text_before_a_call_as_it_comes() -> None:
    words = ["Let", " me", " check.", "\n", '{"name": "add", ', '"arguments": {"a": 1}}']
    chunks = await stream_chunks(make_gen(words))
    contents = [c["choices"][0]["delta"].get("content") for c in chunks]
    assert contents[:4] == [None, "Let", " me", " check."]  # the newline waits: a call may follow
    msg = assemble(chunks)[0]
    assert msg["content"] == "Let me check." and msg["finish_reason"] == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in msg["tool_calls"].values()] == [
        ("add", {"a": 1})
    ]
    chunks = await stream_chunks(make_gen(["Lines:", "\n", "[link]", "(x) and", " more"]))
    contents = [c["choices"][0]["delta"].get("content") for c in chunks]
    assert contents == [None, "Lines:", "\n[link](x) and", " more"]  # not JSON after all: it flows


async def test_auto_stream_json_that_is_no_call_ends_as_content() -> None:
    msg = assemble(await stream_chunks(make_gen(["{", '"x": 1}'])))[0]
    assert msg["content"] == '{"x": 1}' and msg["tool_calls"] == {} and msg["finish_reason"] == "stop"


async def test_cut_short_required_answer() -> None:
    gen = make_gen(['[{"name": "add", ', '"argu'], tool_choice="required", max_tokens=2)
    msg = assemble(await stream_chunks(gen))[0]  # before a name is complete: the text
    assert msg["finish_reason"] == "length" and msg["tool_calls"] == {}
    assert msg["content"] == '[{"name": "add", "argu'
    gen = make_gen(['[{"name": "add", ', '"arguments": {"a'], tool_choice="required", max_tokens=2)
    msg = assemble(await stream_chunks(gen))[0]  # after: the call so far, as OpenAI does
    assert msg["finish_reason"] == "length" and msg["content"] is None
    assert msg["tool_calls"][0]["name"] == "add" and msg["tool_calls"][0]["arguments"] == '{"a'


async def test_whole_response_carries_tool_calls() -> None:
    from gateway.sse_tools import tool_chat_response

    gen = make_gen(['{"name": "add", "arguments": {"a": 5}}'])
    body = tool_chat_response(gen, await gen.collect())
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None and choice["message"]["role"] == "assistant"
    (call,) = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "add", "arguments": '{"a": 5}'}
    plain = make_gen(["Just", " text"])
    choice = tool_chat_response(plain, await plain.collect())["choices"][0]
    assert (
        choice["message"] == {"role": "assistant", "content": "Just text"}
        and choice["finish_reason"] == "stop"
    )


async def test_service_renders_tools_with_the_tool_template_and_constrains_forced_calls() -> None:
    from gateway.catalog import Catalog, Route, RoutingTable
    from gateway.service import ChatService
    from gateway.settings import LimitSettings
    from gateway.tools import tool_template
    from tests.unit.fakes import FakeEngine

    engine = FakeEngine(max_model_len=1000)
    seen: list[dict[str, Any]] = []
    render = engine.tokenizer.apply_chat_template

    def spy(conversation: Any, **kwargs: Any) -> str:
        seen.append(kwargs)
        return render(conversation, **kwargs)

    engine.tokenizer.apply_chat_template = spy  # type: ignore[method-assign]
    table = RoutingTable(base=Route(name="b", kind="base"), routes={}, errors={})
    service = ChatService(engine, LimitSettings())
    catalog = Catalog(lambda ids: table)
    gen = await service.chat(request(tools=[WEATHER], tool_choice="required"), catalog.acquire(None))
    await gen.collect()
    assert seen[0]["chat_template"] == tool_template() and seen[0]["tools"] == [WEATHER]
    assert engine.calls[0][1].constraint is not None and engine.calls[0][1].constraint.kind == "json"
    assert gen.tools.mode == "required"
    gen = await service.chat(request(), catalog.acquire(None))  # no tools: the model's own template
    await gen.collect()
    assert "chat_template" not in seen[1] and "tools" not in seen[1]
    assert engine.calls[1][1].constraint is None


def test_completions_still_refuse_tools() -> None:
    from gateway.protocol import CompletionRequest

    with pytest.raises(InvalidRequest) as info:
        CompletionRequest.model_validate({"prompt": "x", "tools": [WEATHER]})
    assert info.value.param == "tools"
    with pytest.raises(InvalidRequest) as info:
        CompletionRequest.model_validate({"prompt": "x", "tool_choice": "required"})
    assert info.value.param == "tool_choice"


# -- tool_choice auto with a structured output: an answer in the format, or calls ------------
CITY = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "near": {"$ref": "#/$defs/Near"}, "twin": {"$ref": "#"}},
    "required": ["name"],
    "additionalProperties": False,
    "$defs": {"Near": {"type": "array", "items": {"type": "string"}}},
}
A_CALL = {"name": "add", "arguments": {"a": 2}}


def test_auto_tools_and_a_json_schema_admit_an_answer_or_calls() -> None:
    import jsonschema
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    from gateway.structured import xgrammar_gap
    from gateway.tools import answer_or_calls_schema

    lookup = {  # a tool schema xgrammar could not enforce does not reach the grammar
        "type": "function",
        "function": {"name": "lookup", "parameters": {"type": "object", "anyOf": [{"required": ["id"]}]}},
    }
    plan = plan_tools(request(tools=[WEATHER, ADD, lookup]))
    schema = answer_or_calls_schema(plan.tools, plan.parallel, CITY)
    assert xgrammar_gap(schema) is None
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    takes = [
        {"name": "Oslo", "near": ["Bergen"], "twin": {"name": "Paris"}},  # the answer, its refs intact
        A_CALL,
        [A_CALL, {"name": "get_weather", "arguments": {"city": "Paris"}}],
    ]
    # a call's arguments are any object (read, as under auto without a format); its name is not
    refuses = [
        {"name": "nope", "arguments": {}},
        {"name": "add", "arguments": 3},
        {"name": "Oslo", "near": [1]},
        [],
        {"town": "Oslo"},
    ]
    validator = jsonschema.Draft202012Validator(schema)
    for value in takes:
        assert validator.is_valid(value) and _is_grammar_accept_string(grammar, json.dumps(value)), value
    for value in refuses:
        assert not validator.is_valid(value) and not _is_grammar_accept_string(grammar, json.dumps(value)), (
            value
        )
    # one call at most: a list of two is no longer taken
    one = answer_or_calls_schema(plan.tools, False, CITY)
    assert not jsonschema.Draft202012Validator(one).is_valid([A_CALL, A_CALL])


def test_a_strict_functions_arguments_are_decoded_against_its_schema_beside_the_answer() -> None:
    """Under auto with a format, a strict function's call had any arguments; the parser takes
    a strict call only if they validate, so the answer was call-shaped text that followed
    neither (openai-agents: tools strict by default, an agent's output_type the format)."""
    import jsonschema
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    from gateway.tools import answer_or_calls_schema

    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}  # type: ignore[dict-item]
    plan = plan_tools(request(tools=[strict, ADD]))
    schema = answer_or_calls_schema(plan.tools, plan.parallel, CITY, decoded={"get_weather"})
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    weather = {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}
    takes = [weather, A_CALL, [weather, A_CALL], {"name": "Oslo"}]
    refuses = [
        {"name": "get_weather", "arguments": {"city": ["Paris", {"type": "string"}]}},
        {"name": "get_weather", "arguments": {"days": 2}},
        [A_CALL, {"name": "get_weather", "arguments": {}}],
    ]
    validator = jsonschema.Draft202012Validator(schema)
    for value in takes:
        assert validator.is_valid(value) and _is_grammar_accept_string(grammar, json.dumps(value)), value
    for value in refuses:
        accepted = _is_grammar_accept_string(grammar, json.dumps(value))
        assert not validator.is_valid(value) and not accepted, value


def test_a_strict_function_the_grammar_cannot_hold_is_called_whatever_its_arguments() -> None:
    """A strict function whose schema the backend refuses (pydantic's HttpUrl: ``format:
    uri``) or would not enforce whole: beside a format its arguments stay free (decoding
    them would fail the whole request), and its call is a call even where they do not
    validate, since text there must be the format (it came back as text that was neither)."""
    from gateway.errors import InvalidRequest
    from tests.unit.test_responses_app import ReadyEngine, make_app, sdk

    class NoFormats(ReadyEngine):
        def prepare(self, sampling: Any) -> Any:
            if sampling.constraint is not None and '"format"' in json.dumps(sampling.constraint.value):
                raise InvalidRequest("features not supported by xgrammar", param="response_format")
            return super().prepare(sampling)

    fetch = {
        "type": "function",
        "function": {
            "name": "fetch",
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {"url": {"type": "string", "format": "uri"}},
                "required": ["url"],
            },
        },
    }
    strict_weather = {"type": "function", "function": {**WEATHER["function"], "strict": True}}  # type: ignore[dict-item]
    engine = NoFormats(words=['{"name": "fetch", "arguments": {"link": 3}}'], max_model_len=2000)
    client = sdk(make_app(engine))
    fmt = {"type": "json_schema", "json_schema": {"name": "City", "schema": CITY, "strict": True}}
    r = client.chat.completions.create(
        model="base-model", messages=USER, tools=[fetch, strict_weather], response_format=fmt
    )
    (call,) = r.choices[0].message.tool_calls or []
    assert call.function.name == "fetch" and json.loads(call.function.arguments) == {"link": 3}  # type: ignore[union-attr]
    assert r.choices[0].finish_reason == "tool_calls"
    decoded = _engine_constraint(engine).value["$defs"]
    assert "get_weather" in decoded and "fetch" not in decoded  # the strict one it holds is decoded
    # without a format a strict call still needs arguments that validate: text otherwise
    r = client.chat.completions.create(model="base-model", messages=USER, tools=[fetch])
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_stop_sequences_do_not_cut_a_forced_call(choice: Any) -> None:
    """A stop string met inside a forced call cut its arguments (``{"city": "``), and the
    answer still said the call was whole (finish_reason tool_calls). A forced answer is all
    call, which its grammar ends; stop sequences end text. Bad ones are still a 400."""
    from tests.unit.test_responses_app import ReadyEngine, make_app, sdk

    engine = ReadyEngine(words=["{}"], max_model_len=2000)
    client = sdk(make_app(engine))
    kw: dict[str, Any] = dict(model="base-model", messages=USER, tools=[WEATHER], tool_choice=choice)
    client.chat.completions.create(stop=["Paris"], extra_body={"stop_token_ids": [7]}, **kw)
    sampling = engine.calls[-1][1]
    assert sampling.stop == () and sampling.stop_token_ids == () and sampling.constraint is not None
    client.chat.completions.create(stop=["Paris"], **{**kw, "tool_choice": "auto"})
    assert engine.calls[-1][1].stop == ("Paris",)  # text may follow: stop applies
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(stop=[""], **kw)
    assert bad.value.body["param"] == "stop"  # type: ignore[index]


def test_a_structured_output_beside_a_forced_call_is_checked_by_the_grammar_backend() -> None:
    """Beside a forced call a structured output shapes nothing but is checked: a regex the
    backend refuses (``(``) was a 200 under required, a 400 under tool_choice none."""
    from gateway.errors import InvalidRequest
    from tests.unit.test_responses_app import ReadyEngine, make_app, sdk

    class Refuses(ReadyEngine):
        def prepare(self, sampling: Any) -> Any:
            if sampling.constraint is not None and sampling.constraint.value == "(":
                raise InvalidRequest("invalid regex", param="response_format")
            return super().prepare(sampling)

    client = sdk(make_app(Refuses(words=["{}"], max_model_len=2000)))
    for choice in ("required", "none", {"type": "function", "function": {"name": "get_weather"}}):
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(
                model="base-model",
                messages=USER,
                tools=[WEATHER],  # type: ignore[list-item]
                tool_choice=choice,  # type: ignore[arg-type]
                extra_body={"structured_outputs": {"regex": "("}},
            )
        assert bad.value.body["param"] == "structured_outputs", choice  # type: ignore[index]


def _grammar_accepts(schema: dict[str, Any], text: str) -> bool:
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    return bool(_is_grammar_accept_string(grammar, text))


FORMAT = {"type": "json_schema", "json_schema": {"name": "City", "schema": CITY, "strict": True}}


def test_a_format_answer_that_holds_a_tool_name_stays_the_answer() -> None:
    """CITY admits {"name": "add"}, which only the answer branch of the grammar takes (a
    call is exactly name and arguments): it was read as a call to add({}), the answer lost."""
    from tests.unit.test_responses_app import ReadyEngine, make_app, sdk

    text = '{"name": "add"}'
    engine = ReadyEngine(words=[text], max_model_len=2000)
    client = sdk(make_app(engine))
    r = client.chat.completions.create(model="base-model", messages=USER, tools=[ADD], response_format=FORMAT)  # type: ignore[list-item,arg-type]
    assert _grammar_accepts(_engine_constraint(engine).value, text)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content == text


def test_a_call_the_grammar_wrote_beside_a_format_is_a_call() -> None:
    """xgrammar admits a key twice among additionalProperties; Python's json keeps the last,
    so the strict validator's minProperties failed and the call came back as content that
    was not the format either. Beside a format the grammar decides what is a call."""
    params = {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2}
    tally = {"type": "function", "function": {"name": "tally", "strict": True, "parameters": params}}
    text = '{"name": "tally", "arguments": {"x": 3, "x": 4}}'
    from tests.unit.test_responses_app import ReadyEngine, make_app, sdk

    engine = ReadyEngine(words=[text], max_model_len=2000)
    client = sdk(make_app(engine))
    r = client.chat.completions.create(
        model="base-model", messages=USER, tools=[tally], response_format=FORMAT
    )  # type: ignore[list-item,arg-type]
    schema = _engine_constraint(engine).value
    assert "tally" in schema["$defs"] and _grammar_accepts(schema, text)
    assert [c.function.name for c in r.choices[0].message.tool_calls or []] == ["tally"]  # type: ignore[union-attr]


@pytest.mark.parametrize("params", [{}, {"type": "object"}])
def test_a_strict_function_of_any_object_takes_arguments_beside_a_format(params: dict[str, Any]) -> None:
    """Reached through a $ref, {"type": "object"} is {} alone to xgrammar's strict mode
    (vLLM's): a strict function with free parameters could be called with no argument."""
    from tests.unit.test_responses_app import ReadyEngine, make_app, sdk

    note = {"type": "function", "function": {"name": "note", "strict": True, "parameters": params}}
    engine = ReadyEngine(words=["x"], max_model_len=2000)
    client = sdk(make_app(engine))
    client.chat.completions.create(model="base-model", messages=USER, tools=[note], response_format=FORMAT)  # type: ignore[list-item,arg-type]
    assert _grammar_accepts(_engine_constraint(engine).value, '{"name": "note", "arguments": {"text": "hi"}}')


META = {
    "type": "object",
    "properties": {"meta": {"$ref": "#/$defs/Meta"}, "old": {"$ref": "#/definitions/Old"}},
    "required": ["meta"],
    "$defs": {"Meta": {"type": "object", "description": "free-form metadata"}},
    "definitions": {"Old": {"type": "object"}},
}


@pytest.mark.parametrize("field", ["named", "response_format", "structured_outputs", "completions"])
def test_a_referenced_any_object_takes_a_non_empty_object(field: str) -> None:
    """As beside a format (above), and under ``required``: a named function's parameters, a
    format's schema or vLLM's ``structured_outputs.json`` reached the engine as sent, so an
    any-object property could only be {}."""
    from tests.unit.test_responses_app import ReadyEngine, make_app, sdk

    engine = ReadyEngine(words=["{}"], max_model_len=2000)
    client = sdk(make_app(engine))
    f = {"type": "function", "function": {"name": "f", "parameters": META}}
    if field == "named":
        choice = {"type": "function", "function": {"name": "f"}}
        client.chat.completions.create(model="base-model", messages=USER, tools=[f], tool_choice=choice)  # type: ignore[list-item,arg-type]
    elif field == "response_format":
        fmt = {"type": "json_schema", "json_schema": {"name": "m", "schema": META}}
        client.chat.completions.create(model="base-model", messages=USER, response_format=fmt)  # type: ignore[arg-type]
    elif field == "structured_outputs":
        body = {"structured_outputs": {"json": META}}
        client.chat.completions.create(model="base-model", messages=USER, extra_body=body)
    else:
        client.completions.create(
            model="base-model", prompt="x", extra_body={"structured_outputs": {"json": META}}
        )
    schema = _engine_constraint(engine).value
    assert _grammar_accepts(schema, '{"meta": {"source": "web"}, "old": {"a": [1]}}')
    assert not _grammar_accepts(schema, '{"meta": 5}')
    assert META["$defs"]["Meta"] == {"type": "object", "description": "free-form metadata"}  # not changed


def _engine_constraint(engine: Any) -> Any:
    return engine.calls[-1][1].constraint


def test_auto_tools_and_a_format_reach_the_engine_as_either() -> None:
    """openai-agents sends an agent's output_type with its tools (auto) on every turn: the
    format alone left no room for a call, so the agent's tools were never called."""
    import jsonschema

    from tests.unit.test_responses_app import ReadyEngine, make_app, sdk

    engine = ReadyEngine(words=["{}"], max_model_len=2000)
    client = sdk(make_app(engine))
    fmt = {"type": "json_schema", "json_schema": {"name": "City", "schema": CITY, "strict": True}}
    client.chat.completions.create(model="base-model", messages=USER, tools=[ADD], response_format=fmt)
    chat = _engine_constraint(engine)
    tool = {"type": "function", "name": "add", "parameters": ADD["function"]["parameters"]}
    text = {"format": {"type": "json_schema", "name": "final_output", "schema": CITY, "strict": True}}
    client.responses.create(model="base-model", input="Hi", tools=[tool], text=text)
    for constraint in (chat, _engine_constraint(engine)):
        validator = jsonschema.Draft202012Validator(constraint.value)
        assert validator.is_valid(A_CALL) and validator.is_valid({"name": "Oslo"})
        assert not validator.is_valid({"town": "Oslo"})
    # without tools, or with tool_choice none, the format alone
    client.chat.completions.create(model="base-model", messages=USER, response_format=fmt)
    assert _engine_constraint(engine).value == CITY
    client.chat.completions.create(
        model="base-model", messages=USER, tools=[ADD], tool_choice="none", response_format=fmt
    )
    assert _engine_constraint(engine).value == CITY
    # json_object: a call is a JSON object already
    obj = {"type": "json_object"}
    client.chat.completions.create(model="base-model", messages=USER, tools=[ADD], response_format=obj)
    assert _engine_constraint(engine).kind == "json_object"


def test_auto_tools_and_a_format_that_cannot_hold_a_call() -> None:
    from gateway.catalog import Catalog, Route, RoutingTable
    from gateway.types import Constraint
    from tests.unit.test_responses_app import ReadyEngine, make_app, sdk

    engine = ReadyEngine(words=["{}"], max_model_len=2000)
    http = make_app(engine)
    routes = {
        "fixed": Route(name="fixed", kind="preset", response_format=Constraint("json", CITY), enforce=True),
        "plain": Route(name="plain", kind="preset", tool_parser="none"),
    }
    table = RoutingTable(base=Route(name="base-model", kind="base"), routes=routes, errors={})
    http.app.state.gateway.catalog = Catalog(lambda ids: table)  # type: ignore[attr-defined]
    client = sdk(http)
    fmt = {"type": "json_schema", "json_schema": {"name": "City", "schema": CITY}}
    # a route that enforces its format keeps it; one that reads no calls keeps the asked one
    client.chat.completions.create(model="fixed", messages=USER, tools=[ADD])
    assert _engine_constraint(engine) == Constraint("json", CITY)
    client.chat.completions.create(model="plain", messages=USER, tools=[ADD], response_format=fmt)
    assert _engine_constraint(engine) == Constraint("json", CITY)
    # a regex leaves no room for a call: a 400, not tools that can never be called
    r = http.post(
        "/v1/chat/completions",
        json={"model": "base-model", "messages": USER, "tools": [ADD], "structured_outputs": {"regex": "a+"}},
        headers={"authorization": f"Bearer {client.api_key}"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs", r.text


def test_tools_too_costly_together_are_400() -> None:
    """Each function is small, but ``required`` compiles them into one grammar."""
    properties = {f"p{i}": {"type": "string"} for i in range(40)}
    tools = [
        {
            "type": "function",
            "function": {"name": f"f{t}", "parameters": {"type": "object", "properties": properties}},
        }
        for t in range(20)
    ]
    with pytest.raises(InvalidRequest, match="parameters together: the schema is too costly") as info:
        plan_tools(request(tools=tools, tool_choice="required"))
    assert info.value.param == "tools"
    assert plan_tools(request(tools=tools[:10], tool_choice="required")).mode == "required"
    # Under auto (and none) no grammar is made of them: only the per-function bounds apply.
    assert plan_tools(request(tools=tools)).mode == "auto"


@pytest.mark.parametrize("model", ["shout", "concise", "base"])  # a LoRA, a preset, the base
@pytest.mark.parametrize("stream", [False, True])
async def test_a_named_call_ends_with_stop_on_every_kind_of_route(
    serve: Any, model: str, stream: bool
) -> None:
    """Through the app: the route (and its tool parser) does not change a forced function's
    ``stop``, one choice or two."""
    from tests.unit.fakes import FakeEngine

    served = await serve(engine=FakeEngine(words=['{"city"', ': "Paris"}']))
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER, ADD],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "n": 2,
        "stream": stream,
    }
    r = await served.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if stream:
        parts = [p.removeprefix("data: ") for p in r.text.split("\n\n") if p]
        choices = assemble([json.loads(p) for p in parts[:-1]])
        calls = [[c["name"] for c in choices[i]["tool_calls"].values()] for i in (0, 1)]
        finishes = [choices[i]["finish_reason"] for i in (0, 1)]
    else:
        whole = r.json()["choices"]
        calls = [[c["function"]["name"] for c in choice["message"]["tool_calls"]] for choice in whole]
        finishes = [choice["finish_reason"] for choice in whole]
    assert calls == [["get_weather"], ["get_weather"]] and finishes == ["stop", "stop"]
