"""``/v1/responses`` requests: the wire model, and its mapping onto the chat path.

A Responses request becomes a ``ChatCompletionRequest`` (so routing, limits, templating
and sampling are the chat path's): ``instructions`` become a leading system message, the
stored conversation of ``previous_response_id`` comes next (its instructions are not
carried over, as OpenAI does), then ``input`` (a string is one user message).
``text.format`` becomes a ``Constraint`` (``json_schema`` / ``json_object``).

Function tools are chat's tools in the Responses shapes: ``tools`` (``{"type": "function",
"name", "parameters", ...}``) and ``tool_choice`` (``{"type": "function", "name"}`` for a
named one) become chat's; ``function_call`` input items become an assistant message with
``tool_calls`` and ``function_call_output`` items ``tool`` messages, so the chat path's
checks, template and grammar apply. Other tool types (web search, file search, MCP, ...)
are refused with a 400 naming the tool.

``include: ["message.output_text.logprobs"]`` asks chat for logprobs (``top_logprobs``
alternatives a token); they come back on the message's ``output_text`` part and on its
stream's text events. Fields that would change the answer but are not implemented
(reasoning, background, conversation, prompt, moderation, ...) are refused with a 400 naming the field,
and so are chat's spellings of what the Responses API names otherwise (``max_tokens``,
``response_format``, ``messages``, ...), with the field to use. Every other field goes on to
the chat request, so it is honoured or refused as chat does it: vLLM's sampling extensions
(``top_k``, ``min_p``, ``stop``, ``logit_bias``, ``structured_outputs``, ...) work, its
unimplemented ones are 400s, and unknown fields are ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from gateway.errors import InvalidRequest
from gateway.protocol import ChatCompletionRequest, invalid_request, null_is_default
from gateway.structured import FORMAT_NAME, TEXT, check_schema
from gateway.tools import FunctionDef, UnansweredCall, UnknownCallAnswered
from gateway.types import Constraint

_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text")
# Fields that would change the answer; each may still be sent "unused" (None, [], False,
# an object of nulls) or with the value named here.
_UNSUPPORTED: dict[str, tuple[str, ...]] = {
    "background": (),
    "conversation": (),
    "prompt": (),
    "truncation": ("disabled",),
    "moderation": (),
    "context_management": (),
    "echo": (),
}
# ``include`` values: all but the logprobs add what this gateway never makes (reasoning
# items, tool calls other than functions, images), so they change nothing, as on OpenAI for
# a model without them. The logprobs: ``ResponsesRequest.logprobs``.
_INCLUDE_LOGPROBS = "message.output_text.logprobs"
# OpenAI's includable values (the SDK's ``ResponseIncludable``): any other is a 400, as
# OpenAI answers it, so that a misspelt one is not taken for granted.
_INCLUDABLE = frozenset(
    {
        "file_search_call.results",
        "web_search_call.results",
        "web_search_call.action.sources",
        "message.input_image.image_url",
        "computer_call_output.output.image_url",
        "code_interpreter_call.outputs",
        "reasoning.encrypted_content",
        _INCLUDE_LOGPROBS,
    }
)
_TOOL_CHOICE = "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}"
# Chat completions' names for what a Responses request says otherwise: refused (a request
# that sends them means them), naming the field to use.
_CHAT_SPELLINGS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "logprobs": "top_logprobs",
    "functions": "tools",
    "function_call": "tool_choice",
}
# Responses fields that do not change the answer and that chat does not take.
_NOT_PASSED = (
    "stream_options",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "n",
)


def _unused(value: Any, allowed: tuple[str, ...]) -> bool:
    if value in (None, False, [], {}) or (isinstance(value, str) and value in allowed):
        return True
    return isinstance(value, dict) and all(v is None for v in value.values())


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = Field(None, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: TextFormat = Field(default_factory=TextFormat)
    verbosity: Literal["medium"] | None = None  # low/high would change the answer

    _nulls = field_validator("format", mode="before")(null_is_default)  # as left out


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``. ``task`` is the gateway's routing extension, as for chat."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, str_max_length=10_000_000)

    input: str | list[Any]
    model: str | None = Field(None, max_length=256)
    task: str | None = Field(None, max_length=256)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    text: TextConfig = Field(default_factory=TextConfig)
    stream: bool = False  # null: the default
    store: bool = True  # OpenAI's default; null: the default
    previous_response_id: str | None = Field(None, max_length=256)
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = (
        Field(None, max_length=16)
    )
    user: str | None = Field(None, max_length=256)
    tools: list[Any] | None = Field(None, max_length=128)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)  # only read with include=[...logprobs]
    # OpenAI's cap on calls to built-in tools (and MCP), not function tools: with function tools
    # only it changes nothing, and is echoed. An integer from 1, as OpenAI (strict: not 2.0, "2").
    max_tool_calls: Annotated[int, Field(strict=True, ge=1)] | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input_type(cls, value: Any) -> Any:
        if not isinstance(value, str | list):
            raise ValueError("input must be a string or a list of input items")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_type(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, str | dict):
            raise ValueError(_TOOL_CHOICE)
        return value

    _nulls = field_validator("stream", "store", "text", mode="before")(null_is_default)

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> ResponsesRequest:
        # InvalidRequest (not ValueError) passes through pydantic as it is, with its param.
        extra = self.model_extra or {}
        for name, allowed in _UNSUPPORTED.items():
            if not _unused(extra.get(name), allowed):
                raise InvalidRequest(f"'{name}' is not supported by this gateway", param=name)
        include = extra.get("include")
        if include is not None and (
            not isinstance(include, list) or not all(isinstance(value, str) for value in include)
        ):
            raise InvalidRequest("include must be a list of strings", param="include")
        unknown = [value for value in include or () if value not in _INCLUDABLE]
        if unknown:
            known = ", ".join(sorted(_INCLUDABLE))
            raise InvalidRequest(
                f"include: unknown value '{unknown[0][:80]}'; expected one of {known}", param="include"
            )
        reasoning = extra.get("reasoning")
        if isinstance(reasoning, dict) and reasoning.get("effort") == "none":  # no reasoning: as this model
            reasoning = {**reasoning, "effort": None}
        if not _unused(reasoning, ()):
            raise InvalidRequest(
                "reasoning: this model does not reason (only effort 'none')", param="reasoning"
            )
        for name, instead in _CHAT_SPELLINGS.items():
            if not _unused(extra.get(name), ()):
                raise InvalidRequest(
                    f"'{name}' is a chat completions field; /v1/responses takes '{instead}'", param=name
                )
        if extra.get("n", 1) not in (1, None):
            raise InvalidRequest("a response has one output: 'n' must be 1", param="n")
        # Any text.format beside it, as vLLM refuses it (a "text" one would drop it silently)
        if "type" in self.text.format.model_fields_set and extra.get("structured_outputs") is not None:
            raise InvalidRequest(
                "give either 'text.format' or 'structured_outputs', not both", param="structured_outputs"
            )
        return self

    @property
    def logprobs(self) -> dict[str, Any]:
        """Chat's logprobs fields for ``include: ["message.output_text.logprobs"]``, with
        ``top_logprobs`` alternatives a token; without it ``top_logprobs`` is not read, as in
        vLLM's server."""
        if _INCLUDE_LOGPROBS not in ((self.model_extra or {}).get("include") or ()):
            return {}
        return {"logprobs": True, "top_logprobs": self.top_logprobs or 0}

    @property
    def chat_extras(self) -> dict[str, Any]:
        """The fields this model does not declare, for the chat request to honour or refuse."""
        skip = (*_UNSUPPORTED, *_CHAT_SPELLINGS, *_NOT_PASSED, "include", "reasoning")
        return {name: value for name, value in (self.model_extra or {}).items() if name not in skip}


def input_messages(value: str | list[Any], param: str = "input") -> list[dict[str, Any]]:
    """``input`` as chat messages. Items are messages (OpenAI's easy form or typed form,
    output messages of an earlier response included) with text content only, function calls
    (with the assistant text just before or after them: one assistant message) and their
    outputs."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not value:
        raise InvalidRequest("input must not be empty", param=param)
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"{param}[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest("an input item must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "function_call":
            call = _function_call(item, where)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the same answer's text or calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            content = _text(item.get("output"), f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
        elif kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise InvalidRequest(f"role must be one of {', '.join(_ROLES)}", param=f"{where}.role")
            content = _text(item.get("content"), f"{where}.content", refusals=role == "assistant")
            last = messages[-1] if messages else {}
            if role == "assistant" and last.get("tool_calls") and last["content"] is None:
                last["content"] = content  # the text after the same answer's calls (as vLLM joins them)
            else:
                messages.append({"role": role, "content": content})
        else:
            raise InvalidRequest(f"input items of type '{kind}' are not supported", param=f"{where}.type")
    return messages


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A ``function_call`` item as a chat tool call (its arguments a JSON text, as sent)."""
    name, arguments = _string(item, "name", where), _string(item, "arguments", where)
    return {
        "id": _string(item, "call_id", where),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (not value and key != "arguments"):
        raise InvalidRequest(f"'{key}' must be a non-empty string", param=f"{where}.{key}")
    return value


def _text(content: Any, param: str, refusals: bool = False) -> str:
    """A string, or the text of a list of text parts. ``refusals``: an assistant's
    ``refusal`` parts (an earlier response's output, sent back) count as its text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest("content must be a string or a list of parts", param=param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = "refusal" if kind == "refusal" and refusals else "text"
        if (kind not in _TEXT_PARTS and key == "text") or not isinstance(part.get(key), str):
            raise InvalidRequest(
                f"content parts of type '{kind}' are not supported (text only)", param=f"{param}[{j}].type"
            )
        texts.append(part[key])
    return "\n".join(texts)  # as vLLM joins text parts


class ResponsesFunction(FunctionDef):
    """A Responses function tool: strict unless it says ``strict: false`` (OpenAI: "if you omit
    strict, ... Responses requests will normalize your schema into strict mode", chat's tools
    stay non-strict). Its schema is taken as given, not rewritten, and ``strict`` is kept as
    sent: the chat template shows the tool as vLLM's server does, not with a ``strict: true``
    the client never wrote."""

    @property
    def is_strict(self) -> bool:
        return self.strict is not False


def _strict(tool: dict[str, Any]) -> Any:
    """``strict`` as a Response shows a function tool: true unless it says false."""
    strict = tool.get("strict")
    return True if strict is None else strict


def tools_echo(body: ResponsesRequest) -> list[Any]:
    """The request's tools as a response shows them: ``strict`` as they are read."""
    return [
        {**tool, "strict": _strict(tool)}
        if isinstance(tool, dict) and tool.get("type") == "function"
        else tool
        for tool in body.tools or ()
    ]


def chat_tools(body: ResponsesRequest) -> dict[str, Any]:
    """``tools`` and ``tool_choice`` in chat's shapes (only what the request sets)."""
    out: dict[str, Any] = {}
    if body.tools:
        tools = []
        for i, tool in enumerate(body.tools):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise InvalidRequest(
                    f"tools of type '{str(kind)[:40]}' are not supported (function tools only)",
                    param=f"tools[{i}].type",
                )
            fields = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
            try:
                function = ResponsesFunction.model_validate(fields)
            except ValidationError as exc:
                raise invalid_request(exc, f"tools[{i}]") from None
            chat_tool: dict[str, Any] = {"type": "function", "function": function}
            if "defer_loading" in tool:  # judged on the chat side (``plan_tools``)
                chat_tool["defer_loading"] = tool["defer_loading"]
            tools.append(chat_tool)
        out["tools"] = tools
    choice = body.tool_choice
    if isinstance(choice, str) and choice not in ("none", "auto", "required"):
        raise InvalidRequest(_TOOL_CHOICE, param="tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise InvalidRequest(_TOOL_CHOICE, param="tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None and (body.tools or choice not in ("auto", "none")):
        out["tool_choice"] = choice  # "auto" or "none" with no tools changes nothing: not chat's 400
    if body.parallel_tool_calls is not None:
        out["parallel_tool_calls"] = body.parallel_tool_calls
    return out


def chat_request(
    body: ResponsesRequest, history: list[dict[str, Any]], turn: list[dict[str, Any]]
) -> ChatCompletionRequest:
    """The chat request that answers ``body``: instructions, the earlier turns, this turn."""
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    messages = [*system, *history, *turn]
    try:
        return ChatCompletionRequest(
            messages=messages,
            model=body.model,
            task=body.task,
            max_tokens=body.max_output_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            stream=body.stream,
            **body.logprobs,
            **chat_tools(body),
            **body.chat_extras,
        )
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = err["loc"]
        if not loc or loc[0] == "messages":
            param = "input"
        elif loc[0] == "tools" and len(loc) > 2:  # a tool's own field (``defer_loading``)
            param = f"tools[{loc[1]}].{loc[2]}"
        else:
            param = str(loc[0])
        raise InvalidRequest(f"{param}: {err['msg'].removeprefix('Value error, ')}", param=param) from None


# chat's names for what the Responses API calls otherwise, in errors from the chat path
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens"}


def rename_param(exc: InvalidRequest) -> InvalidRequest:
    """An error from the chat path, naming the Responses field (``input``, not ``messages``);
    a call left unanswered in OpenAI's words for it, not chat's."""
    if isinstance(exc, UnansweredCall):
        return InvalidRequest(
            f"No tool output found for function call {exc.call_ids[0][:64]}.", param="input"
        )
    if isinstance(exc, UnknownCallAnswered):
        return InvalidRequest(
            f"No tool call found for function call output with call_id {exc.call_id[:64]}.", param="input"
        )
    exc.param = _PARAMS.get(exc.param or "", exc.param)
    return exc


def constraint(fmt: TextFormat) -> Constraint | None:
    """``text.format`` as a structured-decoding constraint: ``TEXT`` for plain text asked
    for by name (it wins over a route's default format that is not enforced), None when
    left out."""
    if fmt.type == "text":
        return TEXT if "type" in fmt.model_fields_set else None
    if fmt.type == "json_object":
        return Constraint("json_object")
    if fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise InvalidRequest("text.format.schema is required for json_schema", param="text.format.schema")
        if not fmt.name:
            raise InvalidRequest("text.format.name is required for json_schema", param="text.format.name")
        if not FORMAT_NAME.fullmatch(fmt.name):
            raise InvalidRequest(
                "text.format.name must be 1 to 64 letters, digits, '_' or '-'", param="text.format.name"
            )
        # chat's check (its ``$schema``'s draft, its size bounds, cached), so that a schema is
        # valid or not alike on both endpoints
        return Constraint("json", check_schema(fmt.schema_, "text.format.schema"))
    return None


def format_echo(fmt: TextFormat) -> dict[str, Any]:
    """``text.format`` as the Response object shows it."""
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    return {
        "type": "json_schema",
        "name": fmt.name,
        "schema": fmt.schema_,
        "description": fmt.description,
        "strict": fmt.strict,
    }


# -- GET /v1/responses/{id}/input_items: one page (the items: responses_events.input_items) --
def items_page(items: list[dict[str, Any]], query: dict[str, str]) -> dict[str, Any]:
    """One page of ``items`` as OpenAI lists them: ``order`` (``desc``, the default, or
    ``asc``), ``after`` and ``before`` (item ids: the page is the ``limit`` items just after
    the one, or just before the other, in that order), ``limit`` (1 to 100, default 20)."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("order must be 'asc' or 'desc'", param="order")
    raw_limit = query.get("limit", "20")
    if (
        not (raw_limit.isascii() and raw_limit.isdigit() and len(raw_limit) <= 3)
        or not 1 <= int(raw_limit) <= 100
    ):
        raise InvalidRequest("limit must be an integer from 1 to 100", param="limit")
    ordered = items if order == "asc" else items[::-1]
    ids = [item["id"] for item in ordered]
    start, end = 0, len(ordered)
    for cursor in ("after", "before"):
        value = query.get(cursor)
        if value is None:
            continue
        if value not in ids:
            raise InvalidRequest(f"no input item of this response has the id '{value[:80]}'", param=cursor)
        if cursor == "after":
            start = ids.index(value) + 1
        else:
            end = ids.index(value)
    ordered = ordered[start:end]
    limit = int(raw_limit)
    page = ordered[-limit:] if "before" in query and "after" not in query else ordered[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(ordered) > len(page),
    }
