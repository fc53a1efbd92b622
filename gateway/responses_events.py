"""``/v1/responses`` output: the Response object and its typed stream events.

``ResponseDraft`` renders one Response object at any point of its life (in progress,
completed, incomplete, failed). ``ResponseEventEncoder`` writes OpenAI's typed SSE events
(``event: <type>`` / ``data: {..., "sequence_number": n}``) in OpenAI's order::

    response.created, response.in_progress, response.output_item.added,
    response.content_part.added, response.output_text.delta..., response.output_text.done,
    response.content_part.done, response.output_item.done,
    response.completed (or response.incomplete when max_output_tokens cut it short)

With ``include: ["message.output_text.logprobs"]`` each text delta carries the logprobs of
its tokens (a token with no text of its own rides on the next delta), the message's
``output_text`` part and ``response.output_text.done`` all of them (``output_logprobs`` /
``event_logprobs``: OpenAI's two shapes).

An engine failure after the status line ends the stream with ``response.failed``.
``stream_events`` drives it and stores the final Response (``save``) before the last event
goes out, so a client that reads ``response.completed`` can continue from it at once.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from gateway.errors import EngineFailed, GatewayError
from gateway.responses_api import ResponsesRequest, format_echo, tools_echo
from gateway.service import Collected, Generation
from gateway.sse import chat_logprobs
from gateway.tools import call_id, calls_lead, calls_of_answer
from gateway.types import Chunk, StepOutput, TokenCounts, TokenLogprob

log = logging.getLogger(__name__)
Save = Callable[[dict[str, Any]], Awaitable[None]]


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def usage(tokens: TokenCounts) -> dict[str, Any]:
    return {
        "input_tokens": tokens.prompt_tokens,
        "input_tokens_details": {"cached_tokens": tokens.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": tokens.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": tokens.prompt_tokens + tokens.completion_tokens,
    }


def output_text(response: dict[str, Any]) -> str:
    """All output text of a rendered Response (what the SDK's ``output_text`` gives)."""
    return "".join(
        part["text"]
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )


def assistant_turn(response: dict[str, Any]) -> dict[str, Any]:
    """A rendered Response as the chat message that continues from it (tool calls included)."""
    turn: dict[str, Any] = {"role": "assistant", "content": output_text(response)}
    calls = [item for item in response["output"] if item["type"] == "function_call"]
    if calls:
        turn["content"] = turn["content"] or None
        turn["tool_calls"] = [
            {
                "id": c["call_id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": c["arguments"]},
            }
            for c in calls
        ]
    return turn


def input_items(response_id: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation a stored response answered (earlier turns included, its
    instructions not; ``assistant_turn`` read back), as Responses input items in
    conversation order. Items get ids made from the response's, stable across reads, so
    ``after`` can page through them."""
    stem = response_id.removeprefix("resp_")
    items: list[dict[str, Any]] = []

    def next_id(prefix: str) -> str:
        return f"{prefix}_{stem}{len(items):04d}"

    for m in messages:
        role = m["role"]
        if role == "tool":
            item = {"type": "function_call_output", "call_id": m["tool_call_id"], "output": m["content"]}
            items.append({"id": next_id("fco"), **item, "status": "completed"})
            continue
        if m.get("content") or not m.get("tool_calls"):
            text = m.get("content") or ""
            part = text_part(text) if role == "assistant" else {"type": "input_text", "text": text}
            message = {"type": "message", "role": role, "content": [part], "status": "completed"}
            items.append({"id": next_id("msg"), **message})
        for call in m.get("tool_calls") or ():
            fn = call["function"]
            items.append(function_call(next_id("fc"), call["id"], fn["name"], fn["arguments"], "completed"))
    return items


def function_call(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def item_id(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex}"


class ResponseDraft:
    """One Response object: ids fixed at creation, rendered as it progresses."""

    def __init__(self, body: ResponsesRequest, gen: Generation) -> None:
        self.body = body
        self.gen = gen
        self.id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"

    def message(self, text: str, status: str, logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
        return {
            "id": self.message_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": [] if status == "in_progress" else [text_part(text, logprobs)],
        }

    def render(
        self,
        status: str,
        output: list[dict[str, Any]] | None = None,
        tokens: TokenCounts | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The Response with ``output`` (its items); ``tokens`` the usage."""
        body, sampling = self.body, self.gen.sampling
        incomplete = status == "incomplete"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.gen.created,
            "status": status,
            "background": False,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": body.max_tool_calls,
            "metadata": body.metadata or {},
            "model": self.gen.route.name,
            "output": output or [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "service_tier": "default",
            "store": body.store,
            "temperature": sampling.temperature,
            "text": {"format": format_echo(body.text.format), "verbosity": "medium"},
            "tool_choice": body.tool_choice or "auto",
            "tools": tools_echo(body),
            "top_logprobs": body.top_logprobs or 0,
            "top_p": sampling.top_p,
            "truncation": "disabled",
            "usage": usage(tokens) if tokens is not None else None,
            "user": body.user,
        }

    def whole(self, result: Collected) -> dict[str, Any]:
        choice = result.choices[0]
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        output = self.items("".join(choice.text), status, choice.logprobs)
        return self.render(status, output, result)

    def items(
        self, text: str, status: str, logprobs: list[TokenLogprob] | None = None
    ) -> list[dict[str, Any]]:
        """The output items of a finished answer: its text as a message, and where tools were
        offered, the function calls read from it (``tools.calls_of_answer``). The message
        carries ``logprobs``, the whole answer's, calls' tokens too (as vLLM's server)."""
        if self.gen.tools.mode == "none":
            return [self.message(text, status, logprobs)]
        parser = self.gen.route.tool_parser
        content, calls = calls_of_answer(self.gen.tools, text, parser)
        # Under ``required`` each call but the last was complete once the next began: the stream
        # closes it then, as ``completed`` whatever ends the answer; the same here.
        done = "completed" if self.gen.tools.mode == "required" else status
        output = [
            function_call(
                item_id("fc"), call_id(), c.name, c.arguments, done if k < len(calls) - 1 else status
            )
            for k, c in enumerate(calls)
        ]
        if content:  # in the order generated
            output.insert(
                len(output) if calls_lead(self.gen.tools, text, parser) else 0,
                self.message(content, status, logprobs),
            )
        return output


def text_part(text: str, logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": output_logprobs(logprobs)}


def output_logprobs(items: list[TokenLogprob] | None) -> list[dict[str, Any]]:
    """An ``output_text`` part's logprobs: chat's ``logprobs.content`` entries (each token
    with its UTF-8 bytes, and its top alternatives likewise)."""
    logprobs = chat_logprobs(items)
    return logprobs["content"] if logprobs is not None else []


def event_logprobs(items: list[TokenLogprob] | None) -> list[dict[str, Any]]:
    """The text events' logprobs (``response.output_text.delta`` and ``.done``): no bytes."""
    return [
        {
            "token": t.token,
            "logprob": t.logprob,
            "top_logprobs": [{"token": s, "logprob": lp} for s, lp in t.top],
        }
        for t in items or ()
    ]


class ResponseEventEncoder:
    """The typed events of one streamed Response, numbered in order."""

    def __init__(self, draft: ResponseDraft) -> None:
        self.draft = draft
        self.sequence = 0
        self.text: list[str] = []
        self.logprobs: list[TokenLogprob] = []  # every token's so far, when asked for
        self.unsent: list[TokenLogprob] = []  # those not yet on a text delta
        self.finish_reason: str | None = None
        self._where = {"item_id": draft.message_id, "output_index": 0, "content_index": 0}
        head = {"type": "response.output_text.delta", **self._where, "logprobs": []}
        # 'event: ...\ndata: {"type":...,"logprobs":[],"sequence_number":' -- the delta's fixed part
        self._delta_prefix = (
            b"event: response.output_text.delta\ndata: " + _dumps(head)[:-1].encode() + b',"sequence_number":'
        )

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {_dumps(data)}\n\n".encode()

    def start(self) -> bytes:
        draft = self.draft
        snapshot, item = draft.render("in_progress"), draft.message("", "in_progress")
        return b"".join(
            (
                self.event("response.created", response=snapshot),
                self.event("response.in_progress", response=snapshot),
                self.event("response.output_item.added", output_index=0, item=item),
                self.event("response.content_part.added", **self._where, part=text_part("")),
            )
        )

    def take_logprobs(self, chunk: Chunk) -> None:
        if chunk.logprobs:
            self.logprobs += chunk.logprobs
            self.unsent += chunk.logprobs

    def unsent_logprobs(self) -> list[dict[str, Any]]:
        """The logprobs for the next text delta: those of the tokens since the last."""
        out, self.unsent = event_logprobs(self.unsent), []
        return out

    def step(self, step: StepOutput) -> bytes:
        out = []
        for chunk in step.chunks:
            if chunk.finish_reason is not None:
                self.finish_reason = chunk.finish_reason
            self.take_logprobs(chunk)
            if not chunk.text:
                continue  # its tokens' logprobs, if any, ride on the next delta
            self.text.append(chunk.text)
            if self.unsent:
                logprobs = self.unsent_logprobs()
                out.append(
                    self.event(
                        "response.output_text.delta", **self._where, delta=chunk.text, logprobs=logprobs
                    )
                )
            else:
                out.append(
                    self._delta_prefix
                    + str(self.sequence).encode()
                    + b',"delta":'
                    + _dumps(chunk.text).encode()
                    + b"}\n\n"
                )
                self.sequence += 1
        return b"".join(out)

    def final(self, tokens: TokenCounts) -> dict[str, Any]:
        status = "incomplete" if self.finish_reason == "length" else "completed"
        message = self.draft.message("".join(self.text), status, self.logprobs)
        return self.draft.render(status, [message], tokens)

    def end(self, response: dict[str, Any]) -> bytes:
        text = "".join(self.text)
        item = response["output"][0]
        last = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        logprobs = event_logprobs(self.logprobs)
        return b"".join(
            (
                self.event("response.output_text.done", **self._where, text=text, logprobs=logprobs),
                self.event("response.content_part.done", **self._where, part=item["content"][0]),
                self.event("response.output_item.done", output_index=0, item=item),
                self.event(last, response=response),
            )
        )

    def error(self, exc: GatewayError) -> bytes:
        error = {"code": "server_error", "message": exc.message}
        failed = self.draft.render(
            "failed",
            [self.draft.message("".join(self.text), "incomplete", self.logprobs)],
            self.draft.gen,
            error,
        )
        return self.event("response.failed", response=failed)


async def stream_events(
    gen: Generation, encoder: ResponseEventEncoder, save: Save | None
) -> AsyncIterator[bytes]:
    """The bytes of one streamed Response; failures become ``response.failed``."""
    try:
        yield encoder.start()
        async with aclosing(gen.steps()) as steps:  # closed here, not when collected
            async for step in steps:
                data = encoder.step(step)
                if data:
                    yield data
        response = encoder.final(gen)
        if save is not None:
            await save(response)
        yield encoder.end(response)
    except GatewayError as exc:
        gen.error = exc
        yield encoder.error(exc)
    except Exception:
        # The status line went out long ago: the stream must still end with an event.
        log.exception("response stream %s (engine request %s) failed", encoder.draft.id, gen.id)
        gen.error = EngineFailed("internal error while streaming")
        yield encoder.error(gen.error)
