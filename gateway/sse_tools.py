"""Chat answers with tool calls: the whole response and the stream, in OpenAI's shapes.

Used only when a request offers tools (``Generation.tools.mode`` is not ``none``), so the
plain chat encoder's hot path stays as it is.

Streaming, per choice:

- ``named``: the function is known before the first token: the first chunk carries the
  call's ``index``, ``id``, ``type`` and ``name`` with empty ``arguments``, then each
  generated piece of the arguments is an ``arguments`` fragment.
- ``required``: the names are inside the generated JSON list (``[{"name": ..., "arguments":
  {...}}, ...]``): each call's head goes out as soon as its name is complete, then its
  arguments as fragments (``RequiredCallScanner``). With one function offered, the first
  call's name is known before the first token (the grammar allows no other), so its head
  goes out at once, as for ``named``. An answer cut short before any name is sent as
  content, unless its head went out: then the call stays, with the arguments so far.
- ``auto``: an answer whose first non-blank character can open a call (``tools.CALL_OPENERS``)
  is buffered and parsed when the choice ends, on a route whose ``tool_parser`` reads calls
  (under ``none`` every answer is text, and streams so). One that opens with text streams as content
  as it comes, less what may still turn out to be followed by calls (``tools.settled_content``:
  trailing blanks, and a line from where JSON that may be calls ending the answer starts),
  which waits for more text or the end; the deltas add up to the whole response's content.

A choice that ended with calls has ``finish_reason: "tool_calls"`` (``length`` stays ``length``),
except under ``named``: there it stays ``stop``, as OpenAI's API and vLLM's server answer a forced
function.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from gateway.protocol import usage_dict
from gateway.service import Collected, Generation
from gateway.sse import OpenAIChatEncoder, chat_logprobs
from gateway.tools import (
    ParsedCall,
    RequiredCallScanner,
    ToolPlan,
    call_id,
    calls_of_answer,
    may_open_calls,
    settled_content,
    tool_call_dict,
)
from gateway.types import Chunk, StepOutput


def _finish(reason: str | None, calls: list[ParsedCall], plan: ToolPlan) -> str | None:
    return "tool_calls" if calls and reason == "stop" and plan.mode != "named" else reason


def tool_chat_response(gen: Generation, result: Collected) -> dict[str, Any]:
    """The whole ``chat.completion`` body of a request that offered tools."""
    choices = []
    for c in result.choices:
        content, calls = calls_of_answer(gen.tools, "".join(c.text), gen.route.tool_parser)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [tool_call_dict(call) for call in calls]
        choices.append(
            {
                "index": c.index,
                "message": message,
                "logprobs": chat_logprobs(c.logprobs),
                "finish_reason": _finish(c.finish_reason, calls, gen.tools),
            }
        )
    return {
        "id": gen.id,
        "object": "chat.completion",
        "created": gen.created,
        "model": gen.route.name,
        "choices": choices,
        "usage": usage_dict(result),
    }


@dataclass(slots=True)
class _ChoiceState:
    text: str = ""  # auto: the answer so far
    streaming_text: bool = False  # auto: opened with text, streamed as it settles
    sent: int = 0  # auto: how much of ``text`` went out as content
    checked: int = 0  # auto: ``tools.settled_content``'s mark
    call_id: str = ""
    scanner: RequiredCallScanner = field(default_factory=RequiredCallScanner)


class ToolChatEncoder(OpenAIChatEncoder):
    """``chat.completion.chunk`` events with ``tool_calls`` deltas."""

    def __init__(self, gen: Generation, include_usage: bool) -> None:
        super().__init__(gen, include_usage)
        self._plan = gen.tools
        self._parser = gen.route.tool_parser
        self._states = {i: _ChoiceState(call_id=call_id()) for i in range(gen.sampling.n)}
        self._first_name = self._plan.first_name
        self._announced = self._plan.mode == "required" and self._first_name is not None

    def _event(
        self, index: int, delta: dict[str, Any], logprobs: Any = None, finish: str | None = None
    ) -> bytes:
        return (
            self._prefix
            + str(index).encode()
            + b',"delta":'
            + _json(delta)
            + b',"logprobs":'
            + _json(logprobs)
            + b',"finish_reason":'
            + _json(finish)
            + b"}]"
            + self._suffix
        )

    def start(self) -> bytes:
        out = []
        for i, state in self._states.items():
            out.append(self._event(i, {"role": "assistant", "content": None}))
            if self._first_name is not None:
                head = {"index": 0, "id": state.call_id, "type": "function"}
                head["function"] = {"name": self._first_name, "arguments": ""}
                out.append(self._event(i, {"tool_calls": [head]}))
        return b"".join(out)

    def step(self, step: StepOutput) -> bytes:
        return b"".join(self._choice_chunk(c) for c in step.chunks if c.text or c.finish_reason or c.logprobs)

    def _choice_chunk(self, c: Chunk) -> bytes:
        state = self._states[c.index]
        logprobs = chat_logprobs(c.logprobs)
        if self._plan.mode == "named":
            delta = {"tool_calls": [{"index": 0, "function": {"arguments": c.text}}]} if c.text else {}
            return self._event(c.index, delta, logprobs, c.finish_reason)
        if self._plan.mode == "required":
            return self._required_chunk(c, state, logprobs)
        state.text += c.text
        text = state.text
        if self._plan.mode == "auto" and text.strip() and not may_open_calls(self._parser, text):
            state.streaming_text = True
        if c.finish_reason is not None:
            return self._calls_events(c.index, text, logprobs, c.finish_reason, state.sent)
        piece = ""
        if state.streaming_text:
            end = len(text)
            if self._parser == "json":  # hold what may yet turn out to come before calls
                end, state.checked = settled_content(text, self._plan.names, state.checked)
            piece, state.sent = text[state.sent : end], max(state.sent, end)
        if piece or logprobs is not None:
            return self._event(c.index, {"content": piece} if piece else {}, logprobs)
        return b""

    def _required_chunk(self, c: Chunk, state: _ChoiceState, logprobs: Any) -> bytes:
        """Each call's name as soon as it is complete, then its arguments as they grow."""
        scanner = state.scanner
        out = []
        for kind, value, k in scanner.feed(c.text):
            if kind == "name" and k == 0 and self._announced:
                continue  # its head went out at the start
            if kind == "name":
                head = {"index": k, "id": state.call_id if k == 0 else call_id(), "type": "function"}
                head["function"] = {"name": value, "arguments": ""}
                out.append(self._event(c.index, {"tool_calls": [head]}))
            else:
                out.append(
                    self._event(c.index, {"tool_calls": [{"index": k, "function": {"arguments": value}}]})
                )
        if c.finish_reason is not None:
            if scanner.calls == 0 and not self._announced:  # cut short before any call: the text
                return b"".join(out) + self._calls_events(c.index, scanner.text, logprobs, c.finish_reason)
            finish = "tool_calls" if c.finish_reason == "stop" else c.finish_reason
            out.append(self._event(c.index, {}, logprobs, finish))
        elif logprobs is not None:
            out.append(self._event(c.index, {}, logprobs))
        return b"".join(out)

    def _calls_events(self, index: int, text: str, logprobs: Any, reason: str, sent: int = 0) -> bytes:
        """The end of a choice read whole (``sent``: the part of its content already out)."""
        content, calls = calls_of_answer(self._plan, text, self._parser)
        rest = (content or "")[sent:]
        if not calls:  # an empty answer's "" too, as the whole answer has it (the start said null)
            delta = {"content": rest} if rest or (content == "" and sent == 0) else {}
            return self._event(index, delta, logprobs, reason)
        out = []
        if rest:
            out.append(self._event(index, {"content": rest}))
        for k, call in enumerate(calls):
            tool_call = {"index": k, **tool_call_dict(call, self._states[index].call_id if k == 0 else None)}
            out.append(self._event(index, {"tool_calls": [tool_call]}))
        out.append(self._event(index, {}, logprobs, _finish(reason, calls, self._plan)))
        return b"".join(out)


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()
