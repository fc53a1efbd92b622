"""A streamed Response whose request offered function tools: its items and typed events.

Used only when ``Generation.tools.mode`` is not ``none``, so the plain encoder
(``responses_events.ResponseEventEncoder``) keeps its hot path. The output is a list of
items, each announced (``response.output_item.added``), filled and closed
(``response.output_item.done``) before the next opens, as OpenAI streams them:

- a ``function_call`` item: ``response.function_call_arguments.delta`` pieces, then
  ``response.function_call_arguments.done`` with the whole arguments text;
- a ``message`` item: ``response.content_part.added``, ``response.output_text.delta``
  pieces, ``response.output_text.done`` and ``response.content_part.done``.

When the items are known follows chat's tool stream (``sse_tools``): under ``named`` (and
``required`` with one function) the call is announced before the first token and its
arguments stream as generated; under ``required`` each call opens once its name is
complete (``RequiredCallScanner``); under ``auto`` an answer that cannot open a call
streams as a message (less what may still turn out to be followed by calls:
``tools.settled_content``), one that can is read when it ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.errors import GatewayError
from gateway.responses_events import (
    ResponseDraft,
    ResponseEventEncoder,
    event_logprobs,
    function_call,
    item_id,
    text_part,
)
from gateway.tools import (
    RequiredCallScanner,
    call_id,
    calls_lead,
    calls_of_answer,
    may_open_calls,
    settled_content,
)
from gateway.types import Chunk, StepOutput, TokenCounts, TokenLogprob


@dataclass(slots=True)
class _Item:
    kind: str  # "message" or "function_call"
    id: str
    call_id: str = ""
    name: str = ""
    parts: list[str] = field(default_factory=list)  # the text, or the arguments text
    announced: bool = False  # output_item.added went out
    closed: bool = False  # output_item.done went out

    def render(self, draft: ResponseDraft, status: str, logprobs: list[TokenLogprob]) -> dict[str, Any]:
        if self.kind == "message":  # its id is the draft's message_id; logprobs: the answer's
            return draft.message("".join(self.parts), status, logprobs)
        return function_call(self.id, self.call_id, self.name, "".join(self.parts), status)


class ResponseToolEncoder(ResponseEventEncoder):
    """The typed events of a Response that may hold function calls."""

    def __init__(self, draft: ResponseDraft) -> None:
        super().__init__(draft)
        self.plan = draft.gen.tools
        self.parser = draft.gen.route.tool_parser
        self.items: list[_Item] = []
        self.answer = ""  # auto: the answer so far
        self.streaming_text = False  # auto: it opened with text, streamed as it settles
        self.sent = 0  # auto: how much of it went out as text deltas
        self.checked = 0  # auto: tools.settled_content's mark
        self.tail = ""  # auto: the rest of the text, read when the answer ended
        self.scanner = RequiredCallScanner()
        self.first_name = self.plan.first_name

    # -- items ----------------------------------------------------------------------------
    def _open(self, item: _Item) -> bytes:
        """Close the open item, then announce ``item``."""
        out = self._close_open("completed")
        self.items.append(item)
        return out + self._announce(len(self.items) - 1, item)

    def _announce(self, index: int, item: _Item) -> bytes:
        item.announced = True
        added = item.render(self.draft, "in_progress", [])
        out = self.event("response.output_item.added", output_index=index, item=added)
        if item.kind == "message":
            where = {"item_id": item.id, "output_index": index, "content_index": 0}
            out += self.event("response.content_part.added", **where, part=text_part(""))
        return out

    def _add(self, item: _Item, piece: str) -> bytes:
        item.parts.append(piece)
        return self._delta(item, piece)

    def _delta(self, item: _Item, piece: str) -> bytes:
        index = self.items.index(item)
        if item.kind == "message":
            return self.event(
                "response.output_text.delta",
                item_id=item.id,
                output_index=index,
                content_index=0,
                delta=piece,
                logprobs=self.unsent_logprobs(),
            )
        return self.event(
            "response.function_call_arguments.delta", item_id=item.id, output_index=index, delta=piece
        )

    def _close_open(self, status: str) -> bytes:
        for index, item in enumerate(self.items):
            if item.announced and not item.closed:
                item.closed = True
                text = "".join(item.parts)
                if item.kind == "message":
                    where = {"item_id": item.id, "output_index": index, "content_index": 0}
                    logprobs = event_logprobs(self.logprobs)
                    out = self.event("response.output_text.done", **where, text=text, logprobs=logprobs)
                    out += self.event(
                        "response.content_part.done", **where, part=text_part(text, self.logprobs)
                    )
                else:
                    out = self.event(
                        "response.function_call_arguments.done",
                        item_id=item.id,
                        output_index=index,
                        name=item.name,
                        arguments=text,
                    )
                done = item.render(self.draft, status, self.logprobs)
                return out + self.event("response.output_item.done", output_index=index, item=done)
        return b""

    def _call(self, name: str) -> _Item:
        return _Item("function_call", item_id("fc"), call_id(), name)

    def _message(self) -> _Item:
        return _Item("message", self.draft.message_id)

    # -- the stream -----------------------------------------------------------------------
    def start(self) -> bytes:
        snapshot = self.draft.render("in_progress")
        out = self.event("response.created", response=snapshot)
        out += self.event("response.in_progress", response=snapshot)
        if self.first_name is not None:
            out += self._open(self._call(self.first_name))
        return out

    def step(self, step: StepOutput) -> bytes:
        return b"".join(self._chunk(c) for c in step.chunks)

    def _chunk(self, c: Chunk) -> bytes:
        if c.finish_reason is not None:
            self.finish_reason = c.finish_reason
        self.take_logprobs(c)
        if not c.text:
            return b""
        if self.plan.mode == "named":
            return self._add(self.items[0], c.text)
        if self.plan.mode == "required":
            out = b""
            for kind, value, k in self.scanner.feed(c.text):
                if kind == "name":
                    if k == 0 and self.first_name is not None:
                        continue  # announced at the start
                    out += self._open(self._call(value))
                else:
                    out += self._add(self.items[-1], value)
            return out
        self.answer += c.text
        text, out = self.answer, b""
        if not self.streaming_text:
            if not text.strip() or may_open_calls(self.parser, text):
                return b""  # may be calls: read when it ends
            self.streaming_text = True
            out = self._open(self._message())
        end = len(text)
        if self.parser == "json":  # hold what may yet turn out to come before calls
            end, self.checked = settled_content(text, self.plan.names, self.checked)
        if end > self.sent:
            out += self._add(self.items[-1], text[self.sent : end])
            self.sent = end
        return out

    def final(self, tokens: TokenCounts) -> dict[str, Any]:
        """The Response; what was held back (an ``auto`` answer that may be calls, a
        ``required`` one cut short before any call) becomes its items here."""
        status = "incomplete" if self.finish_reason == "length" else "completed"
        held = self.answer if self.plan.mode == "auto" else None
        if self.plan.mode == "required" and not self.items:
            held = self.scanner.text
        if held is not None:
            content, calls = calls_of_answer(self.plan, held, self.parser)
            if self.streaming_text:  # its message is open: the text held back goes out in end()
                self.tail = (content or "")[self.sent :]
                if self.tail:
                    self.items[0].parts.append(self.tail)
            for call in calls:
                item = self._call(call.name)
                item.parts.append(call.arguments)
                self.items.append(item)
            if content and not self.streaming_text:  # in the order generated
                message = _Item("message", self.draft.message_id, parts=[content])
                lead = calls_lead(self.plan, held, self.parser)
                self.items.insert(len(self.items) if lead else len(self.items) - len(calls), message)
        # An item closed because the next one opened was complete; the rest end with the answer.
        output = [
            item.render(self.draft, "completed" if item.closed else status, self.logprobs)
            for item in self.items
        ]
        return self.draft.render(status, output, tokens)

    def end(self, response: dict[str, Any]) -> bytes:
        status = response["status"]
        out = self._delta(self.items[0], self.tail) if self.tail else b""
        out += self._close_open(status)
        for index, item in enumerate(self.items):
            if item.announced:
                continue
            pieces, item.parts = item.parts, []  # _add puts them back, one event each
            out += self._announce(index, item)
            for piece in pieces:
                out += self._add(item, piece)
            out += self._close_open(status)
        last = "response.incomplete" if status == "incomplete" else "response.completed"
        return out + self.event(last, response=response)

    def error(self, exc: GatewayError) -> bytes:
        error = {"code": "server_error", "message": exc.message}
        output = [
            item.render(self.draft, "incomplete", self.logprobs) for item in self.items if item.announced
        ]
        return self.event(
            "response.failed", response=self.draft.render("failed", output, self.draft.gen, error)
        )
