"""read_json on its own: a bounded body (413 by declared length or as it streams in, 408
when it stalls), parsed (400 for bad JSON or not an object) and validated (400 naming the field)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable

import pytest
from pydantic import BaseModel, Field, field_validator
from starlette.requests import Request
from starlette.types import Message

from gateway.errors import InvalidRequest, PayloadTooLarge, RequestTimeout
from gateway.protocol import ChatCompletionRequest
from gateway.responses import PARSE_OFF_LOOP_BYTES, read_json
from gateway.settings import LimitSettings


def limits(max_body_bytes: int, body_timeout_s: float = 30.0) -> LimitSettings:
    return LimitSettings(max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s)


class Small(BaseModel):
    name: str
    count: int = Field(1, ge=1)


def request(chunks: Iterable[bytes], content_length: int | None = None) -> tuple[Request, list[bytes]]:
    """A request whose body arrives in ``chunks``; the list records the chunks read."""
    parts = list(chunks)
    read: list[bytes] = []
    headers = [(b"content-type", b"application/json")]
    if content_length is not None:
        headers.append((b"content-length", str(content_length).encode()))

    async def receive() -> Message:
        if not parts:
            return {"type": "http.request", "body": b"", "more_body": False}
        part = parts.pop(0)
        read.append(part)
        return {"type": "http.request", "body": part, "more_body": bool(parts)}

    scope = {"type": "http", "method": "POST", "path": "/", "headers": headers, "query_string": b""}
    return Request(scope, receive), read


async def test_a_valid_body_becomes_the_model() -> None:
    req, _ = request([b'{"name": "a",', b' "count": 3}'])
    assert await read_json(req, Small, limits(100)) == Small(name="a", count=3)


async def test_a_declared_length_above_the_limit_is_413_before_reading() -> None:
    req, read = request([b'{"name": "a"}'], content_length=101)
    with pytest.raises(PayloadTooLarge) as info:
        await read_json(req, Small, limits(100))
    assert info.value.status_code == 413 and info.value.code == "payload_too_large"
    assert read == []  # refused on the header alone


async def test_a_body_above_the_limit_is_413_as_it_streams_in() -> None:
    chunks = [b'{"name": "', *[b"x" * 40] * 10, b'"}']
    req, read = request(chunks)  # no content-length (chunked), or one that lies
    with pytest.raises(PayloadTooLarge):
        await read_json(req, Small, limits(100))
    assert len(read) == 4  # stopped at the chunk that crossed the limit, not at the end

    lying, _ = request(chunks, content_length=10)
    with pytest.raises(PayloadTooLarge):
        await read_json(lying, Small, limits(100))


async def test_a_body_at_the_limit_is_read() -> None:
    body = b'{"name": "' + b"x" * 88 + b'"}'
    assert len(body) == 100
    req, _ = request([body], content_length=100)
    assert (await read_json(req, Small, limits(100))).name == "x" * 88


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"",
        b'{"name": "a"',
        b"\xff\xfe",
        b'{"name": "\xed\xa0\x80"}',  # a lone surrogate as raw bytes: not UTF-8
        b'{"name": "a", "extra": NaN}',  # Python's json reads these; JSON has no such values
        b'{"name": "a", "extra": [Infinity]}',
        b'{"name": "a", "extra": {"x": -Infinity}}',
    ],
)
async def test_bad_json_is_400(body: bytes) -> None:
    req, _ = request([body])
    with pytest.raises(InvalidRequest) as info:
        await read_json(req, Small, limits(1_000_000))
    assert info.value.status_code == 400 and info.value.message == "request body is not valid JSON"
    assert info.value.param is None


@pytest.mark.parametrize("body", [b"[" * 100_000 + b"]" * 100_000, b'{"a": ' * 5000 + b"1" + b"}" * 5000])
async def test_json_nested_deeper_than_python_reads_is_400_saying_so(body: bytes) -> None:
    req, _ = request([body])
    with pytest.raises(InvalidRequest) as info:
        await read_json(req, Small, limits(1_000_000))
    assert info.value.status_code == 400 and info.value.message == "request body is nested too deeply"


@pytest.mark.parametrize("number", ["1e400", "-1e400", "1.5e999"])
async def test_a_number_no_float_holds_is_400_wherever_it_is(number: str) -> None:
    """Valid JSON, but a float reads it as infinity: a field kept as sent (a schema, a tool)
    echoed it as ``Infinity`` in the response, which is not JSON (a 500)."""
    req, _ = request([f'{{"name": "a", "extra": {{"schema": {{"maximum": {number}}}}}}}'.encode()])
    with pytest.raises(InvalidRequest) as info:
        await read_json(req, Small, limits(1_000_000))
    assert info.value.message == f"request body holds a number out of range: {number}"
    req, _ = request([b'{"name": "a", "extra": [1e300, -2.5e-400, 10000000000000000000000000]}'])
    assert (await read_json(req, Small, limits(1_000_000))).name == "a"  # big, tiny and int: fine


@pytest.mark.parametrize("body", [b"[1, 2]", b'"name"', b"3", b"null", b"true"])
async def test_a_body_that_is_not_an_object_is_400(body: bytes) -> None:
    req, _ = request([body])
    with pytest.raises(InvalidRequest) as info:
        await read_json(req, Small, limits(100))
    assert info.value.message == "request body must be a JSON object" and info.value.param is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{}", "name"),
        (b'{"name": 5}', "name"),
        (b'{"name": "a", "count": 0}', "count"),
        (b'{"name": "a", "count": "many"}', "count"),
    ],
)
async def test_a_validation_error_is_400_naming_the_field(body: bytes, param: str) -> None:
    req, _ = request([body])
    with pytest.raises(InvalidRequest) as info:
        await read_json(req, Small, limits(100))
    assert info.value.param == param
    assert info.value.message.startswith(f"{param}: ")
    assert info.value.to_dict()["error"]["type"] == "invalid_request_error"


async def test_a_nested_field_is_named_by_its_path() -> None:
    req, _ = request(
        [b'{"messages": [{"role": "user", "content": "x"}, {"role": "wizard", "content": "y"}]}']
    )
    with pytest.raises(InvalidRequest) as info:
        await read_json(req, ChatCompletionRequest, limits(10_000))
    assert info.value.param == "messages.1.role"


async def test_a_validator_message_loses_pydantics_prefix() -> None:
    req, _ = request([b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}'])
    with pytest.raises(InvalidRequest) as info:
        await read_json(req, ChatCompletionRequest, limits(10_000))
    assert info.value.param == "messages.0.content"
    assert info.value.message == (
        "messages.0.content: 'image_url' content parts are not supported by this model (text only)"
    )


async def test_a_body_that_stalls_is_408_within_the_body_timeout() -> None:
    """A client that sends its headers and a byte, then nothing, would hold its admission
    slot for as long as it keeps the socket open."""
    sent = asyncio.Event()

    async def receive() -> Message:
        if not sent.is_set():
            sent.set()
            return {"type": "http.request", "body": b"{", "more_body": True}
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    scope = {"type": "http", "method": "POST", "path": "/", "headers": [], "query_string": b""}
    with pytest.raises(RequestTimeout) as info:
        await asyncio.wait_for(read_json(Request(scope, receive), Small, limits(100, 0.05)), 5)
    assert info.value.status_code == 408 and "limits.body_timeout_s" in info.value.message


# -- large bodies: parsed off the event loop ------------------------------------------------
def waiting_model(parsing: threading.Event, loop_ran: threading.Event, waited: list[bool]) -> type[BaseModel]:
    """A model whose validation waits (up to 5 s) for the event loop to run a task meanwhile:
    on the event loop's own thread it never can."""

    class Waits(BaseModel):
        name: str

        @field_validator("name")
        @classmethod
        def _wait_for_the_loop(cls, name: str) -> str:
            parsing.set()
            waited.append(loop_ran.wait(5))
            return name

    return Waits


async def test_a_large_body_is_parsed_while_the_event_loop_runs() -> None:
    """Other requests' streams go on while a large body is parsed and validated."""
    parsing, loop_ran, waited = threading.Event(), threading.Event(), []

    async def another_stream() -> None:
        while not parsing.is_set():
            await asyncio.sleep(0.001)
        loop_ran.set()

    other = asyncio.ensure_future(another_stream())
    name = "x" * PARSE_OFF_LOOP_BYTES
    req, _ = request([b'{"name": "', name.encode(), b'"}'])
    parsed = await read_json(req, waiting_model(parsing, loop_ran, waited), limits(2 * PARSE_OFF_LOOP_BYTES))
    await other
    assert waited == [True] and parsed.name == name  # type: ignore[attr-defined]


async def test_a_large_bodys_errors_are_the_same() -> None:
    padding = b" " * PARSE_OFF_LOOP_BYTES
    for body, message in [
        (b'{"name": 5}' + padding, "name: Input should be a valid string"),
        (b"[1]" + padding, "request body must be a JSON object"),
        (b'{"name": "\\ud800"}' + padding, "a string holds a lone UTF-16 surrogate (not valid Unicode)"),
    ]:
        req, _ = request([body])
        with pytest.raises(InvalidRequest) as info:
            await read_json(req, Small, limits(2 * PARSE_OFF_LOOP_BYTES))
        assert info.value.message == message


async def test_a_small_body_is_parsed_on_the_loop() -> None:
    """A thread hop costs more than a small body's parse: it stays on the loop's thread."""
    threads = []

    class Where(BaseModel):
        name: str

        @field_validator("name")
        @classmethod
        def _thread(cls, name: str) -> str:
            threads.append(threading.current_thread())
            return name

    req, _ = request([b'{"name": "a"}'])
    assert (await read_json(req, Where, limits(100))).name == "a"
    assert threads == [threading.current_thread()]
