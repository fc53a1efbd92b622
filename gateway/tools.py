"""Tool calling: the wire models of ``tools`` and ``tool_choice``, the checks on them, the
grammar that forced calls are generated under, and the parser that reads ``auto`` answers.

- ``plan_tools(request)`` checks the request (400 with ``param``) and returns a ``ToolPlan``:
  ``none`` (plain text), ``auto`` (the model may answer with a call; the route's parser reads
  it), ``required`` or ``named`` (generated under a JSON schema ``Constraint``, so the calls
  always parse and validate).
- Under ``named`` the model writes the arguments object itself (the grammar is the function's
  ``parameters`` schema); under ``required`` it writes a JSON list of ``{"name", "arguments"}``
  objects (one ``anyOf`` branch per tool; one item at most with ``parallel_tool_calls: false``),
  as vLLM's ``get_json_schema_from_tools`` does.
- ``parse_calls(text, names)`` is the ``json`` tool parser: a JSON object ``{"name": ...,
  "arguments": {...}}`` (or a list of them) is a call to an offered tool: at the start of an
  answer (bare or in a fenced block, ```tool_call or ```json; text after it is content), or
  on lines of its own that end an answer after text (as the tool template writes a turn with
  both); any other text is plain content. ``settled_content`` tells a stream how much of an
  answer that opened with text is content already.

No vllm here; the chat template that shows the tools to the model is
``configs/templates/gemma-tools.jinja``.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache, lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import jsonschema
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)
from referencing.exceptions import Unresolvable

from gateway.errors import InvalidRequest
from gateway.schema_regex import bounded_validator, python_patterns, regex_budget
from gateway.structured import open_object, schema_problem, schema_size_problem
from gateway.types import Constraint

if TYPE_CHECKING:
    from gateway.protocol import ChatCompletionRequest, Message

TOOL_TEMPLATE_PATH = Path(__file__).resolve().parent.parent / "configs" / "templates" / "gemma-tools.jinja"


ToolMode = Literal["none", "auto", "required", "named"]
# The offered functions' names; a mapping gives a strict one's arguments validator.
Names = Collection[str] | Mapping[str, "jsonschema.protocols.Validator | None"]


# -- wire models -------------------------------------------------------------------------
class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # as the client sent it (``is_strict``: what it means)

    @property
    def is_strict(self) -> bool:
        """Whether its calls must follow ``parameters``: on chat, where it says ``strict: true``."""
        return bool(self.strict)

    def offered(self) -> dict[str, Any]:
        """The function as vLLM's server hands it to the chat template: ``description`` and
        ``parameters`` always, null where not given (a template that writes the tool as JSON
        shows them), ``strict`` only where the client sent it."""
        out: dict[str, Any] = {
            "name": self.name,
            "description": self.description,
            "parameters": self.parameters,
        }
        if self.strict is not None:
            out["strict"] = self.strict
        return out


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionDef
    # OpenAI's tool search: a deferred tool stays hidden from the model until a search finds
    # it. This gateway has no tool search and shows every tool, so ``true`` is refused.
    defer_loading: bool | None = None


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall


def _one_tool_choice_error(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    # One message at ``tool_choice`` rather than one per branch of the union.
    try:
        return handler(value)
    except ValidationError:
        raise ValueError(
            'must be \'none\', \'auto\', \'required\' or {"type": "function", "function": {"name": ...}}'
        ) from None


ToolChoice = Annotated[
    Literal["none", "auto", "required"] | NamedToolChoice, WrapValidator(_one_tool_choice_error)
]


# -- the plan ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ToolPlan:
    mode: ToolMode
    tools: tuple[FunctionDef, ...] = ()
    named: str | None = None  # the function forced by a named tool_choice
    constraint: Constraint | None = None
    parallel: bool = True  # False: one call at most
    # ``auto`` with a format (``answer_or_calls_schema``): the answer is one JSON value, read
    # as calls only in the grammar's call shape; the grammar, not a validator, decides them.
    formatted: bool = False
    # Each offered function's name, with a validator of its arguments where it is ``strict``:
    # an ``auto`` answer's call to it is a call only if its arguments validate (OpenAI's
    # promise for strict functions; the grammar leaves ``auto`` free). Made once: a stream
    # reads it at every step.
    names: dict[str, jsonschema.protocols.Validator | None] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        names = {t.name: None if self.formatted else _strict_validator(t) for t in self.tools}
        object.__setattr__(self, "names", names)

    @property
    def first_name(self) -> str | None:
        """The first call's name when it is known before any token: a named function, or
        the only one offered under ``required`` (the grammar allows no other)."""
        if self.mode == "named":
            return self.named
        return self.tools[0].name if self.mode == "required" and len(self.tools) == 1 else None

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The ``tools`` argument of the chat template (None: render as a plain chat). Under
        ``none`` too: OpenAI's ``none`` only stops calls, the definitions stay in context,
        and vLLM's server renders them (``--exclude-tools-when-tool-choice-none`` is off)."""
        return offered_tools(self.tools)


NO_TOOLS = ToolPlan("none")


def offered_tools(functions: Sequence[FunctionDef]) -> list[dict[str, Any]] | None:
    """The chat template's ``tools`` argument for these functions (None: none offered), each
    as vLLM's server renders it (``FunctionDef.offered``), so that a prompt is vLLM's."""
    if not functions:
        return None
    return [{"type": "function", "function": f.offered()} for f in functions]


def plan_tools(request: ChatCompletionRequest) -> ToolPlan:
    """Check the tool fields and the tool turns of ``request``; 400 (with ``param``) if wrong."""
    check_tool_messages(request.messages)
    for i, tool in enumerate(request.tools or ()):
        if tool.defer_loading:
            raise InvalidRequest(
                "defer_loading is not supported: this gateway has no tool search and shows every "
                "tool to the model; leave it out or set it to false",
                param=f"tools[{i}].defer_loading",
            )
    tools = tuple(t.function for t in request.tools or ())
    choice = request.tool_choice
    if choice is not None and not tools:
        raise InvalidRequest("'tool_choice' is only allowed when 'tools' are specified", param="tool_choice")
    _check_tools(tools, compiled_together=choice == "required")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolPlan("none", tools)
    if choice == "auto":
        return ToolPlan("auto", tools, parallel=request.parallel_tool_calls is not False)
    if choice == "required":
        return ToolPlan(
            "required", tools, constraint=Constraint("json", calls_schema(tools, request.parallel_tool_calls))
        )
    by_name = {t.name: t for t in tools}
    fn = by_name.get(choice.function.name)
    if fn is None:
        raise InvalidRequest(
            f"tool_choice names the function '{choice.function.name[:64]}', which is not in 'tools'",
            param="tool_choice",
        )
    return ToolPlan("named", tools, named=fn.name, constraint=Constraint("json", arguments_schema(fn)))


def _check_tools(tools: tuple[FunctionDef, ...], *, compiled_together: bool) -> None:
    # Checked together (the meta-schema check's cost), and under ``required`` compiled as one
    # grammar: bounded together, optional properties too only where they are compiled.
    schemas = [fn.parameters for fn in tools if fn.parameters is not None]
    too_big = schema_size_problem(schemas, compiled=compiled_together)
    if too_big is not None:
        raise InvalidRequest(f"tools: the functions' parameters together: {too_big}", param="tools")
    seen: set[str] = set()
    for i, fn in enumerate(tools):
        if fn.name in seen:
            raise InvalidRequest(f"tools: the function name '{fn.name}' appears twice", param="tools")
        seen.add(fn.name)
        if fn.parameters is None:
            continue
        try:
            problem = schema_problem(fn.parameters)
        except RecursionError:
            message = f"tools[{i}].function.parameters is nested too deeply"
            raise InvalidRequest(message, param="tools") from None
        if problem is not None:
            where, why = problem
            raise InvalidRequest(
                f"tools[{i}].function.parameters is not a valid JSON schema"
                f"{f' at {where}' if where else ''}: {why}",
                param="tools",
            )
        if fn.parameters.get("type", "object") != "object":
            raise InvalidRequest(
                f"tools[{i}].function.parameters must describe an object (type 'object')", param="tools"
            )


class UnansweredCall(InvalidRequest):
    """Tool calls of which some have no ``tool`` message before the next message; the
    Responses API says it in its own words (``responses_api.rename_param``)."""

    def __init__(self, index: int, call_ids: list[str]) -> None:
        super().__init__(
            f"messages[{index}]: an assistant message with 'tool_calls' must be followed by tool "
            f"messages answering each call (unanswered: {', '.join(sorted(call_ids))[:200]})",
            param="messages",
        )
        self.call_ids = call_ids  # in the order of the calls


class UnknownCallAnswered(InvalidRequest):
    """A ``tool`` message answering no open call; the Responses API says it in its own words
    (``responses_api.rename_param``)."""

    def __init__(self, index: int, call_id: str) -> None:
        super().__init__(
            f"messages[{index}]: a 'tool' message must answer a tool call of an earlier assistant "
            f"message; no call has the id '{call_id[:64]}'",
            param="messages",
        )
        self.call_id = call_id


def check_tool_messages(messages: list[Message], *, answered_at_end: bool = True) -> None:
    """Tool turns as OpenAI requires them: ``tool_calls`` only on assistant messages, each
    ``tool`` message answering an earlier call by ``tool_call_id``, every call answered, the
    last ones too (OpenAI's 400 whether a user message or the end of the list comes first:
    a model answering after an unanswered call would answer a conversation the caller did not
    mean). ``answered_at_end=False`` (``/tokenize``, which generates nothing) lets the
    messages end in calls not answered yet."""
    open_ids: dict[str, None] = {}  # the calls not answered yet, in order
    called_at = 0  # the index of the assistant message that made them
    for i, m in enumerate(messages):
        if m.tool_calls and m.role != "assistant":
            raise InvalidRequest(
                f"messages[{i}]: only assistant messages may carry tool_calls", param="messages"
            )
        if m.role == "tool":
            if not m.tool_call_id:
                raise InvalidRequest(
                    f"messages[{i}]: a 'tool' message needs a 'tool_call_id'", param="messages"
                )
            if m.tool_call_id not in open_ids:
                raise UnknownCallAnswered(i, m.tool_call_id)
            open_ids.pop(m.tool_call_id)
            continue
        if open_ids:
            raise UnansweredCall(called_at, list(open_ids))
        if m.tool_calls:
            open_ids = dict.fromkeys(c.id for c in m.tool_calls)
            called_at = i
    if open_ids and answered_at_end:
        raise UnansweredCall(called_at, list(open_ids))


def template_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """The messages as the chat template reads them, tool fields included; a tool message
    gets the ``name`` of the function whose call it answers, another its own ``name`` where it
    has one (as vLLM passes it: Gemma's template ignores it, a route's own may read it)."""
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.text}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = [_template_call(c) for c in m.tool_calls]
            names.update((c.id, c.function.name) for c in m.tool_calls)
        if m.role == "tool":
            d["tool_call_id"] = m.tool_call_id
            d["name"] = names.get(m.tool_call_id or "", m.name)
        out.append(d)
    return out


def _template_call(call: ToolCall) -> dict[str, Any]:
    """A call of the history as vLLM hands it to the template: its ``arguments`` an object
    (Hugging Face's tool templates write it with ``tojson``), ``{}`` where the text is no
    JSON object (as vLLM coerces it: the history stays usable)."""
    out = call.model_dump()
    try:
        arguments = json.loads(call.function.arguments) if call.function.arguments else {}
    except (ValueError, RecursionError):
        arguments = {}
    out["function"]["arguments"] = arguments if isinstance(arguments, dict) else {}
    return out


def uses_tools(plan: ToolPlan, messages: list[Message]) -> bool:
    """Whether the prompt needs a tool-aware template: tools offered, or tool turns in history."""
    return plan.template_tools() is not None or any(m.tool_calls or m.role == "tool" for m in messages)


# -- schemas -----------------------------------------------------------------------------
def arguments_schema(fn: FunctionDef) -> dict[str, Any]:
    """The schema of one call's arguments: the function's parameters (any object if none), an
    object in any case: OpenAI's arguments are one, and clients send ``parameters: {}`` or a
    schema without ``type`` (which alone would let 5, "x" or null through)."""
    if fn.parameters is None:
        return {"type": "object", "properties": {}}
    return _an_object(fn.parameters)


def _an_object(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with ``type: object`` if it has no ``type``, and so the branches of its
    ``anyOf``: xgrammar follows those and ignores a ``type`` beside them."""
    if "type" in schema:
        return schema
    out = {"type": "object", **schema}
    if isinstance(schema.get("anyOf"), list):
        out["anyOf"] = [_an_object(b) if isinstance(b, dict) else b for b in schema["anyOf"]]
    return out


def calls_schema(tools: tuple[FunctionDef, ...], parallel: bool | None) -> dict[str, Any]:
    """A JSON list of one or more calls, each ``{"name": <one tool>, "arguments": <its schema>}``.
    Each tool's schema is ``$defs/<its name>``, its own ``$defs`` and ``definitions`` beside it
    (``$defs/<its name>.defs.<key>``, ``.definitions.<key>``), and its references that start
    at its root (``#``, ``#/...``) point there: the list's root is not the tool's."""
    defs: dict[str, Any] = {}
    branches = []
    for fn in tools:
        branches.append(_decoded_call(fn, defs))
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if parallel is False:
        schema["maxItems"] = 1
    schema["$defs"] = defs
    return schema


def _decoded_call(fn: FunctionDef, defs: dict[str, Any]) -> dict[str, Any]:
    """A call to ``fn`` with its arguments decoded against its schema, lifted into ``defs``."""
    defs.update(_lifted(fn.name, arguments_schema(fn)))
    return _call([fn.name], {"$ref": f"#/$defs/{fn.name}"})


def _call(names: list[str], arguments: dict[str, Any]) -> dict[str, Any]:
    """One call as the ``json`` parser reads it: one of ``names``, with ``arguments``."""
    return {
        "type": "object",
        "properties": {"name": {"type": "string", "enum": names}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


# The answer's own schema among the calls' $defs: a tool name has no dot, so no tool's
# entries (``<tool>``, ``<tool>.defs.<key>``) can meet it.
_ANSWER = "answer.schema"


def answer_or_calls_schema(
    tools: tuple[FunctionDef, ...], parallel: bool, answer: dict[str, Any], decoded: Collection[str] = ()
) -> dict[str, Any]:
    """Under ``tool_choice: auto`` with a JSON-schema response format: the answer in that
    format, or calls (one call object, or a list of them), as OpenAI lets the model do
    either; the format alone would leave no room for a call. The functions named in
    ``decoded`` (the strict ones whose schema the grammar backend holds) have their
    arguments decoded against their parameters; the others' are any JSON object, as under
    ``auto`` without a format (read, not decoded, so their schemas cannot fail the format).
    What the grammar wrote in the call shape is a call (``ToolPlan.formatted``)."""
    defs = _lifted(_ANSWER, answer)
    loose: list[str] = []
    held: list[dict[str, Any]] = []
    for fn in tools:
        if fn.name in decoded:
            held.append(_decoded_call(fn, defs))
        else:
            loose.append(fn.name)
    branches = ([_call(loose, {"type": "object"})] if loose else []) + held
    calls: dict[str, Any] = {"type": "array", "minItems": 1}
    calls["items"] = branches[0] if len(branches) == 1 else {"anyOf": branches}
    if not parallel:
        calls["maxItems"] = 1
    return {"anyOf": [{"$ref": f"#/$defs/{_ANSWER}"}, *branches, calls], "$defs": defs}


def in_answer_terms(message: str) -> str:
    """A message about ``answer_or_calls_schema``'s schema, with the places in the answer's
    own schema named as the client wrote them."""
    return (
        message.replace(f"$defs/{_ANSWER}.defs.", "$defs/")
        .replace(f"$defs/{_ANSWER}.definitions.", "definitions/")
        .replace(f"(at $defs/{_ANSWER})", "(at the top)")
        .replace(f"$defs/{_ANSWER}/", "")
    )


_DEF_MAPS = {"$defs": "defs", "definitions": "definitions"}
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "dependentSchemas", *_DEF_MAPS})
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})  # values, not schemas


def _lifted(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """A tool's schema as ``$defs`` entries of the calls list: itself under ``name`` (less its
    ``$id`` and ``$schema``: it is no document root any more), each schema of its ``$defs`` and
    ``definitions`` under ``name.defs.<key>`` / ``name.definitions.<key>`` (a tool name has no
    dot, so no two tools' entries meet), every root-relative ``$ref`` rewritten to match."""
    root = {k: v for k, v in params.items() if k not in _DEF_MAPS and k not in ("$id", "$schema")}
    out = {name: open_object(_rebased(root, name))}
    for where, short in _DEF_MAPS.items():
        found = params.get(where)
        for key, sub in (found if isinstance(found, dict) else {}).items():
            out[f"{name}.{short}.{key}"] = open_object(_rebased(sub, name))
    return out


def _rebased(schema: Any, name: str) -> Any:
    if isinstance(schema, list):
        return [_rebased(s, name) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str):
            out[key] = _moved_ref(value, name)
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: _rebased(v, name) for k, v in value.items()}
        else:
            out[key] = value if key in _DATA_KEYWORDS else _rebased(value, name)
    return out


def _moved_ref(ref: str, name: str) -> str:
    """``ref`` of the tool ``name`` as the calls list resolves it (see ``_lifted``). The key's
    segment is kept as written (escaped or not), so it names the lifted entry as it named the
    original."""
    if ref == "#":
        return f"#/$defs/{name}"
    if not ref.startswith("#/"):
        return ref  # an anchor or another document: left as it is
    parts = ref[2:].split("/", 2)
    if parts[0] in _DEF_MAPS and len(parts) > 1:
        rest = "".join(f"/{p}" for p in parts[2:])
        return f"#/$defs/{name}.{_DEF_MAPS[parts[0]]}.{parts[1]}{rest}"
    return f"#/$defs/{name}{ref[1:]}"


# -- model text -> calls -----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON text, as OpenAI sends it


_FENCE = re.compile(r"\s*```(?:tool_call|tool_code|json)?[ \t]*\n?(.*?)```", re.DOTALL)
CALL_OPENERS = ("{", "[", "`")  # an auto answer that starts otherwise opens with text
_LINE = re.compile(r"\n\s*(\S)")  # a line's first character
_NON_BLANK = re.compile(r"\S")


def parse_calls(text: str, names: Names) -> tuple[str | None, list[ParsedCall]]:
    """The ``json`` parser: (content, calls) of an ``auto`` answer. A call is a JSON object
    ``{"name": <an offered tool>, "arguments": {...}}`` (``parameters`` is read too) or a
    list of them.

    - An answer that starts with calls is read as them: bare or in fenced blocks
      (```tool_call, ```json), one after another; text after them is content.
    - Text, then calls (bare JSON) on lines of their own that end the answer, as the tool
      template writes an assistant turn with both: the text is content, then the calls.

    Anything else is plain content, as it came."""
    calls, end = _leading_calls(text, names)
    if calls:
        return text[end:].strip() or None, calls
    for line in _LINE.finditer(text):
        start = line.start(1)
        calls, end, tail = _json_calls(text, start, names)
        if calls and tail == "end":
            return text[:start].rstrip(), calls
    return text, []


def may_open_calls(parser: str, text: str) -> bool:
    """Whether an ``auto`` answer may yet be read as calls from its start, so a stream holds it
    back: only where the route's parser reads calls (under ``tool_parser: none`` every answer
    is text, and streams as it comes)."""
    return parser == "json" and text.lstrip().startswith(CALL_OPENERS)


def settled_content(text: str, names: Names, checked: int = 0) -> tuple[int, int]:
    """For an ``auto`` answer that opened with text (not ``CALL_OPENERS``), being streamed:
    ``text[:end]`` is content whatever comes next, as ``parse_calls`` will read the whole:
    all but trailing blanks, up to the first line that is, or may yet become, calls that end
    the answer. Returns ``(end, checked)``: lines before ``checked`` can no longer be calls;
    pass it back with the longer text."""
    for line in _LINE.finditer(text, checked):
        start = line.start(1)
        if _json_calls(text, start, names)[2] != "other":
            return _before_blanks(text, start), line.start()
        checked = line.end()
    return _before_blanks(text, len(text)), checked


def _before_blanks(text: str, end: int) -> int:
    """``len(text[:end].rstrip())``, without copying the text (a stream asks at every token)."""
    while end and text[end - 1].isspace():
        end -= 1
    return end


def _leading_calls(text: str, names: Names) -> tuple[list[ParsedCall], int]:
    """The calls an answer opens with, bare or fenced, one after another; where they end."""
    calls: list[ParsedCall] = []
    pos = 0
    while True:
        fence = _FENCE.match(text, pos)
        block = _calls_of(fence.group(1).strip(), names) if fence else []
        if fence and block:
            calls.extend(block)
            pos = fence.end()
            continue
        found, end, _ = _json_calls(text, pos, names)
        if not found:
            return calls, pos
        calls.extend(found)
        pos = end


def _json_calls(text: str, pos: int, names: Names) -> tuple[list[ParsedCall], int, str]:
    """The calls written as bare JSON values from ``pos`` on, one after another; where they
    end; and what follows: ``end`` (only blanks), ``partial`` (a JSON value cut short, which
    more text may make a call) or ``other``."""
    calls: list[ParsedCall] = []
    while True:
        first = _NON_BLANK.search(text, pos)
        if first is None:
            return calls, pos, "end"
        start = first.start()
        if text[start] not in "[{":
            return calls, pos, "other"
        try:
            value, end = _STRICT.raw_decode(text, start)
        except json.JSONDecodeError as exc:
            return calls, pos, "partial" if _cut_short(text, exc) else "other"
        except (ValueError, RecursionError):  # NaN, 1e999; nested absurdly deep
            return calls, pos, "other"
        found = _calls_in(value, names)
        if not found:
            return calls, pos, "other"
        calls.extend(found)
        pos = end


def _cut_short(text: str, exc: json.JSONDecodeError) -> bool:
    """Whether JSON that failed to parse may only be cut short: the error is at its last
    token (a literal, number or string still being written), or at its very end."""
    return exc.msg.startswith("Unterminated string") or not any(c.isspace() for c in text[exc.pos :])


def _calls_of(text: str, names: Names) -> list[ParsedCall]:
    """The calls a text holds as one JSON value (a fenced block's)."""
    if not text or text[0] not in "[{":
        return []
    try:
        value = _STRICT.decode(text)
    except (ValueError, RecursionError):  # an answer nested absurdly deep is no call
        return []
    return _calls_in(value, names)


def _formatted_calls(text: str, names: Names) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of an answer made under ``answer_or_calls_schema``: one JSON value,
    calls only where each is exactly ``{"name", "arguments": {...}}`` (the grammar's call
    shape: an answer in the format that holds a tool's name is the answer), else content."""
    try:
        value = _STRICT.decode(text)
    except (ValueError, RecursionError):  # cut short (max_tokens): the answer as far as it got
        return text, []
    items = value if isinstance(value, list) else [value]
    shaped = all(isinstance(i, dict) and i.keys() == {"name", "arguments"} for i in items)
    calls = _calls_in(value, names) if items and shaped else []
    return (None, calls) if calls else (text, [])


def _calls_in(value: Any, names: Names) -> list[ParsedCall]:
    """A call object, or a list of them, as calls; [] if anything in it is not one (a strict
    function's arguments that do not validate included)."""
    with regex_budget():  # the strict schemas' regexes, over all of the answer's calls
        return _each_call_in(value, names)


def _each_call_in(value: Any, names: Names) -> list[ParsedCall]:
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or item["name"] not in names:
            return []  # an answer's {"name": [...]} is no call (nor a 500: a list is unhashable)
        args = item.get("arguments", item.get("parameters", {}))
        try:
            if isinstance(args, str):  # some models write the arguments as a JSON string
                args = _STRICT.decode(args)
            if not isinstance(args, dict):
                return []
            strict = names.get(item["name"]) if isinstance(names, Mapping) else None
            if strict is not None and not strict.is_valid(args):  # RegexTooSlow: a ValueError
                return []
            calls.append(ParsedCall(item["name"], json.dumps(args, ensure_ascii=False, allow_nan=False)))
        except (ValueError, RecursionError, ArithmeticError, Unresolvable):
            # ArithmeticError: ``multipleOf`` on a huge integer; Unresolvable: a strict schema's
            # ``$ref`` to nowhere. Arguments that cannot be shown valid are no strict call.
            return []
    return calls


@lru_cache(maxsize=256)
def _validator_for(text: str) -> jsonschema.protocols.Validator:
    schema = json.loads(text)
    if "(?<" in text:  # an ECMA-262 named group, which Python's re spells (?P<
        schema = python_patterns(schema)
    # An empty registry: a remote $ref is Unresolvable (no call), never fetched from here. Its
    # regexes run against the model's text under a time bound (``schema_regex.bounded_validator``).
    return bounded_validator(schema)


def _strict_validator(fn: FunctionDef) -> jsonschema.protocols.Validator | None:
    """A validator of ``fn``'s arguments if it is strict (cached by its schema's text: an
    app sends the same tools with every request); None if it is not."""
    if not fn.is_strict:
        return None
    return _validator_for(json.dumps(fn.parameters or {}, sort_keys=True))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text} is out of range")
    return value


# JSON as RFC 8259 has it: json.loads reads NaN and Infinity, and 1e999 as infinity, which
# json.dumps then writes as arguments that are not JSON.
_STRICT = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite)


# The head of the next call in a ``required`` answer; the grammar writes "name" first.
_CALL_HEAD = re.compile(
    r'\s*(?:\}\s*)?[\[,]\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*'
)


class RequiredCallScanner:
    """Reads a ``required`` answer (``[{"name": ..., "arguments": {...}}, ...]``) as it grows:
    ``feed`` returns ``("name", name, k)`` when call ``k``'s name is complete, then
    ``("arguments", fragment, k)`` pieces of its arguments object as they are generated, from
    its opening brace (blanks before it are not the arguments'), so that the fragments of a
    stream add up to what the whole text gives. One piece may end a call and begin the next:
    each event carries its own call's index."""

    def __init__(self) -> None:
        self.text = ""
        self.calls = 0  # calls whose name went out
        self._pos = 0  # where scanning resumes
        self._in_args = False
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, piece: str) -> list[tuple[str, str, int]]:
        self.text += piece
        out: list[tuple[str, str, int]] = []
        while True:
            if not self._in_args:
                head = _CALL_HEAD.match(self.text, self._pos)
                if head is None:
                    return out
                out.append(("name", json.loads(head.group(1)), self.calls))
                self.calls += 1
                self._pos, self._in_args, self._depth = head.end(), True, 0
            while self._depth == 0 and self._pos < len(self.text) and self.text[self._pos].isspace():
                self._pos += 1  # blanks between the colon and the arguments
            start = self._pos
            done = self._scan()
            if self._pos > start:
                out.append(("arguments", self.text[start : self._pos], self.calls - 1))
            if not done:
                return out
            self._in_args = False

    def _scan(self) -> bool:
        """Advance over the arguments object; True when it has closed."""
        text = self.text
        for i in range(self._pos, len(text)):
            ch = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._pos = i + 1
                    return True
        self._pos = len(text)
        return False


def parse_required(text: str) -> list[ParsedCall]:
    """The calls of a ``required`` answer (a list under the grammar), as the stream sends
    them: each call whose name is complete, with its arguments as generated (cut short by
    ``max_tokens``, the last one's as far as they got, as OpenAI does). Not parsed and
    written again: ``1e999`` would come back as ``Infinity``, which is not JSON."""
    calls: list[list[str]] = []
    for kind, piece, _ in RequiredCallScanner().feed(text):
        if kind == "name":
            calls.append([piece, ""])
        else:
            calls[-1][1] += piece
    return [ParsedCall(name, arguments) for name, arguments in calls]


def calls_of_answer(plan: ToolPlan, text: str, parser: str) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of one finished choice under ``plan``; ``parser`` is the route's."""
    if plan.mode == "named" and plan.named is not None:
        return None, [ParsedCall(plan.named, text)]
    if plan.mode == "required":
        calls = parse_required(text)
        if not calls and plan.first_name is not None:  # the stream announced it before any token
            calls = [ParsedCall(plan.first_name, "")]
        return (None, calls) if calls else (text, [])
    if plan.mode == "auto" and parser == "json":
        read = _formatted_calls if plan.formatted else parse_calls
        content, calls = read(text, plan.names)
        return content, calls if plan.parallel else calls[:1]
    return text, []


def calls_lead(plan: ToolPlan, text: str, parser: str) -> bool:
    """Whether ``calls_of_answer`` reads ``text`` as calls that came before its content (an
    ``auto`` answer that opened with them): a Response lists its items in that order."""
    return plan.mode == "auto" and parser == "json" and bool(_leading_calls(text, plan.names)[0])


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_dict(call: ParsedCall, call_id_: str | None = None) -> dict[str, Any]:
    return {
        "id": call_id_ or call_id(),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


@cache
def tool_template() -> str:
    """The built-in tool-aware Gemma template (read once)."""
    return TOOL_TEMPLATE_PATH.read_text()
