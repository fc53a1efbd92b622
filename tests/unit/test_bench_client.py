"""bench/'s request shapes: the bodies both servers get, how streamed deltas are read, how a
finished answer is checked, and where the invalid count lands (results and markdown)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from bench import report
from bench.client import Job, RequestResult, chat_body, summarize
from bench.shapes import RECORD_SCHEMA, answer_valid, delta_parts, shape_fields

GOOD = json.dumps({"name": "a", "age": 3, "city": "b", "email": "c", "active": True})


def test_plain_body_keeps_ignore_eos_and_has_no_structure() -> None:
    body = chat_body(Job("m", "hi"), 16)
    assert body["ignore_eos"] is True and body["max_tokens"] == 16 and body["stream"] is True
    assert "response_format" not in body and "tools" not in body


def test_json_schema_body_is_strict_with_the_five_field_object_and_no_ignore_eos() -> None:
    body = chat_body(Job("m", "hi"), 48, "json_schema")
    assert "ignore_eos" not in body and body["max_tokens"] == 48
    rf = body["response_format"]
    assert rf["type"] == "json_schema"
    assert rf["json_schema"]["strict"] is True and rf["json_schema"]["name"] == "record"
    schema = rf["json_schema"]["schema"]
    assert (
        sorted(schema["properties"])
        == sorted(schema["required"])
        == ["active", "age", "city", "email", "name"]
    )
    assert schema["additionalProperties"] is False


def test_tools_body_requires_one_function_with_the_same_object() -> None:
    body = chat_body(Job("m", "hi"), 48, "tools")
    assert "ignore_eos" not in body and body["tool_choice"] == "required"
    (tool,) = body["tools"]
    assert tool["type"] == "function" and tool["function"]["parameters"] == RECORD_SCHEMA


def test_unknown_shape_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown shape"):
        shape_fields("xml")


@pytest.mark.parametrize(
    ("delta", "expected"),
    [
        ({"role": "assistant", "content": ""}, ("", "", False)),
        ({"content": '{"na'}, ('{"na', "", True)),
        ({"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "record"}}]}, ("", "", False)),
        ({"tool_calls": [{"index": 0, "function": {"arguments": '{"age"'}}]}, ("", '{"age"', True)),
        ({"tool_calls": [{"index": 0, "function": {"arguments": ""}}]}, ("", "", False)),
        ({"content": None, "tool_calls": None}, ("", "", False)),
    ],
)
def test_delta_parts_reads_content_and_tool_call_arguments(delta: dict[str, Any], expected: tuple) -> None:
    assert delta_parts(delta) == expected


def test_delta_parts_keeps_the_first_tool_calls_arguments_only() -> None:
    delta = {
        "tool_calls": [
            {"index": 0, "function": {"arguments": "{}"}},
            {"index": 1, "function": {"arguments": "x"}},
        ]
    }
    assert delta_parts(delta)[1] == "{}"


def test_answer_valid_checks_the_shapes_own_field() -> None:
    assert answer_valid("plain", "anything", "") is None
    assert answer_valid("json_schema", GOOD, "") is True
    assert answer_valid("json_schema", "", GOOD) is False
    assert answer_valid("tools", "", GOOD) is True
    assert answer_valid("tools", GOOD, "") is False


@pytest.mark.parametrize(
    "text",
    [
        GOOD[:-5],
        "[1, 2]",
        json.dumps({"name": "a"}),
        json.dumps({**json.loads(GOOD), "extra": 1}),
        "not json",
    ],
)
def test_answer_valid_refuses_truncated_non_object_or_wrong_fields(text: str) -> None:
    assert answer_valid("json_schema", text, "") is False


def _res(valid: bool | None, ok: bool = True) -> RequestResult:
    return RequestResult(ok=ok, start=0.0, end=1.0, ttft=0.1, completion_tokens=10, valid=valid)


def test_summarize_counts_invalid_answers_apart_from_failures() -> None:
    s = summarize([_res(True), _res(False), _res(False), _res(None, ok=False)], 2.0, 16)
    assert (s["completed"], s["failed"], s["invalid"], s["invalid_at_length"]) == (3, 1, 2, 0)
    assert s["out_tok_per_s"] == pytest.approx(15.0)  # invalid answers' tokens still count


def test_markdown_shows_the_shape_and_an_invalid_column() -> None:
    point = {
        "target": "gateway",
        "mix": "base",
        "concurrency": 1,
        **summarize([_res(True), _res(False)], 1.0, 16),
    }
    meta = {
        "date": "d",
        "machine": "m",
        "versions": {},
        "host": "h",
        "engine": {
            "model": "x",
            "served_name": "x",
            "dtype": "f",
            "load_format": None,
            "max_num_seqs": 1,
            "max_num_batched_tokens": 1,
            "max_model_len": 1,
            "max_loras": 1,
            "adapters": {},
        },
        "adapter_rank": 8,
        "prompt_tokens": 64,
        "output_tokens": 48,
        "requests": {1: 2},
        "mixes": ["base"],
        "concurrencies": [1],
        "client": "c",
        "shape": "tools",
    }
    md = report.markdown({"meta": meta, "points": [point]})
    assert "- shape: tools (" in md and "no ignore_eos" in md
    header = next(line for line in md.splitlines() if line.startswith("| target | mix | conc | req/s"))
    row = next(line for line in md.splitlines() if line.startswith("| gateway | base | 1 |"))
    assert header.rstrip(" |").endswith("invalid (of which cut at max_tokens)")
    assert row.split("|")[-3:-1] == [" 0 ", " 1 (0) "]  # fail 0, invalid 1, none cut at max_tokens
    assert "gateway settings" not in md
    meta["gateway_set"] = ["limits.lora_quantum_s=2"]
    md = report.markdown({"meta": meta, "points": [point]})
    assert "- gateway settings: `--set limits.lora_quantum_s=2`" in md.splitlines()


def _sse(*events: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 12}}
TOOL_STREAM_HEAD = _chunk(
    {"tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": {"name": "record"}}]}
)
TOOL_STREAM = _sse(
    _chunk({"role": "assistant", "content": ""}),
    _chunk({"tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": {"name": "record"}}]}),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": GOOD[:10]}}]}),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": GOOD[10:]}}]}),
    _chunk({}, "tool_calls"),
    USAGE,
)
CONTENT_STREAM = _sse(
    _chunk({"role": "assistant", "content": ""}),
    _chunk({"content": GOOD[:5]}),
    _chunk({"content": GOOD[5:-3]}),
    _chunk({}, "length"),
    USAGE,
)


async def drive_against(handler: Any, jobs: list[Job], workers: int, *args: Any) -> list[RequestResult]:
    """``bench.client.drive`` (max_tokens 48) against an aiohttp app answering chat with ``handler``."""
    from aiohttp import web

    from bench.client import drive

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        results, _ = await drive(f"http://127.0.0.1:{port}", jobs, workers, 48, *args)
    finally:
        await runner.cleanup()
    return results


@pytest.mark.parametrize(
    ("shape", "stream", "valid", "chunks"),
    [("tools", TOOL_STREAM, True, 3), ("json_schema", CONTENT_STREAM, False, 3)],
)
def test_drive_times_either_delta_kind_and_checks_the_answer(
    shape: str, stream: bytes, valid: bool, chunks: int
) -> None:
    """A canned SSE stream over real HTTP: the role event and a tool call's head are not
    output, its arguments are, and the answer is the joined content or arguments."""
    from aiohttp import web

    from bench.client import run_loop

    seen: list[dict[str, Any]] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.Response(body=stream, content_type="text/event-stream")

    results = run_loop(drive_against(handler, [Job("m", "hi")] * 2, 2, None, shape))
    assert [r.ok for r in results] == [True, True]
    assert all(r.valid is valid and r.chunks == chunks and len(r.itl) == chunks - 1 for r in results)
    assert results[0].completion_tokens == 12
    assert results[0].finish_reason == ("tool_calls" if shape == "tools" else "length")
    assert seen[0] == chat_body(Job("m", "hi"), 48, shape)


def test_a_tool_calls_head_sent_before_the_engine_is_not_its_first_token() -> None:
    """The gateway sends a required call's id and name at once, before the engine has run;
    the client took it for the first token: its tools TTFT p50 was 6 ms against vLLM's 385
    (H200, c=1), vLLM's server sending the whole call in one event at the end."""
    from aiohttp import web

    from bench.client import run_loop

    args = _chunk({"tool_calls": [{"index": 0, "function": {"arguments": GOOD}}]}, "tool_calls")

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(_sse(TOOL_STREAM_HEAD)[: -len(b"data: [DONE]\n\n")])
        await asyncio.sleep(0.2)  # the engine's prefill and decode
        await response.write(_sse(args, USAGE))
        await response.write_eof()
        return response

    (res,) = run_loop(drive_against(handler, [Job("m", "hi")], 1, None, "tools"))
    assert res.ok and res.valid and res.ttft is not None and res.ttft >= 0.2
    assert (res.chunks, res.itl) == (1, [])


def test_the_client_reuses_its_connections_between_requests() -> None:
    """Leaving the stream at ``[DONE]``, before the chunked body's end, closed the connection:
    each worker's next request opened a new one, and its TTFT included the connect."""
    from aiohttp import web

    from bench.client import run_loop

    peers: set[Any] = set()

    async def handler(request: web.Request) -> web.StreamResponse:
        peers.add(request.transport.get_extra_info("peername") if request.transport else None)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(CONTENT_STREAM)
        await asyncio.sleep(0.005)  # the body's end a moment after [DONE], as from a busy server
        await response.write_eof()
        return response

    results = run_loop(drive_against(handler, [Job("m", "hi")] * 20, 2))
    assert all(r.ok for r in results)
    assert len(peers) == 2  # one connection per worker
