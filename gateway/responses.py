"""Transport helpers for the handlers: bodies in, responses and errors out.

- ``read_json``: a bounded body, parsed and validated into a request model (400/408/413);
  a large one in a thread, off the event loop.
- ``SSEResponse``: a stream that stops the generation as soon as the client leaves.
- ``collect_unless_gone``: a whole response, aborted if the client leaves first.
- ``render_error`` / ``render_http_error``: every error as OpenAI's error JSON.
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
import re
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from gateway.errors import (
    GatewayError,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    RequestTimeout,
    UnsupportedMediaType,
)
from gateway.metrics import RequestRecord
from gateway.middleware import send_error
from gateway.protocol import invalid_request
from gateway.service import Collected, Generation
from gateway.settings import LimitSettings

M = TypeVar("M", bound=BaseModel)


async def read_json(request: Request, model: type[M], limits: LimitSettings, any_type: bool = False) -> M:
    """The body as ``model``. A declared Content-Type other than JSON is refused (415), as
    vLLM does: a form-encoded body is not JSON. ``any_type`` accepts any (house ``/chat``,
    whose clients post with ``curl -d``). The whole body must arrive within
    ``limits.body_timeout_s`` (408): the request holds an admission slot meanwhile, and a
    client that stalls its upload would keep it for good (uvicorn has no body timeout)."""
    max_bytes = limits.max_body_bytes
    ctype = request.headers.get("content-type")
    if ctype is not None and not any_type and not _is_json(ctype):
        raise UnsupportedMediaType(f"Content-Type must be application/json, not '{ctype[:80]}'")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > max_bytes:
        raise PayloadTooLarge(f"request body is larger than {max_bytes} bytes")
    body = bytearray()
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            async for part in request.stream():
                body += part
                if len(body) > max_bytes:
                    raise PayloadTooLarge(f"request body is larger than {max_bytes} bytes")
    except TimeoutError:
        raise RequestTimeout(
            f"the request body did not arrive within {limits.body_timeout_s:g} s (limits.body_timeout_s)"
        ) from None
    if len(body) > PARSE_OFF_LOOP_BYTES:
        return await asyncio.get_running_loop().run_in_executor(_PARSE, _parse, body, model)
    return _parse(body, model)


# Parsing and validating a 2 MiB body took 19 ms for 16,000 messages, 77 ms for 45,000 content
# parts and 71 ms for 256 prompts of token ids (2 CPU cores): on the event loop, a stall of
# every open stream. Above this size it runs in a thread of its own. json.loads and pydantic's
# core hold the GIL while they run, but pydantic calls back into Python validators (one per
# message), and between those the loop gets the GIL within the 5 ms switch interval: the
# loop's longest stall during those requests fell from 36, 56 and 118 ms to 13, 39 and 40 ms.
# One thread: a burst of large bodies is parsed one at a time, not by a pool that grows a
# malloc arena per thread; small bodies skip the hop (it costs more than their parse).
PARSE_OFF_LOOP_BYTES = 64 * 1024
_PARSE = ThreadPoolExecutor(max_workers=1, thread_name_prefix="parse-body")


def _finite(text: str) -> float:
    """A JSON number as a float, refused where a float cannot hold it (``1e400``): a field
    kept as sent (a schema, a tool) would echo it as ``Infinity``, which is not JSON."""
    value = float(text)
    if not math.isfinite(value):
        raise InvalidRequest(f"request body holds a number out of range: {text[:40]}")
    return value


def _not_json(name: str) -> float:
    """``NaN`` and ``Infinity``: Python's json reads them, JSON has no such values."""
    raise ValueError(f"{name} is not JSON")


def _parse(body: bytearray, model: type[M]) -> M:
    try:
        # Decoded strictly first: json.loads(bytes) decodes with "surrogatepass", so a lone
        # surrogate sent as raw (CESU-8) bytes would pass through and fail in the tokenizer.
        text = body.decode(json.detect_encoding(body))
        data = json.loads(text, parse_float=_finite, parse_constant=_not_json)
    except ValueError:  # also bad UTF-8
        raise InvalidRequest("request body is not valid JSON") from None
    except RecursionError:
        raise InvalidRequest("request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    # Searched in the text, not the bytes: a UTF-16 or UTF-32 body's escapes are not ASCII.
    if _ESCAPED_SURROGATE.search(text) is not None:  # rare: only then walk the strings
        try:
            where = _lone_surrogate(data, "")
        except RecursionError:
            raise InvalidRequest("request body is nested too deeply") from None
        if where is not None:
            raise InvalidRequest(
                "a string holds a lone UTF-16 surrogate (not valid Unicode)", param=where or None
            )
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise invalid_request(exc) from None


_ESCAPED_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")


def _lone_surrogate(value: Any, where: str) -> str | None:
    """Where in ``value`` a string (or key) does not encode as UTF-8, or None."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return where
    elif isinstance(value, dict):
        for key, item in value.items():
            inner = f"{where}.{key}" if where else str(key)
            found = _lone_surrogate(key, where)
            if found is None:
                found = _lone_surrogate(item, inner)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _lone_surrogate(item, f"{where}[{i}]")
            if found is not None:
                return found
    return None


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


STOP_SEND_S = 1.0  # a stopped stream's last sends (``SSEResponse._send_stop``)


class SSEResponse(StreamingResponse):
    """A stream that always watches for the client leaving, whatever the ASGI version,
    so an abandoned request stops in the engine at once rather than at its next token."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        headers: dict[str, str],
        record: RequestRecord | None,
        on_close: Callable[[], None] | None = None,
        *,
        send_timeout_s: float,
        stop: asyncio.Future[GatewayError] | None = None,
        on_stop: Callable[[GatewayError], bytes] | None = None,
    ) -> None:
        self.record = record
        self.on_close = on_close  # runs however the stream ends, even if it never started
        self.send_timeout_s = send_timeout_s
        # ``Gateway.stopping``: done when the drain timed out; the stream then ends with the
        # error event ``on_stop`` renders (it also books the error on the generation).
        self.stop = stop
        self.on_stop = on_stop
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watch = _SendWatch(send)
        stream = asyncio.ensure_future(self.stream_response(watch.send))
        gone = asyncio.ensure_future(self.listen_for_disconnect(receive))
        stalled = asyncio.ensure_future(watch.stalled(self.send_timeout_s))
        waits: set[asyncio.Future[Any]] = {stream, gone, stalled}
        if self.stop is not None:
            waits.add(self.stop)
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if self.stop is not None and not done & {stream, gone, stalled}:
                stream.cancel()  # aborts the generation (its steps close)
                with suppress(BaseException):
                    await stream
                await self._send_stop(watch, self.stop.result())
                return
            # uvicorn answers http.disconnect as soon as a response is complete, so both
            # can be done at once: only a stream cut short (or failing to send) means that
            # the client left. A failed send is enough: uvicorn tells a disconnect only to a
            # connection's latest request, so a stream with requests pipelined behind it
            # never hears of it (its send fails on the closed transport).
            left = stream not in done or stream.exception() is not None
            if left and self.record is not None:
                self.record.disconnected = True
        finally:
            for task in (stream, gone, stalled):
                task.cancel()
            for task in (stream, gone, stalled):
                with suppress(BaseException):
                    await task
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with suppress(BaseException):
                    await aclose()
            if self.on_close is not None:
                self.on_close()

    async def _send_stop(self, watch: _SendWatch, error: GatewayError) -> None:
        """End the stream with ``error``: its error event, or the error itself (a 503) if the
        status line has not gone out yet. A client that does not read gets
        ``STOP_SEND_S``, then counts as gone: uvicorn would cancel the request 2 s after it
        stops (``timeout_graceful_shutdown``), with a traceback in the log."""
        exc = copy.copy(error)
        try:
            async with asyncio.timeout(STOP_SEND_S):
                if not watch.started:
                    await send_error(watch.send, exc)
                    return
                body = self.on_stop(exc) if self.on_stop is not None else b""
                await watch.send({"type": "http.response.body", "body": body, "more_body": True})
                await watch.send({"type": "http.response.body", "body": b"", "more_body": False})
        except (TimeoutError, OSError):  # it takes no data, or it is gone already
            if self.record is not None:
                self.record.disconnected = True


class _SendWatch:
    """A stream's ``send``, timed: ``stalled`` returns once one send has been blocked for
    ``timeout`` seconds. A client that stops reading (a full TCP window) blocks uvicorn's send
    but never disconnects, and would hold its admission slot and route lease for as long as
    its connection stays open; past ``limits.send_timeout_s`` it counts as gone (nginx's
    ``send_timeout``). A client that reads, however slowly, is never cut."""

    __slots__ = ("_send", "since", "started")

    def __init__(self, send: Send) -> None:
        self._send = send
        self.since: float | None = None  # when the send in progress began
        self.started = False  # the status line went out

    async def send(self, message: Message) -> None:
        self.since = time.monotonic()
        self.started = True
        try:
            await self._send(message)
        finally:
            self.since = None

    async def stalled(self, timeout: float) -> None:
        while True:
            since = self.since
            left = timeout if since is None else since + timeout - time.monotonic()
            if left <= 0:
                return
            await asyncio.sleep(left)


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def collect_unless_gone(
    request: Request, gen: Generation, stop: asyncio.Future[GatewayError] | None = None
) -> Collected | None:
    """Collect a whole response; None (and aborted in the engine) if the client leaves first.
    ``stop`` done first (``Gateway.stopping``): aborted, and its error raised."""
    work = asyncio.ensure_future(gen.collect())
    gone = asyncio.ensure_future(_until_disconnect(request.receive))
    waits: set[asyncio.Future[Any]] = {work, gone}
    if stop is not None:
        waits.add(stop)
    try:
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
        gen.close()  # a task cancelled before it ran never reached the release in ``steps``
    if work not in done:
        with suppress(BaseException):
            await work
        if stop is not None and gone not in done:
            raise copy.copy(stop.result())
        return None
    return work.result()


def route_headers(gen: Generation) -> dict[str, str]:
    headers = {"x-adapter": gen.route.name}
    if gen.route.digest:
        headers["x-adapter-digest"] = gen.route.digest
    return headers


class _AsciiJSON(JSONResponse):
    """An error body in ASCII: a message may quote the request's text, lone surrogates too."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


async def render_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    return _AsciiJSON(exc.to_dict(), exc.status_code, headers=exc.headers)


async def render_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        err: GatewayError = NotFound(f"no route for {request.method} {request.scope.get('path', '')[:200]}")
    elif exc.status_code == 405:
        err = MethodNotAllowed(f"method {request.method} is not allowed here")
    else:
        err = InvalidRequest(str(exc.detail))
        err.status_code = exc.status_code
    return JSONResponse(err.to_dict(), err.status_code, headers=dict(exc.headers or {}))
