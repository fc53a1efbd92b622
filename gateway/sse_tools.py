"""Chat answers with tool calls: the whole response and the stream, in OpenAI's shapes.

Used only when a request offers tools (``Generation.tools.mode`` is not ``none``), so the
plain chat encoder's hot path stays as it is.

Streaming, per choice:

- ``named``: the function is known before the first token: the first chunk carries the
  call's ``index``, ``id``, ``type`` and ``name`` with empty ``arguments``, then each
  generated piece of the arguments is an ``arguments`` fragment.
- ``required``: the names are inside the generated JSON list, so the answer is buffered and
  each call goes out whole when the choice ends.
- ``auto``: an answer whose first non-blank character cannot open a call (``tools.CALL_OPENERS``)
  streams as content at once; one that can is buffered and parsed when the choice ends.

A choice that ended with calls has ``finish_reason: "tool_calls"`` (``length`` stays ``length``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from gateway.protocol import usage_dict
from gateway.service import Collected, Generation
from gateway.sse import OpenAIChatEncoder, chat_logprobs
from gateway.tools import CALL_OPENERS, ParsedCall, call_id, calls_of_answer, tool_call_dict
from gateway.types import Chunk, StepOutput


def _finish(reason: str | None, calls: list[ParsedCall]) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason


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
                "finish_reason": _finish(c.finish_reason, calls),
            }
        )
    return {
        "id": gen.id,
        "object": "chat.completion",
        "created": gen.created,
        "model": gen.route.name,
        "choices": choices,
        "usage": usage_dict(result.prompt_tokens, result.completion_tokens),
    }


@dataclass(slots=True)
class _ChoiceState:
    buffered: list[str] = field(default_factory=list)
    streaming_text: bool = False  # auto: known to be plain text, streamed as it comes
    call_id: str = ""


class ToolChatEncoder(OpenAIChatEncoder):
    """``chat.completion.chunk`` events with ``tool_calls`` deltas."""

    def __init__(self, gen: Generation, include_usage: bool) -> None:
        super().__init__(gen, include_usage)
        self._plan = gen.tools
        self._parser = gen.route.tool_parser
        self._states = {i: _ChoiceState(call_id=call_id()) for i in range(gen.sampling.n)}

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
            if self._plan.mode == "named":
                head = {"index": 0, "id": state.call_id, "type": "function"}
                head["function"] = {"name": self._plan.named, "arguments": ""}
                out.append(self._event(i, {"tool_calls": [head]}))
        return b"".join(out)

    def step(self, step: StepOutput) -> bytes:
        return b"".join(self._choice_chunk(c) for c in step.chunks if c.text or c.finish_reason or c.logprobs)

    def _choice_chunk(self, c: Chunk) -> bytes:
        state = self._states[c.index]
        logprobs = chat_logprobs(c.logprobs)
        if self._plan.mode == "named":
            delta = {"tool_calls": [{"index": 0, "function": {"arguments": c.text}}]} if c.text else {}
            finish = "tool_calls" if c.finish_reason == "stop" else c.finish_reason
            return self._event(c.index, delta, logprobs, finish)
        if state.streaming_text:
            return self._event(c.index, {"content": c.text} if c.text else {}, logprobs, c.finish_reason)
        state.buffered.append(c.text)
        text = "".join(state.buffered)
        if self._plan.mode == "auto" and text.strip() and not text.lstrip().startswith(CALL_OPENERS):
            state.streaming_text = True
            return self._event(c.index, {"content": text}, logprobs, c.finish_reason)
        if c.finish_reason is None:
            return self._event(c.index, {}, logprobs) if logprobs is not None else b""
        return self._calls_events(c.index, text, logprobs, c.finish_reason)

    def _calls_events(self, index: int, text: str, logprobs: Any, reason: str) -> bytes:
        content, calls = calls_of_answer(self._plan, text, self._parser)
        out = []
        if content:
            out.append(self._event(index, {"content": content}))
        for k, call in enumerate(calls):
            tool_call = {"index": k, **tool_call_dict(call, self._states[index].call_id if k == 0 else None)}
            out.append(self._event(index, {"tool_calls": [tool_call]}))
        out.append(self._event(index, {}, logprobs, _finish(reason, calls)))
        return b"".join(out)


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()
