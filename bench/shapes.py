"""Request shapes for the load (``--shape``): what each request asks for on top of a plain
streaming chat completion, how its streamed deltas are read, and how its answer is checked.

- ``plain``: free text with ``ignore_eos``, so every request returns exactly max_tokens.
- ``json_schema``: ``response_format`` json_schema (strict) with a 5-field object.
- ``tools``: one function tool whose parameters are the same object, ``tool_choice: "required"``.

Under a grammar ``ignore_eos`` makes little sense (once the object closes only EOS is
allowed), so the structured shapes drop it and keep max_tokens; throughput still counts
``usage.completion_tokens``. They decode greedily: the answers' lengths then depend on the
prompt only, and both servers get the same prompts in the same pass, so they do the same
work (sampled answers of random length made the two sides' token counts differ). Their
answer (the content, or the tool call's arguments) is parsed as JSON when the request ends;
one that does not parse (or lacks a field) counts as ``invalid`` (a truncated object
included), not as a failed request.
"""

from __future__ import annotations

import json
from typing import Any

SHAPES = ("plain", "json_schema", "tools")
STRUCTURED = ("json_schema", "tools")

RECORD_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "email": {"type": "string"},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "email", "active"],
    "additionalProperties": False,
}


def shape_fields(shape: str) -> dict[str, Any]:
    """The body fields a shape adds to a chat completion request (the same for both servers)."""
    if shape == "plain":
        return {"ignore_eos": True}
    if shape == "json_schema":
        return {
            "temperature": 0.0,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "record", "strict": True, "schema": RECORD_SCHEMA},
            },
        }
    if shape == "tools":
        return {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "record",
                        "description": "Store one person's record.",
                        "parameters": RECORD_SCHEMA,
                    },
                }
            ],
            "tool_choice": "required",
            "temperature": 0.0,
        }
    raise ValueError(f"unknown shape {shape!r} (one of {', '.join(SHAPES)})")


def delta_parts(delta: dict[str, Any]) -> tuple[str, str, bool]:
    """(content, tool-call arguments, carries output) of one streamed ``delta``. An event
    carries output when it has content or a tool call's arguments: what the engine wrote.
    The role event (``{"role": "assistant", "content": ""}``) carries none, nor does a call's
    head (id, name) alone: under ``tool_choice: required`` with one function the gateway
    sends it before the engine has run, as it does the role event."""
    content = delta.get("content") or ""
    args = []
    carries = bool(content)
    for call in delta.get("tool_calls") or ():
        fn = call.get("function") or {}
        if call.get("index", 0) == 0:
            args.append(fn.get("arguments") or "")
        carries = carries or bool(fn.get("arguments"))
    return content, "".join(args), carries


def answer_valid(shape: str, content: str, arguments: str) -> bool | None:
    """Whether a finished answer parses as a JSON object with exactly the schema's fields
    (None for ``plain``, which has no check). Values are not type-checked here."""
    if shape not in STRUCTURED:
        return None
    text = content if shape == "json_schema" else arguments
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    return isinstance(obj, dict) and sorted(obj) == sorted(RECORD_SCHEMA["required"])
