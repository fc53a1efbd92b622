"""Answers and histories that once made a tools request a 500 (a review's findings), and
the tools field's edges: each end to end through the app, with a fake engine that writes
the answer."""

from __future__ import annotations

import http.server
import json
import threading
from typing import Any

import httpx
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from tests.helpers import assert_openai_error
from tests.unit.conftest import Serve
from tests.unit.fakes import FakeEngine

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Give me the names as JSON"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
R_TOOLS = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]


def answered(r: httpx.Response) -> None:
    """A 200 whose stream, if any, carries no error event."""
    assert r.status_code == 200, r.text[:300]
    assert "server_error" not in r.text, r.text[-300:]  # an error event after the 200


@pytest.mark.parametrize("answer", ['{"name": ["Alice", "Bob"]}', '{"name": {"first": "Al"}}'])
async def test_an_answer_whose_name_is_no_string_is_content(serve: Serve, answer: str) -> None:
    # ``name`` was looked up in a dict: a list is unhashable (TypeError, a 500).
    served = await serve(FakeEngine(words=[answer]))
    for stream in (False, True):
        body = {"model": "base", "messages": USER, "tools": TOOLS, "stream": stream}
        answered(await served.http.post(CHAT, json=body))
    r = await served.http.post(CHAT, json={"model": "base", "messages": USER, "tools": TOOLS})
    assert r.json()["choices"][0]["message"]["content"] == answer
    answered(await served.http.post("/v1/responses", json={"model": "base", "input": "?", "tools": R_TOOLS}))


@pytest.mark.parametrize(
    ("parameters", "answer"),
    [
        (
            {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
            '{"name": "f", "arguments": {"a": 1}}',
        ),
        (
            {"type": "object", "properties": {"a": {"type": "number", "multipleOf": 0.5}}},
            '{"name": "f", "arguments": {"a": ' + "1" * 400 + "}}",
        ),
    ],
    ids=["unresolvable-ref", "multipleOf-overflow"],
)
async def test_strict_arguments_that_cannot_be_validated_are_no_call(
    serve: Serve, parameters: dict[str, Any], answer: str
) -> None:
    # The validator raised (referencing's Unresolvable, OverflowError): a 500.
    served = await serve(FakeEngine(words=[answer]))
    tools = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": parameters}}]
    for stream in (False, True):
        body = {"model": "base", "messages": USER, "tools": tools, "stream": stream}
        answered(await served.http.post(CHAT, json=body))
    r = await served.http.post(CHAT, json={"model": "base", "messages": USER, "tools": tools})
    message = r.json()["choices"][0]["message"]
    assert message["content"] == answer and not message.get("tool_calls")


async def test_history_arguments_nested_absurdly_deep_are_an_empty_object(serve: Serve) -> None:
    # json.loads raised RecursionError (a 500); vLLM coerces unreadable arguments to {}.
    deep = "[" * 5000 + "]" * 5000
    served = await serve()
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "r"},
    ]
    answered(await served.http.post(CHAT, json={"model": "base", "messages": messages}))
    items = [
        *USER,
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": deep},
        {"type": "function_call_output", "call_id": "c1", "output": "r"},
    ]
    answered(await served.http.post("/v1/responses", json={"model": "base", "input": items}))


async def test_empty_tools_are_refused(serve: Serve) -> None:
    served = await serve()
    r = await served.http.post(CHAT, json={"model": "base", "messages": USER, "tools": []})
    assert assert_openai_error(r, 400)["param"] == "tools"  # as OpenAI and vLLM


async def test_responses_structured_outputs_beside_any_text_format_is_refused(serve: Serve) -> None:
    # With text.format {"type": "text"} structured_outputs was dropped: an unconstrained 200.
    served = await serve()
    for fmt in ({"type": "text"}, {"type": "json_object"}):
        body = {
            "model": "base",
            "input": "yes?",
            "text": {"format": fmt},
            "structured_outputs": {"choice": ["y"]},
        }
        r = await served.http.post("/v1/responses", json=body)
        assert assert_openai_error(r, 400)["param"] == "structured_outputs"
    body = {"model": "base", "input": "yes?", "structured_outputs": {"choice": ["yes", "no"]}}
    answered(await served.http.post("/v1/responses", json=body))
    assert served.engine.calls[-1][1].constraint is not None


@pytest.mark.parametrize("tool_choice", ["auto", "none"])
async def test_an_empty_answer_streams_as_it_is_whole(serve: Serve, tool_choice: str) -> None:
    # The stream said content null at its start and sent no "" after: the SDK's accumulator
    # made None of what the whole answer has as "".
    served = await serve(FakeEngine(words=[""]))
    body = {"model": "base", "messages": USER, "tools": TOOLS, "tool_choice": tool_choice}
    whole = (await served.http.post(CHAT, json=body)).json()
    streamed = await served.http.post(CHAT, json={**body, "stream": True})
    state = ChatCompletionStreamState()  # type: ignore[var-annotated]
    for line in streamed.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            state.handle_chunk(ChatCompletionChunk.model_validate(json.loads(line[6:])))
    assert whole["choices"][0]["message"]["content"] == ""
    assert state.get_final_completion().choices[0].message.content == ""


async def test_a_strict_tools_remote_ref_is_never_fetched(serve: Serve) -> None:
    # jsonschema's default registry fetched it (urlopen, no timeout, on the event loop): any
    # key could make the gateway call an internal URL, and stall every stream meanwhile.
    fetched: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            fetched.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"type": "integer"}')

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        served = await serve(FakeEngine(words=['{"name": "f", "arguments": {"a": 1}}']))
        url = f"http://127.0.0.1:{server.server_address[1]}/internal/secret.json"
        parameters = {"type": "object", "properties": {"a": {"$ref": url}}}
        tools = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": parameters}}]
        r = await served.http.post(CHAT, json={"model": "base", "messages": USER, "tools": tools})
        answered(r)
        assert not r.json()["choices"][0]["message"].get("tool_calls")  # unresolvable: no strict call
        assert fetched == []
    finally:
        server.shutdown()
        server.server_close()
