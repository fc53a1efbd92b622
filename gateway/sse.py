"""Wire formats: engine steps -> bytes, one small encoder per format.

Encoders build each event from pre-rendered byte prefixes and one ``json.dumps`` of the
delta text, with no per-chunk pydantic model: this is the hot path of every stream.
Once a stream has started the HTTP status cannot change, so each format has an explicit
error event.

- ``OpenAIChatEncoder``: ``chat.completion.chunk`` events, then ``data: [DONE]``.
- ``OpenAICompletionEncoder``: ``text_completion`` events, then ``data: [DONE]``. On failure
  both send ``data: {"error": {...}}`` (OpenAI's error object), then ``data: [DONE]``.
- ``HouseEncoder``: ``event: message`` / ``data: {"text": ...}`` (UTF-8, not escaped),
  ``event: done`` / ``data: [DONE]``; on failure ``event: error`` / ``data: {"error": ...}``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, Protocol

from gateway.errors import EngineFailed, GatewayError
from gateway.protocol import usage_dict
from gateway.service import Collected, Generation
from gateway.types import Chunk, StepOutput, TokenCounts, TokenLogprob

log = logging.getLogger(__name__)
_dumps = json.dumps
DONE = b"data: [DONE]\n\n"


class StreamEncoder(Protocol):
    def start(self) -> bytes: ...

    def step(self, step: StepOutput) -> bytes: ...

    def end(self, tokens: TokenCounts) -> bytes: ...

    def error(self, exc: GatewayError) -> bytes: ...


def _data(obj: Any) -> bytes:
    return b"data: " + _dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class _OpenAIEncoder:
    object_name = ""

    def __init__(self, gen: Generation, include_usage: bool) -> None:
        self.gen = gen
        self.include_usage = include_usage
        head = {"id": gen.id, "object": self.object_name, "created": gen.created, "model": gen.route.name}
        self._head = head
        # '{"id":..,"model":..,"choices":[{"index":' -- everything before the choice index
        self._prefix = (
            b"data: " + _dumps(head, separators=(",", ":"))[:-1].encode() + b',"choices":[{"index":'
        )
        self._suffix = b',"usage":null}\n\n' if include_usage else b"}\n\n"

    def error(self, exc: GatewayError) -> bytes:
        # then ``[DONE]``, as vLLM's server ends a failed stream: a client that reads to it
        # (not only OpenAI's SDKs, which raise at the error) sees the stream end, not break
        return _data(exc.to_dict()) + DONE

    def end(self, tokens: TokenCounts) -> bytes:
        if not self.include_usage:
            return DONE
        return _data({**self._head, "choices": [], "usage": usage_dict(tokens)}) + DONE


class OpenAIChatEncoder(_OpenAIEncoder):
    object_name = "chat.completion.chunk"

    def start(self) -> bytes:
        return b"".join(
            self._prefix
            + str(i).encode()
            + b',"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]'
            + self._suffix
            for i in range(self.gen.sampling.n)
        )

    def step(self, step: StepOutput) -> bytes:
        return b"".join(self._chunk(c) for c in step.chunks if c.text or c.finish_reason or c.logprobs)

    def _chunk(self, c: Chunk) -> bytes:
        delta = b'{"content":' + _dumps(c.text).encode() + b"}" if c.text else b"{}"
        logprobs = _dumps(chat_logprobs(c.logprobs)).encode() if c.logprobs is not None else b"null"
        finish = _dumps(c.finish_reason).encode()
        return (
            self._prefix
            + str(c.index).encode()
            + b',"delta":'
            + delta
            + b',"logprobs":'
            + logprobs
            + b',"finish_reason":'
            + finish
            + b"}]"
            + self._suffix
        )


class OpenAICompletionEncoder(_OpenAIEncoder):
    object_name = "text_completion"

    def __init__(self, gen: Generation, include_usage: bool) -> None:
        super().__init__(gen, include_usage)
        self._offsets: dict[int, int] = {}  # choice -> text_offset of its next token

    def start(self) -> bytes:
        return b""

    def step(self, step: StepOutput) -> bytes:
        # A token whose text the detokenizer holds back (a possible stop string) still has
        # logprobs: send them now, or the stream loses tokens and its text_offsets drift.
        return b"".join(self._chunk(c) for c in step.chunks if c.text or c.finish_reason or c.logprobs)

    def _chunk(self, c: Chunk) -> bytes:
        logprobs = b"null"
        if c.logprobs is not None:
            start = self._offsets.get(c.index, 0)
            self._offsets[c.index] = start + sum(len(t.token) for t in c.logprobs)
            logprobs = _dumps(completion_logprobs(c.logprobs, start)).encode()
        return (
            self._prefix
            + str(c.index).encode()
            + b',"text":'
            + _dumps(c.text).encode()
            + b',"logprobs":'
            + logprobs
            + b',"finish_reason":'
            + _dumps(c.finish_reason).encode()
            + b"}]"
            + self._suffix
        )


class HouseEncoder:
    """The in-house SSE format, byte-compatible with the existing clients."""

    def __init__(self, gen: Generation) -> None:
        self.gen = gen

    def start(self) -> bytes:
        return b""

    def step(self, step: StepOutput) -> bytes:
        return b"".join(
            b"event: message\ndata: " + _house_json({"text": c.text}).encode() + b"\n\n"
            for c in step.chunks
            if c.text
        )

    def end(self, tokens: TokenCounts) -> bytes:
        return b"event: done\ndata: [DONE]\n\n"

    def error(self, exc: GatewayError) -> bytes:
        return b"event: error\ndata: " + _house_json({"error": exc.message}).encode() + b"\n\n"


# Line breaks to Python's ``str.splitlines`` (so to httpx's and requests' ``iter_lines``), not
# to SSE: raw in an event, they cut its data line in two for such clients. JSON escapes the
# others (control characters); these three it leaves as they are without ``ensure_ascii``.
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def _house_json(obj: dict[str, str]) -> str:
    """The house format's JSON: UTF-8 as it is (its clients read it so), but for line breaks."""
    text = _dumps(obj, ensure_ascii=False)
    return text if text.isascii() else text.translate(_LINE_BREAKS)


async def encode_stream(gen: Generation, encoder: StreamEncoder) -> AsyncIterator[bytes]:
    """The bytes of one streamed response; engine failures become the format's error event."""
    try:
        first = encoder.start()
        if first:
            yield first
        async with aclosing(gen.steps()) as steps:  # closed here, not when collected
            async for step in steps:
                data = encoder.step(step)
                if data:
                    yield data
        yield encoder.end(gen)
    except GatewayError as exc:
        gen.error = exc
        yield encoder.error(exc)
    except Exception:
        # The status line went out long ago: the stream must still end with an error event.
        log.exception("stream %s failed", gen.id)
        gen.error = EngineFailed("internal error while streaming")
        yield encoder.error(gen.error)


# -- logprobs and whole (non-streamed) responses ---------------------------------------
def _token_entry(token: str, logprob: float | None) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(items: list[TokenLogprob] | None) -> dict[str, Any] | None:
    if items is None:
        return None
    return {
        "content": [
            {**_token_entry(t.token, t.logprob), "top_logprobs": [_token_entry(s, lp) for s, lp in t.top]}
            for t in items
        ]
    }


def completion_logprobs(items: list[TokenLogprob] | None, offset: int = 0) -> dict[str, Any] | None:
    """OpenAI's completion logprobs; ``offset``: where the first token starts in the text
    (a stream's later chunks continue from what was sent)."""
    if items is None:
        return None
    offsets = []
    for t in items:
        offsets.append(offset)
        offset += len(t.token)
    return {
        "tokens": [t.token for t in items],
        "token_logprobs": [t.logprob for t in items],
        # the top k, and the chosen token too (OpenAI: "up to logprobs + 1" entries)
        "top_logprobs": [None if t.logprob is None else {**dict(t.top), t.token: t.logprob} for t in items],
        "text_offset": offsets,
    }


def chat_response(gen: Generation, result: Collected) -> dict[str, Any]:
    return {
        "id": gen.id,
        "object": "chat.completion",
        "created": gen.created,
        "model": gen.route.name,
        "choices": [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": "".join(c.text)},
                "logprobs": chat_logprobs(c.logprobs),
                "finish_reason": c.finish_reason,
            }
            for c in result.choices
        ],
        "usage": usage_dict(result),
    }


def completion_response(gen: Generation, result: Collected) -> dict[str, Any]:
    return {
        "id": gen.id,
        "object": "text_completion",
        "created": gen.created,
        "model": gen.route.name,
        "choices": [
            {
                "index": c.index,
                "text": "".join(c.text),
                "logprobs": completion_logprobs(c.logprobs),
                "finish_reason": c.finish_reason,
            }
            for c in result.choices
        ],
        "usage": usage_dict(result),
    }
